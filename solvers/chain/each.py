"""The exact chain DP over keep / recompute / recompute_each: every plan the executor runs on a chain
without offload, optimised in exact bytes (Pareto step functions), for chains of up to
:data:`MAX_EACH_OPS` ops.

**What the simulator does on a chain** (the shape :func:`.model.op_chain` recognises; ``a_i`` made by op
``i``, read by op ``i+1``, needed by backward step ``i+1``). Let ``k < k'`` be consecutive kept activations
(``-1``: the input; ``k' = n``: ``a_{n-1}`` not kept) and ``e`` the target of the segment's first replay
(``k'-1``; ``n-2`` when ``k' = n``). Backward step ``k'`` finds ``a_e`` missing and replays ops ``k+1 .. e``
from ``a_k`` (``k' = n``: then op ``n-1`` for ``a_{n-1}``). A ``recompute`` tensor it re-creates stays
until its own backward (:func:`memplan.planner.core.replay.kept_by_replays`); a ``recompute_each`` one is
freed after its reader. So the segment's ``recompute`` tensors are *anchors* ``k = p_0 < p_1 < .. < p_m
< e``, and every ``recompute_each`` tensor ``j`` between anchors ``p < j < p'`` is replayed again, alone,
from ``a_p`` at step ``j+1`` (ops ``p+1 .. j``; nothing else between is resident). The target ``a_e`` (and
``a_{n-1}`` when ``k' = n``) is kept by its replay whatever its action: it counts as ``recompute``.

Memory beyond ``F + S(k)`` (fixed bytes, kept bytes up to ``k``), with ``base_l`` the anchors' bytes up to
``p_l``, is at most ``base_l`` plus, for the span ``(p_l, p_{l+1}]``:

* the first replay's ops ``q``: ``G(s) + X + fl(q, p_l)``, ``fl(q, p) = b_q + ws_q + (b_{q-1} if q-1 > p)``
  (``s = min(k', n-1)`` the replay's step, ``G`` the gradients live before it, ``X = b_{n-1}`` when the
  kept ``a_{n-1}`` is resident then);
* backward steps ``i``: ``bc(i) + (b_{i-1} if i-1 > p_l)`` (``bc``: gradients, allocation, workspace);
* the replay of each ``recompute_each`` ``j`` in the span: ``G(j+1) + max_{q in (p_l, j]} fl(q, p_l)``;

and forward op ``i`` of the segment costs ``fl(i, k)``. Step time is keep-everything's plus every replayed
op's cost (:func:`memplan.planner.core.schedule.replay_op_cost_s`), and the executor's watch of forward ops
(``graph.watch_op_dispatch_s``), which no DP term models: where that is not zero the DP's optimum is a
lower bound, not a claim.

**The DP**, three levels, each value a Pareto step function (memory requirement -> least extra time, in
bytes, clipped at the spare of the budget): for each ``k'``, ``Mid[p]`` (the part of the segment above
anchor ``p``) over the next anchor ``p'`` or the top; ``Seg(k, k') = Mid[k]`` with the forward and the first
replay; ``D[k]`` over the next kept ``k'`` of ``Seg(k, k') + D[k'](r - b_k')``. O(n^3) merges of frontiers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Action
from memplan.planner.core.schedule import replay_op_cost_s
from memplan.solvers.chain.model import NEG_BYTES, OpChain, op_chain
from memplan.solvers.chain.table import OutOfTime, check_deadline

#: the DP runs on chains of at most this many ops (O(n^3) frontier merges); longer chains get the keep /
#: recompute DP, and their results say so
MAX_EACH_OPS = 64
_MAX_POINTS = 50_000_000   # frontier points merged in all before the DP gives up (TooLarge)
_TOP = -2                 # Mid's owner of the point that ends the segment (no further anchor)

Front = tuple[np.ndarray, np.ndarray, np.ndarray]  # requirement (int64, ascending), time (descending), owner


class TooLarge(Exception):
    """The frontiers grew past ``_MAX_POINTS``."""


def _prune(req: np.ndarray, t: np.ndarray, owner: np.ndarray, limit: float) -> Front:
    """The non-dominated points with requirement at most ``limit``: requirement ascending, time strictly
    descending (ties: the first in the given order, so a larger table reads the same). The candidates
    come as a few runs already sorted by requirement (one per frontier they continue): a stable sort by
    requirement alone merges them fast."""
    fit = req <= limit
    req, t, owner = req[fit], t[fit], owner[fit]
    order = np.argsort(req, kind="stable")
    req, t, owner = req[order], t[order], owner[order]
    if len(t) > 1:
        before = np.concatenate([[np.inf], np.minimum.accumulate(t)[:-1]])
        keep = np.nonzero(t < before)[0]
        # of the kept points with one requirement (each faster than those before it), the last
        last = keep[np.append(req[keep[1:]] != req[keep[:-1]], True)]
        req, t, owner = req[last], t[last], owner[last]
    return req, t, owner


def _at(front: Front, r: float) -> int:
    """Index of the best point of ``front`` with requirement at most ``r`` (-1: none)."""
    return int(np.searchsorted(front[0], r, side="right")) - 1


@dataclass(frozen=True)
class Spans:
    """Per bottom ``p`` (row ``p+1``) and top ``h`` (column): the memory and time of a span ``(p, h]`` of
    ``recompute_each`` tensors (module docstring). ``NEG_BYTES`` where a maximum is over nothing."""

    fl: np.ndarray     # max_{q in (p, h]} fl(q, p): a replay (or forward) of ops p+1 .. h from a_p
    steps: np.ndarray  # max_{i in (p, h]} of backward step i's cost
    each: np.ndarray   # max_{j in (p, h)} of the lone replay of a_j at step j+1
    time: np.ndarray   # sum_{j in (p, h)} of that replay's time


def spans(ch: OpChain, cost_s: np.ndarray) -> Spans:
    """The :class:`Spans` of ``ch`` with ``cost_s[q]`` the time a replay of op ``q`` costs."""
    n = ch.n
    b, G = ch.bytes_, ch.grads_before
    bc = ch.bwd_step - ch.prefix[:n]
    bc[ch.bwd_step <= NEG_BYTES // 2] = NEG_BYTES
    C = np.concatenate([[0.0], np.cumsum(cost_s)])
    fl = np.full((n + 1, n), NEG_BYTES, np.int64)
    steps, each = fl.copy(), fl.copy()
    tm = np.zeros((n + 1, n))
    for p in range(-1, n - 1):
        lo = p + 1
        f = ch.fwd_full[lo:].copy()
        f[0] = ch.fwd_first[lo]
        fl[lo, lo:] = np.maximum.accumulate(f)
        s = bc[lo:].copy()
        s[1:] += b[lo:n - 1]
        steps[lo, lo:] = np.maximum.accumulate(s)
        if lo + 1 < n:  # j = lo .. n-2 alone, replayed at step j+1, ending spans h = j+1 ..
            each[lo, lo + 1:] = np.maximum.accumulate(G[lo + 1:] + fl[lo, lo:n - 1])
            tm[lo, lo + 1:] = np.cumsum(C[lo + 1:n] - C[lo])
    return Spans(fl, steps, each, tm)


@dataclass
class EachTable:
    """The DP filled up to one spare memory (module docstring), read at any spare up to it: the same
    answer as a table filled for that spare (clipping only drops points above it). ``D[k + 1]``: the
    frontier above kept ``k``; ``mid[k'][p + 1]``: the frontier of segment ``k'``'s part above anchor ``p``."""

    ch: OpChain
    D: list[Front]
    mid: list[dict[int, Front]]

    def extra_s(self, spare: float) -> float | None:
        """The least time over keep-everything's of a plan within ``spare`` (None: none fits)."""
        i = _at(self.D[0], spare)
        return None if i < 0 else float(self.D[0][1][i])

    def min_requirement(self) -> int | None:
        return int(self.D[0][0][0]) if len(self.D[0][0]) else None

    def actions(self, spare: float) -> dict[int, Action]:
        """The plan of the best point within ``spare`` (call only when :meth:`extra_s` is not None)."""
        ch, n, r, k = self.ch, self.ch.n, spare, -1
        out: dict[int, Action] = {}
        while k < n - 1:
            front = self.D[k + 1]
            kp = int(front[2][_at(front, r)])
            e, last = (kp - 1, kp - 1) if kp < n else (n - 2, n - 1)
            anchors: set[int] = set()
            p, rr = k, r
            while True:
                m = self.mid[kp][p + 1]
                nxt = int(m[2][_at(m, rr)])
                if nxt == _TOP:
                    break
                anchors.add(nxt)
                rr -= int(ch.bytes_[nxt])
                p = nxt
            for j in range(k + 1, last + 1):
                each = j < e and j not in anchors
                out[ch.tensors[j]] = Action.RECOMPUTE_EACH if each else Action.RECOMPUTE
            if kp == n:
                break
            r -= int(ch.bytes_[kp])
            k = kp
        return out


def each_table(graph: Graph, ch: OpChain, spare: float, *, times: bool = True,
               deadline: float | None = None) -> EachTable:
    """Fill the DP for spare memory ``spare`` (bytes beyond the fixed memory; ``inf``: unclipped). With
    ``times=False`` every op is free, so each frontier is one point: the least memory requirement. Raises
    ``OutOfTime`` past ``deadline`` and :class:`TooLarge` past ``_MAX_POINTS`` merged points."""
    n = ch.n
    cost = np.array([replay_op_cost_s(graph, op) for op in graph.ops]) if times else np.zeros(n)
    sp = spans(ch, cost)
    b, G = ch.bytes_, ch.grads_before
    C = np.concatenate([[0.0], np.cumsum(cost)])
    fixed = np.nonzero(~ch.recomputable)[0].tolist()
    merged = 0
    mid: list[dict[int, Front]] = [{} for _ in range(n + 1)]
    for kp in range(n + 1):
        if kp == n and not ch.recomputable[n - 1]:
            continue  # k' = n: a_{n-1} is rebuilt
        s, e = min(kp, n - 1), (kp - 1 if kp < n else n - 2)
        q_top = e if kp < n else n - 1           # the first replay's last op (with op n-1's replay)
        last = kp - 1 if kp < n else n - 1      # the last tensor the segment rebuilds
        lo = max([-1, *(z for z in fixed if z <= last)])
        if lo > e:
            continue
        lift = int(G[s]) + (int(b[n - 1]) if kp == n - 1 else 0)
        # the anchor pool: points of Mid[p'] for p' in (p, e), requirement lifted by b_p', in runs of
        # ascending p' (``owners``, ``counts``)
        pool_r, pool_t, pool_o = np.zeros(0, np.int64), np.zeros(0), np.zeros(0, np.int64)
        owners: list[int] = []
        counts: list[int] = []
        for p in range(e, lo - 1, -1):
            check_deadline(deadline)
            row = p + 1
            top_r = max(sp.steps[row, s], sp.each[row, e] if e > p else NEG_BYTES,
                        lift + sp.fl[row, q_top] if q_top > p else NEG_BYTES, 0)
            top_t = sp.time[row, e] if e > p else 0.0
            if len(pool_o):
                cols = np.array(owners)
                cost_r = np.maximum(np.maximum(lift + sp.fl[row, cols], sp.steps[row, cols]), sp.each[row, cols])
                req = np.concatenate([[top_r], np.maximum(pool_r, np.repeat(cost_r, counts))])
                tt = np.concatenate([[top_t], pool_t + np.repeat(sp.time[row, cols], counts)])
                ow = np.concatenate([[_TOP], pool_o])
            else:
                req, tt, ow = np.array([top_r], np.int64), np.array([top_t]), np.array([_TOP], np.int64)
            merged += len(req)
            if merged > _MAX_POINTS:
                raise TooLarge
            front = _prune(req, tt, ow, spare)
            mid[kp][row] = front
            if p > lo and p < e:  # an anchor for the spans below (p > lo: rebuildable)
                pool_r = np.concatenate([front[0] + b[p], pool_r])
                pool_t = np.concatenate([front[1], pool_t])
                pool_o = np.concatenate([np.full(len(front[0]), p, np.int64), pool_o])
                owners.insert(0, p)
                counts.insert(0, len(front[0]))
    D: list[Front] = [None] * (n + 1)  # type: ignore[list-item]
    D[n] = (np.zeros(1, np.int64), np.zeros(1), np.full(1, n, np.int64))  # above kept a_{n-1}: nothing
    for k in range(n - 2, -2, -1):
        check_deadline(deadline)
        rs, ts, os_ = [], [], []
        for kp in range(k + 1, n + 1):
            m = mid[kp].get(k + 1)
            if m is None or not len(m[0]):
                continue
            q_top = kp - 1 if kp < n else n - 1
            fwd = int(sp.fl[k + 1, min(kp, n - 1)])
            seg_r = np.maximum(m[0], fwd)
            seg_t = m[1] + (C[q_top + 1] - C[k + 1])
            if kp < n:
                nxt = D[kp + 1]
                if not len(nxt[0]):
                    continue
                seg_r, seg_t = _add(seg_r, seg_t, nxt[0] + b[kp], nxt[1])
            rs.append(seg_r)
            ts.append(seg_t)
            os_.append(np.full(len(seg_r), kp, np.int64))
            merged += len(seg_r)
        if merged > _MAX_POINTS:
            raise TooLarge
        D[k + 1] = _prune(np.concatenate(rs) if rs else np.zeros(0, np.int64),
                          np.concatenate(ts) if ts else np.zeros(0),
                          np.concatenate(os_) if os_ else np.zeros(0, np.int64), spare)
    return EachTable(ch, D, mid)


def _add(r1: np.ndarray, t1: np.ndarray, r2: np.ndarray, t2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The pointwise sum of two step functions (requirement -> time, requirements ascending): its points
    are at the union of their requirements (where both are defined)."""
    rs = np.union1d(r1, r2)
    i = np.searchsorted(r1, rs, side="right") - 1
    j = np.searchsorted(r2, rs, side="right") - 1
    ok = (i >= 0) & (j >= 0)
    return rs[ok], t1[i[ok]] + t2[j[ok]]


def each_min_budget_bytes(graph: Graph, ch: OpChain, *, deadline: float | None = None) -> int | None:
    """The least budget any plan without offload fits, exactly (the DP with every op free)."""
    low = each_table(graph, ch, float("inf"), times=False, deadline=deadline).min_requirement()
    return None if low is None else max(ch.const_peak_bytes, ch.fixed_bytes + low)


def chain_each_min_budget_bytes(graph: Graph, *, deadline: float | None = None) -> int | None:
    """:func:`each_min_budget_bytes` when ``graph`` is a chain of at most :data:`MAX_EACH_OPS` ops whose DP
    finishes by ``deadline``; None otherwise."""
    ch = op_chain(graph)
    if ch is None or ch.n > MAX_EACH_OPS:
        return None
    try:
        return each_min_budget_bytes(graph, ch, deadline=deadline)
    except (OutOfTime, TooLarge):
        return None
