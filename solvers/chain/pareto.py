"""The exact Pareto engine: per kept element the non-dominated (memory requirement, time saved) pairs in
bytes, for chains whose sizes share no useful gcd (GPU-scale tensors of odd sizes)."""

from __future__ import annotations

import numpy as np

from memplan.solvers.chain.model import OpChain
from memplan.solvers.chain.table import Engine, check_deadline, run_candidates


class TooLarge(Exception):
    pass


class Pareto(Engine):
    """Exact in bytes: ``F[k]`` lists the non-dominated (memory requirement ``R``, time saved ``V``) of the
    suffixes above kept ``k`` (``R`` and ``V`` both strictly increasing), ``R <= spare``; each point keeps
    the ``k'`` it continues with and the index of its point in ``F[k']``. ``F[k]`` is the Pareto merge over
    ``k'`` of ``(max(C(k, k'), b_k' + R), t_k' + V)`` for ``(R, V)`` in ``F[k']`` (``k' = n``: ``(0, 0)``).
    Raises ``TooLarge`` once more than ``max_points`` points have been merged in all."""

    kind = "pareto"
    exact = True

    def __init__(self, ch: OpChain, spare: int, max_points: int, deadline: float | None = None):
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
            check_deadline(deadline)
            ks, costs = run_candidates(ch, k, first_fixed)
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
                    raise TooLarge
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
