"""The service's state and the work behind each route: limits, the plan cache, the worker pool, jobs.

One :class:`Service` lives per app (created in its lifespan); routes reach it through
:func:`get_service`. Nothing here decides an HTTP status code: it raises memplan's errors and
``memplan.api.errors`` maps them (an answer kept for another replica or a job is kept as the status and
body ``memplan.api.errors.error_answer`` gives it).

With a shared store (``--cache postgresql://...``) several replicas coordinate through it: an identical
request is solved once across them (the others wait for its answer, or take it over when its replica's
lease expires) and a job's answer can be read from any of them (:mod:`memplan.api.pgcache`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import secrets
import socket
from collections import OrderedDict
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel

from memplan.api import jobs
from memplan.api.cache import PLAN_KEY_VERSION, content_hash, plan_key
from memplan.api.errors import (
    TRANSIENT,
    JobNotFound,
    LimitExceeded,
    Overloaded,
    SolveTimeout,
    StoredAnswer,
    WorkerLost,
    error_answer,
    error_body,
    validation_message,
)
from memplan.api.jobstore import LocalJobs
from memplan.api.pool import WorkerPool
from memplan.api.schemas import (
    EventOut,
    FrontierRequest,
    PlanRequest,
    PlanResponse,
    ReadRequest,
    SimulateRequest,
    SimulationResponse,
    read_request,
)
from memplan.api.settings import Settings
from memplan.api.store import open_cache
from memplan.planner.core.errors import MemplanError
from memplan.planner.core.graph import Graph

_MAX_BODY_KEYS = 65_536  # request bodies remembered for cached_for_body (~10 MiB)
_POLL_S = 0.1  # how often a replica waiting on another's solve looks for its answer
_JOB_RETRY_S = 1.0  # a job refused a worker (all busy) tries again after this

log = logging.getLogger("memplan.api")


def memplan_version() -> str:
    try:
        return version("memplan")
    except PackageNotFoundError:
        return "unknown"


class Service:
    """The work behind the routes, on requests their models have already checked (types, caps and the
    server's limits: :mod:`memplan.api.schemas`)."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.version = memplan_version()
        self.pool = WorkerPool(settings.pool, settings.workers, settings.max_queue,
                               queue_timeout_s=settings.queue_timeout_s, memory_bytes=settings.worker_memory_bytes,
                               spare=True)
        # Bodies are read apart from solves: a 422 never waits behind a solve, nor a cache hit.
        self.parsers = WorkerPool(settings.pool, settings.parse_workers, settings.max_queue,
                                  queue_timeout_s=settings.queue_timeout_s, memory_bytes=settings.worker_memory_bytes)
        self.cache = open_cache(settings.cache_path, max_bytes=settings.cache_max_bytes,
                                store_timeout_s=settings.store_timeout_s)
        self.store = self.cache if self.cache.shared else LocalJobs()
        """Where jobs and solves in flight are kept: the shared store, or this server's memory."""
        self.replica = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        """This server's name in the shared store (owner of its solves and jobs)."""
        self.solved = 0
        """Plans this server's workers solved (not cache hits, not answers shared from another replica)."""
        self.bodies_read = 0
        """Request bodies this server's parse workers read (a repeated body is answered without)."""
        self.solver_names: list[str] = []
        self._cache_context = ""
        self._inflight: dict[str, asyncio.Future[str]] = {}  # plan key -> the solve running
        self._body_keys: OrderedDict[str, str] = OrderedDict()  # request body's hash -> plan key
        self._jobs: set[asyncio.Future[None]] = set()  # the jobs this server runs now
        self._upkeep: asyncio.Future[None] | None = None

    async def start(self) -> None:
        await self.parsers.start()  # first, then the solve pool: its processes are the newest (tests find them so)
        await self.pool.start()
        self.solver_names = jobs.warm_up()
        # What a solver name means: changes with memplan's version and the solvers it registers.
        self._cache_context = f"memplan {self.version}; solvers {','.join(self.solver_names)}"
        self._upkeep = asyncio.ensure_future(self._keep_up())

    def close(self) -> None:
        for task in [*self._inflight.values(), *self._jobs, *([self._upkeep] if self._upkeep else [])]:
            task.cancel()
        self.pool.close()
        self.parsers.close()
        self.cache.close()

    async def _keep_up(self) -> None:
        """Every third of ``lease_s``: the store's upkeep (reconnect, retry writes, renew this server's
        leases, forget expired jobs), then adopt jobs whose replica died."""
        s = self.settings
        while True:
            await asyncio.sleep(s.lease_s / 3)
            try:
                await asyncio.to_thread(self.store.tick, self.replica, s.lease_s, s.job_ttl_s)
                for job_id, request in await asyncio.to_thread(self.store.adopt_jobs, self.replica, s.lease_s):
                    self._adopt(job_id, request)
            except Exception:  # noqa: BLE001 - upkeep must go on; what failed is logged
                log.exception("plan store upkeep failed")

    def health(self) -> dict[str, Any]:
        """What ``/healthz`` says of the store: ``degraded`` (naming it and why) while it is unreachable."""
        pending = getattr(self.cache, "pending", 0)
        return {"status": "ok" if self.cache.available else "degraded", "store": self.cache.describe(),
                "store_error": self.cache.error, "skipped_rows": self.cache.skipped, "pending_writes": pending,
                "solved": self.solved, "bodies_read": self.bodies_read, "jobs": len(self._jobs),
                "replica": self.replica}

    async def read_body(self, model: type[BaseModel], body: bytes) -> ReadRequest[Any]:
        """``body`` read as ``model`` by a parse worker; raises ``RequestValidationError`` (answered 422
        like FastAPI's own) or :class:`LimitExceeded`."""
        self.bodies_read += 1
        kind, value = await self.parsers.run(
            read_request, model, body, self.settings, keep_graph=self.settings.pool == "thread",
            timeout_s=self.settings.parse_timeout_s)
        if kind == "invalid":
            raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in value])
        if kind == "limit":
            message, limit, limit_value = value
            raise LimitExceeded(message, limit=limit, limit_value=limit_value)
        return value

    @staticmethod
    def _graph_arg(req: ReadRequest[Any]) -> Graph | str:
        # A worker process gets the JSON text; a thread shares the object.
        return req.graph if req.graph is not None else req.graph_json

    # ---- plans -----------------------------------------------------------------------------------
    # A plan answer is validated against PlanResponse once, when it is solved, and stored as that JSON text
    # without ``cache_hit``; every answer, hit or miss, is that text with the flag put in front, served as
    # it is (validating a stored answer again on every hit cost more than the rest of the hit).
    @staticmethod
    def _body(stored: str, *, cache_hit: bool) -> bytes:
        return (b'{"cache_hit":true,' if cache_hit else b'{"cache_hit":false,') + stored[1:].encode()

    async def cached_for_body(self, body_key: str) -> bytes | None:
        """The cached ``PlanResponse`` (JSON bytes) of a request body seen before (``body_key``: the bytes'
        hash, :func:`memplan.api.cache.content_hash`), or None. Reading a graph takes a parse worker
        milliseconds to seconds; a client that repeats a request sends the same bytes, answered here from
        their hash alone."""
        key = self._body_keys.get(body_key)
        if key is None and self.cache.shared:  # bytes another replica read: from the store, unread here too
            found = await asyncio.to_thread(self.cache.get_for_body, self._shared_body_key(body_key))
            if found is not None:
                self._remember_locally(body_key, found[0])
                return self._body(found[1], cache_hit=True)
            return None
        stored = None if key is None else await asyncio.to_thread(self.cache.get, key)
        return None if stored is None else self._body(stored, cache_hit=True)

    def _shared_body_key(self, body_key: str) -> str:
        """A body's hash scoped to what decides the plan key it is read into (the key's version, memplan's
        version and solvers, the default and largest time limits, the largest graph): replicas set up alike
        share it, and a body seen under an older key version is read again."""
        s = self.settings
        return content_hash(f"{body_key};{self._cache_context};{s.default_time_limit_s};{s.max_time_limit_s};"
                            f"{s.max_ops};plan key {PLAN_KEY_VERSION}")

    async def _remember_body(self, body_key: str, key: str) -> None:
        if self._body_keys.get(body_key) != key and self.cache.shared:
            await asyncio.to_thread(self.cache.remember_body, self._shared_body_key(body_key), key)
        self._remember_locally(body_key, key)

    def _remember_locally(self, body_key: str, key: str) -> None:
        self._body_keys[body_key] = key
        self._body_keys.move_to_end(body_key)
        while len(self._body_keys) > _MAX_BODY_KEYS:  # bounded: the oldest bodies go first
            self._body_keys.popitem(last=False)

    async def _key(self, read: ReadRequest[PlanRequest]) -> tuple[str, float]:
        """The request's cache key and its time limit (the server's default when it gives none)."""
        req = read.fields
        time_limit_s = self.settings.time_limit_s(req["time_limit_s"])
        graph_sha256 = await asyncio.to_thread(content_hash, read.graph_json)
        key = plan_key(graph_sha256=graph_sha256, budget=req["budget"], budget_fraction=req["budget_fraction"],
                       solver=req["solver"], time_limit_s=time_limit_s, offload=req["offload"],
                       host_budget=req["host_budget"], context=self._cache_context, fuse=req["fuse"],
                       states=req["states"])
        return key, time_limit_s

    async def plan(self, read: ReadRequest[PlanRequest], *, body_key: str | None = None) -> bytes:
        """A ``PlanResponse`` as JSON bytes: from the cache, from an identical request being solved now
        (here, or by another replica sharing the store), or solved in the pool (and then cached).
        ``body_key``: the hash of the request's bytes, remembered so that the same bytes again are answered
        without reading them (:meth:`cached_for_body`)."""
        key, time_limit_s = await self._key(read)
        if body_key is not None:
            await self._remember_body(body_key, key)
        stored = await asyncio.to_thread(self.cache.get, key)
        if stored is not None:
            return self._body(stored, cache_hit=True)
        task = self._inflight.get(key)
        if task is None:  # else the same request is being solved now: share its answer
            task = asyncio.ensure_future(self._solve_once(key, read, time_limit_s))
            self._inflight[key] = task
            task.add_done_callback(functools.partial(self._solved, key))
        # shield: a request that goes away leaves the solve running; its answer is still cached.
        return self._body(await asyncio.shield(task), cache_hit=False)

    async def _solve_once(self, key: str, read: ReadRequest[PlanRequest], time_limit_s: float) -> str:
        """The answer's text (without ``cache_hit``): solved here when no other replica is solving ``key``
        (or when the one that was let its lease expire: it died), else that replica's answer, waited for
        at most this request's time limit plus the grace period and the queue timeout. Another replica's
        refusal (422) is raised as :class:`StoredAnswer`."""
        req = read.fields
        solve = functools.partial(
            self._solve_and_cache, key, self._graph_arg(read), budget=req["budget"],
            budget_fraction=req["budget_fraction"], solver=req["solver"], time_limit_s=time_limit_s,
            offload=req["offload"], host_budget=req["host_budget"], fuse=req["fuse"], states=req["states"])
        s = self.settings
        if not self.store.shared:
            return await solve()
        loop = asyncio.get_running_loop()
        wait_s = time_limit_s + s.grace_s + s.queue_timeout_s
        deadline = loop.time() + wait_s
        while True:
            if await asyncio.to_thread(self.store.claim_solve, key, self.replica, s.lease_s):
                return await self._solve_owned(key, solve)
            while True:  # another replica solves it: wait for its answer
                await asyncio.sleep(_POLL_S)
                state = await asyncio.to_thread(self.store.solve_state, key)
                if state is None:  # it gave up, or its replica died: take it over (unless it is cached now)
                    stored = await asyncio.to_thread(self.cache.get, key)
                    if stored is not None:
                        return stored
                    break
                if state.done and state.answer is not None:
                    if state.status_code == 200:
                        return state.answer.decode()
                    raise StoredAnswer(state.status_code or 500, state.answer)
                if loop.time() > deadline:
                    raise SolveTimeout(
                        f"replica {state.owner} is solving this request and did not answer within {wait_s:.1f} s "
                        f"(its time limit, the grace period and the queue timeout); retry, or submit it as a "
                        f"job (POST /v1/jobs)")

    async def _solve_owned(self, key: str, solve: Any) -> str:
        """``solve()`` under this replica's lease on ``key``; its answer (or refusal) is left in the store
        for the replicas waiting on it; a transient failure gives the solve up to them."""
        try:
            text: str = await solve()
        except MemplanError as e:
            if isinstance(e, TRANSIENT):
                await asyncio.to_thread(self.store.finish_solve, key, self.replica, None, None)
            else:
                await asyncio.to_thread(self.store.finish_solve, key, self.replica, *error_answer(e))
            raise
        await asyncio.to_thread(self.store.finish_solve, key, self.replica, 200, text.encode())
        return text

    async def _solve_and_cache(self, key: str, graph_arg: Graph | str, *, time_limit_s: float,
                               **kwargs: Any) -> str:
        """Solve in the pool; returns the answer as JSON text without ``cache_hit``, validated, and
        cached when its status is complete."""
        result: dict[str, Any] = await self.pool.run(jobs.plan_job, graph_arg, time_limit_s=time_limit_s,
                                                     timeout_s=time_limit_s + self.settings.grace_s, **kwargs)
        self.solved += 1
        text = PlanResponse.model_validate({"cache_hit": False, **result}).model_dump_json(exclude={"cache_hit"})
        # before the task ends: an identical request finds it in one place or the other
        await asyncio.to_thread(self.cache.put, key, result, text=text)
        return text

    def _solved(self, key: str, task: asyncio.Future[str]) -> None:
        if self._inflight.get(key) is task:
            del self._inflight[key]
        if not task.cancelled():
            task.exception()  # retrieved: no "never retrieved" warning when every waiter went away

    # ---- jobs: a plan request answered later, from any replica ------------------------------------
    async def submit(self, read: ReadRequest[PlanRequest], request: bytes) -> dict[str, Any]:
        """Record a job for the plan request ``read`` (``request``: its bytes, kept so that another replica
        can take the job over) and start it; returns its id and URL. Raises ``StoreUnavailable`` (503)
        when the shared store cannot take it now."""
        key, time_limit_s = await self._key(read)
        job_id = secrets.token_hex(16)
        await asyncio.to_thread(self.store.create_job, job_id, key, request, time_limit_s, self.replica,
                                self.settings.lease_s)
        self._start_job(job_id, self._run_job(job_id, read))
        return {"id": job_id, "status": "running", "url": f"/v1/jobs/{job_id}"}

    def _start_job(self, job_id: str, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self._jobs.add(task)
        task.add_done_callback(self._jobs.discard)

    async def _run_job(self, job_id: str, read: ReadRequest[PlanRequest]) -> None:
        """Answer the job as ``/v1/plans`` would answer its request; a job refused a worker (all busy, or
        its worker lost) tries again, for as long as its request would have waited and been solved."""
        s = self.settings
        loop = asyncio.get_running_loop()
        give_up = loop.time() + s.time_limit_s(read.fields["time_limit_s"]) + s.grace_s + s.queue_timeout_s
        while True:
            try:
                status, answer = 200, await self.plan(read)
            except (Overloaded, WorkerLost) as e:
                if loop.time() < give_up:
                    await asyncio.sleep(_JOB_RETRY_S)
                    continue
                status, answer = error_answer(e)
            except MemplanError as e:
                status, answer = error_answer(e)
            except Exception as e:  # noqa: BLE001 - a bug: logged, and the job answered as the route would
                log.exception("job %s failed", job_id)
                status, answer = 500, json.dumps(error_body(
                    f"internal error ({type(e).__name__}); it has been logged", "internal_error")).encode()
            break
        await asyncio.to_thread(self.store.finish_job, job_id, status, answer)

    def _adopt(self, job_id: str, request: bytes) -> None:
        """Run a job whose replica died (this server now holds its lease): read its request again, solve."""
        async def adopted() -> None:
            try:
                read = await self.read_body(PlanRequest, request)
            except (MemplanError, RequestValidationError) as e:  # this server's limits refuse it: its answer
                if isinstance(e, MemplanError):
                    status, answer = error_answer(e)
                else:
                    detail, field = validation_message(list(e.errors()))
                    status, answer = 422, json.dumps(error_body(detail, "invalid_request", field=field)).encode()
                await asyncio.to_thread(self.store.finish_job, job_id, status, answer)
                return
            log.warning("job %s: its replica stopped renewing its lease; taken over by %s", job_id, self.replica)
            await self._run_job(job_id, read)

        self._start_job(job_id, adopted())

    async def job(self, job_id: str) -> tuple[int, bytes]:
        """The job's answer as ``(HTTP status, body)``: the plan request's own (200, or its error) once
        done, else 202 with its progress. A job whose replica died is taken over here. Raises
        :class:`JobNotFound`, or ``StoreUnavailable`` (503)."""
        s = self.settings
        row = await asyncio.to_thread(self.store.get_job, job_id)
        if row is None:
            raise JobNotFound(f"no job {job_id!r}: never submitted here, or finished more than {s.job_ttl_s:g} s "
                              f"ago (job_ttl_s)")
        if row.done and row.answer is not None and row.status_code is not None:
            return row.status_code, row.answer
        owner, adopted = row.owner, row.adopted
        if row.orphaned:
            for taken, request in await asyncio.to_thread(self.store.adopt_jobs, self.replica, s.lease_s,
                                                           job_id=job_id):
                self._adopt(taken, request)
                owner, adopted = self.replica, adopted + 1
        progress = {"id": row.id, "status": "running", "url": f"/v1/jobs/{row.id}", "replica": owner,
                    "elapsed_s": round(max(0.0, row.now - row.created_at), 3), "time_limit_s": row.time_limit_s,
                    "adopted": adopted}
        return 202, json.dumps(progress).encode()

    # ---- simulate --------------------------------------------------------------------------------
    async def simulate(self, read: ReadRequest[SimulateRequest]) -> dict[str, Any]:
        out = await self.pool.run(
            jobs.simulate_job, self._graph_arg(read), read.fields["plan"], timeline=read.fields["timeline"],
            fuse=read.fields["fuse"],
            timeout_s=self.settings.max_time_limit_s + self.settings.grace_s)
        # The wire form names its fields: a figure the simulator adds later is not sent until it is
        # added to the schema (rather than failing the response's validation).
        out = {k: v for k, v in out.items() if k in SimulationResponse.model_fields}
        if out.get("timeline") is not None:
            out["timeline"] = [{k: v for k, v in e.items() if k in EventOut.model_fields} for e in out["timeline"]]
        return out

    # ---- frontier --------------------------------------------------------------------------------
    async def frontier(self, read: ReadRequest[FrontierRequest]) -> dict[str, Any]:
        req = read.fields
        solves = len(req["budgets"]) * len(req["solvers"])
        per_solve_s = self.settings.time_limit_s(req["time_limit_s"], solves=solves)
        return await self.pool.run(
            jobs.frontier_job, self._graph_arg(read), budgets=list(req["budgets"]), solvers=list(req["solvers"]),
            time_limit_s=per_solve_s, offload=req["offload"], states=req["states"],
            timeout_s=per_solve_s * solves + self.settings.grace_s)


def get_service(request: Request) -> Service:
    """FastAPI dependency: the app's :class:`Service` (made in its lifespan)."""
    return request.app.state.service


ServiceDep = Annotated[Service, Depends(get_service)]
