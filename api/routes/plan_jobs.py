"""POST /v1/jobs and GET /v1/jobs/{id}: a plan request answered later, for solves longer than a proxy
waits. With a shared store (PostgreSQL) any replica answers for any job, and takes over one whose replica
died."""

from typing import Annotated, Any

from fastapi import APIRouter, Path, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from memplan.api.routes.body import documented, read_body
from memplan.api.schemas import ERROR_RESPONSES, ErrorBody, PlanRequest, PlanResponse
from memplan.api.service import ServiceDep

router = APIRouter(prefix="/v1", tags=["jobs"])


class JobAccepted(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    status: str = Field(description="running")
    url: str = Field(description="GET it for the answer (also in the Location header)")


class JobProgress(JobAccepted):
    replica: str = Field(description="the replica solving it")
    elapsed_s: float = Field(description="since it was submitted")
    time_limit_s: float = Field(description="the solver's time limit (the job ends within it plus the grace "
                                            "period, once a worker is free)")
    adopted: int = Field(description="times another replica took it over (its replica had died)")


@router.post("/jobs", status_code=202, response_model=JobAccepted, responses=ERROR_RESPONSES,
             openapi_extra=documented(PlanRequest), summary="Submit a plan request as a job")
async def submit_job(request: Request, service: ServiceDep) -> Any:
    """The body of ``POST /v1/plans``, checked at once (a bad one is the same 422); answers 202 with the
    job's URL before it is solved. 503 with Retry-After when the shared store cannot take it now."""
    body = await request.body()
    accepted = await service.submit(await read_body(service, PlanRequest, body), body)
    return JSONResponse(accepted, status_code=202, headers={"Location": accepted["url"]})


@router.get("/jobs/{job_id}", summary="A job's answer, or its progress",
            responses={200: {"model": PlanResponse, "description": "done: the plan request's answer"},
                       202: {"model": JobProgress, "description": "still running (Retry-After: 1)"},
                       404: {"model": ErrorBody, "description": "no such job, or expired (job_ttl_s)"},
                       **{k: v for k, v in ERROR_RESPONSES.items() if k in (422, 503, 504)}})
async def get_job(job_id: Annotated[str, Path(min_length=1, max_length=64)], service: ServiceDep) -> Any:
    """200 with the plan once done (from any replica), the error the plan request would have had (422,
    504, ...), or 202 with progress while it runs. Finished jobs are kept ``job_ttl_s`` (1 hour), then 404."""
    status, body = await service.job(job_id)
    return Response(body, status_code=status, media_type="application/json",
                    headers={"Retry-After": "1"} if status in (202, 503) else None)
