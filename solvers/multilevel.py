"""``multilevel``: two-level checkpointing with per-use replays (``recompute_each``) on a graph's cut
points, the time-for-memory trade that one-level checkpointing cannot make on long chains (an unrolled
recurrent cell: the lower bound is one time step's saved tensors, while one-level plans hold about
sqrt(n) states plus one segment's saved tensors).

A *cut point* is a forward position whose crossing activations (made before it, read at or after it) are
few bytes: the hidden state between two steps of a recurrent cell, the residual stream between blocks
(:func:`cut_points`). A plan of the family ``(k0, k1, inner)``:

* level 0: the saved crossing tensors of every ``k0``-th cut are kept (checkpoints stored in forward);
* level 1: those of every ``k1``-th cut in between are ``recompute``: a replay that passes them leaves
  them behind until their own backward (checkpoints stored during backward, as REVOLVE's advances do);
* every other saved activation that can be rebuilt is ``inner`` (``recompute_each``: a replay keeps
  only its target, so a step's backward replays from the nearest checkpoint each time it needs a
  tensor; or ``recompute``).

``k0`` past the last cut keeps none (everything replayed from the inputs: memory near the lower bound at
quadratic compute); ``k1`` past it leaves none behind (one-level checkpointing with per-use replays). The strategy simulates a
grid of these plans and returns the fastest within the budget (Griewank & Walther 2000 for the
time-memory trade of nested checkpoints; Chen et al. 2016 section 4 for the two-level recursion).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Action
from memplan.planner.core.simulator import Report, simulate_actions
from memplan.solvers.registry import NO_OPTIONS, NoOptions, Proposal, register

Actions = dict[int, Action]
Family = tuple[int, int, Action]  # (k0, k1, inner); k0 or k1 > len(cuts): that level is empty; inner
                                  # keep: the keep-everything plan


def cut_points(graph: Graph) -> list[tuple[int, ...]]:
    """The crossing tensor sets of the graph's cut points, in forward order: at each op, the activations
    made before it and read at or after it; a cut is the first op of a run with the same set whose bytes
    are at most half the median over all ops (the narrow waists of the forward), or, when that leaves
    fewer than two (a uniform chain), at most the median. Empty sets are skipped."""
    tensors = graph.tensors
    last_read: dict[int, int] = {}
    for op in graph.ops:
        for t in op.inputs:
            last_read[t] = op.id
    by_producer: dict[int, list[int]] = {}
    for t in tensors:
        if t.kind == "activation" and t.producer is not None and last_read.get(t.id, -1) > t.producer:
            by_producer.setdefault(t.producer, []).append(t.id)
    live: set[int] = set()
    sets: list[tuple[int, ...]] = []
    for op in graph.ops:
        live = {t for t in live if last_read[t] >= op.id}
        sets.append(tuple(sorted(live)))
        live.update(by_producer.get(op.id, ()))
    sizes = [sum(tensors[t].bytes for t in s) for s in sets]
    if not sizes:
        return []
    cuts: list[tuple[int, ...]] = []
    for waist in (statistics.median(sizes) / 2, statistics.median(sizes)):  # a uniform chain: the median
        cuts = [s for p, s in enumerate(sets) if s and sizes[p] <= waist and (p == 0 or sets[p - 1] != s)]
        if len(cuts) >= 2:
            break
    return cuts


def family_actions(graph: Graph, cuts: list[tuple[int, ...]], family: Family) -> Actions:
    """The plan of ``family`` = (k0, k1, inner) on ``cuts`` (module docstring)."""
    k0, k1, inner = family
    if inner == Action.KEEP:
        return {}
    tensors = graph.tensors
    actions: Actions = {t: inner for t in graph.saved_activations
                        if tensors[t].recomputable and tensors[t].bytes > 0}
    saved = set(graph.saved_activations)
    for j, cut in enumerate(cuts):
        for t in cut:
            if t not in saved:
                continue
            if k0 <= len(cuts) and j % k0 == 0:
                actions.pop(t, None)
            elif k1 <= len(cuts) and j % k1 == 0 and t in actions:
                actions[t] = Action.RECOMPUTE
    return actions


def _grid(n: int) -> list[int]:
    """1..n+1 densely for small n, geometrically (ratio about 1.4) beyond."""
    out, k = [], 1
    while k <= n:
        out.append(k)
        k = k + 1 if k < 8 else int(k * 1.4)
    return [*out, n + 1]


@dataclass
class _Search:
    """Simulated family plans of one graph, memoised (a budget bisection asks for the same plans)."""

    graph: Graph
    cuts: list[tuple[int, ...]]
    seen: dict[Family, tuple[Report, Actions]]

    def __call__(self, family: Family) -> tuple[Report, Actions]:
        if family not in self.seen:
            actions = family_actions(self.graph, self.cuts, family)
            self.seen[family] = (simulate_actions(self.graph, actions), actions)
        return self.seen[family]

    def families(self) -> list[Family]:
        """Every (k0, k1, inner) of the grid, the cheapest to simulate (fewest replays) first."""
        n = len(self.cuts)
        # inner recompute: one level (a replay keeps what it passes); level-1 spacings double
        out: list[Family] = [(1, n + 1, Action.KEEP)]  # keep everything
        out += [(k0, n + 1, Action.RECOMPUTE) for k0 in _grid(n)]
        for k0 in _grid(n):
            out += [(k0, 1 << i, Action.RECOMPUTE_EACH) for i in range(n.bit_length()) if 1 << i < k0]
            out.append((k0, n + 1, Action.RECOMPUTE_EACH))
        return out


def per_use_everything(graph: Graph, max_replayed_ops: int = 1_000_000) -> Actions | None:
    """Every saved activation that can be rebuilt as ``recompute_each`` (each backward step replays from
    the inputs: the least memory replays can reach, at quadratic compute), or None when simulating it
    would replay more than about ``max_replayed_ops`` ops (ops times rebuildable saved tensors / 2)."""
    tensors = graph.tensors
    actions = {t: Action.RECOMPUTE_EACH for t in graph.saved_activations
               if tensors[t].recomputable and tensors[t].bytes > 0}
    if len(graph.ops) * len(actions) // 2 > max_replayed_ops:
        return None
    return actions


# what simulating a recompute_each plan costs per op it replays (1,000-op chain: 500,000 replayed ops, 5.4 s on
# the 2-core benchmark machine): a start is made only when its simulation fits in what is left of a deadline
_REPLAYED_OP_S = 20e-6


def per_use_in_time(graph: Graph, deadline: float | None) -> Actions | None:
    """The recompute_each-everything start, or None when its simulation would not end before ``deadline``
    (None: no deadline, only :func:`per_use_everything`'s own size limit)."""
    if deadline is None:
        return per_use_everything(graph)
    left_s = deadline - time.perf_counter()
    return per_use_everything(graph, max_replayed_ops=int(left_s / _REPLAYED_OP_S)) if left_s > 0 else None


def searcher(graph: Graph) -> _Search:
    """The memoised family search of ``graph`` (cached on the graph, as the simulator's static facts)."""
    s = graph.__dict__.get("_memplan_multilevel")
    if s is None:
        s = _Search(graph, cut_points(graph), {})
        graph.__dict__["_memplan_multilevel"] = s
    return s


def multilevel_search(graph: Graph, budget: int | None, *, deadline: float) -> tuple[Family, Actions, Report] | None:
    """The fastest family plan within ``budget`` (``None``: the one of least peak, then least time) among
    those simulated before ``deadline``; None when the graph has fewer than two cut points."""
    search = searcher(graph)
    if len(search.cuts) < 2:
        return None
    families = search.families()
    if budget is not None and search(families[0])[0].peak_bytes <= budget:
        families = families[:1]  # keep-everything fits: nothing is faster
    for family in families:
        if time.perf_counter() > deadline:
            break
        search(family)

    def key(f: Family) -> tuple:
        r = search.seen[f][0]
        if budget is None:
            return (r.peak_bytes, r.time_s)
        return (r.peak_bytes > budget, r.time_s if r.peak_bytes <= budget else r.peak_bytes)

    best = min(search.seen, key=key)
    report, actions = search.seen[best]
    return best, actions, report


@register("multilevel", description="two-level checkpointing on the graph's cut points with per-use "
                                    "replays (recompute_each): trades compute for memory down to the lower "
                                    "bound on long chains such as unrolled recurrent cells",
          graphs="dag", exact=False, offload=False, config=NoOptions)
def solve_multilevel(graph: Graph, budget_bytes: int, *, time_limit_s: float = 60.0, offload: bool = False,
                     host_budget_bytes: int | None = None, config: NoOptions = NO_OPTIONS) -> Proposal:
    """The fastest plan of the two-level family (module docstring) whose simulated peak fits
    ``budget_bytes``; ``infeasible`` with the least-peak plan when none does (or with keep-everything
    when the graph has no cut points)."""
    found = multilevel_search(graph, budget_bytes, deadline=time.perf_counter() + time_limit_s)
    n = len(searcher(graph).cuts)
    if found is None:  # no chain of cut points: keep everything, if that fits
        fits = simulate_actions(graph, {}).peak_bytes <= budget_bytes
        return Proposal({}, status="feasible" if fits else "infeasible", stats={"cuts": n})
    (k0, k1, inner), actions, report = found
    status = "feasible" if report.peak_bytes <= budget_bytes else "infeasible"
    return Proposal(actions, status=status, stats={
        "cuts": n, "k0": k0 if k0 <= n else None, "k1": k1 if k1 <= n else None, "inner": inner.value,
        "plans_simulated": len(searcher(graph).seen)})
