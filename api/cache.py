"""The plan cache: SQLite (embedded, no server to run), one row per solved request.

A row is keyed by :func:`plan_key`: a hash of the graph's full content, the budget as given, the solver
and its settings, and what decides what a solver name means (memplan's version, the registered solvers).
The graph's structural ``fingerprint`` alone would not do: it leaves out the op times, so a re-profiled
graph with other timings would be served a plan optimised for the old ones. The fingerprint is stored
beside the key for inspection.

Only complete answers are stored (status ``optimal`` or ``feasible``): a ``timeout`` answer depends on
how busy the machine was, so the next identical request solves again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS plans (
    key TEXT PRIMARY KEY,
    graph_fingerprint TEXT NOT NULL,
    solver TEXT NOT NULL,
    status TEXT NOT NULL,
    response TEXT NOT NULL,
    created_at REAL NOT NULL
)
"""

CACHEABLE_STATUSES = ("optimal", "feasible")

log = logging.getLogger("memplan.api")


def content_hash(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


def plan_key(*, graph_sha256: str, budget: int | str | None, solver: str, time_limit_s: float, offload: bool,
             host_budget: int | str | None, context: str, budget_fraction: float | None = None) -> str:
    """The cache key of a plan request. ``budget`` is taken as given (``"50%"`` and the same number of
    bytes are two keys, both correct); ``context`` names memplan's version and the registered solvers."""
    norm = [b.strip() if isinstance(b, str) else b for b in (budget, host_budget)]
    body = {"graph": graph_sha256, "budget": norm[0], "host_budget": norm[1], "solver": solver,
            "time_limit_s": float(time_limit_s), "offload": bool(offload), "context": context}
    if budget_fraction is not None:  # only when given: keys of requests without it stay as they were
        body["budget_fraction"] = float(budget_fraction)
    return content_hash(json.dumps(body, sort_keys=True, separators=(",", ":")))


class PlanCache:
    """Response JSON text by key. Safe to share between threads; several processes may share a file."""

    def __init__(self, path: str = ":memory:"):
        if path != ":memory:":
            Path(path).expanduser().parent.mkdir(parents=True, exist_ok=True)
            path = str(Path(path).expanduser())
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=5.0)
        if path != ":memory:":
            # WAL: readers do not wait for a writer; NORMAL sync is durable enough for a cache.
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(_SCHEMA)

    def get(self, key: str) -> str | None:
        """The stored response text, or None (also when the database cannot be read: a cache that fails
        costs a solve, never an answer)."""
        try:
            with self._lock:
                row = self._db.execute("SELECT response FROM plans WHERE key = ?", (key,)).fetchone()
        except sqlite3.Error as e:
            log.warning("plan cache %s: read failed (%s); solving instead", self.path, e)
            return None
        return row[0] if row else None

    def put(self, key: str, response: dict[str, Any]) -> bool:
        """Store ``response`` (a ``PlanResponse`` without ``cache_hit``) unless its status is not
        cacheable; returns whether it was stored."""
        status = response["solver"]["status"]
        if status not in CACHEABLE_STATUSES:
            return False
        text = json.dumps(response, separators=(",", ":"), allow_nan=False)
        try:
            with self._lock:
                self._db.execute(
                    "INSERT OR REPLACE INTO plans (key, graph_fingerprint, solver, status, response, created_at) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (key, response["graph_fingerprint"], response["solver"]["name"], status, text, time.time()))
        except sqlite3.Error as e:  # full disk, a locked file: the answer still goes out, uncached
            log.warning("plan cache %s: write failed (%s); answer not cached", self.path, e)
            return False
        return True

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM plans").fetchone()[0]

    def clear(self) -> None:
        with self._lock:
            self._db.execute("DELETE FROM plans")

    def close(self) -> None:
        with self._lock:
            self._db.close()
