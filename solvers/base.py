"""One interface for every solver: ``solve(graph, budget_bytes, method=...) -> SolveResult``.

A solver is a pure function of the graph and budget that proposes actions (keep / recompute / offload
per saved activation, plus prefetch points). :func:`solve` scores the proposal with the simulator (the
single source of truth), refuses one that does not fit the budget there, and wraps it in a Plan with
its prediction and statistics. Solvers import the graph/plan model and the simulator only, never torch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from memplan.planner.errors import Infeasible, MemplanError
from memplan.planner.graph import Graph
from memplan.planner.plan import Action, Plan, Prediction, SolverInfo
from memplan.planner.simulator import Report, simulate, simulate_actions
from memplan.planner.units import format_bytes

STATUSES = ("optimal", "feasible", "timeout", "infeasible")
MAX_EXACT_SAVED = 10      # smallest_known_peak enumerates every plan of graphs this small ...
MAX_EXACT_PLANS = 20_000  # ... when there are at most this many


@dataclass
class Proposal:
    """What a solver method returns: its choice and what it knows about its quality.

    ``status``: ``optimal`` (proved optimal under the method's model), ``feasible`` (a plan, no proof),
    ``timeout`` (best plan found before the time limit), ``infeasible`` (no plan within the budget).
    ``lower_bound_s``: a proven lower bound on the step time, where the method has one.
    """

    actions: dict[int, Action] = field(default_factory=dict)
    prefetch_at: dict[int, int] = field(default_factory=dict)
    status: str = "feasible"
    lower_bound_s: float | None = None
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SolveResult:
    plan: Plan
    report: Report
    status: str
    solve_time_s: float
    lower_bound_s: float | None
    gap: float | None
    stats: dict[str, Any]


SolverFn = Callable[..., Proposal]


@dataclass(frozen=True)
class SolverSpec:
    name: str
    fn: SolverFn
    description: str
    graphs: str           # "chain" (uses the coarsened chain; any graph) or "dag"
    exact: bool           # optimal under its model when it finishes
    offload: bool         # can choose offload
    max_ops: int | None   # refuses larger graphs (exhaustive methods)


_REGISTRY: dict[str, SolverSpec] = {}


def register(name: str, *, description: str, graphs: str = "dag", exact: bool = False, offload: bool = False,
             max_ops: int | None = None) -> Callable[[SolverFn], SolverFn]:
    """Register ``fn(graph, budget_bytes, *, time_limit_s, offload, **options) -> Proposal``."""

    def deco(fn: SolverFn) -> SolverFn:
        _REGISTRY[name] = SolverSpec(name, fn, description, graphs, exact, offload, max_ops)
        return fn

    return deco


def solvers() -> dict[str, SolverSpec]:
    _load_builtin()
    return dict(_REGISTRY)


def _load_builtin() -> None:
    # Importing the modules registers their methods; missing optional modules are skipped so that a
    # half-installed environment still offers the rest.
    import importlib

    for mod in ("memplan.solvers.oracle", "memplan.solvers.heuristics", "memplan.solvers.dp",
                "memplan.solvers.ilp"):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if not e.name or not e.name.startswith("memplan.solvers"):
                raise


def choose_method(graph: Graph, *, offload: bool = False) -> str:
    """``method="auto"``: exhaustive on tiny graphs, the ILP on small ones, DP on large ones (via the
    coarsened chain), the greedy heuristic on huge ones. :func:`solve` then also tries the greedy and
    Capuchin heuristics on the large ones and keeps the fastest plan."""
    reg = solvers()
    n = len(graph.saved_activations)
    if n <= 12 and "oracle" in reg:
        return "oracle"
    if len(graph.ops) <= 400 and "ilp" in reg:
        return "ilp"
    if len(graph.ops) <= 20000 and "dp" in reg:
        return "dp"
    return "greedy"


def keep_all_report(graph: Graph) -> Report:
    return simulate_actions(graph, {})


def activation_bytes(graph: Graph) -> int:
    """Keep-everything peak minus fixed memory: what '100%' of a percentage budget means."""
    return keep_all_report(graph).peak_bytes - graph.fixed.resident_bytes


def memory_lower_bound(graph: Graph) -> int:
    """A sound lower bound on any plan's peak under the cost model: at each forward op its inputs and
    outputs are resident; at each backward step its saved tensors, the gradients live then (which no plan
    changes) and its workspace are. A budget below it is refused at once."""
    fixed = graph.fixed.resident_bytes
    tensors = graph.tensors
    bound = fixed + graph.fixed.optimizer_step_bytes
    held = 0
    for op in graph.ops:
        acts = {t for t in (*op.inputs, *op.outputs) if tensors[t].kind == "activation"}
        bound = max(bound, fixed + held + sum(tensors[t].bytes for t in acts) + op.workspace_bytes)
        held += sum(tensors[t].bytes for t in op.outputs if tensors[t].held_by_caller)
    grads = 0
    for op in reversed(graph.ops):
        acts = {t for t in op.saved if tensors[t].kind == "activation" and not tensors[t].held_by_caller}
        need = fixed + held + grads + op.backward_grad_alloc_bytes + op.backward_workspace_bytes
        bound = max(bound, need + sum(tensors[t].bytes for t in acts))
        grads += op.backward_grad_alloc_bytes - op.backward_grad_free_bytes
    return bound


def smallest_known_peak(graph: Graph, *, offload: bool = False) -> int:
    """The smallest simulated peak among memplan's low-memory plans: keep-everything, recompute-
    everything, offload-everything (when allowed) and the heuristics' minimum-memory search. It is
    achievable, so it is what an Infeasible error reports as the minimum feasible budget."""
    saved = graph.saved_activations
    recomputable = {t: Action.RECOMPUTE for t in saved if graph.tensors[t].recomputable}
    plans: list[tuple[dict[int, Action], dict[int, int]]] = [({}, {}), (recomputable, {})]
    if offload:
        plans.append(({t: Action.OFFLOAD for t in saved}, {}))
    try:
        from memplan.solvers.heuristics import min_memory_actions
    except ImportError:
        pass
    else:
        plans.append(min_memory_actions(graph, offload=offload))
    best = min(simulate_actions(graph, a, prefetch_at=p).peak_bytes for a, p in plans)
    try:  # a chain: the DP knows the exact least budget of keep / recompute plans
        from memplan.solvers.dp import chain_min_budget_bytes
    except ImportError:
        pass
    else:
        exact = chain_min_budget_bytes(graph)
        best = best if exact is None else min(best, exact)
    if len(saved) <= MAX_EXACT_SAVED:  # small enough to know the exact minimum (or, with offload, the
        from memplan.solvers.oracle import oracle_min_peak, plan_count  # minimum at default prefetch)

        for prefetch in ("choose", "default"):
            if plan_count(graph, offload=offload, prefetch=prefetch) <= MAX_EXACT_PLANS:
                best = min(best, oracle_min_peak(graph, offload=offload, prefetch=prefetch))
                break
    return best


def solve(graph: Graph, budget_bytes: int | None, method: str = "auto", *, time_limit_s: float = 60.0,
          offload: bool = False, host_budget_bytes: int | None = None, **options: Any) -> SolveResult:
    """Plan ``graph`` under ``budget_bytes`` (device peak, fixed memory included; None: no limit).

    ``method`` names a registered solver (see :func:`solvers`) or ``"auto"``. ``offload`` lets the
    solver move activations to host memory (``host_budget_bytes`` caps them). Raises :class:`Infeasible`
    (with ``min_feasible_bytes``) when no plan fits, and :class:`MemplanError` for an unknown method.
    Every returned plan has been simulated and fits the budget in the simulator.
    """
    if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes < 0):
        raise MemplanError(f"budget must be a non-negative number of bytes, got {budget_bytes!r}")
    if not (isinstance(time_limit_s, (int, float)) and math.isfinite(time_limit_s) and time_limit_s > 0):
        raise MemplanError(f"time limit must be a positive number of seconds, got {time_limit_s!r}")
    auto = method == "auto"
    if auto:
        method = choose_method(graph, offload=offload)
    reg = solvers()
    if method not in reg:
        raise MemplanError(f"unknown solver {method!r}; known: {', '.join(sorted(reg))}")
    spec = reg[method]
    if offload and not spec.offload:
        raise MemplanError(f"solver {method!r} does not plan offload; use one of "
                           f"{', '.join(sorted(n for n, s in reg.items() if s.offload))}")
    if spec.max_ops is not None and len(graph.saved_activations) > spec.max_ops:
        raise MemplanError(f"solver {method!r} handles at most {spec.max_ops} saved activations; this graph "
                           f"has {len(graph.saved_activations)}")
    budget = budget_bytes if budget_bytes is not None else keep_all_report(graph).peak_bytes
    if budget < memory_lower_bound(graph):
        raise _infeasible(graph, budget, smallest_known_peak(graph, offload=offload))
    t0 = time.perf_counter()
    try:
        proposal, report = _propose(graph, spec, budget, time_limit_s, offload, host_budget_bytes, options)
    except Infeasible:
        if not auto:
            raise
        # "auto" promises a plan whenever memplan knows one: near the minimum budget the exact methods
        # can miss it (their large-graph models are restricted), so fall back to the heuristics
        proposal, report, method = _fallback(graph, budget, time_limit_s, offload, host_budget_bytes, method)
    if auto and method not in ("oracle", "ilp"):
        # past the ILP's size the DP works on the coarsened chain, where a stage is kept or recomputed as a
        # whole; the per-tensor heuristics often do better there, and cost a fraction of a second
        proposal, report, method = _best_of(graph, (proposal, report, method), budget, time_limit_s, offload,
                                            host_budget_bytes)
    elapsed = time.perf_counter() - t0
    gap = None
    if proposal.lower_bound_s is not None and report.time_s > 0:
        gap = max(0.0, (report.time_s - proposal.lower_bound_s) / report.time_s)
    plan = Plan.for_graph(
        graph, proposal.actions, proposal.prefetch_at, budget_bytes=budget, host_budget_bytes=host_budget_bytes,
        solver=SolverInfo(name=method, settings={"time_limit_s": time_limit_s, "offload": offload, **options,
                                                 **({"requested": "auto"} if auto else {})},
                          status=proposal.status, solve_time_s=elapsed, lower_bound_s=proposal.lower_bound_s,
                          gap=gap),
        predicted=Prediction(peak_bytes=report.peak_bytes, step_time_s=report.time_s,
                             recompute_time_s=report.recompute_time_s,
                             exposed_transfer_s=report.exposed_transfer_s))
    full = simulate(graph, plan)  # the plan as a user will load it, with its timeline
    return SolveResult(plan, full, proposal.status, elapsed, proposal.lower_bound_s, gap, proposal.stats)


def _propose(graph: Graph, spec: SolverSpec, budget: int, time_limit_s: float, offload: bool,
             host_budget_bytes: int | None, options: dict[str, Any]) -> tuple[Proposal, Report]:
    """Run one method and score its proposal; Infeasible unless it fits the device and host budgets."""
    method = spec.name
    proposal = spec.fn(graph, budget, time_limit_s=time_limit_s, offload=offload,
                       host_budget_bytes=host_budget_bytes, **options)
    if proposal.status == "infeasible":
        raise _infeasible(graph, budget, smallest_known_peak(graph, offload=offload), method=method)
    report = simulate_actions(graph, proposal.actions, prefetch_at=proposal.prefetch_at, timeline=False)
    if report.peak_bytes > budget:
        raise Infeasible(
            f"solver {method!r} found no plan whose simulated peak fits {format_bytes(budget)} "
            f"(its best peaks at {format_bytes(report.peak_bytes)}); try another solver or a larger budget",
            budget_bytes=budget, min_feasible_bytes=smallest_known_peak(graph, offload=offload))
    if offload and host_budget_bytes is not None and report.host_peak_bytes > host_budget_bytes:
        raise Infeasible(f"solver {method!r} offloads {format_bytes(report.host_peak_bytes)}, over the host "
                         f"budget {format_bytes(host_budget_bytes)}", budget_bytes=budget)
    return proposal, report


def _best_of(graph: Graph, first: tuple[Proposal, Report, str], budget: int, time_limit_s: float, offload: bool,
             host_budget_bytes: int | None) -> tuple[Proposal, Report, str]:
    """``auto`` on large graphs: the fastest simulated plan among ``first`` and the greedy and Capuchin
    heuristics' (each under the same budgets); the others' step times go to ``stats['portfolio_s']``."""
    reg = solvers()
    best = first
    times = {first[2]: first[1].time_s}
    for name in ("capuchin", "greedy"):
        if name == first[2] or name not in reg or (offload and not reg[name].offload):
            continue
        try:
            proposal, report = _propose(graph, reg[name], budget, time_limit_s, offload, host_budget_bytes, {})
        except Infeasible:
            continue
        times[name] = report.time_s
        if report.time_s < best[1].time_s:
            best = (proposal, report, name)
    best[0].stats["portfolio_s"] = times
    return best


def _fallback(graph: Graph, budget: int, time_limit_s: float, offload: bool, host_budget_bytes: int | None,
              failed: str) -> tuple[Proposal, Report, str]:
    """``auto``'s second try after ``failed`` found no plan: the greedy heuristic, then the heuristics'
    minimum-memory plan as it stands. Raises the first method's kind of Infeasible if neither fits."""
    reg = solvers()
    if failed != "greedy" and "greedy" in reg:
        try:
            proposal, report = _propose(graph, reg["greedy"], budget, time_limit_s, offload, host_budget_bytes, {})
            proposal.stats["fallback_from"] = failed
            return proposal, report, "greedy"
        except Infeasible:
            pass
    from memplan.solvers.heuristics import min_memory_actions

    actions, prefetch_at = min_memory_actions(graph, offload=offload)
    report = simulate_actions(graph, actions, prefetch_at=prefetch_at, timeline=False)
    host_ok = not offload or host_budget_bytes is None or report.host_peak_bytes <= host_budget_bytes
    if report.peak_bytes <= budget and host_ok:
        return Proposal(actions, prefetch_at, status="feasible", stats={"fallback_from": failed}), report, "min-memory"
    raise _infeasible(graph, budget, smallest_known_peak(graph, offload=offload), method=failed)


def _both(n: int) -> str:
    return format_bytes(n) if n < 1024 else f"{format_bytes(n)} ({n} B)"


def _infeasible(graph: Graph, budget: int, floor: int, method: str | None = None) -> Infeasible:
    who = f"solver {method!r}: " if method else ""
    if floor <= budget:  # the method failed, yet a plan exists: say so rather than blame the budget
        return Infeasible(
            f"{who}found no plan within {_both(budget)}, but memplan's minimum-memory "
            f"plan peaks at {_both(floor)}: try another solver or a longer time limit",
            budget_bytes=budget, min_feasible_bytes=floor)
    return Infeasible(
        f"{who}no plan fits budget {_both(budget)} for graph {graph.name!r}; the minimum "
        f"feasible budget memplan knows is {_both(floor)} (fixed memory alone is "
        f"{format_bytes(graph.fixed.resident_bytes)})", budget_bytes=budget, min_feasible_bytes=floor)


def solve_frontier(graph: Graph, budgets: list[int], method: str = "auto", **kw: Any) -> list[tuple[int, float | None]]:
    """(budget, predicted overhead) pairs: overhead is step time over keep-everything's, minus one;
    None where the budget is infeasible. Methods with a cheaper way (the DP's one table) override via
    ``frontier=`` in the registry options."""
    if method == "dp" and not kw.get("offload") and set(kw) <= {"offload", "time_limit_s"}:
        from memplan.solvers.dp import dp_frontier

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
