"""Model states and activations under one budget: which units' optimizer state to stream
(planner/core/states.py), chosen with the activations' plan.

A streamed unit frees its state's bytes for all of forward and backward and costs its copies in and out
at the optimizer step (link time, twice its bytes, hidden only under the next unit's update). The search
moves units in :func:`~memplan.planner.core.states.stream_order` (most bytes first) and solves the
activations for a few counts of moved units on :func:`~memplan.planner.core.states.states_search_graph`
(whose peak and time are exactly the placement's): the fewest that the budget's lower bound admits, the
fewest with which keeping every activation fits, and counts between, the most streamed first (it has the
most room, so a fit is found before the time runs out), each with a share of the time limit (where nothing
streamed may fit, that placement first, with 60% of it); every candidate is simulated with its placement and the fastest that fits the device and host
budgets is returned. Claims are those of the activations' search at the chosen placement
(``space`` says so): the placement itself is searched over these counts, not proven.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from memplan.planner.core.errors import Infeasible
from memplan.planner.core.graph import Graph
from memplan.planner.core.simulator import simulate
from memplan.planner.core.states import host_refusal, states_search_graph, stream_order, unit_grads
from memplan.planner.core.units import format_bytes
from memplan.solvers.bounds import keep_all_report, memory_lower_bound

CANDIDATES = 4  # placements whose activations are solved (besides the one with nothing streamed)
SHARE_MARGIN = 0.8  # of its share of the time left, what a candidate's activation search is given
UNSTREAMED_SHARE = 0.6  # of the time, for the placement that streams nothing, where it may fit


def _first(n: int, ok: Any) -> int | None:
    """The least k in 0..n with ``ok(k)`` by bisection, which assumes ok monotone in k; None if ok(n) fails.
    It nearly is (each unit moved frees its bytes), but the streaming phase's two neighbouring units may hold
    more after a move: a k that bisection found is checked, and n (which holds) taken where it fails."""
    if not ok(n):
        return None
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo if ok(lo) else n


def _modes(graph: Graph, placement: str) -> list[str]:
    """The ways a search may move units' state: streamed through the device, stepped on the host."""
    modes = [] if placement == "host" else ["stream"]
    eligible = [u for u in range(len(graph.state_units)) if u in unit_grads(graph)]
    if placement != "stream" and eligible and host_refusal(graph, eligible) is None:
        modes.append("host")
    if not modes:
        raise Infeasible(f"no unit's optimizer can be stepped on the host: "
                         f"{host_refusal(graph, eligible) or 'backward gives no unit a gradient'}")
    return modes


def solve_with_states(graph: Graph, budget: int, solve_activations: Any, *, time_limit_s: float,
                      host_budget_bytes: int | None, placement: str = "auto", fuse: str | None = None,
                      lower_bound: Any = memory_lower_bound, keep_peak: Any = None) -> Any:
    """Search the moved units with the activations. ``solve_activations(search_graph, time_limit_s)``
    solves the activations on a search graph and returns a :class:`~memplan.solvers.core.SolveResult`
    (raising :class:`Infeasible`). ``placement``: where moved units go ("stream", "host", or "auto": each
    way searched). ``fuse``: the step's optimizer fusion ("backward": the moved units' updates in the step,
    the others' fused; the search graphs are that step's, ``lower_bound`` and ``keep_peak`` its bound and
    its keep-everything peak on them). Returns the fastest result that fits, its plan carrying its
    placement; raises the most moved search's :class:`Infeasible` when nothing fits."""
    keep_peak = keep_peak or (lambda g: keep_all_report(g).peak_bytes)
    start = time.perf_counter()
    order = stream_order(graph)
    n = len(order)
    grads = unit_grads(graph)
    searches: dict[tuple[int, str], Graph] = {}

    def split(k: int, mode: str) -> tuple[list[int], list[int]]:
        """(streamed, hosted) when the first ``k`` units of the order move ``mode``'s way (a unit backward
        gives no gradient to is streamed)."""
        moved = order[:k]
        if mode == "stream":
            return moved, []
        return [u for u in moved if u not in grads], [u for u in moved if u in grads]

    def search(k: int, mode: str) -> Graph:
        if (k, mode) not in searches:
            streamed, hosted = split(k, mode)
            searches[k, mode] = states_search_graph(graph, streamed, hosted=hosted, fuse=fuse)
        return searches[k, mode]

    candidates: list[tuple[float, int, str]] = []  # (keep-all's time at the most moved count, k, mode)
    for mode in _modes(graph, placement):
        k_min = _first(n, lambda k, m=mode: lower_bound(search(k, m)) <= budget)
        if k_min is None:
            k_min = n  # nothing fits by the bound: the all-moved search says by how much
        k_keep = _first(n, lambda k, m=mode: keep_peak(search(k, m)) <= budget)
        hi = k_keep if k_keep is not None else n
        # the most moved first: it has the most room, so a fit is found before the time runs out; then fewer
        counts = sorted({k_min, hi, *(k_min + (hi - k_min) * i // CANDIDATES for i in range(1, CANDIDATES))},
                        reverse=True)
        rank = keep_all_report(search(hi, mode)).time_s
        candidates += [(rank, k, mode) for k in counts]
    # the way whose keep-all step is faster first; where nothing moved may fit, that placement goes first with
    # most of the time: it moves no state byte, and an activation search cut short there would lose what
    # offload alone finds
    candidates.sort(key=lambda c: (c[0], c[2], -c[1]))
    plan_order = list(dict.fromkeys((k if k else 0, mode if k else "stream") for _, k, mode in candidates))
    if (0, "stream") in plan_order:
        plan_order.remove((0, "stream"))
        plan_order.insert(0, (0, "stream"))
        first_unmoved = True
    else:
        first_unmoved = False
    best, best_report, refusal, refused_k, host_refusal_ = None, None, None, -1, None
    overhead = 0.0  # the most a candidate took beyond its share (a fused search's graphs and simulations)
    for i, (k, mode) in enumerate(plan_order):
        left = time_limit_s - (time.perf_counter() - start)
        if left <= overhead and (best is not None or left <= 0):
            break  # another candidate would end past the time limit
        share = UNSTREAMED_SHARE if (first_unmoved and i == 0 and len(plan_order) > 1) else 1 / (len(plan_order) - i)
        given = SHARE_MARGIN * max(left - overhead, 0.0) * share
        began = time.perf_counter()
        try:
            # a share of what is left, less a margin: a strategy may end a little past its own limit
            result = solve_activations(search(k, mode), given)
        except Infeasible as e:
            overhead = max(overhead, time.perf_counter() - began - given)
            if k > refused_k:  # the most moved placement's refusal says the most
                refusal, refused_k = e, k
            continue
        streamed, hosted = split(k, mode)
        plan = result.plan.with_states(graph, streamed, hosted)
        report = simulate(graph, plan, fuse=fuse)
        overhead = max(overhead, time.perf_counter() - began - given)
        if report.peak_bytes > budget:
            continue
        if host_budget_bytes is not None and report.host_peak_bytes > host_budget_bytes:
            host_refusal_ = host_refusal_ or Infeasible(
                f"the plan that fits {format_bytes(budget)} with {k} of {n} units' optimizer state off the device "
                f"needs {format_bytes(report.host_peak_bytes)} of host memory (offloaded activations and the state "
                f"pool), over the host budget {format_bytes(host_budget_bytes)}", budget_bytes=budget)
            continue
        if best_report is None or report.time_s < best_report.time_s:
            best, best_report = (result, plan, k, mode), report
    if best is None:
        # a plan that fits the device but not the host budget says what the host must hold; else the most
        # moved placement's refusal
        raise host_refusal_ or refusal or Infeasible(f"no placement of the model states was solved within the "
                                                     f"time limit of {time_limit_s:g} s", budget_bytes=budget)
    result, plan, k, mode = best
    streamed, hosted = plan.streamed(), plan.hosted()
    info = plan.solver
    info.settings = {**info.settings, "time_limit_s": time_limit_s, "streamed_units": len(streamed),
                     "hosted_units": len(hosted), "state_units": n}
    if not k and len(plan_order) > 1:  # the claim holds with every state resident, the placement was searched
        info.space = f"{info.space or 'all'} (activations, with every unit's optimizer state resident)"
    if k:
        where = " and ".join(part for part in (f"{len(streamed)} streamed" if streamed else "",
                                               f"{len(hosted)} stepped on the host" if hosted else "") if part)
        info.space = f"{info.space or 'all'} (activations, with this plan's {k} of {n} units' state: {where})"
        info.status = "feasible" if info.status == "optimal" else info.status
        info.lower_bound_s, info.gap = None, None
    plan.predicted = plan.predicted.model_copy(update={
        "peak_bytes": best_report.peak_bytes, "step_time_s": best_report.time_s,
        "recompute_time_s": best_report.recompute_time_s, "exposed_transfer_s": best_report.exposed_transfer_s})
    info.solve_time_s = time.perf_counter() - start
    if not k:
        return dataclasses.replace(result, plan=plan, report=best_report, space=info.space,
                                   solve_time_s=info.solve_time_s)
    return dataclasses.replace(result, plan=plan, report=best_report, status=info.status, lower_bound_s=None,
                               gap=None, space=info.space, solve_time_s=info.solve_time_s)
