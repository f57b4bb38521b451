"""Measuring real training steps: peaks from the allocator, phase times from the clock. The one place
that reads either, for one process (:func:`measure_step`, :func:`step_peak`, :func:`peak_window`), for
one rank of a distributed step (:func:`measure_rank_step`), and for the profiler's per-op high-water
marks (:func:`allocation_highs`). The executor's runs and the framework callbacks measure through it.

It shares nothing with the profiler's bookkeeping (no dispatch mode, no graph): the peak comes from the
allocator's own accounting.

* **CUDA**: ``torch.cuda.reset_peak_memory_stats`` then ``max_memory_allocated`` over the step (through
  the device layer, :mod:`memplan.planner.probe.device`; under its CUDA emulation, the CPU's reports below,
  each allocation charged as CUDA's caching allocator charges it).
* **CPU**: the step runs under ``torch.profiler.profile(profile_memory=True)``; the CPU allocator reports
  every allocation and free made during the step; the peak is the bytes live at the start (the storages
  of the parameters, buffers, batch and optimizer state, gradients if any) plus the highest running sum of
  those reports. Memory that bypasses PyTorch's allocator (a BLAS library's own buffers) is in neither.
  The profiler's event tree is walked once, by :func:`allocator_walk`; :func:`cpu_allocations`,
  :func:`allocation_highs` and :func:`measure_rank_step` read its result.
* **Time**: ``time.perf_counter`` around each phase of the step (:class:`PhaseClock`), synchronised on
  CUDA; medians over the timed steps (:func:`time_steps`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from memplan.planner.core.devicespec import round_allocation
from memplan.planner.core.errors import MemplanError
from memplan.planner.core.snapshot import Report as SnapshotReport
from memplan.planner.core.snapshot import Storage, measured_snapshot
from memplan.planner.probe.device import Device, device_of, is_host_buffer
from memplan.planner.probe.fusion import fused_training
from memplan.planner.probe.storage import storage_of, tensors_in, unique_bytes
from memplan.planner.workloads import STEP_PHASES, LossFn, default_optimizer, training_step


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


def live_storage_bytes(model: nn.Module, batch: Any, optimizer: torch.optim.Optimizer,
                       device: Device | None = None) -> int:
    """Bytes of the distinct storages a step starts with: parameters (and any gradients), buffers, the
    batch's tensors and the optimizer's state; each charged as ``device``'s allocator charges it (None: the
    tensor's own device type)."""
    tensors: list[torch.Tensor] = list(model.parameters()) + list(model.buffers())
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += tensors_in(batch)
    for state in optimizer.state.values():
        tensors += tensors_in(state)
    # state a plan keeps in a host pool (streamed optimizer state) is the host's memory, not the device's
    tensors = [t for t in tensors if not is_host_buffer(t)]
    return unique_bytes(tensors, set(), device.type if device is not None else None)


def untracked_bytes(model: nn.Module, batch: Any, optimizer: torch.optim.Optimizer) -> int:
    """Memory the device of ``model`` holds beyond the storages a step starts with (cuBLAS workspaces, one
    per handle and stream, that the first matrix products of forward's thread and of autograd's device
    thread created): with allocator counters, ``memory_allocated`` less :func:`live_storage_bytes`, read
    between steps; elsewhere the device layer's own figure (0 on a CPU)."""
    layer = device_of(model)
    if not layer.has_allocator_counters:
        return layer.untracked_bytes()
    layer.synchronize()
    return max(0, layer.memory_allocated() - live_storage_bytes(model, batch, optimizer, layer))


# ---- the CPU allocator's reports, through torch.profiler -----------------------------------------------------


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


@dataclass(frozen=True)
class AllocatorReport:
    """One report of an allocator inside an :func:`allocator_events` block: ``bytes`` positive for an
    allocation, negative for a free; ``scope``: the ``memplan:*`` range around it (None: none);
    ``collective_end_ns``: the end of the innermost ``c10d::`` range around it (None: none); ``ops``: the
    names of the events around it, innermost first (filled by ``allocator_walk(prof, ops=True)``)."""

    time_ns: int
    bytes: int
    address: int
    device_type: str
    scope: str | None
    collective_end_ns: int | None
    ops: tuple[str, ...] = ()


@dataclass
class AllocatorWalk:
    """What :func:`allocator_walk` read: every allocator report in the event tree's walk order (sort by
    ``time_ns`` for time order), and each outermost ``memplan:*`` range's ``(start_ns, end_ns)`` (the
    first seen of a name)."""

    reports: list[AllocatorReport] = field(default_factory=list)
    ranges: dict[str, tuple[int, int]] = field(default_factory=dict)


def allocator_walk(prof: Any, *, ops: bool = False) -> AllocatorWalk:
    """The one walk of a finished :func:`allocator_events` profiler's event tree. ``memplan:*`` ranges do
    not nest (the profiler's and the measurement's ranges are opened with every mode off): a report's
    scope is the outermost one around it. ``ops``: also record each report's enclosing events' names
    (:attr:`AllocatorReport.ops`: what a memory snapshot's frames show)."""
    from torch._C._profiler import _EventType

    walk = AllocatorWalk()
    if ops:
        return _walk_with_ops(prof, walk, _EventType.Allocation)
    stack = [(e, None, None) for e in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        e, scope, c10d_end = stack.pop()
        if e.tag == _EventType.Allocation:
            walk.reports.append(AllocatorReport(e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr,
                                                e.extra_fields.device.type, scope, c10d_end))
            continue
        if scope is None and e.name.startswith("memplan:"):
            walk.ranges.setdefault(e.name, (e.start_time_ns, e.end_time_ns))
            scope = e.name
        if e.name.startswith("c10d::"):
            c10d_end = e.end_time_ns
        stack.extend((c, scope, c10d_end) for c in e.children)
    return walk


def _walk_with_ops(prof: Any, walk: AllocatorWalk, allocation: Any) -> AllocatorWalk:
    """:func:`allocator_walk` that also names each report's enclosing events (innermost first)."""
    stack = [(e, None, None, ()) for e in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        e, scope, c10d_end, names = stack.pop()
        if e.tag == allocation:
            walk.reports.append(AllocatorReport(e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr,
                                                e.extra_fields.device.type, scope, c10d_end, names))
            continue
        if scope is None and e.name.startswith("memplan:"):
            walk.ranges.setdefault(e.name, (e.start_time_ns, e.end_time_ns))
            scope = e.name
        if e.name.startswith("c10d::"):
            c10d_end = e.end_time_ns
        inner = (e.name, *names)
        stack.extend((c, scope, c10d_end, inner) for c in e.children)
    return walk


def _charged(size: int, charge: Callable[[int], int] | None) -> int:
    """A signed report's bytes as ``charge`` (an allocator's rounding) counts them."""
    if charge is None or size == 0:
        return size
    return charge(size) if size > 0 else -charge(-size)


def cpu_allocations(prof: Any, charge: Callable[[int], int] | None = None) -> list[tuple[int, int]]:
    """``(time_ns, bytes)`` of every report the CPU allocator made inside an :func:`allocator_events`
    block, in time order: positive for an allocation, negative for a free. Their running sum on top of
    the bytes live before the block is the memory in use over time (other devices' reports are left out:
    a CPU step may still touch their allocators). ``charge``: each report's bytes as an allocator counts
    them (the emulated CUDA device's rounding; None: as reported)."""
    out = [(r.time_ns, _charged(r.bytes, charge)) for r in allocator_walk(prof).reports if r.device_type == "cpu"]
    out.sort(key=lambda a: a[0])
    return out


def allocation_highs(prof: Any, charge: Callable[[int], int] | None = None) -> dict[str, int]:
    """``memplan:*`` range name -> the highest running sum of the allocation events inside it, from a
    :func:`allocator_events` block whose calls ran inside ``_RecordFunctionFast("memplan:<n>")`` ranges;
    ``charge`` as for :func:`cpu_allocations`."""
    walk = allocator_walk(prof)
    inside: dict[str, list[tuple[int, int]]] = {name: [] for name in walk.ranges}
    for r in walk.reports:
        if r.scope is not None:
            inside[r.scope].append((r.time_ns, _charged(r.bytes, charge)))
    return {name: max_prefix([size for _, size in sorted(found)]) for name, found in inside.items()}


def max_prefix(deltas: list[int]) -> int:
    """The highest running sum of ``deltas`` (0 at least): a high-water mark from +/- byte events."""
    best = running = 0
    for d in deltas:
        running += d
        best = max(best, running)
    return best


# ---- peaks ----------------------------------------------------------------------------------------------------


@dataclass
class PeakReading:
    """What :func:`peak_window` read: ``baseline_bytes`` live when it opened, ``peak_bytes`` the highest
    in use inside it (baseline included), and on CPU the allocator's ``reports`` as ``(time_ns, ±bytes)``
    in time order (empty on CUDA). Filled when the window closes."""

    baseline_bytes: int = 0
    peak_bytes: int = 0
    reports: list[tuple[int, int]] = field(default_factory=list)
    snapshot: dict[str, Any] | None = None  # with ``peak_window(..., snapshot=True)``: the step's memory snapshot


def start_storages(model: nn.Module, batch: Any, optimizer: torch.optim.Optimizer,
                   device: Device | None = None) -> list[Storage]:
    """The distinct storages a step starts with, as :func:`live_storage_bytes` counts them, each with what
    it is (parameter, gradient, buffer, input, optimizer state) and its name where it has one."""
    named = [(t, "parameter", n) for n, t in model.named_parameters()]
    named += [(t.grad, "gradient", f"{n}.grad") for n, t in model.named_parameters() if t.grad is not None]
    named += [(t, "buffer", n) for n, t in model.named_buffers()]
    named += [(t, "input", "the batch") for t in tensors_in(batch)]
    for state in optimizer.state.values():
        named += [(t, "optimizer state", "the optimizer's state") for t in tensors_in(state)]
    seen: set[int] = set()
    out = []
    for t, category, name in named:
        s = storage_of(t)
        if s is None or s._cdata in seen or is_host_buffer(t):  # a host pool's state is not the device's
            continue
        seen.add(s._cdata)
        nbytes = round_allocation(s.nbytes(), device.type if device is not None else t.device.type)
        out.append(Storage(s.data_ptr(), nbytes, category, f"{category}: {name} ({t.dtype}, {list(t.shape)})"))
    return out


@contextlib.contextmanager
def peak_window(model: nn.Module, batch: Any, optimizer: torch.optim.Optimizer, *,
                snapshot: bool = False) -> Iterator[PeakReading]:
    """The allocator's peak over the block, on the device of ``model``'s parameters: CUDA's
    ``max_memory_allocated`` after a reset (baseline: ``memory_allocated``); on CPU (and emulated CUDA) the
    allocator's reports, charged as the device charges them, on top of :func:`live_storage_bytes` of
    ``model``, ``batch`` and ``optimizer`` and the device's untracked bytes. The CPU allocator reports no
    free of a block allocated before the window: what the block frees must be allocated in it.

    ``snapshot``: also record the block as a PyTorch memory snapshot (``reading.snapshot``): on CUDA
    PyTorch's own (``torch.cuda.memory._record_memory_history`` over the block, then ``_snapshot()``); on
    a CPU from the allocator's reports (:func:`memplan.planner.core.snapshot.measured_snapshot`), the
    storages live when it opened allocated first."""
    layer = device_of(model)
    # garbage from before the window (objects in reference cycles: an earlier executor, its model and
    # optimizer) freed by a collection inside it would read as this block's frees, below its true peak (a
    # random-plan test read 11% low after earlier plans' executors); collected before the window opens
    gc.collect()
    if layer.has_allocator_counters:
        layer.synchronize()  # earlier kernels' memory is settled before the reset
        reading = PeakReading(baseline_bytes=layer.memory_allocated())
        with layer.memory_history() if snapshot else contextlib.nullcontext() as taken:
            layer.reset_peak()
            yield reading
            layer.synchronize()  # the block's kernels are asynchronous
            reading.peak_bytes = layer.max_memory_allocated()
            if taken is not None:
                reading.snapshot = taken()
        return
    reading = PeakReading(baseline_bytes=live_storage_bytes(model, batch, optimizer, layer)
                          + layer.untracked_bytes())
    storages = start_storages(model, batch, optimizer, layer) if snapshot else []
    with allocator_events() as prof:
        yield reading
    charge = layer.charged_bytes if layer.emulated else None
    if snapshot:
        walk = allocator_walk(prof, ops=True)
        cpu = sorted((r for r in walk.reports if r.device_type == "cpu"), key=lambda r: r.time_ns)
        reading.reports = [(r.time_ns, _charged(r.bytes, charge)) for r in cpu]
        reading.snapshot = measured_snapshot(
            storages, [SnapshotReport(r.time_ns, _charged(r.bytes, charge), r.address, r.ops) for r in cpu],
            name=type(model).__name__)
    else:
        reading.reports = cpu_allocations(prof, charge)
    reading.peak_bytes = reading.baseline_bytes + max_prefix([size for _, size in reading.reports])


def step_peak(model: nn.Module, batch: Any, loss_fn: LossFn, optimizer: torch.optim.Optimizer, *,
              cpu_setup: Callable[[], Any] | None = None, snapshot: bool = False) -> tuple[PeakReading, torch.Tensor]:
    """One :func:`memplan.planner.workloads.training_step` inside a :func:`peak_window` (the gradients
    released first, outside it); returns the reading and the step's loss (detached). ``cpu_setup`` runs
    first inside a CPU window; what it returns is held until the window has closed (the executor's
    re-allocation of held gradients, so that their frees are reported). ``snapshot``: as for
    :func:`peak_window`."""
    optimizer.zero_grad(set_to_none=True)
    reads_reports = not device_of(model).has_allocator_counters
    with peak_window(model, batch, optimizer, snapshot=snapshot) as reading:
        held = cpu_setup() if cpu_setup is not None and reads_reports else None
        loss = training_step(model, batch, loss_fn, optimizer)
    del held  # freed outside the window: neither in the baseline nor in the reports
    return reading, loss


@dataclass(frozen=True)
class RankMeasurement:
    """One rank's training step as the allocator saw it: ``peak_bytes`` (everything live included),
    ``start_bytes`` (live when the step began, gradients already released: parameters, buckets or shards,
    optimizer state, batch)."""

    rank: int
    peak_bytes: int
    start_bytes: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


_RANK_STEP = "memplan:rank_step"


def measure_rank_step(build: Callable[[], tuple[Any, Any]], batch: Any, loss_fn: LossFn, *,
                      warmup: int = 1, rank: int = 0, device: torch.device | None = None) -> RankMeasurement:
    """Measure one training step of this rank (a DDP or FSDP2 rank: see :mod:`memplan.planner.probe.distributed`).

    ``build()`` returns ``(train_model, optimizer)``: it creates the rank's model (a copy of the bare
    module), wraps it (DDP or fully_shard, optionally with a plan applied) and makes the optimizer.
    ``warmup`` steps create the optimizer state (and let DDP rebuild its buckets); the next step is
    measured, its gradients released first.

    On CUDA (``device``) the allocator's peak over the step after a reset, ``start_bytes`` its
    ``memory_allocated`` before. On CPU (``device`` None or CPU) from the allocator's events: ``build()``
    runs inside the measured window, so that every allocation the rank's training holds is seen, and every
    free too (the CPU allocator reports no free of a block allocated before the window: the full parameters
    that fully_shard replaces must be allocated inside it). ``batch`` is allocated before and counted.
    Memory that the allocator does not report (gloo's own buffers, allocations on threads the profiler
    does not follow) is not counted; a free the profiler misses is restored (:func:`restore_missed_frees`)
    where it can be: a block freed on gloo's worker thread whose address is not handed out again inside the
    window cannot, so build DDP here with ``init_sync=False`` (its constructor's broadcast buffer is such a
    block when the worker thread drops the work last: one measurement in eight on a small MLP).
    """
    if warmup < 1:
        raise ValueError(f"measure_rank_step needs warmup >= 1 (to create the optimizer state), got {warmup}")
    layer = device_of(device if device is not None else "cpu")
    if layer.has_allocator_counters:
        train_model, optimizer = build()
        for _ in range(warmup):
            training_step(train_model, batch, loss_fn, optimizer)
        optimizer.zero_grad(set_to_none=True)
        layer.synchronize()
        start = layer.memory_allocated()
        layer.reset_peak()
        training_step(train_model, batch, loss_fn, optimizer)
        layer.synchronize()  # wait for the step's kernels before reading the allocator
        return RankMeasurement(rank=rank, peak_bytes=layer.max_memory_allocated(), start_bytes=start)
    baseline = unique_bytes(tensors_in(batch), set())
    with allocator_events() as prof:
        train_model, optimizer = build()
        for _ in range(warmup):
            training_step(train_model, batch, loss_fn, optimizer)
        optimizer.zero_grad(set_to_none=True)  # the step starts without gradients, as the graph's does
        with torch.profiler.record_function(_RANK_STEP):
            training_step(train_model, batch, loss_fn, optimizer)
        optimizer.zero_grad(set_to_none=True)
    walk = allocator_walk(prof)
    window = walk.ranges.get(_RANK_STEP)
    if window is None:
        raise MemplanError("measure_rank_step: the profiler recorded no step range (a bug)")
    events = [(r.time_ns, r.bytes, r.address, r.collective_end_ns) for r in walk.reports
              if r.device_type == "cpu" and r.bytes]
    running = 0
    start = high = None
    for at, size in restore_missed_frees(events):
        if at >= window[0] and start is None:
            start = high = running
        if at > window[1]:
            break
        running += size
        if start is not None:
            high = max(high, running)
    if start is None:
        start = high = running
    return RankMeasurement(rank=rank, peak_bytes=baseline + high, start_bytes=baseline + start)


def restore_missed_frees(events: list[tuple[int, int, int, int | None]]) -> list[tuple[int, int]]:
    """``(time_ns, ±bytes)`` in time order from allocator events ``(time_ns, ±bytes, address, end_ns of
    the innermost enclosing c10d:: range or None)``, with the frees the profiler missed put back: a block
    whose address is allocated again while it looks live is freed at the end of its collective's range if
    it has one, else at that reallocation; a block never freed that a collective made is freed at the end
    of its range. A free of a block allocated before the events is dropped (its size is unknown).

    The profiler misses some frees: a block allocated inside a collective (gloo's copy of the input of
    ``reduce_scatter_tensor``) is freed by whichever thread drops the work's last reference, and when that
    is gloo's worker thread, after the work ran, the thread no longer reports to the profiler. The block
    then looks live for ever (its address is handed out again later, which proves it was freed). The
    collective is synchronous: its temporaries go when it returns."""
    out: list[tuple[int, int]] = []
    live: dict[int, tuple[int, int | None]] = {}  # address -> (bytes, end of its c10d range)
    for at, size, ptr, c10d_end in sorted(events, key=lambda e: e[0]):
        if size > 0:
            if ptr in live:  # reallocated: the earlier block was freed without a report
                old, old_end = live.pop(ptr)
                out.append((min(old_end, at) if old_end is not None else at, -old))
            live[ptr] = (size, c10d_end)
            out.append((at, size))
        elif ptr in live:
            live.pop(ptr)
            out.append((at, size))
    out += [(end, -size) for size, end in live.values() if end is not None]
    out.sort(key=lambda a: a[0])
    return out


# ---- times ------------------------------------------------------------------------------------------------------


def op_clock(device: torch.device | str | None = None) -> Callable[[], float]:
    """The clock ops and plain steps are timed with on ``device`` (None: the default device): with one
    torch thread on a CPU, the thread's CPU time (the op runs on the calling thread; other jobs' time slices
    on a shared machine would otherwise land on the longest ops and skew the op times against each other);
    on CUDA wall time (:meth:`memplan.planner.probe.device.Device.clock`)."""
    return device_of(device).clock()


class PhaseClock:
    """A ``run_phase`` for :func:`memplan.planner.workloads.training_step` that times each phase:
    ``seconds[phase]`` gains one entry per step. ``sync`` (CUDA: ``torch.cuda.synchronize``) runs before
    each phase starts and after it ends, so that queued kernels are waited for before the clock is read."""

    def __init__(self, sync: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.sync = sync
        self.clock = clock
        self.seconds: dict[str, list[float]] = {phase: [] for phase in STEP_PHASES}

    def __call__(self, phase: str, fn: Callable[[], Any]) -> Any:
        self.sync()
        start = self.clock()
        out = fn()
        self.sync()
        self.seconds[phase].append(self.clock() - start)
        return out


@dataclass(frozen=True)
class StepTimes:
    """Median seconds over timed training steps: of forward (with the loss), backward, ``optimizer.step()``
    and of the three together (``step_s``, the median of each step's sum)."""

    forward_s: float
    backward_s: float
    optimizer_s: float
    step_s: float


def time_steps(model: nn.Module, batch: Any, loss_fn: LossFn, optimizer: torch.optim.Optimizer, *,
               steps: int, device: torch.device | None = None,
               clock: Callable[[], float] = time.perf_counter) -> StepTimes:
    """``steps`` plain training steps (no mode, no hooks: what eager training pays), each phase timed by a
    :class:`PhaseClock` reading ``clock``, synchronised when ``device`` (None: that of ``model``'s
    parameters) is CUDA."""
    if steps < 1:
        raise ValueError(f"time_steps needs steps >= 1, got {steps}")
    layer = device_of(device if device is not None else model)
    phases = PhaseClock(layer.synchronize, clock)
    for _ in range(steps):
        training_step(model, batch, loss_fn, optimizer, run_phase=phases)
    fwd, bwd, opt = (phases.seconds[p] for p in STEP_PHASES)
    return StepTimes(forward_s=statistics.median(fwd), backward_s=statistics.median(bwd),
                     optimizer_s=statistics.median(opt),
                     step_s=statistics.median(f + b + o for f, b, o in zip(fwd, bwd, opt, strict=True)))


def fused_extra_s(model: nn.Module, batch: Any, loss_fn: LossFn, optimizer: torch.optim.Optimizer, mode: str, *,
                  rounds: int, device: torch.device | None = None,
                  clock: Callable[[], float] = time.perf_counter) -> float:
    """What fusing the optimizer's updates into ``mode`` ("backward" or "forward", planner/probe/fusion.py)
    adds to a plain training step here: ``rounds`` rounds of one plain step, then, fused, one untimed step
    (in forward fusion the first forward after the switch has no update pending) and one timed; the
    median of the fused steps less the median of the plain ones, each synchronised and read with
    ``clock`` as :func:`time_steps` does. Interleaved, so that a machine whose speed drifts (a shared one)
    moves both alike. Fused steps update the parameters exactly as plain ones (the model is trained by
    these steps). Negative when fusion is faster (the updates hide under the device's work)."""
    if rounds < 1:
        raise ValueError(f"fused_extra_s needs rounds >= 1, got {rounds}")

    def timed() -> float:
        return time_steps(model, batch, loss_fn, optimizer, steps=1, device=device, clock=clock).step_s

    plain_s: list[float] = []
    fused_s: list[float] = []
    for _ in range(rounds):
        plain_s.append(timed())
        with fused_training(model, optimizer, mode):
            training_step(model, batch, loss_fn, optimizer)
            fused_s.append(timed())
    return statistics.median(fused_s) - statistics.median(plain_s)


def measure_step(model: nn.Module, batch: Any, loss_fn: LossFn, optimizer: torch.optim.Optimizer | None = None,
                 *, steps: int = 3, warmup: int = 1) -> StepMeasurement:
    """Measure a real training step (:func:`memplan.planner.workloads.training_step`) of ``model`` on the
    device its parameters are on.

    ``warmup`` steps first (at least one is needed unless the optimizer already has state, so that the
    state is part of the baseline, as in steady training); then one step whose peak is measured
    (:func:`step_peak`), and ``steps`` timed steps whose median forward, backward and total times are
    returned (:func:`time_steps`). The model is trained by these steps. ``optimizer`` defaults to AdamW
    (foreach).
    """
    if steps < 1:
        raise ValueError(f"measure_step needs steps >= 1, got {steps}")
    optimizer = optimizer or default_optimizer(model)
    device = next(model.parameters()).device
    for _ in range(warmup):
        training_step(model, batch, loss_fn, optimizer)
    reading, _ = step_peak(model, batch, loss_fn, optimizer)
    times = time_steps(model, batch, loss_fn, optimizer, steps=steps, device=device)
    return StepMeasurement(peak_bytes=reading.peak_bytes, step_time_s=times.step_s,
                           forward_time_s=times.forward_s, backward_time_s=times.backward_s,
                           baseline_bytes=reading.baseline_bytes, device=str(device))
