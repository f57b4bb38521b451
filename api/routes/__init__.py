"""One router per resource: plans, simulate, frontier, solvers, health."""
