"""The service's state and the work behind each route: limits, the plan cache, the worker pool.

One :class:`Service` lives per app (created in its lifespan); routes reach it through
:func:`get_service`. Nothing here knows about HTTP status codes: it raises memplan's errors and
``memplan.api.errors`` maps them.
"""

from __future__ import annotations

import asyncio
import functools
from collections import OrderedDict
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Any

from fastapi import Depends, Request

from memplan.api import jobs
from memplan.api.cache import PlanCache, content_hash, plan_key
from memplan.api.pool import WorkerPool
from memplan.api.schemas import (
    EventOut,
    FrontierRequest,
    PlanRequest,
    PlanResponse,
    ReadRequest,
    SimulateRequest,
    SimulationResponse,
)
from memplan.api.settings import Settings
from memplan.planner.core.graph import Graph

_MAX_BODY_KEYS = 65_536  # request bodies remembered for cached_for_body (~10 MiB)


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
        self.cache = PlanCache(settings.cache_path, max_bytes=settings.cache_max_bytes)
        self.solver_names: list[str] = []
        self._cache_context = ""
        self._inflight: dict[str, asyncio.Future[str]] = {}  # plan key -> the solve running
        self._body_keys: OrderedDict[str, str] = OrderedDict()  # request body's hash -> plan key

    async def start(self) -> None:
        await self.parsers.start()  # first, then the solve pool: its processes are the newest (tests find them so)
        await self.pool.start()
        self.solver_names = jobs.warm_up()
        # What a solver name means: changes with memplan's version and the solvers it registers.
        self._cache_context = f"memplan {self.version}; solvers {','.join(self.solver_names)}"

    def close(self) -> None:
        for task in self._inflight.values():
            task.cancel()
        self.pool.close()
        self.parsers.close()
        self.cache.close()

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
        stored = None if key is None else await asyncio.to_thread(self.cache.get, key)
        return None if stored is None else self._body(stored, cache_hit=True)

    def _remember_body(self, body_key: str, key: str) -> None:
        self._body_keys[body_key] = key
        self._body_keys.move_to_end(body_key)
        while len(self._body_keys) > _MAX_BODY_KEYS:  # bounded: the oldest bodies go first
            self._body_keys.popitem(last=False)

    async def plan(self, read: ReadRequest[PlanRequest], *, body_key: str | None = None) -> bytes:
        """A ``PlanResponse`` as JSON bytes: from the cache, from an identical request being solved now, or
        solved in the pool (and then cached). ``body_key``: the hash of the request's bytes, remembered so
        that the same bytes again are answered without reading them (:meth:`cached_for_body`)."""
        req = read.fields
        time_limit_s = self.settings.time_limit_s(req["time_limit_s"])
        graph_sha256 = await asyncio.to_thread(content_hash, read.graph_json)
        key = plan_key(graph_sha256=graph_sha256, budget=req["budget"], budget_fraction=req["budget_fraction"],
                       solver=req["solver"], time_limit_s=time_limit_s, offload=req["offload"],
                       host_budget=req["host_budget"], context=self._cache_context, fuse=req["fuse"])
        if body_key is not None:
            self._remember_body(body_key, key)
        stored = await asyncio.to_thread(self.cache.get, key)
        if stored is not None:
            return self._body(stored, cache_hit=True)
        task = self._inflight.get(key)
        if task is None:  # else the same request is being solved now: share its answer
            task = asyncio.ensure_future(self._solve_and_cache(
                key, self._graph_arg(read), budget=req["budget"], budget_fraction=req["budget_fraction"],
                solver=req["solver"], time_limit_s=time_limit_s, offload=req["offload"],
                host_budget=req["host_budget"], fuse=req["fuse"]))
            self._inflight[key] = task
            task.add_done_callback(functools.partial(self._solved, key))
        # shield: a request that goes away leaves the solve running; its answer is still cached.
        return self._body(await asyncio.shield(task), cache_hit=False)

    async def _solve_and_cache(self, key: str, graph_arg: Graph | str, *, time_limit_s: float,
                               **kwargs: Any) -> str:
        """Solve in the pool; returns the answer as JSON text without ``cache_hit``, validated, and
        cached when its status is complete."""
        result: dict[str, Any] = await self.pool.run(jobs.plan_job, graph_arg, time_limit_s=time_limit_s,
                                                     timeout_s=time_limit_s + self.settings.grace_s, **kwargs)
        text = PlanResponse.model_validate({"cache_hit": False, **result}).model_dump_json(exclude={"cache_hit"})
        # before the task ends: an identical request finds it in one place or the other
        await asyncio.to_thread(self.cache.put, key, result, text=text)
        return text

    def _solved(self, key: str, task: asyncio.Future[str]) -> None:
        if self._inflight.get(key) is task:
            del self._inflight[key]
        if not task.cancelled():
            task.exception()  # retrieved: no "never retrieved" warning when every waiter went away

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
            time_limit_s=per_solve_s, offload=req["offload"], timeout_s=per_solve_s * solves + self.settings.grace_s)


def get_service(request: Request) -> Service:
    """FastAPI dependency: the app's :class:`Service` (made in its lifespan)."""
    return request.app.state.service


ServiceDep = Annotated[Service, Depends(get_service)]
