"""The ILP's full-graph model for large graphs: retention intervals, after Moccasin (Bartan et al.,
"Moccasin: Efficient Tensor Rematerialization for Neural Networks", ICML 2023).

Moccasin replaces Checkmate's O(n^2) booleans (compute op i at stage t) by O(n) integer variables: each
tensor's *retention intervals* on one timeline, with memory a cumulative sum over the intervals live at
each point. In memplan's plan space the intervals of a saved activation ``u`` are fixed by one boolean
``r[u]`` (recompute): kept, ``u`` is retained from its producer to its last backward reader; recomputed,
it is retained during its forward use and again from its first backward reader on, and absent in the gap
between. The timeline is the forward ops then the backward steps (the simulator's order), so the gap is
one interval. Variables: ``r[u]`` per saved activation and ``y[p]`` per op (replayed at least once);
rows: memory at each forward op and backward step (the cumulative constraint decomposed at each point:
CP-SAT proves bounds far faster from these rows than from ``add_cumulative`` over optional intervals,
measured on GPT-2: optimal in 7 s against no bound in 30 s), ``y[p] >= r[u]`` for the producer of each
recomputed ``u`` and of the unsaved activations its replay must rebuild; objective: the replayed ops'
forward time.

The model is a **relaxation** of the simulator's: a recomputed tensor may be rebuilt earlier than its
first backward reader (when another replay passes through it), a replay's working memory and a second
replay of an op are not counted, and memory is in units rounded down. So its optimum is a lower bound on
the step time of every plan that fits the budget (valid for the exact problem), and its plans are
candidates: each is simulated exactly; one that fits is an incumbent, one that does not is cut off (a
no-good row, which keeps the relaxation valid) and the budget of a second, tightened copy of the model is
lowered by its overshoot to find one that does. Offload is not in this model (the exact replay model and
its windows handle offload).

Its bound holds for ``recompute_each`` plans too: such a plan is freed after forward and present from its
first backward reader on, as a recomputed one is (a replay for another target re-creates it only
transiently, which the rows do not count), and it replays its producer at least once: mapped to ``r[u] =
1`` it satisfies every row at a model time no higher than the simulator's. So the bound and ``optimal``
cover every plan without offload.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Action
from memplan.planner.core.simulator import Report, simulate_actions, static_facts
from memplan.solvers.ilp.backends import Answer, run_backend
from memplan.solvers.ilp.config import Config
from memplan.solvers.ilp.linear import ConstantlyViolated, LinearModel, choose_unit, lin, no_good


@dataclass
class IntervalModel:
    """The built relaxation: the linear model, its decision variables and its units."""

    model: LinearModel
    r: dict[int, int]        # saved activation -> its recompute variable
    tick_s: float
    const_time_s: float      # keep-everything step time (the objective adds replays)
    unit_bytes: int
    memory_exact: bool

    def time_s(self, objective_ticks: float) -> float:
        return self.const_time_s + objective_ticks * self.tick_s

    def actions(self, values: list[int]) -> dict[int, Action]:
        return {u: Action.RECOMPUTE for u, v in self.r.items() if values[v]}

    def hint(self, actions: dict[int, Action]) -> dict[int, int]:
        return {v: int(actions.get(u) == Action.RECOMPUTE) for u, v in self.r.items()}


def relaxation_units(graph: Graph, budget: int, cfg: Config) -> tuple[int, bool, list[int], int]:
    """The memory unit of a relaxation of ``graph`` under ``budget`` (:func:`choose_unit` over every byte
    figure the rows use), whether it is exact, each tensor's size in it rounded down (a relaxation never
    over-counts) and the budget in it: ``(unit, exact, sizes, cap)``."""
    ops, tensors = graph.ops, graph.tensors
    sizes = [t.bytes for t in tensors] + [budget, graph.fixed.resident_bytes, graph.fixed.optimizer_step_bytes]
    sizes += [x for op in ops for x in (op.workspace_bytes, op.backward_workspace_bytes,
                                         op.backward_grad_alloc_bytes, op.backward_grad_free_bytes)]
    unit, exact = choose_unit(sizes, cfg.max_memory_units)
    return unit, exact, [t.bytes // unit for t in tensors], budget // unit


def build_intervals(graph: Graph, budget: int, cfg: Config) -> IntervalModel:
    """The retention-interval relaxation of ``graph`` under ``budget`` bytes (see the module docstring).
    Raises :class:`ConstantlyViolated` when a memory row no plan changes is over the budget."""
    st = static_facts(graph)
    ops, tensors = graph.ops, graph.tensors
    n = len(ops)
    fixed = graph.fixed.resident_bytes
    unit, exact, b, cap = relaxation_units(graph, budget, cfg)
    m = LinearModel()

    # r[u]: saved activation u is recomputed (absent between its last forward use and first backward use)
    r = {u: m.var(f"r[{u}]") for u in graph.saved_activations
         if tensors[u].recomputable and not tensors[u].held_by_caller and tensors[u].bytes > 0}

    def row(const: int, freed: list[int]) -> None:
        # memory at one point of the timeline: what every plan holds, minus what recomputing frees
        if not freed:
            if const > cap:
                raise ConstantlyViolated
            return
        m.row(lin(0, *((r[u], -b[u]) for u in freed)), hi=cap - const)

    # Forward op i: its workspace, every activation produced so far that forward still uses (or that is
    # saved), less the recomputed ones past their last forward use.
    live: list[int] = []
    for i, op in enumerate(ops):
        live += [t for t in op.outputs if tensors[t].kind == "activation"]
        const = (fixed + op.workspace_bytes) // unit
        freed = []
        for u in live:
            if tensors[u].held_by_caller or i <= st.fwd_free_at[u] or st.saved[u]:
                const += b[u]
                if u in r and i > st.fwd_free_at[u]:
                    freed.append(u)
        row(const, freed)
    # Backward step s: gradients live then, its allocation and workspace, every saved activation not yet
    # released, less the recomputed ones whose first backward reader is still to come.
    held = sum(b[t.id] for t in tensors if t.kind == "activation" and t.held_by_caller)
    grads = 0  # gradient bytes live when step s starts (the steps above s have run)
    for s in range(n - 1, -1, -1):
        op = ops[s]
        const = fixed // unit + held + grads // unit + (op.backward_grad_alloc_bytes + op.backward_workspace_bytes) // unit
        freed = []
        for u in graph.saved_activations:
            if tensors[u].held_by_caller or st.release_at[u] > s:
                continue
            const += b[u]
            if u in r and st.first_bwd_use[u] < s:
                freed.append(u)
        row(const, freed)
        grads += op.backward_grad_alloc_bytes - op.backward_grad_free_bytes
    if (fixed + graph.fixed.optimizer_step_bytes) // unit + held + max(grads, 0) // unit > cap:
        raise ConstantlyViolated

    # y[p]: op p is replayed at least once -- the producer of a recomputed tensor and, recursively, of
    # the unsaved activations its replay reads (freed after forward, so rebuilt by any replay needing them)
    unsaved = [t.kind == "activation" and not t.held_by_caller and not st.saved[t.id] for t in tensors]
    init_s = [sum(ops[k].time_s for u in op.outputs for k in tensors[u].rebuilt_by) for op in ops]
    base = max(sum(op.time_s + op.backward_time_s for op in ops) + graph.optimizer_time_s, 1e-12)
    tick = 10.0 ** math.floor(math.log10(base)) / 1e9
    y: dict[int, int] = {}
    for u, ru in r.items():
        stack, seen = [tensors[u].producer], set()
        while stack:
            p = stack.pop()
            if p in seen:
                continue
            seen.add(p)
            if p not in y:
                y[p] = m.var(f"y[{p}]")
            m.row(lin(0, (y[p], 1), (ru, -1)), lo=0)
            stack += [tensors[v].producer for v in ops[p].inputs if unsaved[v] and tensors[v].producer is not None]
    # replay ticks rounded down: the objective never over-prices a plan
    m.objective = {v: math.floor((ops[p].time_s + init_s[p]) / tick) for p, v in y.items()}
    return IntervalModel(m, r, tick, base, unit, exact)


def solve_intervals(graph: Graph, budget: int, cfg: Config, deadline: float,
                    incumbent: tuple[float, dict[int, Action]] | None,
                    fits: Callable[[Report], bool]) -> tuple[str, float | None, tuple[float, dict[int, Action]] | None, dict]:
    """Solve the relaxation for a bound and candidate plans until ``deadline``: returns (status, bound_s,
    best (time, actions) or None, stats). ``status``: ``optimal`` when the best simulated plan meets the
    bound, ``infeasible`` when the relaxation has no plan (none fits the exact budget either), otherwise
    ``timeout`` (or ``feasible`` when the round limit, not the clock, stopped it). ``incumbent`` (a warm start that fits) seeds the search."""
    t0 = time.perf_counter()
    try:
        im = build_intervals(graph, budget, cfg)
    except ConstantlyViolated:
        return "infeasible", None, incumbent, {"reason": "a memory row no plan can change is over budget"}
    stats: dict = {"formulation": "intervals", "variables": len(im.model.lb), "rows": len(im.model.rows),
                   "build_s": time.perf_counter() - t0, "memory_unit_bytes": im.unit_bytes,
                   "memory_exact": im.memory_exact}
    best = incumbent
    bound_s: float | None = None
    hint = im.hint(best[1]) if best else {}
    decision = list(im.r.values())
    status, cuts, tightened, rounds = "timeout", 0, 0, 0
    overshoot = 0

    def tol(time_s: float) -> float:
        return 1e-9 * time_s + im.tick_s * (2 * len(graph.ops) + 2)

    def consider(values: list[int]) -> Report:
        nonlocal best
        actions = im.actions(values)
        rep = simulate_actions(graph, actions)
        if fits(rep) and (best is None or rep.time_s < best[0]):
            best = (rep.time_s, actions)
        return rep

    for _ in range(cfg.max_rounds):
        left = deadline - time.perf_counter()
        if left <= 0.05:
            break
        rounds += 1
        ans: Answer = run_backend(cfg, im.model, hint, left)
        if ans.bound is not None and math.isfinite(ans.bound):
            # valid for the exact problem: a relaxation, cut only where the simulator refused a plan or
            # the plan is recorded in `best`
            bound_s = max(bound_s or 0.0, im.time_s(ans.bound))
        if ans.status == "infeasible":
            status = "optimal" if best is not None else "infeasible"
            break
        if ans.values is None:
            break
        rep = consider(ans.values)
        if best is not None and bound_s is not None and best[0] <= bound_s + tol(best[0]):
            status = "optimal"
            break
        if ans.status != "optimal":
            break  # the time ran out inside the solver
        # the relaxation's optimum is over budget, or slower than its bound: cut it (recorded if it
        # fits) and, when it is over, look for a fitting plan in a copy with the budget lowered
        no_good(im.model, decision, ans.values)
        cuts += 1
        hint = {v: ans.values[v] for v in decision}
        if not fits(rep):
            overshoot += rep.peak_bytes - budget
            left = deadline - time.perf_counter()
            if left > 0.1:
                tightened += 1
                try:
                    inner = build_intervals(graph, max(0, budget - overshoot), cfg)
                except ConstantlyViolated:
                    continue
                a2 = run_backend(cfg, inner.model, inner.hint(best[1]) if best else {}, min(left, 0.25 * left + 1))
                if a2.values is not None:
                    consider(a2.values)
    if status == "timeout" and time.perf_counter() < deadline - 0.05:
        status = "feasible"  # stopped by the round limit, not the clock
    stats.update(rounds=rounds, cuts=cuts, tightened=tightened, solve_s=time.perf_counter() - t0)
    if best is not None and bound_s is not None:
        bound_s = min(bound_s, best[0])
    return status, bound_s, best, stats

