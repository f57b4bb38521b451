"""The service's state and the work behind each route: limits, the plan cache, the worker pool.

One :class:`Service` lives per app (created in its lifespan); routes reach it through
:func:`get_service`. Nothing here knows about HTTP status codes: it raises memplan's errors and
``memplan.api.errors`` maps them.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections import OrderedDict
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Any

from fastapi import Depends, Request

from memplan.api import jobs
from memplan.api.cache import PlanCache, content_hash, plan_key
from memplan.api.errors import LimitExceeded
from memplan.api.pool import WorkerPool
from memplan.api.schemas import EventOut, FrontierRequest, PlanRequest, SimulateRequest, SimulationResponse
from memplan.api.settings import Settings
from memplan.planner.errors import MemplanError
from memplan.planner.graph import Graph

BODY_KEY = "memplan.body_sha256"
"""Scope key under which ``memplan.api.app.PlanCacheShortcut`` hands a request body's hash to the route."""
_MAX_BODY_KEYS = 65_536  # request bodies remembered for the cache shortcut (~10 MiB)


def memplan_version() -> str:
    try:
        return version("memplan")
    except PackageNotFoundError:
        return "unknown"


class Service:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.version = memplan_version()
        self.pool = WorkerPool(settings.pool, settings.workers, settings.max_queue)
        self.cache = PlanCache(settings.cache_path)
        self.solver_names: list[str] = []
        self._cache_context = ""
        self._body_keys: OrderedDict[str, str] = OrderedDict()  # request body hash -> plan key
        self._inflight: dict[str, asyncio.Future[dict[str, Any]]] = {}  # plan key -> the solve running

    async def start(self) -> None:
        await self.pool.start()
        self.solver_names = jobs.warm_up()
        # What a solver name means: changes with memplan's version and the solvers it registers.
        self._cache_context = f"memplan {self.version}; solvers {','.join(self.solver_names)}"

    def close(self) -> None:
        for task in self._inflight.values():
            task.cancel()
        self.pool.close()
        self.cache.close()

    # ---- limits ----------------------------------------------------------------------------------
    def _check_graph(self, graph: Graph) -> None:
        s = self.settings
        if len(graph.ops) > s.max_ops:
            raise LimitExceeded(f"graph has {len(graph.ops)} ops; this server plans graphs of at most "
                                f"{s.max_ops} ops (max_ops)", limit="max_ops", limit_value=s.max_ops)
        jobs.check_finite(graph)

    def _time_limit(self, requested_s: float | None, *, solves: int = 1) -> float:
        """Seconds per solve: the request's, or the default shared out; the total must fit the cap."""
        s = self.settings
        if requested_s is None:
            return min(s.default_time_limit_s, s.max_time_limit_s / solves)
        if requested_s * solves > s.max_time_limit_s:
            what = (f"time_limit_s {requested_s:g} s" if solves == 1
                    else f"{solves} solves of time_limit_s {requested_s:g} s ({requested_s * solves:g} s)")
            raise LimitExceeded(f"{what} is over this server's cap of {s.max_time_limit_s:g} s (max_time_limit_s)",
                                limit="max_time_limit_s", limit_value=s.max_time_limit_s)
        return requested_s

    def _graph_arg(self, graph: Graph) -> Graph | str:
        # A worker process gets the JSON text (pydantic-core dumps it fast); a thread shares the object.
        return graph.model_dump_json() if self.settings.pool == "process" else graph

    # ---- plans -----------------------------------------------------------------------------------
    def cached_by_body(self, body_key: str) -> bytes | None:
        """The cached answer to a request body seen before (its hash, from ``PlanCacheShortcut``)."""
        key = self._body_keys.get(body_key)
        stored = self.cache.get(key) if key is not None else None
        return None if stored is None else _hit(stored)

    def _remember_body(self, body_key: str, key: str) -> None:
        self._body_keys[body_key] = key
        self._body_keys.move_to_end(body_key)
        while len(self._body_keys) > _MAX_BODY_KEYS:  # bounded: the oldest bodies go first
            self._body_keys.popitem(last=False)

    async def plan(self, req: PlanRequest, *, body_key: str | None = None) -> bytes:
        """A ``PlanResponse`` as JSON bytes: from the cache, from an identical request being solved
        now, or solved in the pool (and then cached). ``body_key``: the hash of the request's bytes,
        remembered so that the same bytes again skip parsing (:meth:`cached_by_body`)."""
        self._check_graph(req.graph)
        if req.budget is not None and req.budget_fraction is not None:
            raise MemplanError("budget and budget_fraction: give one of them, not both")
        time_limit_s = self._time_limit(req.time_limit_s)
        graph_json = req.graph.model_dump_json()
        key = plan_key(graph_sha256=content_hash(graph_json), budget=req.budget,
                       budget_fraction=req.budget_fraction, solver=req.solver, time_limit_s=time_limit_s,
                       offload=req.offload, host_budget=req.host_budget, context=self._cache_context)
        if body_key is not None:
            self._remember_body(body_key, key)
        stored = self.cache.get(key)
        if stored is not None:
            return _hit(stored)
        task = self._inflight.get(key)
        if task is None:  # else the same request is being solved now: share its answer
            graph_arg = graph_json if self.settings.pool == "process" else req.graph
            task = asyncio.ensure_future(self._solve_and_cache(
                key, graph_arg, budget=req.budget, budget_fraction=req.budget_fraction, solver=req.solver,
                time_limit_s=time_limit_s, offload=req.offload, host_budget=req.host_budget))
            self._inflight[key] = task
            task.add_done_callback(functools.partial(self._solved, key))
        # shield: a request that goes away leaves the solve running; its answer is still cached.
        return _encode(await asyncio.shield(task), cache_hit=False)

    async def _solve_and_cache(self, key: str, graph_arg: Graph | str, *, time_limit_s: float,
                               **kwargs: Any) -> dict[str, Any]:
        result: dict[str, Any] = await self.pool.run(jobs.plan_job, graph_arg, time_limit_s=time_limit_s,
                                                     timeout_s=time_limit_s + self.settings.grace_s, **kwargs)
        self.cache.put(key, result)  # before the task ends: an identical request finds it in one place or the other
        return result

    def _solved(self, key: str, task: asyncio.Future[dict[str, Any]]) -> None:
        if self._inflight.get(key) is task:
            del self._inflight[key]
        if not task.cancelled():
            task.exception()  # retrieved: no "never retrieved" warning when every waiter went away

    # ---- simulate --------------------------------------------------------------------------------
    async def simulate(self, req: SimulateRequest) -> dict[str, Any]:
        self._check_graph(req.graph)
        out = await self.pool.run(
            jobs.simulate_job, self._graph_arg(req.graph), req.plan, timeline=req.timeline,
            timeout_s=self.settings.max_time_limit_s + self.settings.grace_s)
        # The wire form names its fields: a figure the simulator adds later is not sent until it is
        # added to the schema (rather than failing the response's validation).
        out = {k: v for k, v in out.items() if k in SimulationResponse.model_fields}
        if out.get("timeline") is not None:
            out["timeline"] = [{k: v for k, v in e.items() if k in EventOut.model_fields} for e in out["timeline"]]
        return out

    # ---- frontier --------------------------------------------------------------------------------
    async def frontier(self, req: FrontierRequest) -> dict[str, Any]:
        self._check_graph(req.graph)
        s = self.settings
        solves = len(req.budgets) * len(req.solvers)
        if solves > s.max_frontier_points:
            raise LimitExceeded(f"{len(req.budgets)} budgets x {len(req.solvers)} solvers = {solves} solves; this "
                                f"server computes at most {s.max_frontier_points} per request (max_frontier_points)",
                                limit="max_frontier_points", limit_value=s.max_frontier_points)
        per_solve_s = self._time_limit(req.time_limit_s, solves=solves)
        return await self.pool.run(
            jobs.frontier_job, self._graph_arg(req.graph), budgets=list(req.budgets), solvers=list(req.solvers),
            time_limit_s=per_solve_s, offload=req.offload, timeout_s=per_solve_s * solves + s.grace_s)


def _hit(stored: str) -> bytes:
    # The stored text is a JSON object without "cache_hit": prepend the field, skip re-encoding.
    return b'{"cache_hit":true,' + stored[1:].encode()


def _encode(result: dict[str, Any], *, cache_hit: bool) -> bytes:
    return json.dumps({"cache_hit": cache_hit, **result}, separators=(",", ":"), allow_nan=False).encode()


def get_service(request: Request) -> Service:
    """FastAPI dependency: the app's :class:`Service` (made in its lifespan)."""
    return request.app.state.service


ServiceDep = Annotated[Service, Depends(get_service)]
