"""The exhaustive oracle: every keep / recompute (/ offload) assignment of every saved activation,
each scored by the simulator. Exact by construction, exponential in size: for graphs of up to about 12
saved activations, as the reference the other solvers are proved against."""

from __future__ import annotations

import itertools
import time

from memplan.planner.graph import Graph
from memplan.planner.plan import Action
from memplan.planner.simulator import simulate_actions
from memplan.solvers.base import Proposal, register

MAX_SAVED = 14


@register("oracle", description="exhaustive search over every plan (tiny graphs only; the reference)",
          exact=True, offload=True, max_ops=MAX_SAVED)
def solve_oracle(graph: Graph, budget_bytes: int, *, time_limit_s: float = 60.0, offload: bool = False,
                 host_budget_bytes: int | None = None, **_: object) -> Proposal:
    """Minimise simulated step time subject to simulated peak <= budget (ties: lower peak, then fewer
    non-keep actions). Prefetch points are the simulator's defaults. ``status`` is ``optimal`` when the
    enumeration finished, ``timeout`` otherwise."""
    saved = graph.saved_activations
    choices = []
    for t in saved:
        opts = [Action.KEEP]
        if graph.tensors[t].recomputable:
            opts.append(Action.RECOMPUTE)
        if offload:
            opts.append(Action.OFFLOAD)
        choices.append(opts)
    best: tuple[float, int, int] | None = None
    best_actions: dict[int, Action] = {}
    deadline = time.perf_counter() + time_limit_s
    tried = 0
    for combo in itertools.product(*choices):
        actions = {t: a for t, a in zip(saved, combo, strict=True) if a != Action.KEEP}
        r = simulate_actions(graph, actions)
        tried += 1
        if r.peak_bytes <= budget_bytes and (host_budget_bytes is None or r.host_peak_bytes <= host_budget_bytes):
            key = (r.time_s, r.peak_bytes, len(actions))
            if best is None or key < best:
                best, best_actions = key, actions
        if time.perf_counter() > deadline:
            status = "timeout" if best else "infeasible"
            return Proposal(best_actions, status=status, stats={"plans_tried": tried})
    if best is None:
        return Proposal(status="infeasible", stats={"plans_tried": tried})
    return Proposal(best_actions, status="optimal", lower_bound_s=best[0], stats={"plans_tried": tried})


def oracle_min_peak(graph: Graph, *, offload: bool = False) -> int:
    """The exact smallest simulated peak over all plans (tiny graphs only)."""
    saved = graph.saved_activations
    choices = [[Action.KEEP] + ([Action.RECOMPUTE] if graph.tensors[t].recomputable else [])
               + ([Action.OFFLOAD] if offload else []) for t in saved]
    return min(simulate_actions(graph, {t: a for t, a in zip(saved, combo, strict=True) if a != Action.KEEP}).peak_bytes
               for combo in itertools.product(*choices))
