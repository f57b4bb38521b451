"""POST /v1/frontier: predicted step-time overhead at each budget, for each solver."""

from typing import Annotated, Any

from fastapi import APIRouter, Depends

from memplan.api.routes.body import documented, json_body
from memplan.api.schemas import ERROR_RESPONSES, FrontierRequest, FrontierResponse, ReadRequest
from memplan.api.service import ServiceDep

router = APIRouter(prefix="/v1", tags=["frontier"])


@router.post("/frontier", response_model=FrontierResponse, responses=ERROR_RESPONSES,
             openapi_extra=documented(FrontierRequest), summary="Memory against time: overhead at each budget")
async def frontier(req: Annotated[ReadRequest[FrontierRequest], Depends(json_body(FrontierRequest))], service: ServiceDep) -> Any:
    """One series per solver; a point's ``overhead`` is None where its budget is infeasible. Without
    ``time_limit_s`` the server's default is shared out between the solves."""
    return await service.frontier(req)
