"""``greedy``: DTR's eviction score (Kirisame et al., "Dynamic Tensor Rematerialization", ICLR 2021)
made offline. From keep-everything, repeatedly evict (recompute, or offload when it hides) the saved
activations with the smallest ``cost / (bytes x staleness)`` among those live at the simulated peak, then
give back what the final plan no longer needs. Fast on any graph; no optimality claim.
"""

from __future__ import annotations

import heapq

from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Action
from memplan.solvers.evict import EPS, Actions, Components, Facts, copy_stream, run_eviction
from memplan.solvers.registry import NO_OPTIONS, NoOptions, Proposal, register


def pick_dtr(graph: Graph, facts: Facts, actions: Actions, cands: list[int], target_bytes: int,
              offload: bool, host_budget_bytes: int | None) -> Actions:
    """DTR's order: smallest cost / (bytes x staleness) first, costs updated as neighbours go (lazy
    heap: a score only grows as components merge). An activation is offloaded instead when offload is
    allowed and its transfer hides in its access gap (cost ~ 0), or when it cannot be recomputed."""
    tensors = graph.tensors
    comps = Components(graph, facts, actions)
    stream = copy_stream(graph, facts, actions, host_budget_bytes) if offload else None

    def score(t: int) -> tuple[float, Action | None]:
        b, gap = tensors[t].bytes, facts.gap_s[t] + EPS
        if stream is not None and stream.hides(b, gap):
            return EPS / (b * gap), Action.OFFLOAD
        if tensors[t].recomputable:
            return comps.neighbourhood_cost(t) / (b * gap), Action.RECOMPUTE
        if stream is not None and stream.fits_host(b):  # the only way to free it: pay the exposed copy
            return (2 * b / stream.bandwidth + EPS) / (b * gap), Action.OFFLOAD
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



@register("greedy", description="DTR-style eviction (cost / bytes x staleness) at the simulated peak, "
                                "recompute or hidden offload; fast on any graph",
          graphs="dag", exact=False, offload=True, config=NoOptions)
def solve_greedy(graph: Graph, budget_bytes: int, *, time_limit_s: float = 60.0, offload: bool = False,
                 host_budget_bytes: int | None = None, config: NoOptions = NO_OPTIONS) -> Proposal:
    """Kirisame et al. 2021's eviction heuristic, offline: from keep-everything, evict the activations
    live at the simulated peak with the least ``recompute cost / (bytes x access gap)`` (cost includes
    the evicted neighbourhood it would replay), offloading instead when the copy hides in the gap; then
    keep again what the final plan has room for. Takes no options. Status ``feasible`` or ``infeasible``."""
    return run_eviction(pick_dtr, graph, budget_bytes, time_limit_s=time_limit_s, offload=offload,
                        host_budget_bytes=host_budget_bytes)
