"""The eviction loop the heuristics share: facts about a graph, where a plan's simulated peak is and
which saved activations could lower it, and the loop that evicts at the peak until the plan fits
(:func:`shrink`), then keeps again what the final plan has room for (:func:`give_back`) and makes it faster
within the budget (:func:`polish`, which any fitting plan may go through).

A strategy supplies a :data:`Picker` (which activations to evict, and how: ``greedy.pick_dtr``,
``capuchin.pick_capuchin``) and :func:`run_eviction` does the rest. Every candidate plan is simulated:
the peak's location picks the next move, and no plan is returned whose simulated peak was not checked.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Action
from memplan.planner.core.simulator import Report, simulate_actions
from memplan.solvers.bounds import memory_lower_bound
from memplan.solvers.multilevel import per_use_in_time
from memplan.solvers.registry import Proposal

Actions = dict[int, Action]
EPS = 1e-12

# ---- per-graph facts ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Facts:
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


def graph_facts(graph: Graph) -> Facts:
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
    return Facts(saved, evictable, fwd_free_at, release_at, first_bwd, gap, cost, missing, neighbours,
                  fwd_total, float(sum(bwd)))


def simulate(graph: Graph, actions: Actions, prefetch_at: dict[int, int] | None = None,
              timeline: bool = False) -> Report:
    return simulate_actions(graph, actions, prefetch_at=prefetch_at, timeline=timeline)


# ---- where the simulated peak is, and what could lower it ---------------------------------------------
@dataclass(frozen=True)
class Site:
    """Where a plan's simulated peak happens: during forward op ``op``, during backward step ``op``
    (its replays and prefetches included), or nowhere a plan can change (``none``: the optimizer step,
    fixed memory). ``replayed_at`` maps each op replayed in backward to the highest (earliest) backward
    step that replays it."""

    phase: str
    op: int
    replayed_at: dict[int, int]


def peak_site(graph: Graph, actions: Actions, prefetch_at: dict[int, int], report: Report) -> Site:
    if report.peak_phase == "forward":
        return Site("forward", report.peak_op, {})
    if report.peak_phase not in ("backward", "recompute", "prefetch", "wait"):
        return Site("none", -1, {})
    # Backward: replays and prefetches are labelled with the op they touch, not the step they serve,
    # so read the timeline: each event belongs to the next backward step that follows it.
    events = simulate(graph, actions, prefetch_at, timeline=True).timeline
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
    return Site("backward", step_of[peak_k], replayed)


def candidates(graph: Graph, facts: Facts, actions: Actions, site: Site, allowed: Callable[[int], bool]
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
class Components:
    """Union-find over the tensors missing in backward (DTR's 'evicted neighbourhoods'): recomputing a
    tensor costs its producer plus the components around it, which DTR's h_DTR_eq approximates."""

    def __init__(self, graph: Graph, facts: Facts, actions: Actions):
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
class Stream:
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


def copy_stream(graph: Graph, facts: Facts, actions: Actions, host_budget_bytes: int | None) -> Stream:
    st = Stream(graph.host_bandwidth_bytes_per_s, 0.9 * min(facts.fwd_time_s, facts.bwd_time_s),
                 host_left=float("inf") if host_budget_bytes is None else float(host_budget_bytes))
    for t, a in actions.items():
        if a == Action.OFFLOAD:
            st.add(graph.tensors[t].bytes)
    return st


Picker = Callable[[Graph, Facts, Actions, list[int], int, bool, "int | None"], Actions]


# ---- the shared loop: evict at the peak until it fits, then give back what is not needed -------------
@dataclass
class Outcome:
    actions: Actions
    report: Report
    lowest: tuple[int, Actions]   # (peak, actions) of the lowest-peak plan seen on the way
    sims: int
    rounds: int
    timed_out: bool


def left_behind(graph: Graph, facts: Facts, actions: Actions, site: Site) -> list[int]:
    """Recomputed activations resident at a backward ``site`` only because a replay for another tensor
    re-created them there and keeps them until their own backward (checkpointing's rule): their producer
    was replayed at or above the site's step and their own first backward reader is below it. Planned
    ``recompute_each`` instead, that replay frees them after its last use and their own backward replays
    them again (:func:`memplan.planner.core.replay.kept_by_replays`)."""
    if site.phase != "backward":
        return []
    s, tensors = site.op, graph.tensors
    return [t for t, a in actions.items() if a == Action.RECOMPUTE and facts.first_bwd_use[t] < s
            and site.replayed_at.get(tensors[t].producer, -1) >= s]


def pick_per_use(graph: Graph, facts: Facts, cands: list[int], target_bytes: int) -> Actions:
    """``recompute_each`` for the left-behind activations (:func:`left_behind`) that free the most bytes
    per second of extra replay (their producer's time, paid again by their own backward) first, until
    ``target_bytes`` are freed."""
    tensors = graph.tensors
    batch: Actions = {}
    freed = 0
    for t in sorted(cands, key=lambda t: (-tensors[t].bytes / (facts.cost_s[t] + EPS), t)):
        if freed >= target_bytes:
            break
        batch[t] = Action.RECOMPUTE_EACH
        freed += tensors[t].bytes
    return batch


def shrink(graph: Graph, budget: int, facts: Facts, pick: Picker, *, offload: bool,
            host_budget_bytes: int | None, deadline: float, max_sims: int = 400, per_use: bool = False) -> Outcome:
    """From keep-everything, evict a batch among the activations live at the simulated peak, chosen by
    ``pick`` and sized to the excess, until the peak fits ``budget``. A batch that raises the peak is
    halved, and a single activation that does is not tried again. With ``per_use``, a single activation
    whose recomputation raises the peak is tried as ``recompute_each`` first, and when nothing is left
    to evict at a backward peak, recomputed activations that replays leave behind there become
    ``recompute_each`` (:func:`pick_per_use`: multi-level replays, memory for compute). Returns the last
    plan (fitting or not) and the lowest-peak plan seen."""
    floor = memory_lower_bound(graph)
    tensors = graph.tensors

    def allowed(t: int) -> bool:
        return tensors[t].recomputable or offload

    actions: Actions = {}
    report = simulate(graph, actions)
    lowest = (report.peak_bytes, dict(actions))
    sims, rounds, timed_out = 1, 0, False
    tabu: set[int] = set()
    while report.peak_bytes > budget:
        if time.perf_counter() > deadline or sims >= max_sims:
            timed_out = True
            break
        rounds += 1
        site = peak_site(graph, actions, {}, report)
        sims += site.phase == "backward"
        cands = [t for t in candidates(graph, facts, actions, site, allowed) if t not in tabu]
        # Evict no more than half of what lies above the lower bound at once: evictions interact, and a
        # smaller step lets the next simulation say where the peak went.
        target = max(1, min(report.peak_bytes - budget, (report.peak_bytes - floor) // 2))
        batch = pick(graph, facts, actions, cands, target, offload, host_budget_bytes) if cands else {}
        if not batch and per_use:
            behind = [t for t in left_behind(graph, facts, actions, site) if t not in tabu]
            batch = pick_per_use(graph, facts, behind, target)
        if not batch:
            break
        while True:
            trial = {**actions, **batch}
            r = simulate(graph, trial)
            sims += 1
            if r.peak_bytes <= report.peak_bytes:
                actions, report = trial, r
                break
            if len(batch) == 1:
                ((t, a),) = batch.items()
                if per_use and a == Action.RECOMPUTE:
                    # its replay would leave behind what raised the peak: rebuild it per use instead
                    batch = {t: Action.RECOMPUTE_EACH}
                    continue
                tabu.update(batch)
                break
            batch = dict(list(batch.items())[: len(batch) // 2])  # the best-scored half
        if report.peak_bytes < lowest[0]:
            lowest = (report.peak_bytes, dict(actions))
    return Outcome(actions, report, lowest, sims, rounds, timed_out)


def give_back(graph: Graph, facts: Facts, actions: Actions, budget: int) -> tuple[Actions, Report, int]:
    """Keep again the evicted activations the plan no longer needs to evict: on the plan's simulated
    timeline, an activation that is recomputed is absent from just after its last forward use until its
    producer's first replay; keeping it adds its bytes there and nowhere else (replays only shrink), so
    it comes back when that stretch has room. Most recompute time per byte first, then offloads (their
    device copy is absent at most from its last forward use to its first backward use). Returns the new
    actions, their report and how many came back; the result is re-simulated and dropped if wrong."""
    before = simulate(graph, actions, timeline=True)
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
    after = simulate(graph, new)
    if after.peak_bytes > budget or after.time_s > before.time_s:
        return actions, before, 0  # the stretch argument failed somewhere: keep the checked plan
    return new, after, back


def polish(graph: Graph, facts: Facts, actions: Actions, report: Report, budget: int, *,
           deadline: float) -> tuple[Actions, Report, int]:
    """Make a plan that fits ``budget`` faster without leaving it: each ``recompute_each`` activation, the
    dearest replay per byte first, is kept, or else recomputed (a replay that leaves it behind saves its
    own replay), where the simulated plan still fits and is faster; then :func:`give_back` keeps what has
    room; again while a round gains and time is left (no simulation is started that the last one says
    would end past ``deadline``). A plan that offloads is returned as it is: its prefetches are the
    caller's. Returns the new actions, their report and how many moves it made.

    A plan near the least peak is mostly ``recompute_each`` (the least-peak search's, the multi-level
    family's): on the U-Net's graph a budget 2.5% of its activations above the least peak got the
    multi-level plan at +672% step time, +113% polished from the least-peak plan."""
    actions = {t: a for t, a in actions.items() if a != Action.KEEP}
    if any(a == Action.OFFLOAD for a in actions.values()):
        return actions, report, 0
    tensors = graph.tensors
    moves, sim_s = 0, 0.0
    while True:
        gained = 0
        for t in sorted((t for t, a in actions.items() if a == Action.RECOMPUTE_EACH),
                        key=lambda t: (-facts.cost_s[t] / max(1, tensors[t].bytes), t)):
            for a in (Action.KEEP, Action.RECOMPUTE):
                if time.perf_counter() + sim_s > deadline:
                    return actions, report, moves
                trial = {**actions, t: a}
                if a == Action.KEEP:
                    del trial[t]
                started = time.perf_counter()
                r = simulate(graph, trial)
                sim_s = time.perf_counter() - started
                if r.peak_bytes <= budget and r.time_s < report.time_s:
                    actions, report = trial, r
                    gained += 1
                    moves += 1
                    break
        actions, report, back = give_back(graph, facts, actions, budget)
        moves += back
        if not (gained or back) or time.perf_counter() + sim_s > deadline:
            return actions, report, moves


def run_eviction(pick: Picker, graph: Graph, budget: int, *, time_limit_s: float, offload: bool,
         host_budget_bytes: int | None) -> Proposal:
    """:func:`shrink` with ``pick`` (``recompute_each`` moves allowed) until the plan fits ``budget``,
    then :func:`give_back` and :func:`polish`: a ``feasible`` proposal, or ``infeasible`` (with
    the lowest peak reached in ``stats``)."""
    t0 = time.perf_counter()
    deadline = t0 + time_limit_s
    facts = graph_facts(graph)
    out = shrink(graph, budget, facts, pick, offload=offload, host_budget_bytes=host_budget_bytes,
                  deadline=deadline, per_use=True)
    stats = {"simulations": out.sims, "rounds": out.rounds}
    if out.report.peak_bytes > budget:
        # moves chosen at the peak stop above what multi-level replays reach (a DAG's long skips): the least
        # memory replays reach, polished, where it fits (on random DAGs with long skips at GPU scale, greedy
        # refused 22 of 25 budgets only per-use plans reach)
        every = per_use_in_time(graph, deadline)
        lowest = simulate(graph, every) if every else None
        if lowest is not None and lowest.peak_bytes <= budget:
            actions, report, polished = polish(graph, facts, every, lowest, budget, deadline=deadline)
            stats.update(source="recompute_each", polished=polished, heuristic_time_s=time.perf_counter() - t0)
            return Proposal(actions, {}, "feasible", None, stats)
        stats["lowest_peak_bytes"] = out.lowest[0]
        stats["stopped"] = "time limit" if out.timed_out else "no eviction lowers the peak"
        return Proposal(status="infeasible", stats=stats)
    actions, report, back = give_back(graph, facts, out.actions, budget)
    actions, report, polished = polish(graph, facts, actions, report, budget, deadline=deadline)
    stats.update(given_back=back, polished=polished,
                 recomputed=sum(a == Action.RECOMPUTE for a in actions.values()),
                 recomputed_each=sum(a == Action.RECOMPUTE_EACH for a in actions.values()),
                 offloaded=sum(a == Action.OFFLOAD for a in actions.values()),
                 heuristic_time_s=time.perf_counter() - t0)
    return Proposal(actions, {}, "feasible", None, stats)
