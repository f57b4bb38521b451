"""The service's state and the work behind each route: limits, the plan cache, the worker pool.

One :class:`Service` lives per app (created in its lifespan); routes reach it through
:func:`get_service`. Nothing here knows about HTTP status codes: it raises memplan's errors and
``memplan.api.errors`` maps them.
"""

from __future__ import annotations

import asyncio
import json
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import Request

from memplan.api import jobs
from memplan.api.cache import PlanCache, content_hash, plan_key
from memplan.api.errors import LimitExceeded, Overloaded
from memplan.api.pool import WorkerPool
from memplan.api.schemas import FrontierRequest, PlanRequest, SimulateRequest
from memplan.api.settings import Settings
from memplan.planner.graph import Graph


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
        self._inflight: dict[str, asyncio.Future[dict[str, Any]]] = {}

    async def start(self) -> None:
        await self.pool.start()
        self.solver_names = jobs.warm_up()
        # What a solver name means: changes with memplan's version and the solvers it registers.
        self._cache_context = f"memplan {self.version}; solvers {','.join(self.solver_names)}"

    def close(self) -> None:
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
    async def plan(self, req: PlanRequest) -> bytes:
        """A ``PlanResponse`` as JSON bytes: from the cache, from an identical request being solved
        now, or solved in the pool (and then cached)."""
        self._check_graph(req.graph)
        time_limit_s = self._time_limit(req.time_limit_s)
        graph_json = req.graph.model_dump_json()
        key = plan_key(graph_sha256=content_hash(graph_json), budget=req.budget, solver=req.solver,
                       time_limit_s=time_limit_s, offload=req.offload, host_budget=req.host_budget,
                       context=self._cache_context)
        stored = self.cache.get(key)
        if stored is not None:
            # The stored text is a JSON object without "cache_hit": prepend the field, skip re-encoding.
            return b'{"cache_hit":true,' + stored[1:].encode()
        if key in self._inflight:  # the same request is being solved: share its answer
            shared = self._inflight[key]
            try:
                result = await asyncio.shield(shared)
            except asyncio.CancelledError:
                if shared.cancelled():
                    raise Overloaded("the identical request this one was waiting on was cancelled; retry") from None
                raise
            return _encode(result, cache_hit=False)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._inflight[key] = fut
        try:
            graph_arg = graph_json if self.settings.pool == "process" else req.graph
            result = await self.pool.run(
                jobs.plan_job, graph_arg, budget=req.budget, solver=req.solver, time_limit_s=time_limit_s,
                offload=req.offload, host_budget=req.host_budget,
                timeout_s=time_limit_s + self.settings.grace_s)
            self.cache.put(key, result)
            fut.set_result(result)
        except asyncio.CancelledError:
            fut.cancel()
            raise
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # marks it retrieved: no "never retrieved" warning when nobody shared it
            raise
        finally:
            del self._inflight[key]
        return _encode(result, cache_hit=False)

    # ---- simulate --------------------------------------------------------------------------------
    async def simulate(self, req: SimulateRequest) -> dict[str, Any]:
        self._check_graph(req.graph)
        return await self.pool.run(
            jobs.simulate_job, self._graph_arg(req.graph), req.plan, timeline=req.timeline,
            timeout_s=self.settings.max_time_limit_s + self.settings.grace_s)

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


def _encode(result: dict[str, Any], *, cache_hit: bool) -> bytes:
    return json.dumps({"cache_hit": cache_hit, **result}, separators=(",", ":"), allow_nan=False).encode()


def get_service(request: Request) -> Service:
    """FastAPI dependency: the app's :class:`Service` (made in its lifespan)."""
    return request.app.state.service
