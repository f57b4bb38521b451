"""The measured peak of a real training step: the number the simulator is held to.

It shares nothing with the profiler's bookkeeping (no dispatch mode, no graph): the peak comes from the
allocator's own accounting.

* **CUDA**: ``torch.cuda.reset_peak_memory_stats`` then ``max_memory_allocated`` over the step.
* **CPU**: the step runs under ``torch.profiler.profile(profile_memory=True)``; the CPU allocator reports
  every allocation and free made during the step; the peak is the bytes live at the start (the storages
  of the parameters, buffers, batch and optimizer state, gradients if any) plus the highest running sum of
  those reports. Memory that bypasses PyTorch's allocator (a BLAS library's own buffers) is in neither.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from memplan.planner.workloads import LossFn, compute_loss, default_optimizer, training_step


@dataclass(frozen=True)
class StepMeasurement:
    """One training step as measured: ``peak_bytes`` (fixed memory included), median times over the timed
    steps, and ``baseline_bytes`` (what was live when the step began)."""

    peak_bytes: int
    step_time_s: float
    forward_time_s: float
    backward_time_s: float
    baseline_bytes: int
    device: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def live_storage_bytes(model: nn.Module, batch: Any, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages a step starts with: parameters (and any gradients), buffers, the
    batch's tensors and the optimizer's state."""
    tensors: list[torch.Tensor] = list(model.parameters()) + list(model.buffers())
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += _leaves(batch)
    for state in optimizer.state.values():
        tensors += _leaves(state)
    seen: set[int] = set()
    total = 0
    for t in tensors:
        s = t.untyped_storage()
        if s._cdata not in seen:
            seen.add(s._cdata)
            total += s.nbytes()
    return total


def _leaves(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _leaves(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _leaves(v)]
    return []


@contextlib.contextmanager
def _without_kineto_chatter() -> Iterator[None]:
    """Kineto writes a ``USDT: ... profiler_start``/``profiler_stop`` line to file descriptor 2 each time a
    profiler starts or stops; users of the CLI should not see it. Descriptor 2 goes to a temporary file
    while the profiler starts or stops, and every other line written meanwhile is passed on."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # stderr replaced by an object without a descriptor
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), fd)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, fd)
            os.close(saved)
            sink.seek(0)
            rest = [line for line in sink.read().decode(errors="replace").splitlines(keepends=True)
                    if not line.startswith("USDT:")]
            if rest:
                sys.stderr.write("".join(rest))


@contextlib.contextmanager
def allocator_events() -> Iterator[Any]:
    """``torch.profiler.profile(activities=[CPU], profile_memory=True)``, quiet: yields the profiler,
    whose event tree holds every allocation and free the CPU allocator made inside the block."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    prof = torch_profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _without_kineto_chatter():
        prof.__enter__()
    try:
        yield prof
    finally:
        with _without_kineto_chatter():
            prof.__exit__(None, None, None)


def _cpu_step_peak(model, batch, loss_fn, optimizer) -> tuple[int, int]:
    optimizer.zero_grad(set_to_none=True)
    baseline = live_storage_bytes(model, batch, optimizer)
    with allocator_events() as prof:
        loss = compute_loss(model, batch, loss_fn)
        loss.backward()
        optimizer.step()
        del loss
    running = high = 0
    for _, size in cpu_allocations(prof):
        running += size
        high = max(high, running)
    return baseline + high, baseline


def cpu_allocations(prof: Any) -> list[tuple[int, int]]:
    """``(time_ns, bytes)`` of every report the CPU allocator made inside an :func:`allocator_events`
    block, in time order: positive for an allocation, negative for a free. Their running sum on top of
    the bytes live before the block is the memory in use over time."""
    from torch._C._profiler import _EventType

    allocations: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation:
            # only CPU reports count: a CPU step may still touch other devices' allocators
            if e.extra_fields.device.type == torch.device("cpu").type:
                allocations.append((e.start_time_ns, e.extra_fields.alloc_size))
        stack.extend(e.children)
    allocations.sort(key=lambda a: a[0])
    return allocations


def _cuda_step_peak(model, batch, loss_fn, optimizer, device) -> tuple[int, int]:
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    baseline = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    loss = compute_loss(model, batch, loss_fn)
    loss.backward()
    optimizer.step()
    del loss
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device), baseline


def measure_step(model: nn.Module, batch: Any, loss_fn: LossFn, optimizer: torch.optim.Optimizer | None = None,
                 *, steps: int = 3, warmup: int = 1) -> StepMeasurement:
    """Measure a real training step (``zero_grad(set_to_none=True)``, ``loss_fn(model, batch)``, backward,
    ``optimizer.step()``) of ``model`` on the device its parameters are on.

    ``warmup`` steps first (at least one is needed unless the optimizer already has state, so that the
    state is part of the baseline, as in steady training); then one step whose peak is measured, and
    ``steps`` timed steps whose median forward, backward and total times are returned. The model is
    trained by these steps. ``optimizer`` defaults to AdamW (foreach).
    """
    if steps < 1:
        raise ValueError(f"measure_step needs steps >= 1, got {steps}")
    optimizer = optimizer or default_optimizer(model)
    device = next(model.parameters()).device
    on_cuda = device.type == "cuda"

    def sync() -> None:
        if on_cuda:  # CUDA kernels are asynchronous: wait for them before reading the clock
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        training_step(model, batch, loss_fn, optimizer)
    if on_cuda:
        peak, baseline = _cuda_step_peak(model, batch, loss_fn, optimizer, device)
    else:
        peak, baseline = _cpu_step_peak(model, batch, loss_fn, optimizer)
    fwd, bwd, total = [], [], []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        loss = compute_loss(model, batch, loss_fn)
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        optimizer.step()
        sync()
        t3 = time.perf_counter()
        del loss
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
        total.append(t3 - t0)
    return StepMeasurement(peak_bytes=peak, step_time_s=statistics.median(total),
                           forward_time_s=statistics.median(fwd), backward_time_s=statistics.median(bwd),
                           baseline_bytes=baseline, device=str(device))


def allocation_highs(prof: Any) -> dict[str, int]:
    """``memplan:*`` range name -> the highest running sum of the allocation events inside it, from a
    :func:`allocator_events` block whose calls ran inside ``_RecordFunctionFast("memplan:<n>")`` ranges."""
    from torch._C._profiler import _EventType

    highs: dict[str, int] = {}

    def allocations(event: Any) -> list[tuple[int, int]]:
        found = []
        stack = list(event.children)
        while stack:
            e = stack.pop()
            if e.tag == _EventType.Allocation:
                found.append((e.start_time_ns, e.extra_fields.alloc_size))
            stack.extend(e.children)
        return sorted(found)

    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.name.startswith("memplan:"):
            highs[e.name] = max_prefix([size for _, size in allocations(e)])
            continue  # ranges do not nest: the handler runs with the mode off
        stack.extend(e.children)
    return highs


def max_prefix(deltas: list[int]) -> int:
    """The highest running sum of ``deltas`` (0 at least): a high-water mark from +/- byte events."""
    best = running = 0
    for d in deltas:
        running += d
        best = max(best, running)
    return best
