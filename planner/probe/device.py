"""The device layer: everything that differs between a CPU and a CUDA GPU, in one place.

The probe (profiling, op timing, measurement) and the executor (offload copies, RNG, the output checks)
ask a :class:`Device` what they need and never test ``is_cuda`` or call ``torch.cuda`` themselves:

* **bytes**: what the allocator charges for a storage (:meth:`Device.charged_bytes`): CUDA's caching
  allocator rounds every block up to a multiple of 512 bytes, and ``memory_allocated`` counts the rounded
  size, so a graph profiled on CUDA records rounded bytes and every comparison with a live storage's
  ``nbytes()`` must charge it first;
* **memory readings**: CUDA has the allocator's counters (``memory_allocated``, ``max_memory_allocated``);
  a CPU has none, and is read from the allocator's reports under ``torch.profiler`` instead
  (:mod:`memplan.planner.probe.measure`); memory the device keeps that no tensor owns (cuBLAS workspaces,
  one per handle and stream, created at the first matrix product of each thread) is
  :meth:`Device.untracked_bytes`;
* **streams and events**: offload copies run on a copy stream (:class:`CopyStream`); a copy's
  :class:`Transfer` says whether it is known complete (``done()``, an event query) and makes compute wait
  for it (``wait()``); on a CPU a copy is synchronous and complete at once;
* **pages**: a CPU's C allocator gives memory back to the kernel within a step and its next writes fault
  fresh pages (``returns_pages``; :mod:`memplan.planner.probe.hostheap` charges them in fake profiles);
  CUDA's caching allocator keeps its blocks;
* **op times**: a :class:`Stopwatch` times calls issued back to back without waiting for the device between
  them (CUDA: an event pair per call, read after one synchronisation), so an op's time is its run on the
  device as the step has it, not the launch and the round trip of a synchronisation around it (the first
  GPU run timed each op between two synchronisations, which charges every op that round trip; its plans'
  overhead measured 2-3x under the prediction);
* **pinned host memory**, **synchronisation**, **random generator states**, the device's name, cache and
  memory sizes, and its host-link bandwidth.

**CUDA emulated on a CPU** (:func:`emulate_cuda`, or ``MEMPLAN_EMULATE_CUDA=1``): tensors live on the CPU
but the device is ``cuda`` with CUDA's rules, so that what would fail on a GPU fails in CI:

* every storage is charged and every allocator report counted as the caching allocator counts it
  (rounded up to 512 bytes), and the graph records ``cuda``;
* the copy stream is asynchronous and the host runs ahead of it: a copy is performed only when it is
  waited for (``wait()``, or a synchronisation); an event query (``done()``) says "not yet" until then,
  as it does on a GPU while the device still has queued work before the copy. Until then the copy's
  destination holds a poison pattern (every byte 0xFF: NaN in floating point), so reading a prefetched
  buffer before waiting for it gives wrong numbers, and memory released only when a query says done is
  held to the end of the step, so its excess over the plan shows in the measured peak;
* memory a copy still uses must stay allocated until the copy is known complete: a copy whose source or
  destination storage was freed before that is a :class:`StreamUseError` (on a GPU the allocator would
  hand the block to another tensor while the copy reads or writes it);
* a cuBLAS-like workspace: ``workspace_bytes`` held by the device from its first use, counted in its
  memory readings and not owned by any tensor, as a real GPU's workspaces are;
* a synchronisation costs the host ``sync_latency_s`` (:data:`SYNC_LATENCY_S` by default: a GPU's round
  trip, the wake-up of the waiting thread and the next launch into an idle device), which a step that never
  waits does not pay: a time taken with a synchronisation inside it is that much too long here, as it is
  on a GPU;
* a capacity (``emulate_cuda(capacity_bytes=...)``, or ``MEMPLAN_EMULATE_CAPACITY_BYTES`` beside
  ``MEMPLAN_EMULATE_CUDA=1``; :meth:`Device.total_memory` returns it): the device's live storages are
  counted as the caching allocator counts them, and an allocation that would take them past it raises
  ``torch.OutOfMemoryError`` ("CUDA out of memory. Tried to allocate ...") before the caller gets the tensor,
  so that a plan that does not fit fails in CI. PyTorch has no hook on the CPU allocator; a dispatch mode
  (:class:`DeviceMemory`, which says exactly what it counts) sees every ATen call on the thread that entered
  the block, backward's included. Host pools are never counted; without a capacity no mode is entered.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    _pop_mode,
    _push_mode,
)

from memplan.planner.core.build import NOMINAL_HOST_BANDWIDTH_BYTES_PER_S
from memplan.planner.core.devicespec import round_allocation
from memplan.planner.core.errors import MemplanError
from memplan.planner.core.units import format_bytes, parse_bytes

EMULATE_ENV = "MEMPLAN_EMULATE_CUDA"
CAPACITY_ENV = "MEMPLAN_EMULATE_CAPACITY_BYTES"  # the emulated GPU's memory ("6GiB" or bytes; unset: unlimited)
DEVICE_ENV = "MEMPLAN_DEVICE"
FALLBACK_CACHE_BYTES = 32 * 2**20  # last-level cache assumed where the device does not say
FALLBACK_CORE_CACHE_BYTES = 2**20  # a core's own cache (L2) assumed where /sys does not say


_HOST_BUFFERS: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def _register_host(buffer: torch.Tensor) -> torch.Tensor:
    if buffer.numel():
        _HOST_BUFFERS[buffer.untyped_storage().data_ptr()] = buffer
    return buffer


def is_host_buffer(t: torch.Tensor) -> bool:
    """Whether ``t`` lives in a host buffer of :meth:`Device.pinned_empty` (the host pools): on a CPU, and
    under the CUDA emulation, such memory is the host's though the tensor is a CPU tensor like the device's,
    so the device's memory readings leave it out."""
    try:
        return t.untyped_storage().data_ptr() in _HOST_BUFFERS
    except (RuntimeError, NotImplementedError):
        return False


class StreamUseError(MemplanError):
    """Emulated CUDA: memory a copy stream still used was freed before its work was known complete."""


class Transfer:
    """One copy on the copy stream. ``complete``: done when it was issued (a synchronous CPU copy)."""

    complete = True

    def done(self) -> bool:
        """Whether the copy is known to have finished (CUDA: its event's query)."""
        return True

    def wait(self) -> None:
        """Make compute wait for the copy (CUDA: the compute stream waits on its event; no host sync)."""

    def synchronize(self) -> None:
        """Make the host wait for the copy (CUDA: its event's synchronize): before the host reads what a copy
        to the host wrote (a host-stepped optimizer's gradients, a checkpoint of streamed state)."""


class CopyStream:
    """Copies between device memory and the pinned host pool, off the compute stream where the device has
    streams. ``to_host`` starts after the compute work issued so far (the producer); ``to_device`` writes a
    buffer allocated on the compute stream. CPU: synchronous ``copy_``."""

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> Transfer:
        dst.copy_(src)
        return Transfer()

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> Transfer:
        dst.copy_(src)
        return Transfer()

    def drain(self) -> None:
        """Wait until every copy issued has finished (the host blocks)."""


class HostBytes:
    """A storage's bytes kept on the host, outside the allocators a peak is read from, and copied back to a
    new storage on its device by :meth:`storage`. A CPU storage's go to a ``bytearray``; a GPU storage's to
    a pinned buffer, by a copy on the current stream that the host does not wait for (the copy back waits
    for its event: it may be issued on another stream, backward's)."""

    __slots__ = ("data", "nbytes", "device", "copied")

    def __init__(self, storage: torch.UntypedStorage):
        self.nbytes = storage.nbytes()
        self.device = storage.device
        src = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage, 0, (self.nbytes,), (1,))
        self.copied = None
        if self.device.type == "cpu":
            self.data: Any = bytearray(src.numpy())
        else:
            self.data = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
            self.data.copy_(src, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record()

    def storage(self) -> torch.UntypedStorage:
        dst = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        if self.copied is None:
            if self.nbytes:
                dst.copy_(torch.frombuffer(self.data, dtype=torch.uint8))
        else:
            torch.cuda.current_stream(self.device).wait_event(self.copied)
            dst.copy_(self.data, non_blocking=True)
        return dst.untyped_storage()


class Stopwatch:
    """Times calls issued one after another: ``mark = begin()``, issue the call, ``end(mark)``; once all are
    issued, :meth:`seconds` gives each lap. On a CPU a call runs when it is issued and each lap is read on
    the device's clock at once; subclasses read theirs where the device runs (CUDA: events)."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.laps: list[Any] = []

    def begin(self) -> Any:
        return self.clock()

    def end(self, mark: Any) -> int:
        """Close the lap begun at ``mark``; its index in :meth:`seconds`."""
        self.laps.append(self.clock() - mark)
        return len(self.laps) - 1

    def seconds(self) -> list[float]:
        """Every lap's seconds so far (waits for the device where it runs behind the host)."""
        return list(self.laps)


class _CudaStopwatch(Stopwatch):
    """An event pair per lap on the current stream, read after one synchronisation: the device's time
    between them, what the step's kernels took there while the host went on issuing."""

    def __init__(self, device: torch.device):
        super().__init__(time.perf_counter)
        self.device = device

    def begin(self) -> Any:
        start = torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(self.device))
        return start

    def end(self, mark: Any) -> int:
        stop = torch.cuda.Event(enable_timing=True)
        stop.record(torch.cuda.current_stream(self.device))
        self.laps.append((mark, stop))
        return len(self.laps) - 1

    def seconds(self) -> list[float]:
        if self.laps:  # laps recorded on autograd's device thread too: wait for the whole device
            torch.cuda.synchronize(self.device)
        return [start.elapsed_time(stop) / 1e3 for start, stop in self.laps]


class Device:
    """A CPU: exact bytes, no allocator counters (read the reports), synchronous copies."""

    type = "cpu"              # what a graph profiled here records as its device
    emulated = False
    has_allocator_counters = False  # memory_allocated / max_memory_allocated exist
    # the allocator gives memory back to the kernel within a step, so a step's writes fault fresh pages
    # (the C allocator: planner/probe/hostheap.py); a caching allocator (CUDA's) keeps its blocks
    returns_pages = True
    # a step's call finds the caches holding other calls' data and its output lands in memory the cache
    # has not seen lately, so an isolated call is timed after a cache flush, each run (planner/probe/
    # optime.py): measured on a CPU; a GPU's warm calls are still timed back to back
    calls_find_caches_cold = True

    def __init__(self, torch_device: torch.device | None = None):
        self.torch_device = torch_device or torch.device("cpu")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.torch_device})"

    # ---- bytes --------------------------------------------------------------------------------------
    def charged_bytes(self, nbytes: int) -> int:
        """What the allocator charges for a storage of ``nbytes``."""
        return round_allocation(nbytes, self.type)

    def untracked_bytes(self) -> int:
        """Memory the device holds that no tensor owns (emulated workspaces; on CUDA it is measured)."""
        return 0

    def step_workspace_bytes(self) -> int:
        """What a training step's libraries will hold on this device that no tensor owns, for a profile that
        runs no step here (a fake one): cuBLAS's workspaces on CUDA, one per handle and stream, for the two
        threads a step runs matrix products on (forward's and autograd's device thread)."""
        return self.untracked_bytes()

    # ---- allocator counters (CUDA) ---------------------------------------------------------------------
    def memory_allocated(self) -> int:
        raise MemplanError(f"{self}: no allocator counters; read the allocator's reports")

    def max_memory_allocated(self) -> int:
        raise MemplanError(f"{self}: no allocator counters; read the allocator's reports")

    def reset_peak(self) -> None:
        raise MemplanError(f"{self}: no allocator counters; read the allocator's reports")

    @contextlib.contextmanager
    def memory_history(self) -> Iterator[Callable[[], dict]]:
        """The allocator's own record of every allocation and free over the block (CUDA's
        ``_record_memory_history``); yields a function returning its memory snapshot
        (``torch.cuda.memory._snapshot()``). None here: build one from the allocator's reports."""
        raise MemplanError(f"{self}: its allocator keeps no history; read the allocator's reports")
        yield  # pragma: no cover

    @contextlib.contextmanager
    def host_side(self) -> Iterator[None]:
        """A block of host work on CPU tensors (a host-stepped optimizer's update): nothing to do on a real
        device; the emulation charges none of it to its capacity."""
        yield

    # ---- execution -------------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for the device's queued work (CUDA kernels are asynchronous)."""

    def copy_stream(self) -> CopyStream:
        return CopyStream()

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """A host byte buffer the device copies from and to asynchronously (pinned on CUDA). It is host
        memory, never the device's, whichever device type tensors on it report (:func:`is_host_buffer`)."""
        return _register_host(torch.empty(nbytes, dtype=torch.uint8))

    def stopwatch(self) -> Stopwatch:
        """Times the ops of a step (or an op's runs) issued back to back, each as the device runs it; never
        synchronise inside a lap (see :class:`Stopwatch`)."""
        return Stopwatch(self.clock())

    def clock(self) -> Callable[[], float]:
        """The clock ops and plain steps are timed with: with one torch thread on a CPU, the thread's CPU
        time (other jobs' time slices on a shared machine would land on the longest ops); else wall time."""
        return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter

    # ---- random generators -------------------------------------------------------------------------------
    def rng_state(self) -> bytearray | None:
        """The device generator's state as host bytes (None: ops here draw from the CPU generator)."""
        return None

    @contextlib.contextmanager
    def forked_rng(self, cpu_state: bytearray, device_state: bytearray | None) -> Iterator[None]:
        """Run the block from these generator states and give the caller's streams back afterwards (as
        ``torch.utils.checkpoint`` does, with ``torch.random.fork_rng``)."""
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(torch.frombuffer(cpu_state, dtype=torch.uint8))
            yield

    # ---- facts ---------------------------------------------------------------------------------------------
    matmul_probe_size = 256  # the square matmul that measures a local spec's FLOP/s

    def name(self) -> str:
        return "cpu"

    def timing_identity(self) -> str:
        """What an op's measured time depends on here, for the op-time cache: the processor and threads."""
        return f"{_cpu_model()} threads={torch.get_num_threads()}"

    def cache_bytes(self) -> int:
        """The last-level cache (for timing ops with cold arguments)."""
        return _cpu_cache_bytes()

    def core_cache_bytes(self) -> int:
        """The largest cache one core has to itself (a CPU's L2): a call that moves more bytes than it holds
        streams through the shared cache, whose content the step's other calls decide."""
        return _cpu_cache_bytes(private=True)

    def total_memory(self) -> int | None:
        """Device memory, where the device says (None on a CPU)."""
        return None

    def host_bandwidth_bytes_per_s(self) -> float:
        """Pinned host <-> device copy bandwidth; nominal on a CPU (offload there is a logical move)."""
        return NOMINAL_HOST_BANDWIDTH_BYTES_PER_S


class CudaDevice(Device):
    """A real CUDA GPU."""

    type = "cuda"
    has_allocator_counters = True
    returns_pages = False
    calls_find_caches_cold = False

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated(self.torch_device)

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.torch_device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.torch_device)

    @contextlib.contextmanager
    def memory_history(self) -> Iterator[Callable[[], dict]]:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, clear_history=True, device=self.torch_device)
        try:
            yield torch.cuda.memory._snapshot
        finally:
            torch.cuda.memory._record_memory_history(enabled=None, device=self.torch_device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)

    def step_workspace_bytes(self) -> int:
        """Measured: the cuBLAS workspaces are dropped (they are made again on demand), then one small matrix
        product runs on this thread and one on a new thread (autograd's backward runs on a device thread
        with a handle of its own); the allocator's growth is what they created."""
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        self.synchronize()
        before = self.memory_allocated()
        device = self.torch_device

        def product() -> None:
            x = torch.ones(64, 64, device=device)
            (x @ x).sum().item()  # .item(): the product has run before the thread ends

        product()
        worker = threading.Thread(target=product)
        worker.start()
        worker.join()
        self.synchronize()
        return max(0, self.memory_allocated() - before)

    def copy_stream(self) -> CopyStream:
        return _CudaCopyStream(self.torch_device)

    def stopwatch(self) -> Stopwatch:
        return _CudaStopwatch(self.torch_device)

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        return _register_host(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))

    def clock(self) -> Callable[[], float]:
        return time.perf_counter

    def rng_state(self) -> bytearray | None:
        return bytearray(torch.cuda.get_rng_state(self.torch_device).numpy().tobytes())

    @contextlib.contextmanager
    def forked_rng(self, cpu_state: bytearray, device_state: bytearray | None) -> Iterator[None]:
        with torch.random.fork_rng(devices=[self.torch_device]):
            torch.set_rng_state(torch.frombuffer(cpu_state, dtype=torch.uint8))
            if device_state is not None:
                torch.cuda.set_rng_state(torch.frombuffer(device_state, dtype=torch.uint8), self.torch_device)
            yield

    matmul_probe_size = 4096

    def name(self) -> str:
        return torch.cuda.get_device_name(self.torch_device)

    def timing_identity(self) -> str:
        return self.name()

    def cache_bytes(self) -> int:
        props = torch.cuda.get_device_properties(self.torch_device)
        return int(getattr(props, "L2_cache_size", 0)) or FALLBACK_CACHE_BYTES

    def total_memory(self) -> int | None:
        return torch.cuda.get_device_properties(self.torch_device).total_memory

    def host_bandwidth_bytes_per_s(self) -> float:
        """The slower direction of pinned host <-> device copies, each measured over four 64 MiB copies: an
        offload plan copies both ways, and a device -> host copy that runs longer than planned holds its
        device bytes longer (the first GPU run's offload plan measured 776 MB over its prediction)."""
        host = torch.empty(64 * 2**20, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty_like(host, device=self.torch_device)
        rates = []
        for dst, src in ((dev, host), (host, dev)):
            dst.copy_(src, non_blocking=True)  # warm-up
            self.synchronize()
            start = time.perf_counter()
            for _ in range(4):
                dst.copy_(src, non_blocking=True)
            self.synchronize()  # wait for the async copies before reading the clock
            rates.append(4 * host.numel() / (time.perf_counter() - start))
        return min(rates)


class _CudaTransfer(Transfer):
    complete = False

    def __init__(self, event: Any, device: torch.device):
        self.event = event
        self.device = device

    def done(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)

    def synchronize(self) -> None:
        self.event.synchronize()


class _CudaCopyStream(CopyStream):
    """One dedicated copy stream; an event per transfer; no ``record_stream`` (the executor holds what a copy
    uses until its event says it is done, so the allocator never hands it out early)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> Transfer:
        issued = torch.cuda.Event()
        issued.record(torch.cuda.current_stream(self.device))  # the producer / the buffer's allocation
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(issued)
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return _CudaTransfer(done, self.device)

    to_host = _copy
    to_device = _copy

    def drain(self) -> None:
        self.stream.synchronize()


# ---- CUDA's rules on a CPU ---------------------------------------------------------------------------------

POISON = 0xFF  # an emulated copy's destination until the copy is known complete (NaN in floating point)
# What a synchronisation costs the host on a GPU beyond the queued work: the round trip and the launch of
# the next kernel into an idle device (of the order of tens of microseconds with torch's eager dispatch;
# not measured here: no GPU yet. The emulation's default, so that a time with a synchronisation inside it
# is too long in CI as it would be there).
SYNC_LATENCY_S = 50e-6


class _EmulatedTransfer(Transfer):
    """A copy queued on an emulated stream: performed when it becomes known complete. Holds only weak
    references to its storages, as a GPU copy holds nothing: the caller must keep them."""

    complete = False

    def __init__(self, stream: _EmulatedCopyStream, dst: torch.Tensor, src: torch.Tensor, what: str):
        self.stream = stream
        self.what = what
        self.performed = False
        self._dst = (weakref.ref(dst.untyped_storage()), dst.storage_offset(), dst.numel())
        self._src = (weakref.ref(src.untyped_storage()), src.storage_offset(), src.numel())
        with torch.no_grad():
            dst.fill_(POISON)

    @staticmethod
    def _bytes(ref: tuple[weakref.ref, int, int]) -> torch.Tensor | None:
        s = ref[0]()
        if s is None:
            return None
        return torch.empty(0, dtype=torch.uint8).set_(s, ref[1], (ref[2],), (1,))

    def perform(self) -> None:
        if self.performed:
            return
        self.performed = True
        src, dst = self._bytes(self._src), self._bytes(self._dst)
        if src is None or dst is None:
            which = "source" if src is None else "destination"
            raise StreamUseError(f"emulated CUDA: the {which} of a {self.what} copy was freed before the copy "
                                 f"was known complete; on a GPU the allocator could hand its block to another "
                                 f"tensor while the copy stream still uses it")
        with torch.no_grad():
            dst.copy_(src)

    def done(self) -> bool:
        """Not known complete until waited for: a GPU's host runs ahead of the device, so an event query
        at the op the host is issuing says "not yet" for as long as the device has queued work before
        the copy. Code that frees memory when a query says done would hold it longer on a GPU than its
        plan says; here it holds it to the end, and the CPU tests see the excess."""
        return self.performed

    def wait(self) -> None:
        self.stream.perform_through(self)

    def synchronize(self) -> None:
        self.stream.perform_through(self)


class _EmulatedCopyStream(CopyStream):
    """An in-order copy stream whose work completes only when someone asks (see the module's docstring)."""

    def __init__(self, device: EmulatedCudaDevice):
        self.device = device
        self.queue: list[_EmulatedTransfer] = []
        device.streams.add(self)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> Transfer:
        t = _EmulatedTransfer(self, dst, src, "device-to-host")
        self.queue.append(t)
        return t

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> Transfer:
        t = _EmulatedTransfer(self, dst, src, "host-to-device")
        self.queue.append(t)
        return t

    def perform_through(self, transfer: _EmulatedTransfer) -> None:
        """The stream is in order: everything queued up to ``transfer`` completes with it."""
        if transfer.performed:
            return
        while self.queue:
            t = self.queue.pop(0)
            t.perform()
            if t is transfer:
                return

    def drain(self) -> None:
        while self.queue:
            self.queue.pop(0).perform()


def _tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors among an ATen call's arguments or results: tensors, and lists and tuples of them (a foreach
    op's), one level down."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            if isinstance(x, torch.Tensor):
                yield x
            elif isinstance(x, (list, tuple)):
                yield from (y for y in x if isinstance(y, torch.Tensor))


# calls that read their source where it is (a copy to the device reads host memory): their arguments are not
# counted as the device's by being read
_COPIES = frozenset({torch.ops.aten.clone, torch.ops.aten._to_copy, torch.ops.aten.copy_, torch.ops.aten.lift_fresh_copy,
                     torch.ops.aten._copy_from, torch.ops.aten._copy_from_and_resize})


@functools.cache
def _call_kind(func: Any) -> tuple[bool, bool]:
    """``(reads, allocates)`` of an ATen call: whether it computes with its arguments' data on the device
    (not a view, ``detach`` or ``view``, which reads nothing; not a copy, which reads its source where it
    is), and whether its results are new storages (none aliases an argument: not a view, an in-place or an
    ``out=`` call)."""
    schema = getattr(func, "_schema", None)
    allocates = schema is not None and all(r.alias_info is None for r in schema.returns)
    return not (getattr(func, "is_view", False) or func.overloadpacket in _COPIES), allocates


class DeviceMemory(TorchDispatchMode):
    """The emulated GPU's memory under a capacity: the live storages it holds, each charged as CUDA's caching
    allocator charges it (rounded up to 512 bytes), and an allocation that would take the total past
    ``capacity_bytes`` refused with :class:`torch.OutOfMemoryError`, as on a GPU.

    A dispatch mode (PyTorch has no hook on the CPU allocator: ``CUDAPluggableAllocator`` has no CPU twin):
    every ATen call on this thread below autograd (backward's too: a CPU backward runs on the calling thread,
    with its modes) is seen. What is counted:

    * every new storage a call returns (its results, where none is a view of, or written into, an argument),
      charged when the call returns, before the caller gets the tensor: one past the capacity raises and the
      call's results are dropped; a counted storage that grew (``resize_``) is charged its new size;
    * every storage a call computes with that is not counted yet, when the call starts: on the emulated GPU a
      CPU tensor an op reads is device memory, so a model built before the capacity was set (its
      parameters, buffers, optimizer state, the batch) is counted at its first use, as a model moved to a GPU
      is held there; but the arguments of a view (``detach``, ``view``: nothing read) and of a copy
      (``clone``, ``copy_``, ``_to_copy``) are not counted by being read: a copy reads its source where it
      is, as ``.to("cuda")`` reads host memory (a model deep-copied inside the block from one outside it is
      counted once: its copy);
    * not: host buffers (:meth:`Device.pinned_empty`, :func:`is_host_buffer`: the pinned pools are host
      memory), storages of no bytes, fake and meta tensors (no storage here), what an op's kernel allocates
      and frees inside itself (a GPU kernel's workspace; the peak measurement, from the allocator's
      reports, does see it), storages made outside the dispatcher (``UntypedStorage`` methods,
      ``torch.load``) until a call uses them, calls on other threads, and calls inside
      :meth:`EmulatedCudaDevice.host_side` (host computation, such as a host optimizer step).

    A storage is freed when its last reference goes (a weak reference to it, whose callback gives its bytes
    back). ``allocated_bytes`` and ``max_allocated_bytes`` are the counts (``memory_allocated`` and
    ``max_memory_allocated`` of this accounting)."""

    def __init__(self, capacity_bytes: int):
        super().__init__()
        if capacity_bytes < 0:
            raise MemplanError(f"emulated CUDA: a capacity of {capacity_bytes} bytes; expected >= 0")
        self.capacity_bytes = capacity_bytes
        self.allocated_bytes = 0
        self.max_allocated_bytes = 0
        self.paused = 0  # > 0: inside host_side(), nothing is charged
        # StorageImpl address -> (weak reference to its Python storage, charged bytes); the storage's Python
        # object lives exactly as long as the storage (PyTorch preserves it while C++ holds the storage)
        self.live: dict[int, tuple[weakref.ref, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        reads, allocates = _call_kind(func)
        self.charge(func, args, adopt=reads)
        if kwargs:
            self.charge(func, tuple(kwargs.values()), adopt=reads)
        out = func(*args, **kwargs)
        self.charge(func, out, adopt=allocates)
        return out

    def charge(self, func: Any, tensors: Any, adopt: bool = True) -> None:
        """Count the storages of ``tensors`` that grew since they were counted, and (``adopt``) those not counted
        yet; all or none: raises :class:`torch.OutOfMemoryError` if they would take the total past the
        capacity."""
        new: list[tuple[int, torch.UntypedStorage, int]] = []
        total = self.allocated_bytes
        for t in _tensors_in(tensors):
            if t.layout is not torch.strided:
                continue  # sparse or nested: no one storage
            s = t.untyped_storage()
            if s.device.type != "cpu":
                continue  # a fake or meta tensor: nothing allocated
            key = s._cdata
            nbytes = round_allocation(s.nbytes(), "cuda")
            known = self.live.get(key)
            if known is None and not adopt or known is not None and known[1] == nbytes:
                continue
            if not nbytes:
                if known is not None:  # resized to nothing (a storage's bytes given back in place)
                    self._freed(key, known[0])
                    total -= known[1]
                continue
            if s.data_ptr() in _HOST_BUFFERS or any(k == key for k, _, _ in new):
                continue
            if total + nbytes > self.capacity_bytes:  # a grown storage's old block is live while it is copied
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory. Tried to allocate {format_bytes(nbytes)} (in {func}). GPU 0 (emulated) "
                    f"has a total capacity of {format_bytes(self.capacity_bytes)} of which "
                    f"{format_bytes(self.capacity_bytes - total)} is free. (emulated capacity "
                    f"{self.capacity_bytes} B; {total} B allocated)")
            total += nbytes
            new.append((key, s, nbytes))
        self.max_allocated_bytes = max(self.max_allocated_bytes, total)
        for key, s, nbytes in new:
            known = self.live.get(key)
            if known is not None:  # grown: its old block goes once copied
                total -= known[1]
            self.live[key] = (weakref.ref(s, functools.partial(self._freed, key)), nbytes)
        self.allocated_bytes = total

    def _freed(self, key: int, _ref: weakref.ref) -> None:
        known = self.live.pop(key, None)
        if known is not None:
            self.allocated_bytes -= known[1]

    def leave(self) -> None:
        """Off this thread's mode stack, wherever it is on it (modes entered above it and left active, by a
        step that raised, stay)."""
        above = []
        stack = _get_current_dispatch_mode_stack()
        if self not in stack:
            return
        while stack and stack[-1] is not self:
            above.append(_pop_mode())
            stack = _get_current_dispatch_mode_stack()
        self.__exit__(None, None, None)
        for mode in reversed(above):
            _push_mode(mode)


class EmulatedCudaDevice(Device):
    """CUDA's rules on CPU tensors (see the module's docstring). ``workspace_bytes``: memory the emulated
    device holds from its first use that no tensor owns, as cuBLAS's workspaces on a GPU;
    ``sync_latency_s``: what each synchronisation costs the host (spent, so that every clock sees it);
    ``capacity_bytes``: the device's memory (None: unlimited), enforced by ``memory``
    (:class:`DeviceMemory`) while the device's block is active."""

    type = "cuda"
    emulated = True
    returns_pages = False  # the emulated device is a GPU: its caching allocator keeps its blocks

    def __init__(self, workspace_bytes: int = 0, sync_latency_s: float = SYNC_LATENCY_S,
                 capacity_bytes: int | None = None):
        super().__init__(torch.device("cpu"))
        self.workspace_bytes = workspace_bytes
        self.sync_latency_s = sync_latency_s
        self.synchronizations = 0
        self.streams: weakref.WeakSet[_EmulatedCopyStream] = weakref.WeakSet()
        self.capacity_bytes = capacity_bytes
        self.memory: DeviceMemory | None = None
        if capacity_bytes is not None:
            self.memory = DeviceMemory(capacity_bytes)
            # the workspace is held from the device's first use: charged from the start
            self.memory.allocated_bytes = self.memory.max_allocated_bytes = self.untracked_bytes()
            if self.memory.allocated_bytes > capacity_bytes:
                raise MemplanError(f"emulated CUDA: the workspace ({self.memory.allocated_bytes} B) is over the "
                                   f"capacity ({capacity_bytes} B)")

    def untracked_bytes(self) -> int:
        return self.charged_bytes(self.workspace_bytes) if self.workspace_bytes else 0

    def total_memory(self) -> int | None:
        """The emulated capacity (None: unlimited)."""
        return self.capacity_bytes

    @contextlib.contextmanager
    def host_side(self) -> Iterator[None]:
        """Inside the block, nothing the calls allocate is charged to the capacity: host memory on CPU tensors
        that are not in a host pool (a pool's own allocation, a host optimizer step's temporaries)."""
        if self.memory is None:
            yield
            return
        self.memory.paused += 1
        try:
            yield
        finally:
            self.memory.paused -= 1

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        with self.host_side():  # host memory: never charged, even for the moment before it is registered
            return super().pinned_empty(nbytes)

    def synchronize(self) -> None:
        self.synchronizations += 1
        for s in list(self.streams):
            s.drain()
        if self.sync_latency_s > 0:
            # busy, on the thread's own CPU clock: every clock then sees at least the latency (spun on the wall
            # clock, a thread descheduled on a loaded machine was charged less of it in CPU time)
            until = time.thread_time() + self.sync_latency_s
            while time.thread_time() < until:
                pass

    def copy_stream(self) -> CopyStream:
        return _EmulatedCopyStream(self)

    def name(self) -> str:
        return "emulated cuda (cpu)"


_emulation: list[EmulatedCudaDevice] = []  # the active emulation, innermost last


@contextlib.contextmanager
def emulate_cuda(workspace_bytes: int = 0, sync_latency_s: float = SYNC_LATENCY_S,
                 capacity_bytes: int | None = None) -> Iterator[EmulatedCudaDevice]:
    """Inside the block, ``cuda`` (and the CPU tensors that stand for it) is :class:`EmulatedCudaDevice`.
    ``capacity_bytes``: its memory; an allocation past it raises :class:`torch.OutOfMemoryError` inside the
    block (:class:`DeviceMemory`: what is counted), on the thread that entered it. None: unlimited, and
    nothing is counted."""
    dev = EmulatedCudaDevice(workspace_bytes, sync_latency_s, capacity_bytes)
    _emulation.append(dev)
    if dev.memory is not None:
        dev.memory.__enter__()
    try:
        yield dev
    finally:
        if dev.memory is not None:
            dev.memory.leave()
        _emulation.remove(dev)


def emulation() -> EmulatedCudaDevice | None:
    """The active emulated GPU: :func:`emulate_cuda`'s, else one for ``MEMPLAN_EMULATE_CUDA=1`` (with
    ``MEMPLAN_EMULATE_WORKSPACE_BYTES`` and ``MEMPLAN_EMULATE_CAPACITY_BYTES``; a capacity is enforced from
    this first call on, on the calling thread, to the end of the process)."""
    if _emulation:
        return _emulation[-1]
    if os.environ.get(EMULATE_ENV, "") not in ("", "0"):
        capacity = os.environ.get(CAPACITY_ENV, "").strip()
        try:
            capacity_bytes = parse_bytes(capacity) if capacity else None
        except MemplanError as e:
            raise MemplanError(f"{CAPACITY_ENV}={capacity!r}: {e}") from None
        dev = EmulatedCudaDevice(int(os.environ.get("MEMPLAN_EMULATE_WORKSPACE_BYTES", "0")),
                                 capacity_bytes=capacity_bytes)
        _emulation.append(dev)
        if dev.memory is not None:
            dev.memory.__enter__()
        return dev
    return None


def cuda_available() -> bool:
    """A CUDA device to run on: a real GPU, or the emulation."""
    return emulation() is not None or torch.cuda.is_available()


def default_device_type() -> str:
    """``$MEMPLAN_DEVICE`` (``cpu`` or ``cuda``) when set; else ``cuda`` where :func:`cuda_available`, else
    ``cpu``. (The test suite pins ``cpu``, so that a test not marked ``gpu`` runs the same with a GPU.)"""
    pinned = os.environ.get(DEVICE_ENV, "").strip().lower()
    if pinned in ("cpu", "cuda"):
        return pinned
    if pinned:
        raise MemplanError(f"{DEVICE_ENV}={os.environ[DEVICE_ENV]!r}: expected cpu or cuda (or unset: cuda when "
                           f"a GPU is here)")
    return "cuda" if cuda_available() else "cpu"


def holds_real_tensors(device: torch.device) -> bool:
    """Whether real tensors can live on ``device`` in this process: the CPU, or a GPU that is here (an
    emulated GPU's tensors are the CPU's, and a spec's GPU that is not here holds none)."""
    return device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_available())


def device_here(device: str | torch.device) -> Device | None:
    """:func:`device_of` ``device``, or None for a CUDA device this machine has neither as a GPU nor emulated
    (a device spec's GPU: a fake profile for it runs nothing there)."""
    if torch.device(device).type == "cuda" and not cuda_available():
        return None
    return device_of(device)


def fake_trace_device(device: torch.device, layer: Device | None) -> torch.device:
    """Where a fake step for ``device`` is traced: the device itself, but the CPU for an emulated GPU (its
    tensors live there) and for CUDA on a machine without a GPU (autograd cannot wire fake CUDA tensors
    there: the step is traced with the CPU kernels' op choices, but for attention and dropout, which take the
    GPU's (:mod:`memplan.planner.probe.kernels`), and charged as CUDA's allocator would). A
    torch built with CUDA (the PyPI wheel) but no GPU is such a machine: its autograd engine asks the
    driver for device 0's context and fails ("hasPrimaryContext expects a valid device index")."""
    if layer is not None and layer.emulated:
        return layer.torch_device
    if device.type == "cuda" and not torch.cuda.is_available():
        return torch.device("cpu")
    return device


def device_of(where: str | torch.device | torch.Tensor | torch.nn.Module | None = None) -> Device:
    """The :class:`Device` for a device name, a torch device, a tensor's or a module's (its first parameter's
    or buffer's) device; None: :func:`default_device_type`.

    Under the emulation, ``cuda`` and the CPU are both the emulated GPU (its tensors live on the CPU).
    Raises :class:`MemplanError` for ``cuda`` with neither a GPU nor the emulation."""
    if isinstance(where, torch.nn.Module):
        t = next(iter([*where.parameters(), *where.buffers()]), None)
        where = t.device if t is not None else None
    elif isinstance(where, torch.Tensor):
        where = where.device
    dev = torch.device(where if where is not None else default_device_type())
    emu = emulation()
    if emu is not None and dev.type in ("cuda", "cpu"):
        return emu
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise MemplanError("a CUDA device was asked for and none is available here (no GPU, or a torch "
                               "built without CUDA); set MEMPLAN_EMULATE_CUDA=1 to emulate CUDA's rules on "
                               "the CPU")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return CudaDevice(dev)
    return Device(dev)


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def current_gpus() -> list[torch.device]:
    """The current CUDA device where a real GPU is here, else none: whose generator a block that may draw on
    any device (isolated op timings) forks with the CPU's."""
    return [torch.device("cuda", torch.cuda.current_device())] if torch.cuda.is_available() else []


def generator_devices(tensors: list[torch.Tensor]) -> list[torch.device]:
    """The CUDA devices among ``tensors``: those whose generators ``torch.random.fork_rng`` must save."""
    return sorted({t.device for t in tensors if t.device.type == "cuda"}, key=lambda d: d.index or 0)


def _cpu_list(text: str) -> set[int]:
    """The CPUs of a ``/sys`` list ("0-3,8")."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _cpu_cache_bytes(private: bool = False, root: Path = Path("/sys/devices/system/cpu/cpu0")) -> int:
    """The largest CPU cache ``/sys`` lists for cpu0 (Linux), else a typical size; ``private``: the largest
    one cpu0's core has to itself, shared with no CPU but its own hardware threads (else a typical L2)."""
    core = {0}
    with contextlib.suppress(OSError, ValueError):
        core |= _cpu_list((root / "topology" / "thread_siblings_list").read_text())
    sizes = []
    for index in (root / "cache").glob("index*"):
        with contextlib.suppress(OSError, ValueError):
            if private and not _cpu_list((index / "shared_cpu_list").read_text()) <= core:
                continue
            text = (index / "size").read_text().strip().upper()
            scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=FALLBACK_CORE_CACHE_BYTES if private else FALLBACK_CACHE_BYTES)
