"""What every training-framework integration does, once: profile the step the framework runs (on its
first batch, with the model, gradients and random streams restored afterwards), solve it under the
budget, apply the plan, and measure a later step's peak against the prediction.

The frameworks' callbacks (:mod:`.huggingface`, :mod:`.lightning`) only find the batch, the loss and the
optimizer in their framework and call :class:`StepPlanner`.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memplan.executor.apply import Executor, apply
from memplan.planner.core.errors import Infeasible, MemplanError
from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Plan
from memplan.planner.core.units import format_bytes, parse_budget
from memplan.planner.probe.checkpointing import OwnCheckpointing, checkpointing_off, own_checkpointing
from memplan.planner.probe.family import profile_family, twin_optimizer
from memplan.planner.probe.measure import PeakReading, peak_window
from memplan.planner.probe.profiler import profile
from memplan.planner.workloads import LossFn
from memplan.solvers import activation_bytes, keep_all_report, solve

FUSE_CHOICES = (None, "backward", "forward")
OWN_CHECKPOINTING = ("off", "keep")
log = logging.getLogger("memplan")


@dataclass(frozen=True)
class PlanSummary:
    """What an integration logs once it has planned: the budget and the plan's predicted peak and time."""

    budget_bytes: int
    predicted_peak_bytes: int
    predicted_step_s: float
    keep_all_peak_bytes: int
    solver: str
    recomputed: int
    offloaded: int

    def logs(self) -> dict[str, float]:
        return {"memplan_budget_bytes": self.budget_bytes, "memplan_predicted_peak_bytes": self.predicted_peak_bytes,
                "memplan_predicted_step_s": self.predicted_step_s,
                "memplan_keep_all_peak_bytes": self.keep_all_peak_bytes}


DIM_AXES = {"batch": 0, "seq": 1}


def _resize(x: Any, axis: int, size: int, current: int) -> Any:
    """``x`` with every tensor whose ``axis`` has length ``current`` cut to ``size`` along it, or repeated
    along it and cut (tuples, lists, dicts and namedtuples walked)."""
    if isinstance(x, torch.Tensor):
        if x.dim() <= axis or x.shape[axis] != current:
            return x
        if size > current:
            reps = [1] * x.dim()
            reps[axis] = -(-size // current)
            x = x.repeat(*reps)
        return x.narrow(axis, 0, size).clone()
    if isinstance(x, dict):
        return type(x)({k: _resize(v, axis, size, current) for k, v in x.items()})
    if isinstance(x, (list, tuple)):
        items = [_resize(v, axis, size, current) for v in x]
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
    return x


def _first_length(x: Any, axis: int) -> int | None:
    if isinstance(x, torch.Tensor):
        return int(x.shape[axis]) if x.dim() > axis else None
    values = x.values() if isinstance(x, dict) else x if isinstance(x, (list, tuple)) else ()
    for v in values:
        n = _first_length(v, axis)
        if n is not None:
            return n
    return None


def dim_family(batch: Any, dim: str, largest: int | None = None) -> list[tuple[dict[str, int], Any]]:
    """Batches at ``dim`` (``"batch"``: axis 0; ``"seq"``: axis 1) = ``largest`` (default: the batch's
    own), about 3/4 and 1/2 of it, made from ``batch``: every tensor whose axis has the length the first
    tensor's has is cut, or repeated and cut. For :func:`memplan.planner.probe.family.profile_family`. Raises
    :class:`MemplanError` for another ``dim``, a batch with no tensor of that many dimensions, or a size
    too small to vary."""
    if dim not in DIM_AXES:
        raise MemplanError(f"dimension {dim!r} is not one memplan can resize a batch along; use batch or seq")
    axis = DIM_AXES[dim]
    current = _first_length(batch, axis)
    if current is None:
        raise MemplanError(f"the batch has no tensor with a {dim} axis (axis {axis})")
    largest = current if largest is None else largest
    sizes = [n for n in dict.fromkeys([largest, (3 * largest) // 4, largest // 2]) if n >= 1]
    if len(sizes) < 3:
        raise MemplanError(f"{dim}={largest} is too small to profile a family at three sizes; use at least 4")
    return [({dim: n}, _resize(batch, axis, n, current)) for n in sizes]


def sequence_family(batch: Any, max_seq_len: int) -> list[tuple[dict[str, int], Any]]:
    """:func:`dim_family` over ``seq`` up to ``max_seq_len`` (a token batch: the sequence is axis 1)."""
    return dim_family(batch, "seq", max_seq_len)


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of the gradients of ``model``'s trainable parameters (one per storage)."""
    sizes: dict[int, int] = {}
    for p in model.parameters():
        if p.requires_grad:
            sizes[p.untyped_storage()._cdata] = p.untyped_storage().nbytes()
    return sum(sizes.values())


class StepPlanner:
    """Plans a framework's training step: ``plan(...)`` profiles, solves and applies; ``start_measure`` /
    ``stop_measure`` read one step's peak as memplan measures it.

    ``budget``: bytes, or a string (``"6GiB"``, ``"50%"`` of the activation memory). ``solver``: a
    registered solver or ``"auto"``. ``fuse``: None, ``"backward"`` or ``"forward"`` (see
    :func:`memplan.executor.apply`). ``max_seq_len``: batches vary in sequence length (dynamic padding)
    up to this: the plan is made for a shape family over ``seq`` (:func:`sequence_family`), so every
    step up to that length runs under it; without it, steps longer than the first batch are refused. A budget string that cannot be read and an unknown ``fuse`` raise
    :class:`MemplanError` here, before training starts.

    ``own_checkpointing``: what to do with the model's own activation checkpointing
    (:mod:`memplan.planner.probe.checkpointing`: transformers' ``activation_checkpointing_enable`` /
    ``gradient_checkpointing_enable``, ``offload=True`` included), said in one warning line when found.
    ``"off"`` (the default) switches it off for the profile and the training under the plan, and back on at
    :meth:`remove`: memplan then plans every activation (a layer it recomputes is one the plan chose; it may
    keep more where the budget allows, or offload with prefetch), and ``"100%"`` keeps everything. The
    profile then runs one step without the model's checkpointing: where that step does not fit the device,
    ``"keep"`` plans over the model's own checkpointed step instead (its percentages are of what that step
    saves: the layers' inputs; a plan can keep no more).
    """

    def __init__(self, budget: str | int = "50%", solver: str = "auto", fuse: str | None = None, *,
                 time_limit_s: float = 60.0, offload: bool = False, repeats: int = 2,
                 max_seq_len: int | None = None, own_checkpointing: str = "off"):
        if own_checkpointing not in OWN_CHECKPOINTING:
            raise MemplanError(f"own_checkpointing must be 'off' (plan every activation) or 'keep' (plan over the "
                               f"model's checkpointed step); got {own_checkpointing!r}")
        self.own_checkpointing = own_checkpointing
        self.checkpointing: OwnCheckpointing | None = None  # the model's own, once found
        self._checkpointing_off = contextlib.ExitStack()
        if fuse not in FUSE_CHOICES:
            raise MemplanError(f"fuse must be one of None, 'backward', 'forward'; got {fuse!r}")
        if max_seq_len is not None and (not isinstance(max_seq_len, int) or max_seq_len < 4):
            raise MemplanError(f"max_seq_len must be an integer of at least 4, got {max_seq_len!r}")
        self.max_seq_len = max_seq_len
        if not (isinstance(budget, str) and budget.strip().endswith("%")):
            parse_budget(budget)  # a malformed size fails now, not after the first batch
        self.budget = budget
        self.solver = solver
        self.fuse = fuse
        self.time_limit_s = time_limit_s
        self.offload = offload
        self.repeats = repeats
        self.graph: Graph | None = None
        self.plan_: Plan | None = None
        self.summary: PlanSummary | None = None
        self.executor: Executor | None = None
        self._measure: tuple[contextlib.ExitStack, PeakReading] | None = None

    def plan(self, model: nn.Module, batch: Any, loss_fn: LossFn, optimizer: torch.optim.Optimizer, *,
             accumulation_steps: int = 1, max_grad_norm: float | None = None,
             gradients_held: bool = False) -> Executor:
        """Profile ``loss_fn(model, batch)`` (the framework's own forward and loss) with a twin of
        ``optimizer``, restore the model, solve under the budget and apply the plan to ``model`` and
        ``optimizer``. With ``accumulation_steps > 1`` the gradients earlier micro-batches leave for later
        ones, and with ``gradients_held`` (a loop that zeroes gradients after the forward: Lightning) the
        previous step's, are added to the prediction and taken from the budget the plan is solved for.
        Raises :class:`Infeasible` (naming the minimum feasible budget) when no plan fits, before anything
        is trained."""
        device = next(model.parameters()).device
        name = type(model).__name__
        found = self.checkpointing = own_checkpointing(model)
        if found is not None and self.own_checkpointing == "off":  # back on at remove()
            self._checkpointing_off.enter_context(checkpointing_off(model))
            log.warning("memplan: %s; switched off: memplan plans every activation itself "
                        "(own_checkpointing='keep' plans over the model's checkpointed step)", found.line())
        elif found is not None:
            log.warning("memplan: %s; kept (own_checkpointing='keep'): the plan is over that step, and a "
                        "percentage budget is of what it saves", found.line())
        # the profile puts the model, gradients and random streams back; the twin leaves ``optimizer`` untouched
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*checkpoints .* itself.*")  # said above, once
            graph = self._profile(model, batch, loss_fn, optimizer, device, name)
        return self._solve_and_apply(model, graph, optimizer, accumulation_steps=accumulation_steps,
                                     max_grad_norm=max_grad_norm, gradients_held=gradients_held)

    def _profile(self, model: nn.Module, batch: Any, loss_fn: LossFn, optimizer: torch.optim.Optimizer,
                 device: torch.device, name: str) -> Graph:
        if self.max_seq_len is None:
            graph = profile(model, batch, loss_fn, optimizer=twin_optimizer(optimizer), warmup=1,
                            repeats=self.repeats, device=device, progress=False, measure=False, name=name)
        else:
            graph = profile_family(model, sequence_family(batch, self.max_seq_len), loss_fn,
                                   optimizer=twin_optimizer(optimizer), repeats=self.repeats, device=device,
                                   progress=False, measure=False, name=name)
        return graph

    def _solve_and_apply(self, model: nn.Module, graph: Graph, optimizer: torch.optim.Optimizer, *,
                         accumulation_steps: int, max_grad_norm: float | None, gradients_held: bool) -> Executor:
        # The profiled step starts without gradients. A later micro-batch starts with those the earlier
        # ones accumulated (and a loop that zeroes them after the forward, with the last step's), and they
        # stay into backward: the step's peak is at most the plan's plus them, so the plan is solved for
        # the budget less them. A percentage is of the activations, on top of all that is fixed: the held
        # gradients included ("100%" keeps everything; it was infeasible by their bytes).
        held = gradient_bytes(model) if accumulation_steps > 1 or gradients_held else 0
        budget = parse_budget(self.budget, activation_bytes=activation_bytes(graph),
                              fixed_bytes=graph.fixed.resident_bytes + held)
        try:
            result = solve(graph, max(0, budget - held), self.solver, time_limit_s=self.time_limit_s,
                           offload=self.offload, fuse=self.fuse)
        except Infeasible as e:
            if not held:
                raise
            least = e.min_feasible_bytes + held if e.min_feasible_bytes is not None else None
            raise Infeasible(f"no plan fits budget {format_bytes(budget)} ({budget} B) for graph '{graph.name}' "
                             f"with the {format_bytes(held)} of gradients the loop holds into the step; the "
                             f"minimum feasible budget memplan knows is "
                             f"{format_bytes(least) + f' ({least} B)' if least is not None else 'unknown'}",
                             budget_bytes=budget, min_feasible_bytes=least) from None
        keep_all = keep_all_report(graph)
        self.graph, self.plan_ = graph, result.plan
        predicted = result.report.peak_bytes + held
        self.summary = PlanSummary(
            budget_bytes=budget, predicted_peak_bytes=predicted,
            predicted_step_s=result.report.time_s, keep_all_peak_bytes=keep_all.peak_bytes,
            solver=result.plan.solver.name, recomputed=result.plan.count("recompute"),
            offloaded=result.plan.count("offload"))
        self.executor = apply(model, result.plan, graph=graph, optimizer=optimizer, fuse=self.fuse,
                              accumulation_steps=accumulation_steps, max_grad_norm=max_grad_norm)
        return self.executor

    def start_measure(self, model: nn.Module, batch: Any, optimizer: torch.optim.Optimizer) -> None:
        """Begin measuring a step's peak (fixed memory included): CUDA's allocator peak after a reset; on
        CPU the allocator's reports on top of what is live now (parameters, gradients, optimizer state and
        ``batch``), as :mod:`memplan.planner.probe.measure` reads them."""
        if self._measure is not None:
            return
        stack = contextlib.ExitStack()
        reading = stack.enter_context(peak_window(model, batch, optimizer))
        self._measure = (stack, reading)

    def stop_measure(self) -> int | None:
        """The peak since :meth:`start_measure` (None when not measuring)."""
        if self._measure is None:
            return None
        stack, reading = self._measure
        self._measure = None
        stack.close()
        return reading.peak_bytes

    def remove(self) -> None:
        """Give the model and optimizer back as they were (pending fused updates applied)."""
        if self._measure is not None:
            self._measure[0].close()
            self._measure = None
        if self.executor is not None:
            self.executor.remove()
            self.executor = None
        self._checkpointing_off.close()  # the model's own checkpointing, as it was


class PlannedCallback:
    """What every framework's callback shows of its plan: ``planner`` is its :class:`StepPlanner`."""

    planner: StepPlanner

    @property
    def graph(self) -> Graph | None:
        return self.planner.graph

    @property
    def plan(self) -> Plan | None:
        return self.planner.plan_

    @property
    def summary(self) -> PlanSummary | None:
        return self.planner.summary
