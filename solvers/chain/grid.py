"""The byte grid engine: the DP table over memory in units of ``unit`` bytes (the gcd of the chain's
figures: exact; or a coarser unit, sizes rounded up: sound), with the window maxima that make a row cost
O(columns)."""

from __future__ import annotations

import numpy as np

from memplan.solvers.chain.model import OpChain
from memplan.solvers.chain.table import Engine, check_deadline, run_candidates

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


class Grid(Engine):
    """Memory in units of ``unit`` bytes (sizes rounded up, or down with ``round_down``), ``M`` units at
    most. ``E[k'][r]`` = ``t_k' + D[k'][r - b_k']`` (row ``n``: 0, the end): the most time saved by the
    suffix from kept ``k'`` on with ``r`` units; ``D_top[r]`` = ``D[-1][r]`` (the input kept, nothing else
    yet). ``D[k][r] = max over k' with C(k, k') <= r of E[k'][r]``."""

    kind = "grid"

    def __init__(self, ch: OpChain, unit: int, M: int, *, round_down: bool = False, exact: bool = True,
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
            check_deadline(deadline)
            ks, costs = run_candidates(ch, k, first_fixed)
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
