"""Parsing and printing of byte sizes and budgets at the edges (CLI, REST). Inside, budgets are bytes."""

import math
import re

from memplan.planner.errors import MemplanError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """``"6GiB"`` -> 6442450944, ``"512MB"`` -> 512000000, ``"1234"`` -> 1234."""
    m = _SIZE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise MemplanError(f"cannot read size {text!r}: expected a number with an optional unit "
                           f"(B, KB, MB, GB, KiB, MiB, GiB), e.g. '6GiB' or '512MB'")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(value) or value > 2**62:
        raise MemplanError(f"size {text!r} is too large")
    return int(round(value))


def parse_budget(text: str | int | float, *, activation_bytes: int | None = None,
                 fixed_bytes: int = 0) -> int:
    """A budget in bytes from ``"6GiB"``, ``"512MB"``, a plain byte count, or ``"50%"``.

    A percentage is of the keep-everything *activation* memory (``activation_bytes``: the peak of the
    keep-all plan minus the fixed memory); the fixed memory (parameters, gradients, optimizer state,
    inputs) is added back, so ``"100%"`` is the keep-all peak.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise MemplanError(f"budget must not be negative, got {text}")
        return int(text)
    s = str(text).strip()
    if s.endswith("%"):
        try:
            frac = float(s[:-1]) / 100.0
        except ValueError:
            raise MemplanError(f"cannot read budget {text!r}: expected e.g. '50%'") from None
        if not (math.isfinite(frac) and 0.0 <= frac <= 10.0):
            raise MemplanError(f"budget percentage {text!r} is out of range (0% to 1000%)")
        if activation_bytes is None:
            raise MemplanError(f"budget {text!r} is a percentage, but no graph is at hand to take it of")
        return int(fixed_bytes + frac * activation_bytes)
    value = parse_bytes(s)
    if value < 0:
        raise MemplanError(f"budget must not be negative, got {text!r}")
    return value


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.50 KiB'``."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
