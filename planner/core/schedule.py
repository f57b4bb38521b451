"""A plan lowered once into explicit events per graph position (torch-free), as Checkmate's
``schedule_from_rs`` lowers its R/S matrices and Rockmate's op schedules are both what its simulator sums
and what its runtime runs.

    sched = schedule(graph, plan)          # the lowering: every timing decision is taken here
    for ev in sched.events: ...            # compute, d2h, free, h2d, wait, replay, recompute, backward, ...
    report = score(graph, sched)           # planner/core/simulator.py: sums the events, decides nothing

Event kinds (``ScheduleEvent.kind``), each at a graph position ``at`` (the forward op id in forward, the
backward step's op id in backward, None for the optimizer step):

* ``compute``: forward op ``at`` runs (its new outputs are allocated);
* ``d2h``: ``tensor`` (offloaded) is copied to host when its first saver ``at`` starts (a saved input) or
  ends (a saved output), or when its last in-place writer ``at`` ends;
* ``free``: ``tensor`` leaves the device: after step ``at`` (its last forward use, its last backward
  reader, a replayed op after which the replay no longer needs it, a pin's last reader) when it follows
  that step's event, or, an offloaded tensor whose copy to host has ended, at the op boundary before step
  ``at`` (it then precedes that step's events). A replay's scratch copy (``reason`` says so) is freed the
  same way; the resident tensor of that id, if any, stays;
* ``h2d``: ``tensor`` is copied back to the device at backward step ``at`` (``reason``: scheduled by the
  plan, late because the step needs it, or needed by a replay); its device buffer counts from now;
* ``wait``: compute waits for ``tensor``'s copy back before step ``at`` reads it (``duration_s``: the
  exposed part of the copy, 0 when it has arrived);
* ``replay``: to rebuild ``tensor`` for backward step ``at`` the ops ``ops`` run in forward order
  (:func:`memplan.planner.core.replay.replay` decides them); a ``recompute`` event follows per op;
* ``recompute``: replayed op ``ops[0]`` runs for backward step ``at`` (to rebuild ``tensor``), its
  re-created outputs (scratch copies included) allocated;
* ``backward``: backward step ``at`` runs (allocates its gradients, frees its outputs' gradients);
* ``watch``: the executor's dispatch over the forward ops ``ops`` that it watches under the plan
  (:mod:`memplan.planner.core.watch`), charged to forward time, once the replays are known;
* ``optimizer``: the optimizer step.

Every event carries what it costs, so that scoring is a sum (``alloc_bytes``, ``workspace_bytes``,
``free_bytes``, ``duration_s``, ``copy_bytes``, ``host_bytes``; see :class:`ScheduleEvent`).

When copies end decides what is resident (an offloaded tensor is released at the first op boundary after
its copy ends, and a prefetch of a tensor still on the device moves nothing), which prefetch waits are
exposed and so where the later events fall: the lowering runs the step on the compute clock and the copy
stream (docs/model.md), and is the one place where such decisions are taken.
:func:`memplan.planner.core.simulator.score` walks the events and sums memory and time;
:func:`memplan.planner.core.simulator.simulate` is ``score(graph, schedule(graph, plan))``. The executor
takes its prefetch points and pins from the schedule and logs what it performs in this vocabulary
(``Executor.last_step.events``); :meth:`Schedule.executed` is the part of a schedule that a run performs
observably (compute, d2h, h2d, replay), for comparison event for event.
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from memplan.planner.core.errors import PlanError
from memplan.planner.core.graph import FUSE_MODES, FusedStep, Graph
from memplan.planner.core.plan import Action, Plan
from memplan.planner.core.replay import kept_by_replays, replay
from memplan.planner.core.states import (
    GRADS_RELEASED,
    GRADS_TO_HOST,
    STATE_BACK,
    STATE_IN,
    STATE_RELEASED,
    GradCopies,
    device_state_bytes,
    host_refusal,
    host_state_bytes,
    optimizer_phase,
    unit_grads,
)
from memplan.planner.core.watch import forward_watch, fused_forward_watch

EventKind = Literal["compute", "d2h", "free", "h2d", "wait", "replay", "recompute", "backward", "watch",
                    "optimizer", "host"]
Phase = Literal["forward", "backward", "optimizer"]

#: kinds an executor performs as explicit actions (frees happen when references go, except an offloaded
#: tensor's release once its copy to host has ended, ``COPY_ENDED``, which the executor performs where the
#: schedule puts it; waits and backward steps belong to the device and to autograd; recompute events
#: detail a replay)
EXECUTED_KINDS = ("compute", "d2h", "h2d", "replay")
COPY_ENDED = "its copy to host has ended"  # the reason of the free that releases an offloaded tensor

_NEVER = 1 << 62


class ScheduleEvent(NamedTuple):
    """One event of a schedule (module docstring). ``tensor``: the tensor it moves, frees or rebuilds
    (None for compute); ``ops``: a replay's ops in forward order (a recompute event's one op, a watch
    event's watched ops); ``reason``: why it happens, in words.

    What it costs, filled by the lowering (0 where it does not apply) and summed by
    :func:`memplan.planner.core.simulator.score`: ``alloc_bytes`` device bytes allocated as it starts
    (compute, recompute: its new outputs; h2d: the buffer; backward: the gradients it creates);
    ``workspace_bytes`` held only while it runs; ``free_bytes`` released when it ends (free: the tensor;
    backward: the gradients of its op's outputs); ``duration_s`` on the compute stream (a step's run time,
    a replayed op's with the executor's dispatch, a wait's exposed part, the watch's dispatch);
    ``copy_bytes`` moved on the copy stream (d2h, h2d); ``host_bytes`` host (pinned) memory taken (d2h)
    or, negative, given back (the free of an offloaded tensor at its last backward reader).

    A NamedTuple, not a dataclass: a solver's inner loop builds thousands per simulation, and a frozen
    dataclass costs three times as much to build.
    """

    kind: EventKind
    phase: Phase
    at: int | None
    tensor: int | None = None
    ops: tuple[int, ...] = ()
    reason: str = ""
    alloc_bytes: int = 0
    workspace_bytes: int = 0
    free_bytes: int = 0
    duration_s: float = 0.0
    copy_bytes: int = 0
    host_bytes: int = 0

    def key(self) -> tuple:
        """What identifies the event across the simulator and the executor: kind, tensor, ops, and the
        position where the executor knows it (forward ops; prefetches the plan schedules; a streamed state
        unit's copies)."""
        at = self.at if self.kind == "compute" or (self.kind == "h2d" and self.reason.startswith("scheduled")) \
            or self.performed_release() or self.phase == "optimizer" or self.moves_gradients() else None
        return (self.kind, at, self.tensor, self.ops)

    def moves_gradients(self) -> bool:
        """A host-stepped unit's gradients copied to the host in backward, or their device copy freed: the
        executor performs both where backward completes a host-stepped unit (``at``: that backward step)."""
        return self.tensor is None and self.phase == "backward" and self.reason.startswith(
            (GRADS_TO_HOST, GRADS_RELEASED, STATE_IN, STATE_BACK, STATE_RELEASED))

    def performed_release(self) -> bool:
        """The release of an offloaded tensor's device copy once its copy to host has ended: the executor
        performs it at this very position (``Schedule.released``)."""
        return self.kind == "free" and self.reason == COPY_ENDED


@dataclass(frozen=True)
class Schedule:
    """A plan lowered for one graph: ``events`` in execution order; ``prefetch_at`` (offloaded tensor ->
    backward step at which its copy back is scheduled, defaults resolved); ``pins`` (activation that
    cannot be rebuilt but that a replay reads -> the lowest backward step whose replay reads it: held
    from its production until that step has run); ``released`` (offloaded tensor whose device copy is
    released once its copy to host has ended -> the position ``(phase, op)`` at whose boundary that
    happens: the executor releases it there, whatever its own clock, so its memory is the schedule's)."""

    graph_fingerprint: str
    events: tuple[ScheduleEvent, ...]
    prefetch_at: dict[int, int] = field(default_factory=dict)
    pins: dict[int, int] = field(default_factory=dict)
    released: dict[int, tuple[str, int]] = field(default_factory=dict)
    # model states (planner/core/states.py): the units whose optimizer state is streamed, in order; the bytes
    # the step starts without on the device and the host pool that holds them
    streamed: tuple[int, ...] = ()
    state_off_device_bytes: int = 0
    host_state_bytes: int = 0
    # the host-stepped units, in order; and, per unit, where the executor frees its device gradients once their
    # copy to the host has ended: at the completion of which host-stepped unit (None: at optimizer.step())
    hosted: tuple[int, ...] = ()
    grads_released: dict[int, int | None] = field(default_factory=dict)

    def of(self, kind: EventKind) -> list[ScheduleEvent]:
        return [e for e in self.events if e.kind == kind]

    def executed(self) -> list[tuple]:
        """Keys (:meth:`ScheduleEvent.key`) of the events an executor performs, in order."""
        return [e.key() for e in self.events if e.kind in EXECUTED_KINDS or e.performed_release()
                or (e.kind == "free" and e.moves_gradients())]

    def replays(self) -> list[ScheduleEvent]:
        return self.of("replay")


#: ``_event((kind, phase, at, ...))``: a :class:`ScheduleEvent` from all twelve fields in order, built as
#: the tuple it is (a C call: the lowering's hot loops build one per op and per free, and the NamedTuple's
#: own constructor, a Python function, costs about twice as much)
_event = functools.partial(tuple.__new__, ScheduleEvent)


# ---- per-graph facts ------------------------------------------------------------------------------------


@dataclass
class StaticFacts:
    """Per-graph facts the lowering needs, computed once per graph (:func:`static_facts`)."""

    saved: list[bool]
    fwd_free_at: list[int]          # op after which an unsaved / not-kept activation is freed
    release_at: list[int]           # backward step after which a saved activation is freed (-1: never)
    first_bwd_use: list[int]        # highest saver id (first backward reader), -1 if unsaved
    frees_after_fwd: list[list[int]]
    releases_after_bwd: list[list[int]]
    is_activation: list[bool]
    fixed_content: list[bool]       # an activation that cannot be rebuilt (not recomputable, not held)
    unpack_order: list[list[int]]   # op -> the tensors it saves, in the order autograd packs and unpacks
                                    # them: its inputs (packed before the op runs), then its outputs (after),
                                    # each in ``Op.saved`` order
    saved_at: list[list[int]]       # op -> saved activations first saved by it, in unpack_order: an
                                    # offloaded input is copied to host when the op starts, an output when
                                    # it ends
    d2h_after: dict[int, int]       # saved activation written in place at or after its first saver (its
                                    # rebuilt_by ops) -> its last writer: an offloaded one is copied when
                                    # that op ends, its content final
    d2h_after_op: list[list[int]]   # op -> the tensors of d2h_after whose last writer it is, in pack order


def static_facts(graph: Graph) -> StaticFacts:
    """The plan-independent facts of ``graph`` (when each activation is freed in forward, released in
    backward, first read in backward), cached on the graph."""
    cached = graph.__dict__.get("_memplan_sim_static")
    if cached is not None:
        return cached
    n_t = len(graph.tensors)
    n_o = len(graph.ops)
    is_act = [t.kind == "activation" for t in graph.tensors]
    saved = [False] * n_t
    release_at = [-1] * n_t
    first_bwd = [-1] * n_t
    for t, savers in graph.savers.items():
        if is_act[t]:
            saved[t] = True
            release_at[t] = min(savers)
            first_bwd[t] = max(savers)
    fwd_free_at = [_NEVER] * n_t
    for t in graph.tensors:
        if not is_act[t.id] or t.held_by_caller:
            continue
        last = t.producer
        cons = graph.consumers.get(t.id)
        if cons:
            last = max(last, cons[-1])
        if t.freed_after is not None:
            last = max(last, t.freed_after)
        fwd_free_at[t.id] = min(last, n_o - 1)
    frees_after_fwd: list[list[int]] = [[] for _ in range(n_o)]
    for t in range(n_t):
        if fwd_free_at[t] != _NEVER:
            frees_after_fwd[fwd_free_at[t]].append(t)
    releases_after_bwd: list[list[int]] = [[] for _ in range(n_o)]
    for t in range(n_t):
        if release_at[t] >= 0 and not graph.tensors[t].held_by_caller:
            releases_after_bwd[release_at[t]].append(t)
    fixed_content = [is_act[t.id] and not t.recomputable and not t.held_by_caller for t in graph.tensors]
    saved_at: list[list[int]] = [[] for _ in range(n_o)]
    unpack_order: list[list[int]] = []
    for op in graph.ops:
        ts = list(dict.fromkeys(op.saved))
        order = [t for t in ts if t not in op.outputs] + [t for t in ts if t in op.outputs]
        unpack_order.append(order)
        saved_at[op.id] = [t for t in order if saved[t] and release_at[t] == op.id]
    d2h_after = {t.id: t.rebuilt_by[-1] for t in graph.tensors
                 if saved[t.id] and t.rebuilt_by and t.rebuilt_by[-1] >= release_at[t.id]}
    d2h_after_op: list[list[int]] = [[] for _ in range(n_o)]
    for t in sorted(d2h_after, key=lambda t: (release_at[t], saved_at[release_at[t]].index(t))):
        d2h_after_op[d2h_after[t]].append(t)
    st = StaticFacts(saved, fwd_free_at, release_at, first_bwd, frees_after_fwd, releases_after_bwd, is_act,
                     fixed_content, unpack_order, saved_at, d2h_after, d2h_after_op)
    graph.__dict__["_memplan_sim_static"] = st
    return st


def overlapped_s(device: str, device_s: float, host_s: float) -> float:
    """What an op costs the step when the host spends ``host_s`` on it besides the op's own ``device_s``
    (the executor's dispatch of a replay, eager autograd's recording of a call). On a CPU the op runs on
    the thread that does that work: the sum. On CUDA the host does it while the device runs the kernels
    issued before, so the larger of the two paces the step (docs/model.md, Time)."""
    if device == "cuda":
        return max(device_s, host_s)
    return device_s + host_s


def replay_op_cost_s(graph: Graph, op: Any) -> float:
    """What replaying ``op`` costs the step: its time and the executor's dispatch of it, overlapped on CUDA."""
    return overlapped_s(graph.device, op.time_s, graph.replay_op_dispatch_s)


def watch_op_cost_s(graph: Graph, op: Any) -> float:
    """What watching forward op ``op`` under a plan adds to the step: the executor's dispatch mode's work; on
    CUDA only what the device's run of the op does not hide."""
    return overlapped_s(graph.device, op.time_s, graph.watch_op_dispatch_s) - op.time_s


def final_step_bytes(graph: Graph, *, fused: bool) -> int:
    """The transient the optimizer step at the end of the step holds: all of ``optimizer_step_bytes``, or,
    ``fused``, what the buckets' own steps (each holding its ``step_bytes``) leave of it."""
    total = graph.fixed.optimizer_step_bytes
    return max(0, total - sum(f.step_bytes for f in graph.fused_backward)) if fused else total


def forward_updates(graph: Graph) -> dict[int, list[FusedStep]]:
    """Forward fusion: forward op -> the buckets whose pending update applies just before it, their module's
    first op (the executor's forward pre-hook), in bucket order; a bucket whose module runs no op in the
    graph at op 0. One pass over the ops, every prefix of each op's module path."""
    first: dict[str, int] = {"": 0}
    for op in graph.ops:
        parts = op.module.split(".") if op.module else []
        for n in range(1, len(parts) + 1):
            first.setdefault(".".join(parts[:n]), op.id)
    out: dict[int, list[FusedStep]] = {}
    for f in graph.fused_backward:
        out.setdefault(first.get(f.module, 0), []).append(f)
    return out


def fusion_charge(graph: Graph, fuse: str | None) -> tuple[str, float]:
    """The optimizer step's event under ``fuse``: its reason and seconds. The updates' own time is
    ``graph.optimizer_time_s`` wherever they run; fused, the step also pays what the profiler measured fusion
    to add here (``graph.fused_extra_s``: per-bucket optimizer calls, their kernels among the step's; never
    below zero in all). Forward fusion's watch of the forward is charged with the watch (planner/core/watch.py)."""
    if fuse is None:
        return "optimizer step", graph.optimizer_time_s
    extra = graph.fused_extra_s.get(fuse)
    if extra is None:
        return (f"optimizer step, fused into {fuse} (its cost beyond the plain step not measured: profile with "
                f"fuse={fuse!r})"), graph.optimizer_time_s
    return f"optimizer step, fused into {fuse}", max(0.0, graph.optimizer_time_s + extra)


def default_prefetch_at(graph: Graph, tensor: int, bandwidth_bytes_per_s: float) -> int:
    """The latest op at which to start a tensor's prefetch so that, with an idle copy stream, the
    backward compute between it and the tensor's first backward reader covers the copy."""
    st = static_facts(graph)
    first = st.first_bwd_use[tensor]
    need = graph.tensors[tensor].bytes / bandwidth_bytes_per_s
    covered = 0.0
    k = first
    while covered < need and k + 1 < len(graph.ops):
        k += 1
        covered += graph.ops[k].backward_time_s
    return k


# ---- the lowering -----------------------------------------------------------------------------------------


def schedule(graph: Graph, plan: Plan | None = None, *, check: bool = True, fuse: str | None = None) -> Schedule:
    """Lower ``plan`` (keep everything when None) on ``graph`` into a :class:`Schedule`; ``fuse``: the
    executor's optimizer fusion ("backward", "forward" or None, :func:`fusion_charge`). Raises
    :class:`memplan.planner.core.errors.PlanError` if the plan does not fit the graph (with
    ``check=True``; ``PlanMismatch`` for another graph's plan) or asks to rebuild a tensor from one that
    cannot be recomputed."""
    if plan is None:
        plan = Plan.keep_all(graph)
    if check:
        plan.check_against(graph)
    prefetch = {d.tensor: d.prefetch_at for d in plan.decisions
                if d.action == Action.OFFLOAD and d.prefetch_at is not None}
    return schedule_actions(graph, plan.actions(), prefetch_at=prefetch,
                            bandwidth_bytes_per_s=plan.bandwidth_bytes_per_s, fuse=fuse, streamed=plan.streamed(),
                            hosted=plan.hosted())


def schedule_actions(graph: Graph, actions: dict[int, Action], *, prefetch_at: dict[int, int] | None = None,
                     bandwidth_bytes_per_s: float | None = None, fuse: str | None = None,
                     streamed: list[int] | None = None, hosted: list[int] | None = None) -> Schedule:
    """:func:`schedule` for solvers' inner loops: ``{tensor id: action}`` (KEEP may be left out) and the
    prefetch points the plan sets (the rest default, :func:`default_prefetch_at`), unchecked; the
    bandwidth defaults to the graph's.

    Pinning (docs/model.md): a replay that reads an activation which cannot be rebuilt (not recomputable:
    mutated in place later, say) needs that very tensor, so it is retained until the last backward step
    whose replay reads it. Which ones are read depends only on the plan, not on memory: a first pass that
    retains every such tensor records the reads (and emits nothing); the second pass retains exactly
    those, each until its last read, and emits the events."""
    if fuse is not None and fuse not in FUSE_MODES:
        raise PlanError(f"fuse={fuse!r}: expected {' or '.join(FUSE_MODES)} (or None: not fused)")
    streamed = list(streamed or ())
    hosted = list(hosted or ())
    if (streamed or hosted) and fuse == "forward":
        raise PlanError("the plan moves optimizer state off the device, which runs in optimizer.step(): "
                        "fuse='forward' (updates deferred to the next forward) with state off the device is not "
                        "supported (solve it with fuse='backward' or none)")
    why = host_refusal(graph, hosted)
    if why:
        raise PlanError(why)
    bandwidth = bandwidth_bytes_per_s or graph.host_bandwidth_bytes_per_s
    prefetch_at = prefetch_at or {}
    pins: dict[int, int] = {}
    st = static_facts(graph)
    if any(a.rebuilds for a in actions.values()) and any(st.fixed_content):
        probe = _Lowering(graph, actions, prefetch_at, bandwidth, discover=True)
        probe.run()
        pins = probe.reads
    low = _Lowering(graph, actions, prefetch_at, bandwidth, pins=pins, fuse=fuse, streamed=streamed, hosted=hosted)
    low.run()
    resolved = {t: k for k, ts in low.prefetch_ops.items() for t in ts}
    return Schedule(graph.fingerprint, tuple(low.events), resolved, dict(pins), low.released, tuple(streamed),
                    device_state_bytes(graph, streamed, hosted), host_state_bytes(graph, streamed, hosted),
                    tuple(hosted), low.grads_released)


class _Lowering:
    """One timed pass over the step (docs/model.md, "What is live when" and "Transfers"): the compute
    clock, the copy stream, which tensors are resident and which have a host copy. It decides, in
    execution order, every event and what it costs, and emits them (unless ``discover``); it counts no
    memory: :func:`memplan.planner.core.simulator.score` sums that from the events."""

    def __init__(self, graph: Graph, actions: dict[int, Action], prefetch_at: dict[int, int],
                 bandwidth: float, *, discover: bool = False, pins: dict[int, int] | None = None,
                 fuse: str | None = None, streamed: list[int] | None = None, hosted: list[int] | None = None):
        self.g = graph
        self.fuse = fuse
        self.streamed = streamed or []
        # host-stepped units (planner/core/states.py): backward step -> the units it completes, in the order
        # backward completes them; their gradients' copies to the host (on a copy stream of their own, the
        # other direction's) and, awaiting their device free, (copy end, unit)
        self.hosted = hosted or []
        self.grad_copies = GradCopies(graph, self.hosted, bandwidth)
        self.hosted_at = self.grad_copies.at
        self.grads_released = self.grad_copies.released
        self.fused: dict[int, list[FusedStep]] = {}  # backward step -> the fusion buckets it completes
        grads = unit_grads(graph) if (self.streamed or self.hosted) else {}
        # backward fusion steps the streamed units inside backward too, their state fetched ahead
        # (planner/core/states.py, "in backward"); the host-stepped ones at the step
        self.in_backward = fuse == "backward" and bool(self.streamed)
        off = self.hosted if self.in_backward else [*self.streamed, *self.hosted]
        moved = {id(grads[u]) for u in off if u in grads}
        self.unit_of_step = {id(grads[u]): u for u in self.streamed if u in grads} if self.in_backward else {}
        rank = {id(f): n for n, f in enumerate(graph.fused_backward)}
        self.fetch_order = sorted((u for u in self.streamed if u in grads), key=lambda u: rank[id(grads[u])]) \
            if self.in_backward else []
        self.fetch_next = 0           # the next unit of fetch_order to fetch
        self.state_ready: dict[int, float] = {}
        self.state_out_free = 0.0     # the streamed states' copy stream back to the host
        self.state_back: tuple[int, float] | None = None  # (unit, end of its copy back): freed at the next
        for f in graph.fused_backward:
            if id(f) not in moved:
                self.fused.setdefault(f.after, []).append(f)
        # forward fusion: forward op -> the buckets whose pending update applies before it
        self.applied_before = forward_updates(graph) if fuse == "forward" else {}
        # discover: retain every pinnable tensor, record in ``reads`` the lowest backward step whose
        # replay reads each, emit nothing; pins: {tensor: step} retained from production until after it
        self.discover = discover
        self.emit = not discover
        self.reads: dict[int, int] = {}
        self.pins = pins or {}
        self.pin_release: dict[int, list[int]] = {}
        for t, s in self.pins.items():
            self.pin_release.setdefault(s, []).append(t)
        self.st = st = static_facts(graph)
        self.actions = actions
        self.bw = bandwidth
        n_t = len(graph.tensors)
        self.action = [Action.KEEP] * n_t
        self.offloaded = [False] * n_t
        self.rebuilt = [False] * n_t  # recompute or recompute_each
        for t, a in actions.items():
            self.action[t] = a
            self.offloaded[t] = a == Action.OFFLOAD
            self.rebuilt[t] = a.rebuilds
        self.events: list[ScheduleEvent] = []
        self.phase = "forward"
        self.at: int | None = None  # the graph position being run
        self.waited: set[int] = set()
        self.resident = [not a for a in st.is_activation]  # params/buffers/inputs always resident
        self.ready_at = [0.0] * n_t         # when a prefetched buffer's data has arrived
        self.on_host = [False] * n_t        # a host copy exists (offloaded)
        self.d2h_end = [0.0] * n_t
        self.prefetched = [False] * n_t
        self.now = 0.0
        self.copy_free = 0.0
        self.replayed_ops: set[int] = set()
        self.pending: list[tuple[float, int]] = []  # (copy end, tensor) awaiting device release
        self.released: dict[int, tuple[str, int]] = {}  # offloaded tensor -> where its device copy left
        self.prefetch_ops: dict[int, list[int]] = {}
        for t, a in actions.items():
            if a == Action.OFFLOAD:
                k = prefetch_at.get(t)
                if k is None:
                    k = default_prefetch_at(graph, t, bandwidth)
                self.prefetch_ops.setdefault(k, []).append(t)

    def run(self) -> None:
        g = self.g
        self._forward()
        self._backward()
        if not self.emit:
            return
        # the executor's dispatch mode over the forward ops it watches, known once the replays are
        watch = forward_watch(g, self.actions, self.replayed_ops, self.pins,
                              [*self.prefetch_ops, *(k for phase, k in self.released.values() if phase == "backward")],
                              self.st.d2h_after,
                              release_ops=[k for phase, k in self.released.values() if phase == "forward"])
        if self.fuse == "forward":
            watch = fused_forward_watch(g, watch)
        if watch.ops:
            window = range(watch.first, watch.last + 1)
            watch_s = sum(watch_op_cost_s(g, g.ops[k]) for k in window)
            self.events.append(ScheduleEvent(
                "watch", "forward", None, None, tuple(window),
                "the executor's dispatch over the forward ops it watches", duration_s=watch_s))
        self.phase, self.at = "optimizer", None
        reason, seconds = fusion_charge(g, self.fuse)
        # backward fusion stepped its buckets already: the step's transient is what remains
        # the buckets hold their shares where they step
        workspace = final_step_bytes(g, fused=self.fuse == "backward" or bool(self.applied_before))
        if self.in_backward:
            self._release_state("optimizer", None)  # the last streamed unit's state, after its copy back
        if self.grad_copies.pending:  # host-stepped units' gradients whose copies backward did not see end
            wait, gone = self.grad_copies.finish(self.now)
            self.events.append(ScheduleEvent("wait", "optimizer", None, reason="the host-stepped units' gradient "
                                             "copies to the host end", duration_s=wait))
            self.now += wait
            for u in gone:
                self.events.append(ScheduleEvent("free", "optimizer", None, reason=GRADS_RELEASED,
                                                 free_bytes=self.grad_copies.bytes[u]))
        if not self.hosted and (not self.streamed or self.in_backward):
            self.events.append(ScheduleEvent("optimizer", "optimizer", None, reason=reason,
                                             workspace_bytes=workspace, duration_s=seconds))
            return
        # streamed optimizer state (planner/core/states.py): the resident units' update, then each streamed
        # unit's state through the device; the copy stream is free by now (backward waited for its copies)
        if self.fuse == "backward":
            # the host-stepped units are not fused: their updates run in the phase, each with its share of the
            # whole step's transient (the streamed ones were stepped in backward, as the resident ones: their
            # time is charged here, as fusion charges its updates); what fusion adds is its own event
            phase, copy_end = optimizer_phase(g, [], self.bw, g.fixed.optimizer_step_bytes,
                                              g.optimizer_time_s, self.hosted, resident_bytes=workspace)
            if seconds > g.optimizer_time_s:
                self.events.append(ScheduleEvent("optimizer", "optimizer", None, reason="what backward fusion's "
                                                 "per-bucket calls add", duration_s=seconds - g.optimizer_time_s))
        else:
            phase, copy_end = optimizer_phase(g, self.streamed, self.bw, workspace, seconds, self.hosted)
        start = max(self.now, self.copy_free)
        for e in phase:
            self.events.append(ScheduleEvent(e.kind, "optimizer", e.unit, None, (), e.reason, e.alloc_bytes,
                                             e.workspace_bytes, e.free_bytes, e.duration_s, e.copy_bytes))
        self.copy_free = start + copy_end

    # ---- streamed state inside backward (backward fusion) ------------------------------------------------
    def _fetch_state(self, i: int) -> None:
        """Queue the next streamed unit's state copy in (the activations' copy stream; its buffers now)."""
        if self.fetch_next >= len(self.fetch_order):
            return
        u = self.fetch_order[self.fetch_next]
        self.fetch_next += 1
        b = self.g.state_units[u].state_bytes
        self.copy_free = self.state_ready[u] = max(self.copy_free, self.now) + b / self.bw
        if self.emit:
            module = self.g.state_units[u].module or "the model"
            self.events.append(ScheduleEvent("h2d", "backward", i, reason=f"{STATE_IN} ({module})", alloc_bytes=b,
                                             copy_bytes=b))

    def _release_state(self, phase: str, i: int | None) -> None:
        """The last stepped unit's device state goes, once compute has waited for its copy back."""
        if self.state_back is None:
            return
        u, end = self.state_back
        self.state_back = None
        wait = max(0.0, end - self.now)
        self.now += wait
        if self.emit:
            self.events.append(ScheduleEvent("wait", phase, i, reason=f"{STATE_BACK} ends", duration_s=wait))
            self.events.append(ScheduleEvent("free", phase, i, reason=STATE_RELEASED,
                                             free_bytes=self.g.state_units[u].state_bytes))

    def _stream_before(self, u: int | None, i: int) -> None:
        """Before a fused bucket's step at backward step ``i``: the first one fetches the first streamed
        unit's state; a streamed unit's frees the last one's, fetches the next one's and waits for its own."""
        if self.fetch_next == 0:
            self._fetch_state(i)
        if u is None:
            return
        self._release_state("backward", i)
        self._fetch_state(i)
        wait = max(0.0, self.state_ready[u] - self.now)
        self.now += wait
        if self.emit:
            self.events.append(ScheduleEvent("wait", "backward", i, reason=f"{STATE_IN} arrives", duration_s=wait))

    def _stream_after(self, u: int, i: int) -> None:
        """After streamed unit ``u``'s fused step: its state's copy back (a copy stream of its own)."""
        b = self.g.state_units[u].state_bytes
        self.state_out_free = max(self.state_out_free, self.now) + b / self.bw
        self.state_back = (u, self.state_out_free)
        if self.emit:
            module = self.g.state_units[u].module or "the model"
            self.events.append(ScheduleEvent("d2h", "backward", i, reason=f"{STATE_BACK} ({module})", copy_bytes=b))

    def _grads_to_host(self, u: int, i: int) -> None:
        """Backward step ``i`` has completed host-stepped unit ``u``'s gradients: their copy to the host is
        queued on the gradients' copy stream, and the device copies of earlier units' gradients whose copies
        have ended by now are freed (the executor does both in the completing gradient's hook)."""
        gone = self.grad_copies.complete(u, self.now)
        if self.emit:
            module = self.g.state_units[u].module or "the model"
            self.events.append(ScheduleEvent("d2h", "backward", i, reason=f"{GRADS_TO_HOST} ({module})",
                                             copy_bytes=self.grad_copies.bytes[u]))
            for v in gone:
                self.events.append(ScheduleEvent("free", "backward", i, reason=GRADS_RELEASED,
                                                 free_bytes=self.grad_copies.bytes[v]))

    # ---- bookkeeping ----------------------------------------------------------------------------------
    def _free(self, t: int, reason: str, host_bytes: int = 0) -> None:
        if self.resident[t]:
            self.resident[t] = False
            if self.emit:
                self.events.append(_event(("free", self.phase, self.at, t, (), reason, 0, 0, self.g.tensors[t].bytes,
                                           0.0, 0, host_bytes)))

    def _release_pending(self) -> None:
        while self.pending and self.pending[0][0] <= self.now:
            _, t = heapq.heappop(self.pending)
            if self.resident[t] and not self.prefetched[t]:
                self._free(t, COPY_ENDED)
                self.released[t] = (self.phase, self.at)

    def _pinnable(self, t: int) -> bool:
        return self.st.fixed_content[t] and self.action[t] == Action.KEEP

    def _pinned(self, t: int) -> bool:
        """Retained past its usual free because a replay reads it (see :func:`schedule_actions`)."""
        if self.discover:
            return self._pinnable(t)
        return t in self.pins and self._pinnable(t)

    # ---- phases -----------------------------------------------------------------------------------------
    def _forward(self) -> None:
        g, st = self.g, self.st
        tensors = g.tensors
        resident, offloaded, rebuilt, emit, events = self.resident, self.offloaded, self.rebuilt, self.emit, self.events
        saved, saved_at, d2h_after, d2h_after_op = st.saved, st.saved_at, st.d2h_after, st.d2h_after_op
        pending = self.pending
        if emit and self.applied_before:
            # forward fusion: the previous step's gradients are held until their module's update applies
            events.append(ScheduleEvent(
                "optimizer", "forward", None, reason="the previous step's gradients, held until forward fusion "
                "applies their update", alloc_bytes=sum(f.grad_bytes for f in g.fused_backward)))
        for op in g.ops:
            i = op.id
            self.at = i
            if pending and pending[0][0] <= self.now:
                self._release_pending()  # at the boundary before op i
            if emit:
                for f in self.applied_before.get(i, ()):  # stepped before its module's forward, gradients freed
                    events.append(ScheduleEvent(
                        "optimizer", "forward", i, reason=f"optimizer step of {f.module or 'the model'}'s parameters, "
                        f"fused into forward", workspace_bytes=f.step_bytes, free_bytes=f.grad_bytes))
            alloc = 0
            for t in op.outputs:
                if not resident[t]:
                    resident[t] = True
                    alloc += tensors[t].bytes
            first = saved_at[i]
            for t in first:  # a saved input's content is final when its first saver starts
                if t not in op.outputs and t not in d2h_after:
                    self._d2h(t, i)
            if emit:
                events.append(_event(("compute", "forward", i, None, (), op.name, alloc, op.workspace_bytes, 0,
                                      op.time_s, 0, 0)))
            self.now += op.time_s
            for t in d2h_after_op[i]:  # written in place after its first saver: after the last writer
                if st.release_at[t] < i:
                    self._d2h(t, i)
            for t in first:  # a saved output's, when it ends
                if (t in op.outputs and t not in d2h_after) or d2h_after.get(t) == i:
                    self._d2h(t, i)
            for t in st.frees_after_fwd[i]:
                if not resident[t] or self._pinned(t):
                    continue
                if not saved[t]:
                    self._free(t, "last forward use")
                    continue
                if rebuilt[t]:
                    self._free(t, "last forward use; recomputed for backward")
                elif offloaded[t]:
                    heapq.heappush(pending, (self.d2h_end[t], t))
        # copies that ended by now are released at the boundary before the first backward step

    def _d2h(self, t: int, at: int) -> None:
        """Copy an offloaded tensor to host on the copy stream, after what the stream already holds."""
        if not self.offloaded[t]:
            return
        b = self.g.tensors[t].bytes
        begin = max(self.copy_free, self.now)  # waits for the saver (an event on the compute stream)
        self.copy_free = self.d2h_end[t] = begin + b / self.bw
        self.on_host[t] = True
        if self.emit:
            self.events.append(ScheduleEvent("d2h", "forward", at, t, (), "offloaded", copy_bytes=b, host_bytes=b))

    def _prefetch(self, t: int, why: str) -> None:
        """Start copying an offloaded tensor back: its device buffer is allocated now."""
        if self.prefetched[t]:
            return
        self.prefetched[t] = True
        if self.resident[t]:  # its device copy was never released (the copy ran late): nothing to move
            return
        b = self.g.tensors[t].bytes
        begin = max(self.copy_free, self.now)
        self.copy_free = self.ready_at[t] = begin + b / self.bw
        self.resident[t] = True
        if self.emit:
            self.events.append(ScheduleEvent("h2d", "backward", self.at, t, (), why, alloc_bytes=b, copy_bytes=b))

    def _wait(self, t: int, for_op: int) -> None:
        """Compute waits for ``t``'s copy back (once: the clock is then past its arrival)."""
        if not self.prefetched[t] or t in self.waited:
            return  # never copied back (kept, or its device copy stayed), or already waited for
        self.waited.add(t)
        exposed = max(self.ready_at[t] - self.now, 0.0)
        self.now = max(self.now, self.ready_at[t])
        if self.emit:
            self.events.append(ScheduleEvent("wait", "backward", for_op, t, (), f"op {for_op}'s backward reads it",
                                             duration_s=exposed))

    def _materialize(self, target: int, step: int) -> None:
        """Make ``target`` resident for backward step ``step`` by the replay :func:`replay` defines:
        fetch the offloaded tensors it needs, run its ops in forward order, free what it made after its
        last use unless backward still reads it (a saved tensor whose backward is still to come stays,
        as checkpointing does)."""
        g, st = self.g, self.st
        tensors = g.tensors
        resident, on_host, action, offloaded = self.resident, self.on_host, self.action, self.offloaded
        r = replay(g, target, available=resident.__getitem__,
                   fetchable=lambda u: on_host[u] and offloaded[u],
                   retain=lambda u: st.saved[u] and st.release_at[u] <= step and kept_by_replays(action[u]))
        r.check(g, step)
        if self.discover:
            for u in r.reads:
                if self._pinnable(u):
                    self.reads[u] = min(self.reads.get(u, step), step)
        for u in r.fetches:
            self._prefetch(u, f"needed to recompute tensor {target}")
            self._wait(u, step)
        emit, events = self.emit, self.events
        if emit:
            events.append(ScheduleEvent("replay", "backward", step, target, r.ops, f"op {step}'s backward reads it"))
        scratch = set(r.scratch)  # private copies of tensors read mid-chain: counted, never resident
        for p, freed in zip(r.ops, r.frees_after, strict=True):
            op = g.ops[p]
            alloc = 0
            for o in op.outputs:
                if o in scratch:
                    alloc += tensors[o].bytes
                elif not resident[o]:
                    resident[o] = True
                    alloc += tensors[o].bytes
            cost_s = replay_op_cost_s(g, op)  # the executor's dispatch of a replayed op included
            if emit:
                events.append(_event(("recompute", "backward", step, target, (p,), op.name, alloc,
                                      op.workspace_bytes, 0, cost_s, 0, 0)))
            self.now += cost_s
            self.replayed_ops.add(p)
            for u in freed:
                if u in scratch:
                    if emit:
                        events.append(ScheduleEvent("free", "backward", step, u, (),
                                                    f"scratch copy for the replay of tensor {target}: its "
                                                    f"mid-chain reader has run", free_bytes=tensors[u].bytes))
                else:
                    self._free(u, f"replay for tensor {target} no longer reads it")

    def _backward(self) -> None:
        g, st = self.g, self.st
        tensors = g.tensors
        resident, on_host, offloaded = self.resident, self.on_host, self.offloaded
        is_activation = st.is_activation
        self.phase = "backward"
        pending = self.pending
        # releases happen where the executor sees backward: before the step of an op with an autograd node
        # (its prehook fires there); a graph that records none (hand-built) has every step seen
        seen = [op.has_backward for op in g.ops] if any(op.has_backward for op in g.ops) else [True] * len(g.ops)
        carried: list[int] = []  # prefetches scheduled at a step the executor does not see
        for op in reversed(g.ops):
            i = op.id
            self.at = i
            if not seen[i]:
                carried.extend(self.prefetch_ops.get(i, ()))  # started at the next step the executor sees
            else:
                if pending and pending[0][0] <= self.now:
                    self._release_pending()  # at the boundary before step i
                for t in [*carried, *self.prefetch_ops.get(i, ())]:
                    self._prefetch(t, f"scheduled at op {i}")
                carried.clear()
            for t in st.unpack_order[i]:
                if not is_activation[t]:
                    continue
                if not resident[t]:
                    if offloaded[t] and on_host[t]:
                        self._prefetch(t, f"late: needed by op {i}")
                    else:
                        self._materialize(t, i)
                self._wait(t, i)
            if self.emit:
                self.events.append(_event(("backward", "backward", i, None, (), op.name, op.backward_grad_alloc_bytes,
                                           op.backward_workspace_bytes, op.backward_grad_free_bytes,
                                           op.backward_time_s, 0, 0)))
            self.now += op.backward_time_s
            for t in st.releases_after_bwd[i]:
                if self.discover and self._pinnable(t):
                    continue
                if self._pinned(t) and self.pins[t] < i:
                    continue  # a later replay reads it: released after that step instead
                if resident[t]:
                    self._free(t, "its last backward reader has run", -tensors[t].bytes if on_host[t] else 0)
            for t in self.pin_release.get(i, ()):
                if st.saved[t] and st.release_at[t] < i:
                    continue  # its own backward reader comes later and releases it
                self._free(t, "pinned: the last replay that reads it has run")
            if self.fuse == "backward":
                for f in self.fused.get(i, ()):  # the buckets this step completes: stepped, their gradients freed
                    u = self.unit_of_step.get(id(f))
                    if self.in_backward:
                        self._stream_before(u, i)
                    if self.emit:
                        self.events.append(ScheduleEvent(
                            "optimizer", "backward", i, reason=f"optimizer step of {f.module or 'the model'}'s "
                            f"parameters, fused into backward", workspace_bytes=f.step_bytes, free_bytes=f.grad_bytes))
                    if u is not None:
                        self._stream_after(u, i)
            for u in self.hosted_at.get(i, ()):
                self._grads_to_host(u, i)
