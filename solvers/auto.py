"""``auto``: start with a strategy picked by the graph's size, then keep the plan that measures fastest,
and make sure a plan memplan knows is returned.

Exhaustive on tiny graphs (``oracle`` over every action, recompute_each included, where that is at most
``ORACLE_MAX_PLANS`` plans), the ILP on small ones (its model covers every action too), the chain DP (the
hierarchical solver on models with blocks) on large ones, the greedy heuristic on huge ones. Unless that
first strategy proves its plan optimal over every action, the Capuchin and greedy heuristics and then the
ILP (on large graphs its blocks formulation: a proven bound and block-uniform plans) run with the time
left, and, where the first strategy's claims cover keep / recompute only (the chain DP), the multilevel
strategy's per-use replays too; the plan with the lowest simulated step time wins (every one's time in
``stats['portfolio_s']``, the winner in ``stats['won']`` and ``Proposal.method``). The highest lower bound
any of them proved bounds the winner too (``lower_bound_s``, its strategy in ``stats['bound_from']``;
without offload, where every bound here holds over the plans without offload). When the first method
finds no plan, it falls back to the greedy heuristic, then to the least-peak plan memplan finds
(``min-memory``), before calling the budget infeasible. An ordinary strategy: it delegates through the
registry.

Its time limit bounds the whole of it, not each strategy it runs: the first strategy gets
``PRIMARY_SHARE`` of it, and every later one (the portfolio, the fallbacks, the least-peak search) gets
what is left then, or is skipped when nothing is left (a service answers within its request's limit).
"""

from __future__ import annotations

import time

from memplan.planner.core.errors import Infeasible, MemplanError
from memplan.planner.core.graph import Graph
from memplan.planner.core.simulator import Report, simulate_actions
from memplan.solvers.core import propose
from memplan.solvers.evict import graph_facts, polish
from memplan.solvers.min_memory import min_memory_actions
from memplan.solvers.oracle import plan_count
from memplan.solvers.registry import ALL_PLANS, NO_OPTIONS, NoOptions, Proposal, SolverSpec, register, solvers

#: the oracle runs (over every action, recompute_each included) when it enumerates at most this many plans
ORACLE_MAX_PLANS = 3**7
ILP_MAX_OPS = 400
DP_MAX_OPS = 20_000
#: measured against the first strategy's plan, in this order, while time is left; the ILP last (on large
#: graphs its blocks formulation brings a proven bound and block-uniform plans, with whatever time is left)
PORTFOLIO = ("capuchin", "greedy", "ilp")
#: the part of auto's time limit its first strategy may use; the rest is for the portfolio and fallbacks
PRIMARY_SHARE = 0.7
#: a later strategy is not started with less than this left
MIN_LEFT_S = 0.05
#: of the time left, what each fallback may take (the others and the polishing run after it)
FALLBACK_SHARE = 0.5


def choose_method(graph: Graph, *, offload: bool = False) -> str:
    """The strategy ``auto`` runs first on ``graph`` (see the module docstring)."""
    reg = solvers()
    if "oracle" in reg and plan_count(graph, offload=offload, per_use=True) <= ORACLE_MAX_PLANS:
        return "oracle"
    if len(graph.ops) <= ILP_MAX_OPS and "ilp" in reg:
        return "ilp"
    if len(graph.ops) <= DP_MAX_OPS and "dp" in reg:
        return "dp"
    return "greedy"


Scored = tuple[Proposal, Report, str]


@register("auto", description="by size: the oracle on tiny graphs, the ILP on small ones, the DP (and the "
                              "fastest of it and the heuristics) on large ones; falls back to a heuristic "
                              "when its method misses a plan",
          graphs="dag", exact=False, offload=True, config=NoOptions)
def solve_auto(graph: Graph, budget_bytes: int, *, time_limit_s: float = 60.0, offload: bool = False,
               host_budget_bytes: int | None = None, config: NoOptions = NO_OPTIONS) -> Proposal:
    """Run :func:`choose_method`'s strategy; past the ILP's size keep the fastest of it and the
    heuristics' plans (their step times in ``stats['portfolio_s']``); when it finds nothing, fall back
    (``stats['fallback_from']``). The plan's strategy is in ``Proposal.method``; its status and bound are
    that strategy's. ``infeasible`` only when no fallback fits either."""
    method = choose_method(graph, offload=offload)
    deadline = time.perf_counter() + time_limit_s
    common = dict(time_limit_s=time_limit_s * PRIMARY_SHARE, offload=offload, host_budget_bytes=host_budget_bytes)
    try:
        spec = solvers()[method]
        best: Scored = (*propose(graph, spec, budget_bytes, config=_full_space(spec), **common), method)
    except Infeasible:
        # "auto" promises a plan whenever memplan knows one: near the minimum budget the exact methods
        # can miss it (their large-graph models are restricted), so fall back to the heuristics
        found, cut = _fallback(graph, budget_bytes, method, common, deadline)
        if found is None:
            stats = {"fallback_from": method}
            if cut or time.perf_counter() > deadline - MIN_LEFT_S:
                stats["stopped"] = "time limit"  # not a proof that nothing fits: solve says so
            return Proposal(status="infeasible", stats=stats)
        best = found
    else:
        # unless proved optimal over every action, the portfolio's plans are measured against it
        if best[0].status != "optimal" or best[0].space != ALL_PLANS:
            best = _best_of(graph, best, budget_bytes, common, deadline)
    proposal, _, made_by = best
    proposal.method = made_by
    proposal.stats["won"] = made_by
    return proposal


def _full_space(spec: SolverSpec) -> object:
    """``spec``'s default options, with the oracle enumerating recompute_each too (auto runs it only where
    that is affordable), so that its claims cover every plan."""
    return spec.config_for({"per_use": True}) if spec.name == "oracle" else spec.default_config()


def _left(deadline: float) -> float:
    """Seconds left before ``deadline``."""
    return deadline - time.perf_counter()


def _best_of(graph: Graph, first: Scored, budget: int, common: dict, deadline: float) -> Scored:
    """The fastest simulated plan among ``first`` and the portfolio heuristics' (each under the same
    budgets, started only while time is left before ``deadline``); every one's step time goes to
    ``stats['portfolio_s']``."""
    reg = solvers()
    best = first
    times = {first[2]: first[1].time_s}
    bounds = {first[2]: first[0].lower_bound_s}
    # a first strategy whose claims cover keep / recompute only (the chain DP): multilevel's per-use
    # replays may be faster, so they join the portfolio
    rest = ("multilevel",) if first[0].space != ALL_PLANS and not common["offload"] else ()
    for name in PORTFOLIO + rest:
        if name == first[2] or name not in reg or (common["offload"] and not reg[name].offload):
            continue
        if _left(deadline) < MIN_LEFT_S:
            best[0].stats.setdefault("portfolio_skipped", []).append(name)
            continue
        try:
            proposal, report = propose(graph, reg[name], budget, config=reg[name].default_config(),
                                       **{**common, "time_limit_s": _left(deadline)})
        except Infeasible:
            continue
        except MemplanError:  # not for this request (the ILP's offload model on a large graph)
            continue
        times[name] = report.time_s
        bounds[name] = proposal.lower_bound_s
        if report.time_s < best[1].time_s:
            best = (proposal, report, name)
    best[0].stats["portfolio_s"] = times
    # every strategy's bound holds for every plan of its space: the highest one bounds the winner too.
    # Without offload every bound here is over the keep / recompute (/ recompute_each) plans; with it,
    # only the winner's own is kept (another's may leave offload out)
    valid = {n: b for n, b in bounds.items() if b is not None and (not common["offload"] or n == best[2])}
    if valid:
        source = max(valid, key=valid.__getitem__)
        best[0].lower_bound_s = min(valid[source], best[1].time_s)
        best[0].stats["bound_from"] = source
        if best[1].time_s <= best[0].lower_bound_s * (1 + 1e-9) and best[0].status != "optimal":
            best[0].status = "optimal"
    return best


def _fallback(graph: Graph, budget: int, failed: str, common: dict, deadline: float) -> tuple[Scored | None, bool]:
    """``auto``'s second try after ``failed`` found no plan: the greedy heuristic, (without offload) the
    multilevel strategy and the plan of :func:`~memplan.solvers.min_memory.min_memory_actions` (named
    ``min-memory``), each started only while time is left before ``deadline``; each that fits is made
    faster within the budget (:func:`~memplan.solvers.evict.polish`) and the fastest is kept (None when
    none fits); and whether the least-peak search was cut short (by its share of the time, or none left).
    Near the least peak the first plan that fits may be far from the best: on the U-Net's graph the
    multi-level plan took +672% where the least-peak plan, polished, took +113%."""
    reg = solvers()
    fits: list[Scored] = []
    # greedy, then the fastest two-level plan with per-use replays (multilevel, no offload; at most 10 s)
    tries = ["greedy"] + (["multilevel"] if not common["offload"] else [])
    for name in tries:
        if name == failed or name not in reg:
            continue
        left = _left(deadline) if name == "greedy" else min(_left(deadline), 10.0)
        if left < MIN_LEFT_S:
            break
        try:
            proposal, report = propose(graph, reg[name], budget, config=reg[name].default_config(),
                                       **{**common, "time_limit_s": left * FALLBACK_SHARE})
            fits.append((proposal, report, name))
        except Infeasible:
            pass
    offload, host_budget = common["offload"], common["host_budget_bytes"]
    cut = True
    if _left(deadline) >= MIN_LEFT_S:
        share = _left(deadline) * FALLBACK_SHARE
        started = time.perf_counter()
        actions, prefetch_at = min_memory_actions(graph, offload=offload, time_limit_s=share, deadline=deadline)
        cut = time.perf_counter() - started >= share
        report = simulate_actions(graph, actions, prefetch_at=prefetch_at, timeline=False)
        host_ok = not offload or host_budget is None or report.host_peak_bytes <= host_budget
        if report.peak_bytes <= budget and host_ok:
            fits.append((Proposal(actions, prefetch_at, "feasible"), report, "min-memory"))
    if not fits:
        return None, cut
    facts = graph_facts(graph)
    best: Scored | None = None
    for k, (proposal, report, name) in enumerate(sorted(fits, key=lambda f: f[1].time_s)):
        share = max(0.0, _left(deadline)) / (len(fits) - k)
        moves = 0
        if "polished" not in proposal.stats:  # (the eviction heuristics polish their own plans)
            actions, report, moves = polish(graph, facts, proposal.actions, report, budget,
                                            deadline=time.perf_counter() + share)
        if moves:
            proposal.actions, proposal.status = actions, "feasible"
            proposal.stats["polished"] = moves
        if best is None or report.time_s < best[1].time_s:
            best = (proposal, report, name)
    best[0].stats["fallback_from"] = failed
    return best, False
