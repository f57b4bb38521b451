"""The chain DP at a budget: pick the engine for a chain (:func:`engine_for`: exact grid, exact Pareto
frontier, or rounded grid), read its plan at a budget (:func:`read_plan`, :func:`solve_chain`) and the
exact least budget of a chain (:func:`chain_min_budget_bytes`, what Infeasible errors quote)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Action
from memplan.solvers.bounds import keep_all_report
from memplan.solvers.chain.grid import Grid
from memplan.solvers.chain.model import OpChain, op_chain
from memplan.solvers.chain.pareto import Pareto, TooLarge
from memplan.solvers.chain.table import Engine, OutOfTime, full_spare

Actions = dict[int, Action]

_GRID_CELLS = 12_000_000     # exact grid (memory unit = gcd of the chain's byte figures) up to this many cells
_PARETO_POINTS = 20_000_000  # exact Pareto frontiers while merging at most this many (memory, time) points
_ROUNDED_UNITS = 1_500       # otherwise memory in units, rounded up (sound): at least this many per row, and as
                             # many as the exact grid's cells allow (a 1,000-op chain at GPU scale: 1,500 units of
                             # 2.8 GB planned +24.9% where the heuristics found +14.9%; 12,000: +15.4%)


def engine_for(ch: OpChain, spare: int, deadline: float | None = None, *, exact_until: float | None = None) -> Engine:
    """The exact grid when its table is small enough, else the exact Pareto frontier, else a grid with
    memory rounded up to a unit chosen from the chain alone (so every budget reads the same table).
    Raises ``OutOfTime`` when a table is still being filled at ``deadline`` (a ``time.perf_counter()``
    value; None: none). ``exact_until``: where given, the Pareto frontier is given up at that time for the
    rounded grid (filled in a fraction of a second where the frontier runs for seconds before it proves too
    large: 4.7 s of a 5.1 s solve of a 1,000-op chain at GPU scale)."""
    spare = min(spare, full_spare(ch))
    g = ch.unit_gcd
    if (ch.n + 1) * (spare // g + 1) <= _GRID_CELLS:
        return Grid(ch, g, spare // g, deadline=deadline)
    pareto_until = deadline if exact_until is None else exact_until if deadline is None else min(exact_until, deadline)
    try:
        return Pareto(ch, spare, _PARETO_POINTS, pareto_until)
    except TooLarge:
        pass
    except OutOfTime:
        if exact_until is None or (deadline is not None and time.perf_counter() > deadline):
            raise
    units = max(_ROUNDED_UNITS, _GRID_CELLS // (ch.n + 1))
    unit = g * max(1, -(-(full_spare(ch) // g) // units))
    return Grid(ch, unit, spare // unit, exact=False, deadline=deadline)


def _chain_actions(ch: OpChain, kept: list[int]) -> Actions:
    keep = set(kept)
    return {t: Action.RECOMPUTE for i, t in enumerate(ch.tensors) if i not in keep}


@dataclass
class ChainSolution:
    actions: Actions
    time_s: float
    status: str
    lower_bound_s: float | None
    stats: dict


def read_plan(graph: Graph, ch: OpChain, engine: Engine, budget: int, base_s: float) -> ChainSolution | None:
    """The engine's plan at ``budget`` (None: none fits). A rounded engine's plan is ``feasible`` with a
    bound from the same table rounded down (``optimal`` when both agree)."""
    spare = budget - ch.fixed_bytes
    if budget < ch.const_peak_bytes or spare < 0:
        return None
    saved = engine.saved_time_s(spare)
    if saved is None:
        return None
    total = float(ch.time_s.sum())
    time_s = base_s + total - saved
    kept = engine.kept(spare)
    stats = {"engine": engine.kind, "exact_memory": engine.exact, "kept": len(kept)}
    if isinstance(engine, Grid):
        stats["unit_bytes"] = engine.unit
    if engine.exact:
        return ChainSolution(_chain_actions(ch, kept), time_s, "optimal", time_s, stats)
    low = Grid(ch, engine.unit, engine.M, round_down=True, exact=False).saved_time_s(spare)
    bound = base_s + total - (low if low is not None else saved)
    status = "optimal" if bound >= time_s * (1 - 1e-12) else "feasible"
    return ChainSolution(_chain_actions(ch, kept), time_s, status, min(bound, time_s), stats)


def solve_chain(graph: Graph, ch: OpChain, budget: int, deadline: float | None = None) -> ChainSolution | None:
    """The chain DP at one budget: exact (``optimal``) unless memory had to be rounded. With a ``deadline``
    the exact frontier gets half the time left before the rounded table; ``OutOfTime`` past it."""
    exact_until = None if deadline is None else time.perf_counter() + (deadline - time.perf_counter()) / 2
    engine = engine_for(ch, budget - ch.fixed_bytes, deadline, exact_until=exact_until)
    return read_plan(graph, ch, engine, budget, keep_all_report(graph).time_s)


def chain_min_budget_bytes(graph: Graph, *, deadline: float | None = None) -> int | None:
    """The least budget at which a keep / recompute plan of ``graph`` fits, exactly, when ``graph`` is a
    chain the DP solves exactly (package docstring); None otherwise, and when the DP's table is not filled
    by ``deadline`` (a ``time.perf_counter()`` value; None: none)."""
    ch = op_chain(graph)
    if ch is None:
        return None
    try:
        engine = engine_for(ch, full_spare(ch), deadline)
    except OutOfTime:
        return None
    if not engine.exact:
        return None
    low = engine.min_spare_bytes()
    return None if low is None else max(ch.const_peak_bytes, ch.fixed_bytes + low)
