"""The graph of one training step: forward ATen operators, the tensors (storages) they create and read,
which of them backward saves, and the fixed memory around them.

File format ``memplan.graph/1`` (JSON), modelled with pydantic v2. Ops are listed in execution order and
``ops[i].id == i``; tensors likewise (``tensors[j].id == j``). A tensor here is a *storage*: views and
in-place results are resolved to the storage they alias, so no byte is counted twice. Edges are implied
by ``Op.inputs`` (tensor ids read) and ``TensorInfo.producer`` (op id that created the storage).

See ``docs/model.md`` for what the simulator makes of these fields.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict, deque
from dataclasses import dataclass, field
from functools import cached_property
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from memplan.planner.core.errors import GraphError, first_validation_error
from memplan.planner.core.files import parse_json_object, read_file_bytes
from memplan.planner.core.units import MAX_BYTES  # 1 PiB: no device holds more; beyond is a unit mistake

GRAPH_FORMAT = "memplan.graph/1"
#: autograd's detach of an op's output when the op saves it: in the profiled graph, but not dispatched under
#: saved-tensor hooks (the executor steps over it)
DETACH = "aten.detach.default"

MAX_TOTAL_BYTES = 2**56  # all of a graph's byte figures together (sums stay far from int64's 2^63)


def _device_sized(v: int) -> int:
    if v > MAX_BYTES:
        raise ValueError(f"{v} B is beyond any device (over 2^50 B = 1 PiB); check its unit")
    return v


NonNegBytes = Annotated[int, Field(ge=0, description="bytes, >= 0 and <= 2^50"), AfterValidator(_device_sized)]
FuseMode = Literal["backward", "forward"]
FUSE_MODES: tuple[str, ...] = get_args(FuseMode)  # where a step's optimizer updates may be fused
Seconds = Annotated[float, Field(ge=0.0, allow_inf_nan=False, description="seconds, finite, >= 0")]
TensorKind = Literal["activation", "param", "buffer", "input"]


# Keys of the views computed once per graph (cached_property and the simulator's static facts).
_DERIVED_VIEWS = ("consumers", "savers", "saved_activations", "fingerprint", "_memplan_sim_static",
                  "_memplan_replay_facts", "_memplan_multilevel")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False, validate_assignment=False)


class TensorInfo(_Strict):
    """One storage. ``activation``s are created by an op of the step; the others exist before it."""

    id: int = Field(ge=0)
    kind: TensorKind
    producer: int | None = Field(default=None, ge=0, description="op id that created it (activations)")
    output_index: int = Field(default=0, ge=0, description="position among the producer's new storages")
    bytes: NonNegBytes
    dtype: str = "float32"
    shape: list[int] = Field(default_factory=list)
    requires_grad: bool = False
    freed_after: int | None = Field(
        default=None, ge=0,
        description="activations: the op after which the profiled forward freed it (its last Python "
                    "reference went); None when it lived into backward")
    held_by_caller: bool = Field(
        default=False, description="still alive after backward in the profiled step (model outputs, the "
                                   "loss): freed only when the step ends")
    recomputable: bool = Field(
        default=True,
        description="False when its content cannot be rebuilt by re-running its producer (and its "
                    "rebuilt_by ops): mutated in place by ops the profiler does not accept as a chain, "
                    "produced by an op that writes into its inputs, or rebuilt by an op that reads a tensor "
                    "a later op writes in place")
    rebuilt_by: list[int] = Field(
        default_factory=list,
        description="ops that finish it in place after its producer (dropout's bernoulli_ and div_ into an "
                    "empty_like, an in-place ReLU, x += residual, a recurrent cell's gates): a replay re-runs "
                    "them after the producer, in forward order")

    @field_validator("shape")
    @classmethod
    def _shape_non_negative(cls, v: list[int]) -> list[int]:
        if any(d < 0 for d in v):
            raise ValueError(f"shape has a negative dimension: {v}")
        return v


class Op(_Strict):
    """One forward ATen operator and, folded into it, the backward of its autograd node."""

    id: int = Field(ge=0)
    name: str = Field(min_length=1, description="ATen overload, e.g. 'aten.mm.default'")
    module: str = Field(default="", description="module path that ran it, e.g. 'transformer.h.3.attn'")
    time_s: Seconds = 0.0
    backward_time_s: Seconds = 0.0
    inputs: list[int] = Field(default_factory=list, description="tensor ids read (storages)")
    outputs: list[int] = Field(default_factory=list, description="tensor ids of the storages it creates")
    saved: list[int] = Field(default_factory=list, description="tensor ids its backward keeps")
    workspace_bytes: NonNegBytes = 0
    backward_workspace_bytes: NonNegBytes = Field(0, description="transient bytes of its backward step")
    backward_grad_alloc_bytes: NonNegBytes = Field(
        0, description="gradient bytes its backward step creates that outlive the step (parameter "
                       "gradients included); measured, since pass-through and in-place grads alias")
    backward_grad_free_bytes: NonNegBytes = Field(
        0, description="gradient bytes, created by earlier backward steps, that its step releases")
    has_backward: bool = False
    random: bool = Field(default=False, description="draws random numbers (dropout): replay restores RNG")
    time_source: Literal["measured", "isolated", "analytic"] = Field(
        default="measured",
        description="how time_s and backward_time_s were obtained: measured in the profiled step, each ATen "
                    "call run alone on tensors of its shapes (a fake profile), or a roofline from FLOPs and "
                    "bytes (analytic wherever any of its calls was)")


class ModuleCall(_Strict):
    """One call of a module in the profiled forward: its path (as ``named_modules`` names it, ``""`` for
    the root) and the forward ops it ran, ``start`` to ``end`` (exclusive; its submodules' ops included).
    Listed in the order the calls began; the n-th entry of a path is that module's n-th call."""

    path: str
    start: int = Field(ge=0)
    end: int = Field(ge=0)


class FusedStep(_Strict):
    """One bucket of optimizer fusion into backward (a module's own parameters, planner/probe/fusion.py):
    where the profiled backward made its last gradient final, and its memory. Under
    ``simulate(..., fuse="backward")`` the bucket is stepped right after that backward step (its frees
    included) and its gradients are freed."""

    after: int = Field(ge=0, description="the op whose backward step completes the bucket's gradients")
    module: str = Field(default="", description="the module that owns the bucket's parameters")
    grad_bytes: NonNegBytes = Field(description="its parameters' gradients, freed once it is stepped")
    step_bytes: NonNegBytes = Field(0, description="transient memory of stepping it (its share of "
                                                   "optimizer_step_bytes, by gradient bytes)")


class StateUnit(_Strict):
    """One unit of the optimizer's parameters whose model states a plan places (planner/core/states.py): a
    module's own parameters that the optimizer steps, as optimizer fusion buckets them
    (planner/probe/fusion.py ``buckets``), in that order. Its optimizer state lives on the device between steps
    (resident) or in the pinned host pool, streamed in for its update (a plan's ``states``)."""

    module: str = Field(default="", description="the module that owns the unit's parameters")
    params: int = Field(ge=0, description="how many parameters it holds")
    param_bytes: NonNegBytes = Field(description="its parameters (device bytes)")
    state_bytes: NonNegBytes = Field(description="its optimizer state on the device between steps (moments, "
                                                 "step counters on the device), as the allocator charges it")
    state_tensors: int = Field(0, ge=0, description="how many state tensors it holds on the device")


class FixedMemory(_Strict):
    """Memory that no plan changes. Parameter gradients are not here: the simulator allocates each one
    when backward first produces it (the step starts with ``grad=None``)."""

    params_bytes: NonNegBytes = 0
    buffers_bytes: NonNegBytes = 0
    inputs_bytes: NonNegBytes = 0
    optimizer_state_bytes: NonNegBytes = 0
    optimizer_step_bytes: NonNegBytes = Field(0, description="transient memory of optimizer.step()")
    other_bytes: NonNegBytes = Field(0, description="anything else live at the start of the step")

    @property
    def resident_bytes(self) -> int:
        """What is live at the start of a step: all of the above but the step's transient."""
        return (self.params_bytes + self.buffers_bytes + self.inputs_bytes + self.optimizer_state_bytes
                + self.other_bytes)


class Measured(_Strict):
    """What the profiler measured directly (informative; the simulator does not read it)."""

    peak_bytes: NonNegBytes | None = None
    step_time_s: Seconds | None = None
    forward_time_s: Seconds | None = None
    backward_time_s: Seconds | None = None


class Graph(_Strict):
    """An operator-level DAG of one training step (forward, loss, backward, optimizer step)."""

    format: str = GRAPH_FORMAT
    name: str = "graph"
    device: str = "cpu"
    model_fingerprint: str = ""
    tensors: list[TensorInfo] = Field(default_factory=list)
    ops: list[Op] = Field(default_factory=list)
    fixed: FixedMemory = Field(default_factory=FixedMemory)
    optimizer_time_s: Seconds = 0.0
    replay_op_dispatch_s: Seconds = Field(
        default=0.0, description="what the executor pays per replayed op beyond the op itself (its dispatch)")
    watch_op_dispatch_s: Seconds = Field(
        default=0.0, description="what the executor pays per forward op it watches under a plan (its dispatch "
                                 "mode), beyond the op itself (planner/core/watch.py)")
    fused_extra_s: dict[FuseMode, Annotated[float, Field(allow_inf_nan=False, ge=-1e6, le=1e6)]] = Field(
        default_factory=dict,
        description="what fusing the optimizer's updates into backward or forward adds to a keep-everything step "
                    "beyond the plain one (negative: saves), measured by the profiler when asked "
                    "(profile(fuse=...)); the simulator adds it under simulate(..., fuse=...)")
    host_bandwidth_bytes_per_s: float = Field(
        default=12e9, gt=0, allow_inf_nan=False,
        description="device<->host copy bandwidth for offload (measured on CUDA, nominal on CPU)")
    host_optimizer_bytes_per_s: float | None = Field(
        default=None, gt=0, allow_inf_nan=False,
        description="parameter bytes per second the host steps with the profiled optimizer (its class and "
                    "hyper-parameters on CPU tensors), measured on the profiling host; None: not measured "
                    "(no unit's optimizer can be placed on the host)")
    host_optimizer_call_s: Seconds = Field(
        default=0.0, description="what one host optimizer call takes beyond its bytes (a unit's update: this "
                                 "plus its parameter bytes at host_optimizer_bytes_per_s)")
    measured: Measured = Field(default_factory=Measured)
    fused_backward: list[FusedStep] = Field(
        default_factory=list,
        description="the buckets a backward-fused step steps inside backward, in the order it completes them "
                    "(empty in graphs from before they were recorded: those predict the unfused step)")
    state_units: list[StateUnit] = Field(
        default_factory=list,
        description="the units whose optimizer state a plan may place (planner/core/states.py), in the optimizer "
                    "fusion's bucket order; empty in graphs from before they were recorded (no state moves)")
    module_calls: list[ModuleCall] = Field(
        default_factory=list,
        description="each module call of the forward and its ops (where the executor re-synchronises a step "
                    "whose ops differ from these); empty in graphs from before it was recorded")
    meta: dict[str, Any] = Field(default_factory=dict)

    @field_validator("format")
    @classmethod
    def _known_format(cls, v: str) -> str:
        if v != GRAPH_FORMAT:
            raise ValueError(f"unknown graph format version {v!r}; this memplan reads {GRAPH_FORMAT!r}")
        return v

    @model_validator(mode="after")
    def _check_structure(self) -> Graph:
        _check_graph(self)
        return self

    # ---- loading and saving -------------------------------------------------------------------
    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = "graph") -> Graph:
        """Parse and validate; raises :class:`GraphError` naming the first problem."""
        return cls.from_dict(parse_json_object(text, source=source, error=GraphError,
                                               expected=f"a JSON object with format {GRAPH_FORMAT!r}"), source=source)

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "graph") -> Graph:
        if not isinstance(data, dict):
            raise GraphError(f"{source}: expected a JSON object with format {GRAPH_FORMAT!r}")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise GraphError(f"{source}: {first_validation_error(e)}") from None

    @classmethod
    def load(cls, path: str) -> Graph:
        return cls.from_json(read_file_bytes(path, what="graph file", error=GraphError), source=str(path))

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.model_dump_json(indent=1))

    # ---- derived views (not serialised) -------------------------------------------------------
    def invalidate(self) -> Graph:
        """Forget the derived views after editing a graph in place (they are computed once)."""
        for key in _DERIVED_VIEWS:
            self.__dict__.pop(key, None)
        return self

    @cached_property
    def consumers(self) -> dict[int, list[int]]:
        """tensor id -> ids of the ops that read it in forward, ascending."""
        out: dict[int, list[int]] = defaultdict(list)
        for op in self.ops:
            for t in dict.fromkeys(op.inputs):
                out[t].append(op.id)
        return dict(out)

    @cached_property
    def savers(self) -> dict[int, list[int]]:
        """tensor id -> ids of the ops whose backward saves it, ascending."""
        out: dict[int, list[int]] = defaultdict(list)
        for op in self.ops:
            for t in dict.fromkeys(op.saved):
                out[t].append(op.id)
        return dict(out)

    @cached_property
    def saved_activations(self) -> list[int]:
        """Ids of the activations that backward saves: the tensors a plan decides about."""
        return [t.id for t in self.tensors if t.kind == "activation" and t.id in self.savers]

    @cached_property
    def fingerprint(self) -> str:
        """Hash of the structure (ops, edges, sizes, saves), not of the timings: re-profiling the same
        model and batch gives the same fingerprint."""
        body = {
            "ops": [(o.name, o.inputs, o.outputs, o.saved, o.has_backward) for o in self.ops],
            "tensors": [(t.kind, t.producer, t.bytes, t.dtype, t.shape, t.requires_grad) for t in self.tensors],
        }
        return hashlib.sha256(json.dumps(body, separators=(",", ":")).encode()).hexdigest()[:16]

    def edges(self) -> list[tuple[int, int]]:
        """(producer op, consumer op) pairs through activations, deduplicated."""
        seen: set[tuple[int, int]] = set()
        for op in self.ops:
            for t in op.inputs:
                p = self.tensors[t].producer
                if p is not None and p != op.id:
                    seen.add((p, op.id))
        return sorted(seen)

    def activation_bytes_kept(self) -> int:
        """Bytes of all saved activations (what keep-everything holds for backward)."""
        return sum(self.tensors[t].bytes for t in self.saved_activations)


def _check_graph(g: Graph) -> None:
    """Structural checks the field types cannot express. Raises ValueError (pydantic wraps it)."""
    for i, t in enumerate(g.tensors):
        if t.id != i:
            raise ValueError(f"tensors[{i}] has id {t.id}; tensor ids must be 0..n-1 in order")
    n_t = len(g.tensors)
    for i, op in enumerate(g.ops):
        if op.id != i:
            raise ValueError(f"ops[{i}] has id {op.id}; op ids must be 0..n-1 in execution order")
    n_o = len(g.ops)
    total = g.fixed.resident_bytes + g.fixed.optimizer_step_bytes + sum(t.bytes for t in g.tensors) + sum(
        op.workspace_bytes + op.backward_workspace_bytes + op.backward_grad_alloc_bytes for op in g.ops)
    if total > MAX_TOTAL_BYTES:
        raise ValueError(f"the graph's byte figures add up to {total} B, beyond any device (over 2^56 B)")
    for t in g.tensors:
        if t.kind == "activation":
            if t.producer is None:
                raise ValueError(f"tensor {t.id} is an activation with no producer op")
            if t.producer >= n_o:
                raise ValueError(f"dangling edge: tensor {t.id} names producer op {t.producer}, "
                                 f"but the graph has {n_o} ops")
            if t.id not in g.ops[t.producer].outputs:
                raise ValueError(f"tensor {t.id} names producer op {t.producer} "
                                 f"({g.ops[t.producer].name}), which does not list it in its outputs")
        elif t.producer is not None:
            raise ValueError(f"tensor {t.id} is a {t.kind} but names producer op {t.producer}")
        for m in t.rebuilt_by:
            if t.producer is None or not t.producer < m < n_o:
                raise ValueError(f"tensor {t.id}: rebuilt_by names op {m}, which is not an op after its "
                                 f"producer ({t.producer}) in a graph of {n_o} ops")
            if t.id not in g.ops[m].inputs or g.ops[m].outputs:
                raise ValueError(f"tensor {t.id}: rebuilt_by op {m} ({g.ops[m].name}) must read it and "
                                 f"create no tensor (an in-place initialiser)")
    for op in g.ops:
        for field_name in ("inputs", "outputs", "saved"):
            for t in getattr(op, field_name):
                if not 0 <= t < n_t:
                    raise ValueError(f"dangling edge: op {op.id} ({op.name}) {field_name} names tensor {t}, "
                                     f"but the graph has {n_t} tensors")
        for t in op.outputs:
            if g.tensors[t].producer != op.id:
                raise ValueError(f"op {op.id} ({op.name}) lists tensor {t} as an output, but that tensor "
                                 f"names producer {g.tensors[t].producer}")
    states = sum(u.state_bytes for u in g.state_units)
    if states > g.fixed.optimizer_state_bytes:
        raise ValueError(f"state_units hold {states} B of optimizer state, more than fixed.optimizer_state_bytes "
                         f"({g.fixed.optimizer_state_bytes} B)")
    for f in g.fused_backward:
        if f.after >= n_o:
            raise ValueError(f"fused_backward: a bucket of {f.module or 'the model'} is completed after op "
                             f"{f.after}'s backward, but the graph has {n_o} ops")
    for c in g.module_calls:
        if not c.start <= c.end <= n_o:
            raise ValueError(f"module call {c.path!r} runs ops {c.start}..{c.end}, not a range of the graph's "
                             f"{n_o} ops")
    # Cycles: Kahn's algorithm over producer -> consumer edges.
    succ: dict[int, set[int]] = defaultdict(set)
    indeg = [0] * n_o
    for op in g.ops:
        for t in set(op.inputs) | set(op.saved):
            p = g.tensors[t].producer
            if p is not None and p != op.id and op.id not in succ[p]:
                succ[p].add(op.id)
                indeg[op.id] += 1
    queue = deque(i for i in range(n_o) if indeg[i] == 0)
    seen = 0
    while queue:
        u = queue.popleft()
        seen += 1
        for v in succ[u]:
            indeg[v] -= 1
            if indeg[v] == 0:
                queue.append(v)
    if seen < n_o:
        stuck = [i for i in range(n_o) if indeg[i] > 0][:6]
        raise ValueError(f"cycle: ops {stuck} depend on each other through their tensors")
    for op in g.ops:
        for t in set(op.inputs) | set(op.saved):
            p = g.tensors[t].producer
            if p is not None and p > op.id:
                raise ValueError(f"ops out of execution order: op {op.id} ({op.name}) reads tensor {t}, "
                                 f"produced by later op {p}")


# ---- the coarsened chain view -------------------------------------------------------------------


@dataclass(frozen=True)
class ChainStage:
    """A run of consecutive ops (a module such as a transformer block), seen as one chain stage.

    ``input_tensors`` are the activations alive across the boundary before the stage (produced earlier,
    read at or after it): what a checkpoint at that boundary must hold. ``saved_tensors`` are the
    activations the stage's ops save for backward (the rotor model's x-bar).
    """

    index: int
    name: str
    ops: tuple[int, ...]
    time_s: float
    backward_time_s: float
    input_tensors: tuple[int, ...]
    input_bytes: int
    saved_tensors: tuple[int, ...]
    saved_bytes: int
    workspace_bytes: int
    backward_workspace_bytes: int


@dataclass(frozen=True)
class Chain:
    graph_fingerprint: str
    depth: int
    stages: tuple[ChainStage, ...] = field(default_factory=tuple)

    def __len__(self) -> int:
        return len(self.stages)


def _prefix(module: str, depth: int) -> str:
    parts = [p for p in module.split(".") if p]
    return ".".join(parts[:depth])


def coarsen(graph: Graph, depth: int | None = None, max_stages: int = 64) -> Chain:
    """Derive a module-level chain from the op graph.

    Stages are maximal runs of consecutive ops whose module paths share the first ``depth`` components
    (e.g. depth 3 on GPT-2 gives ``transformer.h.0`` ... one stage per block). With ``depth=None`` the
    deepest depth giving at most ``max_stages`` stages is used. Tensors crossing a boundary (skips
    included) are the next stage's inputs, so a DAG coarsens too; chain solvers treat each boundary's
    crossing set as one checkpoint, and the simulator scores the resulting plan on the real graph.
    """
    if not graph.ops:
        return Chain(graph.fingerprint, 0, ())
    max_depth = max(len([p for p in o.module.split(".") if p]) for o in graph.ops)
    if depth is None:
        depth = 0
        for d in range(1, max_depth + 1):
            if len(_runs(graph, d)) <= max_stages:
                depth = d
    runs = _runs(graph, depth)
    last_use: dict[int, int] = {}
    for op in graph.ops:
        for t in op.inputs:
            last_use[t] = op.id
    # crossing into a stage that starts at op ``start``: activations made before it and read at or after
    # it; swept in op order (live: made so far, dropped once their last reader is behind), not a scan of
    # every tensor per stage, which is quadratic on the finest chains of graphs of thousands of ops
    made_by: dict[int, list[int]] = {}
    for t in graph.tensors:
        if t.kind == "activation" and t.producer is not None and t.id in last_use:
            made_by.setdefault(t.producer, []).append(t.id)
    live: set[int] = set()
    swept = 0
    stages = []
    for k, (name, ops) in enumerate(runs):
        start = ops[0]
        for o in range(swept, start):
            live.update(made_by.get(o, ()))
        swept = max(swept, start)
        live = {t for t in live if last_use[t] >= start}
        crossing = tuple(sorted(live))
        saved = tuple(dict.fromkeys(
            t for o in ops for t in graph.ops[o].saved if graph.tensors[t].kind == "activation"))
        stages.append(ChainStage(
            index=k, name=name, ops=tuple(ops),
            time_s=sum(graph.ops[o].time_s for o in ops),
            backward_time_s=sum(graph.ops[o].backward_time_s for o in ops),
            input_tensors=crossing, input_bytes=sum(graph.tensors[t].bytes for t in crossing),
            saved_tensors=saved, saved_bytes=sum(graph.tensors[t].bytes for t in saved),
            workspace_bytes=max((graph.ops[o].workspace_bytes for o in ops), default=0),
            backward_workspace_bytes=max((graph.ops[o].backward_workspace_bytes for o in ops), default=0),
        ))
    return Chain(graph.fingerprint, depth, tuple(stages))


def _runs(graph: Graph, depth: int) -> list[tuple[str, list[int]]]:
    runs: list[tuple[str, list[int]]] = []
    for op in graph.ops:
        key = _prefix(op.module, depth)
        if runs and runs[-1][0] == key:
            runs[-1][1].append(op.id)
        else:
            runs.append((key, [op.id]))
    return runs


def graph_json_schema() -> dict:
    return Graph.model_json_schema()
