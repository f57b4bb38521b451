"""memplan.solvers: pure functions of (graph, budget) -> plan, scored by the simulator. No torch here."""

from memplan.solvers.base import (
    Proposal,
    SolveResult,
    SolverSpec,
    activation_bytes,
    choose_method,
    keep_all_report,
    memory_lower_bound,
    register,
    smallest_known_peak,
    solve,
    solve_frontier,
    solvers,
)

__all__ = [
    "Proposal", "SolveResult", "SolverSpec", "activation_bytes", "choose_method", "keep_all_report",
    "memory_lower_bound", "register", "smallest_known_peak", "solve", "solve_frontier", "solvers",
]
