"""The ``dp`` method: memplan's exact chain DP on chains, the chain DP over stages on DAGs, and offloads
refined in the simulator; translated into keep / recompute / recompute_each (/ offload) actions and scored
by the simulator like every other method. The chain baselines (``rotor``, ``chen``, ``revolve``) are in
:mod:`memplan.solvers.baselines`.

The exact chain DP itself (the chain model, its engines, the least budget) lives in
:mod:`memplan.solvers.chain`; its docstring says what ``dp`` is exact for and how the table is filled.

**Its space.** On a chain of at most :data:`~memplan.solvers.chain.each.MAX_EACH_OPS` ops, ``dp`` solves
:mod:`memplan.solvers.chain.each`: the exact DP over keep / recompute / recompute_each (``recompute_each``: a
replay for another target frees the tensor again, multi-level replays), every plan the executor runs without
offload; its plan is scored by the simulator, and its ``optimal`` and bound hold over every plan
(``space``: ``all``; with ``per_use=False``, the keep / recompute DP below and ``keep/recompute``). Longer
chains (or that DP out of time) get the keep / recompute DP of :mod:`memplan.solvers.chain`, whose
``optimal`` and bound hold over keep / recompute plans, and the result says so (``space``:
``keep/recompute``). That DP prices each replayed op as the simulator does (its time and the replay
dispatch) but not the executor's watch of forward ops, which only adds time: its plan is simulated, and
it is ``optimal`` only when the simulated time is the DP's optimum, else ``feasible`` with that optimum as
its bound (:func:`keep_recompute_proposal`). Where no keep / recompute plan fits there, the faster of the multilevel family's plan
and recompute_each-everything that fits is returned (``feasible``) rather than an Infeasible beside it.
:func:`dp_frontier` reads the same.

**DAGs.** The graph DP of Kusumoto et al. 2019 enumerates lower sets, exponential in the graph's width,
and the simulator's lazy replay on a DAG does not decompose into runs; the exact method on DAGs is the
ILP (``solvers/ilp.py``). ``dp`` covers DAGs by the chain DP on the module-level chain
(:func:`memplan.planner.core.graph.coarsen`: a stage is kept or recomputed as a whole), scoring the DP's plans
at many memory levels in the simulator and returning the fastest that fits (together with the uniform
segmentations of ``chen`` and every-k, so it is never worse than those): status ``feasible``, never
``optimal``. Where none of those keep / recompute plans fits (nor, on a model with blocks, the hierarchical
solver's), the multi-level fallback of chains (:func:`per_use_fallback`) is tried before refusing.

**Offload** (``offload=True``, after Beaumont, Eyraud-Dubois, Shilova 2021): the simulator's offload
depends on the copy stream's timing (FIFO queueing, release at the first op boundary after the copy),
which the run decomposition above cannot carry exactly. ``dp`` therefore solves the keep / recompute
DP at the budget and at larger budgets (the same table), then turns kept or recomputed activations into
offloads while the simulator says the transfer fits the device and host budgets and lowers the step time
(prefetch at the simulator's default points, which hide the copy behind backward compute when it can):
a sound relaxation plus a simulator-checked refinement, status ``feasible``. On a chain, ``dp``'s own plan
without offload (recompute_each included) is a candidate too, so allowing offload never makes a plan
slower; its ``optimal`` and bound are dropped, as they cover no plan that offloads.
"""

from __future__ import annotations

import contextlib
import time

from memplan.planner.core.errors import Infeasible, MemplanError
from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Action
from memplan.planner.core.simulator import Report, default_prefetch_at, simulate_actions
from memplan.solvers.baselines import chen_candidates
from memplan.solvers.bounds import keep_all_report, memory_lower_bound
from memplan.solvers.chain.each import MAX_EACH_OPS, EachTable, TooLarge, each_min_budget_bytes, each_table
from memplan.solvers.chain.model import OpChain, op_chain
from memplan.solvers.chain.scorer import Scorer
from memplan.solvers.chain.solve import (
    ChainSolution,
    chain_min_budget_bytes,
    engine_for,
    read_plan,
    solve_chain,
)
from memplan.solvers.chain.stages import chain_elements, element_actions, stage_chain, stage_model
from memplan.solvers.chain.table import OutOfTime, full_spare
from memplan.solvers.every_k import every_k_search
from memplan.solvers.evict import give_back, graph_facts, polish
from memplan.solvers.hierarchical import has_blocks, solve_hierarchical
from memplan.solvers.min_memory import min_memory_actions
from memplan.solvers.multilevel import multilevel_search, per_use_in_time
from memplan.solvers.registry import ALL_PLANS, FrontierPoint, Proposal, plan_space, register

Actions = dict[int, Action]

_PAIR_MOVES_UP_TO = 16       # offload refinement tries pairs of changes on graphs this small
_PER_USE_FRONTIER_S = 10.0  # dp_frontier's searches for recompute_each plans below the DP's minimum, together
#: the space of the keep / recompute chain DP's claims (single-level replays)
KEEP_RECOMPUTE = plan_space(per_use=False, offload=False)
_OFFLOAD_REFINE_S = 10.0     # at most this long (or the time limit) refining offloads
HIERARCHICAL_SHARE_WITH_OFFLOAD = 0.35  # of the time left: the plan without offload, on a model with blocks
#: of the time left, what the least-peak search may take when no keep / recompute plan fits (per_use_fallback)
LEAST_PEAK_SHARE = 0.3


# ---- dp on DAGs: the chain DP on the coarsened chain -------------------------------------------------------
def _stage_candidates(graph: Graph, scorer: Scorer, budgets: list[int], deadline: float) -> None:
    """Score the stage DP's plans over the whole range of its memory levels, then, per budget, bisect
    between the fastest fitting level and the next one; add the chen and every-k plans."""
    stages = stage_chain(graph)
    scorer.add({}, "keep-all")
    if not len(stages):
        return
    chen_candidates(graph, stages, scorer)
    for b in budgets:
        scorer.add(every_k_search(graph, b)[1], "every-k")
    for split in (False, True):
        elements = chain_elements(graph, stages, split)
        if elements:
            _element_candidates(graph, scorer, budgets, deadline, elements, stage_model(graph, stages, elements))


def _element_candidates(graph: Graph, scorer: Scorer, budgets: list[int], deadline: float,
                        elements: list[tuple[int, tuple[int, ...]]], model: OpChain) -> None:
    """Score the stage model's plans at 49 of its breakpoints (the spares where its optimum changes),
    then, per budget, bisect between the last level that fits in the simulator and the next."""
    engine = engine_for(model, full_spare(model))
    points = engine.breakpoints()
    if not points:
        return
    levels = sorted({(len(points) - 1) * i // 48 for i in range(49)})

    def plan(i: int) -> Report:
        return scorer.add(element_actions(graph, elements, engine.kept(points[i])), "dp-stages")

    reports = {i: plan(i) for i in levels}
    for b in budgets:
        fitting = [i for i in levels if reports[i].peak_bytes <= b]
        if not fitting:
            continue
        a = max(fitting)
        z = next((i for i in levels if i > a), a)
        while z - a > 1 and time.perf_counter() < deadline:
            mid = (a + z) // 2
            if plan(mid).peak_bytes <= b:
                a = mid
            else:
                z = mid


# ---- offload: DP plans refined in the simulator ------------------------------------------------------------
def _offload_refine(graph: Graph, scorer: Scorer, budget: int, starts: list[Actions], deadline: float) -> None:
    """From each start plan, change single activations (keep / recompute / offload, offloads prefetched
    at the simulator's default point) while that lowers the simulated (peak over budget, step time); on
    small graphs, when no single change helps, pairs of changes. First improvement wins, largest first."""
    bw = graph.host_bandwidth_bytes_per_s
    tensors = graph.tensors
    order = [t for t in sorted(graph.saved_activations, key=lambda t: -tensors[t].bytes) if tensors[t].bytes > 0]
    pairs_ok = len(order) <= _PAIR_MOVES_UP_TO

    def key(r: Report) -> tuple[int, float]:
        over = r.peak_bytes > budget or (scorer.host is not None and r.host_peak_bytes > scorer.host)
        return (r.peak_bytes if over else 0, r.time_s)

    def moves(current: Actions, t: int):
        for a in (Action.OFFLOAD, Action.KEEP, Action.RECOMPUTE):
            if a != current.get(t, Action.KEEP) and (a != Action.RECOMPUTE or tensors[t].recomputable):
                yield a

    def changed(current: Actions, changes) -> Actions:
        trial = dict(current)
        for t, a in changes:
            if a == Action.KEEP:
                trial.pop(t, None)
            else:
                trial[t] = a
        return trial

    def neighbours(current: Actions):
        for t in order:
            for a in moves(current, t):
                yield changed(current, [(t, a)])
        if pairs_ok:
            for i, t in enumerate(order):
                for u in order[i + 1:]:
                    for a in moves(current, t):
                        for b in moves(current, u):
                            yield changed(current, [(t, a), (u, b)])

    for start in starts:
        current = dict(start)
        report = scorer.add(current, "dp+offload", _prefetch(graph, current, bw))
        improved = True
        while improved:
            improved = False
            for trial in neighbours(current):
                if time.perf_counter() > deadline:
                    return
                r = scorer.add(trial, "dp+offload", _prefetch(graph, trial, bw))
                if key(r) < key(report):
                    current, report, improved = trial, r, True
                    break


def keep_recompute_proposal(graph: Graph, sol: ChainSolution) -> Proposal:
    """The keep / recompute DP's plan with only the claims the simulator confirms. The DP prices every
    replayed op as the simulator does (its time and the replay dispatch) but not the executor's watch of
    forward ops, which depends on where the replays fall and only adds time. So: ``optimal`` when the plan's
    simulated time is the DP's optimum; else ``feasible``, with the DP's bound when the simulated time less
    the watch is the DP's value (the model held, the watch came on top), and with no bound when it is not
    (the simulator contradicts the model: never seen)."""
    report = simulate_actions(graph, sol.actions)
    tol = 1e-9 * max(abs(sol.time_s), 1e-300)
    priced = abs(report.time_s - report.watch_time_s - sol.time_s) <= tol
    optimal = sol.status == "optimal" and abs(report.time_s - sol.time_s) <= tol
    bound = None if not priced or sol.lower_bound_s is None else min(sol.lower_bound_s, report.time_s)
    return Proposal(sol.actions, status="optimal" if optimal else "feasible", lower_bound_s=bound,
                    space=KEEP_RECOMPUTE, stats={"model": "chain", "predicted_time_s": report.time_s,
                                                 "dp_time_s": sol.time_s, **sol.stats})


def _rounded_given_back(graph: Graph, p: Proposal, budget: int) -> Proposal:
    """A plan of the rounded chain DP (memory rounded up to a unit: room is left at every step) with the
    recomputed activations that have room kept again (:func:`memplan.solvers.evict.give_back`); its bound
    holds over every keep / recompute plan still. On a 1,000-op chain at GPU scale: 3,461 -> 3,420 s against
    Capuchin's 3,446 s at 30% (bound 3,376 s)."""
    if p.status == "optimal" or p.stats.get("exact_memory", True):
        return p
    actions, report, back = give_back(graph, graph_facts(graph), p.actions, budget)
    if back:
        p.actions = actions
        p.stats.update(given_back=back, predicted_time_s=report.time_s)
        if p.lower_bound_s is not None:
            p.lower_bound_s = min(p.lower_bound_s, report.time_s)
    return p


def per_use_fallback(graph: Graph, budget: int, deadline: float) -> tuple[Actions, Report] | None:
    """For a graph no keep / recompute plan of ``dp``'s fits: the fastest plan that fits ``budget`` among the
    multilevel family's (:func:`memplan.solvers.multilevel.multilevel_search`), recompute_each-everything
    (the least memory replays reach) and the least-peak search's
    (:func:`memplan.solvers.min_memory.min_memory_actions`), each made faster within the budget by
    :func:`memplan.solvers.evict.polish` in its share of the time left; None when none fits."""
    found: list[tuple[Actions, Report]] = []
    ml = multilevel_search(graph, budget, deadline=deadline)
    if ml is not None:
        found.append((ml[1], ml[2]))
    every = per_use_in_time(graph, deadline)  # its simulation takes seconds on a 1,000-op graph: only in time
    if every is not None:
        found.append((every, simulate_actions(graph, every)))
    left = deadline - time.perf_counter()
    if left > 0:
        least, prefetch_at = min_memory_actions(graph, time_limit_s=left * LEAST_PEAK_SHARE, deadline=deadline)
        if not prefetch_at:
            found.append((least, simulate_actions(graph, least)))
    fitting = sorted((f for f in found if f[1].peak_bytes <= budget), key=lambda f: f[1].time_s)
    facts = graph_facts(graph) if fitting else None
    best: tuple[Actions, Report] | None = None
    for k, (actions, report) in enumerate(fitting):
        now = time.perf_counter()
        actions, report, _ = polish(graph, facts, actions, report, budget,
                                    deadline=now + max(0.0, deadline - now) / (len(fitting) - k))
        if best is None or report.time_s < best[1].time_s:
            best = (actions, report)
    return best


def _per_use_or(refused: Proposal, graph: Graph, budget: int, deadline: float) -> Proposal:
    """On a DAG where none of ``dp``'s keep / recompute plans fits ``budget`` (the hierarchical solver's, the
    stage DP's): :func:`per_use_fallback`'s plan where one fits (multi-level replays go lower: on the MLP's
    fused step the least peak is recompute_each's), else ``refused``."""
    found = per_use_fallback(graph, budget, max(deadline, time.perf_counter() + 1e-3))
    if found is None:
        return refused
    return Proposal(found[0], status="feasible", space=refused.space,
                    stats={**refused.stats, "source": "recompute_each"})


def _without_offload(graph: Graph, budget: int, deadline: float, per_use: bool) -> Actions | None:
    """``dp``'s plan at ``budget`` without offload (recompute_each included with ``per_use``); None when it
    has none. Its claims are left behind: offload may beat it."""
    try:
        p = solve_dp(graph, budget, time_limit_s=max(deadline - time.perf_counter(), 1e-3), per_use=per_use)
    except Infeasible:
        return None
    return None if p.status == "infeasible" else p.actions


def _prefetch(graph: Graph, actions: Actions, bw: float) -> dict[int, int]:
    return {t: default_prefetch_at(graph, t, bw) for t, a in actions.items() if a == Action.OFFLOAD}


# ---- chains: every plan without offload (solvers/chain/each.py) -------------------------------------------
def _each_table(graph: Graph, ch: OpChain, budget: int, deadline: float) -> EachTable | None:
    """The keep / recompute / recompute_each DP filled up to ``budget``; None past its size limit or
    ``deadline`` (the keep / recompute DP answers then)."""
    if ch.n > MAX_EACH_OPS:
        return None
    try:
        return each_table(graph, ch, budget - ch.fixed_bytes, deadline=deadline)
    except (OutOfTime, TooLarge):
        return None


def _each_proposal(graph: Graph, ch: OpChain, table: EachTable, budget: int) -> Proposal | None:
    """The table's plan at ``budget``, checked by the simulator: ``optimal`` when its simulated time is the
    DP's optimum, which bounds every plan without offload (the executor's watch of forward ops, which the
    DP does not model, only adds time: then ``feasible`` with that bound). None when no plan fits; the
    simulator disagreeing with the DP's model (never seen) gives None too, after which the keep / recompute
    DP answers."""
    extra = table.extra_s(budget - ch.fixed_bytes) if budget >= ch.const_peak_bytes else None
    if extra is None:
        return None
    actions = table.actions(budget - ch.fixed_bytes)
    report = simulate_actions(graph, actions)
    bound = keep_all_report(graph).time_s + extra
    if report.peak_bytes > budget or abs(report.time_s - report.watch_time_s - bound) > 1e-9 * max(bound, 1e-300):
        return None
    optimal = report.time_s <= bound * (1 + 1e-12)
    return Proposal(actions, status="optimal" if optimal else "feasible", lower_bound_s=min(bound, report.time_s),
                    space=ALL_PLANS, stats={"model": "chain", "engine": "each", "predicted_time_s": report.time_s})


def _solve_chain_each(graph: Graph, ch: OpChain, budget: int, deadline: float) -> Proposal | None:
    """``dp`` on a chain over every plan without offload; None where the keep / recompute DP answers instead.
    Raises Infeasible with the exact least budget when no plan fits."""
    table = _each_table(graph, ch, budget, deadline)
    if table is None:
        return None
    found = _each_proposal(graph, ch, table, budget)
    if found is not None or (budget >= ch.const_peak_bytes and table.extra_s(budget - ch.fixed_bytes) is not None):
        return found
    try:
        least = each_min_budget_bytes(graph, ch, deadline=deadline)
    except (OutOfTime, TooLarge):
        return None
    raise Infeasible(f"dp: no plan of chain {graph.name!r} fits {budget} B; the least budget any plan without "
                     f"offload fits is exactly {least} B", budget_bytes=budget, min_feasible_bytes=least)


# ---- the dp method -------------------------------------------------------------------------------------
@register("dp", description=f"optimal DP on chains (keep/recompute/recompute_each up to {MAX_EACH_OPS} ops, "
                            "keep/recompute beyond; on DAGs over the coarsened module chain, feasible); offload by DP plus "
                            "simulator refinement",
          graphs="chain", exact=True, offload=True)
def solve_dp(graph: Graph, budget_bytes: int, *, time_limit_s: float = 60.0, offload: bool = False,
             host_budget_bytes: int | None = None, per_use: bool = True, **options: object) -> Proposal:
    """Least simulated step time within ``budget_bytes``. On a chain graph (module docstring) without
    offload: the exact DP, status ``optimal`` (``feasible`` with a lower bound if memory had to be
    rounded), over every plan (``per_use``, chains of up to ``MAX_EACH_OPS`` ops) or over keep / recompute
    plans (``space`` says which). On a DAG: the chain DP on ``coarsen(graph)`` scored in the simulator,
    ``feasible``. With ``offload``: the DP's plans refined with offloads in the simulator, and on a chain
    ``dp``'s plan without offload, the fastest that fits: ``feasible``, never slower than without offload."""
    if options:
        raise MemplanError(f"dp: unknown option(s) {', '.join(sorted(options))}")
    if not isinstance(per_use, bool):
        raise MemplanError(f"dp: option per_use must be true or false, got {per_use!r}")
    t0 = time.perf_counter()
    deadline = t0 + time_limit_s
    ch = op_chain(graph)
    if ch is not None and not offload and per_use:
        found = _solve_chain_each(graph, ch, budget_bytes, deadline)
        if found is not None:
            return found
    if ch is not None and not offload:
        try:
            sol = solve_chain(graph, ch, budget_bytes, deadline)
        except OutOfTime:
            return Proposal(status="infeasible", stats={"model": "chain", "stopped": "time limit"}, space=KEEP_RECOMPUTE)
        if sol is None:
            floor = chain_min_budget_bytes(graph, deadline=deadline)
            # the DP's plans keep or recompute; recompute_each (multi-level replays) may go lower: a plan
            # of those that fits is returned, not refused beside an Infeasible that names it
            found = per_use_fallback(graph, budget_bytes, deadline)
            if found is not None:
                actions, _ = found
                return Proposal(actions, status="feasible", space=KEEP_RECOMPUTE, stats={
                    "model": "chain", "source": "recompute_each", "keep_recompute_min_bytes": floor})
            if floor is None:
                stopped = {"stopped": "time limit"} if time.perf_counter() > deadline else {}
                return Proposal(status="infeasible", stats={"model": "chain", **stopped}, space=KEEP_RECOMPUTE)
            every = per_use_in_time(graph, deadline)  # the least memory replays reach
            least = floor if every is None else min(floor, simulate_actions(graph, every).peak_bytes)
            lower = f"; a recompute_each plan fits {least} B" if least < floor else ""
            raise Infeasible(f"dp: no plan of chain {graph.name!r} fits {budget_bytes} B; the least budget any "
                             f"keep / recompute plan fits is exactly {floor} B{lower}", budget_bytes=budget_bytes,
                             min_feasible_bytes=least)
        # exact over keep / recompute: a recompute_each plan may be faster (multi-level replays), so its
        # status and bound say which space they hold over
        return _rounded_given_back(graph, keep_recompute_proposal(graph, sol), budget_bytes)
    if ch is None and not offload and has_blocks(graph):
        # a real model: the hierarchical solver (exact block menus, chain DP over blocks)
        p = solve_hierarchical(graph, budget_bytes, time_limit_s=time_limit_s)
        p.stats = {"model": "hierarchical", **p.stats}
        if p.status == "infeasible":
            return _per_use_or(p, graph, budget_bytes, deadline)
        return p
    scorer = Scorer(graph, host_budget_bytes if offload else None)
    starts: list[Actions] = []
    if ch is not None:
        # chain + offload: the exact keep/recompute plans at the budget and at larger ones (over budget:
        # offloads may bring them down), and keep-everything, refined with offloads in the simulator
        peak = keep_all_report(graph).peak_bytes
        starts = [{}]
        for b in sorted({budget_bytes, *(budget_bytes + (peak - budget_bytes) * i // 4 for i in range(1, 4))}):
            try:
                sol = solve_chain(graph, ch, b, deadline)
            except OutOfTime:
                break
            if sol is not None:
                scorer.add(sol.actions, "dp")
                starts.append(sol.actions)
        if len(starts) == 1:
            starts.append({t: Action.RECOMPUTE for t in ch.tensors if graph.tensors[t].recomputable})
        plain = _without_offload(graph, budget_bytes, deadline, per_use)
        if plain is not None:  # with offload allowed as well, never slower than dp without it
            scorer.add(plain, "dp")
    else:
        _stage_candidates(graph, scorer, [budget_bytes], deadline)
        if offload and has_blocks(graph):
            # with offload allowed as well, never slower than dp without it: the hierarchical solver's plan
            # (what dp returns on this model without offload) is a candidate and a start of the refinement
            # (without it, GPT-2 base's offload plan at 25% of its activations measured 35% over keeping
            # everything on an H100 where the plan without offload predicts 30%)
            share = (deadline - time.perf_counter()) * HIERARCHICAL_SHARE_WITH_OFFLOAD
            with contextlib.suppress(Infeasible):
                found = solve_hierarchical(graph, budget_bytes, time_limit_s=share)
                if found.actions:
                    scorer.add(found.actions, "hierarchical")
        if offload:
            fastest = sorted(scorer.seen.values(), key=lambda v: (v[0].peak_bytes > budget_bytes, v[0].time_s))
            starts = [v[1] for v in fastest[:3]]
    if offload:
        _offload_refine(graph, scorer, budget_bytes, starts, min(deadline, t0 + _OFFLOAD_REFINE_S))
    best = scorer.best(budget_bytes)
    if best is None:
        none = Proposal(status="infeasible", stats={"model": "chain" if ch else "stages", "plans_scored": len(scorer.seen)})
        return none if offload or ch is not None else _per_use_or(none, graph, budget_bytes, deadline)
    report, actions, prefetch_at, source = best
    return Proposal(actions, prefetch_at, status="feasible",
                    stats={"model": "chain" if ch else "stages", "plans_scored": len(scorer.seen), "source": source})


def dp_frontier(graph: Graph, budgets: list[int], *, per_use: bool = True) -> list[tuple[int, float | None]]:
    """(budget, predicted overhead) for each budget (:func:`dp_frontier_points` without the claims)."""
    return [(p.budget_bytes, p.overhead) for p in dp_frontier_points(graph, budgets, per_use=per_use)]


def dp_frontier_points(graph: Graph, budgets: list[int], *, per_use: bool = True) -> list[FrontierPoint]:
    """A :class:`FrontierPoint` for each budget: on a chain graph the exact optimum at every budget from one
    engine (one pass, then one read per budget, when the engine is exact); on a DAG, ``dp`` run at each
    budget. Overhead = step time / keep-everything's - 1; None where no plan fits. Equal to
    ``solve(graph, b, "dp", per_use=per_use)`` at each budget by construction, its status and space too:
    both read the same code path."""
    base = keep_all_report(graph).time_s
    budgets = list(budgets)
    if not budgets:
        return []
    floor = memory_lower_bound(graph)
    ch = op_chain(graph)
    out: list[FrontierPoint] = []

    def point(b: int, time_s: float | None, status: str, space: str | None) -> FrontierPoint:
        if time_s is None:
            return FrontierPoint(b, None, "infeasible", None)
        return FrontierPoint(b, time_s / base - 1.0 if base > 0 else 0.0, status, space)

    table = _each_table(graph, ch, max(budgets), time.perf_counter() + 60.0) if ch is not None and per_use else None
    if table is not None:
        # one table read at every budget, as solve_dp reads its own (the same answer: clipping at the
        # larger budget only drops points above the smaller)
        for b in budgets:
            p = _each_proposal(graph, ch, table, b)
            if p is None and b >= ch.const_peak_bytes and table.extra_s(b - ch.fixed_bytes) is not None:
                try:  # the DP's model disagreed with the simulator (never seen): as solve_dp answers then
                    p = solve_dp(graph, b)
                except Infeasible:
                    p = None
            time_s = None if p is None else simulate_actions(graph, p.actions).time_s
            out.append(point(b, time_s, p.status if p else "infeasible", p.space if p else None))
        return out
    if ch is not None:
        # the one table for the largest budget when it is exact (its answer at a smaller budget is then the
        # optimum there, as solve's own table gives); a rounded one's unit could differ from the table a
        # smaller budget gets, so then each budget is solved as solve solves it
        top = engine_for(ch, max(budgets) - ch.fixed_bytes)
        per_use_until = time.perf_counter() + _PER_USE_FRONTIER_S  # all the frontier's recompute_each searches
        for b in budgets:
            engine = top if top.exact else engine_for(ch, b - ch.fixed_bytes)
            sol = read_plan(graph, ch, engine, b, base) if b >= floor else None
            if sol is not None:
                # the plan's simulated time and claims, as solve reports them (the DP's value leaves out the
                # executor's watch)
                p = keep_recompute_proposal(graph, sol)
                out.append(point(b, p.stats["predicted_time_s"], p.status, p.space))
                continue
            found = per_use_fallback(graph, b, per_use_until) if b >= floor else None
            # as solve_dp: a recompute_each plan where no keep / recompute one fits
            out.append(point(b, None if found is None else found[1].time_s, "feasible", KEEP_RECOMPUTE))
        return out
    # a DAG: each budget solved as solve_dp solves it (the same code path), scored by the simulator
    for b in budgets:
        time_s, status, space = None, "infeasible", None
        if b >= floor:
            try:
                p = solve_dp(graph, b)
            except Infeasible:
                p = None
            if p is not None and p.status != "infeasible":
                r = simulate_actions(graph, p.actions, prefetch_at=p.prefetch_at)
                if r.peak_bytes <= b:
                    time_s, status, space = r.time_s, p.status, p.space
        out.append(point(b, time_s, status, space))
    return out
