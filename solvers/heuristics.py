"""Fast heuristic planners for graphs too big for the exact methods, a plan from a user's list, and the
minimum-memory search that :class:`~memplan.planner.errors.Infeasible` errors quote.

* ``greedy`` -- DTR's eviction score (Kirisame et al., "Dynamic Tensor Rematerialization", ICLR 2021)
  made offline: from keep-everything, repeatedly evict (recompute, or offload when it hides) the saved
  activations with the smallest ``cost / (bytes x staleness)`` among those live at the simulated peak,
  then give back what the final plan no longer needs.
* ``capuchin`` -- Capuchin's per-tensor choice (Peng et al., ASPLOS 2020): swap a tensor when its
  transfer hides in its access gap, otherwise recompute the ones that free the most bytes per second.
* ``every-k`` -- 'checkpoint every k-th block' on the coarsened chain, as users do by hand.
* ``manual`` -- the plan a user names: modules to checkpoint, or tensors to keep.

Every method here is fast and makes no optimality claim (``exact=False``). They work on the simulator's
verdict: a candidate plan is simulated, the peak's location picks the next move, and no plan is returned
whose simulated peak was not checked. :func:`min_memory_actions` combines them into the cheapest search
for the plan of least peak we know.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from memplan.planner.errors import MemplanError
from memplan.planner.graph import Graph, coarsen
from memplan.planner.plan import Action
from memplan.planner.replay import replay
from memplan.planner.simulator import Report, simulate_actions
from memplan.solvers.base import Proposal, register

Actions = dict[int, Action]
_EPS = 1e-12


# ---- per-graph facts ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Facts:
    """What the heuristics need to know about a graph, computed once per call.

    Times are positions on the keep-everything timeline (seconds from the start of the step).
    """

    saved: tuple[int, ...]              # saved activations, ascending
    evictable: tuple[int, ...]          # saved activations whose eviction can free memory (bytes > 0,
                                        # not held by the caller)
    fwd_free_at: dict[int, int]         # saved activation -> op after which forward would free it
    release_at: dict[int, int]          # saved activation -> its last backward reader (lowest saver)
    first_bwd_use: dict[int, int]       # saved activation -> its first backward reader (highest saver)
    gap_s: dict[int, float]             # saved activation -> time from its last forward use to its first
                                        # backward use: how long evicting it frees its bytes
    cost_s: list[float]                 # tensor -> forward time of its producer (0 for non-activations)
    missing_in_backward: list[bool]     # activation not kept by any plan: dropped after forward use
    neighbours: list[tuple[int, ...]]   # tensor -> activations adjacent through its producer / consumers
    fwd_time_s: float
    bwd_time_s: float


def _facts(graph: Graph) -> _Facts:
    ops, tensors = graph.ops, graph.tensors
    n = len(ops)
    fwd_end = np.cumsum([op.time_s for op in ops]) if n else np.zeros(0)
    fwd_total = float(fwd_end[-1]) if n else 0.0
    bwd = [op.backward_time_s for op in ops]
    # backward step s starts after the steps of every op above it
    bwd_after = np.concatenate([np.cumsum(bwd[::-1])[::-1][1:], [0.0]]) if n else np.zeros(0)
    saved = tuple(graph.saved_activations)
    savers, consumers = graph.savers, graph.consumers
    fwd_free_at, release_at, first_bwd, gap = {}, {}, {}, {}
    for t in saved:
        info = tensors[t]
        last = max([info.producer, *consumers.get(t, ())])
        if info.freed_after is not None:
            last = max(last, info.freed_after)
        last = min(last, n - 1)
        fwd_free_at[t] = last
        release_at[t] = min(savers[t])
        first_bwd[t] = max(savers[t])
        gap[t] = max(0.0, fwd_total + float(bwd_after[first_bwd[t]]) - float(fwd_end[last]))
    evictable = tuple(t for t in saved if tensors[t].bytes > 0 and not tensors[t].held_by_caller)
    saved_set = set(saved)
    missing = [t.kind == "activation" and not t.held_by_caller and t.id not in saved_set for t in tensors]
    cost = [ops[t.producer].time_s if t.producer is not None else 0.0 for t in tensors]
    neighbours: list[tuple[int, ...]] = []
    for t in tensors:
        near: dict[int, None] = {}
        if t.producer is not None:
            for u in ops[t.producer].inputs:
                if tensors[u].kind == "activation" and u != t.id:
                    near[u] = None
        for c in consumers.get(t.id, ()):
            for v in ops[c].outputs:
                if v != t.id:
                    near[v] = None
        neighbours.append(tuple(near))
    return _Facts(saved, evictable, fwd_free_at, release_at, first_bwd, gap, cost, missing, neighbours,
                  fwd_total, float(sum(bwd)))


def _simulate(graph: Graph, actions: Actions, prefetch_at: dict[int, int] | None = None,
              timeline: bool = False) -> Report:
    return simulate_actions(graph, actions, prefetch_at=prefetch_at, timeline=timeline)


# ---- where the simulated peak is, and what could lower it ---------------------------------------------
@dataclass(frozen=True)
class _Site:
    """Where a plan's simulated peak happens: during forward op ``op``, during backward step ``op``
    (its replays and prefetches included), or nowhere a plan can change (``none``: the optimizer step,
    fixed memory). ``replayed_at`` maps each op replayed in backward to the highest (earliest) backward
    step that replays it."""

    phase: str
    op: int
    replayed_at: dict[int, int]


def _peak_site(graph: Graph, actions: Actions, prefetch_at: dict[int, int], report: Report) -> _Site:
    if report.peak_phase == "forward":
        return _Site("forward", report.peak_op, {})
    if report.peak_phase not in ("backward", "recompute", "prefetch", "wait"):
        return _Site("none", -1, {})
    # Backward: replays and prefetches are labelled with the op they touch, not the step they serve,
    # so read the timeline: each event belongs to the next backward step that follows it.
    events = _simulate(graph, actions, prefetch_at, timeline=True).timeline
    step_of = [-1] * len(events)
    nxt = -1
    for k in range(len(events) - 1, -1, -1):
        if events[k].phase == "backward":
            nxt = events[k].op
        step_of[k] = nxt
    peak_k = next(k for k, e in enumerate(events) if e.peak_bytes >= report.peak_bytes)
    replayed: dict[int, int] = {}
    for k, e in enumerate(events):
        if e.phase == "recompute" and e.op not in replayed:
            replayed[e.op] = step_of[k]  # events run in time order: the first is the highest step
    return _Site("backward", step_of[peak_k], replayed)


def _candidates(graph: Graph, facts: _Facts, actions: Actions, site: _Site, allowed: Callable[[int], bool]
                ) -> list[int]:
    """Kept activations whose eviction frees their bytes at ``site``."""
    kept = [t for t in facts.evictable if t not in actions and allowed(t)]
    if site.phase == "forward":
        return [t for t in kept if facts.fwd_free_at[t] < site.op]
    if site.phase == "backward":
        s = site.op
        consumers = graph.consumers
        # resident at step s (its last reader is still to come), needed again only after s, and not on
        # the path of a replay that runs at or before s (that replay would rebuild it)
        return [t for t in kept if facts.release_at[t] <= s and facts.first_bwd_use[t] < s
                and all(site.replayed_at.get(c, -1) < s for c in consumers.get(t, ()))]
    return []


# ---- choosing a batch to evict --------------------------------------------------------------------------
class _Components:
    """Union-find over the tensors missing in backward (DTR's 'evicted neighbourhoods'): recomputing a
    tensor costs its producer plus the components around it, which DTR's h_DTR_eq approximates."""

    def __init__(self, graph: Graph, facts: _Facts, actions: Actions):
        self.facts = facts
        n = len(graph.tensors)
        self.parent = list(range(n))
        self.cost = list(facts.cost_s)
        self.missing = list(facts.missing_in_backward)
        for t, a in actions.items():
            if a == Action.RECOMPUTE:
                self.missing[t] = True
        for t in range(n):
            if self.missing[t]:
                self._join_neighbours(t)

    def find(self, t: int) -> int:
        parent = self.parent
        while parent[t] != t:
            parent[t] = parent[parent[t]]
            t = parent[t]
        return t

    def _join_neighbours(self, t: int) -> None:
        for u in self.facts.neighbours[t]:
            if self.missing[u]:
                a, b = self.find(t), self.find(u)
                if a != b:
                    self.parent[b] = a
                    self.cost[a] += self.cost[b]

    def evict(self, t: int) -> None:
        self.missing[t] = True
        self._join_neighbours(t)

    def neighbourhood_cost(self, t: int) -> float:
        """Recompute cost of ``t`` if evicted now: its producer plus the adjacent evicted components."""
        roots = {self.find(u) for u in self.facts.neighbours[t] if self.missing[u]}
        return self.facts.cost_s[t] + sum(self.cost[r] for r in roots)


@dataclass
class _Stream:
    """A coarse check that offloads hide: every offloaded byte crosses the one copy stream once in
    forward and once in backward, so their transfer time must fit in each phase's compute."""

    bandwidth: float
    capacity_s: float
    load_s: float = 0.0
    host_left: float = float("inf")

    def hides(self, nbytes: int, gap_s: float) -> bool:
        transfer = nbytes / self.bandwidth
        return 2 * transfer <= gap_s and self.load_s + transfer <= self.capacity_s and nbytes <= self.host_left

    def fits_host(self, nbytes: int) -> bool:
        return nbytes <= self.host_left

    def add(self, nbytes: int) -> None:
        self.load_s += nbytes / self.bandwidth
        self.host_left -= nbytes


def _stream(graph: Graph, facts: _Facts, actions: Actions, host_budget_bytes: int | None) -> _Stream:
    st = _Stream(graph.host_bandwidth_bytes_per_s, 0.9 * min(facts.fwd_time_s, facts.bwd_time_s),
                 host_left=float("inf") if host_budget_bytes is None else float(host_budget_bytes))
    for t, a in actions.items():
        if a == Action.OFFLOAD:
            st.add(graph.tensors[t].bytes)
    return st


Picker = Callable[[Graph, _Facts, Actions, list[int], int, bool, "int | None"], Actions]


def _pick_dtr(graph: Graph, facts: _Facts, actions: Actions, cands: list[int], target_bytes: int,
              offload: bool, host_budget_bytes: int | None) -> Actions:
    """DTR's order: smallest cost / (bytes x staleness) first, costs updated as neighbours go (lazy
    heap: a score only grows as components merge). An activation is offloaded instead when offload is
    allowed and its transfer hides in its access gap (cost ~ 0), or when it cannot be recomputed."""
    tensors = graph.tensors
    comps = _Components(graph, facts, actions)
    stream = _stream(graph, facts, actions, host_budget_bytes) if offload else None

    def score(t: int) -> tuple[float, Action | None]:
        b, gap = tensors[t].bytes, facts.gap_s[t] + _EPS
        if stream is not None and stream.hides(b, gap):
            return _EPS / (b * gap), Action.OFFLOAD
        if tensors[t].recomputable:
            return comps.neighbourhood_cost(t) / (b * gap), Action.RECOMPUTE
        if stream is not None and stream.fits_host(b):  # the only way to free it: pay the exposed copy
            return (2 * b / stream.bandwidth + _EPS) / (b * gap), Action.OFFLOAD
        return float("inf"), None

    heap = [(score(t)[0], t) for t in cands]
    heapq.heapify(heap)
    batch: Actions = {}
    freed = 0
    while heap and freed < target_bytes:
        _, t = heapq.heappop(heap)
        s, action = score(t)
        if action is None:
            continue
        if heap and s > heap[0][0]:
            heapq.heappush(heap, (s, t))  # stale: its neighbourhood grew since it was scored
            continue
        batch[t] = action
        freed += tensors[t].bytes
        if action == Action.RECOMPUTE:
            comps.evict(t)
        elif stream is not None:
            stream.add(tensors[t].bytes)
    return batch


def _replay_cost(graph: Graph, facts: _Facts, missing: set[int], t: int) -> float:
    """Forward time to rebuild ``t`` from resident tensors: the ops of its replay
    (:func:`memplan.planner.replay.replay`: producers and their in-place initialisers), each once."""
    ops = graph.ops
    r = replay(graph, t, available=lambda u: not (u in missing or facts.missing_in_backward[u]))
    return sum(ops[p].time_s for p in r.ops)


def _pick_capuchin(graph: Graph, facts: _Facts, actions: Actions, cands: list[int], target_bytes: int,
                   offload: bool, host_budget_bytes: int | None) -> Actions:
    """Capuchin's order: first swap, longest access gap first, every tensor whose transfer hides in its
    gap; then recompute, most bytes freed per second of replay first (its MSPS)."""
    tensors = graph.tensors
    batch: Actions = {}
    freed = 0
    rest = list(cands)
    if offload:
        stream = _stream(graph, facts, actions, host_budget_bytes)
        rest = []
        for t in sorted(cands, key=lambda t: -facts.gap_s[t]):
            b = tensors[t].bytes
            if freed < target_bytes and stream.hides(b, facts.gap_s[t]):
                batch[t] = Action.OFFLOAD
                stream.add(b)
                freed += b
            else:
                rest.append(t)
    missing = {t for t, a in actions.items() if a == Action.RECOMPUTE}
    heap = [(-tensors[t].bytes / (_replay_cost(graph, facts, missing, t) + _EPS), t)
            for t in rest if tensors[t].recomputable]
    heapq.heapify(heap)
    while heap and freed < target_bytes:
        _, t = heapq.heappop(heap)
        msps = -tensors[t].bytes / (_replay_cost(graph, facts, missing, t) + _EPS)
        if heap and msps > heap[0][0]:
            heapq.heappush(heap, (msps, t))  # its replay grew with an earlier choice
            continue
        batch[t] = Action.RECOMPUTE
        missing.add(t)
        freed += tensors[t].bytes
    if offload and freed < target_bytes:  # what can be neither hidden nor replayed: swap, exposed
        for t in rest:
            if freed >= target_bytes:
                break
            if t not in batch and not tensors[t].recomputable and stream.fits_host(tensors[t].bytes):
                batch[t] = Action.OFFLOAD
                stream.add(tensors[t].bytes)
                freed += tensors[t].bytes
    return batch


# ---- the shared loop: evict at the peak until it fits, then give back what is not needed -------------
@dataclass
class _Outcome:
    actions: Actions
    report: Report
    lowest: tuple[int, Actions]   # (peak, actions) of the lowest-peak plan seen on the way
    sims: int
    rounds: int
    timed_out: bool


def _shrink(graph: Graph, budget: int, facts: _Facts, pick: Picker, *, offload: bool,
            host_budget_bytes: int | None, deadline: float, max_sims: int = 400) -> _Outcome:
    """From keep-everything, evict a batch among the activations live at the simulated peak, chosen by
    ``pick`` and sized to the excess, until the peak fits ``budget``. A batch that raises the peak is
    halved, and a single activation that does is not tried again. Returns the last plan (fitting or not)
    and the lowest-peak plan seen."""
    from memplan.solvers.base import memory_lower_bound

    floor = memory_lower_bound(graph)
    tensors = graph.tensors

    def allowed(t: int) -> bool:
        return tensors[t].recomputable or offload

    actions: Actions = {}
    report = _simulate(graph, actions)
    lowest = (report.peak_bytes, dict(actions))
    sims, rounds, timed_out = 1, 0, False
    tabu: set[int] = set()
    while report.peak_bytes > budget:
        if time.perf_counter() > deadline or sims >= max_sims:
            timed_out = True
            break
        rounds += 1
        site = _peak_site(graph, actions, {}, report)
        sims += site.phase == "backward"
        cands = [t for t in _candidates(graph, facts, actions, site, allowed) if t not in tabu]
        # Evict no more than half of what lies above the lower bound at once: evictions interact, and a
        # smaller step lets the next simulation say where the peak went.
        target = max(1, min(report.peak_bytes - budget, (report.peak_bytes - floor) // 2))
        batch = pick(graph, facts, actions, cands, target, offload, host_budget_bytes) if cands else {}
        if not batch:
            break
        while True:
            trial = {**actions, **batch}
            r = _simulate(graph, trial)
            sims += 1
            if r.peak_bytes <= report.peak_bytes:
                actions, report = trial, r
                break
            if len(batch) == 1:
                tabu.update(batch)
                break
            batch = dict(list(batch.items())[: len(batch) // 2])  # the best-scored half
        if report.peak_bytes < lowest[0]:
            lowest = (report.peak_bytes, dict(actions))
    return _Outcome(actions, report, lowest, sims, rounds, timed_out)


def _give_back(graph: Graph, facts: _Facts, actions: Actions, budget: int) -> tuple[Actions, Report, int]:
    """Keep again the evicted activations the plan no longer needs to evict: on the plan's simulated
    timeline, an activation that is recomputed is absent from just after its last forward use until its
    producer's first replay; keeping it adds its bytes there and nowhere else (replays only shrink), so
    it comes back when that stretch has room. Most recompute time per byte first, then offloads (their
    device copy is absent at most from its last forward use to its first backward use). Returns the new
    actions, their report and how many came back; the result is re-simulated and dropped if wrong."""
    before = _simulate(graph, actions, timeline=True)
    events = before.timeline
    peaks = np.array([e.peak_bytes for e in events], dtype=np.int64)
    fwd_event: dict[int, int] = {}
    bwd_event: dict[int, int] = {}
    first_replay: dict[int, int] = {}
    for k, e in enumerate(events):
        if e.phase == "forward":
            fwd_event[e.op] = k
        elif e.phase == "backward":
            bwd_event[e.op] = k
        elif e.phase == "recompute":
            first_replay.setdefault(e.op, k)
    tensors = graph.tensors
    order = sorted((t for t, a in actions.items() if a == Action.RECOMPUTE),
                   key=lambda t: -facts.cost_s[t] / tensors[t].bytes)
    order += sorted((t for t, a in actions.items() if a == Action.OFFLOAD), key=lambda t: -tensors[t].bytes)
    new = dict(actions)
    back = 0
    for t in order:
        lo = fwd_event[facts.fwd_free_at[t]] + 1
        if actions[t] == Action.RECOMPUTE:
            hi = first_replay.get(tensors[t].producer, len(events))
        else:
            hi = bwd_event[facts.first_bwd_use[t]]
        b = tensors[t].bytes
        if hi <= lo or int(peaks[lo:hi].max()) + b <= budget:
            peaks[lo:hi] += b
            del new[t]
            back += 1
    if not back:
        return actions, before, 0
    after = _simulate(graph, new)
    if after.peak_bytes > budget or after.time_s > before.time_s:
        return actions, before, 0  # the stretch argument failed somewhere: keep the checked plan
    return new, after, back


def _run(name: str, pick: Picker, graph: Graph, budget: int, *, time_limit_s: float, offload: bool,
         host_budget_bytes: int | None) -> Proposal:
    t0 = time.perf_counter()
    facts = _facts(graph)
    out = _shrink(graph, budget, facts, pick, offload=offload, host_budget_bytes=host_budget_bytes,
                  deadline=t0 + time_limit_s)
    stats = {"simulations": out.sims, "rounds": out.rounds}
    if out.report.peak_bytes > budget:
        stats["lowest_peak_bytes"] = out.lowest[0]
        stats["stopped"] = "time limit" if out.timed_out else "no eviction lowers the peak"
        return Proposal(status="infeasible", stats=stats)
    actions, report, back = _give_back(graph, facts, out.actions, budget)
    stats.update(given_back=back, recomputed=sum(a == Action.RECOMPUTE for a in actions.values()),
                 offloaded=sum(a == Action.OFFLOAD for a in actions.values()),
                 heuristic_time_s=time.perf_counter() - t0)
    return Proposal(actions, {}, "feasible", None, stats)


def _no_options(name: str, options: dict) -> None:
    if options:
        raise MemplanError(f"solver {name!r} takes no options; got {', '.join(sorted(options))}")


@register("greedy", description="DTR-style eviction (cost / bytes x staleness) at the simulated peak, "
                                "recompute or hidden offload; fast on any graph",
          graphs="dag", exact=False, offload=True)
def solve_greedy(graph: Graph, budget_bytes: int, *, time_limit_s: float = 60.0, offload: bool = False,
                 host_budget_bytes: int | None = None, **options: object) -> Proposal:
    """Kirisame et al. 2021's eviction heuristic, offline: from keep-everything, evict the activations
    live at the simulated peak with the least ``recompute cost / (bytes x access gap)`` (cost includes
    the evicted neighbourhood it would replay), offloading instead when the copy hides in the gap; then
    keep again what the final plan has room for. Status ``feasible`` or ``infeasible``."""
    _no_options("greedy", options)
    return _run("greedy", _pick_dtr, graph, budget_bytes, time_limit_s=time_limit_s, offload=offload,
                host_budget_bytes=host_budget_bytes)


@register("capuchin", description="Capuchin-style: swap what hides in its access gap, recompute the most "
                                  "bytes per second of replay; recompute-only without offload",
          graphs="dag", exact=False, offload=True)
def solve_capuchin(graph: Graph, budget_bytes: int, *, time_limit_s: float = 60.0, offload: bool = False,
                   host_budget_bytes: int | None = None, **options: object) -> Proposal:
    """Peng et al. 2020's policy: among the activations live at the simulated peak, swap (offload) those
    whose round trip ``2 x bytes / bandwidth`` fits in their access gap (time from last forward use to
    first backward use), longest gap first; then recompute by memory saved per second of replay. Without
    ``offload`` it is recompute-only. Status ``feasible`` or ``infeasible``."""
    _no_options("capuchin", options)
    return _run("capuchin", _pick_capuchin, graph, budget_bytes, time_limit_s=time_limit_s, offload=offload,
                host_budget_bytes=host_budget_bytes)


# ---- checkpoint every k-th block -------------------------------------------------------------------------
def _chain_for(graph: Graph, depth: int | None):
    """The coarsened chain whose stages are the 'blocks': ``coarsen``'s default, or, when that leaves
    fewer than 4 stages (a flat module tree), the shallowest module depth that gives at least 4."""
    if depth is not None:
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
            raise MemplanError(f"every-k: depth must be a non-negative integer, got {depth!r}")
        return coarsen(graph, depth)
    chain = coarsen(graph)
    if len(chain) >= 4 or not graph.ops:
        return chain
    max_depth = max(len([p for p in op.module.split(".") if p]) for op in graph.ops)
    for d in range(1, max_depth + 1):
        finer = coarsen(graph, d)
        if len(finer) >= 4:
            return finer
    return chain


def _every_k_actions(graph: Graph, chain, k: int) -> Actions:
    """Keep the activations crossing into every k-th stage (0, k, 2k, ...) and everything the last
    segment makes (like ``torch.utils.checkpoint.checkpoint_sequential``, which runs its last segment
    normally); recompute every other saved activation that can be. ``k >= len(chain)`` keeps all."""
    n = len(chain)
    last = ((n - 1) // k) * k if n else 0
    keep: set[int] = set()
    for stage in chain.stages:
        if stage.index % k == 0:
            keep.update(stage.input_tensors)
        if stage.index >= last:
            keep.update(t for o in stage.ops for t in graph.ops[o].outputs)
    tensors = graph.tensors
    return {t: Action.RECOMPUTE for t in graph.saved_activations
            if t not in keep and tensors[t].recomputable and tensors[t].bytes > 0}


class _KSearch:
    """Simulated every-k plans, memoised by k."""

    def __init__(self, graph: Graph, chain):
        self.graph, self.chain = graph, chain
        self.seen: dict[int, tuple[Report, Actions]] = {}

    def __call__(self, k: int) -> Report:
        if k not in self.seen:
            actions = _every_k_actions(self.graph, self.chain, k)
            self.seen[k] = (_simulate(self.graph, actions), actions)
        return self.seen[k][0]

    def lowest(self, grid: list[int]) -> int:
        """The k of least peak: the grid's best, then a ternary search between its neighbours (the peak
        is about n/k boundaries plus k stages: unimodal but for noise)."""
        best = min(grid, key=lambda k: (self(k).peak_bytes, k))
        i = grid.index(best)
        lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
        while hi - lo > 2:
            m1, m2 = lo + (hi - lo) // 3, hi - (hi - lo) // 3
            if self(m1).peak_bytes <= self(m2).peak_bytes:
                hi = m2
            else:
                lo = m1
        return min(range(lo, hi + 1), key=lambda k: (self(k).peak_bytes, k))


def _k_grid(n: int) -> list[int]:
    if n <= 24:
        return list(range(1, n + 1))
    grid, k = [], 1
    while k < n:
        grid.append(k)
        k = max(k + 1, int(k * 1.5))
    return grid + [n]


def every_k_search(graph: Graph, budget: int | None, depth: int | None = None) -> tuple[int, Actions, Report, int]:
    """The every-k plan for ``budget``: the fastest that fits among the k tried (k = len(chain) keeps
    everything), or, with ``budget=None`` or when none fits, the one of least peak. Returns (k, actions,
    report, stages)."""
    chain = _chain_for(graph, depth)
    n = len(chain)
    if n == 0:
        return 0, {}, _simulate(graph, {}), 0
    search = _KSearch(graph, chain)
    grid = _k_grid(n)
    if budget is not None:
        fitting = [k for k in grid if search(k).peak_bytes <= budget]
        if fitting:
            # time falls as k grows (less is recomputed); look between the largest fitting grid k and
            # the next grid point for a larger one that still fits
            lo = max(fitting)
            hi = next((k for k in grid if k > lo), lo)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if search(mid).peak_bytes <= budget:
                    lo = mid
                else:
                    hi = mid
    k = search.lowest(grid)
    fits = [k for k, (r, _) in search.seen.items() if budget is not None and r.peak_bytes <= budget]
    if fits:
        k = min(fits, key=lambda k: (search.seen[k][0].time_s, search.seen[k][0].peak_bytes, -k))
    report, actions = search.seen[k]
    return k, actions, report, n


@register("every-k", description="checkpoint every k-th block of the coarsened chain (what users do by "
                                 "hand); option k=, default: the fastest k that fits",
          graphs="chain", exact=False, offload=False)
def solve_every_k(graph: Graph, budget_bytes: int, *, time_limit_s: float = 60.0, offload: bool = False,
                  host_budget_bytes: int | None = None, k: int | None = None, depth: int | None = None,
                  **options: object) -> Proposal:
    """Keep the activations at the boundary of every k-th stage of ``coarsen(graph)`` (``depth=`` picks
    the module depth) and everything of the last segment; recompute the rest, as
    ``checkpoint_sequential`` does (Chen et al. 2016 with k = sqrt(n)). With ``k`` given, that plan; by
    default the k (1..stages) whose plan is fastest within the budget."""
    _no_options("every-k", options)
    if k is not None:
        chain = _chain_for(graph, depth)
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= max(len(chain), 1):
            raise MemplanError(f"every-k: k must be an integer from 1 to the number of stages "
                               f"({len(chain)} at module depth {chain.depth}), got {k!r}")
        actions = _every_k_actions(graph, chain, k)
        return Proposal(actions, status="feasible", stats={"k": k, "stages": len(chain), "depth": chain.depth})
    best_k, actions, report, n = every_k_search(graph, budget_bytes, depth)
    status = "feasible" if report.peak_bytes <= budget_bytes else "infeasible"
    return Proposal(actions, status=status, stats={"k": best_k, "stages": n})


# ---- a user's list ---------------------------------------------------------------------------------
def _module_matches(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _unknown_module(graph: Graph, name: str) -> MemplanError:
    import difflib

    prefixes: dict[str, None] = {}
    for op in graph.ops:
        parts = [p for p in op.module.split(".") if p]
        for d in range(1, len(parts) + 1):
            prefixes[".".join(parts[:d])] = None
    known = list(prefixes)
    close = difflib.get_close_matches(name, known, n=5, cutoff=0.5)
    shown = list(dict.fromkeys(close + sorted(known, key=lambda p: (p.count("."), p))))[:6]
    return MemplanError(
        f"manual: no op of graph {graph.name!r} ran in module {name!r}; known module prefixes include "
        f"{', '.join(repr(p) for p in shown) or '(none: the graph has no module names)'}"
        f"{f' ({len(known)} in all)' if len(known) > len(shown) else ''}")


@register("manual", description="a user's plan: checkpoint=[module prefixes] to recompute, or "
                                "tensors=[ids] to keep (everything else recomputed)",
          graphs="dag", exact=False, offload=False)
def solve_manual(graph: Graph, budget_bytes: int, *, time_limit_s: float = 60.0, offload: bool = False,
                 host_budget_bytes: int | None = None, checkpoint: Iterable[str] | str | None = None,
                 tensors: Iterable[int] | None = None, **options: object) -> Proposal:
    """The plan a user writes by hand, scored like any other.

    ``checkpoint=["transformer.h.0", ...]``: recompute the saved activations produced inside those
    modules, as ``torch.utils.checkpoint`` around each would. ``tensors=[ids]``: keep those saved
    activations and recompute every other one (Paddle's RecomputeOptimizer checkpoints); with both, the
    listed tensors are kept inside the checkpointed modules. Activations that cannot be recomputed are
    kept (counted in ``stats['kept_not_recomputable']``). The budget only decides whether it fits.
    """
    _no_options("manual", options)
    if checkpoint is None and tensors is None:
        raise MemplanError("manual: give checkpoint=[module prefixes] and/or tensors=[tensor ids]")
    saved = graph.saved_activations
    saved_set = set(saved)
    keep: set[int] = set()
    if tensors is not None:
        for t in tensors:
            if not isinstance(t, int) or isinstance(t, bool) or t not in saved_set:
                shown = ", ".join(map(str, saved[:8])) + (f", ... ({len(saved)} in all)" if len(saved) > 8 else "")
                raise MemplanError(f"manual: tensors lists {t!r}, which is not a saved activation of graph "
                                   f"{graph.name!r}; saved activations: {shown or '(none)'}")
            keep.add(t)
    if checkpoint is not None:
        prefixes = [checkpoint] if isinstance(checkpoint, str) else list(checkpoint)
        for p in prefixes:
            if not isinstance(p, str) or not any(_module_matches(op.module, p) for op in graph.ops):
                raise _unknown_module(graph, str(p))
        ops = graph.ops
        chosen = [t for t in saved
                  if any(_module_matches(ops[graph.tensors[t].producer].module, p) for p in prefixes)]
    else:
        chosen = list(saved)
    chosen = [t for t in chosen if t not in keep]
    actions = {t: Action.RECOMPUTE for t in chosen if graph.tensors[t].recomputable}
    return Proposal(actions, status="feasible",
                    stats={"recomputed": len(actions), "kept_not_recomputable": len(chosen) - len(actions)})


# ---- the least peak we can find cheaply ------------------------------------------------------------------
def _finest_chain(graph: Graph):
    """The chain at the deepest module depth: as many boundaries to choose from as the names allow."""
    max_depth = max((len([p for p in op.module.split(".") if p]) for op in graph.ops), default=0)
    return coarsen(graph, max_depth)


def _segment_actions(graph: Graph, chain, limit_bytes: int, count_kept: bool) -> Actions:
    """Cut the chain into segments and keep only the activations crossing into each segment (and all of
    the last one); the rest is recomputed. A segment grows while its saved bytes (plus, with
    ``count_kept``, the boundaries kept before it, which are live when it is rebuilt) stay within
    ``limit_bytes``: Chen et al. 2016's budgeted greedy, and with ``count_kept`` its refinement into
    REVOLVE's shape, where early segments are longer because fewer checkpoints sit below them."""
    saved = set(graph.saved_activations)
    tensors = graph.tensors
    keep: set[int] = set()
    segment = kept = 0
    last_start = 0
    for stage in chain.stages:
        if segment > 0 and (kept if count_kept else 0) + segment + stage.saved_bytes > limit_bytes:
            boundary = [t for t in stage.input_tensors if t in saved and t not in keep]
            keep.update(boundary)
            kept += sum(tensors[t].bytes for t in boundary)
            segment = 0
            last_start = stage.index
        segment += stage.saved_bytes
    for stage in chain.stages[last_start:]:
        keep.update(t for o in stage.ops for t in graph.ops[o].outputs)
    return {t: Action.RECOMPUTE for t in saved
            if t not in keep and tensors[t].recomputable and tensors[t].bytes > 0}


def _segment_search(graph: Graph, deadline: float) -> list[Actions]:
    """For both segment rules, the limit of least simulated peak: a doubling grid of limits from the
    largest stage to the whole chain, then a ternary search between the best point's neighbours.
    Returns the best plan of each rule."""
    chain = _finest_chain(graph)
    if len(chain) < 2:
        return []
    lo = max(1, max(s.saved_bytes for s in chain.stages))
    total = sum(s.saved_bytes for s in chain.stages)
    out = []
    for count_kept in (True, False):
        seen: dict[int, tuple[int, float, Actions]] = {}

        def peak(limit: int) -> tuple[int, float]:
            if limit not in seen:
                a = _segment_actions(graph, chain, limit, count_kept)
                r = _simulate(graph, a)
                seen[limit] = (r.peak_bytes, r.time_s, a)
            return seen[limit][:2]

        grid, limit = [], lo
        while limit < total:
            grid.append(limit)
            limit *= 2
        grid.append(total)
        for limit in grid:
            if time.perf_counter() > deadline:
                break
            peak(limit)
        if not seen:
            break
        best = min(seen, key=lambda b: peak(b))
        i = grid.index(best)
        a, b = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
        while b - a > max(2, lo // 4) and time.perf_counter() < deadline:
            m1, m2 = a + (b - a) // 3, b - (b - a) // 3
            if peak(m1) <= peak(m2):
                b = m2
            else:
                a = m1
        out.append(seen[min(seen, key=lambda b: peak(b))][2])
    return out


def _descend(graph: Graph, facts: _Facts, actions: Actions, *, offload: bool, deadline: float,
             budget: int | None = None) -> tuple[Actions, Report]:
    """Single-tensor moves (keep / recompute / offload) while one lowers the simulated (peak, time): the
    peak first, and at equal peak the time, which walks plateaus (within ``budget`` when given, the time
    alone). Moves on the activations at the peak's site are tried first; first improvement wins."""
    tensors = graph.tensors
    options = [Action.KEEP, Action.RECOMPUTE] + ([Action.OFFLOAD] if offload else [])
    current = dict(actions)
    report = _simulate(graph, current)

    def key(r: Report) -> tuple[int, float]:
        if budget is not None:
            return (0 if r.peak_bytes <= budget else r.peak_bytes, r.time_s)
        return (r.peak_bytes, r.time_s)

    def ordered() -> list[int]:
        site = _peak_site(graph, current, {}, report) if budget is None else _Site("none", -1, {})
        near = set(_candidates(graph, facts, current, site, lambda t: True))
        if site.phase == "backward":  # recomputed tensors rebuilt before the peak: keeping one splits the run
            near.update(t for t, a in current.items() if a == Action.RECOMPUTE
                        and site.replayed_at.get(tensors[t].producer, -1) > site.op)
        return sorted(facts.evictable, key=lambda t: (t not in near, -tensors[t].bytes))

    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        for t in ordered():
            for a in options:
                if a == current.get(t, Action.KEEP) or (a == Action.RECOMPUTE and not tensors[t].recomputable):
                    continue
                trial = dict(current)
                if a == Action.KEEP:
                    del trial[t]
                else:
                    trial[t] = a
                r = _simulate(graph, trial)
                if key(r) < key(report) and (budget is not None or r.peak_bytes <= report.peak_bytes):
                    current, report, improved = trial, r, True
                    break
            if improved or time.perf_counter() > deadline:
                break
    return current, report


def min_memory_actions(graph: Graph, offload: bool = False, *, time_limit_s: float = 1.0
                       ) -> tuple[Actions, dict[int, int]]:
    """The plan of least simulated peak that a cheap search finds, as (actions, prefetch_at).

    Starting points: segmentations of the finest chain (Chen's budgeted greedy and its REVOLVE-shaped
    refinement, each at the limit of least peak), every-k at the k of least peak, the greedy (and with
    ``offload`` the Capuchin) loop driven towards budget 0 (the lowest plan on its way), recompute-
    everything and, with ``offload``, everything offloaded and prefetched just before its first backward
    use. The best (on small graphs, each) is then improved by single-tensor moves until ``time_limit_s``.
    It is what Infeasible errors quote as the minimum feasible budget (``base.smallest_known_peak``)."""
    t0 = time.perf_counter()
    deadline = t0 + time_limit_s
    facts = _facts(graph)
    starts: list[tuple[Actions, dict[int, int]]] = [
        ({}, {}), ({t: Action.RECOMPUTE for t in facts.evictable if graph.tensors[t].recomputable}, {})]
    if offload:
        everything = {t: Action.OFFLOAD for t in facts.evictable}
        starts.append((everything, {t: facts.first_bwd_use[t] for t in everything}))
    starts += [(a, {}) for a in _segment_search(graph, t0 + 0.4 * time_limit_s)]
    starts.append((every_k_search(graph, None)[1], {}))
    for pick in ((_pick_dtr, _pick_capuchin) if offload else (_pick_dtr,)):
        out = _shrink(graph, 0, facts, pick, offload=offload, host_budget_bytes=None,
                      deadline=t0 + 0.6 * time_limit_s)
        starts.append((out.lowest[1], {}))
    scored = sorted(((_simulate(graph, a, p).peak_bytes, len(a), i) for i, (a, p) in enumerate(starts)))
    best_peak, _, i = scored[0]
    best = starts[i]
    # Descend from the best start; on small graphs from every start (distinct local optima are common).
    tries = [i for _, _, i in scored] if len(facts.evictable) <= 40 else [i]
    for i in tries:
        actions, prefetch_at = starts[i]
        if prefetch_at or time.perf_counter() > deadline:
            continue  # just-in-time prefetches are not single-tensor moves
        a, r = _descend(graph, facts, actions, offload=offload, deadline=deadline)
        if r.peak_bytes < best_peak:
            best_peak, best = r.peak_bytes, (a, {})
    return best
