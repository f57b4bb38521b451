"""Train a few steps under a plan and measure them: what ``memplan run`` reports.

    report = run_plan(model, batch, loss_fn, optimizer, plan, graph, steps=5)
    report.predicted_peak_bytes, report.measured_peak_bytes    # the simulator against the allocator
    report.predicted_step_s, report.measured_step_s            # median of the timed steps

The steps are the unchanged training step of :mod:`memplan.planner.workloads` with the plan applied by
:func:`memplan.executor.apply`. Memory is measured as :mod:`memplan.planner.probe.measure` measures it (CPU: the
allocator's own reports under ``torch.profiler`` on top of the storages live when the step starts; CUDA:
``torch.cuda.max_memory_allocated`` after a reset), on one step after the warm-up; that step is not timed
(the profiler slows it). Then the same measurement without the plan (keep everything), on the same model.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from memplan.executor.apply import Executor, apply
from memplan.planner.core.errors import MemplanError
from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Plan
from memplan.planner.core.simulator import simulate
from memplan.planner.probe.device import cuda_available, device_of
from memplan.planner.probe.materialize import materialize
from memplan.planner.probe.measure import PeakReading, measure_step, step_peak
from memplan.planner.probe.storage import move_batch
from memplan.planner.workloads import LossFn, default_optimizer, training_step

RUN_FORMAT = "memplan.run/1"
MAX_TIMELINE_POINTS = 2000


@dataclass(frozen=True)
class RunReport:
    """Predicted against measured for one plan on one machine.

    Bytes include the fixed memory (parameters, optimizer state, batch), as the simulator's peak does.
    ``measured_step_s`` is the median of ``steps`` timed steps after ``warmup`` steps and the (untimed)
    memory step; ``losses`` has every step's loss in order (warm-up, memory step, timed steps).
    ``timeline`` is memory in use over the memory step, ``(seconds since it began, bytes)``, from the CPU
    allocator's reports (empty on CUDA). ``keep_all_measured_*`` are None when not measured.
    ``profile_peak_bytes`` is the allocator's peak while the graph was profiled (fixed memory included):
    a fake profile's, from its op timing, or a real profile's measured keep-everything step; None when
    the graph does not say (a graph file from elsewhere).
    """

    workload: str
    graph_fingerprint: str
    device: str
    solver: str
    status: str
    fuse: str | None
    steps: int
    warmup: int
    budget_bytes: int | None
    predicted_peak_bytes: int
    measured_peak_bytes: int
    predicted_step_s: float
    measured_step_s: float
    step_times_s: tuple[float, ...]
    losses: tuple[float, ...]
    baseline_bytes: int
    keep_all_predicted_peak_bytes: int
    keep_all_predicted_step_s: float
    keep_all_measured_peak_bytes: int | None
    keep_all_measured_step_s: float | None
    decisions: dict[str, int]
    replays_per_step: int
    late_fetches_per_step: int
    host_pool_bytes: int
    timeline: tuple[tuple[float, int], ...] = ()
    profile_peak_bytes: int | None = None
    memory_snapshot: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    @property
    def peak_error(self) -> float:
        """predicted / measured - 1: positive when the simulator over-estimates."""
        return self.predicted_peak_bytes / self.measured_peak_bytes - 1.0 if self.measured_peak_bytes else 0.0

    @property
    def step_error(self) -> float:
        return self.predicted_step_s / self.measured_step_s - 1.0 if self.measured_step_s else 0.0

    @property
    def predicted_overhead(self) -> float:
        """The simulator's step under the plan over its keep-everything step, minus 1."""
        return self.predicted_step_s / self.keep_all_predicted_step_s - 1.0 if self.keep_all_predicted_step_s else 0.0

    @property
    def measured_overhead(self) -> float | None:
        """The measured step under the plan over plain training's measured step, minus 1 (None unmeasured)."""
        base = self.keep_all_measured_step_s
        return self.measured_step_s / base - 1.0 if base else None

    def within_budget(self, tolerance: float = 0.05) -> bool | None:
        """Measured peak at most ``budget * (1 + tolerance)``; None without a budget."""
        if self.budget_bytes is None:
            return None
        return self.measured_peak_bytes <= self.budget_bytes * (1.0 + tolerance)

    def as_dict(self) -> dict[str, Any]:
        """The run report file (``memplan.run/1``); ``memplan show --run`` reads it."""
        d = asdict(self)
        d.pop("memory_snapshot")  # its own file (``memplan run --snapshot``), not the report's
        d["timeline"] = [{"time_s": t, "bytes": b} for t, b in self.timeline]
        d["step_times_s"] = list(self.step_times_s)
        d["losses"] = list(self.losses)
        within = self.within_budget()
        return {"format": RUN_FORMAT, **d, "peak_error": self.peak_error, "step_error": self.step_error,
                "predicted_overhead": self.predicted_overhead, "measured_overhead": self.measured_overhead,
                "within_budget_5pct": within}




def _thin(points: list[tuple[float, int]], limit: int) -> list[tuple[float, int]]:
    """At most about ``limit`` points, keeping each bucket's highest (so the peak survives)."""
    if len(points) <= limit:
        return points
    size = -(-len(points) // limit)
    return [max(points[i:i + size], key=lambda p: p[1]) for i in range(0, len(points), size)]


def peak_step(model: nn.Module, batch: Any, loss_fn: LossFn, optimizer: torch.optim.Optimizer,
              executor: Executor | None = None) -> tuple[int, int, list[tuple[float, int]], torch.Tensor]:
    """One training step measured as :mod:`memplan.planner.probe.measure` measures it, on the device of the
    model's parameters, with whatever plan or checkpointing the model has applied.

    Returns ``(peak_bytes, baseline_bytes, timeline, loss)``: the peak includes what was live when the step
    began (``baseline_bytes``); ``timeline`` is memory in use over the step as ``(seconds since its
    first allocation, bytes)`` from the CPU allocator's reports (empty on CUDA); ``loss`` is detached.
    ``executor``: the plan applied to ``model``. On CPU the allocator reports no free of a block allocated
    before the profiler started, so the gradients that forward fusion holds from the previous step (applied
    and freed during this step's forward) are re-allocated inside the window: their frees are then seen.
    """
    reading, timeline, loss = measured_step(model, batch, loss_fn, optimizer, executor)
    return reading.peak_bytes, reading.baseline_bytes, timeline, loss


def measured_step(model: nn.Module, batch: Any, loss_fn: LossFn, optimizer: torch.optim.Optimizer,
                  executor: Executor | None = None, *, snapshot: bool = False,
                  ) -> tuple[PeakReading, list[tuple[float, int]], torch.Tensor]:
    """:func:`peak_step`'s step: ``(reading, timeline, loss)``, the reading with the step's PyTorch memory
    snapshot when ``snapshot`` (:func:`memplan.planner.probe.measure.peak_window`)."""
    reading, loss = step_peak(model, batch, loss_fn, optimizer, cpu_setup=lambda: _reallocate_held(executor),
                              snapshot=snapshot)
    start_ns = reading.reports[0][0] if reading.reports else 0
    reports = not device_of(model).has_allocator_counters  # CUDA's counters give no timeline
    timeline = [(0.0, reading.baseline_bytes)] if reports else []
    running = 0
    for t_ns, size in reading.reports:
        running += size
        timeline.append(((t_ns - start_ns) * 1e-9, reading.baseline_bytes + running))
    return reading, _thin(timeline, MAX_TIMELINE_POINTS), loss


def _reallocate_held(executor: Executor | None) -> list[torch.Tensor]:
    """Swap each gradient forward fusion holds between steps for a copy made now (same values), and return
    the originals: the copy's allocation and, when its update is applied, its free are reported; the
    originals (not in the baseline) are freed after the window. Measurement only: the step computes the
    same numbers."""
    pending = getattr(getattr(executor, "fused", None), "pending", None)
    originals: list[torch.Tensor] = []
    if pending:
        with torch.no_grad():
            for p, g in list(pending.items()):
                originals.append(g)
                pending[p] = g.clone()
    return originals


def run_plan(model: nn.Module, batch: Any, loss_fn: LossFn, optimizer: torch.optim.Optimizer | None,
             plan: Plan, graph: Graph, *, steps: int = 5, warmup: int = 1, fuse: str | None = None,
             max_grad_norm: float | None = None, keep_all: bool = True, name: str | None = None,
             snapshot: bool = False) -> RunReport:
    """Train ``warmup + 1 + steps`` steps of ``model`` under ``plan`` and return predicted against measured.

    ``model``, ``batch`` and ``loss_fn`` as for the profiler; they are moved to the graph's device (a graph
    profiled on CUDA needs a GPU here); a model on the meta device (planned with ``fake=True``) is
    allocated there and initialised (:func:`memplan.planner.probe.materialize.materialize`). ``optimizer``
    defaults to AdamW (foreach), as profiled; it must be built over ``model``'s parameters. ``fuse`` (None, "backward", "forward") and ``max_grad_norm`` go to
    :func:`memplan.executor.apply`. With ``keep_all``, ``warmup + 1 + steps`` more steps are then run
    without the plan (:func:`memplan.planner.probe.measure.measure_step`) for the keep-everything figures.
    The model is trained by all of these steps. ``snapshot``: the measured step is also recorded as a
    PyTorch memory snapshot (``report.memory_snapshot``; ``memplan run --snapshot`` writes it).

    Raises :class:`PlanMismatch` if the plan is for another graph or model (before any step runs), and
    :class:`MemplanError` for ``steps < 1``, ``warmup < 0`` or a CUDA graph without a GPU.
    """
    if steps < 1 or warmup < 0:
        raise MemplanError(f"run_plan needs steps >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    if graph.device == "cuda" and not cuda_available():
        raise MemplanError(f"graph {graph.name} was profiled on CUDA and no GPU is available here; "
                           f"profile on this machine")
    layer = device_of(graph.device)
    device = layer.torch_device  # where the tensors live (an emulated GPU's on the CPU)
    # checks the plan against the graph first; a fused step is charged what the profile measured fusion adds
    predicted = simulate(graph, plan, timeline=False, fuse=fuse)
    keep_all_predicted = simulate(graph, None, timeline=False)
    materialize(model, device)  # a model built on the meta device is allocated and initialised here
    model.train()
    batch = move_batch(batch, device)
    optimizer = optimizer or default_optimizer(model)
    sync = layer.synchronize  # CUDA kernels are asynchronous: wait before reading the clock

    def step() -> torch.Tensor:
        return training_step(model, batch, loss_fn, optimizer)

    losses: list[torch.Tensor] = []
    times: list[float] = []
    ex = apply(model, plan, graph=graph, optimizer=optimizer, fuse=fuse, max_grad_norm=max_grad_norm)
    # forward fusion applies a step's updates in the next forward: the first step applies none, the second
    # creates the optimizer's state there; the measured step is one whose forward applies them with the state
    # in place, as every later step's does (after one warm-up it read 4% under the steady step's peak)
    settle = 1 if fuse == "forward" else 0
    try:
        for _ in range(warmup + settle):
            losses.append(step())
        # the memory step: the allocator's view, as planner/probe/measure.py takes it
        reading, timeline, loss = measured_step(model, batch, loss_fn, optimizer, ex, snapshot=snapshot)
        peak, baseline, memory_snapshot = reading.peak_bytes, reading.baseline_bytes, reading.snapshot
        losses.append(loss)
        replays = ex.last_step.replays if ex.last_step is not None else 0
        events = Counter("late" if e.reason.startswith("late") else e.kind
                         for e in ex.last_step.events) if ex.last_step is not None else Counter()
        for _ in range(steps):
            sync()
            t0 = time.perf_counter()
            losses.append(step())
            sync()
            times.append(time.perf_counter() - t0)
        host_pool_bytes = ex.host_pool_bytes
    finally:
        ex.remove()  # flushes pending fused updates and gives the optimizer its step back
    base = measure_step(model, batch, loss_fn, optimizer, steps=steps, warmup=warmup) if keep_all else None
    counts = Counter(a.value for a in plan.actions().values())
    moved = counts.get("recompute", 0) + counts.get("offload", 0)
    return RunReport(
        workload=name or graph.name, graph_fingerprint=graph.fingerprint,
        device=f"{graph.device} (emulated)" if layer.emulated else str(device),
        solver=plan.solver.name, status=plan.solver.status,
        fuse=fuse, steps=steps, warmup=warmup, budget_bytes=plan.budget_bytes,
        predicted_peak_bytes=predicted.peak_bytes, measured_peak_bytes=peak,
        predicted_step_s=predicted.time_s, measured_step_s=statistics.median(times),
        step_times_s=tuple(times), losses=tuple(float(x) for x in losses), baseline_bytes=baseline,
        keep_all_predicted_peak_bytes=keep_all_predicted.peak_bytes,
        keep_all_predicted_step_s=keep_all_predicted.time_s,
        keep_all_measured_peak_bytes=base.peak_bytes if base else None,
        keep_all_measured_step_s=base.step_time_s if base else None,
        decisions={"keep": len(graph.saved_activations) - moved, "recompute": counts.get("recompute", 0),
                   "offload": counts.get("offload", 0)},
        replays_per_step=replays, late_fetches_per_step=events.get("late", 0), host_pool_bytes=host_pool_bytes,
        timeline=tuple(timeline),
        profile_peak_bytes=graph.meta.get("profile_peak_bytes", graph.measured.peak_bytes),
        memory_snapshot=memory_snapshot,
    )
