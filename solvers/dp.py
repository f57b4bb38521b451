"""Dynamic programming on chains: memplan's exact chain DP (``dp``), and the published chain schedules
as baselines (``rotor``, ``chen``, ``revolve``), all translated into keep / recompute (/ offload) actions
and scored by the simulator like every other method.

**What ``dp`` is exact for.** On a graph that *is* a chain (op ``i`` has one output ``a_i``, reads only
``a_{i-1}`` among activations, its backward saves ``a_{i-1}``, and the last op also saves its own output:
the shape of :func:`memplan.planner.core.synthetic.linear_chain`), the simulator's lazy replay reduces to
single-level checkpointing: with ``K`` the kept activations, backward step ``s`` that finds ``a_{s-1}``
missing replays the run of recomputed ops above the nearest kept ``a_k``, and every replayed tensor stays
resident until its own backward (its saver is still to come), so each recomputed op runs exactly once.
Hence step time = keep-everything time + the forward time of the recomputed ops, and every peak the
simulator records is ``F + S(k) + C(k, k')`` for two consecutive kept activations ``k < k'`` (``F`` fixed
bytes, ``S(k)`` the kept bytes up to ``k``, ``C`` the forward, replay and backward peaks of the run between
them: see :meth:`_OpChain.run_costs`), plus peaks no plan changes. Rewriting ``S(k) + C(k, k') <= B - F``
from the top down gives a budget-free table:

    ``D[k][r]`` = the most forward time saved by keeping activations above ``k`` (``k`` kept, ``-1`` = the
    input), over the suffixes whose memory requirement ``R(k) = max(C(k, k'), b_k' + R(k'))`` is at most
    ``r`` memory units; ``-inf`` when none is.

``D[k][r] = max_k' [C(k, k') <= r] (t_k' + D[k'][r - b_k'])`` (``k' = n``: nothing more kept, value 0).
The optimum for budget ``B`` is read at ``D[-1][B - F]``, so one table gives the whole frontier
(:func:`dp_frontier`, which shares :func:`solve`'s code path: an engine's answer at a spare memory does
not depend on the largest spare it was built for). Three engines, all over the same recurrence:

- an **exact grid**: memory in units of the gcd of every byte figure of the chain (exact: no figure is
  rounded), when the table (ops x units) has at most ``_GRID_CELLS`` cells. The window maximum over rows
  costs O(columns) per row (:class:`_Windows`), so the 1000-op chain at 70% solves in about a second;
- an **exact Pareto frontier** in bytes (sizes sharing no useful gcd, e.g. GPU-scale tensors of odd
  sizes): per kept ``k`` the non-dominated (memory requirement, time saved) pairs, while at most
  ``_PARETO_POINTS`` points are merged;
- otherwise a **rounded grid** whose unit depends on the chain alone: sizes rounded *up* (the plan fits;
  status ``feasible``) and a table rounded *down* giving a sound lower bound (``optimal`` when both agree).

The exact engines are equal to the exhaustive oracle at every budget, one byte below each trade-off point
included (tests/test_dp.py), and report the exact least feasible budget (:func:`chain_min_budget_bytes`).
Cost: O(n * L + n * M) numpy work for ``n`` ops, runs of at most ``L`` ops fitting the budget and ``M``
units (grid), or the total size of the frontiers merged (Pareto).

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
from functools import reduce

import numpy as np

from memplan.planner.core.errors import Infeasible, MemplanError
from memplan.planner.core.graph import Graph, coarsen
from memplan.planner.core.plan import Action
from memplan.planner.core.simulator import Report, default_prefetch_at, simulate_actions
from memplan.solvers.bounds import keep_all_report
from memplan.solvers.hierarchical import has_blocks, solve_hierarchical
from memplan.solvers.multilevel import per_use_everything
from memplan.solvers.registry import Proposal, register

Actions = dict[int, Action]

_NEG_BYTES = -(1 << 60)      # "no constraint" in the integer cost arrays
_PAIR_MOVES_UP_TO = 16       # offload refinement tries pairs of changes on graphs this small
_OFFLOAD_REFINE_S = 10.0     # at most this long (or the time limit) refining offloads


# ---- the exact chain model ---------------------------------------------------------------------------
@dataclass(frozen=True)
class _OpChain:
    """Per-element figures of a chain, as the simulator sees them (see the module docstring).

    Element ``i`` is activation ``a_i`` produced by op ``i``: ``bytes_[i]``, ``time_s[i]`` (its producer's
    forward time, paid again when it is recomputed). ``fixed_bytes`` is live throughout; ``const_peak_bytes``
    is the highest peak no plan changes (start, backward of op 0, optimizer step).
    """

    tensors: tuple[int, ...]
    bytes_: np.ndarray          # int64 [n]
    time_s: np.ndarray          # float64 [n]
    recomputable: np.ndarray    # bool [n]
    fixed_bytes: int
    const_peak_bytes: int
    prefix: np.ndarray          # int64 [n+1]: prefix[i+1] = bytes of a_0..a_i
    fwd_full: np.ndarray        # forward op i with a_{i-1} recomputed: a_{i-1} + a_i + workspace
    fwd_first: np.ndarray       # forward op i with a_{i-1} kept (its bytes are in S): a_i + workspace
    bwd_step: np.ndarray        # backward step i: prefix(i-1) + grads + its allocation + workspace (+a_{n-1})
    replay: np.ndarray          # replay of op q: prefix(q) + workspace
    grads_before: np.ndarray    # gradient bytes live before backward step i
    unit_gcd: int               # gcd of every byte figure in the costs (exact memory unit)

    @property
    def n(self) -> int:
        return len(self.tensors)

    def run_costs(self, k: int) -> np.ndarray:
        """``C(k, k')`` for ``k' = k+1 .. n``: the peak bytes (beyond ``F + S(k)``) of the run of
        recomputed ops ``k+1 .. k'-1`` between kept ``a_k`` and kept ``a_k'`` (``k' = n``: none kept above):
        forward ops ``k+1 .. k'``, backward steps ``k+1 .. k'`` and the replay of the run at step
        ``min(k', n-1)``. ``_NEG_BYTES`` where nothing is constrained."""
        n = self.n
        lo = k + 1
        kp = np.arange(lo, n + 1)
        out = np.full(len(kp), _NEG_BYTES, dtype=np.int64)
        if lo >= n:
            return out
        hi = np.minimum(kp, n - 1) - lo                      # last op index of each pair, relative to lo
        f = self.fwd_full[lo:n].copy()
        f[0] = self.fwd_first[lo]
        pk = self.prefix[lo]                                  # prefix(k)
        fwd = np.maximum.accumulate(f)[hi]
        bwd = np.maximum.accumulate(self.bwd_step[lo:n])[hi] - pk
        out = np.maximum(out, np.maximum(fwd, bwd))
        # replay of ops lo .. min(k'-1, n-1), at step s = min(k', n-1); needs a non-empty run (k' >= k+2)
        if len(kp) > 1:
            top = np.minimum(kp[1:] - 1, n - 1) - lo
            s = np.minimum(kp[1:], n - 1)
            extra = np.where(kp[1:] == n - 1, self.bytes_[n - 1], 0)   # a_{n-1} kept: resident at that replay
            rep = np.maximum.accumulate(self.replay[lo:n])[top] - pk + self.grads_before[s] + extra
            out[1:] = np.maximum(out[1:], rep)
        return out


def _op_chain(graph: Graph) -> _OpChain | None:
    """The chain model of ``graph`` when it has linear_chain's shape (module docstring), else None."""
    ops, tensors = graph.ops, graph.tensors
    n = len(ops)
    if n == 0 or sum(t.kind == "activation" for t in tensors) != n:
        return None
    outs: list[int] = []
    for op in ops:
        if len(op.outputs) != 1:
            return None
        info = tensors[op.outputs[0]]
        if info.kind != "activation" or info.held_by_caller:
            return None
        outs.append(info.id)
    for i, op in enumerate(ops):
        acts_in = {t for t in op.inputs if tensors[t].kind == "activation"}
        if acts_in != ({outs[i - 1]} if i else set()):
            return None
        saved = {t for t in op.saved if tensors[t].kind == "activation"}
        want = ({outs[i - 1]} if i else set()) | ({outs[i]} if i == n - 1 else set())
        if saved != want:
            return None
        freed = tensors[outs[i]].freed_after
        if freed is not None and freed > min(i + 1, n - 1):
            return None
    return _model(
        tensors=tuple(outs), bytes_=[tensors[t].bytes for t in outs], time_s=[op.time_s for op in ops],
        recomputable=[tensors[t].recomputable for t in outs], ws=[op.workspace_bytes for op in ops],
        bws=[op.backward_workspace_bytes for op in ops], alloc=[op.backward_grad_alloc_bytes for op in ops],
        free=[op.backward_grad_free_bytes for op in ops], fixed=graph.fixed.resident_bytes,
        optimizer_bytes=graph.fixed.optimizer_step_bytes)


def _model(*, tensors, bytes_, time_s, recomputable, ws, bws, alloc, free, fixed: int,
           optimizer_bytes: int) -> _OpChain:
    n = len(bytes_)
    b = np.asarray(bytes_, dtype=np.int64)
    ws_, bws_ = np.asarray(ws, dtype=np.int64), np.asarray(bws, dtype=np.int64)
    alloc_, free_ = np.asarray(alloc, dtype=np.int64), np.asarray(free, dtype=np.int64)
    net = alloc_ - free_
    grads_before = np.concatenate([np.cumsum(net[::-1])[::-1][1:], [0]]).astype(np.int64)
    prefix = np.concatenate([[0], np.cumsum(b)]).astype(np.int64)
    fwd_full = ws_ + b + np.concatenate([[0], b[:-1]])
    fwd_first = ws_ + b
    bwd_step = prefix[:n] + grads_before + alloc_ + bws_
    bwd_step[n - 1] += b[n - 1]
    if n > 1:
        bwd_step[0] = _NEG_BYTES   # op 0's backward reads no activation: a constant peak
    replay = prefix[1:] + ws_
    const = max(fixed, fixed + int(grads_before[0] + net[0]) + optimizer_bytes)
    if n > 1:
        const = max(const, fixed + int(grads_before[0] + alloc_[0] + bws_[0]))
    figures = [int(x) for x in np.concatenate([b, ws_, bws_, alloc_, free_]) if x] + [fixed]
    g = reduce(math.gcd, figures, 0) or 1
    return _OpChain(tuple(tensors), b, np.asarray(time_s, dtype=np.float64), np.asarray(recomputable, dtype=bool),
                    fixed, const, prefix, fwd_full, fwd_first, bwd_step, replay, grads_before, g)


# ---- the DP engines: an exact grid, an exact Pareto frontier, a rounded grid -----------------------------
# Every engine answers for every spare memory up to the one it was built for, and its answer at a spare
# ``s`` does not depend on how far above ``s`` it was built: solving at one budget and reading a frontier
# built for a larger one give the same plan by construction (``dp_frontier`` and ``solve`` share this path).
_GRID_CELLS = 12_000_000     # exact grid (memory unit = gcd of the chain's byte figures) up to this many cells
_PARETO_POINTS = 20_000_000  # exact Pareto frontiers while merging at most this many (memory, time) points
_ROUNDED_UNITS = 1_500       # otherwise memory in at most this many units, rounded up (sound), per row


class _Engine:
    """One DP over a chain, read at any spare memory ``s`` (bytes beyond the fixed memory) up to the spare
    it was built for: :meth:`saved_time_s` is the most forward time saved by keeping activations (None if
    no plan fits), :meth:`kept` the kept elements of such a plan. ``exact``: the answer is the optimum under
    the chain model; otherwise memory was rounded up (the plan still fits) and ``lower`` (a table rounded
    down) bounds the saved time from above."""

    exact: bool
    kind: str

    def saved_time_s(self, spare: int) -> float | None:
        raise NotImplementedError

    def kept(self, spare: int) -> list[int]:
        raise NotImplementedError

    def min_spare_bytes(self) -> int | None:
        """The least spare memory at which some plan fits (exact engines), None if none does."""
        raise NotImplementedError

    def breakpoints(self) -> list[int]:
        """The spares (ascending) at which the optimum changes: the first that fits and each better one."""
        raise NotImplementedError


def _candidates(ch: _OpChain, k: int, first_fixed: int) -> tuple[np.ndarray, np.ndarray]:
    """(``k'``, ``C(k, k')`` in bytes, 0 where unconstrained) for the runs above kept ``k`` that recompute
    only recomputable elements."""
    costs = np.maximum(ch.run_costs(k)[: first_fixed - k], 0)
    return np.arange(k + 1, k + 1 + len(costs)), costs


_GROUP = 32  # rows per group in _Windows


class _Windows:
    """Maxima of the rows of ``E`` over windows ``lo .. hi`` (a different ``hi`` for each column), for a
    table filled from its last row up. Rows fall in groups of ``_GROUP``: a window is the rest of its first
    group (a running maximum kept while filling), whole groups between (a sparse table over group maxima)
    and the start of its last group (prefix maxima within each completed group): O(columns) per query
    instead of O(rows x columns)."""

    def __init__(self, E: np.ndarray):
        self.E = E
        n1, M1 = E.shape
        self.P = np.full_like(E, -np.inf)                # prefix maxima within each group
        groups = -(-n1 // _GROUP)
        self.levels = max(1, groups.bit_length())
        self.GS = np.full((self.levels, groups, M1), -np.inf)
        self.head = np.full(M1, -np.inf)                # max of rows lo .. end of lo's group
        self.lo = n1

    def filled(self, i: int) -> None:
        """Row ``i`` is final (rows are filled from the last one down)."""
        E, G = self.E, _GROUP
        g = i // G
        same = i + 1 < E.shape[0] and (i + 1) // G == g
        self.head = np.maximum(E[i], self.head) if same else E[i].copy()
        self.lo = i
        if i % G == 0:   # the group is complete
            end = min(i + G, E.shape[0])
            np.maximum.accumulate(E[i:end], axis=0, out=self.P[i:end])
            self.GS[0, g] = self.P[end - 1]
            for lv in range(1, self.levels):
                half = 1 << (lv - 1)
                if g + 2 * half > self.GS.shape[1]:
                    break
                np.maximum(self.GS[lv - 1, g], self.GS[lv - 1, g + half], out=self.GS[lv, g])

    def query(self, hi: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """``max(E[lo .. hi[c], c])`` for each column ``c`` in ``cols``, where ``hi[c]`` lies beyond the group
        of ``lo`` (the last row filled)."""
        G = _GROUP
        out = np.maximum(self.head[cols], self.P[hi, cols])
        a = self.lo // G + 1
        b = hi // G - 1
        mid = b >= a
        if mid.any():
            c, bm = cols[mid], b[mid]
            length = bm - a + 1
            lv = np.floor(np.log2(length)).astype(np.int64)
            m = np.maximum(self.GS[lv, a, c], self.GS[lv, bm - (1 << lv) + 1, c])
            out[mid] = np.maximum(out[mid], m)
        return out


def _window_max(W: _Windows, ks: np.ndarray, th: np.ndarray, M: int, low: np.ndarray) -> np.ndarray:
    """``D[r] = max over j with th[j] <= r of E[ks[j], r]`` (``-inf`` where none), for the consecutive rows
    ``ks`` starting at the last row filled. Rows are taken in threshold order up to the running maximum of
    the thresholds (a window per column), the few below it (stragglers) one by one."""
    E = W.E
    D = np.full(M + 1, -np.inf)
    if not len(ks):
        return D
    k0 = int(ks[0])
    hull = np.maximum.accumulate(th)
    for j in np.nonzero(th < hull)[0].tolist():   # stragglers: below a longer run's threshold
        s = max(int(th[j]), int(low[k0 + j]))
        if s <= M:
            np.maximum(D[s:], E[k0 + j, s:], out=D[s:])
    # windows within lo's group: at most _GROUP rows, one by one over the columns where they end there
    m = min(len(ks), _GROUP - k0 % _GROUP)
    lim = int(hull[m]) if m < len(ks) else M + 1
    for j in range(m):
        s = max(int(hull[j]), int(low[k0 + j]))
        if s < lim:
            np.maximum(D[s:lim], E[k0 + j, s:lim], out=D[s:lim])
    if lim <= M:
        cols = np.arange(lim, M + 1)
        hi = k0 - 1 + np.searchsorted(hull, cols, side="right")
        np.maximum(D[lim:], W.query(hi, cols), out=D[lim:])
    return D


class _Grid(_Engine):
    """Memory in units of ``unit`` bytes (sizes rounded up, or down with ``round_down``), ``M`` units at
    most. ``E[k'][r]`` = ``t_k' + D[k'][r - b_k']`` (row ``n``: 0, the end): the most time saved by the
    suffix from kept ``k'`` on with ``r`` units; ``D_top[r]`` = ``D[-1][r]`` (the input kept, nothing else
    yet). ``D[k][r] = max over k' with C(k, k') <= r of E[k'][r]``."""

    kind = "grid"

    def __init__(self, ch: _OpChain, unit: int, M: int, *, round_down: bool = False, exact: bool = True,
                 deadline: float | None = None):
        self.ch, self.unit, self.M, self.exact = ch, unit, M, exact
        n = ch.n
        self.units = (ch.bytes_ // unit) if round_down else -(-ch.bytes_ // unit)
        E = np.full((n + 1, M + 1), -np.inf)
        E[n] = 0.0
        W = _Windows(E)
        W.filled(n)
        low = np.zeros(n + 1, dtype=np.int64)   # the first finite column of each row of E
        self.succ: list[tuple[np.ndarray, np.ndarray]] = [None] * (n + 1)  # type: ignore[list-item]
        first_fixed = n
        D = np.full(M + 1, -np.inf)
        for k in range(n - 1, -2, -1):
            _check_deadline(deadline)
            ks, costs = _candidates(ch, k, first_fixed)
            th = (costs // unit) if round_down else -(-costs // unit)
            fits = th <= M
            ks, th = ks[fits], th[fits]
            self.succ[k + 1] = (ks, th)
            D = _window_max(W, ks, th, M, low)
            if k >= 0:
                b = int(self.units[k])
                finite = np.nonzero(D > -np.inf)[0]
                if b <= M and finite.size and finite[0] + b <= M:
                    E[k, b:] = ch.time_s[k] + D[: M + 1 - b]
                    low[k] = finite[0] + b
                else:
                    low[k] = M + 1
                W.filled(k)
                if not ch.recomputable[k]:
                    first_fixed = k
        self.E, self.D_top = E, D

    def _r(self, spare: int) -> int:
        return min(spare // self.unit, self.M)

    def saved_time_s(self, spare: int) -> float | None:
        if spare < 0:
            return None
        v = self.D_top[self._r(spare)]
        return None if v == -np.inf else float(v)

    def kept(self, spare: int) -> list[int]:
        r, k, kept = self._r(spare), -1, []
        while True:
            ks, th = self.succ[k + 1]
            ok = ks[th <= r]
            nxt = int(ok[int(np.argmax(self.E[ok, r]))])
            if nxt == self.ch.n:
                return kept
            kept.append(nxt)
            r -= int(self.units[nxt])
            k = nxt

    def min_spare_bytes(self) -> int | None:
        finite = np.nonzero(self.D_top > -np.inf)[0]
        return int(finite[0]) * self.unit if finite.size else None

    def breakpoints(self) -> list[int]:
        d = self.D_top
        better = np.nonzero((d > -np.inf) & (d > np.concatenate([[-np.inf], d[:-1]])))[0]
        return [int(r) * self.unit for r in better]


class _TooLarge(Exception):
    pass


class _OutOfTime(Exception):
    """A table was still being filled at its ``deadline``."""


def _check_deadline(deadline: float | None) -> None:
    if deadline is not None and time.perf_counter() > deadline:
        raise _OutOfTime


class _Pareto(_Engine):
    """Exact in bytes: ``F[k]`` lists the non-dominated (memory requirement ``R``, time saved ``V``) of the
    suffixes above kept ``k`` (``R`` and ``V`` both strictly increasing), ``R <= spare``; each point keeps
    the ``k'`` it continues with and the index of its point in ``F[k']``. ``F[k]`` is the Pareto merge over
    ``k'`` of ``(max(C(k, k'), b_k' + R), t_k' + V)`` for ``(R, V)`` in ``F[k']`` (``k' = n``: ``(0, 0)``).
    Raises ``_TooLarge`` once more than ``max_points`` points have been merged in all."""

    kind = "pareto"
    exact = True

    def __init__(self, ch: _OpChain, spare: int, max_points: int, deadline: float | None = None):
        n = ch.n
        self.ch = ch
        # per row k' (n: the end): the E-frontier (b_k' + R, t_k' + V) and its back pointers
        ER: list[np.ndarray] = [None] * (n + 1)  # type: ignore[list-item]
        EV: list[np.ndarray] = [None] * (n + 1)  # type: ignore[list-item]
        ER[n], EV[n] = np.zeros(1, np.int64), np.zeros(1)
        self.back: list[tuple[np.ndarray, np.ndarray]] = [None] * (n + 1)  # type: ignore[list-item]
        total = 0
        first_fixed = n
        for k in range(n - 1, -2, -1):
            _check_deadline(deadline)
            ks, costs = _candidates(ch, k, first_fixed)
            rs, vs, bk, bi = [], [], [], []
            for kp, c in zip(ks.tolist(), costs.tolist(), strict=True):
                if c > spare or ER[kp] is None or not ER[kp].size:
                    continue
                r_, v_ = ER[kp], EV[kp]
                cut = int(np.searchsorted(r_, c, side="right"))   # points at or below C collapse onto C
                start = max(cut - 1, 0)
                r = np.maximum(r_[start:], c)
                keep = r <= spare
                total += int(keep.sum())
                if total > max_points:
                    raise _TooLarge
                rs.append(r[keep])
                vs.append(v_[start:][keep])
                bk.append(np.full(int(keep.sum()), kp, dtype=np.int64))
                bi.append(np.arange(start, start + len(r), dtype=np.int64)[keep])
            if rs:
                R, V, K, Ix = (np.concatenate(x) for x in (rs, vs, bk, bi))
                order = np.lexsort((-V, R))
                R, V, K, Ix = R[order], V[order], K[order], Ix[order]
                best_before = np.concatenate([[-np.inf], np.maximum.accumulate(V)[:-1]])
                front = V > best_before
                R, V, K, Ix = R[front], V[front], K[front], Ix[front]
            else:
                R, V, K, Ix = (np.zeros(0, np.int64), np.zeros(0), np.zeros(0, np.int64), np.zeros(0, np.int64))
            self.back[k + 1] = (K, Ix)
            if k >= 0:
                ER[k], EV[k] = R + int(ch.bytes_[k]), V + ch.time_s[k]
                if not ch.recomputable[k]:
                    first_fixed = k
        self.R_top, self.V_top = R, V

    def _point(self, spare: int) -> int | None:
        i = int(np.searchsorted(self.R_top, spare, side="right")) - 1
        return i if i >= 0 else None

    def saved_time_s(self, spare: int) -> float | None:
        i = self._point(spare)
        return None if i is None else float(self.V_top[i])

    def kept(self, spare: int) -> list[int]:
        i, row, kept = self._point(spare), 0, []
        while True:
            K, Ix = self.back[row]
            kp, i = int(K[i]), int(Ix[i])
            if kp == self.ch.n:
                return kept
            kept.append(kp)
            row = kp + 1

    def min_spare_bytes(self) -> int | None:
        return int(self.R_top[0]) if len(self.R_top) else None

    def breakpoints(self) -> list[int]:
        return [int(r) for r in self.R_top]


def _full_spare(ch: _OpChain) -> int:
    """Spare memory at which keeping everything fits (the top of every chain's frontier)."""
    keep_all = int(ch.prefix[-1]) + max(0, int(ch.fwd_first.max()), int(ch.bwd_step.max()))
    return keep_all


def _engine(ch: _OpChain, spare: int, deadline: float | None = None) -> _Engine:
    """The exact grid when its table is small enough, else the exact Pareto frontier, else a grid with
    memory rounded up to a unit chosen from the chain alone (so every budget reads the same table).
    Raises ``_OutOfTime`` when a table is still being filled at ``deadline`` (a ``time.perf_counter()``
    value; None: none)."""
    spare = min(spare, _full_spare(ch))
    g = ch.unit_gcd
    if (ch.n + 1) * (spare // g + 1) <= _GRID_CELLS:
        return _Grid(ch, g, spare // g, deadline=deadline)
    try:
        return _Pareto(ch, spare, _PARETO_POINTS, deadline)
    except _TooLarge:
        pass
    unit = g * max(1, -(-(_full_spare(ch) // g) // _ROUNDED_UNITS))
    return _Grid(ch, unit, spare // unit, exact=False, deadline=deadline)


def _chain_actions(ch: _OpChain, kept: list[int]) -> Actions:
    keep = set(kept)
    return {t: Action.RECOMPUTE for i, t in enumerate(ch.tensors) if i not in keep}


@dataclass
class _ChainSolution:
    actions: Actions
    time_s: float
    status: str
    lower_bound_s: float | None
    stats: dict


def _read(graph: Graph, ch: _OpChain, engine: _Engine, budget: int, base_s: float) -> _ChainSolution | None:
    """The engine's plan at ``budget`` (None: none fits). A rounded engine's plan is ``feasible`` with a
    bound from the same table rounded down (``optimal`` when both agree)."""
    spare = budget - ch.fixed_bytes
    if budget < ch.const_peak_bytes or spare < 0:
        return None
    saved = engine.saved_time_s(spare)
    if saved is None:
        return None
    total = float(ch.time_s.sum())
    time_s = base_s + total - saved
    kept = engine.kept(spare)
    stats = {"engine": engine.kind, "exact_memory": engine.exact, "kept": len(kept)}
    if isinstance(engine, _Grid):
        stats["unit_bytes"] = engine.unit
    if engine.exact:
        return _ChainSolution(_chain_actions(ch, kept), time_s, "optimal", time_s, stats)
    low = _Grid(ch, engine.unit, engine.M, round_down=True, exact=False).saved_time_s(spare)
    bound = base_s + total - (low if low is not None else saved)
    status = "optimal" if bound >= time_s * (1 - 1e-12) else "feasible"
    return _ChainSolution(_chain_actions(ch, kept), time_s, status, min(bound, time_s), stats)


def _solve_op_chain(graph: Graph, ch: _OpChain, budget: int) -> _ChainSolution | None:
    """The chain DP at one budget: exact (``optimal``) unless memory had to be rounded."""
    return _read(graph, ch, _engine(ch, budget - ch.fixed_bytes), budget, keep_all_report(graph).time_s)


def chain_min_budget_bytes(graph: Graph, *, deadline: float | None = None) -> int | None:
    """The least budget at which a keep / recompute plan of ``graph`` fits, exactly, when ``graph`` is a
    chain the DP solves exactly (module docstring); None otherwise, and when the DP's table is not filled
    by ``deadline`` (a ``time.perf_counter()`` value; None: none)."""
    ch = _op_chain(graph)
    if ch is None:
        return None
    try:
        engine = _engine(ch, _full_spare(ch), deadline)
    except _OutOfTime:
        return None
    if not engine.exact:
        return None
    low = engine.min_spare_bytes()
    return None if low is None else max(ch.const_peak_bytes, ch.fixed_bytes + low)


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
    if _op_chain(graph) is not None:
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


def _stage_model(graph: Graph, stages: _Stages, elements: list[tuple[int, tuple[int, ...]]]) -> _OpChain:
    """The chain model of the elements, as if each were one linear_chain op producing its tensors (its
    stage's time to recompute, its stage's workspace and gradients on the stage's first element): an
    approximation on a DAG, used to rank stage plans that the simulator then scores."""
    ops, tensors = graph.ops, graph.tensors
    first = {s: i for i, (s, _) in reversed(list(enumerate(elements)))}

    def per_stage(i: int, s: int, value: int) -> int:
        return value if first[s] == i else 0

    return _model(
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
    try:
        from memplan.solvers.every_k import every_k_search
    except ImportError:
        pass
    else:
        for b in budgets:
            scorer.add(every_k_search(graph, b)[1], "every-k")
    for split in (False, True):
        elements = _elements(graph, stages, split)
        if elements:
            _element_candidates(graph, scorer, budgets, deadline, elements, _stage_model(graph, stages, elements))


def _element_candidates(graph: Graph, scorer: _Scorer, budgets: list[int], deadline: float,
                        elements: list[tuple[int, tuple[int, ...]]], model: _OpChain) -> None:
    """Score the stage model's plans at 49 of its breakpoints (the spares where its optimum changes),
    then, per budget, bisect between the last level that fits in the simulator and the next."""
    engine = _engine(model, _full_spare(model))
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
    ch = _op_chain(graph)
    if ch is not None and not offload:
        sol = _solve_op_chain(graph, ch, budget_bytes)
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
            sol = _solve_op_chain(graph, ch, b)
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
    from memplan.solvers.bounds import memory_lower_bound

    base = keep_all_report(graph).time_s
    budgets = list(budgets)
    if not budgets:
        return []
    floor = memory_lower_bound(graph)
    ch = _op_chain(graph)
    out: list[tuple[int, float | None]] = []
    if ch is not None:
        # the one table for the largest budget when it is exact (its answer at a smaller budget is then the
        # optimum there, as solve's own table gives); a rounded one's unit could differ from the table a
        # smaller budget gets, so then each budget is solved as solve solves it
        top = _engine(ch, max(budgets) - ch.fixed_bytes)
        for b in budgets:
            engine = top if top.exact else _engine(ch, b - ch.fixed_bytes)
            sol = _read(graph, ch, engine, b, base) if b >= floor else None
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
