"""The retention-interval relaxation (:mod:`.intervals`) at the size of the models people train: the
same bound, in rows whose size does not grow with the graph.

Each memory row of the interval model subtracts, from what every plan holds at one point, the bytes of the
recomputed activations absent there. At forward op ``i`` those are the recomputed ones past their last
forward use (``fwd_free_at[u] < i``); at backward step ``s`` the recomputed ones whose first backward
reader is still to come (``first_bwd_use[u] < s``). Both sets are *nested*: forward rows take a growing
prefix of the activations sorted by ``fwd_free_at``, backward rows a prefix of them sorted by
``first_bwd_use``. So every row is written with one integer variable, a running sum ``P_k`` of
``bytes * r`` over the first ``k`` activations of its order (``P_k = P_j + sum`` of the group between),
and only the rows some plan could violate are kept, one per prefix (the largest). On the 1.1B Llama (405
saved activations, 1,923 ops) that is about 2,500 non-zeros instead of 650,000; on an 80-layer one it
stays linear in the graph.

Two further differences from :func:`~.intervals.build_intervals`, both keeping the relaxation valid:

* a replay's closure through unsaved activations stops at an activation that cannot be rebuilt (it is
  pinned resident by the simulator, so its producer is not replayed);
* rows no plan can violate are left out (they bound nothing).

**The claimed space.** Its optimum is a lower bound on the simulated step time of every plan that keeps,
recomputes or recomputes-each (``recompute_each``) each saved activation, without offload, and fits the
budget: a recomputed (or recomputed-each) activation is absent at most between its last forward use and
its first backward reader (once its own backward rebuilds it, it stays to its release under both
actions; docs/model.md), every other one is present, replay memory is not counted, each replayed op is
counted once at its forward time (rounded down), the watch window (planner/core/watch.py) spans at least
the ops its rebuilt tensors' replays run or read and each watched op is charged its own watch cost
(rounded down), and sizes are rounded down to the model's unit. Offload
can lower memory at no recompute cost, so the bound does not hold for plans that offload.
"""

from __future__ import annotations

import math

from memplan.planner.core.graph import Graph
from memplan.planner.core.schedule import replay_op_cost_s, watch_op_cost_s
from memplan.planner.core.simulator import static_facts
from memplan.solvers.ilp.config import Config
from memplan.solvers.ilp.intervals import IntervalModel, relaxation_units
from memplan.solvers.ilp.linear import ConstantlyViolated, LinearModel, lin
from memplan.solvers.ilp.window import watch_window

#: the plans this module's bounds are lower bounds over (see the module docstring)
SPACE = ("keep", "recompute", "recompute_each")


def build_staircase(graph: Graph, budget: int, cfg: Config) -> IntervalModel:
    """The interval relaxation of ``graph`` under ``budget`` bytes with prefix-sum rows (module
    docstring). Raises :class:`ConstantlyViolated` when a memory row no plan changes is over budget."""
    st = static_facts(graph)
    ops, tensors = graph.ops, graph.tensors
    n = len(ops)
    fixed = graph.fixed.resident_bytes
    unit, exact, b, cap = relaxation_units(graph, budget, cfg)
    m = LinearModel()

    # r[u]: saved activation u is rebuilt (absent between its last forward use and first backward use)
    r = {u: m.var(f"r[{u}]") for u in graph.saved_activations
         if tensors[u].recomputable and not tensors[u].held_by_caller and b[u] > 0}

    # need[i]: bytes that must be freed at forward op i (what every plan holds there, over the budget)
    held_fwd = [0] * n
    live_bytes = 0  # activations produced so far that forward still uses, saved ones, held ones
    for i, op in enumerate(ops):
        live_bytes += sum(b[t] for t in op.outputs if tensors[t].kind == "activation")
        held_fwd[i] = (fixed + op.workspace_bytes) // unit + live_bytes
        live_bytes -= sum(b[u] for u in st.frees_after_fwd[i] if not st.saved[u])
    held = sum(b[t.id] for t in tensors if t.kind == "activation" and t.held_by_caller)
    held_bwd = [0] * n
    alive = [0] * (n + 1)  # bytes of saved, not held activations whose release is at or below step s
    for u in graph.saved_activations:
        if not tensors[u].held_by_caller:
            alive[st.release_at[u]] += b[u]
    at_or_below = 0
    cum_alive = [0] * n
    for s in range(n):
        at_or_below += alive[s]
        cum_alive[s] = at_or_below
    # saved activations released at or below s are still held at backward step s (they sit above it in
    # forward order): release_at[u] <= s
    grads = 0
    for s in range(n - 1, -1, -1):
        op = ops[s]
        held_bwd[s] = (fixed // unit + held + grads // unit + cum_alive[s]
                       + (op.backward_grad_alloc_bytes + op.backward_workspace_bytes) // unit)
        grads += op.backward_grad_alloc_bytes - op.backward_grad_free_bytes
    if (fixed + graph.fixed.optimizer_step_bytes) // unit + held + max(grads, 0) // unit > cap:
        raise ConstantlyViolated

    def staircase(order: list[int], needs: list[tuple[int, int]]) -> None:
        """Rows ``sum(b[u] r[u] for u in order[:k]) >= need`` for each (k, need), as running sums."""
        best: dict[int, int] = {}
        for k, need in needs:
            if need > 0:
                best[k] = max(best.get(k, 0), need)
        prev_var, prev_k = None, 0
        for k in sorted(best):
            group = [(r[u], b[u]) for u in order[prev_k:k]]
            if sum(c for _, c in group) + (m.ub[prev_var] if prev_var is not None else 0) < best[k]:
                raise ConstantlyViolated  # even recomputing all of them frees too little
            total = sum(c for _, c in group) + (m.ub[prev_var] if prev_var is not None else 0)
            p = m.var(f"P[{k}]", 0, total, binary=False)
            m.row(lin(0, (p, 1), *((v, -c) for v, c in group), *(((prev_var, -1),) if prev_var is not None else ())),
                  lo=0, hi=0)
            m.row(lin(0, (p, 1)), lo=best[k])
            prev_var, prev_k = p, k

    # forward: the recomputed activations freed before op i are a prefix of r sorted by fwd_free_at
    fwd_order = sorted(r, key=lambda u: st.fwd_free_at[u])
    keys = [st.fwd_free_at[u] for u in fwd_order]
    needs, k = [], 0
    for i in range(n):
        while k < len(keys) and keys[k] < i:
            k += 1
        needs.append((k, held_fwd[i] - cap))
    staircase(fwd_order, needs)
    # backward: those whose first backward reader is below s are a prefix of r sorted by first_bwd_use
    bwd_order = sorted(r, key=lambda u: st.first_bwd_use[u])
    keys = [st.first_bwd_use[u] for u in bwd_order]
    needs, k = [], 0
    for s in range(n):
        while k < len(keys) and keys[k] < s:
            k += 1
        needs.append((k, held_bwd[s] - cap))
    staircase(bwd_order, needs)

    # y[p]: op p is replayed at least once -- the producer of a rebuilt tensor and, recursively, of the
    # unsaved activations its replay must rebuild (an unsaved one that cannot be rebuilt is pinned: read)
    unsaved = [t.kind == "activation" and not t.held_by_caller and not st.saved[t.id] and t.recomputable
               for t in tensors]
    init_s = [sum(ops[k].time_s for u in op.outputs for k in tensors[u].rebuilt_by) for op in ops]
    base = max(sum(op.time_s + op.backward_time_s for op in ops) + graph.optimizer_time_s, 1e-12)
    tick = 10.0 ** math.floor(math.log10(base)) / 1e9
    y: dict[int, int] = {}
    spans: dict[int, tuple[int, int]] = {}
    for u, ru in r.items():
        stack, seen = [tensors[u].producer], set()
        span = {tensors[u].producer}
        while stack:
            p = stack.pop()
            if p in seen:
                continue
            seen.add(p)
            if p not in y:
                y[p] = m.var(f"y[{p}]")
            m.row(lin(0, (y[p], 1), (ru, -1)), lo=0)
            span.add(p)
            span.update(tensors[v].producer for v in ops[p].inputs
                        if tensors[v].kind == "activation" and tensors[v].producer is not None)
            stack += [tensors[v].producer for v in ops[p].inputs if unsaved[v] and tensors[v].producer is not None]
        spans[u] = (min(span), max(span))
    # replay ticks rounded down (with the executor's dispatch of the replayed op as the schedule charges it,
    # the in-place initialisers at their time alone): never over-prices a plan
    m.objective = {v: math.floor((replay_op_cost_s(graph, ops[p]) + init_s[p]) / tick) for p, v in y.items()}
    # the watch window at each op's own charge, rounded down (on CUDA an op's run hides its dispatch: the
    # charge is per op; a GPT-2 step's window was priced at the cheapest op's, zero, 35% under the plans')
    watch_ticks = [math.floor(watch_op_cost_s(graph, op) / tick) for op in ops]
    watch_window(m, {r[u]: span for u, span in spans.items()}, n, watch_ticks, strengthen=r.values())
    const_s = base
    return IntervalModel(m, r, tick, const_s, unit, exact)
