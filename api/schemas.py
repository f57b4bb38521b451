"""Request and response bodies of the REST service (pydantic v2).

The graph and the plan travel in their file formats (``memplan.graph/1``, ``memplan.plan/1``): those are
memplan's public exchange formats. Everything else here is the wire form of the service, kept separate
from the internal types (``SolveResult``, ``Report``, ``SolverSpec``) so that either can change alone.

The request models are where a request is refused: types are strict (the OpenAPI schema says exactly
what is accepted: ``timeline: 0`` is not a boolean), byte counts and budgets are capped at 2^50, and the
server's limits (:class:`memplan.api.settings.Settings`, handed in as the validation context under
``"settings"``) are checked in model validators. :func:`parse_request` is how the routes read a body.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    model_validator,
)

from memplan.api.errors import LimitExceeded
from memplan.api.jobs import check_finite
from memplan.api.settings import Settings
from memplan.planner.core.errors import MemplanError
from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Plan
from memplan.planner.core.units import MAX_BUDGET_FRACTION, MAX_BYTES, check_budget

# The string form of a budget, as a pattern: the schema documents it and the validator applies it, then
# reads the string with the CLI's parser (planner/core/units.py).
_SIZE_PATTERN = r"[0-9]*\.?[0-9]+([eE][+-]?[0-9]+)?\s*(([kKmMgGtT][iI]?)?[bB]|[kKmMgG])?"
_BUDGET_PATTERN = rf"^\s*({_SIZE_PATTERN}|[0-9]*\.?[0-9]+\s*%)\s*$"
_HOST_BUDGET_PATTERN = rf"^\s*{_SIZE_PATTERN}\s*$"
_MAX_BUDGET_CHARS = 64


def _budget_validator(pattern: str, what: str) -> Callable[[Any], int | str]:
    def validate(value: Any) -> int | str:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError(f"expected {what}, got {type(value).__name__}")
        if isinstance(value, str) and not (1 <= len(value) <= _MAX_BUDGET_CHARS and re.match(pattern, value)):
            shown = value if len(value) <= _MAX_BUDGET_CHARS else f"a string of {len(value)} characters"
            raise ValueError(f"cannot read {shown!r} as {what} (at most {_MAX_BUDGET_CHARS} characters)")
        try:
            check_budget(value)
        except MemplanError as e:
            raise ValueError(str(e)) from None
        return value

    return validate


def _budget_schema(pattern: str, description: str, examples: list[Any]) -> dict[str, Any]:
    return {"anyOf": [{"type": "integer", "minimum": 0, "maximum": MAX_BYTES},
                      {"type": "string", "minLength": 1, "maxLength": _MAX_BUDGET_CHARS, "pattern": pattern}],
            "description": description, "examples": examples}


# One validator per field, refusing with one sentence (a union would report a failure for each member).
Budget = Annotated[
    int | str,
    PlainValidator(_budget_validator(_BUDGET_PATTERN, "a budget: bytes (an integer) or a string such as '6GiB' "
                                                      "or '50%'")),
    WithJsonSchema(_budget_schema(
        _BUDGET_PATTERN, "device bytes (fixed memory included) as an integer (at most 2^50), or a string: '6GiB', "
                         "'512MB', '123456', or '50%' (fixed memory plus that share of the keep-everything "
                         "activation memory, 0% to 1000%)", ["50%", "6GiB", 1048576])),
]
HostBudget = Annotated[
    int | str,
    PlainValidator(_budget_validator(_HOST_BUDGET_PATTERN, "host bytes: an integer or a string such as '8GiB' "
                                                           "(not a percentage)")),
    WithJsonSchema(_budget_schema(_HOST_BUDGET_PATTERN, "pinned host bytes as an integer (at most 2^50) or a "
                                                        "string such as '8GiB' (not a percentage)", ["8GiB", 1048576])),
]
def _solver_names() -> list[str]:
    from memplan.solvers import solvers

    return ["auto", *sorted(solvers())]


def _known_solver(name: str) -> str:
    names = _solver_names()
    if name not in names:
        raise ValueError(f"unknown solver {name!r}; known: {', '.join(names)}")
    return name


def _solver_enum(schema: dict[str, Any]) -> None:
    schema["enum"] = _solver_names()  # at schema time: the solvers registered in this server


SolverName = Annotated[str, AfterValidator(_known_solver),
                       Field(description="a name from GET /v1/solvers, or 'auto'", json_schema_extra=_solver_enum)]
TimeLimit = Annotated[float, Field(gt=0, allow_inf_nan=False, description="seconds; capped by the server "
                                                                          "(max_time_limit_s)")]
StatesChoice = Literal["auto", "stream", "host", "none"]
"""Where a request lets the solver move units' optimizer state (solve's ``states``:
:func:`memplan.api.jobs.solve_states` maps one to the other)."""
STATES_DESCRIPTION = (
    "where the solver may move each unit's optimizer state: 'auto' (streamed through the device for its "
    "update, or stepped on the host, whichever the search finds faster), 'stream' or 'host' (that way only), "
    "'none' (activations only); absent: as offload says (offload moves model states too). Without offload, "
    "'auto', 'stream' and 'host' move model states alone")


def check_states(states: str | None, fuse: str | None) -> None:
    """Refuse a model-state placement with forward fusion: the solver searches placements for unfused and
    backward-fused steps only (it would plan the activations alone without saying so)."""
    if states not in (None, "none") and fuse == "forward":
        raise ValueError(f"states {states!r} with fuse 'forward': model states are placed for unfused or "
                         f"backward-fused steps only; give fuse 'backward', no fuse, or states 'none'")

def _check_graph_sizes(graph: Graph) -> Graph:
    """Refuse figures too large to add up (each byte field is capped at 2^50 by the graph model itself,
    :data:`memplan.planner.core.graph.MAX_BYTES`, naming the field)."""
    try:
        check_finite(graph)
    except MemplanError as e:
        raise ValueError(str(e).removeprefix("graph: ")) from None
    return graph


CheckedGraph = Annotated[Graph, AfterValidator(_check_graph_sizes),
                         Field(description="the training step, in memplan.graph/1 form (memplan profile)")]


def settings_of(info: ValidationInfo) -> Settings | None:
    return (info.context or {}).get("settings")


def check_ops(graph: Graph, settings: Settings) -> None:
    if len(graph.ops) > settings.max_ops:
        raise LimitExceeded(f"graph has {len(graph.ops)} ops; this server plans graphs of at most "
                            f"{settings.max_ops} ops (max_ops)", limit="max_ops", limit_value=settings.max_ops)


def check_time_limit(requested_s: float | None, settings: Settings, *, solves: int = 1) -> None:
    if requested_s is None or requested_s * solves <= settings.max_time_limit_s:
        return
    what = (f"time_limit_s {requested_s:g} s" if solves == 1
            else f"{solves} solves of time_limit_s {requested_s:g} s ({requested_s * solves:g} s)")
    raise LimitExceeded(f"{what} is over this server's cap of {settings.max_time_limit_s:g} s (max_time_limit_s)",
                        limit="max_time_limit_s", limit_value=settings.max_time_limit_s)


class _In(BaseModel):
    # strict: what the schema says is what is accepted (no "1" for 1, no 0 for false)
    model_config = ConfigDict(extra="forbid", strict=True)


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- requests -------------------------------------------------------------------------------------
class PlanRequest(_In):
    graph: CheckedGraph
    budget: Budget | None = Field(default=None, description="None (and no budget_fraction): no limit (the "
                                                          "keep-everything peak)")
    budget_fraction: float | None = Field(
        default=None, ge=0, le=MAX_BUDGET_FRACTION, allow_inf_nan=False,
        description="the budget as a fraction of the keep-everything activation memory, fixed memory added "
                    "back (0.5 is the same as budget '50%'); give this or budget, not both")
    solver: SolverName = "auto"
    time_limit_s: TimeLimit | None = Field(default=None, description="None: the server's default")
    offload: bool = Field(default=False, description="let the solver offload activations to host memory")
    host_budget: HostBudget | None = Field(default=None, description="pinned host memory cap for what the "
                                                                    "plan puts there (offloaded activations, "
                                                                    "streamed or host-stepped optimizer state)")
    states: StatesChoice | None = Field(default=None, description=STATES_DESCRIPTION)
    fuse: Literal["backward", "forward"] | None = Field(
        default=None, description="'backward' (or 'forward'): the training loop steps the optimizer inside "
                                  "backward (before each module's next forward); plan for that step's peak "
                                  "(predicted is then that step's)")

    @model_validator(mode="after")
    def _one_budget_within_limits(self, info: ValidationInfo) -> PlanRequest:
        if self.budget is not None and self.budget_fraction is not None:
            raise ValueError("budget and budget_fraction: give one of them, not both")
        check_states(self.states, self.fuse)
        settings = settings_of(info)
        if settings is not None:
            check_ops(self.graph, settings)
            check_time_limit(self.time_limit_s, settings)
        return self


class SimulateRequest(_In):
    graph: CheckedGraph
    plan: Plan | None = Field(default=None, description="memplan.plan/1; None: keep everything")
    timeline: bool = Field(default=False, description="include the per-step memory timeline")
    fuse: Literal["backward", "forward"] | None = Field(
        default=None, description="the optimizer's steps fused into backward or forward (what the graph's "
                                  "profile measured them to cost, and backward fusion's early frees)")

    @model_validator(mode="after")
    def _within_limits(self, info: ValidationInfo) -> SimulateRequest:
        settings = settings_of(info)
        if settings is not None:
            check_ops(self.graph, settings)
        return self


DEFAULT_FRONTIER_BUDGETS = ["30%", "40%", "50%", "60%", "70%", "80%", "90%", "100%"]


class FrontierRequest(_In):
    graph: CheckedGraph
    budgets: list[Budget] = Field(default_factory=lambda: list(DEFAULT_FRONTIER_BUDGETS), min_length=1,
                                  max_length=64)
    solvers: list[SolverName] = Field(default_factory=lambda: ["auto"], min_length=1, max_length=8)
    time_limit_s: TimeLimit | None = Field(default=None, description="per solve; None: the server's default")
    offload: bool = False
    states: StatesChoice | None = Field(default=None, description=STATES_DESCRIPTION)

    @model_validator(mode="after")
    def _within_limits(self, info: ValidationInfo) -> FrontierRequest:
        settings = settings_of(info)
        if settings is None:
            return self
        check_ops(self.graph, settings)
        solves = len(self.budgets) * len(self.solvers)
        if solves > settings.max_frontier_points:
            raise LimitExceeded(
                f"{len(self.budgets)} budgets x {len(self.solvers)} solvers = {solves} solves; this server computes "
                f"at most {settings.max_frontier_points} per request (max_frontier_points)",
                limit="max_frontier_points", limit_value=settings.max_frontier_points)
        check_time_limit(self.time_limit_s, settings, solves=solves)
        return self


M = TypeVar("M", bound=BaseModel)


def parse_request(model: type[M], body: bytes, settings: Settings | None) -> M:
    """``body`` (JSON bytes) validated as ``model`` with the server's ``settings`` as context. JSON is
    parsed by pydantic-core: lone surrogates, nesting past its depth limit and malformed text are
    ``ValidationError`` s (``json_invalid``), as are values over the caps; the limits raise
    :class:`LimitExceeded`."""
    return model.model_validate_json(body, strict=True, context={"settings": settings})


@dataclass(frozen=True)
class ReadRequest(Generic[M]):
    """A request body as a parse worker read it (:func:`read_request`)."""

    fields: dict[str, Any]
    """The request model's fields but ``graph``, validated (a simulate request's plan is a ``Plan``)."""
    graph_json: str
    """The graph as canonical JSON text: what the plan cache key hashes and a worker process reads."""
    graph: Graph | None
    """The graph itself when it was read in this process (a thread pool shares objects), else None."""


def read_request(model: type[M], body: bytes, settings: Settings | None, *, keep_graph: bool
                 ) -> tuple[str, Any]:
    """What a parse worker runs: ``("ok", ReadRequest)``, ``("invalid", [first error])`` (pydantic's error
    dict, made plain so that it pickles) or ``("limit", (message, limit, limit_value))``.

    A maximal body takes seconds to parse and pydantic-core holds the GIL meanwhile, so the server runs
    this in a process of its own (:class:`memplan.api.pool.WorkerPool`): its event loop keeps answering.
    """
    try:
        req = parse_request(model, body, settings)
    except ValidationError as e:
        err = e.errors(include_url=False, include_input=False)[0]
        plain = {"type": err["type"], "loc": tuple(err["loc"]), "msg": err["msg"]}
        if "ctx" in err:
            plain["ctx"] = {k: str(v) for k, v in err["ctx"].items()}
        return "invalid", [plain]
    except LimitExceeded as e:
        return "limit", (str(e), e.limit, e.limit_value)
    graph: Graph = req.graph  # type: ignore[attr-defined]  # every request model has one
    fields = {name: value for name, value in req if name != "graph"}
    return "ok", ReadRequest(fields, graph.model_dump_json(), graph if keep_graph else None)


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
    space: str = Field(default="all", description="the plans over which status and lower_bound_s hold: 'all' "
                                                  "(every action memplan executes that the request allows) or "
                                                  "the actions the solver searched, e.g. 'keep/recompute'")
    stats: dict[str, Any] = Field(default_factory=dict, description="solver-specific figures")


class PredictedParts(_Out):
    """The predicted step in parts, seconds (the simulator's report)."""

    forward: float
    backward: float
    recompute: float
    exposed_transfers: float = Field(description="copies (activations, streamed state) compute waits for")
    optimizer: float = Field(description="the device's optimizer step")
    host_optimizer: float = Field(description="host-stepped units' optimizer steps, on the host")
    waits_for_host: float = Field(description="what compute waits for the host steps and their copies")


class StateSummary(_Out):
    """What the plan does with the model states (``memplan solve --json`` prints the same figures)."""

    state_units: int = Field(description="units whose optimizer state a plan may place (the graph's state_units)")
    streamed_units: int = Field(description="units whose state is streamed through the device for its update")
    hosted_units: int = Field(description="units whose optimizer is stepped on the host")
    streamed_state_bytes: int
    hosted_state_bytes: int
    host_peak_bytes: int = Field(description="the host memory the plan holds at its peak (pinned)")
    predicted_parts_s: PredictedParts


class PlanResponse(_Out):
    cache_hit: bool = Field(description="answered from the plan cache without solving")
    plan: Plan
    budget_bytes: int
    graph_fingerprint: str
    predicted: Predicted
    state_summary: StateSummary
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
    status: str = Field(description="what the solve at this budget claims: optimal, feasible, timeout or "
                                    "infeasible")
    space: str | None = Field(description="the plans the status holds over ('all', or e.g. 'keep/recompute': "
                                          "another solver's plan from outside it can be faster); None: "
                                          "infeasible")


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
    status: Literal["ok", "degraded"] = Field(
        default="ok", description="degraded: the plan store cannot be reached (store_error says why); requests "
                                  "are still answered (solved), jobs get 503 with Retry-After")
    store: str = Field(default="", description="the plan store: a SQLite file or a postgresql:// URL (without its password)")
    store_error: str | None = None
    skipped_rows: int = Field(default=0, description="cache rows found damaged or foreign, not served")
    pending_writes: int = Field(default=0, description="store writes waiting for the database to come back")
    solved: int = Field(default=0, description="plans this replica's workers solved")
    bodies_read: int = Field(default=0, description="request bodies this replica's parse workers read")
    jobs: int = Field(default=0, description="jobs this replica runs now")
    replica: str = Field(default="", description="this server's name in the shared store")
    version: str
    pool: str
    workers: int
    busy: int = Field(description="workers running a job now")
    ready: int = Field(description="workers waiting for a job now (fewer than workers - busy while a "
                                   "stopped or dead worker's replacement starts)")
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
