"""The ILP past a few hundred saved activations: a proven bound from the staircase relaxation
(:mod:`.staircase`), plans from the same model restricted to *block-uniform* choices.

The layers of a transformer are identical: the same ops, tensor sizes and edges, one after another.
:func:`layer_classes` finds them (runs of ops sharing a module prefix, with equal signatures) and matches
their saved activations by position. A plan that makes the same choice for matched activations of every
layer in a group of consecutive layers is *block-uniform*; with ``G`` groups the model keeps a few dozen
free decisions whatever the depth, and HiGHS solves it in a second or two where the full MIP of an
80-layer model finds nothing in a minute. Mixed choices (some layers keeping more than others) come from
more groups (1, 2, 4, 8, ...), tried while time is left.

**Bound.** The LP relaxation of the full (unrestricted) staircase model, then, with the time left, its
MIP's dual bound (whichever is higher). The restriction only chooses which plans are tried; it never
touches the bound. Every plan is simulated; one over the budget in bytes (the relaxation leaves replay
memory out) is retried in a model whose budget is lowered by its overshoot, which is only a search
heuristic (the bound still comes from the model at the real budget). The bound holds over the space of
:data:`~.staircase.SPACE` (keep, recompute, recompute_each; no offload).

Status: ``optimal`` when the best simulated plan meets the bound (to 1e-9 relative and a tick per op),
``feasible`` otherwise, ``infeasible`` when the relaxation has no plan (then no plan fits).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator

from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Action
from memplan.planner.core.simulator import Report, simulate_actions
from memplan.solvers.ilp.backends import run_backend
from memplan.solvers.ilp.config import Config
from memplan.solvers.ilp.intervals import IntervalModel
from memplan.solvers.ilp.linear import ConstantlyViolated, LinearModel, lin
from memplan.solvers.ilp.lp import solve_bounded, solve_direct
from memplan.solvers.ilp.staircase import SPACE, build_staircase

MAX_DEPTH = 6          # module depths searched for repeated layers
GROUPS = (1, 2, 4, 8, 16)
RETRIES = 4            # tightened re-solves of a plan over budget
#: the share of the time limit the restricted models may use; the rest goes to the full MIP's bound
PLAN_SHARE = 0.6

Best = tuple[float, dict[int, Action]]


def layer_classes(graph: Graph) -> list[list[int]]:
    """Saved activations matched across repeated layers: each class holds, for one position within a
    layer, that position's activation in every repetition, in forward order. The layers are the runs of
    ops sharing their first ``d`` module-path components, at the depth ``d`` whose repeated runs
    (equal op names, output sizes, and saved activations at equal positions and sizes) cover the most
    ops (the shallowest of equals). Empty when nothing repeats."""
    saved = set(graph.saved_activations)
    best: tuple[int, list[list[int]]] = (0, [])
    for depth in range(1, MAX_DEPTH + 1):
        runs: list[list[int]] = []
        key = None
        for op in graph.ops:
            k = tuple(p for p in op.module.split(".") if p)[:depth]
            if k != key or not runs:
                runs.append([])
                key = k
            runs[-1].append(op.id)
        groups: dict[tuple, list[tuple[int, ...]]] = defaultdict(list)
        for ops in runs:
            start = ops[0]
            own = sorted(t for o in ops for t in graph.ops[o].outputs if t in saved)
            sig = (tuple((graph.ops[o].name, tuple(graph.tensors[t].bytes for t in graph.ops[o].outputs))
                         for o in ops),
                   tuple((graph.tensors[t].producer - start, graph.tensors[t].bytes) for t in own))
            groups[sig].append(tuple(own))
        covered = sum(len(sig[0]) * len(members) for sig, members in groups.items() if len(members) > 1)
        if covered > best[0]:
            classes = [list(col) for members in groups.values() if len(members) > 1 for col in zip(*members, strict=True)]
            best = (covered, classes)
    return best[1]


def _restricted(im: IntervalModel, classes: list[list[int]], groups: int) -> LinearModel:
    """``im``'s model with matched activations tied within each of ``groups`` runs of consecutive
    repetitions (block-uniform plans)."""
    m = im.model
    out = LinearModel(list(m.lb), list(m.ub), list(m.binary), list(m.names), list(m.rows), dict(m.objective))
    for cls in classes:
        members = [u for u in cls if u in im.r]
        if len(members) < 2:
            continue
        size = -(-len(members) // groups)
        for g in range(0, len(members), size):
            part = members[g:g + size]
            for u in part[1:]:
                out.row(lin(0, (im.r[part[0]], 1), (im.r[u], -1)), lo=0, hi=0)
    return out


def uniform_plans(graph: Graph, budget: int, im: IntervalModel, cfg: Config, *, until: float,
                  groups: tuple[int, ...] = GROUPS, enough: Callable[[], bool] = lambda: False,
                  ) -> Iterator[tuple[dict[int, Action], str]]:
    """Block-uniform plans of ``graph`` (module docstring) from ``im`` (its staircase model at
    ``budget``), for each number of groups in ``groups`` while time is left before ``until``: each
    solved by CP-SAT and, when its simulated peak is over ``budget``, re-solved at most ``RETRIES`` times
    with the overshoot taken off the model's budget. Yields every plan tried with its source
    (``uniform/G``), fitting or not; stops early once ``enough()``."""
    classes = layer_classes(graph)
    layers = max((len(c) for c in classes), default=1)
    for g in groups if classes else ():
        if g > layers or time.perf_counter() > until or enough():
            break
        model_budget = budget
        for _ in range(RETRIES):
            left = until - time.perf_counter()
            if left < 0.1:
                break
            try:
                tight = im if model_budget == budget else build_staircase(graph, model_budget, cfg)
            except ConstantlyViolated:
                break
            # CP-SAT: it keeps its time limit (HiGHS's MIP overran a 10 s one by a minute here)
            ans = run_backend(Config(backend="cpsat", workers=cfg.workers), _restricted(tight, classes, g),
                              {}, left)
            if ans.values is None:
                break
            actions = tight.actions(ans.values)
            yield actions, f"uniform/{g}"
            peak = simulate_actions(graph, actions).peak_bytes
            if peak <= budget:
                break
            model_budget -= peak - budget  # over in bytes: try again with the overshoot taken off


def staircase_bound(graph: Graph, budget: int, cfg: Config, deadline: float) -> tuple[IntervalModel | None, float | None]:
    """The staircase model of ``graph`` at ``budget`` and its LP relaxation's optimum as a step time (a
    lower bound over :data:`~.staircase.SPACE`); (None, None) when a row no plan changes is over the
    budget (then no plan fits), (model, None) when the LP found nothing before ``deadline``."""
    try:
        im = build_staircase(graph, budget, cfg)
    except ConstantlyViolated:
        return None, None
    lp = solve_direct(im.model, integral=False, time_limit_s=max(0.1, deadline - time.perf_counter()))
    if lp.bound is None:
        return (None if lp.status == "infeasible" else im), None
    return im, im.time_s(lp.bound * (1 - 1e-9) - 1)  # less float noise


def solve_blocks(graph: Graph, budget: int, cfg: Config, deadline: float, incumbent: Best | None,
                 fits: Callable[[Report], bool]) -> tuple[str, float | None, Best | None, dict]:
    """Bound and plans until ``deadline`` (module docstring): returns (status, bound_s, best (time,
    actions) or None, stats). ``incumbent``: a plan that fits (a warm start), kept unless beaten."""
    t0 = time.perf_counter()
    # what follows the deadline (the caller's simulation of the plan with its timeline, the plan file)
    # takes a second or two on these graphs: stop that much earlier (61.7 s for 60 s before)
    deadline -= min(2.0, 0.04 * (deadline - t0))
    stats: dict = {"formulation": "blocks", "space": list(SPACE)}
    im, bound_s = staircase_bound(graph, budget, cfg, deadline)
    if im is None:
        return ("optimal" if incumbent else "infeasible"), None, incumbent, {**stats, "reason": "no plan fits the relaxation"}
    stats.update(variables=len(im.model.lb), rows=len(im.model.rows), lp_bound_s=bound_s,
                 memory_unit_bytes=im.unit_bytes, memory_exact=im.memory_exact)
    best = incumbent
    sources: dict[str, float] = {}

    def consider(actions: dict[int, Action], source: str) -> Report:
        nonlocal best
        rep = simulate_actions(graph, actions)
        if fits(rep):
            sources[source] = min(sources.get(source, rep.time_s), rep.time_s)
            if best is None or rep.time_s < best[0]:
                best = (rep.time_s, actions)
        return rep

    def tol(time_s: float) -> float:
        return 1e-9 * time_s + im.tick_s * (2 * len(graph.ops) + 2)

    def proved() -> bool:
        return best is not None and bound_s is not None and best[0] <= bound_s + tol(best[0])

    for actions, source in uniform_plans(graph, budget, im, cfg, until=t0 + PLAN_SHARE * (deadline - t0),
                                         enough=proved):
        consider(actions, source)
    # the full MIP: a tighter bound (its dual bound is valid for the whole space) and maybe a better plan
    left = deadline - time.perf_counter()
    if left > 0.5 and not proved():
        ans = solve_bounded(im.model, time_limit_s=left)
        if ans.bound is not None:
            bound_s = max(bound_s or 0.0, im.time_s(ans.bound))
            stats["mip_bound_s"] = im.time_s(ans.bound)
        if ans.values is not None:
            consider(im.actions(ans.values), "full")
    stats.update(solve_s=time.perf_counter() - t0, plans=sources)
    if best is None:
        return "timeout", bound_s, None, stats
    if bound_s is not None:
        bound_s = min(bound_s, best[0])
    status = "optimal" if bound_s is not None and best[0] <= bound_s + tol(best[0]) else "feasible"
    return status, bound_s, best, stats
