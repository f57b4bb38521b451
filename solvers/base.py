"""Names that used to live here, for modules written against the old layout (``dp.py`` imports
``Proposal``, ``register``, ``keep_all_report`` and ``memory_lower_bound`` from here). New code imports
them from where they live: :mod:`memplan.solvers.registry` (the contract and the registry) and
:mod:`memplan.solvers.bounds`. Nothing is defined here; delete this module once nothing imports it.
"""

from memplan.solvers.bounds import activation_bytes, keep_all_report, memory_lower_bound
from memplan.solvers.registry import Proposal, SolverSpec, register, solvers

__all__ = ["Proposal", "SolverSpec", "activation_bytes", "keep_all_report", "memory_lower_bound", "register",
           "solvers"]
