"""Request and response bodies of the REST service (pydantic v2).

The graph and the plan travel in their file formats (``memplan.graph/1``, ``memplan.plan/1``): those are
memplan's public exchange formats. Everything else here is the wire form of the service, kept separate
from the internal types (``SolveResult``, ``Report``, ``SolverSpec``) so that either can change alone.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from memplan.planner.graph import Graph
from memplan.planner.plan import Plan

Budget = Annotated[
    int | Annotated[str, Field(min_length=1, max_length=64)],
    Field(description="device bytes (fixed memory included) as an integer, or a string: '6GiB', '512MB', "
                      "'123456', or '50%' (fixed memory plus that share of the keep-everything activation "
                      "memory)", examples=["50%", "6GiB", 1048576]),
]
SolverName = Annotated[str, Field(min_length=1, max_length=64, description="a name from GET /v1/solvers, or 'auto'")]
TimeLimit = Annotated[float, Field(gt=0, allow_inf_nan=False, description="seconds; capped by the server")]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- requests -------------------------------------------------------------------------------------
class PlanRequest(_In):
    graph: Graph = Field(description="the training step, in memplan.graph/1 form (memplan profile)")
    budget: Budget | None = Field(default=None, description="None (and no budget_fraction): no limit (the "
                                                          "keep-everything peak)")
    budget_fraction: float | None = Field(
        default=None, ge=0, le=10, allow_inf_nan=False,
        description="the budget as a fraction of the keep-everything activation memory, fixed memory added "
                    "back (0.5 is the same as budget '50%'); give this or budget, not both")
    solver: SolverName = "auto"
    time_limit_s: TimeLimit | None = Field(default=None, description="None: the server's default")
    offload: bool = Field(default=False, description="let the solver offload activations to host memory")
    host_budget: Budget | None = Field(default=None, description="pinned host memory cap for offload")


class SimulateRequest(_In):
    graph: Graph
    plan: Plan | None = Field(default=None, description="memplan.plan/1; None: keep everything")
    timeline: bool = Field(default=False, description="include the per-step memory timeline")


DEFAULT_FRONTIER_BUDGETS = ["30%", "40%", "50%", "60%", "70%", "80%", "90%", "100%"]


class FrontierRequest(_In):
    graph: Graph
    budgets: list[Budget] = Field(default_factory=lambda: list(DEFAULT_FRONTIER_BUDGETS), min_length=1,
                                  max_length=64)
    solvers: list[SolverName] = Field(default_factory=lambda: ["auto"], min_length=1, max_length=8)
    time_limit_s: TimeLimit | None = Field(default=None, description="per solve; None: the server's default")
    offload: bool = False


# ---- responses ------------------------------------------------------------------------------------
class Predicted(_Out):
    """What the simulator predicts for the plan, beside keeping everything."""

    peak_bytes: int
    step_time_s: float
    recompute_time_s: float
    exposed_transfer_s: float
    host_peak_bytes: int
    transfer_bytes: int
    keep_all_peak_bytes: int
    keep_all_step_time_s: float
    overhead: float = Field(description="step time over keep-everything's, minus one")


class SolverStats(_Out):
    name: str = Field(description="the solver that ran ('auto' resolved)")
    requested: str
    status: Literal["optimal", "feasible", "timeout", "infeasible"]
    solve_time_s: float
    lower_bound_s: float | None = None
    gap: float | None = Field(default=None, description="relative optimality gap, where the solver has a bound")
    stats: dict[str, Any] = Field(default_factory=dict, description="solver-specific figures")


class PlanResponse(_Out):
    cache_hit: bool = Field(description="answered from the plan cache without solving")
    plan: Plan
    budget_bytes: int
    graph_fingerprint: str
    predicted: Predicted
    solver: SolverStats


class EventOut(_Out):
    phase: str
    op: int | None
    start_s: float
    live_bytes: int
    peak_bytes: int
    note: str = ""


class SimulationResponse(_Out):
    graph_fingerprint: str
    peak_bytes: int
    time_s: float
    forward_time_s: float
    backward_time_s: float
    recompute_time_s: float
    exposed_transfer_s: float
    optimizer_time_s: float
    transfer_bytes: int
    host_peak_bytes: int
    fixed_bytes: int
    recomputed_ops: int
    peak_phase: str
    peak_op: int | None
    peak_note: str
    timeline: list[EventOut] | None = Field(default=None, description="only when asked for")


class FrontierPoint(_Out):
    budget: str = Field(description="the budget as given")
    budget_bytes: int
    overhead: float | None = Field(description="predicted step-time overhead; None: infeasible")


class FrontierSeries(_Out):
    solver: str
    points: list[FrontierPoint]


class FrontierResponse(_Out):
    graph_fingerprint: str
    keep_all_peak_bytes: int
    keep_all_step_time_s: float
    series: list[FrontierSeries]


class SolverOut(_Out):
    name: str
    description: str
    graphs: str = Field(description="'chain' (solves the coarsened chain) or 'dag'")
    exact: bool
    offload: bool
    max_saved_activations: int | None


class SolversResponse(_Out):
    default: str = "auto"
    solvers: list[SolverOut]


class Health(_Out):
    status: Literal["ok"] = "ok"
    version: str
    pool: str
    workers: int
    busy: int = Field(description="workers running a job now")
    queued: int = Field(description="requests waiting for a worker")


class ErrorBody(_Out):
    detail: str = Field(description="what is wrong, naming the culprit")
    error: str = Field(description="stable code: graph_error, plan_error, plan_mismatch, infeasible, "
                                   "limit_exceeded, invalid_request, overloaded, solve_timeout, ...")
    field: str | None = Field(default=None, description="the offending request field, dotted")
    limit: str | None = Field(default=None, description="the server limit exceeded (a Settings field)")
    limit_value: float | None = None
    budget_bytes: int | None = None
    min_feasible_bytes: int | None = Field(default=None, description="infeasible: the smallest budget known to fit")


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorBody, "description": "the body could not be decoded (not UTF-8 JSON)"},
    413: {"model": ErrorBody, "description": "request body over the server's max_body_bytes"},
    422: {"model": ErrorBody, "description": "invalid input, over a limit, or infeasible"},
    503: {"model": ErrorBody, "description": "every worker busy and the queue full; retry later"},
    504: {"model": ErrorBody, "description": "the job ran past its time limit plus the grace period"},
}
