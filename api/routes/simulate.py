"""POST /v1/simulate: replay one training step of a graph under a plan (the cost model)."""

from typing import Annotated, Any

from fastapi import APIRouter, Depends

from memplan.api.routes.body import documented, json_body
from memplan.api.schemas import ERROR_RESPONSES, ReadRequest, SimulateRequest, SimulationResponse
from memplan.api.service import ServiceDep

router = APIRouter(prefix="/v1", tags=["simulate"])


@router.post("/simulate", response_model=SimulationResponse, response_model_exclude_none=False,
             responses=ERROR_RESPONSES, openapi_extra=documented(SimulateRequest),
             summary="Predict peak memory and step time of a plan")
async def simulate(req: Annotated[ReadRequest[SimulateRequest], Depends(json_body(SimulateRequest))], service: ServiceDep) -> Any:
    """The simulator's report; the per-step timeline only when ``timeline`` is true. A plan made for
    another graph is a 422 (``plan_mismatch``)."""
    return await service.simulate(req)
