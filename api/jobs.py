"""What the service's workers run: pure functions from a graph (JSON text or object) and plain arguments
to JSON-able dicts, shaped like the response schemas. They import memplan's core only (no FastAPI), so a
worker process starts quickly; memplan's errors raised here reach the server intact (they pickle).
"""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import ValidationError

from memplan.planner.core.errors import GraphError, MemplanError
from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Plan
from memplan.planner.core.simulator import simulate
from memplan.planner.core.units import MAX_BUDGET_FRACTION, parse_budget

# Step times beyond this are refused: sums of them (recompute replays included) must stay finite, or the
# figures would not serialise.
_MAX_TOTAL_S = 1e290


def warm_up() -> list[str]:
    """Import and register every solver (run once per worker at start); returns their names."""
    from memplan.solvers import solvers

    return sorted(solvers())


def load_graph(graph: Graph | str) -> Graph:
    """A validated graph from its JSON text (what travels to a worker process: the canonical text of a
    graph a parse worker has validated, read by pydantic-core directly) or the object itself."""
    if isinstance(graph, Graph):
        g = graph
    else:
        try:
            g = Graph.model_validate_json(graph)
        except ValidationError:  # not text the service made: say what is wrong as the CLI's loader does
            g = Graph.from_json(graph, source="graph")
    check_finite(g)
    return g


def check_finite(g: Graph) -> None:
    """Refuse graphs whose figures overflow when added up (each is finite, their sums need not be)."""
    total_s = g.optimizer_time_s + sum(o.time_s + o.backward_time_s for o in g.ops)
    total_bytes = sum(t.bytes for t in g.tensors)
    transfer_s = 2.0 * float(total_bytes) / g.host_bandwidth_bytes_per_s
    worst = (len(g.ops) + 2) * total_s + transfer_s
    if not math.isfinite(worst) or worst > _MAX_TOTAL_S:
        raise GraphError(f"graph: its op times and transfer times ({total_s:.3g} s of compute, "
                         f"{transfer_s:.3g} s of copies) are too large to add up; use seconds")


def resolve_budget(value: int | str | None, graph: Graph, *, fraction: float | None = None) -> int | None:
    """Bytes from a budget as given (:func:`memplan.planner.core.units.parse_budget`; ``50%`` is of ``graph``'s
    keep-everything activation memory), or from ``fraction`` of that memory (``0.5`` is ``50%``) when no
    ``value`` is given; None when neither is. The one place the CLI, the service and the distributed
    launcher turn a budget into bytes."""
    from memplan.solvers import activation_bytes

    fixed = graph.fixed.resident_bytes
    if value is None and fraction is not None:
        if not (math.isfinite(fraction) and 0.0 <= fraction <= MAX_BUDGET_FRACTION):
            raise MemplanError(f"budget_fraction {fraction!r} is out of range (0 to {MAX_BUDGET_FRACTION:g})")
        return int(fixed + fraction * activation_bytes(graph))
    if value is None:
        return None
    return parse_budget(value, activation_bytes=lambda: activation_bytes(graph), fixed_bytes=fixed)


def solve_states(states: str | None) -> bool | str | None:
    """:func:`memplan.solvers.solve`'s ``states`` from a request's (``"auto"``, ``"stream"``, ``"host"``,
    ``"none"``, or None: follow ``offload``)."""
    return {None: None, "none": False, "auto": True}.get(states, states)


def state_summary(graph: Graph, result: Any) -> dict[str, Any]:
    """What a plan does with the model states, and its predicted step in parts (the report's): the
    ``memplan solve --json`` figures and the service's ``StateSummary``. ``result``: a ``SolveResult``."""
    r = result.report
    streamed, hosted = result.plan.streamed(), result.plan.hosted()
    return {"state_units": len(graph.state_units), "streamed_units": len(streamed), "hosted_units": len(hosted),
            "streamed_state_bytes": sum(graph.state_units[u].state_bytes for u in streamed),
            "hosted_state_bytes": sum(graph.state_units[u].state_bytes for u in hosted),
            "host_peak_bytes": r.host_peak_bytes,
            "predicted_parts_s": {"forward": r.forward_time_s, "backward": r.backward_time_s,
                                  "recompute": r.recompute_time_s, "exposed_transfers": r.exposed_transfer_s,
                                  "optimizer": r.optimizer_time_s, "host_optimizer": r.host_optimizer_time_s,
                                  "waits_for_host": r.host_wait_s}}


def _jsonable(obj: Any) -> Any:
    """Solver statistics as plain JSON (numbers that are not finite become strings)."""
    def default(o: Any) -> Any:
        return str(o)
    text = json.dumps(obj, default=default, allow_nan=True)
    return json.loads(text, parse_constant=lambda c: c)


def _overhead(time_s: float, base_s: float) -> float:
    return time_s / base_s - 1.0 if base_s > 0 else 0.0


def plan_job(graph: Graph | str, *, budget: int | str | None, solver: str, time_limit_s: float,
             offload: bool, host_budget: int | str | None, budget_fraction: float | None = None,
             fuse: str | None = None, states: str | None = None) -> dict[str, Any]:
    """Solve; returns a :class:`memplan.api.schemas.PlanResponse` without ``cache_hit``. ``states``: the
    request's (:func:`solve_states`).

    Raises :class:`memplan.planner.core.errors.Infeasible` (with ``min_feasible_bytes``) and the other
    :class:`MemplanError` s for input the user can fix.
    """
    from memplan.solvers import keep_all_report, solve

    g = load_graph(graph)
    budget_bytes = resolve_budget(budget, g, fraction=budget_fraction)
    host_bytes = None if host_budget is None else parse_budget(host_budget)  # bytes: never a percentage
    result = solve(g, budget_bytes, solver, time_limit_s=time_limit_s, offload=offload,
                   host_budget_bytes=host_bytes, fuse=fuse, states=solve_states(states))
    base = keep_all_report(g)
    r = result.report
    return {
        "plan": result.plan.model_dump(mode="json"),
        "budget_bytes": result.plan.budget_bytes,
        "graph_fingerprint": g.fingerprint,
        "predicted": {
            "peak_bytes": r.peak_bytes, "step_time_s": r.time_s, "recompute_time_s": r.recompute_time_s,
            "exposed_transfer_s": r.exposed_transfer_s, "host_peak_bytes": r.host_peak_bytes,
            "transfer_bytes": r.transfer_bytes, "keep_all_peak_bytes": base.peak_bytes,
            "keep_all_step_time_s": base.time_s, "overhead": _overhead(r.time_s, base.time_s),
        },
        "state_summary": state_summary(g, result),
        "solver": {
            "name": result.plan.solver.name, "requested": solver, "status": result.status,
            "solve_time_s": result.solve_time_s, "lower_bound_s": result.lower_bound_s, "gap": result.gap,
            "space": result.space, "stats": _jsonable(result.stats),
        },
    }


def simulate_job(graph: Graph | str, plan: Plan | dict[str, Any] | None, *, timeline: bool,
                 fuse: str | None = None) -> dict[str, Any]:
    """Replay the step under ``plan`` (None: keep everything), its optimizer ``fuse``-d as given; returns a
    ``SimulationResponse``. Raises :class:`memplan.planner.core.errors.PlanMismatch` / ``PlanError`` for a
    plan of another graph."""
    g = load_graph(graph)
    p = plan if plan is None or isinstance(plan, Plan) else Plan.model_validate(plan)
    report = simulate(g, p, timeline=timeline, fuse=fuse)
    out = report.model_dump(exclude={"timeline"})
    out["graph_fingerprint"] = g.fingerprint
    out["timeline"] = [e.model_dump() for e in report.timeline] if timeline else None
    return out


def frontier_job(graph: Graph | str, *, budgets: list[int | str], solvers: list[str], time_limit_s: float,
                 offload: bool, states: str | None = None) -> dict[str, Any]:
    """Predicted overhead at each budget for each solver; returns a ``FrontierResponse``."""
    from memplan.solvers import frontier_points, keep_all_report

    g = load_graph(graph)
    resolved = []
    for b in budgets:
        value = resolve_budget(b, g)
        if value is None:  # cannot happen: budgets are never null in a frontier request
            raise MemplanError("budgets: a frontier needs a budget at every point")
        resolved.append(value)
    base = keep_all_report(g)
    # states only where they change what offload says: frontier_points reads the chain DP's table at every
    # budget only when it is given offload and the time limit alone
    chosen = solve_states(states)
    extra = {} if chosen is None or chosen == offload else {"states": chosen}
    series = []
    for name in solvers:
        points = frontier_points(g, resolved, name, time_limit_s=time_limit_s, offload=offload, **extra)
        series.append({"solver": name, "points": [
            {"budget": str(label), "budget_bytes": p.budget_bytes, "overhead": p.overhead, "status": p.status,
             "space": p.space}
            for label, p in zip(budgets, points, strict=True)]})
    return {"graph_fingerprint": g.fingerprint, "keep_all_peak_bytes": base.peak_bytes,
            "keep_all_step_time_s": base.time_s, "series": series}
