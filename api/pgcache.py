"""The plan store a team's replicas share: the plan cache in PostgreSQL, and what lets several ``memplan
serve`` processes solve a request once and answer each other's jobs.

Three tables (``memplan_schema`` holds their version; :data:`MIGRATIONS` brings an older store up to date,
under an advisory lock, so replicas starting together migrate once):

* ``memplan_plans``: the plan cache, keyed and answered exactly as the SQLite one
  (:func:`memplan.api.cache.plan_key`, the same response text), with the same size bound and
  least-recently-used eviction;
* ``memplan_solves``: one row per request being solved: the replica that ``owner``-s it holds a lease
  (``expires_at``) that it renews while it solves (:meth:`PostgresPlanCache.renew`); the others wait for its
  answer (``done``, kept ``retain_s``: an answer the cache does not keep, a timeout or a refusal, is shared
  with the identical requests that arrive meanwhile), or take the solve over once the lease has expired
  (its replica died);
* ``memplan_jobs``: ``POST /v1/jobs``'s jobs, with their request, so that any replica can answer for them,
  and adopt one whose replica died;
* ``memplan_bodies``: the request bodies seen (their hash, scoped to the settings that decide a body's key)
  and the plan each asks for, so that a replica answers bytes another replica read from the cache without
  reading them.

Times are the database's clock (``clock_timestamp()``), so replicas' clocks need not agree.

The database may go away and come back: every operation that cannot reach it raises
:class:`StoreUnavailable` inside and marks the store unavailable (``available``, ``error``); the cache then
answers misses (a solve), its writes and the jobs' answers wait in a bounded queue and are retried, and
:meth:`PostgresPlanCache.tick` (the service calls it every few seconds) reconnects with a fresh pool.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from memplan.api.cache import CACHEABLE_STATUSES, CacheError, content_hash, redact, servable
from memplan.api.errors import StoreUnavailable
from memplan.api.jobstore import JobRow, SolveState

log = logging.getLogger("memplan.api")

_NOW = "extract(epoch from clock_timestamp())::double precision"
_EVICT_TO = 0.9  # as the SQLite cache: evicting stops at this share of max_bytes
_PENDING_MAX = 1024  # writes kept for retry while the database is away; the oldest go first
_LOCK_ID = 0x6D656D706C616E  # "memplan": the advisory lock migrations and eviction take

MIGRATIONS: list[list[str]] = [
    [  # 1: the plan cache, as the SQLite one
        """CREATE TABLE IF NOT EXISTS memplan_plans (
            key TEXT PRIMARY KEY,
            graph_fingerprint TEXT NOT NULL,
            solver TEXT NOT NULL,
            status TEXT NOT NULL,
            response TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            used_at DOUBLE PRECISION NOT NULL DEFAULT 0)""",
    ],
    [  # 2: checksums and sizes on the cache's rows; solves in flight; jobs
        "ALTER TABLE memplan_plans ADD COLUMN checksum TEXT",
        "ALTER TABLE memplan_plans ADD COLUMN size_bytes BIGINT",
        "UPDATE memplan_plans SET size_bytes = octet_length(response)",
        "ALTER TABLE memplan_plans ALTER COLUMN size_bytes SET NOT NULL",
        "CREATE INDEX memplan_plans_used_at ON memplan_plans (used_at)",
        """CREATE TABLE memplan_solves (
            key TEXT PRIMARY KEY,
            owner TEXT NOT NULL,
            expires_at DOUBLE PRECISION NOT NULL,
            done BOOLEAN NOT NULL DEFAULT false,
            status_code INTEGER,
            answer BYTEA)""",
        """CREATE TABLE memplan_jobs (
            id TEXT PRIMARY KEY,
            plan_key TEXT NOT NULL,
            request BYTEA NOT NULL,
            time_limit_s DOUBLE PRECISION NOT NULL,
            owner TEXT NOT NULL,
            expires_at DOUBLE PRECISION NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            adopted INTEGER NOT NULL DEFAULT 0,
            done BOOLEAN NOT NULL DEFAULT false,
            status_code INTEGER,
            answer BYTEA,
            finished_at DOUBLE PRECISION)""",
        "CREATE INDEX memplan_jobs_open ON memplan_jobs (expires_at) WHERE NOT done",
        """CREATE TABLE memplan_bodies (
            body_key TEXT PRIMARY KEY,
            plan_key TEXT NOT NULL)""",
    ],
]
SCHEMA_VERSION = len(MIGRATIONS)
TABLES = ("memplan_schema", "memplan_plans", "memplan_solves", "memplan_jobs", "memplan_bodies")
"""Every table the store is made of (all named ``memplan_*``: a database may hold other things)."""

T = TypeVar("T")


class PostgresPlanCache:
    """The plan cache and the replicas' coordination in one PostgreSQL database (``url``: a libpq URL,
    ``postgresql://user[:password]@host:port/dbname``). Safe to share between threads.

    Never raises for a database it cannot reach: it starts (or goes) unavailable and reconnects in
    :meth:`tick`. Raises :class:`CacheError` for a URL libpq cannot read, or a store written by a newer
    memplan (a schema version past :data:`SCHEMA_VERSION`).
    """

    shared = True

    def __init__(self, url: str, *, max_bytes: int = 0, store_timeout_s: float = 2.0, pool_size: int = 4,
                 retain_s: float = 30.0):
        import psycopg

        try:
            params = psycopg.conninfo.conninfo_to_dict(url)
        except psycopg.ProgrammingError as e:
            raise CacheError(f"plan store {redact(url)}: not a PostgreSQL URL libpq can read ({e})") from None
        if not all(p.strip().isdigit() for p in str(params.get("port", "5432")).split(",")):
            raise CacheError(f"plan store {redact(url)}: port {params['port']!r} is not a number")
        self.url = url
        self.max_bytes = max_bytes
        self.store_timeout_s = store_timeout_s
        self.pool_size = pool_size
        self.retain_s = retain_s
        self.touch_every_s = 10.0
        """A hit records its recency (for eviction) only when the last was longer ago than this: a hit is
        then a read, not a write the database must flush, and eviction's order is right to this much."""
        self.skipped = 0
        """Rows found damaged or foreign (not served)."""
        self.error: str | None = "not connected yet"
        """Why the store is unavailable now (None: it is available)."""
        self._pool: Any = None
        self._lock = threading.Lock()  # guards _pool and _pending
        self._pending: collections.deque[tuple[str, tuple[Any, ...]]] = collections.deque(maxlen=_PENDING_MAX)
        self._connect()

    # ---- connection --------------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        return self.error is None

    def describe(self) -> str:
        return redact(self.url)

    def _connect(self) -> bool:
        """A fresh pool and the schema brought up to date; False (and ``error`` set) when the database
        cannot be reached."""
        import psycopg
        from psycopg_pool import ConnectionPool, PoolTimeout

        try:  # one direct connection first: a pool would retry in the background for minutes
            with psycopg.connect(self.url, connect_timeout=max(1, round(self.store_timeout_s)),
                                 autocommit=True) as conn:
                self._migrate(conn)
        except (psycopg.OperationalError, PoolTimeout) as e:
            self._unavailable(e)
            return False
        except psycopg.Error as e:  # reached, but refused: no right to create the tables, say
            raise CacheError(f"plan store {redact(self.url)}: cannot set up memplan's tables: "
                             f"{' '.join(str(e).split())}") from None
        pool = ConnectionPool(self.url, min_size=1, max_size=self.pool_size, open=False, name="memplan-store",
                              timeout=self.store_timeout_s, kwargs={"autocommit": True, "connect_timeout": max(
                                  1, round(self.store_timeout_s))})
        try:
            pool.open(wait=True, timeout=self.store_timeout_s + 1)
        except PoolTimeout as e:
            pool.close(timeout=0)
            self._unavailable(e)
            return False
        with self._lock:
            old, self._pool = self._pool, pool
        if old is not None:
            old.close(timeout=0)
        if self.error is not None and self.error != "not connected yet":
            log.warning("plan store %s is reachable again", redact(self.url))
        self.error = None
        return True

    def _unavailable(self, e: BaseException) -> None:
        reason = " ".join(str(e).split()) or type(e).__name__
        if self.error is None or self.error == "not connected yet":
            log.warning("plan store %s unreachable (%s): cache reads solve instead, writes are retried",
                        redact(self.url), reason)
        self.error = f"unreachable: {reason}"
        with self._lock:  # its workers would retry in the background for minutes: tick() reconnects instead
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close(timeout=0)

    def _migrate(self, conn: Any) -> None:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_ID,))
            conn.execute("CREATE TABLE IF NOT EXISTS memplan_schema (version INTEGER NOT NULL)")
            row = conn.execute("SELECT version FROM memplan_schema").fetchone()
            version = 0 if row is None else row[0]
            if version > SCHEMA_VERSION:
                raise CacheError(f"plan store {redact(self.url)} has schema version {version}, written by a newer "
                                 f"memplan (this one knows up to {SCHEMA_VERSION}); upgrade memplan")
            for step in MIGRATIONS[version:]:
                for statement in step:
                    conn.execute(statement)
            if row is None:
                conn.execute("INSERT INTO memplan_schema (version) VALUES (%s)", (SCHEMA_VERSION,))
            elif version < SCHEMA_VERSION:
                conn.execute("UPDATE memplan_schema SET version = %s", (SCHEMA_VERSION,))
                log.info("plan store %s: schema migrated from version %d to %d", redact(self.url), version,
                         SCHEMA_VERSION)

    @contextmanager
    def _conn(self) -> Iterator[Any]:
        """A pooled connection; raises :class:`StoreUnavailable` (and marks the store so) when the
        database cannot be reached."""
        import psycopg

        pool = self._pool
        if pool is None or self.error is not None:
            raise StoreUnavailable(f"the plan store is {self.error}")
        try:
            with pool.connection() as conn:
                yield conn
        except psycopg.Error as e:  # unreachable, or a table gone: degraded until tick() sets it up again
            self._unavailable(e)
            raise StoreUnavailable(f"the plan store is {self.error}") from None

    def _run(self, fn: Callable[[Any], T]) -> T:
        """``fn(connection)``, once more on a fresh connection if the first was broken (the server was
        restarted since it was opened: the pool drops broken connections)."""
        import psycopg

        pool = self._pool
        if pool is None or self.error is not None:
            raise StoreUnavailable(f"the plan store is {self.error}")
        try:
            with pool.connection() as conn:
                return fn(conn)
        except psycopg.Error:  # PoolTimeout and PoolClosed are OperationalErrors
            pass
        with self._conn() as conn:
            return fn(conn)

    def tick(self, owner: str, lease_s: float, job_ttl_s: float) -> None:
        """Upkeep, every few seconds: reconnect when unavailable, retry pending writes, renew ``owner``'s
        leases, forget finished solves past ``retain_s`` and finished jobs past ``job_ttl_s``."""
        if self.error is not None and not self._connect():
            return
        try:
            self._flush()
            self.renew(owner, lease_s)
            self._run(lambda c: (
                c.execute(f"DELETE FROM memplan_solves WHERE expires_at < {_NOW}"),
                c.execute(f"DELETE FROM memplan_jobs WHERE done AND finished_at < {_NOW} - %s", (job_ttl_s,))))
        except StoreUnavailable:
            pass

    # ---- the plan cache (as memplan.api.cache.PlanCache) ------------------------------------------
    def get(self, key: str) -> str | None:
        """The stored response text, or None: not stored, the store unreachable (a solve instead), or a
        damaged or foreign row (counted in ``skipped``)."""
        try:
            if self.max_bytes:  # recency, for eviction, in the same round trip; written at most every touch_every_s
                row = self._run(lambda c: c.execute(
                    f"WITH touched AS (UPDATE memplan_plans SET used_at = {_NOW} WHERE key = %s AND "
                    f"used_at < {_NOW} - %s) SELECT response, status, checksum FROM memplan_plans WHERE key = %s",
                    (key, self.touch_every_s, key)).fetchone())
            else:
                row = self._run(lambda c: c.execute(
                    "SELECT response, status, checksum FROM memplan_plans WHERE key = %s", (key,)).fetchone())
        except StoreUnavailable:
            return None
        if row is None:
            return None
        if not servable(*row):
            self.skipped += 1
            log.warning("plan store: row %s is damaged or foreign (status %r); skipped, solving instead", key[:12],
                        row[1])
            return None
        return row[0]

    def put(self, key: str, response: dict[str, Any], *, text: str | None = None) -> bool:
        """As :meth:`memplan.api.cache.PlanCache.put`; a write the store cannot take now is kept and retried
        (:meth:`tick`), and False returned."""
        status = response["solver"]["status"]
        if status not in CACHEABLE_STATUSES:
            return False
        if text is None:
            text = json.dumps(response, separators=(",", ":"), allow_nan=False)
        args = (key, response["graph_fingerprint"], response["solver"]["name"], status, text, content_hash(text))
        return self._write("_put", args)

    def _put(self, conn: Any, key: str, fingerprint: str, solver: str, status: str, text: str, checksum: str) -> None:
        conn.execute(
            "INSERT INTO memplan_plans (key, graph_fingerprint, solver, status, response, created_at, used_at, "
            f"checksum, size_bytes) VALUES (%s, %s, %s, %s, %s, {_NOW}, {_NOW}, %s, octet_length(%s)) "
            "ON CONFLICT (key) DO UPDATE SET graph_fingerprint = EXCLUDED.graph_fingerprint, solver = EXCLUDED.solver, "
            "status = EXCLUDED.status, response = EXCLUDED.response, created_at = EXCLUDED.created_at, "
            "used_at = EXCLUDED.used_at, checksum = EXCLUDED.checksum, size_bytes = EXCLUDED.size_bytes",
            (key, fingerprint, solver, status, text, checksum, text))
        if self.max_bytes:
            self._evict(conn)

    def _evict(self, conn: Any) -> None:
        """Delete the least recently used answers until the stored text is within ``max_bytes`` (to
        ``_EVICT_TO`` of it), as the SQLite cache does; one replica at a time."""
        stored = conn.execute("SELECT COALESCE(SUM(size_bytes), 0) FROM memplan_plans").fetchone()[0]
        if stored <= self.max_bytes:
            return
        with conn.transaction():
            if not conn.execute("SELECT pg_try_advisory_xact_lock(%s)", (_LOCK_ID,)).fetchone()[0]:
                return  # another replica is evicting now
            doomed = conn.execute(
                "DELETE FROM memplan_plans WHERE key IN (SELECT key FROM (SELECT key, SUM(size_bytes) OVER "
                "(ORDER BY used_at DESC, key) AS newer FROM memplan_plans) ranked WHERE newer > %s)",
                (int(self.max_bytes * _EVICT_TO),)).rowcount
            conn.execute("DELETE FROM memplan_bodies b WHERE NOT EXISTS "
                         "(SELECT 1 FROM memplan_plans p WHERE p.key = b.plan_key)")
        log.info("plan store: evicted %d least recently used plans (max_bytes %d)", doomed, self.max_bytes)

    def get_for_body(self, body_key: str) -> tuple[str, str] | None:
        """``(plan key, stored response text)`` of a request body some replica read before (``body_key``,
        see :meth:`remember_body`), or None (also when unreachable, or the row is damaged: counted)."""
        try:
            row = self._run(lambda c: c.execute(
                "WITH b AS (SELECT plan_key FROM memplan_bodies WHERE body_key = %s), touched AS ("
                f"UPDATE memplan_plans SET used_at = {_NOW} WHERE key = (SELECT plan_key FROM b) AND "
                f"used_at < {_NOW} - %s) SELECT p.key, p.response, p.status, p.checksum FROM memplan_plans p "
                "JOIN b ON p.key = b.plan_key", (body_key, self.touch_every_s)).fetchone())
        except StoreUnavailable:
            return None
        if row is None:
            return None
        if not servable(*row[1:]):
            self.skipped += 1
            log.warning("plan store: row %s is damaged or foreign (status %r); skipped", row[0][:12], row[2])
            return None
        return row[0], row[1]

    def remember_body(self, body_key: str, key: str) -> None:
        """Record that request bodies hashing to ``body_key`` ask for plan ``key`` (best effort: not retried)."""
        try:
            self._run(lambda c: c.execute(
                "INSERT INTO memplan_bodies (body_key, plan_key) VALUES (%s, %s) ON CONFLICT (body_key) DO UPDATE "
                "SET plan_key = EXCLUDED.plan_key", (body_key, key)))
        except StoreUnavailable:
            pass

    def stored_bytes(self) -> int:
        return self._run(lambda c: c.execute("SELECT COALESCE(SUM(size_bytes), 0) FROM memplan_plans").fetchone()[0])

    def __len__(self) -> int:
        return self._run(lambda c: c.execute("SELECT COUNT(*) FROM memplan_plans").fetchone()[0])

    def clear(self) -> None:
        self._run(lambda c: (c.execute("DELETE FROM memplan_plans"), c.execute("DELETE FROM memplan_bodies")))

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close(timeout=1)
        if self._pending:
            log.warning("plan store %s: %d writes not made (the database was unreachable)", redact(self.url),
                        len(self._pending))

    # ---- writes that must not be lost: retried while the store is away ----------------------------
    def _write(self, method: str, args: tuple[Any, ...]) -> bool:
        try:
            self._run(lambda c: getattr(self, method)(c, *args))
            return True
        except StoreUnavailable:
            with self._lock:
                if len(self._pending) == self._pending.maxlen:
                    log.warning("plan store: more than %d writes waiting; the oldest is dropped", _PENDING_MAX)
                self._pending.append((method, args))
            return False

    def _flush(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    return
                method, args = self._pending[0]
            self._run(lambda c, m=method, a=args: getattr(self, m)(c, *a))  # StoreUnavailable: kept for later
            with self._lock:
                if self._pending and self._pending[0] == (method, args):
                    self._pending.popleft()

    @property
    def pending(self) -> int:
        """Writes waiting for the store to come back."""
        return len(self._pending)

    # ---- solving once across replicas -------------------------------------------------------------
    def claim_solve(self, key: str, owner: str, lease_s: float) -> bool:
        """Whether ``owner`` may solve ``key`` now: no replica is, or the one that was let its lease expire
        (it died). True also when the store cannot be reached (each replica then solves alone)."""
        try:
            row = self._run(lambda c: c.execute(
                f"INSERT INTO memplan_solves (key, owner, expires_at) VALUES (%s, %s, {_NOW} + %s) "
                "ON CONFLICT (key) DO UPDATE SET owner = EXCLUDED.owner, expires_at = EXCLUDED.expires_at, "
                f"done = false, status_code = NULL, answer = NULL WHERE memplan_solves.expires_at < {_NOW} "
                "RETURNING owner", (key, owner, lease_s)).fetchone())
        except StoreUnavailable:
            return True
        return row is not None

    def solve_state(self, key: str) -> SolveState | None:
        """The solve of ``key`` under way (or done, its answer kept ``retain_s``); None when no replica
        holds a live lease on it (never claimed, given up, its replica died) or the store is unreachable."""
        try:
            row = self._run(lambda c: c.execute(
                f"SELECT owner, done, status_code, answer FROM memplan_solves WHERE key = %s AND "
                f"(done OR expires_at >= {_NOW})", (key,)).fetchone())
        except StoreUnavailable:
            return None
        if row is None:
            return None
        return SolveState(row[0], row[1], row[2], None if row[3] is None else bytes(row[3]))

    def finish_solve(self, key: str, owner: str, status_code: int | None, answer: bytes | None) -> None:
        """``owner``'s solve of ``key`` ended: with its answer (HTTP status and body, kept ``retain_s`` for
        the replicas waiting on it), or, ``status_code`` None, given up (a transient failure: a waiting
        replica solves it itself)."""
        try:
            if status_code is None:
                self._run(lambda c: c.execute("DELETE FROM memplan_solves WHERE key = %s AND owner = %s",
                                              (key, owner)))
            else:
                self._run(lambda c: c.execute(
                    f"UPDATE memplan_solves SET done = true, status_code = %s, answer = %s, expires_at = {_NOW} + %s "
                    "WHERE key = %s AND owner = %s", (status_code, answer, self.retain_s, key, owner)))
        except StoreUnavailable:
            pass  # the waiting replicas see the lease expire, and solve it themselves

    def renew(self, owner: str, lease_s: float) -> None:
        """Extend every lease ``owner`` holds (its solves and its jobs) by ``lease_s`` from now."""
        self._run(lambda c: (
            c.execute(f"UPDATE memplan_solves SET expires_at = {_NOW} + %s WHERE owner = %s AND NOT done",
                      (lease_s, owner)),
            c.execute(f"UPDATE memplan_jobs SET expires_at = {_NOW} + %s WHERE owner = %s AND NOT done",
                      (lease_s, owner))))

    # ---- jobs -------------------------------------------------------------------------------------
    def create_job(self, job_id: str, key: str, request: bytes, time_limit_s: float, owner: str,
                   lease_s: float) -> None:
        """Record a new job run by ``owner``; raises :class:`StoreUnavailable` (the job is refused, 503)."""
        self._run(lambda c: c.execute(
            "INSERT INTO memplan_jobs (id, plan_key, request, time_limit_s, owner, expires_at, created_at) "
            f"VALUES (%s, %s, %s, %s, %s, {_NOW} + %s, {_NOW})", (job_id, key, request, time_limit_s, owner, lease_s)))

    def get_job(self, job_id: str) -> JobRow | None:
        """The job, or None (never created, or expired); raises :class:`StoreUnavailable`."""
        row = self._run(lambda c: c.execute(
            "SELECT id, owner, done, status_code, answer, created_at, expires_at, time_limit_s, adopted, "
            f"{_NOW} FROM memplan_jobs WHERE id = %s", (job_id,)).fetchone())
        if row is None:
            return None
        return JobRow(row[0], row[1], row[2], row[3], None if row[4] is None else bytes(row[4]), *row[5:])

    def finish_job(self, job_id: str, status_code: int, answer: bytes) -> None:
        """Store the job's answer (HTTP status and body); kept and retried while the store is away."""
        self._write("_finish_job", (job_id, status_code, answer))

    @staticmethod
    def _finish_job(conn: Any, job_id: str, status_code: int, answer: bytes) -> None:
        conn.execute(f"UPDATE memplan_jobs SET done = true, status_code = %s, answer = %s, finished_at = {_NOW} "
                     "WHERE id = %s AND NOT done", (status_code, answer, job_id))

    def adopt_jobs(self, owner: str, lease_s: float, *, job_id: str | None = None,
                   limit: int = 4) -> list[tuple[str, bytes]]:
        """Take over jobs whose replica died (their lease expired): ``(id, request)`` of each now
        ``owner``'s; only ``job_id`` when given. Empty when the store is unreachable."""
        which = "id = %s AND" if job_id is not None else ""
        params: tuple[Any, ...] = (owner, lease_s, *((job_id,) if job_id is not None else ()), limit)
        try:
            rows = self._run(lambda c: c.execute(
                f"UPDATE memplan_jobs SET owner = %s, expires_at = {_NOW} + %s, adopted = adopted + 1 WHERE id IN "
                f"(SELECT id FROM memplan_jobs WHERE {which} NOT done AND expires_at < {_NOW} "
                "ORDER BY created_at LIMIT %s FOR UPDATE SKIP LOCKED) RETURNING id, request",
                params).fetchall())
        except StoreUnavailable:
            return []
        return [(r[0], bytes(r[1])) for r in rows]
