"""memplan.solvers: pure functions of (graph, budget) -> plan, scored by the simulator. No torch here.

Layout: :mod:`~memplan.solvers.registry` (the strategy contract and the registry; imports no strategy),
:mod:`~memplan.solvers.core` (``solve``: validation, scoring, the plan), :mod:`~memplan.solvers.bounds`,
:mod:`~memplan.solvers.frontier`, and one module per strategy, each registering itself on import:
``oracle``, ``greedy``, ``capuchin`` (sharing :mod:`~memplan.solvers.evict`), ``every_k``, ``manual``,
``min_memory``, ``multilevel``, ``auto``, ``dp`` (over the exact chain DP of the ``chain`` package), ``baselines``
(``chen``, ``revolve``, ``rotor``) and the ``ilp`` package. This package imports
every strategy module once, below, so that :func:`solvers` lists them all.
"""

# the strategy modules register themselves when imported; the import is the registration
from memplan.solvers import (  # noqa: F401
    auto,
    baselines,
    capuchin,
    dp,
    every_k,
    greedy,
    ilp,
    manual,
    min_memory,
    multilevel,
    oracle,
)
from memplan.solvers.auto import choose_method
from memplan.solvers.bounds import activation_bytes, keep_all_report, memory_lower_bound
from memplan.solvers.core import SolveResult, solve
from memplan.solvers.frontier import frontier_points, solve_frontier
from memplan.solvers.min_memory import smallest_known_peak
from memplan.solvers.registry import FrontierPoint, Proposal, SolverSpec, register, solvers

__all__ = [
    "FrontierPoint", "Proposal", "SolveResult", "SolverSpec", "activation_bytes", "choose_method", "frontier_points",
    "keep_all_report", "memory_lower_bound", "register", "smallest_known_peak", "solve", "solve_frontier", "solvers",
]
