"""``capuchin``: Capuchin's per-tensor choice (Peng et al., ASPLOS 2020). Among the activations live at
the simulated peak, swap a tensor when its transfer hides in its access gap, otherwise recompute the ones
that free the most bytes per second of replay. Fast on any graph; no optimality claim.
"""

from __future__ import annotations

import heapq

from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Action
from memplan.planner.core.replay import replay
from memplan.solvers.evict import EPS, Actions, Facts, copy_stream, run_eviction
from memplan.solvers.registry import NO_OPTIONS, NoOptions, Proposal, register


def _replay_cost(graph: Graph, facts: Facts, missing: set[int], t: int) -> float:
    """Forward time to rebuild ``t`` from resident tensors: the ops of its replay
    (:func:`memplan.planner.core.replay.replay`: producers and their in-place initialisers), each once."""
    ops = graph.ops
    r = replay(graph, t, available=lambda u: not (u in missing or facts.missing_in_backward[u]))
    return sum(ops[p].time_s for p in r.ops)


def pick_capuchin(graph: Graph, facts: Facts, actions: Actions, cands: list[int], target_bytes: int,
                   offload: bool, host_budget_bytes: int | None) -> Actions:
    """Capuchin's order: first swap, longest access gap first, every tensor whose transfer hides in its
    gap; then recompute, most bytes freed per second of replay first (its MSPS)."""
    tensors = graph.tensors
    batch: Actions = {}
    freed = 0
    rest = list(cands)
    if offload:
        stream = copy_stream(graph, facts, actions, host_budget_bytes)
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
    heap = [(-tensors[t].bytes / (_replay_cost(graph, facts, missing, t) + EPS), t)
            for t in rest if tensors[t].recomputable]
    heapq.heapify(heap)
    while heap and freed < target_bytes:
        _, t = heapq.heappop(heap)
        msps = -tensors[t].bytes / (_replay_cost(graph, facts, missing, t) + EPS)
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



@register("capuchin", description="Capuchin-style: swap what hides in its access gap, recompute the most "
                                  "bytes per second of replay; recompute-only without offload",
          graphs="dag", exact=False, offload=True, config=NoOptions)
def solve_capuchin(graph: Graph, budget_bytes: int, *, time_limit_s: float = 60.0, offload: bool = False,
                   host_budget_bytes: int | None = None, config: NoOptions = NO_OPTIONS) -> Proposal:
    """Peng et al. 2020's policy: among the activations live at the simulated peak, swap (offload) those
    whose round trip ``2 x bytes / bandwidth`` fits in their access gap (time from last forward use to
    first backward use), longest gap first; then recompute by memory saved per second of replay. Without
    ``offload`` it is recompute-only. Takes no options. Status ``feasible`` or ``infeasible``."""
    return run_eviction(pick_capuchin, graph, budget_bytes, time_limit_s=time_limit_s, offload=offload,
                        host_budget_bytes=host_budget_bytes)
