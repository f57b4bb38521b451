"""The least peak memplan can find cheaply: :func:`min_memory_actions` (a search combining the
segmentations of the finest chain, every-k, the eviction loops driven to budget 0, and single-tensor
descent), :func:`smallest_known_peak` (what :class:`~memplan.planner.core.errors.Infeasible` errors quote as
the minimum feasible budget). ``auto`` falls back to that plan (naming it ``min-memory``) when its
methods find none near the minimum budget.
"""

from __future__ import annotations

import time

from memplan.planner.core.graph import Graph, coarsen
from memplan.planner.core.plan import Action
from memplan.planner.core.simulator import Report, simulate_actions
from memplan.solvers.bounds import memory_lower_bound
from memplan.solvers.capuchin import pick_capuchin
from memplan.solvers.chain.each import chain_each_min_budget_bytes
from memplan.solvers.chain.solve import chain_min_budget_bytes
from memplan.solvers.every_k import every_k_search
from memplan.solvers.evict import Actions, Facts, candidates, graph_facts, peak_site, shrink, simulate
from memplan.solvers.greedy import pick_dtr
from memplan.solvers.multilevel import per_use_in_time
from memplan.solvers.oracle import oracle_min_peak, plan_count

MAX_EXACT_SAVED = 10      # smallest_known_peak enumerates every plan of graphs this small ...
MAX_EXACT_PLANS = 20_000  # ... when there are at most this many


class Scores:
    """The simulated report of each plan one search has scored, by plan, so that no plan is simulated
    twice: :func:`smallest_known_peak`'s plans are :func:`min_memory_actions`' starts too, and the
    recompute_each start (replays quadratic in a chain's length) is the costliest simulation of all."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.reports: dict[tuple[frozenset, frozenset], Report] = {}

    @staticmethod
    def _key(actions: Actions, prefetch_at: dict[int, int] | None) -> tuple[frozenset, frozenset]:
        return frozenset((t, a) for t, a in actions.items() if a != Action.KEEP), frozenset((prefetch_at or {}).items())

    def __call__(self, actions: Actions, prefetch_at: dict[int, int] | None = None) -> Report:
        key = self._key(actions, prefetch_at)
        if key not in self.reports:
            self.reports[key] = simulate_actions(self.graph, actions, prefetch_at=prefetch_at)
        return self.reports[key]

    def known(self, actions: Actions, prefetch_at: dict[int, int] | None = None) -> bool:
        """Whether the plan has been scored (reading its report costs nothing)."""
        return self._key(actions, prefetch_at) in self.reports

    def add(self, actions: Actions, prefetch_at: dict[int, int] | None, report: Report) -> None:
        """Record a report simulated elsewhere."""
        self.reports[self._key(actions, prefetch_at)] = report


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


def _segment_search(graph: Graph, deadline: float, scores: Scores) -> list[Actions]:
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

        def peak(limit: int, seen: dict = seen, count_kept: bool = count_kept) -> tuple[int, float]:
            if limit not in seen:
                a = _segment_actions(graph, chain, limit, count_kept)
                r = scores(a)
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


def _descend(graph: Graph, facts: Facts, actions: Actions, *, offload: bool,
             deadline: float) -> tuple[Actions, Report]:
    """Single-tensor moves (keep / recompute / offload) while one lowers the simulated (peak, time): the
    peak first, and at equal peak the time, which walks plateaus. Moves on the activations at the peak's
    site are tried first; first improvement wins. (Making a plan faster within a budget is
    :func:`memplan.solvers.evict.polish`'s.)"""
    tensors = graph.tensors
    options = [Action.KEEP, Action.RECOMPUTE] + ([Action.OFFLOAD] if offload else [])
    current = dict(actions)
    report = simulate(graph, current)

    def key(r: Report) -> tuple[int, float]:
        return (r.peak_bytes, r.time_s)

    def ordered() -> list[int]:
        site = peak_site(graph, current, {}, report)
        near = set(candidates(graph, facts, current, site, lambda t: True))
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
                r = simulate(graph, trial)
                if key(r) < key(report):
                    current, report, improved = trial, r, True
                    break
            if improved or time.perf_counter() > deadline:
                break
    return current, report


def min_memory_actions(graph: Graph, offload: bool = False, *, time_limit_s: float = 1.0,
                       deadline: float | None = None, scores: Scores | None = None) -> tuple[Actions, dict[int, int]]:
    """The plan of least simulated peak that a cheap search finds, as (actions, prefetch_at).

    Starting points: segmentations of the finest chain (Chen's budgeted greedy and its REVOLVE-shaped
    refinement, each at the limit of least peak), every-k at the k of least peak, the greedy (and with
    ``offload`` the Capuchin) loop driven towards budget 0 (the lowest plan on its way), recompute-
    everything, recompute_each-everything where affordable (multi-level replays, which keep only their
    target) and, with ``offload``, everything offloaded and prefetched just before its first backward
    use. The best (on small graphs, each) is then improved by single-tensor moves until ``time_limit_s``.
    It is what Infeasible errors quote as the minimum feasible budget (:func:`smallest_known_peak`).
    ``deadline`` (a ``time.perf_counter()`` value; None: none) is the caller's: it cuts ``time_limit_s``
    short, and no start is made or scored after it (keep-everything always is), so the result is the best
    plan found by then. ``scores``: the caller's :class:`Scores`, to share the plans both simulate (the
    plan returned is in it)."""
    t0 = time.perf_counter()
    scores = scores or Scores(graph)
    stop = deadline  # the caller's deadline, if any: the starts below are made only before it

    def in_time() -> bool:
        return stop is None or time.perf_counter() < stop

    if deadline is not None:
        time_limit_s = max(0.0, min(time_limit_s, deadline - t0))
    deadline = t0 + time_limit_s
    facts = graph_facts(graph)
    starts: list[tuple[Actions, dict[int, int]]] = [
        ({}, {}), ({t: Action.RECOMPUTE for t in facts.evictable if graph.tensors[t].recomputable}, {})]
    per_use = per_use_in_time(graph, stop if stop is not None else deadline)  # multi-level replays: near
    if per_use is not None:                                                   # the bound on long chains
        starts.append((per_use, {}))
    if offload:
        everything = {t: Action.OFFLOAD for t in facts.evictable}
        starts.append((everything, {t: facts.first_bwd_use[t] for t in everything}))
    # each start below is made only before the caller's deadline (building the finest chain, every-k's search and
    # a shrink's first simulation take seconds on graphs of thousands of ops)
    if in_time():
        starts += [(a, {}) for a in _segment_search(graph, t0 + 0.4 * time_limit_s, scores)]
    if in_time():
        starts.append((every_k_search(graph, None, deadline=stop)[1], {}))
    for pick in ((pick_dtr, pick_capuchin) if offload else (pick_dtr,)):
        if in_time():
            out = shrink(graph, 0, facts, pick, offload=offload, host_budget_bytes=None,
                         deadline=t0 + 0.6 * time_limit_s)
            starts.append((out.lowest[1], {}))
    # past the deadline, the starts already scored still count (the segmentations are, by their search):
    # nothing new is simulated, keep-everything at least
    scored = sorted((scores(a, p).peak_bytes, len(a), i) for i, (a, p) in enumerate(starts)
                    if i == 0 or scores.known(a, p) or in_time())
    best_peak, _, i = scored[0]
    best = starts[i]
    # Descend from the best start; on small graphs from every start (distinct local optima are common).
    tries = [i for _, _, i in scored] if len(facts.evictable) <= 40 else [i]
    for i in tries:
        actions, prefetch_at = starts[i]
        if prefetch_at or time.perf_counter() > deadline:
            continue  # just-in-time prefetches are not single-tensor moves
        a, r = _descend(graph, facts, actions, offload=offload, deadline=deadline)
        scores.add(a, {}, r)
        if r.peak_bytes < best_peak:
            best_peak, best = r.peak_bytes, (a, {})
    return best


def smallest_known_peak(graph: Graph, *, offload: bool = False, deadline: float | None = None) -> int:
    """:func:`least_peak`'s peak."""
    return least_peak(graph, offload=offload, deadline=deadline)[0]


def least_peak(graph: Graph, *, offload: bool = False, deadline: float | None = None) -> tuple[int, bool]:
    """(peak, proven): the smallest simulated peak among memplan's low-memory plans: keep-everything, recompute-
    everything, recompute_each-everything (where affordable), offload-everything (when allowed) and
    :func:`min_memory_actions`; on chains, the exact DP's
    least budget; on graphs of at most
    ``MAX_EXACT_SAVED`` saved activations, the oracle's exact minimum. It is achievable, so it is what an
    Infeasible error reports as the minimum feasible budget.

    ``deadline`` (a ``time.perf_counter()`` value; None: none) bounds the search: no step (a plan's
    simulation, the search, the chain DP, the oracle) starts after it, so it returns at most one step
    past it with the least peak found by then: keep-everything's at worst, achievable, perhaps not the least.
    ``proven``: no plan peaks lower: the peak meets the memory lower bound, or the oracle enumerated every
    plan (with ``offload``, at every prefetch point; recompute_each too where that space is affordable,
    else keep / recompute / offload plans); otherwise it is the least a search found, and another strategy
    may fit below it."""
    def in_time() -> bool:
        return deadline is None or time.perf_counter() < deadline

    saved = graph.saved_activations
    recomputable = {t: Action.RECOMPUTE for t in saved if graph.tensors[t].recomputable}
    plans: list[tuple[dict[int, Action], dict[int, int]]] = [({}, {}), (recomputable, {})]
    scores = Scores(graph)  # each plan simulated once, here and in min_memory_actions
    per_use = per_use_in_time(graph, deadline)  # recompute_each: a replay keeps only its target
    if per_use is not None:
        peak = scores(per_use).peak_bytes
        if peak <= memory_lower_bound(graph):
            return peak, True  # at the lower bound: no plan goes lower
        plans.append((per_use, {}))
    if offload:
        plans.append(({t: Action.OFFLOAD for t in saved}, {}))
    best = scores({}).peak_bytes
    for actions, prefetch_at in plans[1:]:
        if in_time() or scores.known(actions, prefetch_at):  # one scored already counts past the deadline
            best = min(best, scores(actions, prefetch_at).peak_bytes)
    if in_time():
        actions, prefetch_at = min_memory_actions(graph, offload=offload, deadline=deadline, scores=scores)
        best = min(best, scores(actions, prefetch_at).peak_bytes)
    # a chain: the DP knows the exact least keep/recompute budget, and on short chains the exact least
    # budget of every plan without offload (then proven, unless offload could go lower)
    proven = False
    for least_of in (chain_min_budget_bytes, chain_each_min_budget_bytes):
        exact = least_of(graph, deadline=deadline) if in_time() else None
        if exact is not None:
            best = min(best, exact)
            proven = proven or (least_of is chain_each_min_budget_bytes and not offload and best == exact)
    proven = proven or best <= memory_lower_bound(graph)
    if len(saved) <= MAX_EXACT_SAVED:  # small enough to know the exact minimum (with recompute_each when
        # that space is small; else without it; with offload, perhaps only at default prefetch)
        for prefetch, per_use in (("choose", True), ("choose", False), ("default", False)):
            limit = MAX_EXACT_PLANS // 16 if per_use else MAX_EXACT_PLANS
            if in_time() and plan_count(graph, offload=offload, prefetch=prefetch, per_use=per_use) <= limit:
                best = min(best, oracle_min_peak(graph, offload=offload, prefetch=prefetch, per_use=per_use))
                proven = proven or prefetch == "choose"  # every plan enumerated, every prefetch point
                break
    return best, proven
