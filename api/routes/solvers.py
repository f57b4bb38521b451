"""GET /v1/solvers: the registered solvers."""

from fastapi import APIRouter

from memplan.api.schemas import SolverOut, SolversResponse

router = APIRouter(prefix="/v1", tags=["solvers"])


@router.get("/solvers", response_model=SolversResponse, summary="List the registered solvers")
async def list_solvers() -> SolversResponse:
    """Each solver's name (for ``solver`` in a plan request), what it handles and whether it is exact."""
    from memplan.solvers import solvers

    return SolversResponse(solvers=[
        SolverOut(name=s.name, description=s.description, graphs=s.graphs, exact=s.exact, offload=s.offload,
                  max_saved_activations=s.max_ops)
        for s in sorted(solvers().values(), key=lambda s: s.name)])
