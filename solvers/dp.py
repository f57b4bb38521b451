"""Dynamic programming on chains: memplan's exact chain DP (``dp``), and the published chain schedules
as baselines (``rotor``, ``chen``, ``revolve``), all translated into keep / recompute (/ offload) actions
and scored by the simulator like every other method.

The exact chain DP itself (the chain model, its engines, the least budget) lives in
:mod:`memplan.solvers.chain`; its docstring says what ``dp`` is exact for and how the table is filled.

**DAGs.** The graph DP of Kusumoto et al. 2019 enumerates lower sets, exponential in the graph's width,
and the simulator's lazy replay on a DAG does not decompose into runs; the exact method on DAGs is the
ILP (``solvers/ilp.py``). ``dp`` covers DAGs by the chain DP on the module-level chain
(:func:`memplan.planner.core.graph.coarsen`: a stage is kept or recomputed as a whole), scoring the DP's plans
at many memory levels in the simulator and returning the fastest that fits (together with the uniform
segmentations of ``chen`` and every-k, so it is never worse than those): status ``feasible``, never
``optimal``.

**Offload** (``offload=True``, after Beaumont, Eyraud-Dubois, Shilova 2021): the simulator's offload
depends on the copy stream's timing (FIFO queueing, release at the first op boundary after the copy),
which the run decomposition above cannot carry exactly. ``dp`` therefore solves the keep / recompute
DP at the budget and at larger budgets (the same table), then turns kept or recomputed activations into
offloads while the simulator says the transfer fits the device and host budgets and lowers the step time
(prefetch at the simulator's default points, which hide the copy behind backward compute when it can):
a sound relaxation plus a simulator-checked refinement, status ``feasible``.

Baselines, each on the coarsened chain (op-level stages for a chain graph): ``rotor`` (Beaumont,
Eyraud-Dubois, Herrmann, Joly, Shilova 2019: nested recomputation DP, ``Opt[s][t][m]``), ``chen`` (Chen
et al. 2016: sqrt(n) segments), ``revolve`` (Griewank & Walther 2000: binomial checkpoint positions).
memplan's plans recompute each tensor at most once, so a nested schedule is translated into the
activations it keeps in its first forward sweep; each baseline is tried over its own parameter and the
fastest simulated plan that fits is returned.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from memplan.planner.core.errors import Infeasible, MemplanError
from memplan.planner.core.graph import Graph, coarsen
from memplan.planner.core.plan import Action
from memplan.planner.core.simulator import Report, default_prefetch_at, simulate_actions
from memplan.solvers.bounds import keep_all_report, memory_lower_bound
from memplan.solvers.chain.model import OpChain, chain_model, op_chain
from memplan.solvers.chain.solve import chain_min_budget_bytes, engine_for, read_plan, solve_chain
from memplan.solvers.chain.table import full_spare
from memplan.solvers.every_k import every_k_search
from memplan.solvers.hierarchical import has_blocks, solve_hierarchical
from memplan.solvers.multilevel import per_use_everything
from memplan.solvers.registry import Proposal, register

Actions = dict[int, Action]

_PAIR_MOVES_UP_TO = 16       # offload refinement tries pairs of changes on graphs this small
_OFFLOAD_REFINE_S = 10.0     # at most this long (or the time limit) refining offloads


# ---- stage views (coarsened chains) ------------------------------------------------------------------
@dataclass(frozen=True)
class _Stages:
    """A chain of stages for the baselines and the DAG path. ``produced[s]``: the saved activations
    produced by stage ``s`` (kept or recomputed together); ``inputs[s]``: the saved activations crossing
    into stage ``s`` (a checkpoint at that boundary)."""

    ops: tuple[tuple[int, ...], ...]
    produced: tuple[tuple[int, ...], ...]
    inputs: tuple[tuple[int, ...], ...]
    time_s: tuple[float, ...]
    backward_time_s: tuple[float, ...]
    produced_bytes: tuple[int, ...]
    input_bytes: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.ops)


def _stages(graph: Graph, max_stages: int | None = None) -> _Stages:
    """Op-level stages for a chain graph (grouped evenly to at most ``max_stages``); otherwise
    ``coarsen(graph)``, or the shallowest module depth giving at least 4 stages when that gives fewer."""
    n = len(graph.ops)
    if op_chain(graph) is not None:
        per = 1 if max_stages is None or n <= max_stages else -(-n // max_stages)
        groups = [tuple(range(i, min(i + per, n))) for i in range(0, n, per)]
    else:
        chain = coarsen(graph)
        if len(chain) < 4 and graph.ops:
            deepest = max(len([p for p in op.module.split(".") if p]) for op in graph.ops)
            for d in range(1, deepest + 1):
                finer = coarsen(graph, d)
                if len(finer) >= 4:
                    chain = finer
                    break
        groups = [s.ops for s in chain.stages]
        if max_stages is not None and len(groups) > max_stages:
            per = -(-len(groups) // max_stages)
            groups = [tuple(o for g in groups[i:i + per] for o in g) for i in range(0, len(groups), per)]
    saved = set(graph.saved_activations)
    tensors = graph.tensors
    stage_of = {}
    for s, ops in enumerate(groups):
        for o in ops:
            stage_of[o] = s
    produced: list[list[int]] = [[] for _ in groups]
    for t in graph.saved_activations:
        produced[stage_of[tensors[t].producer]].append(t)
    inputs: list[list[int]] = []
    for s, ops in enumerate(groups):
        crossing = {t for o in ops for t in (*graph.ops[o].inputs, *graph.ops[o].saved)
                    if t in saved and stage_of[tensors[t].producer] < s}
        inputs.append(sorted(crossing))
    return _Stages(
        ops=tuple(tuple(g) for g in groups), produced=tuple(map(tuple, produced)), inputs=tuple(map(tuple, inputs)),
        time_s=tuple(sum(graph.ops[o].time_s for o in g) for g in groups),
        backward_time_s=tuple(sum(graph.ops[o].backward_time_s for o in g) for g in groups),
        produced_bytes=tuple(sum(tensors[t].bytes for t in p) for p in produced),
        input_bytes=tuple(sum(tensors[t].bytes for t in i) for i in inputs))


def _stage_actions(graph: Graph, stages: _Stages, keep_stages, keep_inputs=()) -> Actions:
    """Keep what the kept stages produce and the activations crossing into the checkpointed stages;
    recompute every other saved activation that can be (zero-byte ones are kept: nothing to gain)."""
    keep: set[int] = set()
    for s in keep_stages:
        keep.update(stages.produced[s])
    for s in keep_inputs:
        keep.update(stages.inputs[s])
    tensors = graph.tensors
    return {t: Action.RECOMPUTE for p in stages.produced for t in p
            if t not in keep and tensors[t].recomputable and tensors[t].bytes > 0}


def _elements(graph: Graph, stages: _Stages, split: bool) -> list[tuple[int, tuple[int, ...]]]:
    """The chain elements of the stage DP: (stage, saved tensors kept or recomputed together). Whole
    stages, or (``split``) each stage's inner activations, then those it hands on to later stages (its
    boundary: keeping it while recomputing the inside is rotor's checkpoint without x-bar)."""
    if not split:
        return list(enumerate(stages.produced))
    stage_of = {o: s for s, ops in enumerate(stages.ops) for o in ops}
    out: list[tuple[int, tuple[int, ...]]] = []
    for s, produced in enumerate(stages.produced):
        later = {t for t in produced
                 if any(stage_of[o] > s for o in (*graph.consumers.get(t, ()), *graph.savers.get(t, ())))}
        inner = tuple(t for t in produced if t not in later)
        boundary = tuple(t for t in produced if t in later)
        out += [(s, part) for part in (inner, boundary) if part]
    return out


def _stage_model(graph: Graph, stages: _Stages, elements: list[tuple[int, tuple[int, ...]]]) -> OpChain:
    """The chain model of the elements, as if each were one linear_chain op producing its tensors (its
    stage's time to recompute, its stage's workspace and gradients on the stage's first element): an
    approximation on a DAG, used to rank stage plans that the simulator then scores."""
    ops, tensors = graph.ops, graph.tensors
    first = {s: i for i, (s, _) in reversed(list(enumerate(elements)))}

    def per_stage(i: int, s: int, value: int) -> int:
        return value if first[s] == i else 0

    return chain_model(
        tensors=tuple(range(len(elements))), bytes_=[sum(tensors[t].bytes for t in ts) for _, ts in elements],
        time_s=[stages.time_s[s] for s, _ in elements], recomputable=[True] * len(elements),
        ws=[per_stage(i, s, max(ops[o].workspace_bytes for o in stages.ops[s])) for i, (s, _) in enumerate(elements)],
        bws=[per_stage(i, s, max(ops[o].backward_workspace_bytes for o in stages.ops[s]))
             for i, (s, _) in enumerate(elements)],
        alloc=[per_stage(i, s, sum(ops[o].backward_grad_alloc_bytes for o in stages.ops[s]))
               for i, (s, _) in enumerate(elements)],
        free=[per_stage(i, s, sum(ops[o].backward_grad_free_bytes for o in stages.ops[s]))
              for i, (s, _) in enumerate(elements)],
        fixed=graph.fixed.resident_bytes, optimizer_bytes=graph.fixed.optimizer_step_bytes)


def _element_actions(graph: Graph, elements: list[tuple[int, tuple[int, ...]]], kept: list[int]) -> Actions:
    keep = {t for i in kept for t in elements[i][1]}
    tensors = graph.tensors
    return {t: Action.RECOMPUTE for _, ts in elements for t in ts
            if t not in keep and tensors[t].recomputable and tensors[t].bytes > 0}


class _Scorer:
    """Simulated candidate plans, memoised; picks the fastest that fits a budget."""

    def __init__(self, graph: Graph, host_budget_bytes: int | None = None):
        self.graph = graph
        self.host = host_budget_bytes
        self.seen: dict[frozenset, tuple[Report, Actions, dict[int, int], str]] = {}

    def add(self, actions: Actions, source: str, prefetch_at: dict[int, int] | None = None) -> Report:
        key = frozenset((*actions.items(), *((t, -k - 1) for t, k in (prefetch_at or {}).items())))
        if key not in self.seen:
            r = simulate_actions(self.graph, actions, prefetch_at=prefetch_at)
            self.seen[key] = (r, actions, dict(prefetch_at or {}), source)
        return self.seen[key][0]

    def best(self, budget: int):
        fits = [v for v in self.seen.values() if v[0].peak_bytes <= budget
                and (self.host is None or v[0].host_peak_bytes <= self.host)]
        if not fits:
            return None
        return min(fits, key=lambda v: (v[0].time_s, v[0].peak_bytes, len(v[1])))


# ---- dp on DAGs: the chain DP on the coarsened chain -------------------------------------------------------
def _stage_candidates(graph: Graph, scorer: _Scorer, budgets: list[int], deadline: float) -> None:
    """Score the stage DP's plans over the whole range of its memory levels, then, per budget, bisect
    between the fastest fitting level and the next one; add the chen and every-k plans."""
    stages = _stages(graph)
    scorer.add({}, "keep-all")
    if not len(stages):
        return
    _chen_candidates(graph, stages, scorer)
    for b in budgets:
        scorer.add(every_k_search(graph, b)[1], "every-k")
    for split in (False, True):
        elements = _elements(graph, stages, split)
        if elements:
            _element_candidates(graph, scorer, budgets, deadline, elements, _stage_model(graph, stages, elements))


def _element_candidates(graph: Graph, scorer: _Scorer, budgets: list[int], deadline: float,
                        elements: list[tuple[int, tuple[int, ...]]], model: OpChain) -> None:
    """Score the stage model's plans at 49 of its breakpoints (the spares where its optimum changes),
    then, per budget, bisect between the last level that fits in the simulator and the next."""
    engine = engine_for(model, full_spare(model))
    points = engine.breakpoints()
    if not points:
        return
    levels = sorted({(len(points) - 1) * i // 48 for i in range(49)})

    def plan(i: int) -> Report:
        return scorer.add(_element_actions(graph, elements, engine.kept(points[i])), "dp-stages")

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
def _offload_refine(graph: Graph, scorer: _Scorer, budget: int, starts: list[Actions], deadline: float) -> None:
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


def _prefetch(graph: Graph, actions: Actions, bw: float) -> dict[int, int]:
    return {t: default_prefetch_at(graph, t, bw) for t, a in actions.items() if a == Action.OFFLOAD}


# ---- the dp method -------------------------------------------------------------------------------------
@register("dp", description="optimal keep/recompute DP on chains (exact for linear chains; on DAGs over "
                            "the coarsened module chain, feasible); offload by DP plus simulator refinement",
          graphs="chain", exact=True, offload=True)
def solve_dp(graph: Graph, budget_bytes: int, *, time_limit_s: float = 60.0, offload: bool = False,
             host_budget_bytes: int | None = None, **options: object) -> Proposal:
    """Least simulated step time within ``budget_bytes``. On a chain graph (module docstring) without
    offload: the exact DP, status ``optimal`` (``feasible`` with a lower bound if memory had to be
    rounded). On a DAG: the chain DP on ``coarsen(graph)`` scored in the simulator, ``feasible``. With
    ``offload``: the DP's plans refined with offloads in the simulator, ``feasible``."""
    if options:
        raise MemplanError(f"dp: unknown option(s) {', '.join(sorted(options))}")
    t0 = time.perf_counter()
    deadline = t0 + time_limit_s
    ch = op_chain(graph)
    if ch is not None and not offload:
        sol = solve_chain(graph, ch, budget_bytes)
        if sol is None:
            floor = chain_min_budget_bytes(graph)
            if floor is None:
                return Proposal(status="infeasible", stats={"model": "chain"})
            # the DP's plans keep or recompute; recompute_each (multi-level replays) may go lower
            per_use = per_use_everything(graph)
            least = floor if per_use is None else min(floor, simulate_actions(graph, per_use).peak_bytes)
            lower = f"; a recompute_each plan fits {least} B" if least < floor else ""
            raise Infeasible(f"dp: no plan of chain {graph.name!r} fits {budget_bytes} B; the least budget any "
                             f"keep / recompute plan fits is exactly {floor} B{lower}", budget_bytes=budget_bytes,
                             min_feasible_bytes=least)
        return Proposal(sol.actions, status=sol.status, lower_bound_s=sol.lower_bound_s,
                        stats={"model": "chain", "predicted_time_s": sol.time_s, **sol.stats})
    if ch is None and not offload and has_blocks(graph):
        # a real model: the hierarchical solver (exact block menus, chain DP over blocks)
        p = solve_hierarchical(graph, budget_bytes, time_limit_s=time_limit_s)
        p.stats = {"model": "hierarchical", **p.stats}
        return p
    scorer = _Scorer(graph, host_budget_bytes if offload else None)
    starts: list[Actions] = []
    if ch is not None:
        # chain + offload: the exact keep/recompute plans at the budget and at larger ones (over budget:
        # offloads may bring them down), and keep-everything, refined with offloads in the simulator
        peak = keep_all_report(graph).peak_bytes
        starts = [{}]
        for b in sorted({budget_bytes, *(budget_bytes + (peak - budget_bytes) * i // 4 for i in range(1, 4))}):
            sol = solve_chain(graph, ch, b)
            if sol is not None:
                scorer.add(sol.actions, "dp")
                starts.append(sol.actions)
        if len(starts) == 1:
            starts.append({t: Action.RECOMPUTE for t in ch.tensors if graph.tensors[t].recomputable})
    else:
        _stage_candidates(graph, scorer, [budget_bytes], deadline)
        if offload:
            fastest = sorted(scorer.seen.values(), key=lambda v: (v[0].peak_bytes > budget_bytes, v[0].time_s))
            starts = [v[1] for v in fastest[:3]]
    if offload:
        _offload_refine(graph, scorer, budget_bytes, starts, min(deadline, t0 + _OFFLOAD_REFINE_S))
    best = scorer.best(budget_bytes)
    if best is None:
        return Proposal(status="infeasible", stats={"model": "chain" if ch else "stages", "plans_scored": len(scorer.seen)})
    report, actions, prefetch_at, source = best
    return Proposal(actions, prefetch_at, status="feasible",
                    stats={"model": "chain" if ch else "stages", "plans_scored": len(scorer.seen), "source": source})


def dp_frontier(graph: Graph, budgets: list[int]) -> list[tuple[int, float | None]]:
    """(budget, predicted overhead) for each budget: on a chain graph the exact optimum at every budget
    from one engine (one pass, then one read per budget, when the engine is exact); on a DAG, ``dp`` run
    at each budget. Overhead = step time / keep-everything's - 1; None where no plan fits. Equal to
    ``solve(graph, b, "dp")`` at each budget by construction: both read the same code path."""
    base = keep_all_report(graph).time_s
    budgets = list(budgets)
    if not budgets:
        return []
    floor = memory_lower_bound(graph)
    ch = op_chain(graph)
    out: list[tuple[int, float | None]] = []
    if ch is not None:
        # the one table for the largest budget when it is exact (its answer at a smaller budget is then the
        # optimum there, as solve's own table gives); a rounded one's unit could differ from the table a
        # smaller budget gets, so then each budget is solved as solve solves it
        top = engine_for(ch, max(budgets) - ch.fixed_bytes)
        for b in budgets:
            engine = top if top.exact else engine_for(ch, b - ch.fixed_bytes)
            sol = read_plan(graph, ch, engine, b, base) if b >= floor else None
            out.append((b, None if sol is None else (sol.time_s / base - 1.0 if base > 0 else 0.0)))
        return out
    # a DAG: each budget solved as solve_dp solves it (the same code path), scored by the simulator
    for b in budgets:
        overhead = None
        if b >= floor:
            try:
                p = solve_dp(graph, b)
            except Infeasible:
                p = None
            if p is not None and p.status != "infeasible":
                r = simulate_actions(graph, p.actions, prefetch_at=p.prefetch_at)
                if r.peak_bytes <= b:
                    overhead = r.time_s / base - 1.0 if base > 0 else 0.0
        out.append((b, overhead))
    return out


# ---- baselines -----------------------------------------------------------------------------------------
def _chen_candidates(graph: Graph, stages: _Stages, scorer: _Scorer, segments: int | None = None) -> None:
    """Chen et al. 2016: cut the chain into about sqrt(n) segments of equal length; keep what the last
    stage of each segment produces (the next segment's input) and the whole last segment."""
    n = len(stages)
    k = segments if segments is not None else max(1, math.isqrt(n - 1) + 1 if n > 1 else 1)
    length = max(1, -(-n // k))
    bounds = list(range(length - 1, n, length))
    last_start = (bounds[-1] + 1) if bounds and bounds[-1] + 1 < n else (bounds[-2] + 1 if len(bounds) > 1 else 0)
    keep = set(bounds) | set(range(last_start, n))
    scorer.add(_stage_actions(graph, stages, keep), "chen")


def _run_baseline(graph: Graph, budget: int, name: str, fill) -> Proposal:
    scorer = _Scorer(graph)
    scorer.add({}, "keep-all")
    fill(scorer)
    best = scorer.best(budget)
    if best is None:
        return Proposal(status="infeasible", stats={"plans_scored": len(scorer.seen)})
    report, actions, _, source = best
    return Proposal(actions, status="feasible", stats={"plans_scored": len(scorer.seen), "source": source})


@register("chen", description="Chen et al. 2016: sqrt(n) equal segments of the coarsened chain "
                              "(keep-everything when it fits)", graphs="chain")
def solve_chen(graph: Graph, budget_bytes: int, *, time_limit_s: float = 60.0, offload: bool = False,
               host_budget_bytes: int | None = None, segments: int | None = None, **options: object) -> Proposal:
    """Keep-everything if it fits, else Chen's sqrt(n)-segment plan (``segments=`` to choose the count)."""
    if options:
        raise MemplanError(f"chen: unknown option(s) {', '.join(sorted(options))}")
    stages = _stages(graph)
    if segments is not None and (not isinstance(segments, int) or isinstance(segments, bool)
                                 or not 1 <= segments <= max(1, len(stages))):
        raise MemplanError(f"chen: segments must be an integer from 1 to {len(stages)} (the stages), got {segments!r}")
    return _run_baseline(graph, budget_bytes, "chen",
                         lambda sc: len(stages) and _chen_candidates(graph, stages, sc, segments))


def revolve_checkpoints(steps: int, snaps: int) -> list[int]:
    """Griewank & Walther's binomial schedule: the positions (0 .. steps-1) at which the first forward
    sweep stores a checkpoint, for a homogeneous chain of ``steps`` steps and ``snaps`` checkpoint slots
    (position 0, the input, included). With ``r`` the least number of repetitions such that
    ``C(snaps + r, snaps) >= steps``, each advance is ``C(s + r - 1, s)`` steps (``s`` slots left) and
    the rest is covered with one slot fewer."""
    if steps <= 0:
        return []
    snaps = max(1, snaps)
    pos, left, s, out = 0, steps, snaps, [0]
    while left > 1 and s > 1:
        r = 0
        while math.comb(s + r, s) < left:
            r += 1
        if r == 0:
            break
        advance = max(1, min(left - 1, math.comb(s + r - 1, s)))
        pos += advance
        left -= advance
        s -= 1
        out.append(pos)
    return out


@register("revolve", description="REVOLVE (Griewank & Walther 2000): binomial checkpoint positions on the "
                                 "coarsened chain, over the number of checkpoints", graphs="chain")
def solve_revolve(graph: Graph, budget_bytes: int, *, time_limit_s: float = 60.0, offload: bool = False,
                  host_budget_bytes: int | None = None, snaps: int | None = None, **options: object) -> Proposal:
    """The binomial schedule's first-sweep checkpoints as kept stage boundaries (the last stage kept),
    for ``snaps`` slots or, by default, the count whose simulated plan is fastest within the budget."""
    if options:
        raise MemplanError(f"revolve: unknown option(s) {', '.join(sorted(options))}")
    stages = _stages(graph)
    n = len(stages)
    deadline = time.perf_counter() + time_limit_s

    def fill(sc: _Scorer) -> None:
        for c in ([snaps] if snaps is not None else range(1, n + 1)):
            checkpoints = revolve_checkpoints(n, c)
            sc.add(_stage_actions(graph, stages, {n - 1}, [p for p in checkpoints if p > 0]), f"revolve({c})")
            if time.perf_counter() > deadline:
                break

    return _run_baseline(graph, budget_bytes, "revolve", fill if n else (lambda sc: None))


# ---- rotor -----------------------------------------------------------------------------------------------
_ROTOR_STAGES = 64
_ROTOR_UNITS = 160


def _rotor_table(uf, ub, x, xbar, M):
    """Beaumont et al. 2019's ``Opt[s][t][m]``: least time to run forward and backward of stages
    ``s .. t`` given their input stored, with ``m`` memory units for everything else; either store all of
    stage ``s`` (x-bar) and continue, or store the input of a later stage ``s'`` as a checkpoint, run on,
    and redo ``s .. s'-1`` afterwards with the memory given back. ``choice[s][t][m]`` = -1 (all) or s'."""
    L = len(uf)
    inf = np.inf
    opt = [[None] * L for _ in range(L)]
    choice = [[None] * L for _ in range(L)]
    ar = np.arange(M + 1)

    def shift(a, d):
        out = np.full(M + 1, inf)
        if d <= M:
            out[d:] = a[: M + 1 - d]
        return out

    pre = np.concatenate([[0.0], np.cumsum(uf)])
    for s in range(L):
        opt[s][s] = np.where(ar >= xbar[s], uf[s] + ub[s], inf)
        choice[s][s] = np.full(M + 1, -1, dtype=np.int64)
    for length in range(1, L):
        for s in range(L - length):
            t = s + length
            best = uf[s] + ub[s] + shift(opt[s + 1][t], xbar[s])
            ch = np.full(M + 1, -1, dtype=np.int64)
            for sp in range(s + 1, t + 1):
                cand = (pre[sp] - pre[s]) + shift(opt[sp][t], x[sp]) + opt[s][sp - 1]
                better = cand < best
                best = np.where(better, cand, best)
                ch = np.where(better, sp, ch)
            opt[s][t], choice[s][t] = best, ch
    return opt, choice


@register("rotor", description="Beaumont et al. 2019: nested-recomputation DP on the coarsened "
                               "(heterogeneous) chain, translated into memplan actions", graphs="chain")
def solve_rotor(graph: Graph, budget_bytes: int, *, time_limit_s: float = 60.0, offload: bool = False,
                host_budget_bytes: int | None = None, **options: object) -> Proposal:
    """Rotor's optimal schedule for each memory level (one table), translated into the activations it
    keeps in its first forward sweep (stages stored whole, and checkpointed stage inputs); the fastest
    simulated translation that fits is returned."""
    if options:
        raise MemplanError(f"rotor: unknown option(s) {', '.join(sorted(options))}")
    stages = _stages(graph, _ROTOR_STAGES)
    L = len(stages)
    if not L:
        return _run_baseline(graph, budget_bytes, "rotor", lambda sc: None)
    total = sum(stages.produced_bytes) + max(stages.input_bytes)
    unit = max(1, -(-total // _ROTOR_UNITS))
    x = [-(-b // unit) for b in stages.input_bytes]
    xbar = [-(-b // unit) for b in stages.produced_bytes]
    M = -(-total // unit)
    opt, choice = _rotor_table(list(stages.time_s), list(stages.backward_time_s), x, xbar, M)

    def translate(m: int) -> Actions | None:
        if not np.isfinite(opt[0][L - 1][m]):
            return None
        keep_stages, keep_inputs = set(), set()
        s, t = 0, L - 1
        while True:
            c = int(choice[s][t][m])
            if s == t:
                keep_stages.add(s)
                break
            if c < 0:
                keep_stages.add(s)
                m -= xbar[s]
                s += 1
            else:
                keep_inputs.add(c)
                m -= x[c]
                s = c
        return _stage_actions(graph, stages, keep_stages, keep_inputs)

    def fill(sc: _Scorer) -> None:
        for m in range(M + 1):
            a = translate(m)
            if a is not None:
                sc.add(a, f"rotor(m={m * unit})")

    return _run_baseline(graph, budget_bytes, "rotor", fill)
