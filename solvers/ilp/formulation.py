"""The ILP's formulation: the simulator's plan space as linear rows over a :class:`LinearModel` (see the
package docstring for what the variables mean). :class:`Builder` reads a graph and a budget and returns a
:class:`Built` model with the maps needed to decode a solution.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from memplan.planner.core.graph import Graph
from memplan.planner.core.replay import reads_mid_chain, replay
from memplan.planner.core.schedule import replay_op_cost_s, watch_op_cost_s
from memplan.planner.core.simulator import default_prefetch_at, static_facts
from memplan.solvers.ilp.config import Config
from memplan.solvers.ilp.linear import BuildOutOfTime, ConstantlyViolated, Expr, LinearModel, choose_unit, lin
from memplan.solvers.ilp.window import watch_window


@dataclass
class Slot:
    var: int
    key: tuple[int, int]   # position in backward order: (-step, -1) step start, (-step, k) pass k
    step: int
    start: bool            # a scheduled prefetch (prefetch_at = step) rather than one a replay triggers
    cf: int | None = None  # copy-stream variable after this copy
    active: int | None = None  # 1 when the slot fired and a copy really runs


@dataclass
class Built:
    model: LinearModel
    r: dict[int, int]
    o: dict[int, int]
    each: dict[int, int]  # saved activation -> its recompute_each variable (per-use re-creation)
    slots: dict[int, list[Slot]]
    decision_vars: list[int]
    tick_s: float
    const_time_s: float
    unit_bytes: int
    obj_offset: int
    default_prefetch: bool
    exact: bool  # no window or depth limit: every plan of the simulator's space is in the model

    memory_exact: bool = True  # memory in units is byte-exact (else a relaxation, rounded down)
    time_err_ticks: float = 0.0  # |model time - simulated time| of any plan the model admits, at most

    def time_s(self, objective_ticks: float) -> float:
        return self.const_time_s + (objective_ticks + self.obj_offset) * self.tick_s

    @property
    def time_err_s(self) -> float:
        return self.time_err_ticks * self.tick_s


class Builder:
    def __init__(self, graph: Graph, budget: int, *, offload: bool, host_budget: int | None, cfg: Config,
                 deadline: float | None = None):
        self.g, self.cfg = graph, cfg
        self.deadline = deadline  # perf_counter time: past it, building stops (BuildOutOfTime)
        self.st = static_facts(graph)
        self.m = LinearModel()
        ops, tensors = graph.ops, graph.tensors
        self.n = n = len(ops)
        self.bw = graph.host_bandwidth_bytes_per_s
        saved = graph.saved_activations
        small = len(saved) <= cfg.small_saved
        self.depth = cfg.max_replay_depth if cfg.max_replay_depth is not None else (None if small else 4)
        self.copy_window = cfg.copy_window_ops if cfg.copy_window_ops is not None else (n if small else 3)
        self.pf_window = cfg.prefetch_window_ops if cfg.prefetch_window_ops is not None else (n if small else 6)
        # Without a copy window a D2H copy may still run when backward starts: the device copy is then
        # released at the first backward boundary after the copy ends, and a prefetch due before that
        # finds it on device (nothing moves back). Modelled exactly (see _linger), small graphs only.
        self.linger = cfg.copy_window_ops is None and small and offload

        # Units. Memory: the gcd of every size when that keeps the rows' magnitudes below
        # cfg.max_memory_units (the model is then byte-exact); otherwise a coarser unit with every size and
        # the budget rounded *down*, so that the model is a relaxation: every plan that fits in bytes fits
        # in units, its bound and its "infeasible" hold for the exact problem, and the plans it proposes
        # are confirmed (or cut) by the exact simulator. Byte-exact coefficients of GPU tensors (1e10 and
        # more) made CP-SAT's presolve and CBC report false optima, bounds and infeasibility.
        # Time: ticks of ~1e-9 of the step (model and simulator differ by at most time_err_ticks).
        sizes = [t.bytes for t in tensors] + [budget, graph.fixed.resident_bytes, graph.fixed.optimizer_step_bytes]
        sizes += [x for op in ops for x in (op.workspace_bytes, op.backward_workspace_bytes,
                                             op.backward_grad_alloc_bytes, op.backward_grad_free_bytes)]
        if host_budget is not None:
            sizes.append(host_budget)
        self.unit, self.memory_exact = choose_unit(sizes, cfg.max_memory_units)
        self.budget = budget // self.unit
        self.host_budget = None if host_budget is None else host_budget // self.unit
        # Replay times are rounded down, so without offload the model never over-prices a plan (its bound
        # holds as it is). With offload the copy-stream clock mixes rounded-up copies, rounded backward
        # steps and rounded-down replays, so any plan's model time may differ from the simulator's by up
        # to time_err_ticks (counted as the rows are built); bounds are lowered by that much.
        self.time_err_ticks = 0.0 if not offload else 0.5 * n + 2
        fwd_total = sum(op.time_s for op in ops)
        bwd_total = sum(op.backward_time_s for op in ops)
        base = max(fwd_total + bwd_total + graph.optimizer_time_s, 1e-12)
        # The LP-based backends mis-solve the offload clock's big-M rows at 1e9 ticks per step (coefficients
        # ~1e10, past their float tolerances): HiGHS gave false optima, CBC's preprocessing a false
        # "infeasible". 1e6 there; CP-SAT is exact in integers and keeps the finer tick
        per_step = 1e6 if offload and cfg.backend in ("highs", "cbc") else 1e9
        self.tick = 10.0 ** math.floor(math.log10(base)) / per_step
        self.const_time_s = fwd_total + bwd_total + graph.optimizer_time_s
        starts, acc = [], 0.0
        for op in ops:
            starts.append(acc)
            acc += op.time_s
        self.fwd_start = [math.floor(s / self.tick + 1e-6) for s in starts]       # rounded down
        self.fwd_end = [math.ceil((s + op.time_s) / self.tick - 1e-6) for s, op in zip(starts, ops, strict=True)]
        self.fwd_start_up = [math.ceil(s / self.tick - 1e-6) for s in starts]  # a D2H copy's earliest start
        self.fwd_total = math.floor(fwd_total / self.tick + 1e-6)
        # a replayed op also re-runs the in-place initialisers of its output (TensorInfo.rebuilt_by: the
        # profiler only allows them on single-output producers), as the simulator does; each replayed op
        # at the simulator's price (schedule.replay_op_cost_s: the executor's dispatch of it included)
        self.replay_s = [replay_op_cost_s(graph, op) for op in ops]
        init_s = [sum(self.replay_s[m] for u in op.outputs for m in graph.tensors[u].rebuilt_by) for op in ops]
        self.replay_ws = [max([op.workspace_bytes] + [ops[m].workspace_bytes for u in op.outputs
                                                      for m in graph.tensors[u].rebuilt_by]) for op in ops]
        self.op_ticks = [math.floor((own + extra) / self.tick) for own, extra in zip(self.replay_s, init_s, strict=True)]
        # the executor's watch window (solvers/ilp/window.py): trigger variable -> the forward ops it needs
        self.watch_spans: dict[int, tuple[int, int]] = {}
        self.bwd_ticks = [round(op.backward_time_s / self.tick) for op in ops]

        # Decisions.
        self.saved = saved
        self.r: dict[int, int] = {}
        self.o: dict[int, int] = {}
        # each[u]: recompute_each, freed after forward like r[u], but a replay that re-creates u for
        # another target frees it after its last use there (it is replayed again for its own backward):
        # Checkmate's natural form, a tensor computed at several stages
        self.each: dict[int, int] = {}
        for u in saved:
            info = tensors[u]
            if info.held_by_caller or info.bytes == 0:
                continue  # never freed or nothing to free: keeping is always at least as good
            if info.recomputable:
                self.r[u] = self.m.var(f"r[{u}]")
                if cfg.model_per_use(len(saved)):
                    self.each[u] = self.m.var(f"each[{u}]")
            if offload:
                self.o[u] = self.m.var(f"o[{u}]")
            # one action per tensor
            choice = [v for v in (self.r.get(u), self.each.get(u), self.o.get(u)) if v is not None]
            if len(choice) > 1:
                self.m.row(lin(0, *((v, 1) for v in choice)), hi=1)
        self.b = {t.id: t.bytes // self.unit for t in tensors}  # rounded down: a relaxation (see above)
        self.held_bytes = sum(self.b[t.id] for t in tensors if t.kind == "activation" and t.held_by_caller)
        self.fixed = self._units(graph.fixed.resident_bytes)
        self.d = {u: max(1, math.ceil(tensors[u].bytes / self.bw / self.tick - 1e-6)) for u in self.o}
        self.slots: dict[int, list[Slot]] = {u: [] for u in self.o}
        self.made: dict[int, list[tuple[tuple[int, int], int]]] = {u: [] for u in saved}  # (key, var)
        self.remade: dict[int, list[int]] = {u: [] for u in self.each}  # made by a replay for another target
        self.big_t = 0  # big-M for time, set in _backward's pre-pass
        self.cf_last: int | None = None  # the last D2H copy's end (forward ticks)
        self.cf_of: dict[int, int] = {}  # the copy stream's free time after u's place in the FIFO
        self.big_f = 0  # big-M for forward ticks
        self.d2h_ub: dict[int, int] = {}  # latest possible D2H end of each offload candidate
        self.linger_var: dict[tuple[int, int], int] = {}  # (u, s): u's D2H copy not over when step s starts
        self.linger_res: dict[tuple[int, int], int] = {}  # (u, s): ... and u not yet fetched back

    # -- residency --------------------------------------------------------------------------------
    def keep(self, u: int) -> Expr:
        e = lin(1)
        e.add(self.r.get(u), -1)
        e.add(self.each.get(u), -1)
        e.add(self.o.get(u), -1)
        return e

    def prefetched(self, u: int, key: tuple[int, int], inclusive: bool) -> Expr:
        e = Expr()
        for sl in self.slots.get(u, ()):
            if sl.key < key or (inclusive and sl.key == key):
                e.add(sl.var)
        return e

    def available(self, u: int, s: int, key: tuple[int, int], inclusive: bool = False) -> Expr:
        """1 when u is usable by a replay at position ``key`` of backward step ``s`` (see module doc);
        for memory, :meth:`resident` adds the release."""
        info = self.g.tensors[u]
        if info.kind != "activation" or info.held_by_caller:
            return lin(1)
        if not self.st.saved[u]:
            return Expr()
        e = self.prefetched(u, key, inclusive)  # an offloaded tensor, once fetched, is usable after its
        e.add(self.linger_res.get((u, s)))      # release too (the simulator does not fetch it again)
        if self.st.release_at[u] <= s:
            e.plus(self.keep(u))
            for k, v in self.made[u]:
                if k < key:
                    e.add(v)
        return e

    def resident_saved(self, s: int, key: tuple[int, int]) -> Expr:
        """Bytes (units) of saved, not caller-held activations on device at ``key`` of step ``s``."""
        e = Expr()
        for u in self.saved:
            if self.g.tensors[u].held_by_caller or self.st.release_at[u] > s:
                continue
            e.plus(self.available(u, s, key, inclusive=True), self.b[u])
        return e

    def _in_time(self) -> None:
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise BuildOutOfTime

    # -- the whole model -------------------------------------------------------------------------------
    def build(self) -> Built:
        self._forward()
        self._in_time()
        self._backward()
        for u, v in self.each.items():
            # recompute_each differs from recompute only where a replay for another target re-creates u
            # before its own backward: elsewhere the two plans replay alike, and the model keeps only the
            # recompute one (fewer equivalent plans for the lazy cuts to remove one by one)
            self.m.row(lin(0, (v, 1), *((x, -1) for x in self.remade[u])), hi=0)
        if self.host_budget is not None and self.o:
            self.m.row(lin(0, *((v, self.b[u]) for u, v in self.o.items())), hi=self.host_budget)
        decision = list(self.r.values()) + list(self.each.values()) + list(self.o.values())
        decision += [sl.var for u in self.o for sl in self.slots[u] if sl.start]
        exact = self.depth is None and (not self.o or (self.linger and self.pf_window >= self.n))
        return Built(self.m, self.r, self.o, self.each, self.slots, decision, self.tick, self.const_time_s, self.unit,
                      self.obj_offset, self.cfg.prefetch == "default", exact, self.memory_exact,
                      self.time_err_ticks)

    def _forward(self) -> None:
        g, st, m = self.g, self.st, self.m
        tensors = g.tensors
        # a D2H copy starts when the tensor's first saver starts (a saved input) or ends (a saved output),
        # in the simulator's ``saved_at`` order
        order = sorted(self.o, key=lambda u: (st.release_at[u], st.saved_at[st.release_at[u]].index(u)))
        big = self.fwd_total + sum(self.d.values()) + 1
        self.big_f = big
        z: dict[int, dict[int, int]] = {u: {} for u in self.o}
        prev: int | None = None
        latest = 0
        for u in order:
            ou, d = self.o[u], self.d[u]
            k = st.release_at[u]
            fe = self.fwd_end[k] if u in g.ops[k].outputs else self.fwd_start_up[k]
            latest = max(latest, fe) + d
            self.d2h_ub[u] = latest
            cf = m.var(f"d2h_end[{u}]", 0, big, binary=False)
            self.cf_of[u] = cf
            # the copy stream is FIFO: it starts when the producer ends and the previous copy is done
            if prev is not None:
                m.row(lin(0, (cf, 1), (prev, -1)), lo=0)
                m.row(lin(0, (cf, 1), (prev, -1), (ou, -d)), lo=0)
            m.row(lin(0, (cf, 1), (ou, -(fe + d))), lo=0)
            if self.linger:
                # exact, not just a lower bound: whether a copy is over in backward changes what a prefetch
                # costs, so cf = o ? max(prev, fe) + d : prev (one binary picks which term is the max)
                if prev is None:
                    m.row(lin(0, (cf, 1), (ou, -(fe + d))), hi=0)
                else:
                    m.row(lin(0, (cf, 1), (prev, -1), (ou, -big)), hi=0)
                    after_prev = m.var(f"d2h_after_prev[{u}]")
                    m.row(lin(0, (cf, 1), (prev, -1), (after_prev, big)), hi=d + big)
                    m.row(lin(0, (cf, 1), (after_prev, -big)), hi=fe + d)
            prev = cf
            f = st.fwd_free_at[u]
            lim = self.n if self.linger else f + self.copy_window + 1
            if not self.linger:
                end = self.fwd_start[lim] if lim < self.n else self.fwd_total
                end = min(end, self.fwd_total)
                # the copy must be over by op `lim` (and before backward starts)
                m.row(lin(0, (cf, 1), (ou, big)), hi=end + big)
            else:
                end = big
            for i in range(f + 1, min(lim, self.n)):
                if self.fwd_start[i] >= end:
                    break
                zi = m.var(f"z[{u},{i}]")
                z[u][i] = zi
                m.row(lin(0, (zi, 1), (ou, -1)), hi=0)
                # on device at op i unless its copy ended by the time op i starts
                m.row(lin(0, (cf, 1), (zi, -big), (ou, big)), hi=self.fwd_start[i] + big)
        self.cf_last = prev
        self.z = z
        produced = self._produced()
        for op in g.ops:
            i = op.id
            e = lin(self.fixed + self._units(op.workspace_bytes))
            for u in produced[i]:
                if tensors[u].held_by_caller or i <= st.fwd_free_at[u]:
                    e.const += self.b[u]  # in forward use (or held): live whatever the plan
                elif u in self.r or u in self.o:  # (each[u] only exists beside r[u])
                    e.plus(self.keep(u), self.b[u])  # past its last forward use: the plan decides
                    if i in z.get(u, {}):
                        e.add(z[u][i], self.b[u])
                elif st.saved[u]:
                    e.const += self.b[u]
            m.row(e, hi=self.budget)

    def _produced(self) -> list[list[int]]:
        """For each op i: the activations produced at or before i."""
        acc: list[int] = []
        out: list[list[int]] = []
        for op in self.g.ops:
            acc = acc + [t for t in op.outputs if self.g.tensors[t].kind == "activation"]
            out.append(acc)
        return out

    # -- backward ------------------------------------------------------------------------------------
    def _closure(self, t: int, s: int) -> tuple[list[int], set[int]]:
        """Tensors a replay for target t at step s may traverse (:func:`memplan.planner.core.replay.replay`,
        breadth first, with every activation missing unless it is always there at s: not an activation,
        held by the caller, or kept for certain and not yet released), and the ones past the depth limit
        (they must then be available when reached)."""
        tensors, st = self.g.tensors, self.st

        def always_there(v: int) -> bool:
            info = tensors[v]
            return info.held_by_caller or (st.saved[v] and v not in self.r and v not in self.o
                                           and st.release_at[v] <= s)

        rp = replay(self.g, t, available=always_there, max_depth=self.depth)
        return list(rp.missing), set(rp.frontier)

    def _backward(self) -> None:
        g, st, m = self.g, self.st, self.m
        ops, tensors = g.ops, g.tensors
        n = self.n
        grads_after = [0] * (n + 1)  # grad bytes live at the start of step s: steps above s have run
        for s in range(n - 1, -1, -1):
            op = ops[s]
            grads_after[s] = grads_after[s + 1] + op.backward_grad_alloc_bytes - op.backward_grad_free_bytes
        grads = [(grads_after[s + 1]) for s in range(n)]
        choose = self.cfg.prefetch == "choose"
        # Scheduled-prefetch slots (prefetch_at = q, from the first backward use upwards).
        # a prefetch scheduled at a step without an autograd node starts at the next step with one (the
        # executor sees backward only there; the simulator carries it): only those steps are slots
        seen = [op.has_backward for op in ops] if any(op.has_backward for op in ops) else [True] * n
        for u in self.o:
            fb = st.first_bwd_use[u]
            if choose:
                qs = [q for q in range(fb, min(n - 1, fb + self.pf_window) + 1) if seen[q]]
                dq = default_prefetch_at(g, u, self.bw)
                if dq not in qs and seen[dq]:
                    qs.append(dq)
                qs = qs or [fb]  # (its first backward reader saves it: a step with a node)
            else:
                qs = [default_prefetch_at(g, u, self.bw)]
            for q in qs:
                self.slots[u].append(Slot(m.var(f"pf[{u},{q}]"), (-q, -1), q, True))
        # Passes: one per (step, saved tensor with a recompute option), in the simulator's order.
        passes: list[tuple[int, int, int, list[int], set[int]]] = []
        for s in range(n - 1, -1, -1):
            for k, t in enumerate(st.unpack_order[s]):  # the simulator's order
                if t in self.r:
                    c, fr = self._closure(t, s)
                    passes.append((s, k, t, c, fr))
        # Visit slots (a replay needs an offloaded tensor before its scheduled prefetch).
        # (with the default prefetch points, only above the default: below it u is back already)
        for s, k, t, c, _ in passes:
            for u in c:
                floor = st.first_bwd_use[u] if choose or u not in self.o else self.slots[u][0].step
                if u in self.o and u != t and s > floor:
                    self.slots[u].append(Slot(m.var(f"pv[{u},{s},{k}]"), (-s, k), s, False))
        for u in self.o:
            self.slots[u].sort(key=lambda sl: sl.key)
            m.row(lin(0, *((sl.var, 1) for sl in self.slots[u]), (self.o[u], -1)), lo=0, hi=0)
        big_t = 2 * (sum(self.bwd_ticks) + sum(self.d.values()) + 1)
        for *_, c, _ in passes:
            rep_ops = {tensors[u].producer for u in c}
            big_t += sum(self.op_ticks[p] for p in rep_ops)
        self.big_t = big_t
        big_mem = self.fixed + sum(self.b.values()) + sum(
            -(-(op.workspace_bytes + op.backward_workspace_bytes + op.backward_grad_alloc_bytes) // self.unit)
            for op in ops) + max(grads + [0]) // self.unit + 1

        timing = bool(self.o)
        self.m.timed = timing
        objective = Expr()
        tau = m.var("tau[start]", 0, 0, binary=False) if timing else None
        cf = tau  # copy stream free (relative to the start of backward)
        if timing and self.linger and self.cf_last is not None:
            # D2H copies still running when backward starts delay the first prefetch (one FIFO stream)
            cf = m.var("cf[start]", 0, big_t, binary=False)
            m.row(lin(0, (cf, 1), (self.cf_last, -1)), lo=-self.fwd_total)
        above = 0  # backward ticks of the steps above s: the clock at step s is at least this
        pass_iter = iter(passes)
        nxt = next(pass_iter, None)
        for s in range(n - 1, -1, -1):
            self._in_time()
            op = ops[s]
            if timing and self.linger:
                self._linger(s, tau, above)
            above += self.bwd_ticks[s]
            # scheduled prefetches at the start of step s, FIFO in tensor order
            if timing:
                for u in sorted(self.o):
                    for sl in self.slots[u]:
                        if sl.start and sl.step == s:
                            active = sl.var
                            lv = self.linger_var.get((u, s))
                            if lv is not None:  # still on device: the prefetch moves nothing
                                active = self._and_not(f"pf_copy[{u},{s}]", Expr.of(sl.var), Expr.of(lv))
                            cf = self._copy(sl, u, cf, tau, big_t, active)
            for k, t in enumerate(st.unpack_order[s]):
                if not st.is_activation[t]:
                    continue
                if nxt is not None and nxt[0] == s and nxt[1] == k:
                    replay = self._pass(nxt, grads[s], big_mem)
                    nxt = next(pass_iter, None)
                    objective.plus(replay)
                    if timing:
                        # visit prefetches of this pass, each waited for at once
                        tau_b = m.var(f"tau[{s},{k}]b", 0, big_t, binary=False)
                        m.row(lin(0, (tau_b, 1), (tau, -1)), lo=0)
                        for u in sorted(self.o):
                            for sl in self.slots[u]:
                                if not sl.start and sl.key == (-s, k):
                                    cf = self._copy(sl, u, cf, tau, big_t, sl.var)
                                    m.row(lin(0, (tau_b, 1), (cf, -1), (sl.var, -big_t)), lo=-big_t)
                        tau_c = m.var(f"tau[{s},{k}]c", 0, big_t, binary=False)
                        m.row(Expr({tau_c: 1, tau_b: -1}).plus(replay, -1), lo=0, hi=0)
                        tau = tau_c
                if timing and t in self.o:
                    # wait for t's copy back
                    tau_d = m.var(f"tau[{s},{k}]d", 0, big_t, binary=False)
                    m.row(lin(0, (tau_d, 1), (tau, -1)), lo=0)
                    for sl in self.slots[t]:
                        m.row(lin(0, (tau_d, 1), (sl.cf, -1), (sl.active, -big_t)), lo=-big_t)
                    tau = tau_d
            # the backward step itself
            e = lin(self.fixed + self.held_bytes + self._units(grads[s]) + self._units(
                op.backward_grad_alloc_bytes + op.backward_workspace_bytes))
            e.plus(self.resident_saved(s, (-s, 10**9)))
            m.row(e, hi=self.budget)
            if timing:
                nt = m.var(f"tau[{s}]end", 0, big_t, binary=False)
                m.row(lin(0, (nt, 1), (tau, -1)), lo=self.bwd_ticks[s], hi=self.bwd_ticks[s])
                tau = nt
        self.obj_offset = 0
        if timing:
            m.objective = {tau: 1}
            self.obj_offset = -sum(self.bwd_ticks)  # the chain includes backward compute (a constant)
        else:
            m.objective = dict(objective.terms)
        self._watch()
        # optimizer step: constant
        opt = self.fixed + self.held_bytes + self._units(max(grads_after[0], 0)) + self._units(
            g.fixed.optimizer_step_bytes)
        if opt > self.budget:
            raise ConstantlyViolated

    def _watch(self) -> None:
        """The executor's watch window in the objective (solvers/ilp/window.py), each op at its own cost
        rounded down. Triggers: a recomputed tensor's producer, each replayed op with the producers of what
        it reads (``_pass``); with offload the window starts at op 0 (planner/core/watch.py ``full``) and
        reaches an offloaded tensor's last saver, a chosen prefetch point and the forward op before which its
        device copy is released (the first boundary after its last forward use at which its copy has ended:
        ``z[u][i]`` says it has not by op ``i``). Backward releases and pins, which may extend it further,
        are left out: the model stays a relaxation."""
        g = self.g
        tensors = g.tensors
        for u, v in [*self.r.items(), *self.each.items()]:
            p = tensors[u].producer
            self.watch_spans[v] = (p, p)
        last = self.n - 1
        for u, v in self.o.items():
            self.watch_spans[v] = (0, max([tensors[u].producer, *g.savers.get(u, []),
                                           min(self.st.fwd_free_at[u] + 1, last)]))
            for i, zi in self.z[u].items():
                self.watch_spans[zi] = (0, min(i + 1, last))
            for sl in self.slots[u]:
                if sl.start:
                    self.watch_spans[sl.var] = (0, sl.step)
        ticks = [math.floor(watch_op_cost_s(g, op) / self.tick) for op in g.ops]
        watch_window(self.m, self.watch_spans, self.n, ticks, strengthen=[*self.r.values(), *self.each.values()])

    def _units(self, nbytes: int) -> int:
        """``nbytes`` in memory units, rounded down (the model is a relaxation; see ``__init__``)."""
        return nbytes // self.unit

    def _copy(self, sl: Slot, u: int, cf: int, tau: int, big_t: int, active: int) -> int:
        """One potential copy on the FIFO copy stream, run when ``active`` is 1 (the slot fired and the
        tensor is not still on device)."""
        m, d = self.m, self.d[u]
        self.time_err_ticks += 1
        new = m.var(f"cf[{u},{sl.key}]", 0, big_t, binary=False)
        m.row(lin(0, (new, 1), (cf, -1)), lo=0)
        m.row(lin(0, (new, 1), (cf, -1), (active, -d)), lo=0)
        m.row(lin(0, (new, 1), (tau, -1), (active, -(d + big_t))), lo=-big_t)
        sl.cf, sl.active = new, active
        return new

    def _linger(self, s: int, tau: int, above: int) -> None:
        """Variables for offloaded tensors whose D2H copy may still run when backward step ``s`` starts
        (clock ``fwd_total + tau``): ``linger_var`` is 1 exactly when the copy has not ended then (the
        simulator releases at a boundary when end <= now), ``linger_res`` when, in addition, the tensor
        has not been fetched back by then (it is on device without a fetch)."""
        m, st = self.m, self.st
        big = self.big_f + self.big_t + 1
        for u in sorted(self.o):
            if s < st.release_at[u] or self.d2h_ub[u] <= self.fwd_total + above:
                continue  # released by its own backward, or its copy certainly over
            ou, cf_u = self.o[u], self.cf_of[u]
            v = m.var(f"linger[{u},{s}]")
            m.row(lin(0, (v, 1), (ou, -1)), hi=0)
            # copy not over (cf - T >= 1 tick) -> v = 1 (when offloaded) ...
            m.row(lin(0, (cf_u, 1), (tau, -1), (v, -big), (ou, big)), hi=self.fwd_total + big)
            # ... and v = 1 -> copy not over
            m.row(lin(0, (cf_u, 1), (tau, -1), (v, -big)), lo=self.fwd_total + 1 - big)
            self.linger_var[(u, s)] = v
            fetched = self.prefetched(u, (-s, -1), True)
            self.linger_res[(u, s)] = self._and_not(f"linger_res[{u},{s}]", Expr.of(v), fetched)

    def _and_not(self, name: str, a: Expr, b: Expr) -> int:
        """A binary equal to ``a and not b`` (a, b 0/1 expressions)."""
        m = self.m
        w = m.var(name)
        m.row(Expr({w: 1}).plus(a, -1), hi=0)
        m.row(Expr({w: 1}).plus(b, 1), hi=1)
        m.row(Expr({w: 1}).plus(a, -1).plus(b, 1), lo=0)
        return w

    def _pass(self, p: tuple[int, int, int, list[int], set[int]], grads_s: int, big_mem: int) -> Expr:
        """Rows of one materialisation pass; returns its replay time (ticks) as an expression."""
        s, k, t, closure, frontier = p
        g, st, m = self.g, self.st, self.m
        ops, tensors = g.ops, g.tensors
        key = (-s, k)
        in_c = set(closure)
        rep_ops = sorted({tensors[u].producer for u in closure if tensors[u].recomputable})
        # Which replay ops read each tensor (the traversal goes from a replayed op to its inputs).
        readers: dict[int, list[int]] = {}
        # ... of those, the ones that read it finished (a reader mid-chain alone gets a scratch copy, below)
        full_readers: dict[int, list[int]] = {}
        # mid-chain reads (replay.reads_mid_chain): tensor -> replayed ops that read it only mid-chain
        mid: dict[int, list[int]] = {}
        for q in rep_ops:
            # a replayed producer re-runs its output's in-place chain (rebuilt_by): what those ops read is
            # read at q too (the model places the chain with its producer)
            reads = [(q, v) for v in ops[q].inputs]
            reads += [(c, v) for u in ops[q].outputs for c in tensors[u].rebuilt_by for v in ops[c].inputs]
            finished = {v for c, v in reads if not reads_mid_chain(g, c, v)}
            for v in dict.fromkeys(v for _, v in reads):
                if v in in_c or v in frontier:
                    readers.setdefault(v, []).append(q)
                    if v in finished:
                        full_readers.setdefault(v, []).append(q)
                if v not in finished and tensors[v].kind == "activation":
                    mid.setdefault(v, []).append(q)
        avail = {u: self.available(u, s, key) for u in in_c | frontier}
        vis: dict[int, Expr] = {}
        w: dict[int, Expr] = {}
        # the target: replayed when not on device (recomputed, not made by an earlier pass)
        miss = lin(1).plus(avail[t], -1)
        rp: dict[int, int] = {q: m.var(f"rp[{q},{s},{k}]") for q in rep_ops}
        for q in rep_ops:  # a replayed op is watched in forward, and so are the producers of what it reads
            run = [q, *(c for u in ops[q].outputs for c in tensors[u].rebuilt_by)]
            lo = min([q, *(tensors[v].producer for c in run for v in ops[c].inputs
                           if tensors[v].kind == "activation" and tensors[v].producer is not None)])
            self.watch_spans[rp[q]] = (lo, max(run))
        if self.o:
            self.time_err_ticks += len(rep_ops)  # each replay rounded down by under a tick
        for u in closure:
            vis[u] = miss if u == t else Expr.of(m.var(f"vis[{u},{s},{k}]"))
            a = avail[u]
            if not a.terms and a.const == 0:
                w[u] = vis[u]
            elif not a.terms and a.const == 1:
                w[u] = Expr()
            else:
                w[u] = Expr.of(self._and_not(f"w[{u},{s},{k}]", vis[u], a))
        # scratch copies: a replayed op that reads v mid-chain, when this pass does not rebuild v in full
        # (w[v] = 0: v resident, fetched, or not needed finished), reads a private copy that v's producer
        # and the chain's ops before the reader re-create and that lives until the reader has run
        # (replay.Replay.scratch), whether v is resident or not. sc[v] = 1 exactly when some such reader
        # runs: v's bytes at each of its rows, the producer's time (and the chain's ops before every
        # reader); what those ops read finished is needed as a replayed op's input is (``reach``). A
        # tensor that cannot be rebuilt cannot be copied: its mid-chain reader cannot run.
        scratch: dict[int, list[tuple[int, int]]] = {}  # replayed op -> (tensor, its sc) read from a copy
        scratch_time = Expr()
        reach: dict[int, list[Expr]] = {}  # tensor -> 0/1 expressions: a scratch run reads it finished
        for v, qs in mid.items():
            if not tensors[v].recomputable or tensors[v].producer is None:
                for q in qs:
                    m.row(lin(0, (rp[q], 1)), hi=0)
                continue
            sc = m.var(f"scratch[{v},{s},{k}]")
            wv = w.get(v, Expr())
            for q in qs:
                m.row(Expr({sc: 1, rp[q]: -1}).plus(wv, 1), lo=0)
                scratch.setdefault(q, []).append((v, sc))
            m.row(lin(0, (sc, 1), *((rp[q], -1) for q in qs)), hi=0)
            m.row(Expr({sc: 1}).plus(wv, 1), hi=1)
            first = min(qs)
            run = [(tensors[v].producer, Expr.of(sc))]
            for c in tensors[v].rebuilt_by:
                if c < first:
                    run.append((c, Expr.of(sc)))
                else:
                    run += [(c, lin(-1, (sc, 1), (rp[q], 1))) for q in qs if q > c]
            definite = [c for c, e in run if len(e.terms) == 1 and e.const == 0]
            scratch_time.add(sc, math.floor(sum(self.replay_s[c] for c in definite) / self.tick))
            if self.o:
                self.time_err_ticks += 1
            for c, e in run:
                for x in ops[c].inputs:
                    if x != v and (x in in_c or x in frontier) and not reads_mid_chain(g, c, x):
                        reach.setdefault(x, []).append(e)
        for u in closure:
            if u == t:
                continue
            (var,) = vis[u].terms
            qs = full_readers.get(u, [])
            for q in qs:
                m.row(lin(0, (var, 1), (rp[q], -1)), lo=0)
            upper = Expr({var: 1})
            for q in qs:
                upper.add(rp[q], -1)
            for e in reach.get(u, ()):
                m.row(Expr({var: 1}).plus(e, -1), lo=0)
                upper.add(next(iter(e.terms)), -1)  # its sc
            m.row(upper, hi=0)
        # frontier tensors: reached only if available
        for u in frontier:
            for q in full_readers.get(u, []):
                m.row(Expr({rp[q]: 1}).plus(avail[u], -1), hi=0)
            for e in reach.get(u, ()):
                m.row(e.copy().plus(avail[u], -1), hi=0)
        # replay or fetch: an offloaded tensor is fetched (visit slot), the others are replayed
        wr: dict[int, Expr] = {}
        for u in closure:
            if u in self.o and u != t:
                slot = next((sl for sl in self.slots[u] if sl.key == key), None)
                ou = self.o[u]
                if slot is None:  # reached at or below its first backward use: fetched already
                    wr[u] = Expr.of(self._and_not(f"wr[{u},{s},{k}]", w[u], Expr.of(ou)))
                    continue
                # the slot fires exactly when u is reached, offloaded and not yet fetched
                y = slot.var
                lv = self.linger_var.get((u, s))  # still on device: read as it is, nothing fetched
                m.row(Expr({y: 1}).plus(vis[u], -1), hi=0)
                m.row(lin(0, (y, 1), (ou, -1)), hi=0)
                m.row(Expr({y: 1}).plus(self.prefetched(u, key, False), 1).add(lv, 1), hi=1)
                m.row(Expr({y: 1}).plus(vis[u], -1).plus(self.prefetched(u, key, False), 1).add(ou, -1)
                      .add(lv, 1), lo=-1)
                wr[u] = Expr.of(self._and_not(f"wr[{u},{s},{k}]", w[u], Expr.of(ou)))
            else:
                wr[u] = w[u]
            if not tensors[u].recomputable:
                m.row(wr[u], hi=0)  # cannot be rebuilt: the plan must keep it there
        for q in rep_ops:
            outs = [u for u in ops[q].outputs if u in in_c]
            for u in outs:
                m.row(Expr({rp[q]: 1}).plus(wr[u], -1), lo=0)
            e = Expr({rp[q]: 1})
            for u in outs:
                e.plus(wr[u], -1)
            m.row(e, hi=0)
        # allocations: every output of a replayed op that is not there
        made: dict[int, Expr] = {}
        for q in rep_ops:
            outs = ops[q].outputs
            for u in outs:
                if len(outs) == 1 and u in in_c:
                    made[u] = Expr.of(rp[q])
                    continue
                a = avail.get(u)
                if a is None:
                    a = self.available(u, s, key)
                if not a.terms and a.const == 1:
                    continue
                mv = Expr.of(self._and_not(f"made[{u},{s},{k}]", Expr.of(rp[q]), a))
                made[u] = mv
                if u in self.o:
                    m.row(mv.copy().add(self.o[u], 1), hi=1)  # would re-create an offloaded output
        # retained: saved tensors whose backward is still to come (and the target)
        retained = {u for u in made if u == t or (st.saved[u] and st.release_at[u] <= s
                                                  and not tensors[u].held_by_caller)}
        # ... unless planned recompute_each (not the target): then freed after its last use in the pass
        # like an unsaved tensor, and replayed again for its own backward. kept[u]: made and retained
        kept: dict[int, int] = {}
        for u in retained:
            (v,) = made[u].terms  # single variables by construction
            if u != t and u in self.each:
                self.remade[u].append(v)
                v = self._and_not(f"kept[{u},{s},{k}]", made[u], Expr.of(self.each[u]))
            kept[u] = v
            self.made[u].append((key, v))
        # memory of each replayed op: pass-start residents, fetched ones, this op's outputs, earlier
        # outputs still read by this or a later replayed op
        base = lin(self.fixed + self.held_bytes + self._units(grads_s))
        base.plus(self.resident_saved(s, key))
        for q in rep_ops:
            e = base.copy()
            e.const += self._units(self.replay_ws[q])
            for v, sc in scratch.get(q, ()):
                e.add(sc, self.b[v])
            for u in ops[q].outputs:
                if u in made and u not in retained:
                    e.plus(made[u], self.b[u])
                elif u in retained and self.made[u][-1][0] == key:
                    e.plus(made[u], self.b[u])
            for q2 in rep_ops:
                if q2 >= q:
                    break
                for u in ops[q2].outputs:
                    if u not in made:
                        continue
                    per_use = u in retained and kept[u] not in made[u].terms
                    if u in retained and not per_use:
                        e.plus(made[u], self.b[u])
                        continue
                    later = [q3 for q3 in readers.get(u, []) if q3 >= q]
                    if not later:
                        if per_use:
                            e.add(kept[u], self.b[u])
                        continue
                    # live while a later replayed op reads it (or, planned recompute, for good)
                    al = m.var(f"alive[{u},{q},{s},{k}]")
                    for q3 in later:
                        m.row(Expr({al: 1}).plus(made[u], -1).add(rp[q3], -1), lo=-1)
                    if per_use:
                        m.row(lin(0, (al, 1), (kept[u], -1)), lo=0)
                    e.add(al, self.b[u])
            e.add(rp[q], big_mem)
            m.row(e, hi=self.budget + big_mem)
        return lin(0, *((rp[q], self.op_ticks[q]) for q in rep_ops)).plus(scratch_time)

