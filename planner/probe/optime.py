"""Op times without the training step: each ATen call a fake trace recorded, timed on its own.

A fake trace (:func:`memplan.planner.probe.profiler.profile` with ``fake=True``) runs no kernel, so it knows
every call's operator and the shapes, dtypes, strides and aliasing of its arguments, but not its time.
:class:`OpTimer` gives each call a time and an allocator high-water mark in one of two ways:

* **isolated**: the call runs alone on the target device, on real tensors of its recorded metadata
  (floats uniform in [0, 1), integers zero so that indices are valid, a grouped product's offsets an
  even split (:mod:`memplan.planner.probe.grouped`); arguments sharing a storage share one here too). One warm-up run, then the median of at least 3 timed runs (more for calls under 50 ms
  in all). Only one call's working set is allocated at a time. With ``cold=True`` (the default) each
  call's arguments are as warm as the step has them: :func:`cold_arguments` walks the step's calls in
  order and marks an argument cold when the step has not touched its storage before (parameters, the
  batch, optimizer state) or when more bytes than the last-level cache holds went through the cache since
  (a saved activation read in backward). A call with cold arguments is timed after a write over a
  buffer twice the size of the last-level cache (CPU; L2 on CUDA) and one untimed run on a spare copy
  of the cold arguments, which brings the kernel's code, the dispatch path and the hot arguments back
  into cache and leaves the cold ones in memory; a call with none is timed warm, as before, except on
  a CPU (:attr:`Device.calls_find_caches_cold`) where one with an argument beyond its core's own cache
  (reuse distance over the L2) is timed in the step's context: each run after a flush and a spare run on
  the same arguments, whose output is held, so that the timed output lands in memory the cache has not
  seen lately, as the step's does (run after run alone, the U-Net's convolutions read 0.85-0.9x and its
  optimizer 0.5x their time in the step; timed so, the GRU's gates, which its step keeps in the core's
  cache, read +13%). A cold call
  is charged at most its warm time plus two reads of its cold bytes at the bandwidth its flushes write at:
  the flush costs a compute-bound call with a small cold argument far more than the step pays for it. Timed all
  warm (the same tensors again and again), a memory-bound op looked up to 8 times faster on CPU than in
  the step; timed all cold (everything flushed, code included), a tiny op looked 20 times slower.
  On a CPU each timed run is taken net of the page faults it took (``getrusage``, at the cost of a fresh
  page measured here): an output above glibc's mmap threshold is mapped afresh every run and one below
  it never is, while the step's own faults, its kernels' in-call scratch included (:func:`kernel_scratch`),
  are charged apart where the step takes them (:mod:`memplan.planner.probe.hostheap`).
  A second pass runs each call once more under the allocator's eye (CPU: ``torch.profiler`` allocation
  events in a ``memplan:<n>`` range; CUDA: ``max_memory_allocated``) for its high-water mark, which the
  profiler turns into workspace as it does for a real step. Results go to an on-disk cache keyed by the
  call (operator, argument metadata), its cold arguments, the timing method (cold or warm), the device
  and the torch version: repeated layers and later profiles run nothing.
* **analytic**: the roofline ``op_overhead_s + max(flops / FLOP/s, bytes moved / bytes/s)`` at the rates
  the call's op class (matmul, attention, elementwise, copy...: :mod:`memplan.planner.core.opclass`)
  achieves on the device, where the spec gives them, else at its peak FLOP/s for the dtype and its
  memory bandwidth (:meth:`DeviceSpec.rates`). FLOPs come from ``torch.utils.flop_counter``'s formulas
  (0 for ops it does not count), bytes moved are the distinct argument bytes read plus the bytes
  written (0 for views). The
  figures come from a :class:`DeviceSpec`: a shipped or given one (a device you do not have), or this
  machine's, measured once by :func:`local_device_spec` (matmul FLOP/s per dtype, copy bandwidth, the
  cost of a tiny op) and cached. Calls that cannot run alone fall back to it.

The cache is a SQLite file in ``cache_dir`` (default ``$MEMPLAN_CACHE_DIR`` or ``~/.cache/memplan``,
then ``optimes/``).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import sqlite3
import statistics
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from memplan.planner.core.devicespec import DeviceSpec, parse_device_spec
from memplan.planner.core.opclass import op_class
from memplan.planner.probe.device import Device, device_here, device_of
from memplan.planner.probe.grouped import TIMING_VALUES, fill_offsets, grouped_mm_flops, is_grouped_mm
from memplan.planner.probe.hostheap import fresh_page_cost_s, process_faults
from memplan.planner.probe.measure import (
    AllocatorReport,
    allocation_highs,
    allocator_events,
    allocator_walk,
    cpu_allocations,
)
from memplan.planner.probe.workspaces import fill_workspaces

TIME_SOURCES = ("measured", "isolated", "analytic")
_MIN_RUNS, _MAX_RUNS, _TARGET_S = 3, 50, 0.05
# Sweeps over the distinct calls, each timing every call once; a call's time is the median of its sweeps'
# figures. One distinct call stands for every repeat of a layer (the 129 addmm calls of the unrolled GRU
# share a few keys), so a burst of load on a shared machine while one call alone was timed moved the whole
# step with it (the rnn's prediction read 0.86x and 1.85x of the real step in two runs); across sweeps a
# burst spoils one figure of many calls instead of every figure of one.
_SWEEPS = 3
_MAX_COLD_RUNS = 9  # each cold run also writes the flush buffer: fewer runs, still a median
# A cold call costs at most its warm time plus this many times what reading its cold arguments once at the
# memory bandwidth (the flushes' own write rate) takes. The flush (twice the last-level cache written)
# costs a compute-bound call with a small cold argument far more than the step pays for that argument: the
# unrolled GRU's weight-gradient products (a 64 KiB saved hidden state cold) timed 0.80 ms after a flush
# against 0.40 ms warm, which put the rnn's fake step 16-26% over the measured one where its real profile
# was within 5%.
# A memory-bound call's flushed time is about that sum already, and stays.
_COLD_READS = 2.0
_FLUSH_RATES = 64  # the bandwidth is the median of the latest flushes' rates


def default_cache_dir() -> Path:
    """``$MEMPLAN_CACHE_DIR`` or ``~/.cache/memplan``, then ``optimes``."""
    root = os.environ.get("MEMPLAN_CACHE_DIR") or Path.home() / ".cache" / "memplan"
    return Path(root) / "optimes"


# ---- what a call is, without its tensors -------------------------------------------------------------


@dataclass(frozen=True)
class TensorMeta:
    """A tensor argument as recorded: its view of storage ``storage`` (numbered within the call)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    storage: int
    storage_bytes: int
    # a small tensor the step computed for real (not fake: from the batch or Python numbers, such as the
    # lengths ``pack_padded_sequence`` reads): its storage's bytes, which the isolated run is given
    values: bytes | None = None

    @property
    def nbytes(self) -> int:
        """Bytes the view spans (at most its storage's)."""
        return min(self.storage_bytes, math.prod(self.shape) * self.dtype.itemsize)


@dataclass
class OpCall:
    """One ATen call of a fake trace: ``func`` and its arguments with tensors as :class:`TensorMeta`.
    ``flops`` and ``written_bytes`` are counted at trace time (the fake outputs are at hand then)."""

    func: Any
    args: tuple
    kwargs: dict
    device: str
    flops: int = 0
    written_bytes: int = 0
    # the step-wide identity of each argument storage (index = TensorMeta.storage) and of each storage it
    # wrote; no part of the key: they say where the call stands in the step, not what it is
    storage_ids: tuple[int, ...] = ()
    output_storage_ids: tuple[int, ...] = ()
    output_storage_bytes: tuple[int, ...] = ()  # bytes of each storage in output_storage_ids
    _key: str | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return str(self.func)

    @property
    def key(self) -> str:
        """The call's identity for the cache: operator and argument metadata."""
        if self._key is None:
            self._key = f"{self.func}|{_describe((self.args, self.kwargs))}"
            if is_grouped_mm(self.func):  # timed on filled offsets (grouped.py): not the zero offsets' times
                self._key += f"|{TIMING_VALUES}"
        return self._key

    def tensors(self) -> list[TensorMeta]:
        out: list[TensorMeta] = []
        _metas((self.args, self.kwargs), out)
        return out

    def read_bytes(self) -> int:
        """Bytes of the distinct argument views (what a kernel reads, at most)."""
        return sum({(m.storage, m.offset, m.shape, m.stride): m.nbytes for m in self.tensors()}.values())

    def argument_storage_bytes(self) -> tuple[int, ...]:
        """Per argument storage (by its number in the call), the most bytes one view of it spans: what
        the call touches of it."""
        touched = [0] * len(self.storage_ids)
        for m in self.tensors():
            if m.storage < len(touched):
                touched[m.storage] = max(touched[m.storage], m.nbytes)
        return tuple(touched)

    def output_bytes(self) -> tuple[int, ...]:
        """Bytes of each storage in ``output_storage_ids`` (the bytes written, shared out, where the
        call was recorded without them)."""
        if len(self.output_storage_bytes) == len(self.output_storage_ids):
            return self.output_storage_bytes
        n = len(self.output_storage_ids)
        return tuple([self.written_bytes // n] * n) if n else ()

    def dtype(self) -> str:
        """The first floating argument's dtype name ("float32"), else the first argument's."""
        metas = self.tensors()
        chosen = next((m for m in metas if m.dtype.is_floating_point), metas[0] if metas else None)
        return str(chosen.dtype).removeprefix("torch.") if chosen else "float32"


def _describe(x: Any) -> str:
    if isinstance(x, TensorMeta):
        values = "" if x.values is None else f",v{_hashed(x.values.hex())}"
        return f"T({x.dtype},{list(x.shape)},{list(x.stride)},{x.offset},s{x.storage}:{x.storage_bytes}{values})"
    if isinstance(x, (tuple, list)):
        inner = ",".join(_describe(y) for y in x)
        return f"[{inner}]" if isinstance(x, list) else f"({inner})"
    if isinstance(x, dict):
        return "{" + ",".join(f"{k}={_describe(v)}" for k, v in sorted(x.items())) + "}"
    text = repr(x)
    return type(x).__name__ if " at 0x" in text else text  # an object's address is no part of the call


def _metas(x: Any, out: list[TensorMeta]) -> None:
    if isinstance(x, TensorMeta):
        out.append(x)
    elif isinstance(x, (tuple, list)):
        for y in x:
            _metas(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _metas(y, out)


def _replace(x: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(x, tuple):
        return tuple(_replace(y, fn) for y in x)
    if isinstance(x, list):
        return [_replace(y, fn) for y in x]
    if isinstance(x, dict):
        return {k: _replace(v, fn) for k, v in x.items()}
    return fn(x)


class StorageNumbers:
    """A number per storage that no other storage ever gets: a storage's ``_cdata`` (its address) is
    handed to a new storage once it dies, and a step's storages die and are born all the time, so that
    "touched before in the step" by address would depend on where the allocator put things (and a key
    built from it, on the run)."""

    def __init__(self) -> None:
        self._live: dict[int, tuple[weakref.ref, int]] = {}  # _cdata -> (the storage, its number)
        self._next = 0

    def __call__(self, storage: Any) -> int:
        key = storage._cdata
        known = self._live.get(key)
        if known is not None and known[0]() is storage:
            return known[1]
        number = self._next
        self._next += 1
        self._live[key] = (weakref.ref(storage), number)
        return number


#: ``storage_number(storage)``: its number, unique in this process (what ``OpCall.storage_ids`` hold)
storage_number = StorageNumbers()


# Kernels torch's FLOP formulas do not know, counted with the formula of the op they stand in for (same
# leading arguments). A fake trace for CUDA without a GPU here runs the CPU's op choices: its attention is
# the CPU flash kernel, whose 0 FLOPs made the 1.1B Llama's 44 attention calls cost 8 ms on an H100.
FLOP_ALIASES = {"_scaled_dot_product_flash_attention_for_cpu": "_scaled_dot_product_flash_attention",
                "_scaled_dot_product_flash_attention_for_cpu_backward": "_scaled_dot_product_flash_attention_backward"}


def record_call(func: Any, args: tuple, kwargs: dict, out: Any) -> OpCall:
    """An :class:`OpCall` of ``func(*args, **kwargs) -> out`` (fake tensors): metadata only, nothing of
    the tensors is kept. FLOPs from ``torch.utils.flop_counter``'s formula for the operator, or for the
    one it stands in for (:data:`FLOP_ALIASES`); 0 if none."""
    from torch.utils.flop_counter import flop_registry

    storages: dict[int, int] = {}
    objects: list[Any] = []  # the storages, by their index in the call
    device = "cpu"

    def meta(x: Any) -> Any:
        nonlocal device
        if not isinstance(x, torch.Tensor):
            return x
        s = x.untyped_storage()
        index = storages.setdefault(s._cdata, len(storages))
        if index == len(objects):
            objects.append(s)
        device = x.device.type
        return TensorMeta(tuple(x.shape), tuple(x.stride()), x.storage_offset(), x.dtype, index, s.nbytes(),
                          _real_values(x, s))

    margs, mkwargs = _replace(args, meta), _replace(kwargs, meta)
    flops = 0
    packet = getattr(func, "overloadpacket", None)
    formula = flop_registry.get(packet)
    if formula is None and packet is not None and packet.__name__ in FLOP_ALIASES:
        formula = flop_registry.get(getattr(torch.ops.aten, FLOP_ALIASES[packet.__name__]))
    if formula is not None:
        with contextlib.suppress(Exception):  # a formula that does not know this overload: no FLOPs
            flops = int(formula(*args, **kwargs, out_val=out))
    elif is_grouped_mm(func):
        flops = grouped_mm_flops(func, args, kwargs)
    read = set(storages)
    written = 0
    outs: list[torch.Tensor] = []
    _collect_tensors(out, outs)
    for t in outs:
        s = t.untyped_storage()
        if s._cdata not in read or _mutates(func):  # a new storage, or an in-place write
            written += min(s.nbytes(), t.numel() * t.element_size())
    # step-wide identities (for cold_arguments): numbers, not addresses, which a later storage may reuse
    ids = tuple(storage_number(s) for s in objects)  # in index order
    written_storages = {storage_number(t.untyped_storage()): t.untyped_storage().nbytes() for t in outs}
    return OpCall(func, margs, mkwargs, device, flops, written, ids, tuple(written_storages),
                  tuple(written_storages.values()))


REAL_VALUES_MAX_BYTES = 4096  # a real argument up to this size keeps its values in the recorded call


def _real_values(x: torch.Tensor, s: Any) -> bytes | None:
    """The bytes of ``x``'s storage when ``x`` is a small real CPU tensor among a fake call's arguments (its
    values are the step's: a kernel that reads them, as ``pack_padded_sequence`` reads its lengths, cannot
    run alone on made-up ones); None otherwise."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import _disable_current_modes

    if isinstance(x, FakeTensor) or x.device.type != "cpu" or s.nbytes() > REAL_VALUES_MAX_BYTES:
        return None
    with _disable_current_modes():
        return bytes(s.tolist())


def _collect_tensors(x: Any, out: list[torch.Tensor]) -> None:
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (tuple, list)):
        for y in x:
            _collect_tensors(y, out)


def _mutates(func: Any) -> bool:
    schema = getattr(func, "_schema", None)
    return bool(schema and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments))


def cold_arguments(calls: list[OpCall], cache_bytes: int,
                   distances: list[tuple[int | None, ...]] | None = None) -> list[frozenset[int]]:
    """For each call of a step (in step order), the argument storages (numbered as in its
    :class:`TensorMeta`) that the step reads from memory rather than from cache: those the step has not
    touched before (parameters, the batch and optimizer state, last touched in the previous step), and
    those whose reuse distance (:func:`reuse_distances`, or ``distances`` it gave) is over ``cache_bytes``."""
    if distances is None:
        distances = reuse_distances(calls)
    return [frozenset(i for i, d in enumerate(ds) if d is None or d > cache_bytes) for ds in distances]


def reuse_distances(calls: list[OpCall]) -> list[tuple[int | None, ...]]:
    """For each call of a step (in step order), each argument storage's reuse distance: the bytes of the
    distinct storages touched since its last touch in the step (arguments read and outputs written), the
    stack distance of an LRU cache; None where the step has not touched it before. Distinct, not the
    traffic: a weight that every step of an unrolled cell reads occupies the cache once, however often it
    is read (counted per read, the 64-step GRU's hidden states all looked evicted by backward and its
    weight-gradient products were timed cold: +45%). One walk, O(n log n), whatever caches it is read
    against."""
    total = sum(len(c.storage_ids) + len(c.output_storage_ids) for c in calls)
    tree = _Fenwick(total)
    position: dict[int, int] = {}  # storage id -> index of its last touch in the tree
    size: dict[int, int] = {}      # storage id -> bytes charged at that touch
    touches = 0
    out: list[tuple[int | None, ...]] = []
    for c in calls:
        out.append(tuple(None if sid not in position else tree.total - tree.prefix(position[sid])
                         for sid in c.storage_ids))
        for sid, nbytes in (*zip(c.storage_ids, c.argument_storage_bytes(), strict=True),
                            *zip(c.output_storage_ids, c.output_bytes(), strict=True)):
            if sid in position:
                tree.add(position[sid], -size[sid])
            position[sid], size[sid] = touches, nbytes
            tree.add(touches, nbytes)
            touches += 1
    return out


class _Fenwick:
    """Prefix sums over touch positions (a binary indexed tree): bytes touched up to a position."""

    def __init__(self, n: int):
        self.sums = [0] * (n + 1)
        self.total = 0

    def add(self, index: int, value: int) -> None:
        self.total += value
        index += 1
        while index < len(self.sums):
            self.sums[index] += value
            index += index & -index

    def prefix(self, index: int) -> int:
        """The sum of positions 0..index."""
        index += 1
        result = 0
        while index > 0:
            result += self.sums[index]
            index -= index & -index
        return result


def analytic_time_s(call: OpCall, spec: DeviceSpec) -> float:
    """Roofline time of ``call`` on ``spec``'s device at the rates its op class achieves there
    (:meth:`DeviceSpec.rates`; see the module docstring)."""
    if getattr(call.func, "is_view", False):
        return spec.op_overhead_s
    moved = call.read_bytes() + call.written_bytes
    flops_per_s, bytes_per_s = spec.rates(op_class(call.name), call.dtype())
    return spec.op_overhead_s + max(call.flops / flops_per_s, moved / bytes_per_s)


# ---- real tensors for a call ---------------------------------------------------------------------------


def materialise(call: OpCall, device: torch.device,
                storages: dict[int, torch.Tensor] | None = None) -> tuple[tuple, dict]:
    """Real arguments for ``call`` on ``device``: one filled storage per recorded storage, each tensor
    argument a view of it with the recorded offset, shape and stride. ``storages``, when given,
    receives each storage (by its number in the call) as a flat tensor."""
    storages = {} if storages is None else storages

    def real(x: Any) -> Any:
        if not isinstance(x, TensorMeta):
            return x
        filled = storages.get(x.storage)
        if filled is None and x.values is not None:  # the step's own values
            filled = torch.frombuffer(bytearray(x.values), dtype=torch.uint8).to(device)
            storages[x.storage] = filled = filled.view(x.dtype) if len(x.values) % x.dtype.itemsize == 0 else filled
        if filled is None:
            n = -(-x.storage_bytes // x.dtype.itemsize)
            if x.dtype.is_floating_point and x.dtype.itemsize >= 2:
                filled = torch.rand(n, dtype=x.dtype, device=device)
            else:  # integers (indices stay valid), booleans, 8-bit floats
                filled = torch.zeros(n, dtype=x.dtype, device=device)
            storages[x.storage] = filled
        view = torch.empty(0, dtype=x.dtype, device=device)
        return view.set_(filled.untyped_storage(), x.offset, x.shape, x.stride)

    args, kwargs = _replace(call.args, real), _replace(call.kwargs, real)
    fill_offsets(call.func, args, kwargs)  # a grouped product's groups split its rows, not all empty
    fill_workspaces(call.func, args, kwargs)  # a backward's private state as its forward writes it
    return args, kwargs


# ---- the cache ------------------------------------------------------------------------------------------


class OpTimeCache:
    """``key -> (time_s, high_bytes, output storage bytes)`` in a SQLite file; safe for several processes."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.directory / "optimes.sqlite", timeout=30)
        self.db.execute("CREATE TABLE IF NOT EXISTS optimes2 (key TEXT PRIMARY KEY, time_s REAL, "
                        "high_bytes INTEGER, output_bytes TEXT)")

    def get(self, key: str) -> tuple[float, int, tuple[int, ...]] | None:
        row = self.db.execute("SELECT time_s, high_bytes, output_bytes FROM optimes2 WHERE key = ?",
                              (key,)).fetchone()
        if not row:
            return None
        return float(row[0]), int(row[1]), tuple(int(b) for b in row[2].split(",") if b)

    def put(self, rows: list[tuple[str, float, int, tuple[int, ...]]]) -> None:
        with self.db:
            self.db.executemany("INSERT OR REPLACE INTO optimes2 VALUES (?, ?, ?, ?)",
                                [(k, t, h, ",".join(map(str, o))) for k, t, h, o in rows])

    def close(self) -> None:
        self.db.close()


def device_identity(device: torch.device) -> str:
    """What a timing depends on besides the call: the device model, thread count, torch version."""
    return f"{device.type}:{device_of(device).timing_identity()}|torch={torch.__version__}"


def last_level_cache_bytes(device: torch.device) -> int:
    """Bytes of ``device``'s last-level cache: CUDA's L2, or the largest CPU cache ``/sys`` lists for
    cpu0 (32 MiB when neither can be read)."""
    return device_of(device).cache_bytes()


def _hashed(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# ---- this machine's figures -----------------------------------------------------------------------------


def local_device_spec(device: torch.device, cache_dir: str | Path | None = None) -> DeviceSpec:
    """This machine's :class:`DeviceSpec`, measured once per device and torch version and cached as JSON:
    matmul FLOP/s for float32, bfloat16 and float16, copy bandwidth, and a tiny op's cost (overhead)."""
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    identity = device_identity(device)
    # keyed by how its runs are timed too: a spec measured with a synchronisation inside each run (before
    # the stopwatch) charged CUDA's round trip to every tiny op, and is measured again
    path = directory / f"device-{_hashed(identity + '|laps=queued')[:16]}.json"
    if path.is_file():
        with contextlib.suppress(Exception):  # a damaged cache file is measured again
            spec = parse_device_spec(path.read_bytes(), source=str(path))
            # the device's memory as it is now (an emulated GPU's capacity is not part of what is timed)
            here = device_here(device)
            memory = here.total_memory() if here is not None else None
            return spec.model_copy(update={"memory_bytes": memory}) if memory else spec
    layer = device_of(device)
    device = layer.torch_device

    def median_s(fn: Callable[[], Any], runs: int = 5) -> float:
        """The median of ``runs`` runs issued back to back, each as the device ran it (its stopwatch)."""
        fn()
        layer.synchronize()
        watch = layer.stopwatch()
        for _ in range(runs):
            mark = watch.begin()
            fn()
            watch.end(mark)
        return statistics.median(watch.seconds())

    n = layer.matmul_probe_size
    flops: dict[str, float] = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        a = torch.rand(n, n, dtype=dtype, device=device)
        b = torch.rand(n, n, dtype=dtype, device=device)
        flops[str(dtype).removeprefix("torch.")] = 2 * n**3 / median_s(lambda a=a, b=b: a @ b, runs=3)
    x = torch.rand(16 * 2**20, device=device)
    y = torch.empty_like(x)
    bandwidth = 2 * x.nbytes / median_s(lambda: y.copy_(x))
    tiny = torch.rand(1, device=device)
    overhead = median_s(lambda: torch.add(tiny, tiny), runs=50)
    memory = layer.total_memory() or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    host = layer.host_bandwidth_bytes_per_s()  # nominal on a CPU: offload there is a logical move
    spec = DeviceSpec(name="local", description=f"measured on {identity}", device=device.type,
                      memory_bytes=memory, peak_flops_per_s=flops, memory_bandwidth_bytes_per_s=bandwidth,
                      host_bandwidth_bytes_per_s=host, op_overhead_s=overhead)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(spec.model_dump_json(indent=1))
    tmp.replace(path)
    return spec


# ---- the timer -----------------------------------------------------------------------------------------


@dataclass
class Timing:
    """A call's time, its allocator high-water mark (bytes above what was allocated before it, outputs
    included; 0 when analytic), how it was timed ("isolated" or "analytic") and, when it ran, the storage
    bytes of each tensor it returned (flattened in argument order)."""

    time_s: float
    high_bytes: int
    source: str
    output_bytes: tuple[int, ...] = ()  # storage bytes of each output tensor when it ran (isolated)


@dataclass
class TimerStats:
    calls: int = 0          # calls asked about
    distinct: int = 0       # distinct keys among them
    cache_hits: int = 0     # distinct keys found in the cache
    isolated_runs: int = 0  # distinct keys run alone now
    analytic: int = 0       # distinct keys timed analytically
    peak_bytes: int = 0     # allocator high-water mark of the isolated runs, above what was live before


class OpTimer:
    """Times :class:`OpCall` lists. ``spec``: time every call analytically for that device (nothing
    runs); None: run each call alone on ``device``, falling back to this machine's measured spec for
    calls that cannot run. ``cache_dir``: where the cache lives (None: :func:`default_cache_dir`).
    ``min_runs`` timed runs at least per call, more while they total under ``target_s / sweeps`` (at
    most 50; at most 9 when ``cold``), in each of ``sweeps`` sweeps over the distinct calls (the median of the
    sweeps is the call's time). ``cold``: flush the device's caches before each timed run (see the module
    docstring); warm and cold times are cached apart. Runs are timed with the device's clock
    (:meth:`Device.clock`: with one torch thread on a CPU, the thread's CPU time, as the real profile's
    plain step is timed, so that other jobs' time slices land on neither). ``eager``: whether a fake
    profile charges its calls what eager training pays beyond them (:func:`memplan.planner.probe.eager.
    eager_charge_s`; False: nothing)."""

    def __init__(self, device: torch.device, *, spec: DeviceSpec | None = None,
                 cache_dir: str | Path | None = None, min_runs: int = _MIN_RUNS, target_s: float = _TARGET_S,
                 cold: bool = True, sweeps: int = _SWEEPS, eager: bool = True):
        # an analytic timer for a GPU that is not here runs nothing: no device layer is needed for it
        self.layer = (device_here(device) if spec is not None else device_of(device)) or Device()
        self.device = self.layer.torch_device  # where calls run (an emulated GPU's tensors live on the CPU)
        self.min_runs, self.target_s = max(1, min_runs), target_s
        self.sweeps = max(1, sweeps)
        self.eager = eager
        self.spec = spec
        self.cold = cold
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.stats = TimerStats()
        self._local: DeviceSpec | None = None
        self._flush: torch.Tensor | None = None
        # a CPU's runs are timed net of the page faults they take (planner/probe/hostheap.py): an output
        # above glibc's mmap threshold faults every run, one below it none, and the step's own faults
        # are charged apart, where the step takes them
        self.net_faults = spec is None and self.layer.returns_pages
        self._fault_s: float | None = None
        self._flush_rates: list[float] = []  # bytes/s of each cache flush's write
        self._core: int | None = None

    @property
    def identity(self) -> str:
        """What a cached time depends on besides the call: the device, torch version and timing method."""
        faults = "|faults=net" if self.net_faults else ""
        timing = f"cold<=warm+{_COLD_READS:g}reads" if self.cold else "warm"
        context = f"|context=flushed,held>{self._core_bytes()}" if self._in_step_context() else ""
        return f"{device_identity(self.device)}|timing={timing}{faults}|laps=queued{context}"

    def cache_key(self, call: OpCall, cold: frozenset[int] = frozenset(), context: bool = False) -> str:
        """The cache's key for ``call``'s time under this timer with the arguments ``cold`` timed cold:
        a SHA-256 of the timing key and the timer's identity."""
        return _hashed(f"{self.timing_key(call, cold, context)}|{self.identity}")

    @property
    def flush_bytes(self) -> int:
        """Bytes written by :meth:`flush_caches`: twice the device's last-level cache."""
        return 2 * last_level_cache_bytes(self.device)

    def flush_caches(self) -> None:
        """Evict the device's caches: write a buffer of twice the last-level cache's bytes (allocated
        once per timer, so no page is touched for the first time here). Each write is timed: the memory
        bandwidth a cold call's charge is capped with (:meth:`_cold_ceiling`), measured without another
        buffer (a capped process has room for this one)."""
        if self._flush is None:
            self._flush = torch.empty(self.flush_bytes // 4, dtype=torch.float32, device=self.device)
            self._flush.fill_(1.0)  # first touch: its page faults are not bandwidth
            self._sync()
        watch = self.layer.stopwatch()
        mark = watch.begin()
        self._flush.fill_(1.0)
        watch.end(mark)
        (seconds,) = watch.seconds()
        if seconds > 0:
            self._flush_rates.append(self._flush.nbytes / seconds)

    def fault_cost_s(self) -> float:
        """Seconds a fresh page's first write costs here, taken off each timed run per fault it took (0
        where runs are not timed net of faults)."""
        if self._fault_s is None:
            self._fault_s = fresh_page_cost_s() if self.net_faults else 0.0
        return self._fault_s

    def local_spec(self) -> DeviceSpec:
        if self._local is None:
            self._local = local_device_spec(self.device, self.cache_dir)
        return self._local

    def time(self, calls: list[OpCall]) -> list[Timing]:
        """One :class:`Timing` per call of a step, given in step order (the order decides which
        arguments are cold: :func:`cold_arguments`)."""
        self.stats.calls += len(calls)
        in_context = self._in_step_context()
        distances = reuse_distances(calls) if (self.cold and self.spec is None) or in_context else None
        if self.cold and self.spec is None:
            colds = cold_arguments(calls, last_level_cache_bytes(self.device), distances)
        else:
            colds = [frozenset()] * len(calls)
        if in_context:
            # a call that finds an argument beyond its core's own cache is timed in the step's context
            contexts = [bool(beyond) for beyond in cold_arguments(calls, self._core_bytes(), distances)]
        else:
            contexts = [False] * len(calls)
        keys = [self.timing_key(c, cold, context) for c, cold, context in zip(calls, colds, contexts, strict=True)]
        distinct: dict[str, tuple[OpCall, frozenset[int], bool]] = {}
        for key, c, cold, context in zip(keys, calls, colds, contexts, strict=True):
            distinct.setdefault(key, (c, cold, context))
        self.stats.distinct += len(distinct)
        results: dict[str, Timing] = {}
        if self.spec is not None:
            for key, (c, _, _) in distinct.items():
                results[key] = Timing(analytic_time_s(c, self.spec), 0, "analytic")
            self.stats.analytic += len(distinct)
        else:
            results = self._isolated(distinct)
        return [results[key] for key in keys]

    def timing_key(self, call: OpCall, cold: frozenset[int] = frozenset(), context: bool = False) -> str:
        """``call``'s key with the arguments timed cold (none when the timer is warm) and whether it is
        timed in the step's context (:meth:`_run_timed`)."""
        if not self.cold:
            return call.key
        return f"{call.key}|cold={','.join(map(str, sorted(cold)))}" + ("|context" if context else "")

    def _isolated(self, distinct: dict[str, tuple[OpCall, frozenset[int], bool]]) -> dict[str, Timing]:
        cache = OpTimeCache(self.cache_dir)
        results: dict[str, Timing] = {}
        todo: dict[str, tuple[OpCall, frozenset[int], bool]] = {}
        try:
            for key, (c, cold, context) in distinct.items():
                hit = cache.get(self.cache_key(c, cold, context))
                if hit is not None:
                    results[key] = Timing(hit[0], hit[1], "isolated", hit[2])
                else:
                    todo[key] = (c, cold, context)
            self.stats.cache_hits += len(distinct) - len(todo)
            highs, outputs, failed = self._high_water({key: c for key, (c, _, _) in todo.items()})
            figures: dict[str, list[float]] = {key: [] for key in todo if key not in failed}
            for _ in range(self.sweeps):
                for key in list(figures):
                    seconds = self._run_timed(*todo[key])
                    if seconds is None:  # cannot run alone: analytic below
                        del figures[key]
                    else:
                        figures[key].append(seconds)
            rows = []
            for key, (c, cold, context) in todo.items():
                seconds = statistics.median(figures[key]) if key in figures else None
                if seconds is None:
                    results[key] = Timing(analytic_time_s(c, self.local_spec()), 0, "analytic")
                    self.stats.analytic += 1
                    continue
                results[key] = Timing(seconds, highs.get(key, 0), "isolated", outputs.get(key, ()))
                rows.append((self.cache_key(c, cold, context), seconds, highs.get(key, 0), outputs.get(key, ())))
                self.stats.isolated_runs += 1
            cache.put(rows)
        finally:
            cache.close()
        return results

    def _sync(self) -> None:
        self.layer.synchronize()  # CUDA kernels are asynchronous: wait before reading the clock

    def _run_timed(self, call: OpCall, cold: frozenset[int] = frozenset(), context: bool = False) -> float | None:
        """Median seconds of ``call`` run alone (None if it cannot run). With arguments in ``cold``, each
        run starts with the caches flushed, then one run of the call on a spare set of arguments that
        shares the others and has its own copies of the cold ones: the kernel's code, the framework's
        dispatch path and the other arguments are back in cache, as in the step, and the cold ones are
        not (flushed, then never touched). In the step's ``context`` (:meth:`_in_step_context`: a CPU's
        call with an argument beyond its core's own cache) every run is so, the spare run on the same
        arguments but the cold ones, and the spare run's output is held while the timed run writes its
        own: the timed output lands in memory the cache has not seen lately, as a step's does, not in the
        block the run before it just wrote. Otherwise
        warm runs are issued ``min_runs`` at a time back to back, as a step issues its ops: on CUDA a run
        is then timed behind queued work, not launched into an idle device (the flush and the spare run
        queue ahead of a cold one)."""
        try:
            storages: dict[int, torch.Tensor] = {}
            args, kwargs = materialise(call, self.device, storages)
            out = call.func(*args, **kwargs)
            self._sync()
            del out
            if cold:
                spare = {i: flat for i, flat in storages.items() if i not in cold}
                spare_args, spare_kwargs = materialise(call, self.device, spare)
            else:
                spare_args, spare_kwargs = args, kwargs
            fault_s = self.fault_cost_s()
            times: list[float] = []
            most = _MAX_COLD_RUNS if cold or context else _MAX_RUNS
            target_s = self.target_s / self.sweeps  # the sweeps share the call's time budget
            while len(times) < self.min_runs or (sum(times) < target_s and len(times) < most):
                if cold or context:
                    times += self._flushed_lap(call, args, kwargs, spare_args, spare_kwargs, fault_s, context)
                else:
                    times += self._laps(call, args, kwargs, self.min_runs, fault_s)
            if not cold:
                return statistics.median(times)
            return min(statistics.median(times), self._cold_ceiling(call, cold, args, kwargs, fault_s, context))
        except Exception:  # noqa: BLE001 - any failure means "cannot run alone": analytic instead
            return None

    def _in_step_context(self) -> bool:
        """Whether this timer times a call with an argument beyond its core's own cache (a reuse distance
        over it, or new to the step) in the step's context (:meth:`_run_timed`): a cold timer on a device
        whose step leaves its calls' caches cold (:attr:`Device.calls_find_caches_cold`)."""
        return self.cold and self.spec is None and self.layer.calls_find_caches_cold

    def _core_bytes(self) -> int:
        if self._core is None:
            self._core = self.layer.core_cache_bytes()
        return self._core

    def _flushed_lap(self, call: OpCall, args: tuple, kwargs: dict, spare_args: tuple, spare_kwargs: dict,
                     fault_s: float, hold: bool) -> list[float]:
        """One run of ``call`` timed after the caches are flushed and one untimed run on the spare
        arguments, whose output is ``hold``-en while the timed run writes its own."""
        self.flush_caches()
        held = call.func(*spare_args, **spare_kwargs)
        if not hold:
            del held
            held = None
        lap = self._laps(call, args, kwargs, 1, fault_s)
        del held
        return lap

    def _laps(self, call: OpCall, args: tuple, kwargs: dict, runs: int, fault_s: float) -> list[float]:
        """Seconds of ``runs`` runs of ``call`` issued back to back on the device layer's
        :class:`~memplan.planner.probe.device.Stopwatch` (no synchronisation inside a run), each net of
        the page faults it took at ``fault_s`` each. Each output is dropped at once: the working set stays
        one call's."""
        watch = self.layer.stopwatch()
        faults: list[int] = []
        for _ in range(runs):
            before = process_faults() if fault_s else 0
            mark = watch.begin()
            out = call.func(*args, **kwargs)
            watch.end(mark)
            del out
            if fault_s:
                faults.append(process_faults() - before)
        seconds = watch.seconds()
        if fault_s:
            seconds = [max(0.0, s - f * fault_s) for s, f in zip(seconds, faults, strict=True)]
        return seconds

    def _cold_ceiling(self, call: OpCall, cold: frozenset[int], args: tuple, kwargs: dict,
                      fault_s: float, context: bool = False) -> float:
        """The most a call with ``cold`` arguments is charged: its warm time (the median of ``min_runs``
        runs on the arguments the cold runs left in cache; in a step's ``context``, each after a flush and
        a spare run on the same arguments) plus :data:`_COLD_READS` reads of the cold arguments' bytes at
        the memory bandwidth the cache flushes wrote at (their median)."""
        if not self._flush_rates:
            return math.inf
        if context:
            warm = [lap for _ in range(self.min_runs)
                    for lap in self._flushed_lap(call, args, kwargs, args, kwargs, fault_s, True)]
        else:
            warm = self._laps(call, args, kwargs, self.min_runs, fault_s)
        touched = call.argument_storage_bytes()
        cold_bytes = sum(touched[i] for i in cold if i < len(touched))
        bandwidth = statistics.median(self._flush_rates[-_FLUSH_RATES:])
        return statistics.median(warm) + _COLD_READS * cold_bytes / bandwidth

    def _high_water(self, todo: dict[str, OpCall]) -> tuple[dict[str, int], dict[str, tuple[int, ...]], set[str]]:
        """Each call's allocator high-water mark and its outputs' storage bytes, run once; and the keys that
        failed to run. Records the pass's own high-water mark (inputs included) in ``stats.peak_bytes``."""
        highs: dict[str, int] = {}
        outputs: dict[str, tuple[int, ...]] = {}
        failed: set[str] = set()
        if not todo:
            return highs, outputs, failed
        layer = self.layer
        if layer.has_allocator_counters:
            base = layer.memory_allocated()
            peak = 0
            for key, c in todo.items():
                with _running(key, failed):
                    args, kwargs = materialise(c, self.device)
                    self._sync()
                    before = layer.memory_allocated()
                    layer.reset_peak()
                    out = c.func(*args, **kwargs)
                    self._sync()
                    outputs[key] = _storage_bytes(out)
                    high = layer.max_memory_allocated()
                    highs[key] = high - before
                    peak = max(peak, high - base)
                    del out, args, kwargs
            self.stats.peak_bytes = max(self.stats.peak_bytes, peak)
            return highs, outputs, failed
        names: dict[str, str] = {}
        with allocator_events() as prof:
            for i, (key, c) in enumerate(todo.items()):
                with _running(key, failed):
                    args, kwargs = materialise(c, self.device)
                    names[f"memplan:{i}"] = key
                    with torch._C._profiler._RecordFunctionFast(f"memplan:{i}"):
                        out = c.func(*args, **kwargs)
                    outputs[key] = _storage_bytes(out)
                    del out, args, kwargs
        for name, high in allocation_highs(prof, layer.charged_bytes).items():
            if name in names:
                highs[names[name]] = high
        running = 0
        for _, size in cpu_allocations(prof, layer.charged_bytes):
            running += size
            self.stats.peak_bytes = max(self.stats.peak_bytes, running)
        return highs, outputs, failed


def kernel_scratch(calls: list[OpCall], device: torch.device) -> dict[str, tuple[int, ...]]:
    """Per distinct call (by :attr:`OpCall.key`), the blocks its kernel allocates and frees inside the call
    (oneDNN's reorders of a convolution's input and output into its blocked layouts, its backward's
    gradient copies), from one run on real arguments under the allocator's eye: a tuple of events in
    allocation order, ``+n`` a block of n bytes allocated, ``-(i + 1)`` the i-th of them freed. The blocks
    the call returns (its outputs) are not in it. A call that cannot run alone gets ``()``.

    What a step's allocator makes of them is the shadow's to replay (:class:`memplan.planner.probe.hostheap.
    Shadow`): in a step a block above glibc's mmap threshold is mapped afresh at each call (a
    convolution's 36 MiB reorder of a 131-channel input faulted 9,217 pages, 17 ms of a 56 ms call),
    while the same call alone found a free block in a quiet heap, or had its faults taken off its time."""
    from torch.utils._python_dispatch import _disable_current_modes

    distinct = {c.key: c for c in calls}
    out: dict[str, tuple[int, ...]] = {key: () for key in distinct}
    names: dict[str, str] = {}
    with _disable_current_modes(), allocator_events() as prof:
        for i, (key, c) in enumerate(distinct.items()):
            with contextlib.suppress(Exception):  # cannot run alone: no scratch known
                args, kwargs = materialise(c, device)
                names[f"memplan:{i}"] = key
                with torch._C._profiler._RecordFunctionFast(f"memplan:{i}"):
                    result = c.func(*args, **kwargs)
                del result, args, kwargs
    inside: dict[str, list[AllocatorReport]] = {}
    for r in allocator_walk(prof).reports:
        if r.scope in names and r.device_type == device.type:
            inside.setdefault(r.scope, []).append(r)
    for scope, reports in inside.items():
        reports.sort(key=lambda r: r.time_ns)
        sizes: list[int] = []                  # every block the call allocated, in order
        order: list[tuple[bool, int]] = []     # (allocated?, block) in time order
        live: dict[int, int] = {}              # address -> its block, while allocated
        for r in reports:
            if r.bytes > 0:
                live[r.address] = len(sizes)
                order.append((True, len(sizes)))
                sizes.append(r.bytes)
            elif r.bytes < 0 and r.address in live:
                order.append((False, live.pop(r.address)))
        scratch = {b: n for n, b in enumerate(sorted(set(range(len(sizes))) - set(live.values())))}
        out[names[scope]] = tuple(sizes[b] if allocated else -(scratch[b] + 1)
                                  for allocated, b in order if b in scratch)
    return out


def _storage_bytes(out: Any) -> tuple[int, ...]:
    tensors: list[torch.Tensor] = []
    _collect_tensors(out, tensors)
    return tuple(t.untyped_storage().nbytes() for t in tensors)


@contextlib.contextmanager
def _running(key: str, failed: set[str]) -> Iterator[None]:
    """Run one call; a failure marks ``key`` as one that cannot run alone."""
    try:
        yield
    except Exception:  # noqa: BLE001 - any failure means "cannot run alone": analytic instead
        failed.add(key)
