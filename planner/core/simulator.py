"""The simulator: scores one training step of a graph under a plan, peak device memory and step time. It
is the single source of truth: every solver's plan is scored by :func:`simulate` (or
:func:`simulate_actions`, the same without a Plan object).

It works in two pieces, as Checkmate's ``schedule_from_rs`` and its memory accounting do:

    plan --schedule()--> Schedule (events) --score()--> Report

* :func:`memplan.planner.core.schedule.schedule` lowers the plan: it runs the step on the compute clock
  and the copy stream and takes every timing decision (when a copy to host ends and so where its free
  goes, when prefetches start, which waits are exposed, what each replay runs), emitting events that
  carry what they cost (bytes allocated, held while running, freed; time on the compute stream; bytes
  copied; host memory). The executor follows the same schedule.
* :func:`score` walks those events in order and sums: ``live`` starts at ``graph.fixed.resident_bytes``;
  a step (forward op, replayed op, backward step, optimizer step) allocates, peaks at ``live`` plus its
  workspace, advances the clock by its duration and releases; a free releases; a prefetch allocates its
  buffer (a peak candidate); a wait advances the clock by its exposed time. It decides nothing.

:func:`simulate` is ``score(graph, schedule(graph, plan))``. The cost model is stated in docs/model.md.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from memplan.planner.core.errors import PlanMismatch
from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Action, Plan
from memplan.planner.core.schedule import (
    Schedule,
    ScheduleEvent,
    StaticFacts,
    default_prefetch_at,
    schedule,
    schedule_actions,
    static_facts,
)
from memplan.planner.core.states import HOST_WAIT

# the per-graph facts and default prefetch points live with the lowering; solvers and the executor import
# them from here too
__all__ = ["Event", "Report", "StaticFacts", "default_prefetch_at", "score", "simulate", "simulate_actions",
           "static_facts"]


class Event(BaseModel):
    """One step of the replay. ``live_bytes`` is what is live after it, ``peak_bytes`` the most during."""

    model_config = ConfigDict(frozen=True)

    phase: str = Field(description="forward | backward | recompute | prefetch | wait | optimizer")
    op: int | None
    start_s: float
    live_bytes: int
    peak_bytes: int
    note: str = ""


class Report(BaseModel):
    """What :func:`simulate` predicts for one training step."""

    peak_bytes: int = Field(description="highest device memory of the step, fixed memory included")
    time_s: float = Field(description="step time: forward + backward + recompute + exposed transfers + optimizer")
    forward_time_s: float
    backward_time_s: float
    recompute_time_s: float
    exposed_transfer_s: float = Field(description="time compute waited for prefetches")
    optimizer_time_s: float
    host_optimizer_time_s: float = Field(0.0, description="the host's optimizer steps of host-stepped units (host "
                                                          "time, beside the device's: not in time_s)")
    host_wait_s: float = Field(0.0, description="time compute waited for the host's steps and their parameters' "
                                                "copies back (in time_s)")
    transfer_bytes: int = Field(description="bytes moved device->host plus host->device")
    host_peak_bytes: int = Field(description="most host (pinned) memory held by offloaded activations and "
                                             "streamed optimizer state")
    fixed_bytes: int
    recomputed_ops: int = Field(description="op replays in backward")
    watched_ops: int = Field(0, description="forward ops the executor watches under the plan (planner/core/watch.py)")
    watch_time_s: float = Field(0.0, description="their dispatch, watched_ops x graph.watch_op_dispatch_s "
                                                 "(included in forward_time_s)")
    peak_phase: str
    peak_op: int | None
    peak_note: str
    timeline: list[Event] = Field(default_factory=list)

    def fits(self, budget_bytes: int | None) -> bool:
        return budget_bytes is None or self.peak_bytes <= budget_bytes


def simulate(graph: Graph, plan: Plan | None = None, *, timeline: bool = True, check: bool = True,
             fuse: str | None = None) -> Report:
    """Score one training step of ``graph`` under ``plan`` (keep everything when None):
    ``score(graph, schedule(graph, plan))``. ``fuse``: the step's optimizer updates fused into "backward"
    or "forward" (the executor's ``apply(..., fuse=)``): its measured cost (``graph.fused_extra_s``) and,
    forward, the executor's watch of the whole forward are charged.

    Returns a :class:`Report` with the peak device bytes, step time and its parts, and (with
    ``timeline=True``) one :class:`Event` per forward op, backward step, replayed op, prefetch and
    exposed wait. Raises :class:`PlanError` if the plan does not fit the graph (with ``check=True``) or
    asks to rebuild a tensor from one that cannot be recomputed.
    """
    return score(graph, schedule(graph, plan, check=check, fuse=fuse), timeline=timeline)


def simulate_actions(graph: Graph, actions: dict[int, Action], *, prefetch_at: dict[int, int] | None = None,
                     bandwidth_bytes_per_s: float | None = None, timeline: bool = False) -> Report:
    """:func:`simulate` for solvers' inner loops: ``{tensor id: action}`` instead of a Plan, unchecked."""
    sched = schedule_actions(graph, actions, prefetch_at=prefetch_at, bandwidth_bytes_per_s=bandwidth_bytes_per_s)
    return score(graph, sched, timeline=timeline)


#: the timeline phase of each kind of step
_STEP_PHASE = {"compute": "forward", "recompute": "recompute", "backward": "backward"}


def score(graph: Graph, sched: Schedule, *, timeline: bool = True) -> Report:
    """Sum a schedule's events (:mod:`memplan.planner.core.schedule`) into a :class:`Report`, in order and
    without looking at any plan: memory from each event's ``alloc_bytes``, ``workspace_bytes``,
    ``free_bytes`` and ``host_bytes``, time from its ``duration_s``, transfers from its ``copy_bytes``.
    The graph gives the fixed memory, the optimizer's and the watched ops' charges, and names for notes.

    The peak is the largest ``live`` (plus a running step's workspace); each timeline entry of a step
    records ``live`` after the step and the frees that follow it at its position (a ``d2h`` in between
    moves no device memory). Hand-edited events are scored as they are: a free moved later raises the
    memory in between. Raises :class:`PlanMismatch` for a schedule lowered on another graph."""
    if sched.graph_fingerprint != graph.fingerprint:
        raise PlanMismatch(f"schedule was lowered for graph {sched.graph_fingerprint}, but this graph is "
                           f"{graph.fingerprint} ({graph.name}): lower the plan on this graph")
    ops, tensors = graph.ops, graph.tensors
    # streamed optimizer state (planner/core/states.py) starts the step in the host pool
    fixed = graph.fixed.resident_bytes - sched.state_off_device_bytes
    live = fixed
    peak = live
    peak_event: ScheduleEvent | None = None  # the event at the peak (None: the start); named at the end
    now = forward_s = backward_s = recompute_s = exposed_s = watch_s = optimizer_s = host_s = host_wait_s = 0.0
    moved = replayed = watched = 0
    host = host_peak = sched.host_state_bytes
    entries: list[Event] = []
    # a step's entry stays open until an event at another position (or another step) comes:
    # (phase, at) of the step, and its timeline phase, op, start, peak candidate, note
    open_key: tuple | None = None
    open_entry: tuple = ()
    if timeline:
        entries.append(Event(phase="start", op=None, start_s=0.0, live_bytes=live, peak_bytes=live,
                             note="fixed memory"))
    for ev in sched.events:
        kind = ev.kind
        if kind == "free":
            if open_key is not None and (ev.phase, ev.at) != open_key:
                entries.append(_entry(*open_entry, live))
                open_key = None
            live -= ev.free_bytes
            host += ev.host_bytes
            continue
        if kind == "d2h":
            moved += ev.copy_bytes
            host += ev.host_bytes
            if host > host_peak:
                host_peak = host
            continue
        if open_key is not None:
            entries.append(_entry(*open_entry, live))
            open_key = None
        if kind in _STEP_PHASE:  # a forward op, a replayed op, a backward step
            start = now
            live += ev.alloc_bytes
            during = live + ev.workspace_bytes
            if during > peak:
                peak, peak_event = during, ev
            now += ev.duration_s
            live -= ev.free_bytes
            if kind == "compute":
                forward_s += ev.duration_s
            elif kind == "recompute":
                recompute_s += ev.duration_s
                replayed += 1
            else:
                backward_s += ev.duration_s
            if timeline:
                op = ev.ops[0] if kind == "recompute" else ev.at
                note = (f"recompute op {op} ({ops[op].name}) for op {ev.at}'s backward" if kind == "recompute"
                        else ops[op].name)
                open_key = (ev.phase, ev.at)
                open_entry = (_STEP_PHASE[kind], op, start, during, note)
        elif kind == "h2d":
            live += ev.alloc_bytes
            moved += ev.copy_bytes
            if live > peak:
                peak, peak_event = live, ev
            if timeline:
                what = f"tensor {ev.tensor}" if ev.tensor is not None else f"state unit {ev.at}"
                if ev.tensor is None and ev.alloc_bytes == 0:
                    what = f"state unit {ev.at}'s updated parameters"
                elif ev.tensor is None and ev.phase == "backward":
                    what = f"a unit's optimizer state for its update in backward, at backward step {ev.at}"
                entries.append(Event(phase="prefetch", op=tensors[ev.tensor].producer if ev.tensor is not None
                                     else None, start_s=now, live_bytes=live, peak_bytes=live,
                                     note=f"prefetch {what} ({ev.reason})"))
        elif kind == "host":  # the host's time, beside the compute stream's
            host_s += ev.duration_s
        elif kind == "wait":
            if ev.duration_s > 0 and ev.reason == HOST_WAIT:
                if timeline:
                    entries.append(Event(phase="wait", op=None, start_s=now, live_bytes=live, peak_bytes=live,
                                         note="wait for the host's optimizer steps and their parameters"))
                now += ev.duration_s
                host_wait_s += ev.duration_s
            elif ev.duration_s > 0:
                if timeline:
                    entries.append(Event(phase="wait", op=ev.at, start_s=now, live_bytes=live, peak_bytes=live,
                                         note=f"wait for prefetch of tensor {ev.tensor}" if ev.tensor is not None
                                         else f"wait for state unit {ev.at}'s copy ({ev.reason})"))
                now += ev.duration_s
                exposed_s += ev.duration_s
        elif kind == "watch":
            watched += len(ev.ops)
            watch_s += ev.duration_s
            now += ev.duration_s
        elif kind == "optimizer":  # the step, or a fused bucket's (or forward fusion's held gradients)
            start = now
            live += ev.alloc_bytes
            during = live + ev.workspace_bytes
            if during > peak:
                peak, peak_event = during, ev
            now += ev.duration_s
            optimizer_s += ev.duration_s
            live -= ev.free_bytes  # a fused bucket's gradients
            if timeline:
                entries.append(Event(phase="optimizer", op=ev.at, start_s=start, live_bytes=live,
                                     peak_bytes=max(during, live),
                                     note="optimizer step" if ev.phase == "optimizer" else ev.reason))
        # a replay event itself costs nothing: its recompute events do
    if open_key is not None:
        entries.append(_entry(*open_entry, live))
    if timeline and (sched.streamed or sched.hosted):  # the last streamed unit's buffers went after its copy back
        entries.append(Event(phase="optimizer", op=None, start_s=now, live_bytes=live, peak_bytes=live,
                             note="streamed optimizer state back in the host pool"))
    phase, op, note = _peak_site(graph, peak_event)
    return Report(
        peak_bytes=peak, time_s=now, forward_time_s=forward_s + watch_s, backward_time_s=backward_s,
        recompute_time_s=recompute_s, exposed_transfer_s=exposed_s, optimizer_time_s=optimizer_s,
        host_optimizer_time_s=host_s, host_wait_s=host_wait_s,
        transfer_bytes=moved, host_peak_bytes=host_peak, fixed_bytes=fixed,
        recomputed_ops=replayed, watched_ops=watched, watch_time_s=watch_s,
        peak_phase=phase, peak_op=op, peak_note=note, timeline=entries)


def _entry(phase: str, op: int | None, start_s: float, during: int, note: str, live: int) -> Event:
    return Event(phase=phase, op=op, start_s=start_s, live_bytes=live, peak_bytes=max(during, live), note=note)


def _peak_site(graph: Graph, ev: ScheduleEvent | None) -> tuple[str, int | None, str]:
    """The report's (peak_phase, peak_op, peak_note) from the event at the peak."""
    ops = graph.ops
    if ev is None:
        return "start", None, "fixed memory"
    if ev.kind == "compute":
        return "forward", ev.at, f"forward op {ev.at} ({ops[ev.at].name})"
    if ev.kind == "recompute":
        p = ev.ops[0]
        return "recompute", p, f"recompute op {p} ({ops[p].name}) for op {ev.at}'s backward"
    if ev.kind == "backward":
        return "backward", ev.at, f"backward of op {ev.at} ({ops[ev.at].name})"
    if ev.kind == "h2d" and ev.tensor is not None:
        return "prefetch", ev.tensor, f"prefetch tensor {ev.tensor} ({ev.reason})"
    if ev.phase == "optimizer" and ev.at is not None:  # a streamed state unit's
        unit = graph.state_units[ev.at].module or "the model"
        return "optimizer", None, f"optimizer step, {unit}'s state streamed in"
    return "optimizer", None, "optimizer step"
