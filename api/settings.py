"""Settings of the REST service: limits, the worker pool and the plan cache.

Built by the caller and handed to :func:`memplan.api.app.create_app`; nothing is read at import time.
:meth:`Settings.from_env` reads ``MEMPLAN_*`` variables for deployments that configure by environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

from memplan.planner.errors import MemplanError


def default_cache_path() -> str:
    """``$XDG_CACHE_HOME/memplan/plans.sqlite`` (``~/.cache/...`` when unset): where ``memplan serve``
    keeps its plan cache unless told otherwise."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(root) / "memplan" / "plans.sqlite")


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Every knob of the service, with the limit it enforces and the status a request over it gets."""

    cache_path: str = ":memory:"
    """SQLite file of the plan cache; ``":memory:"`` keeps it for the life of the process only."""
    workers: int = 2
    """Solves that run at once (worker processes or threads); more requests wait in a queue."""
    pool: Literal["process", "thread"] = "process"
    """``process``: solves run in worker processes, so a pure-Python solver never holds the server's GIL.
    ``thread``: in threads of the server process (CP-SAT and HiGHS release the GIL; cheaper to start)."""
    max_queue: int = 64
    """Requests allowed to wait for a worker; more get 503 with Retry-After."""
    max_body_bytes: int = 32 * 2**20
    """Largest request body; a larger one gets 413 naming this limit."""
    max_ops: int = 20_000
    """Largest graph (ops) the service plans; a larger one gets 422 naming this limit."""
    max_time_limit_s: float = 120.0
    """Largest ``time_limit_s`` a request may ask for (for a frontier: all its solves together); more
    gets 422 naming this limit."""
    default_time_limit_s: float = 30.0
    """``time_limit_s`` of a request that gives none (capped by ``max_time_limit_s``)."""
    grace_s: float = 10.0
    """How long past its time limit a solve may run (simulation, the minimum-budget search of an
    infeasible answer) before the request is answered 504; the worker stays busy until it ends."""
    max_frontier_points: int = 64
    """Most (budget, solver) pairs one frontier request may ask for."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise MemplanError(f"settings: workers must be >= 1, got {self.workers}")
        if self.pool not in ("process", "thread"):
            raise MemplanError(f"settings: pool must be 'process' or 'thread', got {self.pool!r}")
        for name in ("max_queue", "max_body_bytes", "max_ops", "max_frontier_points"):
            if getattr(self, name) < 0:
                raise MemplanError(f"settings: {name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_time_limit_s", "default_time_limit_s", "grace_s"):
            if not getattr(self, name) > 0:
                raise MemplanError(f"settings: {name} must be > 0 seconds, got {getattr(self, name)}")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings from ``MEMPLAN_<FIELD>`` variables (e.g. ``MEMPLAN_MAX_OPS=5000``), then ``overrides``."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(f"MEMPLAN_{f.name.upper()}")
            if raw is None:
                continue
            kind = type(getattr(cls(), f.name))
            try:
                values[f.name] = kind(raw)
            except ValueError:
                raise MemplanError(f"settings: MEMPLAN_{f.name.upper()}={raw!r} is not a {kind.__name__}") from None
        return replace(cls(**values), **overrides)

    def effective_time_limit_s(self, requested_s: float | None) -> float:
        return self.default_time_limit_s if requested_s is None else requested_s
