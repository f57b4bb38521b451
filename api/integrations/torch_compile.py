"""torch.compile under a budget in bytes on the compiled step's measured peak.

``compile_with_budget(model, batch, loss_fn, budget_bytes)`` returns a compiled module (``module(batch)``
is the loss) whose training step (forward, backward, ``optimizer.step()``) was measured within the budget.

How: torch's min-cut partitioner, given ``activation_memory_budget`` strictly between 0 and 1, hands a
0-1 knapsack to ``torch._functorch.config.activation_memory_budget_solver``: which of its candidate
nodes (forward values it would otherwise ban from recomputation) to save and which to let its min-cut
recompute. :class:`MemplanKnapsack` is that solver (a ``torch._inductor.custom_graph_pass.
CustomKnapsackSolver``): it turns the joint graph's forward into a memplan :class:`Graph`
(:func:`graph_from_joint`: ops, storages, what backward reads, each op timed by memplan's op timer), and
asks memplan's :func:`~memplan.solvers.solve` for the fastest keep / recompute plan under a budget in
bytes; the candidates the plan keeps are saved, the others recomputed. The budget handed to the solver is
the user's less an offset the simulator of that graph does not see (optimizer state, gradients, inductor's
buffers: the measured peak less the simulated one), measured: each attempt compiles, measures the step's
peak with the allocator (:func:`memplan.planner.probe.measure.measure_step`) and, while it is over the
budget, lowers the solver's budget by the overshoot and compiles again.

What the partitioner lets it decide, and what not: only saved-or-recomputed among the candidates (the
min-cut then places the cut; what it saves besides them, and the backward's order, are its own); one
budget per compiled graph (a graph break would split the step into graphs that each get the whole budget:
refused, the model is compiled with ``fullgraph=True``); no offload (compile offloads only tagged nodes).
The measured peak is not monotonic in what is saved (recomputing every candidate can peak above saving
them all), so a budget is met by measurement, never by the prediction alone.
"""

from __future__ import annotations

import contextlib
import copy
import math
import operator
import typing
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memplan.planner.core.errors import Infeasible, MemplanError, WorkloadError
from memplan.planner.core.graph import FixedMemory, Graph, Op, TensorInfo
from memplan.planner.core.plan import Action
from memplan.planner.core.simulator import simulate
from memplan.planner.core.synthetic import fill_structural_grads
from memplan.planner.core.units import format_bytes
from memplan.planner.probe.measure import measure_step
from memplan.planner.probe.optime import OpTimer, record_call
from memplan.planner.workloads import LossFn, compute_loss, default_optimizer, refuse_compiled
from memplan.solvers import solve

#: the fraction handed to the partitioner: above 0 (0 saves only the inputs and never asks the knapsack)
#: and below every saving its more aggressive min-cuts reach, so that the knapsack is always asked
KNAPSACK_FRACTION = 1e-9
#: compiles per call at most, before the budget is refused
DEFAULT_TRIES = 4


@dataclass(frozen=True)
class Attempt:
    """One compile: the byte budget memplan's solver was given (None: a forced split), the simulated peak
    and step time of its plan on the compiled graph, the measured peak and step time of the compiled step,
    and the knapsack's split (candidates saved, recomputed)."""

    solver_budget_bytes: int | None
    simulated_peak_bytes: int | None
    simulated_time_s: float | None
    measured_peak_bytes: int
    step_time_s: float
    saved: int
    recomputed: int
    note: str = ""
    least_plan: bool = False  # the solver's budget was below its least plan on the graph, which was taken


@dataclass
class BudgetedCompile:
    """What :func:`compile_with_budget` returns: ``module`` (compiled; ``module(batch)`` returns the loss;
    train it with ``loss.backward()`` and the optimizer's step), the budget, the accepted attempt's
    measured peak and step time, every attempt in order, and the compiled graph as memplan saw it."""

    module: nn.Module
    budget_bytes: int
    measured_peak_bytes: int
    step_time_s: float
    attempts: list[Attempt]
    graph: Graph | None = None


class LossModule(nn.Module):
    """``loss_fn(model, batch)`` as a module, so that the model and its loss head compile as one graph."""

    def __init__(self, model: nn.Module, loss_fn: LossFn):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch: Any) -> torch.Tensor:
        return self.loss_fn(self.model, batch)


def _step_loss(module: nn.Module, batch: Any) -> torch.Tensor:
    return module(batch)


# ---- the joint graph as a memplan graph ------------------------------------------------------------------

def _tensor_val(node: torch.fx.Node) -> torch.Tensor | None:
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel()) * t.element_size()


def _is_view(node: torch.fx.Node) -> bool:
    """An ATen view (its output aliases its first argument's storage): no storage of its own."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def _node_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    return node.all_input_nodes


@dataclass
class JointGraph:
    """:func:`graph_from_joint`'s result: the memplan graph and, per knapsack candidate (by its index in
    the partitioner's list), the tensor ids that stand for it (its storages; empty: none of its own)."""

    graph: Graph
    candidate_tensors: list[tuple[int, ...]]
    stats: dict[str, Any] = field(default_factory=dict)


def graph_from_joint(joint_graph: torch.fx.Graph, node_info: Any, candidates: list[torch.fx.Node], *,
                     timer: OpTimer | None = None) -> JointGraph:
    """The forward half of the partitioner's joint graph as a memplan :class:`Graph`.

    Storages: each primal input (``param`` for the partitioner's static-lifetime inputs, else ``input``)
    and each forward node's tensor result (``activation``); a view is its base's storage, a ``getitem`` of
    a tuple result the storage its producer made. Ops: the forward nodes that make storages, in forward
    order, each timed alone by memplan's op timer on tensors of its shapes (``timer``; warm, cached).
    What backward reads of a storage is saved by the op that made it. Only the knapsack's candidates
    are ``recomputable``: every other saved value is the min-cut's to place, held here as kept. Backward
    times are left at 0: the graph prices recomputation, not the whole step."""
    fw_nodes = list(node_info.required_fw_nodes)
    fw_set = set(fw_nodes)
    tensors: list[TensorInfo] = []
    ops: list[Op] = []
    tid_of: dict[torch.fx.Node, int] = {}
    fixed = FixedMemory()
    for node in joint_graph.nodes:
        if node.op != "placeholder" or node not in node_info.inputs:
            continue
        val = _tensor_val(node)
        if val is None:
            continue
        param = node in node_info.static_lifetime_input_nodes
        tid_of[node] = len(tensors)
        tensors.append(TensorInfo(id=len(tensors), kind="param" if param else "input", bytes=_nbytes(val),
                                  dtype=str(val.dtype).removeprefix("torch."), shape=list(val.shape),
                                  requires_grad=param))
        if param:
            fixed.params_bytes += _nbytes(val)
        else:
            fixed.inputs_bytes += _nbytes(val)
    timed: list[tuple[int, torch.fx.Node]] = []
    for node in fw_nodes:
        if node.op != "call_function":
            continue
        if node.target is operator.getitem:
            continue  # made by its producer (below)
        val = node.meta.get("val")
        inputs = list(dict.fromkeys(tid_of[a] for a in _node_args(node) if a in tid_of))
        if isinstance(val, torch.Tensor) and _is_view(node) and inputs:
            tid_of[node] = inputs[0]
            continue
        results: list[tuple[torch.fx.Node, torch.Tensor]] = []
        if isinstance(val, torch.Tensor):
            results.append((node, val))
        elif isinstance(val, (tuple, list)):
            results += [(u, u.meta["val"]) for u in node.users
                        if u.target is operator.getitem and isinstance(u.meta.get("val"), torch.Tensor)]
        if not results:
            continue
        op_id = len(ops)
        outputs = []
        for k, (owner, v) in enumerate(results):
            tid_of[owner] = len(tensors)
            outputs.append(len(tensors))
            tensors.append(TensorInfo(id=len(tensors), kind="activation", producer=op_id, output_index=k,
                                      bytes=_nbytes(v), dtype=str(v.dtype).removeprefix("torch."),
                                      shape=list(v.shape), recomputable=False,
                                      requires_grad=v.dtype.is_floating_point
                                      and any(tensors[t].requires_grad for t in inputs)))
        ops.append(Op(id=op_id, name=str(node.target), inputs=inputs, outputs=outputs, time_source="isolated"))
        timed.append((op_id, node))
    # what backward reads, saved by the op that made it; the rest freed after its last forward read
    read_by_bw: set[int] = set()
    for node in node_info.required_bw_nodes:
        for a in _node_args(node):
            if a in tid_of and (a in fw_set or a.op == "placeholder"):
                read_by_bw.add(tid_of[a])
    # a candidate is what the min-cut saves when it is banned from recomputing it (backward reads it
    # through views and cheap pointwise values the min-cut rebuilds from it): saved by the op that made
    # it, and the only recomputable storage; what backward reads besides is held as kept (the same in
    # every plan: the measured offset carries it)
    candidate_tensors: list[tuple[int, ...]] = []
    for c in candidates:
        owners = [c] if c in tid_of else [u for u in c.users if u.target is operator.getitem]
        ts = tuple(dict.fromkeys(tid_of[o] for o in owners if o in tid_of))
        candidate_tensors.append(ts if ts and all(tensors[t].kind == "activation" for t in ts) else ())
    saved = set(read_by_bw) | {t for ts in candidate_tensors for t in ts}
    last_read: dict[int, int] = {}
    for op in ops:
        for t in op.inputs:
            last_read[t] = op.id
    for t in tensors:
        if t.kind != "activation":
            continue
        if t.id in saved:
            ops[t.producer].saved.append(t.id)
            ops[t.producer].has_backward = True
        else:
            t.freed_after = last_read.get(t.id, t.producer)
    for ts in candidate_tensors:
        for t in ts:
            tensors[t].recomputable = True
    _time_ops(ops, timed, timer, _device_of(fw_nodes))
    for op in ops:  # an op whose output needs a gradient has a backward step (its gradients, below)
        op.has_backward = op.has_backward or any(tensors[t].requires_grad for t in op.outputs)
    graph = fill_structural_grads(Graph(name="compiled", device=str(_device_of(fw_nodes)), tensors=tensors, ops=ops, fixed=fixed))
    return JointGraph(graph=graph, candidate_tensors=candidate_tensors,
                      stats={"ops": len(ops), "candidates": len(candidates),
                             "mapped": sum(bool(ts) for ts in candidate_tensors)})


def _fake_args(node: torch.fx.Node) -> tuple[tuple, dict]:
    def val(a: Any) -> Any:
        return a.meta.get("val") if isinstance(a, torch.fx.Node) else a

    return torch.fx.node.map_aggregate(node.args, val), torch.fx.node.map_aggregate(node.kwargs, val)


def _device_of(nodes: list[torch.fx.Node]) -> torch.device:
    """Where the compiled step runs: the device of its first tensor value."""
    return next((v.device for n in nodes if (v := _tensor_val(n)) is not None), torch.device("cpu"))


def _time_ops(ops: list[Op], timed: list[tuple[int, torch.fx.Node]], timer: OpTimer | None,
              device: torch.device) -> None:
    timer = timer or OpTimer(device, cold=False, sweeps=1)
    calls, owners = [], []
    for op_id, node in timed:
        args, kwargs = _fake_args(node)
        if any(isinstance(v, torch.SymInt) for v in torch.utils._pytree.tree_leaves((args, kwargs))):
            raise MemplanError(f"compile_with_budget: the compiled graph has dynamic shapes ({node.name}); "
                               "compile for one shape (dynamic=False)")
        calls.append(record_call(node.target, tuple(args), dict(kwargs), node.meta.get("val")))
        owners.append(op_id)
    for op_id, timing in zip(owners, timer.time(calls), strict=True):
        ops[op_id].time_s = float(timing.time_s)


# ---- the knapsack -----------------------------------------------------------------------------------------

def _custom_knapsack_base() -> type:
    try:
        from torch._inductor.custom_graph_pass import CustomKnapsackSolver
    except ImportError as e:  # torch before the hook existed
        raise MemplanError(f"compile_with_budget needs torch._inductor.custom_graph_pass.CustomKnapsackSolver "
                           f"(torch >= 2.8); this torch is {torch.__version__}") from e
    return CustomKnapsackSolver


@dataclass(frozen=True)
class Split:
    """A knapsack answer: the candidates saved (indices into the partitioner's list), with memplan's
    simulated peak and step time of the plan on the compiled graph (None: not simulated), and whether it
    is the least plan memplan knows there (asked below it)."""

    saved: tuple[int, ...]
    simulated_peak_bytes: int | None = None
    simulated_time_s: float | None = None
    least_plan: bool = False
    note: str = ""


def plan_split(joint: JointGraph, budget_bytes: int, *, method: str = "auto", time_limit_s: float = 20.0) -> Split:
    """memplan's fastest keep / recompute plan on ``joint``'s graph within ``budget_bytes`` (its simulated
    peak) as a knapsack answer: a candidate is saved when the plan keeps every storage standing for it.
    Below the least peak memplan knows there, that least plan (``least_plan``); below every plan, every
    candidate recomputed (no simulated figures)."""
    graph = joint.graph
    try:
        result = solve(graph, budget_bytes, method, time_limit_s=time_limit_s)
        least, note = False, ""
    except Infeasible as e:
        # recomputing every candidate can peak higher than memplan's least plan: that plan, where known
        least, note, result = True, f"solver: {e}", None
        if e.min_feasible_bytes is not None:
            with contextlib.suppress(Infeasible):
                result = solve(graph, e.min_feasible_bytes, method, time_limit_s=time_limit_s)
        if result is None:
            return Split((), least_plan=True, note=note + "; every candidate recomputed")
        note += "; its least plan taken"
    actions = result.plan.actions()
    saved = tuple(i for i, ts in enumerate(joint.candidate_tensors)
                  if all(actions.get(t, Action.KEEP) == Action.KEEP for t in ts))
    return Split(saved, result.report.peak_bytes, result.report.time_s, least, note)


class MemplanKnapsack(_custom_knapsack_base()):  # type: ignore[misc]
    """The partitioner's knapsack, answered by memplan on the compiled graph.

    ``solver_budget_bytes``: memplan's :func:`plan_split` within that budget on :func:`graph_from_joint`'s
    graph; or ``split``: that answer, given (the candidates saved); or ``force``: ``"save"`` /
    ``"recompute"`` every candidate. Each call (one per compiled graph) is recorded in ``calls``: the
    joint graph and the :class:`Split` answered."""

    def __init__(self, solver_budget_bytes: int | None = None, *, split: Split | None = None,
                 force: str | None = None, method: str = "auto", time_limit_s: float = 20.0,
                 timer: OpTimer | None = None):
        if sum(x is not None for x in (solver_budget_bytes, split, force)) != 1:
            raise MemplanError("MemplanKnapsack: give one of solver_budget_bytes, split or force")
        if force not in (None, "save", "recompute"):
            raise MemplanError(f"MemplanKnapsack: force must be 'save' or 'recompute', got {force!r}")
        self.solver_budget_bytes = solver_budget_bytes
        self.split = split
        self.force = force
        self.method = method
        self.time_limit_s = time_limit_s
        self.timer = timer
        self.calls: list[tuple[JointGraph, Split]] = []

    def __call__(self, memory: list[float], joint_graph: torch.fx.Graph, max_memory: float, node_info: Any,
                 all_recomputable_banned_nodes: list[torch.fx.Node]) -> tuple[list[int], list[int]]:
        joint = graph_from_joint(joint_graph, node_info, all_recomputable_banned_nodes, timer=self.timer)
        everything = range(len(all_recomputable_banned_nodes))
        if self.force == "save":
            report = simulate(joint.graph, timeline=False)
            split = Split(tuple(everything), report.peak_bytes, report.time_s, note="every candidate saved")
        elif self.force == "recompute":
            split = Split((), note="every candidate recomputed")
        elif self.split is not None:
            split = self.split
        else:
            split = plan_split(joint, self.solver_budget_bytes, method=self.method, time_limit_s=self.time_limit_s)
        self.calls.append((joint, split))
        saved = set(split.saved)
        return sorted(saved), [i for i in everything if i not in saved]

    def uuid(self) -> Any:
        return None  # the answer depends on the budget: never served from inductor's cache


def _custom_runtime_base() -> type:
    from torch._inductor.custom_graph_pass import CustomRuntimeEstimator

    return CustomRuntimeEstimator


class MemplanRuntimeEstimator(_custom_runtime_base()):  # type: ignore[misc]
    """memplan's op timer as torch's ``activation_memory_budget_runtime_estimator``: a node's seconds, its
    ATen call run alone on tensors of its shapes on this machine (warm, cached as the fake profile caches
    them), for torch's own knapsacks (its default counts FLOPs). :class:`MemplanKnapsack` does not need it:
    it times the whole forward itself (the partitioner hands a custom knapsack no runtimes)."""

    def __init__(self, timer: OpTimer | None = None):
        self.timer = timer

    def __call__(self, node: torch.fx.Node) -> float:
        if self.timer is None:
            self.timer = OpTimer(_device_of([node]), cold=False, sweeps=1)
        args, kwargs = _fake_args(node)
        call = record_call(node.target, tuple(args), dict(kwargs), node.meta.get("val"))
        return float(self.timer.time([call])[0].time_s)

    def uuid(self) -> Any:
        return None  # times are this machine's: never served from inductor's cache


# ---- the one call -----------------------------------------------------------------------------------------

def _grad_bytes(model: nn.Module) -> int:
    return sum(_nbytes(p) for p in model.parameters() if p.requires_grad)


def _batch_bytes(batch: Any) -> int:
    return sum(_nbytes(t) for t in torch.utils._pytree.tree_leaves(batch) if isinstance(t, torch.Tensor))


def _measure(model: nn.Module, module: nn.Module, batch: Any, knapsack: MemplanKnapsack,
             optimizer: torch.optim.Optimizer, steps: int, backend: str = "inductor") -> tuple[nn.Module, Any]:
    """Compile ``module`` with ``knapsack`` and measure its step; model and optimizer restored after."""
    from torch._functorch import config as functorch_config

    torch.compiler.reset()  # a new compile reads the knapsack again (dynamo would reuse the last one)
    compiled = torch.compile(module, fullgraph=True, dynamic=False, backend=backend)
    model_state = copy.deepcopy(model.state_dict())
    optim_state = copy.deepcopy(optimizer.state_dict())
    try:
        with functorch_config.patch(activation_memory_budget=KNAPSACK_FRACTION,
                                    activation_memory_budget_solver=knapsack):
            try:
                m = measure_step(compiled, batch, _step_loss, optimizer, steps=steps, warmup=1)
            except (WorkloadError, torch._dynamo.exc.TorchDynamoException) as e:
                cause = e.__cause__ if isinstance(e, WorkloadError) else e
                if not isinstance(cause, torch._dynamo.exc.TorchDynamoException):
                    raise
                text = str(cause).strip()
                first = text.splitlines()[0][:200] if text else type(cause).__name__
                raise MemplanError(f"compile_with_budget: the model does not compile as one graph (a graph "
                                   f"break, {type(cause).__name__}: {first}); the byte budget holds for one "
                                   "compiled graph (torch.compile(fullgraph=True) must succeed)") from None
    finally:
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optim_state)
    return compiled, m


def compile_with_budget(model: nn.Module, batch: Any, loss_fn: LossFn, budget_bytes: int, *,
                        optimizer: torch.optim.Optimizer | None = None, tries: int = DEFAULT_TRIES,
                        method: str = "auto", time_limit_s: float = 20.0, steps: int = 3,
                        backend: str = "inductor") -> BudgetedCompile:
    """Compile ``loss_fn(model, batch)`` (model and loss as one graph) so that its training step peaks
    within ``budget_bytes`` as the allocator measures it (parameters, gradients, optimizer state and batch
    included), recomputing the least memplan's cost model finds.

    Each attempt compiles with :class:`MemplanKnapsack` and measures one step (the model and optimizer
    are restored afterwards). The first saves every candidate and is returned where it fits. Else memplan's
    solver (:func:`plan_split`, ``method``, ``time_limit_s``) is searched on its budget on the compiled
    graph: first ``budget_bytes`` less the offset between that compile's measured and simulated peak;
    over the budget, lower by the overshoot (and the new offset); within it, halfway back up towards the
    lowest solver budget that measured over, for a plan that recomputes less, until the two are within 1%
    of the budget. ``tries`` compiles in all for the first and the search (a split already measured is not
    compiled again); the fastest split that measured within the budget (by memplan's simulated time) is
    returned, compiled once more if another was compiled after it; with none, every candidate recomputed
    is the last resort. ``attempts[-1]`` is the compile returned. ``optimizer`` (default AdamW, foreach)
    is the one the step is measured with: train with it; ``steps``: timed steps per measurement;
    ``backend``: torch.compile's (any that partitions with AOTAutograd's min-cut partitioner, whose knapsack
    this drives: inductor, or ``aot_eager_decomp_partition``, which compiles no kernel).

    Raises :class:`MemplanError` for a budget that is not a positive byte count or a graph break,
    :class:`WorkloadError` for a compiled model or a failing ``loss_fn``, :class:`Infeasible` below the
    parameters, gradients and batch, and :class:`CompileInfeasible` (``min_feasible_bytes``: the least
    peak measured; ``attempts``) when no compile fits. Resets dynamo's caches (``torch.compiler.reset()``)
    before each compile."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise MemplanError(f"compile_with_budget: budget_bytes must be a positive number of bytes, "
                           f"got {budget_bytes!r}")
    if tries < 1:
        raise MemplanError(f"compile_with_budget: tries must be >= 1, got {tries}")
    refuse_compiled(model)
    optimizer = optimizer or default_optimizer(model)
    # below the parameters, their gradients and the batch nothing fits, whatever is recomputed
    floor = sum(_nbytes(p) for p in model.parameters()) + _grad_bytes(model) + _batch_bytes(batch)
    if budget_bytes < floor:
        raise Infeasible(f"compile_with_budget: budget {format_bytes(budget_bytes)} is below the parameters, "
                         f"their gradients and the batch ({format_bytes(floor)}), which every step holds",
                         budget_bytes=budget_bytes, min_feasible_bytes=None)
    compute_loss(model, batch, loss_fn)  # the user's loss checked eagerly: one clear error, not inductor's
    module = LossModule(model, loss_fn)
    attempts: list[Attempt] = []

    def attempt(knapsack: MemplanKnapsack, solver_budget: int | None) -> tuple[nn.Module, Attempt]:
        compiled, m = _measure(model, module, batch, knapsack, optimizer, steps, backend)
        joint, split = knapsack.calls[0] if knapsack.calls else (None, Split(()))
        candidates = len(joint.candidate_tensors) if joint is not None else 0
        a = Attempt(solver_budget, split.simulated_peak_bytes, split.simulated_time_s, m.peak_bytes,
                    m.step_time_s, len(split.saved), candidates - len(split.saved), split.note, split.least_plan)
        attempts.append(a)
        return compiled, a

    # attempt 0 saves every candidate (the partitioner's fastest split): where it fits, it is the answer
    first = MemplanKnapsack(force="save")
    compiled, a0 = attempt(first, None)
    if not first.calls:  # the partitioner asked nothing: there is no choice to make
        if a0.measured_peak_bytes <= budget_bytes:
            return BudgetedCompile(compiled, budget_bytes, a0.measured_peak_bytes, a0.step_time_s, attempts, None)
        _refuse(budget_bytes, attempts)
    joint = first.calls[0][0]
    if a0.measured_peak_bytes <= budget_bytes:
        return BudgetedCompile(compiled, budget_bytes, a0.measured_peak_bytes, a0.step_time_s, attempts, joint.graph)
    # memplan's plans on the compiled graph, searched on the solver's budget: the first is the user's less
    # what the simulation misses (attempt 0's measured peak less its simulated one: gradients, optimizer
    # state, inductor's fusions and buffers); over the budget, lower by the overshoot and by the new
    # offset; within it, back up halfway to the lowest solver budget that measured over (a faster plan)
    over = a0.simulated_peak_bytes  # the least solver budget known to measure over the budget
    fit: int | None = None          # the highest solver budget known to measure within it
    best: tuple[Attempt, Split] | None = None
    last: tuple[nn.Module, Split] | None = None
    measured: dict[tuple[int, ...], Attempt] = {}
    solver_budget = budget_bytes - (a0.measured_peak_bytes - a0.simulated_peak_bytes)
    for _ in range(tries - 1):
        split = plan_split(joint, solver_budget, method=method, time_limit_s=time_limit_s)
        a = measured.get(split.saved)
        if a is None:  # a split already measured is not compiled again
            compiled, a = attempt(MemplanKnapsack(split=split), solver_budget)
            measured[split.saved] = a
            last = (compiled, split)
        if a.measured_peak_bytes <= budget_bytes:
            if best is None or (a.simulated_time_s or 0.0) < (best[0].simulated_time_s or 0.0):
                best = (a, split)
            fit = solver_budget
            solver_budget = (fit + over) // 2
            if over - fit <= max(1, budget_bytes // 100):
                break  # within 1% of the budget of a plan that measured over: close enough
        else:
            if best is None and split.least_plan:
                break  # memplan's least plan measured over: lower budgets change nothing
            over = solver_budget
            if fit is None:
                overshoot = a.measured_peak_bytes - budget_bytes
                solver_budget = min(solver_budget - overshoot,
                                    budget_bytes - (a.measured_peak_bytes - (a.simulated_peak_bytes or 0)))
            else:
                solver_budget = (fit + over) // 2
                if over - fit <= max(1, budget_bytes // 100):
                    break
    if best is not None:
        a, split = best
        if last is None or last[1] != split:  # compiled last is another split: compile the best again
            compiled, a = attempt(MemplanKnapsack(split=split), a.solver_budget_bytes)
        else:
            compiled = last[0]
        if a.measured_peak_bytes <= budget_bytes:
            return BudgetedCompile(compiled, budget_bytes, a.measured_peak_bytes, a.step_time_s, attempts, joint.graph)
    if not any(x.saved == 0 for x in attempts):
        compiled, a = attempt(MemplanKnapsack(force="recompute"), None)
        if a.measured_peak_bytes <= budget_bytes:
            return BudgetedCompile(compiled, budget_bytes, a.measured_peak_bytes, a.step_time_s, attempts, joint.graph)
    _refuse(budget_bytes, attempts)


def _refuse(budget_bytes: int, attempts: list[Attempt]) -> typing.NoReturn:
    least = min(a.measured_peak_bytes for a in attempts)
    raise CompileInfeasible(attempts, f"compile_with_budget: budget {format_bytes(budget_bytes)} is below every "
                            f"compiled step the partitioner reached: the least measured peak was "
                            f"{format_bytes(least)} ({len(attempts)} compiles)",
                            budget_bytes=budget_bytes, min_feasible_bytes=least)


class CompileInfeasible(Infeasible):
    """:class:`Infeasible` from :func:`compile_with_budget`, with its ``attempts`` (each compile measured)."""

    def __init__(self, attempts: list[Attempt], message: str, **kw: Any):
        super().__init__(message, **kw)
        self.attempts = attempts


def compile_with_fraction(model: nn.Module, batch: Any, loss_fn: LossFn, fraction: float, *,
                          optimizer: torch.optim.Optimizer | None = None, steps: int = 3) -> tuple[nn.Module, Any]:
    """torch's own ``activation_memory_budget`` (a 0-1 fraction) on the same step, measured as
    :func:`compile_with_budget` measures: the compiled module and its :class:`StepMeasurement`. For side
    by side comparisons (benchmarks/compile_budget.py)."""
    from torch._functorch import config as functorch_config

    if not 0.0 <= fraction <= 1.0 or math.isnan(fraction):
        raise MemplanError(f"compile_with_fraction: fraction must be within [0, 1], got {fraction!r}")
    refuse_compiled(model)
    optimizer = optimizer or default_optimizer(model)
    torch.compiler.reset()
    compiled = torch.compile(LossModule(model, loss_fn), fullgraph=True, dynamic=False)
    model_state = copy.deepcopy(model.state_dict())
    optim_state = copy.deepcopy(optimizer.state_dict())
    try:
        with functorch_config.patch(activation_memory_budget=fraction):
            m = measure_step(compiled, batch, _step_loss, optimizer, steps=steps, warmup=1)
    finally:
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optim_state)
    return compiled, m
