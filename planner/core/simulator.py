"""The simulator: replays one training step of a graph under a plan and reports peak device memory and
step time. It is the single source of truth: every solver's plan is scored by :func:`simulate`.

The cost model is stated in docs/model.md; in short:

* Start: ``graph.fixed.resident_bytes`` are live (parameters, buffers, batch, optimizer state).
* Forward op ``i``: its new output storages are allocated (peak also counts ``workspace_bytes``), the
  compute clock advances by ``time_s``; then every activation whose last forward use is ``i`` is freed,
  unless backward saves it and the plan keeps it, or the caller holds it (``held_by_caller``).
  An offloaded activation is copied to host on the copy stream right after its first saver (the forward op
  whose autograd node first saves it: its content is final then, in-place initialisers included; one
  written in place after that, a recurrent cell's gates, is copied when its last writer ends), and its
  device memory is released at the first op boundary after both its last forward use and the copy's end.
* Backward, ops in reverse: prefetches scheduled at this op start (device buffer allocated now, copy on
  the copy stream); missing saved tensors are made resident: an offloaded one waits for its copy (the
  wait is *exposed* transfer time), a recomputed one is rebuilt by replaying its producer and, recursively,
  the producers of missing inputs (replayed ops in forward order; replayed saved tensors stay until
  their own backward, the rest are freed after their last use in the replay). Then the step allocates
  its gradients (``backward_grad_alloc_bytes``, peak also counts ``backward_workspace_bytes``), the clock
  advances by ``backward_time_s``, it releases ``backward_grad_free_bytes`` and every saved activation
  whose last backward reader (the lowest saver id) is this op.
* Optimizer step: ``optimizer_step_bytes`` transient, ``optimizer_time_s``.

One copy stream (FIFO) carries both directions, concurrent with compute. Memory is tracked at op
granularity, and frees that depend on a copy happen only at the first op boundary after the copy ends,
so the model never releases memory earlier than a real run could.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Action, Plan
from memplan.planner.core.replay import kept_by_replays, replay
from memplan.planner.core.schedule import Schedule, ScheduleEvent
from memplan.planner.core.watch import forward_watch

_NEVER = 1 << 62


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
    transfer_bytes: int = Field(description="bytes moved device->host plus host->device")
    host_peak_bytes: int = Field(description="most host (pinned) memory held by offloaded activations")
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


@dataclass
class StaticFacts:
    """Per-graph facts the simulator needs, computed once per graph (:func:`static_facts`)."""

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


def simulate(graph: Graph, plan: Plan | None = None, *, timeline: bool = True, check: bool = True) -> Report:
    """Replay one training step of ``graph`` under ``plan`` (keep everything when None).

    Returns a :class:`Report` with the peak device bytes, step time and its parts, and (with
    ``timeline=True``) one :class:`Event` per forward op, backward step, replay, prefetch and wait.
    Raises :class:`PlanError` if the plan does not fit the graph (with ``check=True``) or asks to
    rebuild a tensor from one that cannot be recomputed.
    """
    if plan is None:
        plan = Plan.keep_all(graph)
    if check:
        plan.check_against(graph)
    bandwidth = plan.bandwidth_bytes_per_s or graph.host_bandwidth_bytes_per_s
    actions = plan.actions()
    prefetch = {d.tensor: d.prefetch_at for d in plan.decisions
                if d.action == Action.OFFLOAD and d.prefetch_at is not None}
    return _run(graph, actions, prefetch, bandwidth, timeline)[0]


def lower(graph: Graph, plan: Plan | None = None, *, check: bool = True) -> Schedule:
    """``plan`` lowered into a :class:`~memplan.planner.core.schedule.Schedule` by the pass that
    :func:`simulate` scores (use :func:`memplan.planner.core.schedule.schedule`)."""
    if plan is None:
        plan = Plan.keep_all(graph)
    if check:
        plan.check_against(graph)
    bandwidth = plan.bandwidth_bytes_per_s or graph.host_bandwidth_bytes_per_s
    prefetch = {d.tensor: d.prefetch_at for d in plan.decisions
                if d.action == Action.OFFLOAD and d.prefetch_at is not None}
    return _run(graph, plan.actions(), prefetch, bandwidth, False, record=True)[1]


def simulate_actions(graph: Graph, actions: dict[int, Action], *, prefetch_at: dict[int, int] | None = None,
                     bandwidth_bytes_per_s: float | None = None, timeline: bool = False) -> Report:
    """:func:`simulate` for solvers' inner loops: ``{tensor id: action}`` instead of a Plan, unchecked."""
    return _run(graph, actions, prefetch_at or {}, bandwidth_bytes_per_s or graph.host_bandwidth_bytes_per_s,
                timeline)[0]


def _run(graph: Graph, actions: dict[int, Action], prefetch_at: dict[int, int], bandwidth: float,
         timeline: bool, record: bool = False) -> tuple[Report, Schedule | None]:
    """Pinning (docs/model.md): a replay that reads an activation which cannot be rebuilt (not
    recomputable: mutated in place later, say) needs that very tensor, so it is retained until the last
    backward step whose replay reads it. Which ones are read depends only on the plan, not on memory: a
    first pass that retains every such tensor records the reads; the second, real pass retains exactly
    those, each until its last read."""
    pins: dict[int, int] = {}
    st = static_facts(graph)
    if any(a.rebuilds for a in actions.values()) and any(st.fixed_content):
        probe = _Replay(graph, actions, prefetch_at, bandwidth, False, discover=True)
        probe.run()
        pins = probe.reads
    sim = _Replay(graph, actions, prefetch_at, bandwidth, timeline, pins=pins, record=record)
    report = sim.run()
    if not record:
        return report, None
    resolved = {t: k for k, ts in sim.prefetch_ops.items() for t in ts}
    return report, Schedule(graph.fingerprint, tuple(sim.schedule), resolved, dict(pins))


class _Replay:
    def __init__(self, graph: Graph, actions: dict[int, Action], prefetch_at: dict[int, int],
                 bandwidth: float, timeline: bool, *, discover: bool = False, pins: dict[int, int] | None = None,
                 record: bool = False):
        self.g = graph
        # discover: retain every pinnable tensor and record in ``reads`` the lowest backward step whose
        # replay reads each; pins: {tensor: step} retained from production until after that step
        self.discover = discover
        self.reads: dict[int, int] = {}
        self.pins = pins or {}
        self.pin_release: dict[int, list[int]] = {}
        for t, s in self.pins.items():
            self.pin_release.setdefault(s, []).append(t)
        self.st = static_facts(graph)
        self.actions = actions
        self.bw = bandwidth
        self.record = timeline
        self.events: list[Event] = []
        self.phase = "forward"
        self.at: int | None = None  # the graph position being run (for schedule events)
        self.waited: set[int] = set()
        self.recording = record
        self.schedule: list[ScheduleEvent] = []  # the pass as schedule events (planner/core/schedule.py)
        n_t = len(graph.tensors)
        self.resident = [not a for a in self.st.is_activation]  # params/buffers/inputs always resident
        self.ready_at = [0.0] * n_t         # when a prefetched buffer's data has arrived
        self.on_host = [False] * n_t        # a host copy exists (offloaded)
        self.d2h_end = [0.0] * n_t
        self.prefetched = [False] * n_t
        self.live = graph.fixed.resident_bytes
        self.peak = self.live
        self.peak_where: tuple[str, int | None, str] = ("start", None, "fixed memory")
        self.now = 0.0
        self.copy_free = 0.0
        self.host_live = 0
        self.host_peak = 0
        self.transfer_bytes = 0
        self.recompute_s = 0.0
        self.exposed_s = 0.0
        self.replays = 0
        self.replayed_ops: set[int] = set()
        self.pending: list[tuple[float, int]] = []  # (copy end, tensor) awaiting device release
        self.prefetch_ops: dict[int, list[int]] = {}
        for t, a in actions.items():
            if a == Action.OFFLOAD:
                k = prefetch_at.get(t)
                if k is None:
                    k = default_prefetch_at(graph, t, bandwidth)
                self.prefetch_ops.setdefault(k, []).append(t)

    # ---- bookkeeping --------------------------------------------------------------------------
    def _bump(self, during: int, phase: str, op: int | None, note: str) -> None:
        if during > self.peak:
            self.peak = during
            self.peak_where = (phase, op, note)

    def _event(self, phase: str, op: int | None, start: float, during: int, note: str = "") -> None:
        if self.record:
            self.events.append(Event(phase=phase, op=op, start_s=start, live_bytes=self.live,
                                     peak_bytes=max(during, self.live), note=note))

    def _sched(self, kind: str, at: int | None, tensor: int | None = None, ops: tuple[int, ...] = (),
               reason: str = "") -> None:
        if self.recording:
            self.schedule.append(ScheduleEvent(kind, self.phase, at, tensor, ops, reason))  # type: ignore[arg-type]

    def _free(self, t: int, reason: str = "") -> None:
        if self.resident[t]:
            self.resident[t] = False
            self.live -= self.g.tensors[t].bytes
            if self.recording:
                self._sched("free", self.at, t, reason=reason)

    def _release_pending(self) -> None:
        while self.pending and self.pending[0][0] <= self.now:
            _, t = heapq.heappop(self.pending)
            if self.resident[t] and not self.prefetched[t]:
                self._free(t, "its copy to host has ended")

    def _action(self, t: int) -> Action:
        return self.actions.get(t, Action.KEEP)

    def _pinnable(self, t: int) -> bool:
        return self.st.fixed_content[t] and self._action(t) == Action.KEEP

    def _pinned(self, t: int) -> bool:
        """Retained past its usual free because a replay reads it (see :func:`_run`)."""
        if self.discover:
            return self._pinnable(t)
        return t in self.pins and self._pinnable(t)

    # ---- phases -------------------------------------------------------------------------------
    def run(self) -> Report:
        g = self.g
        self._event("start", None, 0.0, self.live, "fixed memory")
        self._forward()
        fwd_s = self.now
        self._backward()
        bwd_s = self.now - fwd_s - self.recompute_s - self.exposed_s
        # the executor's dispatch mode over the forward ops it watches, known once the replays are
        watch = forward_watch(g, self.actions, self.replayed_ops, self.pins, self.prefetch_ops, self.st.d2h_after)
        watch_s = watch.ops * g.watch_op_dispatch_s
        fwd_s += watch_s
        self.now += watch_s
        start = self.now
        self.phase, self.at = "optimizer", None
        self._sched("optimizer", None, reason="optimizer step")
        during = self.live + g.fixed.optimizer_step_bytes
        self._bump(during, "optimizer", None, "optimizer step")
        self.now += g.optimizer_time_s
        self._event("optimizer", None, start, during, "optimizer step")
        pw = self.peak_where
        return Report(
            peak_bytes=self.peak, time_s=self.now, forward_time_s=fwd_s, backward_time_s=max(bwd_s, 0.0),
            recompute_time_s=self.recompute_s, exposed_transfer_s=self.exposed_s,
            optimizer_time_s=g.optimizer_time_s, transfer_bytes=self.transfer_bytes,
            host_peak_bytes=self.host_peak, fixed_bytes=g.fixed.resident_bytes, recomputed_ops=self.replays,
            watched_ops=watch.ops, watch_time_s=watch_s,
            peak_phase=pw[0], peak_op=pw[1], peak_note=pw[2], timeline=self.events)

    def _forward(self) -> None:
        g, st = self.g, self.st
        tensors = g.tensors
        for op in g.ops:
            self._release_pending()
            self.at = op.id
            start = self.now
            for t in op.outputs:
                if not self.resident[t]:
                    self.resident[t] = True
                    self.live += tensors[t].bytes
            during = self.live + op.workspace_bytes
            self._bump(during, "forward", op.id, f"forward op {op.id} ({op.name})")
            first = st.saved_at[op.id]
            for t in first:  # a saved input's content is final when its first saver starts
                if t not in op.outputs and t not in st.d2h_after:
                    self._d2h(t, op.id)
            self._sched("compute", op.id, reason=op.name)
            self.now += op.time_s
            for t in st.d2h_after_op[op.id]:  # written in place after its first saver: after the last writer
                if st.release_at[t] < op.id:
                    self._d2h(t, op.id)
            for t in first:  # a saved output's, when it ends
                if (t in op.outputs and t not in st.d2h_after) or st.d2h_after.get(t) == op.id:
                    self._d2h(t, op.id)
            for t in st.frees_after_fwd[op.id]:
                if not self.resident[t] or self._pinned(t):
                    continue
                if not st.saved[t]:
                    self._free(t, "last forward use")
                    continue
                a = self._action(t)
                if a.rebuilds:
                    self._free(t, "last forward use; recomputed for backward")
                elif a == Action.OFFLOAD:
                    heapq.heappush(self.pending, (self.d2h_end[t], t))
            self._event("forward", op.id, start, during, op.name)
        self._release_pending()

    def _d2h(self, t: int, at: int) -> None:
        """Copy an offloaded tensor to host on the copy stream, after what the stream already holds."""
        if self._action(t) != Action.OFFLOAD:
            return
        b = self.g.tensors[t].bytes
        begin = max(self.copy_free, self.now)  # waits for the saver (an event on the compute stream)
        self.copy_free = self.d2h_end[t] = begin + b / self.bw
        self.on_host[t] = True
        self._sched("d2h", at, t, reason="offloaded")
        self.transfer_bytes += b
        self.host_live += b
        self.host_peak = max(self.host_peak, self.host_live)

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
        self.live += b
        self.transfer_bytes += b
        self._sched("h2d", self.at, t, reason=why)
        self._bump(self.live, "prefetch", t, f"prefetch tensor {t} ({why})")
        self._event("prefetch", self.g.tensors[t].producer, self.now, self.live, f"prefetch tensor {t} ({why})")

    def _wait(self, t: int, for_op: int) -> None:
        if self.recording and self.prefetched[t] and t not in self.waited:
            self.waited.add(t)
            self._sched("wait", for_op, t, reason=f"op {for_op}'s backward reads it")
        if self.ready_at[t] > self.now:
            start = self.now
            self.exposed_s += self.ready_at[t] - self.now
            self.now = self.ready_at[t]
            self._event("wait", for_op, start, self.live, f"wait for prefetch of tensor {t}")

    def _materialize(self, target: int, step: int) -> None:
        """Make ``target`` resident for backward step ``step`` by the replay :func:`replay` defines:
        fetch the offloaded tensors it needs, run its ops in forward order, free what it made after its
        last use unless backward still reads it (a saved tensor whose backward is still to come stays,
        as checkpointing does)."""
        g, st = self.g, self.st
        tensors = g.tensors
        resident, on_host = self.resident, self.on_host
        r = replay(g, target, available=resident.__getitem__,
                   fetchable=lambda u: on_host[u] and self._action(u) == Action.OFFLOAD,
                   retain=lambda u: st.saved[u] and st.release_at[u] <= step and kept_by_replays(self._action(u)))
        r.check(g, step)
        if self.discover:
            for u in r.reads:
                if self._pinnable(u):
                    self.reads[u] = min(self.reads.get(u, step), step)
        for u in r.fetches:
            self._prefetch(u, f"needed to recompute tensor {target}")
            self._wait(u, step)
        self._sched("replay", step, target, r.ops, f"op {step}'s backward reads it")
        scratch = set(r.scratch)  # private copies of tensors read mid-chain: counted, never resident
        for p, freed in zip(r.ops, r.frees_after, strict=True):
            op = g.ops[p]
            start = self.now
            for o in op.outputs:
                if o in scratch:
                    self.live += tensors[o].bytes
                elif not resident[o]:
                    resident[o] = True
                    self.live += tensors[o].bytes
            note = f"recompute op {p} ({op.name}) for op {step}'s backward"
            during = self.live + op.workspace_bytes
            self._bump(during, "recompute", p, note)
            cost_s = op.time_s + g.replay_op_dispatch_s  # the executor's dispatch of a replayed op included
            self.now += cost_s
            self.recompute_s += cost_s
            self.replays += 1
            self.replayed_ops.add(p)
            for u in freed:
                if u in scratch:
                    self.live -= tensors[u].bytes
                else:
                    self._free(u, f"replay for tensor {target} no longer reads it")
            self._event("recompute", p, start, during, note)

    def _backward(self) -> None:
        g, st = self.g, self.st
        tensors = g.tensors
        self.phase = "backward"
        for op in reversed(g.ops):
            i = op.id
            self.at = i
            self._release_pending()
            for t in self.prefetch_ops.get(i, ()):
                self._prefetch(t, f"scheduled at op {i}")
            for t in st.unpack_order[i]:
                if not st.is_activation[t]:
                    continue
                if not self.resident[t]:
                    if self._action(t) == Action.OFFLOAD and self.on_host[t]:
                        self._prefetch(t, f"late: needed by op {i}")
                    else:
                        self._materialize(t, i)
                self._wait(t, i)
            start = self.now
            self._sched("backward", i, reason=op.name)
            during = self.live + op.backward_grad_alloc_bytes + op.backward_workspace_bytes
            self._bump(during, "backward", i, f"backward of op {i} ({op.name})")
            self.live += op.backward_grad_alloc_bytes
            self.now += op.backward_time_s
            self.live -= op.backward_grad_free_bytes
            for t in st.releases_after_bwd[i]:
                if self.discover and self._pinnable(t):
                    continue
                if self._pinned(t) and self.pins[t] < i:
                    continue  # a later replay reads it: released after that step instead
                if self.resident[t]:
                    self._free(t, "its last backward reader has run")
                    if self.on_host[t]:
                        self.host_live -= tensors[t].bytes
            for t in self.pin_release.get(i, ()):
                if st.saved[t] and st.release_at[t] < i:
                    continue  # its own backward reader comes later and releases it
                self._free(t, "pinned: the last replay that reads it has run")
            self._event("backward", i, start, during, op.name)
