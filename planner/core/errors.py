"""memplan's domain errors: one small hierarchy, each message naming the culprit.

The CLI and the REST service map these to exit codes / HTTP statuses in one place each; anything else
that escapes is a bug.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError


class MemplanError(Exception):
    """Base class of every error memplan raises on purpose."""


class MemplanWarning(UserWarning):
    """Something the user should know that does not stop the work (the CLI prints it as one line)."""


class GraphError(MemplanError):
    """A graph file or object is malformed: a cycle, a dangling edge, a negative size, a bad version..."""


class PlanError(MemplanError):
    """A plan file or object is malformed or inconsistent with the graph it claims to be for."""


class PlanMismatch(PlanError):
    """A plan was made for another graph or model (its fingerprint differs)."""


class Infeasible(MemplanError):
    """No plan fits the budget. ``min_feasible_bytes`` is the smallest budget known to be feasible."""

    def __init__(self, message: str, *, budget_bytes: int | None = None, min_feasible_bytes: int | None = None):
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_feasible_bytes = min_feasible_bytes


class WorkloadError(MemplanError):
    """A workload spec (built-in name or ``file.py:function``) cannot be loaded or does not return
    ``(model, example_batch, loss_fn)``."""


class SolverUnavailable(MemplanError):
    """An optional solver backend is not installed; the message says what to install."""


def first_validation_error(e: ValidationError) -> str:
    """The first problem of a pydantic ``ValidationError`` as one line, ``"field.path: message"``: what a
    graph or plan file's loader reports (the one culprit, not pydantic's full listing)."""
    err = e.errors(include_url=False)[0]
    loc = ".".join(str(p) for p in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    return f"{loc}: {msg}" if loc else msg
