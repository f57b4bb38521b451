"""POST /v1/plans: a plan for a graph under a budget, with its prediction and the solver's statistics."""

import asyncio
from typing import Any

from fastapi import APIRouter, Request, Response

from memplan.api.cache import content_hash
from memplan.api.routes.body import documented, read_body
from memplan.api.schemas import ERROR_RESPONSES, PlanRequest, PlanResponse
from memplan.api.service import ServiceDep

router = APIRouter(prefix="/v1", tags=["plans"])
_INLINE_HASH_BYTES = 1 << 20  # hashing a MiB takes about a millisecond: smaller bodies are hashed on the loop


@router.post("/plans", response_model=PlanResponse, responses=ERROR_RESPONSES, openapi_extra=documented(PlanRequest),
             summary="Plan a graph under a memory budget")
async def create_plan(request: Request, service: ServiceDep) -> Any:
    """Solve (or answer from the plan cache): the fastest plan whose simulated peak fits the budget.

    ``cache_hit`` says whether it was answered from the cache. An infeasible budget is a 422 whose body
    carries ``min_feasible_bytes``.
    """
    body = await request.body()
    # the same bytes as a request answered before: from the cache without reading them again
    body_key = content_hash(body) if len(body) < _INLINE_HASH_BYTES else await asyncio.to_thread(content_hash, body)
    answer = await service.cached_for_body(body_key)
    if answer is None:
        answer = await service.plan(await read_body(service, PlanRequest, body), body_key=body_key)
    # the answer's JSON as validated when it was solved: a hit is served without validating it again
    return Response(answer, media_type="application/json")
