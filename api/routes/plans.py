"""POST /v1/plans: a plan for a graph under a budget, with its prediction and the solver's statistics."""

from fastapi import APIRouter, Request, Response

from memplan.api.schemas import ERROR_RESPONSES, PlanRequest, PlanResponse
from memplan.api.service import BODY_KEY, ServiceDep

router = APIRouter(prefix="/v1", tags=["plans"])


@router.post("/plans", response_model=PlanResponse, responses=ERROR_RESPONSES,
             summary="Plan a graph under a memory budget")
async def create_plan(req: PlanRequest, request: Request, service: ServiceDep) -> Response:
    """Solve (or answer from the plan cache): the fastest plan whose simulated peak fits the budget.

    ``cache_hit`` says whether it was answered from the cache. An infeasible budget is a 422 whose body
    carries ``min_feasible_bytes``.
    """
    # The body is already JSON shaped like PlanResponse (a cache hit is served without re-encoding).
    answer = await service.plan(req, body_key=request.scope.get(BODY_KEY))
    return Response(content=answer, media_type="application/json")
