"""The overhead / budget frontier: a strategy's predicted overhead at each of several budgets."""

from __future__ import annotations

from typing import Any

from memplan.planner.core.errors import Infeasible
from memplan.planner.core.graph import Graph
from memplan.solvers.bounds import keep_all_report
from memplan.solvers.core import solve
from memplan.solvers.dp import dp_frontier_points
from memplan.solvers.registry import FrontierPoint


def solve_frontier(graph: Graph, budgets: list[int], method: str = "auto", **kw: Any) -> list[tuple[int, float | None]]:
    """(budget, predicted overhead) pairs: overhead is step time over keep-everything's, minus one;
    None where the budget is infeasible (:func:`frontier_points` without the claims)."""
    return [(p.budget_bytes, p.overhead) for p in frontier_points(graph, budgets, method, **kw)]


def frontier_points(graph: Graph, budgets: list[int], method: str = "auto", **kw: Any) -> list[FrontierPoint]:
    """A :class:`FrontierPoint` per budget: the predicted overhead and what ``solve(graph, b, method, **kw)``
    claims there (status, and the space of plans it holds over: a heuristic's plan can beat an ``optimal``
    one only from outside that space, e.g. greedy's ``recompute_each`` against the oracle's default
    ``keep/recompute``). The chain DP (``method="dp"`` without offload or options) reads every budget from
    one table (:func:`memplan.solvers.dp.dp_frontier_points`); other methods solve each."""
    if method == "dp" and not kw.get("offload") and set(kw) <= {"offload", "time_limit_s"}:
        return dp_frontier_points(graph, list(budgets))  # one DP table read at every budget
    base = keep_all_report(graph).time_s
    out: list[FrontierPoint] = []
    for b in budgets:
        try:
            r = solve(graph, b, method, **kw)
            out.append(FrontierPoint(b, r.report.time_s / base - 1.0 if base > 0 else 0.0, r.status, r.space))
        except Infeasible:
            out.append(FrontierPoint(b, None, "infeasible", None))
    return out
