"""The ILP: a Checkmate-style mixed-integer program (Jain et al., "Checkmate: Breaking the Memory Wall
with Optimal Tensor Rematerialization", MLSys 2020) for general DAGs, in memplan's plan space.

Checkmate lets the solver pick any schedule (``R[t,i]`` compute op i at stage t, ``S[t,i]`` keep it).
memplan's plans are narrower -- per saved activation keep / recompute / offload, plus a prefetch point --
and the simulator (:mod:`memplan.planner.simulator`) fixes everything else: a missing saved tensor is
rebuilt *lazily* when its backward step needs it, by replaying its producer and, recursively, the
producers of missing inputs. So the stages here are the simulator's own: one per forward op, and in
backward one per (step ``s``, k-th saved tensor of op ``s``) materialisation pass. The variables encode
the simulator's boolean logic exactly, as linear constraints:

* decisions: ``r[u]`` recompute, ``o[u]`` offload (keep is ``1 - r - o``) per saved activation;
  ``y[u, slot]`` the moment u's copy back starts: at the start of a chosen backward step (the plan's
  ``prefetch_at``) or in a pass whose replay needs u earlier (the simulator then prefetches it there);
* per pass (s, k) and tensor u of the target's ancestor closure: ``vis`` (the replay's traversal
  reaches u), ``w = vis and not resident`` (u must be rebuilt or fetched), ``rp[p]`` (op p is replayed:
  Checkmate's R), ``made`` (an output allocated by the replay); residency (Checkmate's S) is a linear
  expression of the decisions and of earlier passes' ``made`` (replayed saved tensors stay until their
  own backward, the rest are freed after their last use in the pass);
* memory: one row per forward op, per backward step and per replayed op of every pass (the replay's
  live set: pass-start residents, this op's outputs, earlier outputs still read by a later replayed op);
* offload: the D2H copies form a FIFO chain of continuous end times in forward; ``z[u, i]`` says the
  copy of u has not ended when op i starts (u still on device); prefetches and exposed waits form a
  second chain over backward (clock ``tau``, copy stream ``cf``), lower bounds only, so at the optimum
  they equal the simulator's max(...) recurrences;
* objective: the simulated step time (replays + exposed waits; forward, backward and optimizer time
  are constants). Host memory: ``sum(o[u] * bytes) <= host_budget_bytes``.

The model is formulated once (:class:`_Model`: variables, linear rows, objective, with integer
coefficients: time in integer ticks, memory in units of the gcd of all sizes, so the budget row is
exact) and handed to OR-Tools CP-SAT (``backend="cpsat"``, default) or to PuLP's CBC (``"cbc"``) or
HiGHS (``"highs"``; in a child process when the installed highspy cannot load beside OR-Tools' own HiGHS
library, see :func:`_solve_highs`).

Where the model is not exact it is conservative (it never under-estimates memory or time), and
``solve_ilp`` re-simulates every proposal; a proposal over budget gets a no-good cut and the model is
re-solved (a small lazy-constraint loop), and so does a proposal the model priced below its simulated
time (a tie that integer ticks round the other way), after it is kept as the incumbent. The
conservative parts:

* copy durations are rounded up to ticks and forward op starts down, so a copy is never modelled as
  ending earlier than it does;
* on large graphs (or with ``copy_window_ops`` set) an offloaded tensor's D2H copy must end within
  ``copy_window_ops`` ops after its last forward use and before backward starts; on small graphs a copy
  may run into backward, modelled exactly: the forward copy chain is an exact max, and per backward step
  a binary says whether the copy is still running (the tensor still on device, a prefetch then moving
  nothing);
* a replayed multi-output op may not re-create an offloaded output that is not yet back on device;
* on large graphs (see :class:`IlpConfig`) replays are limited to ``max_replay_depth`` producers deep
  and prefetch points to a window after the first backward use; plans needing more are excluded, not
  mis-modelled.

``Proposal.lower_bound_s`` is the solver's best bound (a bound under the model, so over the plans the
model admits), ``status`` is ``optimal`` only when the solver proved it and the simulator agrees with the
model's time, ``timeout`` with the incumbent (or the warm start) otherwise.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import reduce

from memplan.planner.errors import MemplanError, SolverUnavailable
from memplan.planner.graph import Graph
from memplan.planner.plan import Action
from memplan.planner.replay import replay
from memplan.planner.simulator import Report, _static, default_prefetch_at, simulate_actions
from memplan.solvers.base import Proposal, register

BACKENDS = ("cpsat", "cbc", "highs")
MAX_SAVED = 400


@dataclass(frozen=True, kw_only=True)
class IlpConfig:
    """Options of :func:`solve_ilp` (pass them as keyword options to ``solve(..., "ilp", ...)``)."""

    backend: str = "cpsat"              # cpsat | cbc | highs
    prefetch: str = "choose"            # choose: the ILP picks prefetch points; default: the simulator's
    max_replay_depth: int | None = None  # producers a replay may go back; None: unlimited on small graphs
    copy_window_ops: int | None = None   # ops after last forward use within which a D2H copy must end;
                                         # None: unlimited on small graphs (a copy may then run into backward)
    prefetch_window_ops: int | None = None  # candidate prefetch points after the first backward use
    workers: int = 2                     # CP-SAT search workers
    max_rounds: int = 20                 # lazy-constraint rounds (re-solves after a cut)
    warm_start: bool = True              # hint the faster of the greedy and Capuchin plans
    small_saved: int = 40                # graphs with at most this many saved activations get no windows

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise MemplanError(f"ilp: unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if self.prefetch not in ("choose", "default"):
            raise MemplanError(f"ilp: prefetch must be 'choose' or 'default', got {self.prefetch!r}")
        for name in ("max_replay_depth", "copy_window_ops", "prefetch_window_ops"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise MemplanError(f"ilp: {name} must be a non-negative integer or None, got {v!r}")


# ---- the model, formulated once -----------------------------------------------------------------------
@dataclass
class _Model:
    """Variables (bounds, integrality), rows ``lo <= sum(coef * var) <= hi`` with integer coefficients,
    and an objective to minimise (integer coefficients plus a constant)."""

    lb: list[int] = field(default_factory=list)
    ub: list[int] = field(default_factory=list)
    binary: list[bool] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    rows: list[tuple[dict[int, int], int | None, int | None]] = field(default_factory=list)
    objective: dict[int, int] = field(default_factory=dict)

    def var(self, name: str, lb: int = 0, ub: int = 1, binary: bool = True) -> int:
        self.lb.append(lb)
        self.ub.append(ub)
        self.binary.append(binary)
        self.names.append(name)
        return len(self.lb) - 1

    def row(self, expr: _Expr, lo: float | None = None, hi: float | None = None) -> None:
        """``lo <= expr <= hi`` (expr's constant moved to the bounds)."""
        terms = {v: c for v, c in expr.terms.items() if c != 0}
        lo2 = None if lo is None else math.ceil(lo - expr.const)
        hi2 = None if hi is None else math.floor(hi - expr.const)
        if not terms:
            if (lo2 is not None and lo2 > 0) or (hi2 is not None and hi2 < 0):
                raise _ConstantlyViolated
            return
        self.rows.append((terms, lo2, hi2))

    def to_json(self) -> dict:
        return {"lb": self.lb, "ub": self.ub, "binary": self.binary,
                "rows": [[list(t.items()), lo, hi] for t, lo, hi in self.rows],
                "objective": list(self.objective.items())}


class _ConstantlyViolated(Exception):
    """A row without variables that can never hold: the budget is infeasible for every plan."""


class _Expr:
    """A linear expression with integer coefficients."""

    __slots__ = ("terms", "const")

    def __init__(self, terms: dict[int, int] | None = None, const: int = 0):
        self.terms = dict(terms or {})
        self.const = const

    @staticmethod
    def of(v: int | None, c: int = 1) -> _Expr:
        return _Expr({} if v is None else {v: c})

    def add(self, v: int | None, c: int = 1) -> _Expr:
        if v is not None and c:
            self.terms[v] = self.terms.get(v, 0) + c
        return self

    def plus(self, other: _Expr, c: int = 1) -> _Expr:
        for v, k in other.terms.items():
            self.terms[v] = self.terms.get(v, 0) + c * k
        self.const += c * other.const
        return self

    def copy(self) -> _Expr:
        return _Expr(self.terms, self.const)


def _lin(const: int = 0, *pairs: tuple[int | None, int]) -> _Expr:
    e = _Expr(const=const)
    for v, c in pairs:
        e.add(v, c)
    return e


# ---- building it from the graph -----------------------------------------------------------------------
@dataclass
class _Slot:
    var: int
    key: tuple[int, int]   # position in backward order: (-step, -1) step start, (-step, k) pass k
    step: int
    start: bool            # a scheduled prefetch (prefetch_at = step) rather than one a replay triggers
    cf: int | None = None  # copy-stream variable after this copy
    active: int | None = None  # 1 when the slot fired and a copy really runs


@dataclass
class _Built:
    model: _Model
    r: dict[int, int]
    o: dict[int, int]
    slots: dict[int, list[_Slot]]
    decision_vars: list[int]
    tick_s: float
    const_time_s: float
    unit_bytes: int
    obj_offset: int
    default_prefetch: bool
    exact: bool  # no window or depth limit: every plan of the simulator's space is in the model

    def time_s(self, objective_ticks: float) -> float:
        return self.const_time_s + (objective_ticks + self.obj_offset) * self.tick_s


class _Builder:
    def __init__(self, graph: Graph, budget: int, *, offload: bool, host_budget: int | None, cfg: IlpConfig):
        self.g, self.cfg = graph, cfg
        self.st = _static(graph)
        self.m = _Model()
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

        # Units: memory in the gcd of every size (exact), time in ticks of ~1e-9 of the step.
        sizes = [t.bytes for t in tensors] + [budget, graph.fixed.resident_bytes]
        sizes += [x for op in ops for x in (op.workspace_bytes, op.backward_workspace_bytes,
                                             op.backward_grad_alloc_bytes, op.backward_grad_free_bytes)]
        self.unit = reduce(math.gcd, [s for s in sizes if s], 0) or 1
        self.budget = budget // self.unit
        self.host_budget = None if host_budget is None else host_budget // self.unit
        fwd_total = sum(op.time_s for op in ops)
        bwd_total = sum(op.backward_time_s for op in ops)
        base = max(fwd_total + bwd_total + graph.optimizer_time_s, 1e-12)
        self.tick = 10.0 ** math.floor(math.log10(base)) / 1e9
        self.const_time_s = fwd_total + bwd_total + graph.optimizer_time_s
        starts, acc = [], 0.0
        for op in ops:
            starts.append(acc)
            acc += op.time_s
        self.fwd_start = [math.floor(s / self.tick + 1e-6) for s in starts]       # rounded down
        self.fwd_end = [math.ceil((s + op.time_s) / self.tick - 1e-6) for s, op in zip(starts, ops)]
        self.fwd_start_up = [math.ceil(s / self.tick - 1e-6) for s in starts]  # a D2H copy's earliest start
        self.fwd_total = math.floor(fwd_total / self.tick + 1e-6)
        # a replayed op also re-runs the in-place initialisers of its output (TensorInfo.rebuilt_by: the
        # profiler only allows them on single-output producers), as the simulator does
        init_s = [sum(ops[m].time_s for u in op.outputs for m in graph.tensors[u].rebuilt_by) for op in ops]
        self.replay_ws = [max([op.workspace_bytes] + [ops[m].workspace_bytes for u in op.outputs
                                                      for m in graph.tensors[u].rebuilt_by]) for op in ops]
        self.op_ticks = [round((op.time_s + extra) / self.tick) for op, extra in zip(ops, init_s, strict=True)]
        self.bwd_ticks = [round(op.backward_time_s / self.tick) for op in ops]

        # Decisions.
        self.saved = saved
        self.r: dict[int, int] = {}
        self.o: dict[int, int] = {}
        for u in saved:
            info = tensors[u]
            if info.held_by_caller or info.bytes == 0:
                continue  # never freed or nothing to free: keeping is always at least as good
            if info.recomputable:
                self.r[u] = self.m.var(f"r[{u}]")
            if offload:
                self.o[u] = self.m.var(f"o[{u}]")
            if u in self.r and u in self.o:
                self.m.row(_lin(0, (self.r[u], 1), (self.o[u], 1)), hi=1)
        self.b = {t.id: t.bytes // self.unit if t.bytes % self.unit == 0 else -(-t.bytes // self.unit)
                  for t in tensors}
        self.held_bytes = sum(self.b[t.id] for t in tensors if t.kind == "activation" and t.held_by_caller)
        self.fixed = -(-graph.fixed.resident_bytes // self.unit)
        self.d = {u: max(1, math.ceil(tensors[u].bytes / self.bw / self.tick - 1e-6)) for u in self.o}
        self.slots: dict[int, list[_Slot]] = {u: [] for u in self.o}
        self.made: dict[int, list[tuple[tuple[int, int], int]]] = {u: [] for u in saved}  # (key, var)
        self.big_t = 0  # big-M for time, set in _backward's pre-pass
        self.cf_last: int | None = None  # the last D2H copy's end (forward ticks)
        self.cf_of: dict[int, int] = {}  # the copy stream's free time after u's place in the FIFO
        self.big_f = 0  # big-M for forward ticks
        self.d2h_ub: dict[int, int] = {}  # latest possible D2H end of each offload candidate
        self.linger_var: dict[tuple[int, int], int] = {}  # (u, s): u's D2H copy not over when step s starts
        self.linger_res: dict[tuple[int, int], int] = {}  # (u, s): ... and u not yet fetched back

    # -- residency --------------------------------------------------------------------------------
    def keep(self, u: int) -> _Expr:
        e = _lin(1)
        e.add(self.r.get(u), -1)
        e.add(self.o.get(u), -1)
        return e

    def prefetched(self, u: int, key: tuple[int, int], inclusive: bool) -> _Expr:
        e = _Expr()
        for sl in self.slots.get(u, ()):
            if sl.key < key or (inclusive and sl.key == key):
                e.add(sl.var)
        return e

    def available(self, u: int, s: int, key: tuple[int, int], inclusive: bool = False) -> _Expr:
        """1 when u is usable by a replay at position ``key`` of backward step ``s`` (see module doc);
        for memory, :meth:`resident` adds the release."""
        info = self.g.tensors[u]
        if info.kind != "activation" or info.held_by_caller:
            return _lin(1)
        if not self.st.saved[u]:
            return _Expr()
        e = self.prefetched(u, key, inclusive)  # an offloaded tensor, once fetched, is usable after its
        e.add(self.linger_res.get((u, s)))      # release too (the simulator does not fetch it again)
        if self.st.release_at[u] <= s:
            e.plus(self.keep(u))
            for k, v in self.made[u]:
                if k < key:
                    e.add(v)
        return e

    def resident_saved(self, s: int, key: tuple[int, int]) -> _Expr:
        """Bytes (units) of saved, not caller-held activations on device at ``key`` of step ``s``."""
        e = _Expr()
        for u in self.saved:
            if self.g.tensors[u].held_by_caller or self.st.release_at[u] > s:
                continue
            e.plus(self.available(u, s, key, inclusive=True), self.b[u])
        return e

    # -- the whole model -------------------------------------------------------------------------------
    def build(self) -> _Built:
        self._forward()
        self._backward()
        if self.host_budget is not None and self.o:
            self.m.row(_lin(0, *((v, self.b[u]) for u, v in self.o.items())), hi=self.host_budget)
        decision = list(self.r.values()) + list(self.o.values())
        decision += [sl.var for u in self.o for sl in self.slots[u] if sl.start]
        exact = self.depth is None and (not self.o or (self.linger and self.pf_window >= self.n))
        return _Built(self.m, self.r, self.o, self.slots, decision, self.tick, self.const_time_s, self.unit,
                      self.obj_offset, self.cfg.prefetch == "default", exact)

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
                m.row(_lin(0, (cf, 1), (prev, -1)), lo=0)
                m.row(_lin(0, (cf, 1), (prev, -1), (ou, -d)), lo=0)
            m.row(_lin(0, (cf, 1), (ou, -(fe + d))), lo=0)
            if self.linger:
                # exact, not just a lower bound: whether a copy is over in backward changes what a prefetch
                # costs, so cf = o ? max(prev, fe) + d : prev (one binary picks which term is the max)
                if prev is None:
                    m.row(_lin(0, (cf, 1), (ou, -(fe + d))), hi=0)
                else:
                    m.row(_lin(0, (cf, 1), (prev, -1), (ou, -big)), hi=0)
                    after_prev = m.var(f"d2h_after_prev[{u}]")
                    m.row(_lin(0, (cf, 1), (prev, -1), (after_prev, big)), hi=d + big)
                    m.row(_lin(0, (cf, 1), (after_prev, -big)), hi=fe + d)
            prev = cf
            f = st.fwd_free_at[u]
            lim = self.n if self.linger else f + self.copy_window + 1
            if not self.linger:
                end = self.fwd_start[lim] if lim < self.n else self.fwd_total
                end = min(end, self.fwd_total)
                # the copy must be over by op `lim` (and before backward starts)
                m.row(_lin(0, (cf, 1), (ou, big)), hi=end + big)
            else:
                end = big
            for i in range(f + 1, min(lim, self.n)):
                if self.fwd_start[i] >= end:
                    break
                zi = m.var(f"z[{u},{i}]")
                z[u][i] = zi
                m.row(_lin(0, (zi, 1), (ou, -1)), hi=0)
                # on device at op i unless its copy ended by the time op i starts
                m.row(_lin(0, (cf, 1), (zi, -big), (ou, big)), hi=self.fwd_start[i] + big)
        self.cf_last = prev
        produced = self._produced()
        for op in g.ops:
            i = op.id
            e = _lin(self.fixed + self._ceil(op.workspace_bytes))
            for u in produced[i]:
                if tensors[u].held_by_caller or i <= st.fwd_free_at[u]:
                    e.const += self.b[u]  # in forward use (or held): live whatever the plan
                elif u in self.r or u in self.o:
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
        """Tensors a replay for target t at step s may traverse (:func:`memplan.planner.replay.replay`,
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
        for u in self.o:
            fb = st.first_bwd_use[u]
            if choose:
                qs = list(range(fb, min(n - 1, fb + self.pf_window) + 1))
                dq = default_prefetch_at(g, u, self.bw)
                if dq not in qs:
                    qs.append(dq)
            else:
                qs = [default_prefetch_at(g, u, self.bw)]
            for q in qs:
                self.slots[u].append(_Slot(m.var(f"pf[{u},{q}]"), (-q, -1), q, True))
        # Passes: one per (step, saved tensor with a recompute option), in the simulator's order.
        passes: list[tuple[int, int, int, list[int], set[int]]] = []
        for s in range(n - 1, -1, -1):
            for k, t in enumerate(st.unpack_order[s]):  # the simulator's order
                if t in self.r:
                    c, fr = self._closure(t, s)
                    passes.append((s, k, t, c, fr))
        # Visit slots (a replay needs an offloaded tensor before its scheduled prefetch).
        # (with the default prefetch points, only above the default: below it u is back already)
        for s, k, t, c, fr in passes:
            for u in c:
                floor = st.first_bwd_use[u] if choose or u not in self.o else self.slots[u][0].step
                if u in self.o and u != t and s > floor:
                    self.slots[u].append(_Slot(m.var(f"pv[{u},{s},{k}]"), (-s, k), s, False))
        for u in self.o:
            self.slots[u].sort(key=lambda sl: sl.key)
            m.row(_lin(0, *((sl.var, 1) for sl in self.slots[u]), (self.o[u], -1)), lo=0, hi=0)
        big_t = 2 * (sum(self.bwd_ticks) + sum(self.d.values()) + 1)
        for s, k, t, c, fr in passes:
            rep_ops = {tensors[u].producer for u in c}
            big_t += sum(self.op_ticks[p] for p in rep_ops)
        self.big_t = big_t
        big_mem = self.fixed + sum(self.b.values()) + sum(
            -(-(op.workspace_bytes + op.backward_workspace_bytes + op.backward_grad_alloc_bytes) // self.unit)
            for op in ops) + max(grads + [0]) // self.unit + 1

        timing = bool(self.o)
        objective = _Expr()
        tau = m.var("tau[start]", 0, 0, binary=False) if timing else None
        cf = tau  # copy stream free (relative to the start of backward)
        if timing and self.linger and self.cf_last is not None:
            # D2H copies still running when backward starts delay the first prefetch (one FIFO stream)
            cf = m.var("cf[start]", 0, big_t, binary=False)
            m.row(_lin(0, (cf, 1), (self.cf_last, -1)), lo=-self.fwd_total)
        above = 0  # backward ticks of the steps above s: the clock at step s is at least this
        pass_iter = iter(passes)
        nxt = next(pass_iter, None)
        for s in range(n - 1, -1, -1):
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
                                active = self._and_not(f"pf_copy[{u},{s}]", _Expr.of(sl.var), _Expr.of(lv))
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
                        m.row(_lin(0, (tau_b, 1), (tau, -1)), lo=0)
                        for u in sorted(self.o):
                            for sl in self.slots[u]:
                                if not sl.start and sl.key == (-s, k):
                                    cf = self._copy(sl, u, cf, tau, big_t, sl.var)
                                    m.row(_lin(0, (tau_b, 1), (cf, -1), (sl.var, -big_t)), lo=-big_t)
                        tau_c = m.var(f"tau[{s},{k}]c", 0, big_t, binary=False)
                        m.row(_Expr({tau_c: 1, tau_b: -1}).plus(replay, -1), lo=0, hi=0)
                        tau = tau_c
                if timing and t in self.o:
                    # wait for t's copy back
                    tau_d = m.var(f"tau[{s},{k}]d", 0, big_t, binary=False)
                    m.row(_lin(0, (tau_d, 1), (tau, -1)), lo=0)
                    for sl in self.slots[t]:
                        m.row(_lin(0, (tau_d, 1), (sl.cf, -1), (sl.active, -big_t)), lo=-big_t)
                    tau = tau_d
            # the backward step itself
            e = _lin(self.fixed + self.held_bytes + self._ceil(grads[s]) + self._ceil(
                op.backward_grad_alloc_bytes + op.backward_workspace_bytes))
            e.plus(self.resident_saved(s, (-s, 10**9)))
            m.row(e, hi=self.budget)
            if timing:
                nt = m.var(f"tau[{s}]end", 0, big_t, binary=False)
                m.row(_lin(0, (nt, 1), (tau, -1)), lo=self.bwd_ticks[s], hi=self.bwd_ticks[s])
                tau = nt
        self.obj_offset = 0
        if timing:
            m.objective = {tau: 1}
            self.obj_offset = -sum(self.bwd_ticks)  # the chain includes backward compute (a constant)
        else:
            m.objective = dict(objective.terms)
        # optimizer step: constant
        opt = self.fixed + self.held_bytes + self._ceil(max(grads_after[0], 0)) + self._ceil(
            g.fixed.optimizer_step_bytes)
        if opt > self.budget:
            raise _ConstantlyViolated

    def _ceil(self, nbytes: int) -> int:
        return -(-nbytes // self.unit)

    def _copy(self, sl: _Slot, u: int, cf: int, tau: int, big_t: int, active: int) -> int:
        """One potential copy on the FIFO copy stream, run when ``active`` is 1 (the slot fired and the
        tensor is not still on device)."""
        m, d = self.m, self.d[u]
        new = m.var(f"cf[{u},{sl.key}]", 0, big_t, binary=False)
        m.row(_lin(0, (new, 1), (cf, -1)), lo=0)
        m.row(_lin(0, (new, 1), (cf, -1), (active, -d)), lo=0)
        m.row(_lin(0, (new, 1), (tau, -1), (active, -(d + big_t))), lo=-big_t)
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
            m.row(_lin(0, (v, 1), (ou, -1)), hi=0)
            # copy not over (cf - T >= 1 tick) -> v = 1 (when offloaded) ...
            m.row(_lin(0, (cf_u, 1), (tau, -1), (v, -big), (ou, big)), hi=self.fwd_total + big)
            # ... and v = 1 -> copy not over
            m.row(_lin(0, (cf_u, 1), (tau, -1), (v, -big)), lo=self.fwd_total + 1 - big)
            self.linger_var[(u, s)] = v
            fetched = self.prefetched(u, (-s, -1), True)
            self.linger_res[(u, s)] = self._and_not(f"linger_res[{u},{s}]", _Expr.of(v), fetched)

    def _and_not(self, name: str, a: _Expr, b: _Expr) -> int:
        """A binary equal to ``a and not b`` (a, b 0/1 expressions)."""
        m = self.m
        w = m.var(name)
        m.row(_Expr({w: 1}).plus(a, -1), hi=0)
        m.row(_Expr({w: 1}).plus(b, 1), hi=1)
        m.row(_Expr({w: 1}).plus(a, -1).plus(b, 1), lo=0)
        return w

    def _pass(self, p: tuple[int, int, int, list[int], set[int]], grads_s: int, big_mem: int) -> _Expr:
        """Rows of one materialisation pass; returns its replay time (ticks) as an expression."""
        s, k, t, closure, frontier = p
        g, st, m = self.g, self.st, self.m
        ops, tensors = g.ops, g.tensors
        key = (-s, k)
        in_c = set(closure)
        rep_ops = sorted({tensors[u].producer for u in closure if tensors[u].recomputable})
        # Which replay ops read each tensor (the traversal goes from a replayed op to its inputs).
        readers: dict[int, list[int]] = {}
        for q in rep_ops:
            # a replayed producer re-runs its output's in-place chain (rebuilt_by): what those ops read is
            # read at q too (the model places the chain with its producer)
            chain = [v for u in ops[q].outputs for m in tensors[u].rebuilt_by for v in ops[m].inputs]
            for v in dict.fromkeys([*ops[q].inputs, *chain]):
                if v in in_c or v in frontier:
                    readers.setdefault(v, []).append(q)
        avail = {u: self.available(u, s, key) for u in in_c | frontier}
        vis: dict[int, _Expr] = {}
        w: dict[int, _Expr] = {}
        # the target: replayed when not on device (recomputed, not made by an earlier pass)
        miss = _lin(1).plus(avail[t], -1)
        rp: dict[int, int] = {q: m.var(f"rp[{q},{s},{k}]") for q in rep_ops}
        for u in closure:
            if u == t:
                vis[u] = miss
            else:
                v = m.var(f"vis[{u},{s},{k}]")
                qs = readers.get(u, [])
                for q in qs:
                    m.row(_lin(0, (v, 1), (rp[q], -1)), lo=0)
                m.row(_lin(0, (v, 1), *((rp[q], -1) for q in qs)), hi=0)
                vis[u] = _Expr.of(v)
            a = avail[u]
            if not a.terms and a.const == 0:
                w[u] = vis[u]
            elif not a.terms and a.const == 1:
                w[u] = _Expr()
            else:
                w[u] = _Expr.of(self._and_not(f"w[{u},{s},{k}]", vis[u], a))
        # frontier tensors: reached only if available
        for u in frontier:
            for q in readers.get(u, []):
                m.row(_Expr({rp[q]: 1}).plus(avail[u], -1), hi=0)
        # replay or fetch: an offloaded tensor is fetched (visit slot), the others are replayed
        wr: dict[int, _Expr] = {}
        for u in closure:
            if u in self.o and u != t:
                slot = next((sl for sl in self.slots[u] if sl.key == key), None)
                ou = self.o[u]
                if slot is None:  # reached at or below its first backward use: fetched already
                    wr[u] = _Expr.of(self._and_not(f"wr[{u},{s},{k}]", w[u], _Expr.of(ou)))
                    continue
                # the slot fires exactly when u is reached, offloaded and not yet fetched
                y = slot.var
                lv = self.linger_var.get((u, s))  # still on device: read as it is, nothing fetched
                m.row(_Expr({y: 1}).plus(vis[u], -1), hi=0)
                m.row(_lin(0, (y, 1), (ou, -1)), hi=0)
                m.row(_Expr({y: 1}).plus(self.prefetched(u, key, False), 1).add(lv, 1), hi=1)
                m.row(_Expr({y: 1}).plus(vis[u], -1).plus(self.prefetched(u, key, False), 1).add(ou, -1)
                      .add(lv, 1), lo=-1)
                wr[u] = _Expr.of(self._and_not(f"wr[{u},{s},{k}]", w[u], _Expr.of(ou)))
            else:
                wr[u] = w[u]
            if not tensors[u].recomputable:
                m.row(wr[u], hi=0)  # cannot be rebuilt: the plan must keep it there
        for q in rep_ops:
            outs = [u for u in ops[q].outputs if u in in_c]
            for u in outs:
                m.row(_Expr({rp[q]: 1}).plus(wr[u], -1), lo=0)
            e = _Expr({rp[q]: 1})
            for u in outs:
                e.plus(wr[u], -1)
            m.row(e, hi=0)
        # allocations: every output of a replayed op that is not there
        made: dict[int, _Expr] = {}
        for q in rep_ops:
            outs = ops[q].outputs
            for u in outs:
                if len(outs) == 1 and u in in_c:
                    made[u] = _Expr.of(rp[q])
                    continue
                a = avail.get(u)
                if a is None:
                    a = self.available(u, s, key)
                if not a.terms and a.const == 1:
                    continue
                mv = _Expr.of(self._and_not(f"made[{u},{s},{k}]", _Expr.of(rp[q]), a))
                made[u] = mv
                if u in self.o:
                    m.row(mv.copy().add(self.o[u], 1), hi=1)  # would re-create an offloaded output
        # retained: saved tensors whose backward is still to come (and the target)
        retained = {u for u in made if u == t or (st.saved[u] and st.release_at[u] <= s
                                                  and not tensors[u].held_by_caller)}
        for u in retained:
            (v,) = made[u].terms  # single variables by construction
            self.made[u].append((key, v))
        # memory of each replayed op: pass-start residents, fetched ones, this op's outputs, earlier
        # outputs still read by this or a later replayed op
        base = _lin(self.fixed + self.held_bytes + self._ceil(grads_s))
        base.plus(self.resident_saved(s, key))
        for q in rep_ops:
            e = base.copy()
            e.const += self._ceil(self.replay_ws[q])
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
                    if u in retained:
                        e.plus(made[u], self.b[u])
                        continue
                    later = [q3 for q3 in readers.get(u, []) if q3 >= q]
                    if not later:
                        continue
                    al = m.var(f"alive[{u},{q},{s},{k}]")
                    for q3 in later:
                        m.row(_Expr({al: 1}).plus(made[u], -1).add(rp[q3], -1), lo=-1)
                    e.add(al, self.b[u])
            e.add(rp[q], big_mem)
            m.row(e, hi=self.budget + big_mem)
        return _lin(0, *((rp[q], self.op_ticks[q]) for q in rep_ops))


# ---- backends -----------------------------------------------------------------------------------------
@dataclass
class _Answer:
    status: str                        # optimal | feasible | infeasible | unknown
    values: list[int] | None           # one per variable, when a solution was found
    objective: float | None            # in ticks
    bound: float | None                # best bound, in ticks
    stats: dict = field(default_factory=dict)


def _solve_cpsat(model: _Model, hint: dict[int, int], time_limit_s: float, workers: int) -> _Answer:
    try:
        from ortools.sat.python import cp_model
    except ImportError as e:  # not installed, or a conflicting HiGHS library loaded first
        if "undefined symbol" in str(e):
            return _solve_child(model, hint, time_limit_s, "cpsat", workers)
        raise SolverUnavailable("ilp backend 'cpsat' needs OR-Tools: pip install ortools") from None
    cm = cp_model.CpModel()
    xs = [cm.new_bool_var(nm) if bi else cm.new_int_var(lo, hi, nm)
          for lo, hi, bi, nm in zip(model.lb, model.ub, model.binary, model.names, strict=True)]
    lo_inf, hi_inf = cp_model.INT_MIN, cp_model.INT_MAX
    for terms, lo, hi in model.rows:
        expr = cp_model.LinearExpr.weighted_sum([xs[v] for v in terms], list(terms.values()))
        cm.add_linear_constraint(expr, lo_inf if lo is None else lo, hi_inf if hi is None else hi)
    cm.minimize(cp_model.LinearExpr.weighted_sum([xs[v] for v in model.objective], list(model.objective.values())))
    for v, val in hint.items():
        cm.add_hint(xs[v], val)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.01, time_limit_s)
    solver.parameters.num_workers = max(1, workers)
    code = solver.solve(cm)
    stats = {"wall_s": solver.wall_time, "branches": solver.num_branches}
    if code == cp_model.INFEASIBLE:
        return _Answer("infeasible", None, None, None, stats)
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return _Answer("unknown", None, None, None, stats)
    values = [int(solver.value(x)) for x in xs]
    return _Answer("optimal" if code == cp_model.OPTIMAL else "feasible", values, solver.objective_value,
                   solver.best_objective_bound, stats)


def _pulp_problem(model: _Model):
    import pulp

    prob = pulp.LpProblem("memplan_ilp", pulp.LpMinimize)
    xs = [pulp.LpVariable(f"x{i}", lowBound=lo, upBound=hi, cat=pulp.LpBinary if bi else pulp.LpContinuous)
          for i, (lo, hi, bi) in enumerate(zip(model.lb, model.ub, model.binary, strict=True))]
    prob += pulp.LpAffineExpression([(xs[v], c) for v, c in model.objective.items()])
    for j, (terms, lo, hi) in enumerate(model.rows):
        expr = pulp.LpAffineExpression([(xs[v], c) for v, c in terms.items()])
        if lo is not None and hi is not None and lo == hi:
            prob += pulp.LpConstraint(expr, pulp.LpConstraintEQ, f"r{j}", hi)
            continue
        if lo is not None:
            prob += pulp.LpConstraint(expr, pulp.LpConstraintGE, f"r{j}l", lo)
        if hi is not None:
            prob += pulp.LpConstraint(expr, pulp.LpConstraintLE, f"r{j}h", hi)
    return prob, xs


def _solve_cbc(model: _Model, hint: dict[int, int], time_limit_s: float) -> _Answer:
    try:
        import pulp
    except ImportError:
        raise SolverUnavailable("ilp backend 'cbc' needs PuLP (it bundles CBC): pip install pulp") from None
    prob, xs = _pulp_problem(model)
    for v, val in hint.items():
        xs[v].setInitialValue(val)
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "cbc.log")
        cmd = pulp.PULP_CBC_CMD(msg=False, timeLimit=max(1, math.ceil(time_limit_s)), warmStart=bool(hint),
                                logPath=log, threads=1)
        prob.solve(cmd)
        text = open(log).read() if os.path.exists(log) else ""
    bound = _cbc_bound(text)
    return _pulp_answer(prob, xs, bound)


def _cbc_bound(log: str) -> float | None:
    """CBC's best possible objective, from its log ('best possible X' / 'Objective value' lines)."""
    import re

    found = re.findall(r"best possible (-?[0-9.eE+-]+)", log)
    if found:
        return float(found[-1])
    found = re.findall(r"Lower bound:\s+(-?[0-9.eE+-]+)", log)
    return float(found[-1]) if found else None


HIGHSPY_PIN = "highspy==1.12.0"  # the HiGHS that OR-Tools 9.15 bundles (libhighs.so.1): both load together


def _solve_highs(model: _Model, time_limit_s: float) -> _Answer:
    """HiGHS through PuLP, in this process when highspy loads here, else in a child process.

    OR-Tools ships its own ``libhighs.so.1``. Once OR-Tools is loaded, a highspy built against another
    HiGHS release finds that library already loaded under the same soname and fails with an undefined
    symbol; a highspy of the bundled release (pyproject pins it) loads beside it."""
    try:
        import highspy  # noqa: F401
    except ModuleNotFoundError:
        raise SolverUnavailable(f"ilp backend 'highs' needs highspy: pip install '{HIGHSPY_PIN}'") from None
    except ImportError as e:  # another HiGHS library is loaded in this process (OR-Tools')
        if "undefined symbol" not in str(e):
            raise SolverUnavailable(f"ilp backend 'highs': highspy does not load ({e}); "
                                    f"pip install '{HIGHSPY_PIN}'") from None
        return _solve_child(model, {}, time_limit_s, "highs", 1)
    return _solve_highs_here(model, time_limit_s)


def _solve_highs_here(model: _Model, time_limit_s: float) -> _Answer:
    import pulp

    prob, xs = _pulp_problem(model)
    prob.solve(pulp.HiGHS(msg=False, timeLimit=max(0.01, time_limit_s), threads=1))
    h = getattr(prob, "solverModel", None)
    bound = None
    if h is not None:
        try:
            bound = float(h.getInfo().mip_dual_bound)
        except Exception:  # an older highspy without the field: no bound
            bound = None
    return _pulp_answer(prob, xs, bound)


def _pulp_answer(prob, xs, bound: float | None) -> _Answer:
    """A solved PuLP problem as an :class:`_Answer` (CBC and HiGHS alike); ``bound`` is the backend's."""
    import pulp

    if prob.status == pulp.LpStatusInfeasible:
        return _Answer("infeasible", None, None, None, {})
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return _Answer("unknown", None, None, bound, {})
    values = [round(x.value() or 0) for x in xs]
    obj = pulp.value(prob.objective) or 0.0
    optimal = prob.sol_status == pulp.LpSolutionOptimal
    return _Answer("optimal" if optimal else "feasible", values, obj, obj if optimal else bound, {})


def _solve_child(model: _Model, hint: dict[int, int], time_limit_s: float, backend: str, workers: int) -> _Answer:
    """Solve in a fresh Python process: highspy and OR-Tools ship incompatible HiGHS libraries and cannot
    both be loaded in one process (whichever comes second fails with an undefined symbol)."""
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "model.json"), os.path.join(tmp, "answer.json")
        with open(src, "w") as f:
            json.dump({"model": model.to_json(), "hint": list(hint.items()), "time_limit_s": time_limit_s,
                       "backend": backend, "workers": workers}, f)
        code = ("import sys; from memplan.solvers.ilp import _child_main; _child_main(sys.argv[1], sys.argv[2])")
        try:
            proc = subprocess.run([sys.executable, "-c", code, src, dst], capture_output=True, text=True,
                                  timeout=time_limit_s + 60)
        except subprocess.TimeoutExpired:
            return _Answer("unknown", None, None, None, {"child": "killed after the time limit"})
        if proc.returncode != 0 or not os.path.exists(dst):
            tail = (proc.stderr or "").strip().splitlines()[-1:] or ["no output"]
            if "No module named" in tail[0] or "undefined symbol" in tail[0] or "not available" in tail[0]:
                what = HIGHSPY_PIN if backend == "highs" else "ortools"
                raise SolverUnavailable(f"ilp backend {backend!r} is unavailable ({tail[0]}); "
                                        f"pip install '{what}'")
            raise MemplanError(f"ilp backend {backend!r} failed in its child process: {tail[0]}")
        with open(dst) as f:
            a = json.load(f)
    return _Answer(a["status"], a["values"], a["objective"], a["bound"], a.get("stats", {}))


def _child_main(src: str, dst: str) -> None:
    with open(src) as f:
        job = json.load(f)
    mj = job["model"]
    model = _Model(lb=mj["lb"], ub=mj["ub"], binary=mj["binary"], names=[f"x{i}" for i in range(len(mj["lb"]))],
                   rows=[({int(v): int(c) for v, c in t}, lo, hi) for t, lo, hi in mj["rows"]],
                   objective={int(v): int(c) for v, c in mj["objective"]})
    hint = {int(v): int(c) for v, c in job["hint"]}
    if job["backend"] == "highs":
        ans = _solve_highs_here(model, job["time_limit_s"])
    else:
        ans = _solve_cpsat(model, hint, job["time_limit_s"], job["workers"])
    with open(dst, "w") as f:
        json.dump({"status": ans.status, "values": ans.values, "objective": ans.objective, "bound": ans.bound,
                   "stats": ans.stats}, f)


def _run_backend(cfg: IlpConfig, model: _Model, hint: dict[int, int], time_limit_s: float) -> _Answer:
    if cfg.backend == "cpsat":
        return _solve_cpsat(model, hint, time_limit_s, cfg.workers)
    if cfg.backend == "cbc":
        return _solve_cbc(model, hint, time_limit_s)
    return _solve_highs(model, time_limit_s)


# ---- the solver method --------------------------------------------------------------------------------
def _decode(built: _Built, values: list[int], graph: Graph) -> tuple[dict[int, Action], dict[int, int]]:
    actions: dict[int, Action] = {}
    prefetch: dict[int, int] = {}
    st = _static(graph)
    for u in graph.saved_activations:  # ascending ids: the simulator's FIFO order among equal prefetch points
        if u in built.r and values[built.r[u]]:
            actions[u] = Action.RECOMPUTE
        elif u in built.o and values[built.o[u]]:
            actions[u] = Action.OFFLOAD
            fired = [sl for sl in built.slots[u] if values[sl.var]]
            if built.default_prefetch:
                continue  # the simulator's default point (a replay may fetch it earlier, as it would)
            if fired and fired[0].start:
                prefetch[u] = fired[0].step
            else:  # fetched by a replay before any scheduled point: the earliest legal point is a no-op
                prefetch[u] = st.first_bwd_use[u]
    return actions, prefetch


def _hint_for(built: _Built, graph: Graph, actions: dict[int, Action], prefetch: dict[int, int],
              bandwidth: float) -> dict[int, int]:
    hint: dict[int, int] = {}
    for u, v in built.r.items():
        hint[v] = int(actions.get(u) == Action.RECOMPUTE)
    for u, v in built.o.items():
        off = actions.get(u) == Action.OFFLOAD
        hint[v] = int(off)
        q = prefetch.get(u, default_prefetch_at(graph, u, bandwidth)) if off else None
        for sl in built.slots[u]:
            if sl.start:
                hint[sl.var] = int(off and sl.step == q)
    return hint


def _cut(model: _Model, decision: list[int], values: list[int]) -> None:
    """A no-good cut: forbid exactly this assignment of the decision variables."""
    terms: dict[int, int] = {}
    ones = 0
    for v in decision:
        if values[v]:
            terms[v] = -1
            ones += 1
        else:
            terms[v] = 1
    model.rows.append((terms, 1 - ones, None))


@register("ilp", description="Checkmate-style MILP over keep / recompute / offload and prefetch points, "
                             "exact under the simulator's lazy replay (CP-SAT, CBC or HiGHS)",
          graphs="dag", exact=True, offload=True, max_ops=MAX_SAVED)
def solve_ilp(graph: Graph, budget_bytes: int, *, time_limit_s: float = 60.0, offload: bool = False,
              host_budget_bytes: int | None = None, **options: object) -> Proposal:
    """Minimise the simulated step time subject to the simulated peak <= ``budget_bytes`` (and the host
    bytes <= ``host_budget_bytes``), by the MILP described in this module's docstring, solved by
    ``backend`` (see :class:`IlpConfig` for the options). Warm-started from the faster of the greedy and
    Capuchin heuristics; every solution is simulated, and one over budget is cut off and the model
    re-solved. Returns the best simulated plan with the solver's bound; ``optimal`` only when proved (and
    confirmed by the simulator) on a model that admits every plan (on large graphs the model is limited,
    and its bound and status go to ``stats['model_bound_s']`` / ``stats['model_status']`` instead),
    ``timeout`` when the limit stopped the search, ``infeasible`` when the model has no plan."""
    try:
        cfg = IlpConfig(**options)  # type: ignore[arg-type]
    except TypeError as e:
        raise MemplanError(f"ilp: unknown option ({e}); options: {', '.join(IlpConfig.__dataclass_fields__)}") from None
    t0 = time.perf_counter()
    deadline = t0 + time_limit_s
    bw = graph.host_bandwidth_bytes_per_s
    stats: dict[str, object] = {"backend": cfg.backend}

    def fits(r: Report) -> bool:
        return r.peak_bytes <= budget_bytes and (not offload or host_budget_bytes is None
                                                 or r.host_peak_bytes <= host_budget_bytes)

    # Warm start: the faster of the greedy and Capuchin heuristics' plans that fit. It is also the answer
    # when the model (depth- or window-limited on large graphs) admits nothing better.
    best: tuple[float, dict[int, Action], dict[int, int]] | None = None
    warm: tuple[dict[int, Action], dict[int, int]] | None = None
    if cfg.warm_start:
        from memplan.solvers.heuristics import solve_capuchin, solve_greedy

        for name, heuristic in (("greedy", solve_greedy), ("capuchin", solve_capuchin)):
            try:
                prop = heuristic(graph, budget_bytes, time_limit_s=min(5.0, 0.1 * time_limit_s), offload=offload,
                                 host_budget_bytes=host_budget_bytes)
            except MemplanError:
                continue
            if prop.status == "infeasible":
                continue
            rep = simulate_actions(graph, prop.actions, prefetch_at=prop.prefetch_at)
            if fits(rep) and (best is None or rep.time_s < best[0]):
                warm = (prop.actions, prop.prefetch_at)
                best = (rep.time_s, dict(prop.actions), dict(prop.prefetch_at))
                stats["warm_start"] = name
        stats["warm_start_s"] = None if best is None else best[0]
    try:
        built = _Builder(graph, budget_bytes, offload=offload, host_budget=host_budget_bytes, cfg=cfg).build()
    except _ConstantlyViolated:
        return Proposal(status="infeasible", stats={**stats, "reason": "a memory row no plan can change is over budget"})
    model = built.model
    stats.update(variables=len(model.lb), rows=len(model.rows), build_s=time.perf_counter() - t0)
    hint = _hint_for(built, graph, *warm, bw) if warm else {}
    bound_s: float | None = None
    status = "timeout"
    cuts = mismatches = time_cuts = 0
    for rnd in range(cfg.max_rounds):
        left = deadline - time.perf_counter()
        if left <= 0.05:
            break
        ans = _run_backend(cfg, model, hint, left)
        if ans.bound is not None and (cuts == 0 or ans.status == "optimal"):
            # cuts only remove plans the simulator refused, so the bound stays valid across rounds
            bound_s = built.time_s(ans.bound)
        if ans.status == "infeasible":
            # nothing the model admits fits: the warm start (if any) lies outside the model -- unless
            # only time cuts removed plans, from an exact model: then the best of them is the optimum
            status = "infeasible" if best is None else "feasible"
            if best is not None and time_cuts and cuts == time_cuts and built.exact:
                status = "optimal"
            break
        if ans.values is None:
            break  # no solution within the time left
        actions, prefetch = _decode(built, ans.values, graph)
        rep = simulate_actions(graph, actions, prefetch_at=prefetch)
        model_s = built.time_s(ans.objective or 0.0)
        if not fits(rep):
            cuts += 1
            _cut(model, built.decision_vars, ans.values)
            continue
        tol = 1e-6 * max(1.0, rep.time_s) + 2 * built.tick_s * (len(graph.ops) + 1)
        if abs(rep.time_s - model_s) > tol:
            mismatches += 1
        if best is None or rep.time_s < best[0]:
            best = (rep.time_s, actions, prefetch)
        if ans.status == "optimal" and best[0] <= model_s + tol:
            status = "optimal"  # nothing the model admits is faster than a plan the simulator confirmed
            break
        if ans.status == "optimal" and rep.time_s > model_s + tol:
            # the model under-estimated this plan (a tie the integer ticks round the other way): it is
            # recorded in `best` at its simulated time; cut it and ask again for the next best
            cuts += 1
            _cut(model, built.decision_vars, ans.values)
            time_cuts += 1
            continue
        hint = {v: ans.values[v] for v in built.decision_vars}
        break
    stats.update(cuts=cuts, time_cuts=time_cuts, rounds=rnd + 1 if cfg.max_rounds else 0, model_mismatches=mismatches,
                 solve_s=time.perf_counter() - t0)
    if best is None:
        stats["stopped"] = "model infeasible" if status == "infeasible" else "time limit"
        return Proposal(status="infeasible", stats=stats)
    if bound_s is not None:
        bound_s = min(bound_s, best[0])
    if status == "optimal":
        bound_s = best[0] if bound_s is None else bound_s
    if not built.exact:
        # the model left plans out (replay depth, prefetch window): its bound and its "optimal" hold over
        # the plans it admits only, and a heuristic can beat them, so neither is reported as the method's
        stats["model_bound_s"] = bound_s
        stats["model_status"] = status
        bound_s = None
        status = "feasible" if status == "optimal" else status
    return Proposal(best[1], best[2], status, bound_s, stats)
