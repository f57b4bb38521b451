"""Parsing and printing of byte sizes and budgets at the edges (CLI, REST). Inside, budgets are bytes."""

import math
import re
from collections.abc import Callable

from memplan.planner.core.errors import MemplanError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")

MAX_BYTES = 2**50
"""The largest byte count memplan reads (1 PiB): a size, a budget or a tensor beyond it is a mistake, and
sums of a graph's sizes must stay well inside 64-bit integers (the solvers' arrays)."""
MAX_BUDGET_FRACTION = 10.0
"""The largest percentage budget is 1000% of the keep-everything activation memory."""


def parse_bytes(text: str) -> int:
    """``"6GiB"`` -> 6442450944, ``"512MB"`` -> 512000000, ``"1234"`` -> 1234."""
    m = _SIZE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise MemplanError(f"cannot read size {text!r}: expected a number with an optional unit "
                           f"(B, KB, MB, GB, KiB, MiB, GiB), e.g. '6GiB' or '512MB'")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(value) or value > MAX_BYTES:
        raise MemplanError(f"size {text!r} is too large: memplan reads sizes up to 2^50 bytes (1 PiB)")
    return int(round(value))


def parse_budget(value: str | int, *, activation_bytes: int | Callable[[], int] | None = None,
                 fixed_bytes: int = 0) -> int:
    """A budget in bytes from ``"6GiB"``, ``"512MB"``, a byte count (an int or its digits), or ``"50%"``:
    the one parser of budgets, for the CLI, the REST service and the distributed launcher.

    A percentage is of the keep-everything *activation* memory (``activation_bytes``: the peak of the
    keep-all plan minus the fixed memory, or a function computing it, called only for a percentage); the
    fixed memory (parameters, gradients, optimizer state, inputs) is added back, so ``"100%"`` is the
    keep-all peak. Raises :class:`MemplanError` naming the value: unreadable, negative, over
    :data:`MAX_BYTES`, a percentage out of 0-1000%, or a percentage with no graph to take it of.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise MemplanError(f"budget {value!r}: expected bytes (an integer) or a string such as '6GiB' or '50%'")
    if isinstance(value, int):
        if not 0 <= value <= MAX_BYTES:
            raise MemplanError(f"budget {value} is out of range: 0 to 2^50 bytes (1 PiB)")
        return value
    frac = budget_fraction(value)
    if frac is None:
        return parse_bytes(value)
    if activation_bytes is None:
        raise MemplanError(f"budget {value!r} is a percentage, but no graph is at hand to take it of")
    activation = activation_bytes() if callable(activation_bytes) else activation_bytes
    return int(fixed_bytes + frac * activation)


def budget_fraction(text: str) -> float | None:
    """``"50%"`` -> 0.5; None when ``text`` is not a percentage. Raises :class:`MemplanError` for an
    unreadable percentage or one outside 0-1000%."""
    s = text.strip()
    if not s.endswith("%"):
        return None
    try:
        frac = float(s[:-1]) / 100.0
    except ValueError:
        raise MemplanError(f"cannot read budget {text!r}: expected e.g. '50%'") from None
    if not (math.isfinite(frac) and 0.0 <= frac <= MAX_BUDGET_FRACTION):
        raise MemplanError(f"budget percentage {text!r} is out of range (0% to 1000%)")
    return frac


def check_budget(value: str | int) -> None:
    """Raise :class:`MemplanError` unless ``value`` reads as a budget (:func:`parse_budget`); a
    percentage is checked for its range only (no graph is needed)."""
    if isinstance(value, str) and budget_fraction(value) is not None:
        return
    parse_budget(value)


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.50 KiB'``."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
