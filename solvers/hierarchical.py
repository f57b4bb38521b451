"""Hierarchical planning for real models (after Rockmate, Zhao et al. ICML 2023, and HiRemate 2025): solve
each block of the model exactly on its own, then choose one solution per block with a chain DP.

**Blocks** are the stages of :func:`memplan.planner.core.graph.coarsen` (runs of ops sharing a module prefix)
at the shallowest module depth where none has more than ``MAX_BLOCK_OPS`` ops: a transformer layer, a
ResNet bottleneck. Each saved activation is *owned* by the block of its first saver
(the first op whose backward reads it): the block's inner activations, and its *input* (activations an
earlier block produced that this block's backward reads, such as the residual stream entering a layer).

**The menu of a block** (:func:`block_menu`): its sub-graph (:func:`block_subgraph`: its ops, everything
produced outside held as fixed input) solved exactly by the ILP (the exhaustive oracle when it has at
most 6 saved activations) at ``levels`` memory levels from its least peak to keep-everything, plus
keep-everything, recompute-everything, and the per-block restrictions of the greedy and Capuchin plans
at the budget; each of these with the block's input kept or recomputed (Rockmate's "recompute the
block's input"). Repeated blocks (same ops, sizes and edges) are solved once, and when their ops' profiled
times are equal too (a fake profile's layers) each option is scored once. Each option is scored on
the block's sub-graph by the simulator: extra time ``time_s``, bytes it keeps into later blocks'
backward ``kept_bytes``, and the peak of its own forward and backward ``peak_bytes`` (its input
included).

**The chain DP** (:func:`chain_dp`) chooses one option per block to minimise the summed extra time
subject to, at every block ``s``: ``F + sum(kept of blocks before s) + G_s + peak_s <= budget`` (``F``
fixed memory, ``G_s`` gradient bytes live when ``s``'s backward starts). It is exact over that space and
model: a Pareto frontier of (kept bytes, time) in bytes, no rounding.

**What is optimal, and what is checked.** The answer is optimal within the *product of the menus* under
the *block-additive model* above. The model is not the simulator (a recomputed input replays its
producer, which may cascade; tensors crossing blocks unsaved are not counted), so the DP is run at the
budget and at model budgets bisected below and above it, each plan is scored by the simulator, and the
fastest that fits is returned; the greedy, Capuchin, Chen and every-k plans at the budget are candidates
too, so the result is never slower than theirs. Status ``feasible`` (no proof against the full op-level space, which
only the ILP covers).

**Time.** Greedy and Capuchin run first with the time they need (the plans never to lose to), then the
staircase relaxation's bound, its block-uniform plans, the menus, the DP's rounds and the baselines, each
started only while its cost, counted in whole-graph simulations (the longest one measured), fits before
``target_s``, with the caller's scoring of the answer kept in hand: under load a step is left out rather
than the target overrun.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from memplan.planner.core.errors import Infeasible, MemplanError
from memplan.planner.core.graph import FixedMemory, Graph, Op, TensorInfo, coarsen
from memplan.planner.core.plan import Action
from memplan.planner.core.simulator import Report, simulate_actions
from memplan.solvers.bounds import keep_all_report
from memplan.solvers.chain.table import OutOfTime, check_deadline
from memplan.solvers.core import solve
from memplan.solvers.ilp.blocks import staircase_bound, uniform_plans
from memplan.solvers.ilp.config import Config as IlpConfig
from memplan.solvers.ilp.staircase import SPACE
from memplan.solvers.registry import Proposal, get, register

Actions = dict[int, Action]

LEVELS = 5            # ILP memory levels per block menu
ORACLE_SAVED = 6      # blocks with at most this many saved activations use the exhaustive oracle
MAX_BLOCK_OPS = 100   # blocks are the shallowest module level whose largest stage has at most this many ops
BISECT_STEPS = 6      # model budgets tried below / above the budget
CALIBRATION_ROUNDS = 6
HEURISTICS = ("greedy", "capuchin")   # whole-graph plans that are candidates and feed the menus
BASELINES = ("chen", "every-k")       # whole-graph plans that are candidates only, when time is left
TARGET_S = 8.0                        # what the solver aims to finish in (its time limit caps it)
HEURISTIC_MIN_S = 20.0                # greedy's and Capuchin's time limit at least (within the caller's)
BOUND_MIN_S = 10.0                    # the staircase LP's time limit at least (within the caller's)
UNIFORM_MIN_S = 0.5                   # a block-uniform model is solved only with this much time left
# whole-graph simulations kept in hand at the end: the caller's scoring of the answer (solve(): one plain and
# one with its timeline, about 3.5 plain ones)
WRAPUP_SIMS = 4.5
TIMELINE_SIMS = 3.5                   # a simulation with its timeline, in plain ones
BASELINE_SIMS = 10                    # Chen or every-k are started with at least this many simulations' time
UNIFORM_GROUPS = (1, 2)               # block-uniform plans of the staircase relaxation: groups of layers
STAIRCASE = IlpConfig()               # the relaxation's options (units, CP-SAT workers)


# ---- blocks ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Block:
    """A run of consecutive ops (one coarsened stage). ``owned``: the saved activations this block decides
    (first saved here); ``inner`` those produced here, ``inputs`` those produced by earlier blocks."""

    index: int
    name: str
    ops: tuple[int, ...]
    inner: tuple[int, ...]
    inputs: tuple[int, ...]


def block_depth(graph: Graph) -> int:
    """The shallowest module depth at which no stage has more than ``MAX_BLOCK_OPS`` ops (a transformer
    layer, a ResNet bottleneck), or the deepest there is."""
    deepest = max((len([p for p in op.module.split(".") if p]) for op in graph.ops), default=0)
    for depth in range(1, deepest + 1):
        if max(len(s.ops) for s in coarsen(graph, depth, max_stages=len(graph.ops)).stages) <= MAX_BLOCK_OPS:
            return depth
    return deepest


def has_blocks(graph: Graph) -> bool:
    """Whether ``graph`` has module structure to plan by blocks (at least two blocks, none over
    ``MAX_BLOCK_OPS`` ops)."""
    if not any(op.module for op in graph.ops):
        return False
    chain = coarsen(graph, block_depth(graph), max_stages=len(graph.ops))
    return len(chain) >= 2 and max(len(s.ops) for s in chain.stages) <= MAX_BLOCK_OPS


def blocks(graph: Graph) -> list[Block]:
    """The blocks of ``graph`` (:func:`block_depth`), each with the saved activations it owns."""
    chain = coarsen(graph, block_depth(graph), max_stages=len(graph.ops))
    stage_of = {o: s.index for s in chain.stages for o in s.ops}
    owned: dict[int, list[int]] = defaultdict(list)
    for t in graph.saved_activations:
        owned[stage_of[min(graph.savers[t])]].append(t)
    out = []
    for s in chain.stages:
        own = owned.get(s.index, [])
        inner = tuple(t for t in own if stage_of[graph.tensors[t].producer] == s.index)
        inputs = tuple(t for t in own if stage_of[graph.tensors[t].producer] != s.index)
        out.append(Block(s.index, s.name, tuple(s.ops), inner, inputs))
    return out


def block_subgraph(graph: Graph, block: Block) -> tuple[Graph, dict[int, int]]:
    """The block's ops as a graph of their own: activations produced inside stay activations (freed at the
    block's end at the latest), every other tensor they read is fixed input (parameters stay parameters).
    Returns the graph and the map from ``graph``'s tensor ids to its own."""
    ops = [graph.ops[o] for o in block.ops]
    first, last = block.ops[0], block.ops[-1]
    used: list[int] = []
    for op in ops:
        for t in (*op.inputs, *op.outputs, *op.saved):
            if t not in used:
                used.append(t)
    used.sort()
    tmap = {t: i for i, t in enumerate(used)}
    opmap = {o: i for i, o in enumerate(block.ops)}
    tensors, fixed = [], defaultdict(int)
    for t in used:
        info = graph.tensors[t]
        inside = info.kind == "activation" and first <= info.producer <= last
        if inside:
            later = any(o > last for o in (*graph.consumers.get(t, ()), *graph.savers.get(t, ())))
            freed = info.freed_after
            if later or (freed is not None and freed > last):
                freed = last
            tensors.append(info.model_copy(update={
                "id": tmap[t], "producer": opmap[info.producer], "freed_after": None if freed is None else opmap.get(freed, len(ops) - 1),
                "rebuilt_by": [opmap[m] for m in info.rebuilt_by if m in opmap],
                "held_by_caller": info.held_by_caller and not later}))
        else:
            kind = info.kind if info.kind in ("param", "buffer") else "input"
            fixed[{"param": "params_bytes", "buffer": "buffers_bytes"}.get(kind, "inputs_bytes")] += info.bytes
            tensors.append(TensorInfo(id=tmap[t], kind=kind, bytes=info.bytes, dtype=info.dtype, shape=info.shape,
                                      requires_grad=info.requires_grad and kind == "param"))
    sub_ops = [op.model_copy(update={"id": opmap[op.id], "inputs": [tmap[t] for t in op.inputs],
                     "outputs": [tmap[t] for t in op.outputs], "saved": [tmap[t] for t in op.saved]}) for op in ops]
    sub = Graph(name=f"{graph.name}:{block.name}", tensors=tensors, ops=sub_ops, fixed=FixedMemory(**fixed),
                host_bandwidth_bytes_per_s=graph.host_bandwidth_bytes_per_s)
    return sub, tmap


def block_saved(graph: Graph, block: Block) -> list[int]:
    """``graph``'s ids of the saved activations of the block's sub-graph (:func:`block_subgraph`), in its
    order: the activations produced in the block that its ops save."""
    first, last = block.ops[0], block.ops[-1]
    return sorted({t for o in block.ops for t in graph.ops[o].saved
                   if graph.tensors[t].kind == "activation" and first <= graph.tensors[t].producer <= last})


def _signature(graph: Graph, block: Block) -> tuple:
    """Equal for repeated blocks: op names, sizes and edges relative to the block, and what produces its
    input (the first layer's input is an embedding's, the others' the residual add of the layer before)."""
    base_t = min((t for o in block.ops for t in graph.ops[o].outputs), default=0)
    rel = {}
    for o in block.ops:
        for t in (*graph.ops[o].inputs, *graph.ops[o].saved):
            p = graph.tensors[t].producer
            rel.setdefault(t, ("in", t - base_t) if p is not None and p >= block.ops[0] else ("out", graph.tensors[t].bytes))
    return tuple((graph.ops[o].name, tuple(rel.get(t, ("o", t - base_t)) for t in graph.ops[o].inputs),
                  tuple(graph.tensors[t].bytes for t in graph.ops[o].outputs), tuple(rel.get(t) for t in graph.ops[o].saved))
                 for o in block.ops) + (tuple((graph.tensors[t].bytes, graph.ops[graph.tensors[t].producer].name)
                                              for t in block.inputs),)


# ---- menus -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Option:
    """One way to run a block: ``actions`` on the tensors it owns (``graph``'s ids; absent = keep), with
    its figures under the block model (module docstring)."""

    actions: tuple[tuple[int, Action], ...]
    time_s: float
    kept_bytes: int
    peak_bytes: int
    source: str


def _with_boundary(sub: Graph, hold_bytes: int) -> Graph:
    """``sub`` with one more op at the end of its forward holding ``hold_bytes`` of workspace: its peak is
    then the fixed memory, the saved activations kept through the block's backward, and ``hold_bytes``.
    With ``hold_bytes`` above every other peak of the block, a budget on this graph is a budget on the
    bytes the block keeps (Rockmate's memory at the block's boundary)."""
    ops = [*sub.ops, Op(id=len(sub.ops), name="memplan.block_boundary", module="", workspace_bytes=hold_bytes)]
    return sub.model_copy(update={"ops": ops, "name": sub.name + ":boundary"}).invalidate()


def _inner_plans(sub: Graph, time_limit_s: float, levels: int, deadline: float = math.inf) -> list[tuple[Actions, str]]:
    """Exact plans of the block's sub-graph keeping at most ``levels`` amounts of memory into the block's
    backward, from the least to all (the ILP, or the oracle on small blocks, on :func:`_with_boundary`);
    past ``deadline`` (``time.perf_counter()``) only keep-everything and recompute-everything."""
    saved = sub.saved_activations
    if not saved:
        return [({}, "keep")]
    method = "oracle" if len(saved) <= ORACLE_SAVED else "ilp"
    recompute_all = {t: Action.RECOMPUTE for t in saved if sub.tensors[t].recomputable}
    plans: list[tuple[Actions, str]] = [({}, "keep"), (recompute_all, "recompute")]
    hold = keep_all_report(sub).peak_bytes
    bounded = _with_boundary(sub, hold)
    lo = simulate_actions(bounded, recompute_all).peak_bytes
    hi = keep_all_report(bounded).peak_bytes
    for i in range(1, levels):
        if time.perf_counter() > deadline:
            break
        b = lo + (hi - lo) * i // levels
        try:
            r = solve(bounded, b, method, time_limit_s=time_limit_s)
        except (Infeasible, MemplanError):
            continue
        plans.append((r.plan.actions(), f"{method}@{i}/{levels}"))
    return plans


def _figures(graph: Graph, sub: Graph, sub_keep_s: float, block: Block, recompute: frozenset[int],
             recompute_input: bool, input_s: float) -> tuple[float, int, int]:
    """(extra time, kept bytes, peak bytes) of recomputing the sub-graph's saved activations at positions
    ``recompute``: its simulation (time over keep-everything's ``sub_keep_s``, peak over its fixed memory)
    plus the block's input, kept (held into later blocks' backward) or recomputed (``input_s``: what
    replaying it costs, :func:`_input_cost_s`)."""
    saved = sub.saved_activations
    inner = {saved[i]: Action.RECOMPUTE for i in recompute}
    r = simulate_actions(sub, inner)
    kept = sum(sub.tensors[t].bytes for i, t in enumerate(saved) if i not in recompute)
    in_bytes = sum(graph.tensors[t].bytes for t in block.inputs)
    kept_in = sum(graph.tensors[t].bytes for t in block.inputs
                  if not (recompute_input and graph.tensors[t].recomputable))
    return (r.time_s - sub_keep_s + (input_s if recompute_input else 0.0), kept + kept_in,
            r.peak_bytes - sub.fixed.resident_bytes + in_bytes)


def _input_cost_s(graph: Graph, block: Block, inputs: list[int]) -> float:
    """What recomputing the block's ``inputs`` costs: simulated on the window of ops from the first of
    their producers to the block's end (held as a block of its own, :func:`block_subgraph`), not on the
    whole graph (a second or more per block on an 80-layer model). A replay cascading past the window's
    start is cut there: a figure of the block model, which the simulator checks on whole plans."""
    first = min(graph.tensors[t].producer for t in inputs)
    window = Block(-1, block.name + ":input", tuple(range(first, block.ops[-1] + 1)), (), ())
    sub, tmap = block_subgraph(graph, window)
    rebuilt = {tmap[t]: Action.RECOMPUTE for t in inputs if sub.tensors[tmap[t]].kind == "activation"}
    return simulate_actions(sub, rebuilt).time_s - keep_all_report(sub).time_s if rebuilt else 0.0


def _op_times(graph: Graph, block: Block) -> tuple:
    return tuple((graph.ops[o].time_s, graph.ops[o].backward_time_s) for o in block.ops)


def block_menu(graph: Graph, block: Block, *, time_limit_s: float = 2.0, levels: int = LEVELS,
               extra: list[tuple[Actions, str]] = (), cache: dict | None = None,
               deadline: float = math.inf) -> list[Option]:
    """The block's options (module docstring): exact sub-graph plans at ``levels`` memory levels, the
    ``extra`` whole-graph plans restricted to the block, each with the input kept or recomputed (at the
    cost of recomputing it alone, :func:`_input_cost_s`); dominated options (no less time, memory and
    peak) dropped. Repeated blocks share, through ``cache``, their plans (by position in the block), the
    cost of recomputing their input and, when their ops' profiled times are equal too, every option's
    figures. Past ``deadline`` a new block gets no exact plans and keeps its input."""
    late = time.perf_counter() > deadline
    saved = block_saved(graph, block)  # graph's ids, in the sub-graph's order: positions index both
    index = {t: i for i, t in enumerate(saved)}
    built: list[Graph] = []

    def sub() -> Graph:  # built only for what the cache does not hold (a second a model on 80 layers)
        if not built:
            built.append(block_subgraph(graph, block)[0])
        return built[0]

    key = _signature(graph, block)
    cache = {} if cache is None else cache
    entry = cache.get(key)
    if entry is None or entry["saved"] != len(saved):
        plans = [(frozenset(i for i, t in enumerate(sub().saved_activations) if p.get(t) == Action.RECOMPUTE), src)
                 for p, src in _inner_plans(sub(), time_limit_s, levels, deadline)]
        recomputable_in = [] if late else [t for t in block.inputs if graph.tensors[t].recomputable]
        entry = {"saved": len(saved), "plans": plans, "input": not late,
                 "input_s": _input_cost_s(graph, block, recomputable_in) if recomputable_in else 0.0}
        cache[key] = entry
    # figures are simulated per block unless its ops' profiled times equal those of a block already
    # done: repeated blocks' profiled times differ on real profiles, and a DP fed one block's figures
    # for another picks whichever option that block's noise flatters
    figures = cache.setdefault(("figures", key, _op_times(graph, block)), {})
    plans = list(entry["plans"])
    for actions, src in extra:
        plans.append((frozenset(index[t] for t in block.inner if actions.get(t) == Action.RECOMPUTE and t in index),
                      src))
    options, seen = [], set()
    inputs = [t for t in block.inputs if graph.tensors[t].recomputable] if entry["input"] else []
    sub_keep_s = None
    for pos, src in plans:
        for rin in (False, True) if inputs else (False,):
            if (pos, rin) in seen:
                continue
            seen.add((pos, rin))
            if (pos, rin) not in figures:
                if sub_keep_s is None:
                    sub_keep_s = keep_all_report(sub()).time_s
                figures[pos, rin] = _figures(graph, sub(), sub_keep_s, block, pos, rin, entry["input_s"])
            time_s, kept, peak = figures[pos, rin]
            actions = {saved[i]: Action.RECOMPUTE for i in pos}
            if rin:
                actions.update((t, Action.RECOMPUTE) for t in inputs)
            options.append(Option(tuple(sorted(actions.items())), time_s, kept, peak, src + ("+input" if rin else "")))
    return _pareto_options(options)


def _pareto_options(options: list[Option]) -> list[Option]:
    options = sorted(options, key=lambda o: (o.time_s, o.kept_bytes, o.peak_bytes))
    out: list[Option] = []
    for o in options:
        if not any(p.time_s <= o.time_s and p.kept_bytes <= o.kept_bytes and p.peak_bytes <= o.peak_bytes for p in out):
            out.append(o)
    return out


# ---- the chain DP over blocks ------------------------------------------------------------------------
def grads_before(graph: Graph, blks: list[Block]) -> list[int]:
    """Gradient bytes live when each block's backward starts (created by the later blocks' backward)."""
    net = [sum(graph.ops[o].backward_grad_alloc_bytes - graph.ops[o].backward_grad_free_bytes for o in b.ops)
           for b in blks]
    out, acc = [0] * len(blks), 0
    for i in range(len(blks) - 1, -1, -1):
        out[i] = acc
        acc += net[i]
    return out


def chain_dp(menus: list[list[Option]], grads: list[int], spare_bytes: int,
             deadline: float | None = None) -> list[int] | None:
    """One option per block minimising the summed ``time_s`` subject to ``sum(kept_bytes of the blocks
    before s) + grads[s] + peak_bytes of s's option <= spare_bytes`` for every block ``s``; None if no
    choice fits. Exact: a Pareto frontier of (kept bytes so far, time so far), kept bytes unrounded.
    ``OutOfTime`` past ``deadline`` (334 distinct blocks at GPU byte scale: 3 s a call)."""
    A = np.zeros(1, np.int64)       # kept bytes so far, ascending
    T = np.zeros(1)                 # time so far, descending
    back: list[tuple[np.ndarray, np.ndarray]] = []
    # kept bytes only grow: a state keeping more than some later block's tightest option allows is dead
    room = [spare_bytes - grads[s] - min(o.peak_bytes for o in menu) for s, menu in enumerate(menus)]
    cap = np.minimum.accumulate(np.asarray(room[1:] + [1 << 62], dtype=np.int64)[::-1])[::-1]
    for s, menu in enumerate(menus):
        check_deadline(deadline)
        parts_a, parts_t, parts_o, parts_i = [], [], [], []
        for j, o in enumerate(menu):
            ok = A + grads[s] + o.peak_bytes <= spare_bytes
            if ok.any():
                idx = np.nonzero(ok)[0]
                parts_a.append(A[idx] + o.kept_bytes)
                parts_t.append(T[idx] + o.time_s)
                parts_o.append(np.full(len(idx), j))
                parts_i.append(idx)
        if not parts_a:
            return None
        a, t, oo, ii = (np.concatenate(x) for x in (parts_a, parts_t, parts_o, parts_i))
        live = a <= cap[s]
        if not live.any():
            return None
        a, t, oo, ii = a[live], t[live], oo[live], ii[live]
        order = np.lexsort((t, a))
        a, t, oo, ii = a[order], t[order], oo[order], ii[order]
        best_before = np.concatenate([[np.inf], np.minimum.accumulate(t)[:-1]])
        front = t < best_before
        A, T = a[front], t[front]
        back.append((oo[front], ii[front]))
    i = int(np.argmin(T))
    choice = []
    for oo, ii in reversed(back):
        choice.append(int(oo[i]))
        i = int(ii[i])
    return choice[::-1]


def block_peaks(graph: Graph, blks: list[Block], report: Report) -> list[int]:
    """The highest memory the simulator records while each block's ops run (forward, replay, backward)."""
    block_of = {o: i for i, b in enumerate(blks) for o in b.ops}
    out = [0] * len(blks)
    for e in report.timeline:
        if e.op is not None and e.op in block_of:
            i = block_of[e.op]
            out[i] = max(out[i], e.peak_bytes)
    return out


def model_peaks(menus: list[list[Option]], choice: list[int], grads: list[int], fixed_bytes: int) -> list[int]:
    """The block model's peak at each block for ``choice`` (module docstring)."""
    out, kept = [], 0
    for s, j in enumerate(choice):
        out.append(fixed_bytes + kept + grads[s] + menus[s][j].peak_bytes)
        kept += menus[s][j].kept_bytes
    return out


def _plan(menus: list[list[Option]], choice: list[int]) -> Actions:
    return {t: a for s, j in enumerate(choice) for t, a in menus[s][j].actions}


# ---- the solver ----------------------------------------------------------------------------------------
@register("hierarchical", description="Rockmate-style: each block's menu solved exactly (ILP) at several "
                                      "memory levels, one option per block by a chain DP, simulator-checked; "
                                      "never slower than greedy, Capuchin, Chen or every-k")
def solve_hierarchical(graph: Graph, budget_bytes: int, *, time_limit_s: float = 60.0, offload: bool = False,
                       host_budget_bytes: int | None = None, levels: int = LEVELS, target_s: float = TARGET_S,
                       **options: object) -> Proposal:
    """The fastest simulated plan among the greedy and Capuchin plans, the block-uniform plans of the
    staircase relaxation (:mod:`memplan.solvers.ilp.blocks`), the chain DP's over the blocks' menus (at
    the budget and at model budgets bisected around it) and, when time is left, the Chen and every-k
    plans; ``feasible``, or ``optimal`` when that plan meets the relaxation's bound. It aims to finish in
    ``target_s`` seconds (capped by ``time_limit_s``). ``lower_bound_s``: the staircase LP's bound, valid
    over every keep / recompute / recompute_each plan without offload (``stats['bound_space']``)."""
    if options:
        raise MemplanError(f"hierarchical: unknown option(s) {', '.join(sorted(options))}")
    if offload:
        raise MemplanError("hierarchical: plans keep / recompute only; use dp or ilp with offload")
    if not isinstance(levels, int) or isinstance(levels, bool) or not 1 <= levels <= 20:
        raise MemplanError(f"hierarchical: levels must be an integer from 1 to 20, got {levels!r}")
    if (not isinstance(target_s, (int, float)) or isinstance(target_s, bool) or not math.isfinite(target_s)
            or not 0 < target_s <= 3600):
        raise MemplanError(f"hierarchical: target_s must be a number of seconds in (0, 3600], got {target_s!r}")
    t0 = time.perf_counter()
    caller_limit_s = time_limit_s
    time_limit_s = min(time_limit_s, target_s)  # every share below is of what it aims for
    end = t0 + time_limit_s
    tried: list[tuple[Report, Actions, str]] = []

    sim_s = [0.0]  # the longest whole-graph simulation so far: what each step's cost is estimated in

    def score(actions: Actions, source: str) -> Report:
        t = time.perf_counter()
        r = simulate_actions(graph, actions)
        sim_s[0] = max(sim_s[0], time.perf_counter() - t)
        tried.append((r, actions, source))
        return r

    def time_for(sims: float) -> bool:
        """Whether ``sims`` more whole-graph simulations fit before the end, the caller's kept in hand."""
        return time.perf_counter() + (sims + WRAPUP_SIMS) * sim_s[0] <= end

    heuristics: list[tuple[Actions, str]] = []

    def run_strategy(name: str, limit_s: float) -> Actions | None:
        # the strategy alone, not solve(): its plan is scored once, in score(), and a strategy that finds
        # none does not start the least-peak search an error would quote (the rest of the time, on an
        # 80-layer Llama where Chen finds nothing)
        spec = get(name)
        p = spec.call(graph, budget_bytes, time_limit_s=limit_s, offload=False, host_budget_bytes=None,
                      config=spec.default_config())
        return None if p.status == "infeasible" else p.actions

    def heuristic(name: str) -> None:  # its per-block choices join the menus
        try:
            # at least HEURISTIC_MIN_S (within the caller's limit): starved, Capuchin finds nothing on an
            # 80-layer Llama under load and the answer falls back to greedy's plan (14.2% against 6.4%)
            left = max(end - time.perf_counter(), min(HEURISTIC_MIN_S, caller_limit_s - (time.perf_counter() - t0)))
            actions = run_strategy(name, max(0.5, left))
        except (Infeasible, MemplanError):
            return
        if actions is not None:
            score(actions, name)
            heuristics.append((actions, name))

    def uniform(groups: tuple[int, ...], until: float) -> None:
        until = min(until, end - WRAPUP_SIMS * sim_s[0])
        for g in groups if stair is not None else ():
            if until - time.perf_counter() < UNIFORM_MIN_S:  # CP-SAT finds nothing in less
                break
            for actions, source in uniform_plans(graph, budget_bytes, stair, STAIRCASE, groups=(g,), until=until):
                score(actions, source)

    # in order of worth per second: greedy (the plan never to lose to) and Capuchin (given the time they
    # need: starved of it, Capuchin found nothing on a 32-layer Llama), the staircase relaxation's bound
    # and its block-uniform plans (until 60% of the time), then the menus and the DP (until the end)
    for name in HEURISTICS:
        heuristic(name)
    # the LP gets the time it needs (about 0.5 s of CPU on an 80-layer Llama) past the end if need be: cut
    # off under load after slow heuristics, the answer came without a bound
    stair, bound_s = staircase_bound(graph, budget_bytes, STAIRCASE,
                                     max(end, min(time.perf_counter() + BOUND_MIN_S, t0 + caller_limit_s)))
    uniform(UNIFORM_GROUPS, t0 + 0.6 * time_limit_s)
    blks = blocks(graph)
    cache: dict = {}
    per_block_s = max(0.2, min(5.0, time_limit_s / 4 / max(1, len(blks))))
    menus = [block_menu(graph, b, time_limit_s=per_block_s, levels=levels, extra=heuristics, cache=cache,
                        deadline=t0 + 0.75 * time_limit_s) for b in blks]
    grads = grads_before(graph, blks)
    fixed = graph.fixed.resident_bytes
    top = keep_all_report(graph).peak_bytes
    # calibration: what the block model misses at each block (tensors crossing blocks unsaved, gradients
    # flowing in, replays reaching into earlier blocks), measured by the simulator on the plans tried and
    # added to that block's allowance (the largest miss seen), so the DP's next plans account for it
    allowance = list(grads)

    def calibrate(choice: list[int], report: Report) -> None:
        for s, (real, model) in enumerate(zip(block_peaks(graph, blks, report),
                                              model_peaks(menus, choice, allowance, fixed), strict=True)):
            if real > model:
                allowance[s] += real - model

    def at(model_budget: int) -> Report | None:  # None also past the end: no round follows then
        try:
            choice = chain_dp(menus, allowance, model_budget - fixed, deadline=end)
        except OutOfTime:
            return None
        if choice is None:
            return None
        actions = _plan(menus, choice)
        r = score(actions, "block-dp")
        if r.peak_bytes > budget_bytes:
            calibrate(choice, simulate_actions(graph, actions, timeline=True))
        return r

    # each DP round below: a plan simulated, and again with its timeline when it is over the budget
    round_sims = 1 + TIMELINE_SIMS
    r = None
    if time_for(TIMELINE_SIMS + round_sims):
        fastest = [min(range(len(m)), key=lambda j: m[j].time_s) for m in menus]
        calibrate(fastest, simulate_actions(graph, _plan(menus, fastest), timeline=True))
        for _ in range(CALIBRATION_ROUNDS):
            r = at(budget_bytes)
            if r is None or r.peak_bytes <= budget_bytes or not time_for(round_sims):
                break
    # the model may now over-estimate: bisect for the largest model budget whose plan fits, above the budget
    lo, hi = budget_bytes, max(top, budget_bytes)
    if r is None or r.peak_bytes > budget_bytes:
        lo, hi = fixed, budget_bytes
    for _ in range(BISECT_STEPS):
        if hi - lo <= 1 or not time_for(round_sims):
            break
        mid = (lo + hi) // 2
        rm = at(mid)
        if rm is not None and rm.peak_bytes <= budget_bytes:
            lo = mid
        else:
            hi = mid
    for name in BASELINES:  # candidates too, while time is left
        if not time_for(BASELINE_SIMS):
            break
        try:
            actions = run_strategy(name, end - WRAPUP_SIMS * sim_s[0] - time.perf_counter())
        except (Infeasible, MemplanError):
            continue
        if actions is not None:
            score(actions, name)
    fits = [(r, a, s) for r, a, s in tried if r.peak_bytes <= budget_bytes]
    stats = {"blocks": len(blks), "distinct_blocks": sum(k[0] != "figures" for k in cache), "options": sum(len(m) for m in menus),
             "plans_scored": len(tried), "lp_bound_s": bound_s, "bound_space": list(SPACE),
             "candidates": sorted({s for _, _, s in tried}),
             # each source's fastest plan that fits: what each part of the portfolio is worth
             "candidates_s": {s: min(r.time_s for r, _, s2 in tried if s2 == s and r.peak_bytes <= budget_bytes)
                              for s in sorted({s for r, _, s in tried if r.peak_bytes <= budget_bytes})}}
    if not fits:
        return Proposal(status="infeasible", stats=stats)
    report, actions, source = min(fits, key=lambda v: (v[0].time_s, v[0].peak_bytes))
    stats.update(source=source, **{f"{s}_s": r.time_s for r, _, s in tried if s in ("greedy", "capuchin")})
    if bound_s is None:
        return Proposal(actions, status="feasible", stats=stats)
    bound_s = min(bound_s, report.time_s)
    proved = report.time_s <= bound_s + 1e-9 * report.time_s + stair.tick_s * (2 * len(graph.ops) + 2)
    return Proposal(actions, status="optimal" if proved else "feasible", lower_bound_s=bound_s, stats=stats)
