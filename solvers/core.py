"""The entry every caller uses: ``solve(graph, budget_bytes, method=...) -> SolveResult``.

It validates the request once (budget, time limit, the strategy's typed options), runs the strategy,
scores its proposal with the simulator (the single source of truth), refuses one that does not fit the
budget there, and wraps it in a Plan with its prediction and statistics. :func:`propose` is the scoring
step alone, for strategies that run others (``auto``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from memplan.planner.core.errors import Infeasible, MemplanError
from memplan.planner.core.graph import FUSE_MODES, Graph
from memplan.planner.core.plan import Action, Plan, Prediction, SolverInfo
from memplan.planner.core.simulator import Report, simulate, simulate_actions
from memplan.planner.core.units import MAX_BYTES, format_bytes
from memplan.solvers.bounds import keep_all_report, memory_lower_bound
from memplan.solvers.min_memory import least_peak, smallest_known_peak
from memplan.solvers.registry import ALL_PLANS, Proposal, SolverSpec, get

# A budget below the memory lower bound is refused without running a strategy; the search for the least peak
# to quote gets at most this long (the time limit, when shorter): a refusal is answered in about a second
# (GPT-2's search ran ~7 s, a 2,000-op chain's its whole time limit), and a budget near the quoted peak, which
# the strategy then runs on, gets the full search
QUOTE_SEARCH_S = 1.0
# searches under a smaller budget for a plan whose backward-fused step fits (solve's ``fuse``)
FUSED_RETRIES = 5
# searches under a larger budget where backward fusion's early frees leave room (solve's ``fuse``)
FUSED_ROOM_SEARCHES = 2


@dataclass(frozen=True)
class SolveResult:
    plan: Plan
    report: Report
    status: str
    solve_time_s: float
    lower_bound_s: float | None
    gap: float | None
    stats: dict[str, Any]
    #: the plans over which status and lower_bound_s hold (registry.ALL_PLANS: every plan memplan executes
    #: for the request; else the actions the method searched, e.g. "keep/recompute")
    space: str = ALL_PLANS


def solve(graph: Graph, budget_bytes: int | None, method: str = "auto", *, time_limit_s: float = 60.0,
          offload: bool = False, host_budget_bytes: int | None = None, fuse: str | None = None,
          **options: Any) -> SolveResult:
    """Plan ``graph`` under ``budget_bytes`` (device peak, fixed memory included; None: no limit).

    ``method`` names a registered strategy (see :func:`memplan.solvers.registry.solvers`; ``auto`` picks
    one). ``offload`` lets the strategy move activations to host memory (``host_budget_bytes`` caps them);
    ``options`` are the strategy's ``Config`` fields. ``fuse``: the step the plan will run in ("backward":
    each fusion bucket stepped inside backward, :func:`simulate`'s ``fuse``); the plans are searched
    unfused, and one whose fused step goes over the budget (a bucket stepped beside backward's peak holds
    its share of the optimizer's transient there) is searched again under a budget below its own peak by the
    overshoot (deeper each time), at most :data:`FUSED_RETRIES` times, and one that fits with room to spare
    is searched again under a budget larger by the room (:data:`FUSED_ROOM_SEARCHES` times, the faster
    fitting plan kept), all within ``time_limit_s``; such a plan is "feasible", not proven
    optimal (``stats["unfused_status"]``: the search's own claim). Raises :class:`Infeasible` (with ``min_feasible_bytes``) when no
    plan fits, and :class:`MemplanError` for an unknown method, a bad option or a budget out of range.
    Every returned plan has been simulated and fits the budget there, fused as asked.
    """
    if fuse is not None and fuse not in FUSE_MODES:
        raise MemplanError(f"fuse={fuse!r}: expected {' or '.join(FUSE_MODES)} (or None: not fused)")
    start = time.perf_counter()
    deadline = start + time_limit_s  # the searches below share the request's time limit
    result = _solve(graph, budget_bytes, method, time_limit_s=time_limit_s, offload=offload,
                    host_budget_bytes=host_budget_bytes, **options)
    if fuse != "backward" or not graph.fused_backward or budget_bytes is None:
        return result  # (forward fusion's step is predicted as the unfused one)
    budget, cut = budget_bytes, 0
    for _ in range(FUSED_RETRIES):
        fused = simulate(graph, result.plan, timeline=False, fuse=fuse)
        over = fused.peak_bytes - budget
        if over <= 0:
            return _unproven(graph, _use_the_room(graph, result, fused, budget, budget_bytes, method,
                                                  deadline=deadline, offload=offload,
                                                  host_budget_bytes=host_budget_bytes, **options),
                             budget, time.perf_counter() - start)
        # a plan whose unfused peak is under the budget already is found again under a budget cut less than
        # its slack: cut below its own peak, and deeper each time (the fused peak need not fall as fast)
        cut = max(over, 2 * cut)
        budget_bytes = min(budget_bytes, result.report.peak_bytes) - cut
        left = deadline - time.perf_counter()
        if budget_bytes < 0 or left <= 0:
            break
        try:
            result = _solve(graph, budget_bytes, method, time_limit_s=left, offload=offload,
                            host_budget_bytes=host_budget_bytes, **options)
        except Infeasible as e:
            raise Infeasible(f"no plan fits budget {_both(budget)} for graph '{graph.name}' with the optimizer "
                             f"fused into backward: its steps inside backward hold {_both(over)} more than the "
                             f"plans found for it; {e}", budget_bytes=budget,
                             min_feasible_bytes=e.min_feasible_bytes) from None
    over = simulate(graph, result.plan, timeline=False, fuse=fuse).peak_bytes - budget
    if over > 0:
        raise Infeasible(f"no plan fits budget {_both(budget)} for graph '{graph.name}' with the optimizer fused "
                         f"into backward: searched again under smaller budgets within the time limit of "
                         f"{time_limit_s:g} s, its steps inside backward still go {_both(over)} over",
                         budget_bytes=budget)
    return _unproven(graph, result, budget, time.perf_counter() - start)


def _use_the_room(graph: Graph, result: SolveResult, best: Report, budget: int, searched: int, method: str, *,
                  deadline: float, **kw: Any) -> SolveResult:
    """A plan searched under ``searched`` whose backward-fused step fits ``budget`` with room to spare
    (fusion freed the gradients early): searched again under ``searched`` plus the room, at most
    :data:`FUSED_ROOM_SEARCHES` times, and the faster fused step that still fits is kept (fewer recomputes
    where the freed gradients make room: ResNet at 80%). ``best``: the plan's fused step, simulated."""
    for _ in range(FUSED_ROOM_SEARCHES):
        room = budget - best.peak_bytes
        if room <= 0 or all(a == Action.KEEP for a in result.plan.actions().values()):  # nothing to give back
            break
        searched += room
        left = deadline - time.perf_counter()
        if left <= 0:
            break
        try:
            again = _solve(graph, searched, method, time_limit_s=left, **kw)
        except Infeasible:
            break
        fused = simulate(graph, again.plan, timeline=False, fuse="backward")
        if fused.peak_bytes > budget or fused.time_s >= best.time_s:
            break
        result, best = again, fused
    return result


def _unproven(graph: Graph, result: SolveResult, budget: int, elapsed_s: float) -> SolveResult:
    """``result`` for a backward-fused step under ``budget``: its plan was searched among those whose
    unfused step fits another budget (smaller, or larger by the room fusion leaves), so neither an
    optimality claim nor a lower bound holds for the fused step: status "feasible", the search's own status
    kept in ``stats["unfused_status"]``. The plan records the fused step's prediction and ``fuse`` in its
    solver settings (it may fit the budget only fused), and the report is the fused step's; ``elapsed_s``:
    all the searches' time."""
    stats = {**result.stats, "unfused_status": result.status}
    fused = simulate(graph, result.plan, fuse="backward")  # the report, with its timeline
    solver = result.plan.solver.model_copy(update={
        "status": "feasible", "lower_bound_s": None, "gap": None, "solve_time_s": elapsed_s,
        "settings": {**result.plan.solver.settings, "fuse": "backward"}})
    predicted = Prediction(peak_bytes=fused.peak_bytes, step_time_s=fused.time_s,
                           recompute_time_s=fused.recompute_time_s, exposed_transfer_s=fused.exposed_transfer_s)
    plan = result.plan.model_copy(update={"budget_bytes": budget, "solver": solver, "predicted": predicted})
    return SolveResult(plan, fused, "feasible", elapsed_s, None, None, stats, result.space)


def _solve(graph: Graph, budget_bytes: int | None, method: str = "auto", *, time_limit_s: float = 60.0,
           offload: bool = False, host_budget_bytes: int | None = None, **options: Any) -> SolveResult:
    for name, value in (("budget", budget_bytes), ("host budget", host_budget_bytes)):
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise MemplanError(f"{name} must be a non-negative number of bytes, got {value!r}")
        if value > MAX_BYTES:
            raise MemplanError(f"{name} {value} B is beyond any device (over 2^50 B = 1 PiB); "
                               f"check its unit")
    if not (isinstance(time_limit_s, (int, float)) and math.isfinite(time_limit_s) and time_limit_s > 0):
        raise MemplanError(f"time limit must be a positive number of seconds, got {time_limit_s!r}")
    spec = get(method)
    spec.check(graph, offload)
    config = spec.config_for(options) if spec.config is not None else options
    t0 = time.perf_counter()
    budget = budget_bytes if budget_bytes is not None else keep_all_report(graph).peak_bytes
    lower = memory_lower_bound(graph)
    if budget < lower:
        # proven infeasible, no strategy runs: a short search for the least peak to quote
        search_s = min(time_limit_s, QUOTE_SEARCH_S)
        floor = smallest_known_peak(graph, offload=offload, deadline=t0 + search_s)
        if search_s < time_limit_s:
            raise infeasible(graph, budget, floor, cut_at_s=_cut(t0 + search_s, search_s), quick_below=lower)
        raise infeasible(graph, budget, floor, cut_at_s=_cut(t0 + search_s, search_s))
    proposal, report = propose(graph, spec, budget, time_limit_s=time_limit_s, offload=offload,
                               host_budget_bytes=host_budget_bytes, config=config)
    elapsed = time.perf_counter() - t0
    gap = None
    if proposal.lower_bound_s is not None and report.time_s > 0:
        gap = max(0.0, (report.time_s - proposal.lower_bound_s) / report.time_s)
    made_by = proposal.method or spec.name
    settings = {"time_limit_s": time_limit_s, "offload": offload, **options,
                **({"requested": spec.name} if made_by != spec.name else {})}
    plan = Plan.for_graph(
        graph, proposal.actions, proposal.prefetch_at, budget_bytes=budget, host_budget_bytes=host_budget_bytes,
        solver=SolverInfo(name=made_by, settings=settings, status=proposal.status, solve_time_s=elapsed,
                          lower_bound_s=proposal.lower_bound_s, gap=gap, space=proposal.space),
        predicted=Prediction(peak_bytes=report.peak_bytes, step_time_s=report.time_s,
                             recompute_time_s=report.recompute_time_s,
                             exposed_transfer_s=report.exposed_transfer_s))
    full = simulate(graph, plan)  # the plan as a user will load it, with its timeline
    return SolveResult(plan, full, proposal.status, elapsed, proposal.lower_bound_s, gap, proposal.stats,
                       proposal.space)


def propose(graph: Graph, spec: SolverSpec, budget: int, *, time_limit_s: float, offload: bool,
            host_budget_bytes: int | None, config: Any) -> tuple[Proposal, Report]:
    """Run one strategy and score its proposal; :class:`Infeasible` unless it fits the device and host
    budgets in the simulator."""
    method = spec.name
    deadline = time.perf_counter() + time_limit_s  # the least-peak search below gets what the strategy left
    proposal = spec.call(graph, budget, time_limit_s=time_limit_s, offload=offload,
                         host_budget_bytes=host_budget_bytes, config=config)
    if proposal.status == "infeasible":
        floor, proven = least_peak(graph, offload=offload, deadline=deadline)
        own = proposal.stats.get("lowest_peak_bytes")  # the strategy's own least peak, achievable too
        if own is not None and own < floor:
            floor, proven = own, proven or own <= memory_lower_bound(graph)
        if proposal.stats.get("stopped") == "time limit" and floor > budget:
            # not a proof: say what happened rather than call the budget infeasible
            raise Infeasible(f"solver {method!r} found no plan within its time limit of {time_limit_s:g} s at "
                             f"{_both(budget)}; the least peak memplan knows is {_both(floor)}: try a longer "
                             f"time limit", budget_bytes=budget, min_feasible_bytes=floor)
        cut_at_s = _cut(deadline, time_limit_s)
        if not proven and floor > budget and cut_at_s is None:
            # a search's least peak, not a proof: another strategy may fit (Capuchin fits 154 GiB on an
            # 80-layer Llama where Chen's least peak is 262 GiB)
            mine = ("" if own is None else " (this solver's own)" if own == floor
                    else f" (this solver's own: {_both(own)})")
            raise Infeasible(f"solver {method!r} found no plan within {_both(budget)}; the least peak memplan's "
                             f"search reached is {_both(floor)}{mine}, not a proven minimum: a plan may still fit "
                             f"the budget{' (try auto)' if method != 'auto' else ''}", budget_bytes=budget,
                             min_feasible_bytes=floor)
        raise infeasible(graph, budget, floor, method=method, cut_at_s=cut_at_s)
    report = simulate_actions(graph, proposal.actions, prefetch_at=proposal.prefetch_at, timeline=False)
    if report.peak_bytes > budget:
        raise Infeasible(
            f"solver {method!r} found no plan whose simulated peak fits {format_bytes(budget)} "
            f"(its best peaks at {format_bytes(report.peak_bytes)}); try another solver or a larger budget",
            budget_bytes=budget, min_feasible_bytes=smallest_known_peak(graph, offload=offload, deadline=deadline))
    if offload and host_budget_bytes is not None and report.host_peak_bytes > host_budget_bytes:
        raise Infeasible(f"solver {method!r} offloads {format_bytes(report.host_peak_bytes)}, over the host "
                         f"budget {format_bytes(host_budget_bytes)}", budget_bytes=budget)
    return proposal, report


def _both(n: int) -> str:
    return format_bytes(n) if n < 1024 else f"{format_bytes(n)} ({n} B)"


def _cut(deadline: float, time_limit_s: float) -> float | None:
    """``time_limit_s`` when the search it bounded has run to its ``deadline`` (and so may have been cut
    short), else None."""
    return time_limit_s if time.perf_counter() > deadline else None


def infeasible(graph: Graph, budget: int, floor: int, method: str | None = None, *,
               cut_at_s: float | None = None, quick_below: int | None = None) -> Infeasible:
    """The :class:`Infeasible` error for ``budget``, quoting ``floor`` (the least peak memplan knows) as
    the minimum feasible budget; when ``floor`` fits, it blames the method rather than the budget.
    ``cut_at_s``: the time limit that stopped the search for ``floor`` (the message says a longer one
    may find less), None when it finished. ``quick_below``: the lower bound below which ``budget`` was
    refused after a search shorter than the time limit (the message says a budget near ``floor`` gets a
    longer one)."""
    who = f"solver {method!r}: " if method else ""
    if cut_at_s is not None and quick_below is not None:
        cut = (f"; the search for it stopped after {cut_at_s:g} s, as budgets below the lower bound "
               f"{_both(quick_below)} are refused at once: a budget near it gets the whole time limit")
    elif cut_at_s is not None:
        cut = f"; the search for it stopped at the time limit of {cut_at_s:g} s, a longer one may find less"
    else:
        cut = ""
    if method and cut_at_s is not None and floor > budget:
        # the method found nothing and the search for a floor was cut short: neither proves that no plan
        # fits (on 1,000-op GPU-scale chains the Chen baseline failed where greedy fits, and the cut
        # search had only reached a higher peak), so blame neither the budget nor claim a minimum
        return Infeasible(
            f"{who}found no plan within {_both(budget)}; the least peak memplan found before the time limit "
            f"of {cut_at_s:g} s is {_both(floor)}, a longer search may find less: try another solver or a "
            f"longer time limit", budget_bytes=budget, min_feasible_bytes=floor)
    if floor <= budget:  # the method failed, yet a plan exists: say so rather than blame the budget
        return Infeasible(
            f"{who}found no plan within {_both(budget)}, but memplan's minimum-memory "
            f"plan peaks at {_both(floor)}: try another solver or a longer time limit",
            budget_bytes=budget, min_feasible_bytes=floor)
    return Infeasible(
        f"{who}no plan fits budget {_both(budget)} for graph {graph.name!r}; the minimum "
        f"feasible budget memplan knows is {_both(floor)} (fixed memory alone is "
        f"{format_bytes(graph.fixed.resident_bytes)}){cut}", budget_bytes=budget, min_feasible_bytes=floor)
