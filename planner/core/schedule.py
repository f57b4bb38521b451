"""A plan lowered once into explicit events per graph position (torch-free), as Checkmate's
``schedule_from_rs`` lowers its R/S matrices and Rockmate's op schedules are both what its simulator sums
and what its runtime runs.

    sched = schedule(graph, plan)
    for ev in sched.events: ...            # compute, d2h, free, h2d, wait, replay, backward, optimizer

Event kinds (``ScheduleEvent.kind``), each at a graph position ``at`` (the forward op id in forward, the
backward step's op id in backward, None for the optimizer step):

* ``compute``: forward op ``at`` runs (its new outputs are allocated);
* ``d2h``: ``tensor`` (offloaded) is copied to host right after its producer ``at``;
* ``free``: ``tensor`` leaves the device after position ``at`` (its last forward use, its D2H copy's end,
  its last backward reader, the end of a replay that no longer needs it, or a pin's last reader);
* ``h2d``: ``tensor`` is copied back to the device at backward step ``at`` (``reason``: scheduled by the
  plan, late because the step needs it, or needed by a replay);
* ``wait``: compute waits for ``tensor``'s copy back before step ``at`` reads it (exposed transfer time);
* ``replay``: to rebuild ``tensor`` for backward step ``at`` the ops ``ops`` run in forward order
  (:func:`memplan.planner.core.replay.replay` decides them);
* ``backward``: backward step ``at`` runs;
* ``optimizer``: the optimizer step.

When copies end decides what is resident (an offloaded tensor is released at the first op boundary after
its copy ends, and a prefetch of a tensor still on the device moves nothing), so the lowering is the
simulator's timed pass: :func:`schedule` records the events that pass takes, and
:func:`memplan.planner.core.simulator.simulate` scores the same pass. The executor logs what it performs in
this vocabulary (``Executor.last_step.events``), and :meth:`Schedule.executed` is the part of a
schedule that a run performs observably (compute, d2h, h2d, replay), for comparison event for event.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Plan

EventKind = Literal["compute", "d2h", "free", "h2d", "wait", "replay", "backward", "optimizer"]
Phase = Literal["forward", "backward", "optimizer"]

#: kinds an executor performs as explicit actions (frees happen when references go; waits and backward
#: steps belong to the device and to autograd)
EXECUTED_KINDS = ("compute", "d2h", "h2d", "replay")


@dataclass(frozen=True)
class ScheduleEvent:
    """One event of a schedule. ``tensor``: the tensor it moves, frees or rebuilds (None for compute);
    ``ops``: a replay's ops in forward order; ``reason``: why it happens, in words."""

    kind: EventKind
    phase: Phase
    at: int | None
    tensor: int | None = None
    ops: tuple[int, ...] = ()
    reason: str = ""

    def key(self) -> tuple:
        """What identifies the event across the simulator and the executor: kind, tensor, ops, and the
        position where the executor knows it (forward ops; prefetches the plan schedules)."""
        at = self.at if self.kind == "compute" or (self.kind == "h2d" and self.reason.startswith("scheduled")) \
            else None
        return (self.kind, at, self.tensor, self.ops)


@dataclass(frozen=True)
class Schedule:
    """A plan lowered for one graph: ``events`` in execution order; ``prefetch_at`` (offloaded tensor ->
    backward step at which its copy back is scheduled, defaults resolved); ``pins`` (activation that
    cannot be rebuilt but that a replay reads -> the lowest backward step whose replay reads it: held
    from its production until that step has run)."""

    graph_fingerprint: str
    events: tuple[ScheduleEvent, ...]
    prefetch_at: dict[int, int] = field(default_factory=dict)
    pins: dict[int, int] = field(default_factory=dict)

    def of(self, kind: EventKind) -> list[ScheduleEvent]:
        return [e for e in self.events if e.kind == kind]

    def executed(self) -> list[tuple]:
        """Keys (:meth:`ScheduleEvent.key`) of the events an executor performs, in order."""
        return [e.key() for e in self.events if e.kind in EXECUTED_KINDS]

    def replays(self) -> list[ScheduleEvent]:
        return self.of("replay")


def schedule(graph: Graph, plan: Plan | None = None, *, check: bool = True) -> Schedule:
    """Lower ``plan`` (keep everything when None) on ``graph`` into a :class:`Schedule`. Raises
    :class:`memplan.planner.core.errors.PlanError` / ``PlanMismatch`` as :func:`simulate` does."""
    from memplan.planner.core.simulator import lower  # the lowering is the simulator's timed pass

    return lower(graph, plan, check=check)
