"""What every chain DP engine answers (:class:`Engine`), the runs it chooses between
(:func:`run_candidates`), and the deadline a table is filled under.

Every engine answers for every spare memory up to the one it was built for, and its answer at a spare
``s`` does not depend on how far above ``s`` it was built: solving at one budget and reading a frontier
built for a larger one give the same plan by construction (``dp_frontier`` and ``solve`` share this path).
"""

from __future__ import annotations

import time

import numpy as np

from memplan.solvers.chain.model import OpChain


class Engine:
    """One DP over a chain, read at any spare memory ``s`` (bytes beyond the fixed memory) up to the spare
    it was built for: :meth:`saved_time_s` is the most replay time saved by keeping activations (None if
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


def run_candidates(ch: OpChain, k: int, first_fixed: int) -> tuple[np.ndarray, np.ndarray]:
    """(``k'``, ``C(k, k')`` in bytes, 0 where unconstrained) for the runs above kept ``k`` that recompute
    only recomputable elements."""
    costs = np.maximum(ch.run_costs(k)[: first_fixed - k], 0)
    return np.arange(k + 1, k + 1 + len(costs)), costs


class OutOfTime(Exception):
    """A table was still being filled at its ``deadline``."""


def check_deadline(deadline: float | None) -> None:
    if deadline is not None and time.perf_counter() > deadline:
        raise OutOfTime


def full_spare(ch: OpChain) -> int:
    """Spare memory at which keeping everything fits (the top of every chain's frontier)."""
    keep_all = int(ch.prefix[-1]) + max(0, int(ch.fwd_first.max()), int(ch.bwd_step.max()))
    return keep_all
