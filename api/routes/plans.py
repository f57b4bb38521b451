"""POST /v1/plans: a plan for a graph under a budget, with its prediction and the solver's statistics."""

from typing import Annotated, Any

from fastapi import APIRouter, Depends

from memplan.api.routes.body import documented, json_body
from memplan.api.schemas import ERROR_RESPONSES, PlanRequest, PlanResponse, ReadRequest
from memplan.api.service import ServiceDep

router = APIRouter(prefix="/v1", tags=["plans"])


@router.post("/plans", response_model=PlanResponse, responses=ERROR_RESPONSES, openapi_extra=documented(PlanRequest),
             summary="Plan a graph under a memory budget")
async def create_plan(req: Annotated[ReadRequest[PlanRequest], Depends(json_body(PlanRequest))], service: ServiceDep) -> Any:
    """Solve (or answer from the plan cache): the fastest plan whose simulated peak fits the budget.

    ``cache_hit`` says whether it was answered from the cache. An infeasible budget is a 422 whose body
    carries ``min_feasible_bytes``.
    """
    return await service.plan(req)
