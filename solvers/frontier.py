"""The overhead / budget frontier: a strategy's predicted overhead at each of several budgets."""

from __future__ import annotations

from typing import Any

from memplan.planner.core.errors import Infeasible
from memplan.planner.core.graph import Graph
from memplan.solvers.bounds import keep_all_report
from memplan.solvers.core import solve
from memplan.solvers.dp import dp_frontier


def solve_frontier(graph: Graph, budgets: list[int], method: str = "auto", **kw: Any) -> list[tuple[int, float | None]]:
    """(budget, predicted overhead) pairs: overhead is step time over keep-everything's, minus one;
    None where the budget is infeasible. The chain DP (``method="dp"`` without offload or options) reads
    every budget from one table (:func:`memplan.solvers.dp.dp_frontier`); other methods solve each."""
    if method == "dp" and not kw.get("offload") and set(kw) <= {"offload", "time_limit_s"}:
        return dp_frontier(graph, list(budgets))  # one DP table read at every budget
    base = keep_all_report(graph).time_s
    out: list[tuple[int, float | None]] = []
    for b in budgets:
        try:
            r = solve(graph, b, method, **kw)
            out.append((b, r.report.time_s / base - 1.0 if base > 0 else 0.0))
        except Infeasible:
            out.append((b, None))
    return out
