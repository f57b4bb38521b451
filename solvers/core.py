"""The entry every caller uses: ``solve(graph, budget_bytes, method=...) -> SolveResult``.

It validates the request once (budget, time limit, the strategy's typed options), runs the strategy,
scores its proposal with the simulator (the single source of truth), refuses one that does not fit the
budget there, and wraps it in a Plan with its prediction and statistics. :func:`propose` is the scoring
step alone, for strategies that run others (``auto``).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any

from memplan.planner.core.errors import Infeasible, MemplanError
from memplan.planner.core.graph import FUSE_MODES, Graph
from memplan.planner.core.plan import Plan, Prediction, SolverInfo
from memplan.planner.core.schedule import final_step_bytes, forward_updates
from memplan.planner.core.simulator import Report, simulate, simulate_actions, static_facts
from memplan.planner.core.units import MAX_BYTES, format_bytes
from memplan.solvers.bounds import keep_all_report, memory_lower_bound
from memplan.solvers.min_memory import least_peak, smallest_known_peak
from memplan.solvers.registry import ALL_PLANS, Proposal, SolverSpec, get
from memplan.solvers.states import solve_with_states

# A budget below the memory lower bound is refused without running a strategy; the search for the least peak
# to quote gets at most this long (the time limit, when shorter): a refusal is answered in about a second
# (GPT-2's search ran ~7 s, a 2,000-op chain's its whole time limit), and a budget near the quoted peak, which
# the strategy then runs on, gets the full search
QUOTE_SEARCH_S = 1.0
# bisections of the searched budget for a fused step (solve's ``fuse``), after its first two searches
FUSED_SEARCHES = 4
# forward fusion's searches from below (solve's ``fuse="forward"``), each under the last plan's peak less its overshoot
FUSED_RETRIES = 5


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


STATE_PLACEMENTS = ("auto", "stream", "host")  # solve's states= ways to move a unit's state


def solve(graph: Graph, budget_bytes: int | None, method: str = "auto", *, time_limit_s: float = 60.0,
          offload: bool = False, host_budget_bytes: int | None = None, fuse: str | None = None,
          states: bool | str | None = None, **options: Any) -> SolveResult:
    """Plan ``graph`` under ``budget_bytes`` (device peak, fixed memory included; None: no limit).

    ``states`` (default: ``offload``) lets the search move units' optimizer state off the device: streamed
    through it for the update, or stepped on the host (planner/core/states.py;
    :func:`memplan.solvers.states.solve_with_states` chooses which units and how, with the activations;
    unfused steps only); ``"stream"`` or ``"host"`` allows that way only; ``offload=True, states=False``
    moves activations alone, ``offload=False, states=True`` model states alone.

    ``method`` names a registered strategy (see :func:`memplan.solvers.registry.solvers`; ``auto`` picks
    one). ``offload`` lets the strategy move activations to host memory (``host_budget_bytes`` caps them);
    ``options`` are the strategy's ``Config`` fields. ``fuse``: the step the plan will run in ("backward":
    each fusion bucket stepped inside backward; "forward": before its module's next forward; :func:`simulate`'s
    ``fuse``); its plans are searched on :func:`fused_search_graph` (the fused step's memory; backward's
    over-counted by at most a bucket step's transient) within ``time_limit_s`` (:func:`_solve_fused`):
    backward-fused plans optimal where the search's claim carries over, else "feasible" with the search's
    bound; forward-fused plans "feasible" (the executor's watch of the parameter reads is not searched). Raises :class:`Infeasible` (with ``min_feasible_bytes``) when no
    plan fits, and :class:`MemplanError` for an unknown method, a bad option or a budget out of range.
    Every returned plan has been simulated and fits the budget there, fused as asked.
    """
    if fuse is not None and fuse not in FUSE_MODES:
        raise MemplanError(f"fuse={fuse!r}: expected {' or '.join(FUSE_MODES)} (or None: not fused)")
    if budget_bytes is not None and (not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool)):
        # bytes inside the code (the CLI and the service parse "6GiB" and "50%" at the edge): refused here, before
        # the fused and the model-state searches, which did arithmetic on it first (a TypeError)
        raise MemplanError(f"budget must be a non-negative number of bytes, got {budget_bytes!r} (parse strings "
                           f"such as '6GiB' or '50%' with memplan.planner.core.units.parse_budget)")
    start = time.perf_counter()
    deadline = start + time_limit_s  # the searches below share the request's time limit
    if isinstance(states, str) and states not in STATE_PLACEMENTS:
        raise MemplanError(f"states={states!r}: expected {', '.join(STATE_PLACEMENTS)}, True, False or None")
    if states not in (None, False) and fuse == "forward":
        raise MemplanError("states with fuse='forward': forward fusion defers each update to the module's next "
                           "forward, and state off the device is updated at optimizer.step(); use "
                           "fuse='backward' or none (states=None plans activations only under forward fusion)")
    if ((offload if states is None else bool(states)) and graph.state_units and fuse in (None, "backward")
            and budget_bytes is not None):
        if fuse is None:
            return solve_with_states(
                graph, budget_bytes, lambda search, seconds: _solve(
                    search, budget_bytes, method, time_limit_s=seconds, offload=offload,
                    host_budget_bytes=host_budget_bytes, **options),
                time_limit_s=time_limit_s, host_budget_bytes=host_budget_bytes,
                placement=states if isinstance(states, str) else "auto")

        def fused(search: Graph, seconds: float) -> SolveResult:
            now = time.perf_counter()
            return _solve_fused(search, budget_bytes, method, fuse=fuse, time_limit_s=seconds, start=now,
                                deadline=now + seconds, offload=offload, host_budget_bytes=host_budget_bytes,
                                **options)

        def fused_bound(search: Graph) -> int:
            # the fused step's peaks on ``search`` are its search graph's, less at most ``over``
            lite, over = fused_search_graph(search, fuse)
            return memory_lower_bound(lite) - over

        return solve_with_states(
            graph, budget_bytes, fused, time_limit_s=time_limit_s, host_budget_bytes=host_budget_bytes,
            placement=states if isinstance(states, str) else "auto", fuse=fuse, lower_bound=fused_bound,
            keep_peak=lambda search: simulate(search, timeline=False, fuse=fuse).peak_bytes)
    if fuse is None or not graph.fused_backward or budget_bytes is None:
        return _solve(graph, budget_bytes, method, time_limit_s=time_limit_s, offload=offload,
                      host_budget_bytes=host_budget_bytes, **options)
    return _solve_fused(graph, budget_bytes, method, fuse=fuse, time_limit_s=time_limit_s, start=start,
                        deadline=deadline, offload=offload, host_budget_bytes=host_budget_bytes, **options)


def fused_search_graph(graph: Graph, fuse: str = "backward") -> tuple[Graph, int]:
    """The graph the searches for a fused step run on (solve's ``fuse``), and the most it over-counts a
    plan's fused peak by.

    Forward fusion: the previous step's gradients are held until each bucket's update applies, before its
    module's first forward op (:func:`~memplan.planner.core.schedule.forward_updates`). Each forward op's
    workspace gains the gradients still held while it runs and what the updates just before it need beyond
    its own outputs and workspace (their transients, over the gradients not yet freed): the largest of those
    moments is then the op's own candidate, exactly the fused step's in forward. An op replayed in backward
    (the gradients gone by then) holds that extra too: a plan's peak here is over its fused peak by at most
    the largest extra. Backward: the graph's own, the final step's transient what the buckets leave.

    Backward fusion: the step without fusion, but each bucket's gradients freed
    by the backward step that completes them (``backward_grad_free_bytes``) and what its step's transient
    needs beyond that step's own frees held during the step (``backward_workspace_bytes``); the final step's
    transient is what remains. Every solver reads those fields, so every solver searches the fused step's
    memory. A bucket is stepped after its backward step frees its workspace, the gradients it consumed and
    the saved activations it read last (plan-independent: every plan has them resident there), so only the
    transient beyond those is added, and a plan's peak here is never below its fused peak (the executor's
    pins, which keep an activation for a later replay, aside: solve checks every plan fused). Same
    fingerprint: its plans are the graph's."""
    if fuse == "forward":
        return _forward_search_graph(graph)
    st = static_facts(graph)
    search = _unbucketed(graph)
    buckets: dict[int, list[Any]] = {}
    for f in graph.fused_backward:
        buckets.setdefault(f.after, []).append(f)
    over = 0
    for i, steps in buckets.items():
        op = graph.ops[i]
        freed = (op.backward_workspace_bytes + op.backward_grad_free_bytes
                 + sum(graph.tensors[t].bytes for t in st.releases_after_bwd[i] if st.is_activation[t]))
        need, stepped = 0, 0
        for f in steps:  # stepped one after another, each after the gradients before it are freed
            need = max(need, f.step_bytes - stepped)
            stepped += f.grad_bytes
        extra = max(0, need - freed)
        search.ops[i].backward_workspace_bytes += extra
        search.ops[i].backward_grad_free_bytes += stepped
        over = max(over, extra)
    return search.invalidate(), over


def _unbucketed(graph: Graph) -> Graph:
    """A copy of ``graph`` without its fusion buckets, its final optimizer step holding what the buckets'
    steps leave of the transient (:func:`final_step_bytes`): the unfused step the fused searches edit."""
    out = graph.model_copy(deep=True)
    out.fixed.optimizer_step_bytes = final_step_bytes(graph, fused=True)
    out.fused_backward = []
    return out.invalidate()


def _forward_search_graph(graph: Graph) -> tuple[Graph, int]:
    """:func:`fused_search_graph` for forward fusion."""
    search = _unbucketed(graph)
    at = forward_updates(graph)
    held = sum(f.grad_bytes for f in graph.fused_backward)
    over = 0
    for op in graph.ops:
        update = 0  # the most an update before the op holds: its transient and the gradients not yet freed
        for f in at.get(op.id, ()):  # applied one after another, each freeing its gradients
            update = max(update, held + f.step_bytes)
            held -= f.grad_bytes
        made = sum(graph.tensors[t].bytes for t in dict.fromkeys(op.outputs))
        extra = held + max(0, update - held - made - op.workspace_bytes)
        search.ops[op.id].workspace_bytes += extra
        over = max(over, extra)
    return search.invalidate(), over


def _solve_fused(graph: Graph, budget: int, method: str, *, fuse: str, time_limit_s: float, start: float,
                 deadline: float, **kw: Any) -> SolveResult:
    """solve(..., fuse=...): :func:`_fused_search`; for forward fusion, beside it (each half the time left)
    :func:`_forward_from_below`, and the faster plan whose fused step fits (neither makes a claim)."""
    if fuse != "forward":
        return _fused_search(graph, *fused_search_graph(graph, fuse), budget, method, fuse=fuse,
                             time_limit_s=time_limit_s, start=start, deadline=deadline, **kw)
    halfway = start + (deadline - start) / 2
    try:
        found: SolveResult | None = _fused_search(graph, *fused_search_graph(graph, fuse), budget, method, fuse=fuse,
                                                  time_limit_s=time_limit_s, start=start, deadline=halfway, **kw)
        refused = None
    except Infeasible as e:
        found, refused = None, e
    below, least = _forward_from_below(graph, budget, method, deadline=deadline, **kw)
    if below is not None and (found is None or below[1].time_s < found.report.time_s):
        return _fused_result(graph, below[0], budget, start, fuse=fuse, status="feasible", lower_bound_s=None,
                             searched=below[0].plan.budget_bytes or budget, searches=below[2])
    if found is not None:
        return found
    assert refused is not None
    floor = refused.min_feasible_bytes
    if least is not None and (floor is None or least < floor):
        refused = _fused_refusal(graph, fuse, budget, None, refused, None, found=least)
    raise refused


def _forward_from_below(graph: Graph, budget: int, method: str, *, deadline: float,
                        **kw: Any) -> tuple[tuple[SolveResult, Report, int] | None, int | None]:
    """Forward fusion's plans searched from below: on the graph without the held gradients (its final step's
    transient what the buckets leave), which under-counts the fused forward, under ``budget`` and then,
    while the fused step goes over, under a budget below the plan's own peak by the overshoot (deeper each
    time, :data:`FUSED_RETRIES` times). The fused search graph over-counts a replay of an early op in
    backward by the gradients held beside it in forward: at an 8-layer chain at GPU figures it refused every
    budget within 0.9 GiB of the least fused peak; from below those fit. Returns the plan, its fused step and
    the searches run (None where none fits), and the least fused peak seen."""
    lite = _unbucketed(graph)
    searched, cut, least = budget, 0, None
    for k in range(FUSED_RETRIES):
        left = deadline - time.perf_counter()
        if left <= 0 or searched < 0:
            break
        try:
            result = _solve(lite, searched, method, time_limit_s=left / (FUSED_RETRIES - k), **kw)
        except Infeasible as e:
            left = deadline - time.perf_counter()  # (the search above took its share)
            if e.min_feasible_bytes is not None and least is None and left > 0:  # a quote: the lite graph's
                with contextlib.suppress(Infeasible):                            # least plan, fused
                    quote = _solve(lite, e.min_feasible_bytes, method, time_limit_s=min(left, QUOTE_SEARCH_S), **kw)
                    least = simulate(graph, quote.plan, timeline=False, fuse="forward").peak_bytes
            break
        fused = simulate(graph, result.plan, timeline=False, fuse="forward")
        least = fused.peak_bytes if least is None else min(least, fused.peak_bytes)
        if fused.peak_bytes <= budget:
            return (result, fused, k + 1), least
        cut = max(fused.peak_bytes - budget, 2 * cut)
        searched = min(searched, result.report.peak_bytes) - cut
    return None, least


def _fused_search(graph: Graph, search: Graph, over: int, budget: int, method: str, *, fuse: str,
                  time_limit_s: float, start: float, deadline: float, **kw: Any) -> SolveResult:
    """The searches for a fused step on ``search`` (:func:`fused_search_graph`), whose peaks are the fused
    step's plus at most ``over`` (backward: a bucket step's transient beyond its backward step's frees;
    forward: the gradients held in forward, charged again to a replay in backward), so every plan
    whose fused step fits ``budget`` fits ``budget + over`` there: the plan searched under that budget is at
    least as fast as any of them (over the search's space), and where its own fused step fits it is the
    answer, with the search's claims. Otherwise the plan searched under ``budget`` fits (or, where no plan
    does there, the one at the search graph's least peak may), and the searched budget is bisected between
    the two (:data:`FUSED_SEARCHES` times), the fastest fused step that fits kept: bounded by the first
    search's bound, and "optimal" only where it meets it. The searches share ``time_limit_s``: where another
    may follow, a search gets half of what is left (auto's ILP runs to its limit), a bisection its share."""

    def attempt(searched: int, share: float = 1.0, most_s: float | None = None) -> tuple[SolveResult, Report]:
        left = deadline - time.perf_counter()
        if left <= 0:
            raise Infeasible(f"no plan fits budget {_both(budget)} for graph '{graph.name}' with the optimizer "
                             f"fused into {fuse} within the time limit of {time_limit_s:g} s", budget_bytes=budget)
        limit = left * share if most_s is None else min(left * share, most_s)
        result = _solve(search, searched, method, time_limit_s=limit, **kw)
        return result, simulate(graph, result.plan, timeline=False, fuse=fuse)

    def late() -> float | None:  # the time these searches had (forward fusion's: half the request's)
        return deadline - start if time.perf_counter() >= deadline else None

    try:  # (a search may run to its limit, as auto's ILP does: where another may follow, it gets half)
        top, top_fused = attempt(budget + over, 0.5 if over else 1.0)
    except Infeasible as e:  # no plan's search peak is under budget + over: no plan's fused peak under budget
        raise _fused_refusal(graph, fuse, budget, late(), e, attempt) from None
    # backward fusion's time is the search graph's plus what fusion adds, the same for every plan, so the
    # search's claims carry over; forward fusion's watch of the parameter-reading ops depends on the plan's
    # own window: no claim
    fixed_s = top_fused.time_s - top.report.time_s
    bound = None if top.lower_bound_s is None or fuse != "backward" else top.lower_bound_s + fixed_s
    if top_fused.peak_bytes <= budget:
        return _fused_result(graph, top, budget, start, fuse=fuse, lower_bound_s=bound, searched=budget + over,
                             searches=1, status=top.status if fuse == "backward" else "feasible")
    searches, fits = 2, budget
    try:
        low, low_fused = attempt(budget, 0.5)
    except Infeasible as e:
        floor = e.min_feasible_bytes
        if floor is None or floor <= budget or floor >= budget + over:
            raise _fused_refusal(graph, fuse, budget, late(), e, None) from None
        low, low_fused = attempt(floor, 0.5)  # the search graph's least peak: its fused step may still fit
        if low_fused.peak_bytes > budget:
            raise _fused_refusal(graph, fuse, budget, late(), e, None, found=min(floor, low_fused.peak_bytes)) from None
        searches, fits = 3, floor
    if low_fused.peak_bytes > budget:  # a pin kept an activation past the step that frees it (see above)
        fits = budget - (low_fused.peak_bytes - budget)
        try:
            low, low_fused = attempt(fits)
        except Infeasible as e:
            raise _fused_refusal(graph, fuse, budget, late(), e, None, found=low_fused.peak_bytes) from None
        if low_fused.peak_bytes > budget:
            raise _fused_refusal(graph, fuse, budget, late(), Infeasible(""), None, found=low_fused.peak_bytes)
        searches += 1
    misses = budget + over
    best, best_fused = low, low_fused
    for k in range(FUSED_SEARCHES):
        mid = (fits + misses) // 2
        if mid <= fits or deadline - time.perf_counter() <= 0:
            break
        try:
            again, again_fused = attempt(mid, 1 / (FUSED_SEARCHES - k))
        except Infeasible:
            break
        searches += 1
        if again_fused.peak_bytes <= budget:
            fits = mid
            if again_fused.time_s < best_fused.time_s:
                best, best_fused = again, again_fused
        else:
            misses = mid
    # as fast as the bound over every plan whose fused step fits: optimal over the search's space
    proven = bound is not None and best_fused.time_s <= bound + 1e-9 * abs(bound)
    return _fused_result(graph, best, budget, start, fuse=fuse, status="optimal" if proven else "feasible",
                         lower_bound_s=bound, searched=fits, searches=searches)


def _fused_refusal(graph: Graph, fuse: str, budget: int, late: float | None, refused: Infeasible, attempt: Any, *,
                   found: int | None = None) -> Infeasible:
    """The refusal of ``budget`` for a fused step, quoting the least fused peak memplan found: the
    plan at the search graph's least peak (``refused.min_feasible_bytes``), searched again with ``attempt``
    where given (its fused peak is at most that), or ``found``; ``late``: the time limit the searches ran
    out of, if they did."""
    floor = refused.min_feasible_bytes if found is None else found
    if floor is not None and floor <= budget:
        # the search failed for another reason than the budget (its method, its time): say its own words
        return Infeasible(f"with the optimizer fused into {fuse}: {refused}", budget_bytes=budget,
                          min_feasible_bytes=refused.min_feasible_bytes)
    if floor is not None and attempt is not None and found is None:
        with contextlib.suppress(Infeasible):  # a quote: as short as a refusal's own search for one
            floor = min(floor, attempt(floor, most_s=QUOTE_SEARCH_S)[1].peak_bytes)
    least = (f"; the least peak memplan found for that step is {_both(floor)} (fixed memory alone is "
             f"{format_bytes(graph.fixed.resident_bytes)})" if floor is not None else f": {refused}")
    if late is not None:
        least += f"; the searches stopped at their time limit of {late:.3g} s, a longer one may find a plan"
    return Infeasible(f"no plan fits budget {_both(budget)} for graph '{graph.name}' with the optimizer fused into "
                      f"{fuse}{least}", budget_bytes=budget, min_feasible_bytes=floor)


def _fused_result(graph: Graph, result: SolveResult, budget: int, start: float, *, fuse: str, status: str,
                  lower_bound_s: float | None, searched: int, searches: int) -> SolveResult:
    """``result`` (searched on the fused search graph under ``searched``) for the ``fuse``-fused step under
    ``budget``: the report and the plan's prediction are the fused step's (with its timeline), the plan records
    ``fuse`` in its solver settings (it may fit the budget only fused), and ``status`` / ``lower_bound_s``
    the claims that hold for the fused step."""
    elapsed = time.perf_counter() - start
    report = simulate(graph, result.plan, fuse=fuse)  # with its timeline
    gap = None
    if lower_bound_s is not None and report.time_s > 0:
        gap = max(0.0, (report.time_s - lower_bound_s) / report.time_s)
    stats = {**result.stats, "search_status": result.status, "searched_bytes": searched, "searches": searches}
    solver = result.plan.solver.model_copy(update={
        "status": status, "lower_bound_s": lower_bound_s, "gap": gap, "solve_time_s": elapsed,
        "settings": {**result.plan.solver.settings, "fuse": fuse}})
    predicted = Prediction(peak_bytes=report.peak_bytes, step_time_s=report.time_s,
                           recompute_time_s=report.recompute_time_s, exposed_transfer_s=report.exposed_transfer_s)
    plan = result.plan.model_copy(update={"budget_bytes": budget, "solver": solver, "predicted": predicted})
    return SolveResult(plan, report, status, elapsed, lower_bound_s, gap, stats, result.space)


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
