"""The linear model the ILP is formulated in, independent of any backend: integer variables with bounds
(binary or not), rows ``lo <= sum(coef * var) <= hi`` with integer coefficients, and a linear objective
(:class:`LinearModel`); :class:`Expr` builds the rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import reduce


@dataclass
class LinearModel:
    """Variables (bounds, integrality), rows ``lo <= sum(coef * var) <= hi`` with integer coefficients,
    and an objective to minimise (integer coefficients plus a constant)."""

    lb: list[int] = field(default_factory=list)
    ub: list[int] = field(default_factory=list)
    binary: list[bool] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    rows: list[tuple[dict[int, int], int | None, int | None]] = field(default_factory=list)
    objective: dict[int, int] = field(default_factory=dict)
    timed: bool = False  # has big-M clock rows (offload timing): backends solve it with tighter settings

    def var(self, name: str, lb: int = 0, ub: int = 1, binary: bool = True) -> int:
        self.lb.append(lb)
        self.ub.append(ub)
        self.binary.append(binary)
        self.names.append(name)
        return len(self.lb) - 1

    def row(self, expr: Expr, lo: float | None = None, hi: float | None = None) -> None:
        """``lo <= expr <= hi`` (expr's constant moved to the bounds)."""
        terms = {v: c for v, c in expr.terms.items() if c != 0}
        lo2 = None if lo is None else math.ceil(lo - expr.const)
        hi2 = None if hi is None else math.floor(hi - expr.const)
        if not terms:
            if (lo2 is not None and lo2 > 0) or (hi2 is not None and hi2 < 0):
                raise ConstantlyViolated
            return
        self.rows.append((terms, lo2, hi2))

    def to_json(self) -> dict:
        return {"lb": self.lb, "ub": self.ub, "binary": self.binary,
                "rows": [[list(t.items()), lo, hi] for t, lo, hi in self.rows],
                "objective": list(self.objective.items()), "timed": self.timed}


class ConstantlyViolated(Exception):
    """A row without variables that can never hold: the budget is infeasible for every plan."""


class BuildOutOfTime(Exception):
    """The model was not built before the solve's deadline (large graphs with offload take seconds)."""


class Expr:
    """A linear expression with integer coefficients."""

    __slots__ = ("terms", "const")

    def __init__(self, terms: dict[int, int] | None = None, const: int = 0):
        self.terms = dict(terms or {})
        self.const = const

    @staticmethod
    def of(v: int | None, c: int = 1) -> Expr:
        return Expr({} if v is None else {v: c})

    def add(self, v: int | None, c: int = 1) -> Expr:
        if v is not None and c:
            self.terms[v] = self.terms.get(v, 0) + c
        return self

    def plus(self, other: Expr, c: int = 1) -> Expr:
        for v, k in other.terms.items():
            self.terms[v] = self.terms.get(v, 0) + c * k
        self.const += c * other.const
        return self

    def copy(self) -> Expr:
        return Expr(self.terms, self.const)


def lin(const: int = 0, *pairs: tuple[int | None, int]) -> Expr:
    e = Expr(const=const)
    for v, c in pairs:
        e.add(v, c)
    return e


def choose_unit(sizes: list[int], max_units: int) -> tuple[int, bool]:
    """The memory unit for a model whose byte figures are ``sizes``: their gcd when the total stays
    within ``max_units`` of it (then every figure is exact), else the total over ``max_units`` (figures
    are then rounded down by the caller: a relaxation). Returns (unit, every figure a multiple of it)."""
    scale = sum(sizes)
    exact_unit = reduce(math.gcd, [s for s in sizes if s], 0) or 1
    unit = exact_unit if scale // exact_unit <= max_units else -(-scale // max_units)
    return unit, all(x % unit == 0 for x in sizes)


def no_good(model: LinearModel, decision: list[int], values: list[int]) -> None:
    """A no-good row: forbid exactly this assignment of the (binary) decision variables."""
    terms: dict[int, int] = {}
    ones = 0
    for v in decision:
        if values[v]:
            terms[v] = -1
            ones += 1
        else:
            terms[v] = 1
    model.rows.append((terms, 1 - ones, None))
