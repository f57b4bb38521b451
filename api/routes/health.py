"""GET /healthz: answers at once, even while every worker is solving; ``degraded`` while the plan store is away."""

from fastapi import APIRouter

from memplan.api.schemas import Health
from memplan.api.service import ServiceDep

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, summary="Liveness and load")
async def healthz(service: ServiceDep) -> Health:
    pool = service.pool
    return Health(version=service.version, pool=pool.kind, workers=pool.workers, busy=pool.busy,
                  ready=pool.ready, queued=pool.queued, **service.health())
