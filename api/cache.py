"""The plan cache: SQLite (embedded, no server to run), one row per solved request; a team's replicas
share one in PostgreSQL instead (:mod:`memplan.api.pgcache`, same keys, same answers), and
:func:`memplan.api.store.open_cache` picks the backend from the location given (:func:`cache_backend`).

A row is keyed by :func:`plan_key`: a hash of the graph's full content, the budget as given, the solver
and its settings, what decides what a solver name means (memplan's version, the registered solvers) and
the key's version (:data:`PLAN_KEY_VERSION`).
The graph's structural ``fingerprint`` alone would not do: it leaves out the op times, so a re-profiled
graph with other timings would be served a plan optimised for the old ones. The fingerprint is stored
beside the key for inspection.

Only complete answers are stored (status ``optimal`` or ``feasible``): a ``timeout`` answer depends on
how busy the machine was, so the next identical request solves again.

The cache looks after itself: a file that is not a readable SQLite database (garbage, cut short, a
damaged header) is moved aside with a warning and a fresh one is started; past ``max_bytes`` of stored
answers the least recently used are evicted. Each row carries the sha256 of its answer: a row whose answer
does not match it, or whose status is not a complete one (damaged, or written by something else), is
skipped and counted (``skipped``), never served.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from memplan.planner.core.errors import MemplanError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS plans (
    key TEXT PRIMARY KEY,
    graph_fingerprint TEXT NOT NULL,
    solver TEXT NOT NULL,
    status TEXT NOT NULL,
    response TEXT NOT NULL,
    created_at REAL NOT NULL,
    used_at REAL NOT NULL DEFAULT 0,
    checksum TEXT
)
"""
_EVICT_TO = 0.9  # evicting stops at this share of max_bytes, so that not every put evicts

CACHEABLE_STATUSES = ("optimal", "feasible")

log = logging.getLogger("memplan.api")


def content_hash(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


PLAN_KEY_VERSION = 2
"""Part of every plan key (and of the shared store's body keys): bumped when the same request comes to
deserve another answer within one memplan version, so that no answer stored before is served after.
2: answers carry ``state_summary``, and ``offload`` (``states`` absent) moves model states too."""


def plan_key(*, graph_sha256: str, budget: int | str | None, solver: str, time_limit_s: float, offload: bool,
             host_budget: int | str | None, context: str, budget_fraction: float | None = None,
             fuse: str | None = None, states: str | None = None) -> str:
    """The cache key of a plan request. ``budget`` is taken as given (``"50%"`` and the same number of
    bytes are two keys, both correct); ``context`` names memplan's version and the registered solvers.
    ``states`` too is as given: absent (follow ``offload``) and the value it follows are two keys."""
    norm = [b.strip() if isinstance(b, str) else b for b in (budget, host_budget)]
    body = {"graph": graph_sha256, "budget": norm[0], "host_budget": norm[1], "solver": solver,
            "time_limit_s": float(time_limit_s), "offload": bool(offload), "context": context,
            "version": PLAN_KEY_VERSION}
    # The optional fields only when given: within a key version, adding one leaves the others' keys alone.
    if budget_fraction is not None:
        body["budget_fraction"] = float(budget_fraction)
    if fuse is not None:
        body["fuse"] = fuse
    if states is not None:
        body["states"] = states
    return content_hash(json.dumps(body, sort_keys=True, separators=(",", ":")))


class CacheError(MemplanError):
    """The plan cache cannot be opened or created (its folder is not writable, it is a folder), or its
    location is not one memplan understands (a URL scheme it does not know)."""


def servable(text: str | None, status: str, checksum: str | None) -> bool:
    """Whether a stored row may be served: a complete status and an answer whose sha256 is the one
    written with it (a row without one, from a cache written before checksums, must at least be a JSON
    object's text)."""
    if text is None or status not in CACHEABLE_STATUSES:
        return False
    if checksum is None:
        return text.startswith("{") and text.endswith("}")
    return content_hash(text) == checksum


_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


def redact(location: str) -> str:
    """``location`` with a URL's password replaced by ``***`` (for messages and ``/healthz``)."""
    return re.sub(r"^([A-Za-z][A-Za-z0-9+.\-]*://[^:/@]*):[^@/]*@", r"\1:***@", location)


def cache_backend(location: str) -> tuple[str, str]:
    """``("sqlite", path)`` or ``("postgresql", url)`` for a cache location: a file path, ``":memory:"``,
    ``sqlite:///abs/path``, or ``postgresql://`` (``postgres://``) URL. Any other ``scheme://`` is refused
    (:class:`CacheError`), never taken as a path."""
    m = _URL.match(location)
    if m is None:
        return "sqlite", location
    scheme = m.group(1).lower()
    if scheme in ("postgresql", "postgres"):
        return "postgresql", location
    if scheme == "sqlite" and location[len("sqlite://"):].startswith("/"):
        return "sqlite", location[len("sqlite://"):]
    raise CacheError(f"plan cache {redact(location)!r}: unknown scheme {scheme!r}; give a SQLite file path, "
                     f"':memory:', sqlite:///absolute/path or a postgresql://user@host:port/dbname URL")


class PlanCache:
    """Response JSON text by key. Safe to share between threads; several processes may share a file.

    ``max_bytes`` (0: no cap) bounds the stored answers' text; past it the least recently used go.
    Raises :class:`CacheError` when ``path`` cannot be opened or created at all.
    """

    shared = False
    """One server's cache: replicas do not coordinate through it (:mod:`memplan.api.pgcache` does)."""
    available = True
    error: str | None = None

    def __init__(self, path: str = ":memory:", *, max_bytes: int = 0):
        if path != ":memory:":
            path = str(Path(path).expanduser())
        self.path = path
        self.max_bytes = max_bytes
        self.skipped = 0
        """Rows found damaged or foreign (not served)."""
        self._lock = threading.Lock()
        try:
            self._db = self._open()
        except sqlite3.DatabaseError as e:  # garbage, cut short, a damaged header: start afresh
            aside = self._move_aside(e)
            log.warning("plan cache %s is not a readable SQLite database (%s); moved it to %s and started "
                        "a fresh one", path, e, aside)
            self._db = self._open()

    def _open(self) -> sqlite3.Connection:
        if self.path != ":memory:":
            target = Path(self.path)
            if target.is_dir():
                raise CacheError(f"plan cache {self.path} is a folder; give a file path (or ':memory:')")
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise CacheError(f"cannot create the plan cache's folder {target.parent}: {e.strerror}") from None
        try:
            db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=5.0)
        except sqlite3.OperationalError as e:
            raise CacheError(f"cannot open plan cache {self.path}: {e}") from None
        try:
            if self.path != ":memory:":
                # WAL: readers do not wait for a writer; NORMAL sync is durable enough for a cache.
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=NORMAL")
                if db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
                    raise sqlite3.DatabaseError("quick_check found damage")
            db.execute(_SCHEMA)
            columns = {row[1] for row in db.execute("PRAGMA table_info(plans)")}
            if "used_at" not in columns:  # a cache written before eviction existed
                db.execute("ALTER TABLE plans ADD COLUMN used_at REAL NOT NULL DEFAULT 0")
            if "checksum" not in columns:  # ... before checksums
                db.execute("ALTER TABLE plans ADD COLUMN checksum TEXT")
        except sqlite3.OperationalError as e:
            db.close()
            if "unable to open" in str(e) or "readonly" in str(e):
                raise CacheError(f"cannot open plan cache {self.path}: {e}") from None
            raise sqlite3.DatabaseError(str(e)) from None
        except sqlite3.DatabaseError:
            db.close()
            raise
        return db

    def _move_aside(self, why: Exception) -> str:
        if self.path == ":memory:":
            raise CacheError(f"in-memory plan cache failed: {why}")
        aside = f"{self.path}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}"
        try:
            os.replace(self.path, aside)
            for suffix in ("-wal", "-shm"):  # SQLite's side files belong to the damaged database
                if os.path.exists(self.path + suffix):
                    os.replace(self.path + suffix, aside + suffix)
        except OSError as e:
            raise CacheError(f"plan cache {self.path} is damaged ({why}) and cannot be moved aside: "
                             f"{e.strerror}") from None
        return aside

    def describe(self) -> str:
        return self.path

    def get(self, key: str) -> str | None:
        """The stored response text, or None (also when the database cannot be read: a cache that fails
        costs a solve, never an answer; and for a damaged or foreign row, counted in ``skipped``)."""
        try:
            with self._lock:
                row = self._db.execute("SELECT response, status, checksum FROM plans WHERE key = ?",
                                       (key,)).fetchone()
                if row is not None and self.max_bytes:  # recency, for eviction
                    self._db.execute("UPDATE plans SET used_at = ? WHERE key = ?", (time.time(), key))
        except sqlite3.Error as e:
            log.warning("plan cache %s: read failed (%s); solving instead", self.path, e)
            return None
        if row is None:
            return None
        if not servable(*row):
            self.skipped += 1
            log.warning("plan cache %s: row %s is damaged or foreign (status %r); skipped, solving instead",
                        self.path, key[:12], row[1])
            return None
        return row[0]

    def put(self, key: str, response: dict[str, Any], *, text: str | None = None) -> bool:
        """Store ``response`` (a ``PlanResponse`` without ``cache_hit``) unless its status is not
        cacheable; returns whether it was stored. ``text``: the response's JSON text as it is to be served
        (default: ``response`` dumped); :meth:`get` returns it unchanged."""
        status = response["solver"]["status"]
        if status not in CACHEABLE_STATUSES:
            return False
        if text is None:
            text = json.dumps(response, separators=(",", ":"), allow_nan=False)
        try:
            with self._lock:
                now = time.time()
                self._db.execute(
                    "INSERT OR REPLACE INTO plans (key, graph_fingerprint, solver, status, response, created_at, "
                    "used_at, checksum) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (key, response["graph_fingerprint"], response["solver"]["name"], status, text, now, now,
                     content_hash(text)))
                if self.max_bytes:
                    self._evict()
        except sqlite3.Error as e:  # full disk, a locked file: the answer still goes out, uncached
            log.warning("plan cache %s: write failed (%s); answer not cached", self.path, e)
            return False
        return True

    def _evict(self) -> None:
        """Delete the least recently used answers until the stored text is within ``max_bytes`` (to
        ``_EVICT_TO`` of it, so that the next puts do not each evict). Called with the lock held."""
        stored = self._db.execute("SELECT COALESCE(SUM(LENGTH(response)), 0) FROM plans").fetchone()[0]
        if stored <= self.max_bytes:
            return
        target = int(self.max_bytes * _EVICT_TO)
        rows = self._db.execute("SELECT key, LENGTH(response) FROM plans ORDER BY used_at ASC").fetchall()
        doomed = []
        for key, size in rows:
            if stored <= target:
                break
            doomed.append((key,))
            stored -= size
        self._db.executemany("DELETE FROM plans WHERE key = ?", doomed)
        log.info("plan cache %s: evicted %d least recently used plans (max_bytes %d)", self.path, len(doomed),
                 self.max_bytes)

    def stored_bytes(self) -> int:
        """The stored answers' text, in bytes (what ``max_bytes`` bounds)."""
        with self._lock:
            return self._db.execute("SELECT COALESCE(SUM(LENGTH(response)), 0) FROM plans").fetchone()[0]

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM plans").fetchone()[0]

    def clear(self) -> None:
        with self._lock:
            self._db.execute("DELETE FROM plans")

    def close(self) -> None:
        with self._lock:
            self._db.close()
