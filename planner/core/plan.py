"""The plan file ``memplan.plan/1``: for each saved activation, keep / recompute / offload (and
``recompute_each``: recomputed, never kept by another tensor's replay).

Activations a plan does not list are kept. An offloaded activation is copied to host memory as soon as
it is produced and copied back when backward reaches ``prefetch_at`` (see docs/model.md).
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from memplan.planner.core.errors import PlanError, PlanMismatch, first_validation_error
from memplan.planner.core.files import parse_json_object, read_file_bytes
from memplan.planner.core.graph import Graph

PLAN_FORMAT = "memplan.plan/1"


class Action(str, Enum):
    """What a plan does with a saved activation between its forward use and its backward readers.

    ``keep``: stays on the device. ``offload``: copied to host, copied back for backward. ``recompute``:
    freed after its last forward use and rebuilt by a replay when backward needs it; a replay that
    re-creates it on the way to another tensor keeps it until its own backward (a checkpoint left behind,
    as checkpointing keeps a segment). ``recompute_each``: the same, except that a replay which re-creates
    it for another tensor frees it after its last use there: it is rebuilt again when its own backward
    needs it (multi-level checkpointing: memory held by replays for compute spent again; docs/model.md).
    """

    KEEP = "keep"
    RECOMPUTE = "recompute"
    OFFLOAD = "offload"
    RECOMPUTE_EACH = "recompute_each"

    @property
    def rebuilds(self) -> bool:
        """Freed after forward and rebuilt by a replay for backward (``recompute`` or ``recompute_each``)."""
        return self in (Action.RECOMPUTE, Action.RECOMPUTE_EACH)


class Decision(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tensor: int = Field(ge=0, description="tensor id in the graph (a saved activation)")
    action: Action
    prefetch_at: int | None = Field(
        default=None, ge=0,
        description="offload only: the copy back starts when backward reaches this op (its backward "
                    "step is about to run); must be at or after (in forward order: at or above) the "
                    "last op whose backward reads the tensor. None: just before that op")


class SolverInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = "manual"
    settings: dict[str, Any] = Field(default_factory=dict)
    status: str = "feasible"
    solve_time_s: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    lower_bound_s: float | None = Field(default=None, description="a bound on the step time, where known")
    gap: float | None = Field(default=None, description="relative optimality gap, where known")
    space: str | None = Field(
        default=None, description="the plans over which status and lower_bound_s hold: 'all' (every action "
                                  "memplan executes that the request allows), or the actions searched, e.g. "
                                  "'keep/recompute'; None: not stated (a plan by hand, or an older memplan)")


class Prediction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    peak_bytes: int = Field(ge=0)
    step_time_s: float = Field(ge=0.0, allow_inf_nan=False)
    recompute_time_s: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    exposed_transfer_s: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)


class StateDecision(BaseModel):
    """Where one state unit's model states live (planner/core/states.py): its optimizer state ``resident``
    on the device; in the host pool and streamed through the device for its update (``stream``); or in the
    host pool and updated there (``host``: its gradients leave the device as backward completes them, the
    host runs the optimizer, the updated parameters are copied back)."""

    model_config = ConfigDict(extra="forbid")

    unit: int = Field(ge=0, description="index into the graph's state_units")
    module: str = Field(default="", description="the unit's module, as the graph names it (checked)")
    optimizer_state: Literal["resident", "stream", "host"] = "resident"


class Plan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: str = PLAN_FORMAT
    graph_fingerprint: str = ""
    model_fingerprint: str = ""
    budget_bytes: int | None = Field(default=None, ge=0)
    host_budget_bytes: int | None = Field(default=None, ge=0, description="pinned host memory for offload")
    bandwidth_bytes_per_s: float | None = Field(
        default=None, gt=0, allow_inf_nan=False, description="overrides the graph's host bandwidth")
    solver: SolverInfo = Field(default_factory=SolverInfo)
    decisions: list[Decision] = Field(default_factory=list)
    states: list[StateDecision] = Field(
        default_factory=list, description="model-state placements; units not listed are resident (a plan "
                                          "without them places nothing)")
    predicted: Prediction | None = None

    @field_validator("format")
    @classmethod
    def _known_format(cls, v: str) -> str:
        if v != PLAN_FORMAT:
            raise ValueError(f"unknown plan format version {v!r}; this memplan reads {PLAN_FORMAT!r}")
        return v

    @field_validator("decisions")
    @classmethod
    def _unique(cls, v: list[Decision]) -> list[Decision]:
        seen: set[int] = set()
        for d in v:
            if d.tensor in seen:
                raise ValueError(f"tensor {d.tensor} has more than one decision")
            seen.add(d.tensor)
        return v

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def keep_all(cls, graph: Graph, **kw: Any) -> Plan:
        return cls.for_graph(graph, {}, **kw)

    @classmethod
    def for_graph(cls, graph: Graph, actions: dict[int, Action | str],
                  prefetch_at: dict[int, int] | None = None, **kw: Any) -> Plan:
        """A plan for ``graph`` from ``{tensor id: action}``; unlisted saved activations are kept."""
        prefetch_at = prefetch_at or {}
        decisions = [
            Decision(tensor=t, action=Action(actions.get(t, Action.KEEP)), prefetch_at=prefetch_at.get(t))
            for t in graph.saved_activations
        ]
        return cls(graph_fingerprint=graph.fingerprint, model_fingerprint=graph.model_fingerprint,
                   decisions=decisions, **kw)

    def streamed(self) -> list[int]:
        """The state units whose optimizer state is streamed, in the order the plan lists them."""
        return [d.unit for d in self.states if d.optimizer_state == "stream"]

    def hosted(self) -> list[int]:
        """The state units whose optimizer runs on the host, in the order the plan lists them."""
        return [d.unit for d in self.states if d.optimizer_state == "host"]

    def with_states(self, graph: Graph, streamed: list[int], hosted: list[int] = ()) -> Plan:
        """This plan with ``streamed`` units' optimizer state streamed, ``hosted`` units' stepped on the host
        (and every other unit resident)."""
        where = {**{u: "stream" for u in streamed}, **{u: "host" for u in hosted}}
        if len(where) != len(streamed) + len(hosted):
            raise PlanError("a state unit is both streamed and stepped on the host")
        order = [*streamed, *hosted, *(u for u in range(len(graph.state_units)) if u not in where)]
        states = [StateDecision(unit=u, module=graph.state_units[u].module,
                                optimizer_state=where.get(u, "resident")) for u in order]
        return self.model_copy(update={"states": states})

    def actions(self) -> dict[int, Action]:
        return {d.tensor: d.action for d in self.decisions}

    def count(self, action: Action) -> int:
        return sum(1 for d in self.decisions if d.action == action)

    # ---- checking against a graph ---------------------------------------------------------------
    def check_against(self, graph: Graph) -> None:
        """Raise :class:`PlanMismatch` / :class:`PlanError` if this plan does not fit ``graph``."""
        if self.graph_fingerprint and self.graph_fingerprint != graph.fingerprint:
            raise PlanMismatch(
                f"plan was made for graph {self.graph_fingerprint}, but this graph is {graph.fingerprint} "
                f"({graph.name}): re-solve for this graph")
        seen: set[int] = set()
        for sd in self.states:
            if sd.unit >= len(graph.state_units):
                raise PlanError(f"state decision names unit {sd.unit}, but the graph has {len(graph.state_units)} "
                                f"state units" + ("" if graph.state_units else
                                                  " (profiled before they were recorded: re-profile)"))
            if sd.unit in seen:
                raise PlanError(f"state unit {sd.unit} has more than one decision")
            seen.add(sd.unit)
            if sd.module != graph.state_units[sd.unit].module:
                raise PlanMismatch(f"state unit {sd.unit} is module {graph.state_units[sd.unit].module!r} in the "
                                   f"graph, {sd.module!r} in the plan: re-solve for this graph")
        saved = set(graph.saved_activations)
        for d in self.decisions:
            if d.tensor >= len(graph.tensors):
                raise PlanError(f"decision names tensor {d.tensor}, but the graph has {len(graph.tensors)}")
            if d.tensor not in saved:
                raise PlanError(f"decision names tensor {d.tensor}, which is not an activation saved "
                                f"for backward; only saved activations can be planned")
            t = graph.tensors[d.tensor]
            if d.action.rebuilds and not t.recomputable:
                raise PlanError(f"tensor {d.tensor} (output of op {t.producer} "
                                f"{graph.ops[t.producer].name}) cannot be recomputed: it is mutated in "
                                f"place or its producer cannot be replayed")
            if d.prefetch_at is not None:
                if d.action != Action.OFFLOAD:
                    raise PlanError(f"tensor {d.tensor}: prefetch_at is only meaningful for offload")
                if d.prefetch_at >= len(graph.ops):
                    raise PlanError(f"tensor {d.tensor}: prefetch_at {d.prefetch_at} is not an op id")
                first_bwd_user = max(graph.savers[d.tensor])
                if d.prefetch_at < first_bwd_user:
                    raise PlanError(
                        f"tensor {d.tensor}: prefetch_at op {d.prefetch_at} comes after its first "
                        f"backward use (op {first_bwd_user}); it must be >= {first_bwd_user}")

    # ---- files -----------------------------------------------------------------------------------
    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = "plan") -> Plan:
        data = parse_json_object(text, source=source, error=PlanError,
                                 expected=f"a JSON object with format {PLAN_FORMAT!r}")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise PlanError(f"{source}: {first_validation_error(e)}") from None

    @classmethod
    def load(cls, path: str) -> Plan:
        return cls.from_json(read_file_bytes(path, what="plan file", error=PlanError), source=str(path))

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.model_dump_json(indent=1))
