"""Settings of the REST service: limits, the worker pool and the plan cache.

Built by the caller and handed to :func:`memplan.api.app.create_app`; nothing is read at import time.
:meth:`Settings.from_env` reads ``MEMPLAN_*`` variables for deployments that configure by environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

from memplan.planner.core.errors import MemplanError


def default_cache_path() -> str:
    """``$XDG_CACHE_HOME/memplan/plans.sqlite`` (``~/.cache/...`` when unset): where ``memplan serve``
    keeps its plan cache unless told otherwise."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(root) / "memplan" / "plans.sqlite")


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Every knob of the service, with the limit it enforces and the status a request over it gets."""

    cache_path: str = ":memory:"
    """Where the plan cache lives: a SQLite file (``":memory:"`` keeps it for the life of the process
    only), or a ``postgresql://user@host:port/dbname`` URL: a store several replicas share (they then
    solve a request once, and answer each other's jobs). ``MEMPLAN_CACHE_URL`` sets it too. Any other
    ``scheme://`` is refused."""
    workers: int = 2
    """Solves that run at once (worker processes or threads); more requests wait in a queue."""
    pool: Literal["process", "thread"] = "process"
    """``process``: solves run in worker processes, so a pure-Python solver never holds the server's GIL.
    ``thread``: in threads of the server process (CP-SAT and HiGHS release the GIL; cheaper to start)."""
    max_queue: int = 64
    """Requests allowed to wait for a worker; more get 503 with Retry-After."""
    parse_workers: int = 1
    """Processes that parse and validate request bodies (a maximal body takes seconds; the event loop
    never does it). With ``pool="thread"``, threads."""
    parse_timeout_s: float = 60.0
    """How long reading one body may take before its parse worker is stopped (503)."""
    queue_timeout_s: float = 30.0
    """How long a request waits for a free worker; past it, 503 with Retry-After."""
    worker_memory_bytes: int = 4 * 2**30
    """Address space a worker process may use (``RLIMIT_AS``); a solve that needs more (the DP's table on
    a long chain) gets 422 naming this limit and its worker is replaced. 0: no cap."""
    max_body_bytes: int = 32 * 2**20
    """Largest request body; a larger one gets 413 naming this limit."""
    max_ops: int = 20_000
    """Largest graph (ops) the service plans; a larger one gets 422 naming this limit."""
    max_time_limit_s: float = 120.0
    """Largest ``time_limit_s`` a request may ask for (for a frontier: all its solves together); more
    gets 422 naming this limit."""
    default_time_limit_s: float = 30.0
    """``time_limit_s`` of a request that gives none (capped by ``max_time_limit_s``)."""
    grace_s: float = 5.0
    """How long past its time limit a job may run (simulation, the minimum-budget search of an
    infeasible answer) before it is stopped and answered 504. With process workers, the worker is then
    killed and replaced, so no request holds a worker longer than its limit plus this; a thread worker
    cannot be stopped and stays busy until its job returns."""
    max_frontier_points: int = 64
    """Most (budget, solver) pairs one frontier request may ask for."""
    cache_max_bytes: int = 256 * 2**20
    """Size the plan cache file may reach; past it the least recently used plans are evicted. 0: no cap."""
    lease_s: float = 10.0
    """Shared store: a replica renews its lease on a solve or a job every third of this; one that stops
    (killed, cut off) loses it this long after, and another replica takes the work over."""
    job_ttl_s: float = 3600.0
    """How long a finished job's answer stays readable at ``GET /v1/jobs/{id}`` (then 404)."""
    store_timeout_s: float = 2.0
    """Shared store: how long an operation waits for the database before the service goes on without it
    (a cache read becomes a solve; ``/healthz`` says ``degraded``)."""
    token: str = ""
    """When set, every route but ``/healthz`` requires ``Authorization: Bearer <token>`` (401 without)."""
    allowed_hosts: str = ""
    """Comma-separated ``Host`` header values accepted (Starlette's trusted-host check, against DNS
    rebinding); ``*`` accepts any. Empty: loopback names (127.0.0.1, localhost, ::1) when the server
    binds a loopback address, any host otherwise (see :meth:`hosts_for`)."""

    def __post_init__(self) -> None:
        for name in ("workers", "parse_workers"):
            if getattr(self, name) < 1:
                raise MemplanError(f"settings: {name} must be >= 1, got {getattr(self, name)}")
        if self.pool not in ("process", "thread"):
            raise MemplanError(f"settings: pool must be 'process' or 'thread', got {self.pool!r}")
        for name in ("max_queue", "max_body_bytes", "max_ops", "max_frontier_points", "worker_memory_bytes",
                     "cache_max_bytes"):
            if getattr(self, name) < 0:
                raise MemplanError(f"settings: {name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_time_limit_s", "default_time_limit_s", "grace_s", "queue_timeout_s",
                     "parse_timeout_s", "lease_s", "job_ttl_s", "store_timeout_s"):
            if not getattr(self, name) > 0:
                raise MemplanError(f"settings: {name} must be > 0 seconds, got {getattr(self, name)}")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings from ``MEMPLAN_<FIELD>`` variables (e.g. ``MEMPLAN_MAX_OPS=5000``), then ``overrides``."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        if env.get("MEMPLAN_CACHE_URL"):  # the name a database URL is looked for under
            values["cache_path"] = env["MEMPLAN_CACHE_URL"]
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

    def time_limit_s(self, requested_s: float | None, *, solves: int = 1) -> float:
        """Seconds per solve: the request's (already checked against ``max_time_limit_s`` by the
        request model), or the default shared out between ``solves``."""
        if requested_s is not None:
            return requested_s
        return min(self.default_time_limit_s, self.max_time_limit_s / solves)

    def hosts_for(self, bind_host: str) -> list[str]:
        """The ``Host`` values to accept for a server bound to ``bind_host``: ``allowed_hosts`` when
        given; else the loopback names for a loopback bind (a web page's DNS rebinding cannot reach it),
        else any."""
        if self.allowed_hosts.strip():
            return [h.strip() for h in self.allowed_hosts.split(",") if h.strip()]
        if is_loopback(bind_host):
            return ["127.0.0.1", "localhost", "::1", "[::1]"]
        return ["*"]


def is_loopback(host: str) -> bool:
    """``127.0.0.1``, ``::1``, ``localhost``: addresses only this machine can reach."""
    import ipaddress

    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
