"""GET /healthz: answers at once, even while every worker is solving."""

from fastapi import APIRouter, Depends

from memplan.api.schemas import Health
from memplan.api.service import Service, get_service

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, summary="Liveness and load")
async def healthz(service: Service = Depends(get_service)) -> Health:
    pool = service.pool
    return Health(version=service.version, pool=pool.kind, workers=pool.workers, busy=pool.busy, queued=pool.queued)
