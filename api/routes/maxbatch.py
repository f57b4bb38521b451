"""POST /v1/maxbatch: the largest batch (or sequence length) whose best plan fits a budget.

The graph must carry a shape family (``memplan maxbatch WORKLOAD`` or
``memplan.planner.probe.family.profile_family`` makes one); the search is
:func:`memplan.solvers.maxbatch.max_dim`, run in the service's worker pool. Its cost is bounded: at most
``max_value`` (<= 65536, so at most 34 candidates) and ``time_limit_s`` per candidate, whose product with
the candidate count must fit the server's ``max_time_limit_s``.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from memplan.api.jobs import load_graph, solve_states, state_summary
from memplan.api.routes.body import documented, json_body
from memplan.api.schemas import (
    ERROR_RESPONSES,
    STATES_DESCRIPTION,
    Budget,
    ReadRequest,
    StatesChoice,
    StateSummary,
    check_ops,
    check_states,
    check_time_limit,
    settings_of,
)
from memplan.api.service import ServiceDep
from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Plan
from memplan.planner.core.shapes import family_of
from memplan.planner.core.units import parse_budget

router = APIRouter(prefix="/v1", tags=["maxbatch"])

MAX_VALUE = 65536
DEFAULT_TIME_LIMIT_S = 5.0


def candidates(max_value: int) -> int:
    """Most candidates the search solves up to ``max_value``: doubling, then bisection, then one more."""
    steps = max(1, math.ceil(math.log2(max_value + 1)))
    return 2 * steps + 2


class MaxBatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    graph: Graph = Field(description="a memplan.graph/1 with a shape family in meta.shape_family")
    budget: Budget = Field(description="device bytes (an integer, or '24GiB', '512MB'); not a percentage")
    dim: Annotated[str, Field(min_length=1, max_length=32)] = Field(
        default="batch", description="the family's dimension to maximise (batch, seq, ...)")
    max_overhead: float | None = Field(
        default=None, ge=0, le=10, allow_inf_nan=False,
        description="step time at most (1 + this) x keeping everything (0.2 is 20%); None: any")
    max_value: int = Field(default=MAX_VALUE, ge=1, le=MAX_VALUE, description="search no higher")
    solver: Annotated[str, Field(min_length=1, max_length=64)] = "auto"
    time_limit_s: float = Field(default=DEFAULT_TIME_LIMIT_S, gt=0, allow_inf_nan=False,
                                description="solver seconds per candidate")
    offload: bool = False
    states: StatesChoice | None = Field(default=None, description=STATES_DESCRIPTION)
    fuse: Literal["backward", "forward"] | None = Field(
        default=None, description="'backward' (or 'forward'): the training loop steps the optimizer inside "
                                  "backward (before each module's next forward); size for that step (its peak "
                                  "and its overhead against keeping everything in it)")
    include_graph: bool = Field(default=False, description="return the family evaluated at the answer (the "
                                                           "graph the plan is for)")

    @model_validator(mode="after")
    def _checks(self, info: ValidationInfo) -> MaxBatchRequest:
        if isinstance(self.budget, str) and self.budget.strip().endswith("%"):
            raise ValueError("maxbatch takes a budget in bytes (e.g. '24GiB'), not a percentage of one shape's "
                             "activation memory")
        fam = family_of(self.graph)
        if fam is None:
            raise ValueError("the graph has no shape family (meta.shape_family): profile it at several shapes "
                             "(memplan maxbatch WORKLOAD, or memplan.planner.probe.family.profile_family)")
        if self.dim not in fam.dims:
            raise ValueError(f"the graph's shape family varies {', '.join(fam.dims)}, not {self.dim!r}")
        check_states(self.states, self.fuse)
        settings = settings_of(info)
        if settings is not None:  # the server's limits: the search's whole work must fit its time cap
            check_ops(self.graph, settings)
            check_time_limit(self.time_limit_s, settings, solves=candidates(self.max_value))
        return self


class NextValue(BaseModel):
    value: int
    reason: str
    min_feasible_bytes: int | None
    overhead: float | None


class MaxBatchPredicted(BaseModel):
    peak_bytes: int
    step_time_s: float
    overhead: float = Field(description="step time over keeping everything at that shape, minus one")


class MaxBatchResponse(BaseModel):
    dim: str
    value: int = Field(description="the largest value whose best plan fits")
    budget_bytes: int
    plan: Plan
    predicted: MaxBatchPredicted
    state_summary: StateSummary = Field(description="what the plan does with the model states at the answer")
    next: NextValue = Field(description="value + 1, and why it does not fit")
    candidates: int = Field(description="values solved")
    graph: Graph | None = None


def maxbatch_job(graph: Graph | str, budget_bytes: int, *, dim: str, max_overhead: float | None, solver: str,
                 time_limit_s: float, offload: bool, max_value: int, include_graph: bool,
                 fuse: str | None = None, states: str | None = None) -> dict[str, Any]:
    """The search, in a worker: the response body as a dict."""
    from memplan.solvers.maxbatch import max_dim

    a = max_dim(load_graph(graph), budget_bytes, dim=dim, max_overhead=max_overhead, method=solver,
                time_limit_s=time_limit_s, offload=offload, max_value=max_value, fuse=fuse,
                states=solve_states(states))  # (annotated bool | None, it passes a placement to solve too)
    return {"dim": dim, "value": a.value, "budget_bytes": budget_bytes, "plan": a.result.plan.model_dump(mode="json"),
            "predicted": {"peak_bytes": a.result.report.peak_bytes, "step_time_s": a.result.report.time_s,
                          "overhead": a.overhead},
            "state_summary": state_summary(a.graph, a.result),
            "next": {"value": a.next.value, "reason": a.next.reason, "min_feasible_bytes": a.next.min_feasible_bytes,
                     "overhead": a.next.overhead},
            "candidates": len(a.probes), "graph": a.graph.model_dump(mode="json") if include_graph else None}


@router.post("/maxbatch", response_model=MaxBatchResponse, response_model_exclude_none=True,
             responses=ERROR_RESPONSES, openapi_extra=documented(MaxBatchRequest),
             summary="The largest batch (or sequence) whose best plan fits a budget")
async def maxbatch(read: Annotated[ReadRequest[MaxBatchRequest], Depends(json_body(MaxBatchRequest))],
                   service: ServiceDep) -> Any:
    """Searches the graph's shape family along ``dim``; the plan is for the family evaluated at the answer
    (``include_graph`` returns that graph). A budget that not even ``dim = 1`` fits is 422 with
    ``min_feasible_bytes``. The body is read by a parse worker (limits checked by the request model)."""
    req = read.fields
    n = candidates(req["max_value"])
    budget_bytes = parse_budget(req["budget"])
    graph = read.graph if read.graph is not None else read.graph_json
    return await service.pool.run(
        maxbatch_job, graph, budget_bytes, dim=req["dim"], max_overhead=req["max_overhead"], solver=req["solver"],
        time_limit_s=req["time_limit_s"], offload=req["offload"], max_value=req["max_value"],
        include_graph=req["include_graph"], fuse=req["fuse"], states=req["states"], timeout_s=req["time_limit_s"] * n + service.settings.grace_s)
