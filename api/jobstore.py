"""Jobs (``POST /v1/jobs``) as a store holds them, and the store of a single server: in its memory.

A team's replicas keep their jobs in the shared PostgreSQL store instead
(:class:`memplan.api.pgcache.PostgresPlanCache`, the same methods), so that any replica answers for any
job and adopts one whose replica died. Here, with one server (a SQLite cache), there is no other replica
to wait for or take over from: a solve is always this server's to run, and jobs live as long as it does.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class JobRow:
    """A job as the store holds it. ``now``: the store's clock when it was read."""

    id: str
    owner: str
    done: bool
    status_code: int | None
    answer: bytes | None
    created_at: float
    expires_at: float
    time_limit_s: float
    adopted: int
    now: float

    @property
    def orphaned(self) -> bool:
        """Running, and its replica has not renewed its lease: it died (another may adopt it)."""
        return not self.done and self.expires_at < self.now


@dataclass(frozen=True)
class SolveState:
    """A request being solved by some replica: running (under a live lease) or done with its answer."""

    owner: str
    done: bool
    status_code: int | None
    answer: bytes | None


class LocalJobs:
    """One server's jobs, in memory; finished ones are forgotten ``job_ttl_s`` after they end (:meth:`tick`)."""

    shared = False

    def __init__(self) -> None:
        self._jobs: dict[str, JobRow] = {}
        self._finished_at: dict[str, float] = {}
        self._lock = threading.Lock()

    def claim_solve(self, key: str, owner: str, lease_s: float) -> bool:
        return True  # no other replica: the server's own identical requests share one solve already

    def solve_state(self, key: str) -> SolveState | None:
        return None

    def finish_solve(self, key: str, owner: str, status_code: int | None, answer: bytes | None) -> None:
        return None

    def create_job(self, job_id: str, key: str, request: bytes, time_limit_s: float, owner: str,
                   lease_s: float) -> None:
        now = time.time()
        with self._lock:
            self._jobs[job_id] = JobRow(job_id, owner, False, None, None, now, float("inf"), time_limit_s, 0, now)

    def get_job(self, job_id: str) -> JobRow | None:
        with self._lock:
            row = self._jobs.get(job_id)
        return None if row is None else replace(row, now=time.time())

    def finish_job(self, job_id: str, status_code: int, answer: bytes) -> None:
        with self._lock:
            if job_id in self._jobs:
                self._jobs[job_id] = replace(self._jobs[job_id], done=True, status_code=status_code, answer=answer)
                self._finished_at[job_id] = time.time()

    def adopt_jobs(self, owner: str, lease_s: float, *, job_id: str | None = None,
                   limit: int = 4) -> list[tuple[str, bytes]]:
        return []  # a job of this server's outlives it only as far as its client's retry

    def tick(self, owner: str, lease_s: float, job_ttl_s: float) -> None:
        cutoff = time.time() - job_ttl_s
        with self._lock:
            for job_id in [j for j, t in self._finished_at.items() if t < cutoff]:
                del self._jobs[job_id], self._finished_at[job_id]
