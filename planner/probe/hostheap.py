"""Fresh host pages in a CPU training step: what the C allocator's returns to the kernel cost (issue 21).

On a CPU, PyTorch allocates every tensor with the C library's allocator (c10's ``alloc_cpu``:
``posix_memalign``, 64-byte aligned). glibc gives memory back to the kernel *within* a step: a block above
its mmap threshold (dynamic, at most 32 MiB) is mapped on its own and unmapped when freed, and the top of
its heap is trimmed when more than its trim threshold lies free there. A page mapped again is zero-filled
by the kernel at its first write (a minor fault, about 2 us per 4 KiB page on this project's 2-core
machine, where writing the page costs 0.5 us). A step grows memory by its activations in forward and frees
them in backward, so every step takes faults again: on the built-in GPT-2 (CPU) 8,000 to 20,000 of them
per step, 15 to 45 ms of a 550 ms step; with glibc told never to return memory (``MALLOC_MMAP_THRESHOLD_``
and ``MALLOC_TRIM_THRESHOLD_`` set high) the same step ran 10 to 20% faster. How many a step takes depends
on where its blocks land among the process's small long-lived allocations (autograd's nodes, tensor
objects), which pin the heap's top: the count moves from step to step.

Timed alone, a call's output lands in the block its previous run freed, so an isolated time has none of
these faults, or, for a block above the threshold, all of them: a fake profile missed the step's and
carried the isolated runs' at random (the same fake ResNet read 180 and 281 ms under two allocator
settings). So a fake profile on a CPU takes them apart:

* **isolated times net of their own faults**: :class:`memplan.planner.probe.optime.OpTimer` counts each
  timed run's faults (``getrusage``) and takes off what they cost;
* **the step's faults charged where they happen**: :class:`Shadow` gives each storage a fake step creates
  a block of the same size from this process's own ``posix_memalign`` (never written: nothing of the
  step's size becomes resident, a model that does not fit is shadowed too) and frees it when the fake
  storage dies. The fake step makes the real step's small allocations around them (autograd's nodes and
  tensor objects are real even for fake tensors), so the allocator makes the real step's choices, and
  :class:`HostHeap` keeps an account of which pages have been written since the kernel last mapped them
  (a block counts as written when allocated; an unmapped block and a trimmed heap top are dropped, read
  from the chunk's ``IS_MMAPPED`` bit and ``sbrk(0)``; the pages of the process's anonymous mappings
  resident when the account begins, read with ``mincore``, count as written: a long-lived process reuses
  them without faults, also where its main arena has gone on in mapped segments because another mapping
  sat above its heap). The pages a block finds unwritten are its faults.
  A kernel's own scratch (blocks it allocates and frees inside the call, which no storage of the step
  owns: oneDNN's blocked copies of a convolution's input and output) is replayed at each call from what
  one real run of the call allocated (:meth:`Shadow.kernel_scratch`, found by
  :func:`memplan.planner.probe.optime.kernel_scratch`): above glibc's mmap threshold such a block faults
  at every call of a step, and before it was shadowed a DenseNet-style step (issue 37) was charged for
  none of its ~590k faults of its convolutions' and batch norms' scratch, half its time.
  Steady state needs a few steps (the first ones grow the heap): the profile shadows its warm-up steps
  and averages the last ones (:data:`COUNTED_STEPS`), and charges that mean, in the traced step's
  proportions, to the ops whose allocations take the faults (forward op, backward step, optimizer),
  at a page's fault and its release (:func:`fresh_page_cost_s`, :func:`page_release_cost_s`: a steady
  step gives back every page it faults in).

Against the real step's own counts (``getrusage`` around plain steps, 10 steps each, medians of the
steady ones): GPT-2 16.3k shadowed against 15.0k real pages per step, ResNet 5.7k against 6.2k, BERT
16.4k against 8.2k (its real count ran 0 to 16k).

Only glibc on Linux is shadowed (the account relies on its chunk layout and ``sbrk``), in the main thread
(another thread's allocations go to another arena); with another C library, an allocator preloaded over
it (jemalloc, tcmalloc keep their pages), glibc's settings changed by environment, or an allocation the
shadow cannot make (an address-space limit), no page is charged and the graph's ``meta["fresh_pages"]``
says why. CUDA's caching allocator keeps its blocks: a GPU step takes no such faults after its first.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import ctypes.util
import mmap
import os
import platform
import resource
import statistics
import threading
import time
import weakref
from collections.abc import Hashable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

PAGE = mmap.PAGESIZE
COUNTED_STEPS = 3  # steps averaged: the last warm-up steps and the traced one
WARMUP_STEPS = 3   # fake steps before the traced one when shadowing (the first also makes the optimizer state)
_COST: list[tuple[float, float]] = []  # seconds per fresh page: its fault, its release (once per process)
_SIZE_T = ctypes.sizeof(ctypes.c_size_t)


class ShadowError(RuntimeError):
    """The shadow cannot go on (an allocation failed): the profile charges no fresh page."""


class _Pages:
    """Pages as disjoint half-open intervals [start, end) of page numbers, sorted."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def touch(self, a: int, b: int) -> int:
        """Mark [a, b) written; return how many of its pages were not."""
        if b <= a:
            return 0
        starts, ends = self.starts, self.ends
        i = bisect.bisect_left(ends, a)    # first interval ending at or after a (adjacent ones merge)
        j = bisect.bisect_right(starts, b)  # intervals starting at or before b
        covered = sum(max(0, min(ends[k], b) - max(starts[k], a)) for k in range(i, j))
        lo, hi = (min(a, starts[i]), max(b, ends[j - 1])) if i < j else (a, b)
        starts[i:j] = [lo]
        ends[i:j] = [hi]
        return (b - a) - covered

    def drop(self, a: int, b: int) -> None:
        """Forget [a, b) (unmapped: its next write faults again)."""
        if b <= a:
            return
        starts, ends = self.starts, self.ends
        i = bisect.bisect_right(ends, a)   # first interval ending after a
        j = bisect.bisect_left(starts, b)  # intervals starting before b
        if i >= j:
            return
        keep_s: list[int] = []
        keep_e: list[int] = []
        if starts[i] < a:
            keep_s.append(starts[i])
            keep_e.append(a)
        if ends[j - 1] > b:
            keep_s.append(b)
            keep_e.append(ends[j - 1])
        starts[i:j] = keep_s
        ends[i:j] = keep_e

    def count(self) -> int:
        return sum(e - s for s, e in zip(self.starts, self.ends, strict=True))


def unsupported() -> str | None:
    """Why this process's allocator cannot be shadowed here (None: it can)."""
    if platform.system() != "Linux":
        return f"the C allocator of {platform.system()} is not shadowed (glibc on Linux only)"
    libc_name, _ = platform.libc_ver()
    if libc_name != "glibc":
        return f"the C library is {libc_name or 'not glibc'} (only glibc's allocator is shadowed)"
    if threading.current_thread() is not threading.main_thread():
        return "profiling outside the main thread (glibc gives other threads other arenas)"
    try:
        here = ctypes.CDLL(None)
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError as e:
        return f"cannot load the C library: {e}"
    if ctypes.cast(here.posix_memalign, ctypes.c_void_p).value != ctypes.cast(libc.posix_memalign,
                                                                            ctypes.c_void_p).value:
        return "posix_memalign is not glibc's (a preloaded allocator keeps its pages)"
    for var in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES"):
        if os.environ.get(var):
            return f"{var} is set (glibc's settings by environment are not modelled)"
    return None


_BIT0 = bytes(b & 1 for b in range(256))  # mincore's byte per page: bit 0 says resident


def _resident_pages(libc: ctypes.CDLL) -> list[tuple[int, int]]:
    """The pages of this process's private anonymous writable mappings (the main heap, the chunks glibc
    maps on their own, and the segments the main arena maps when its heap cannot grow in place) that are
    resident now, as runs [a, b) of page numbers (``mincore``): the process has written them, so a block
    placed on them later takes no fault. A mapping that cannot be read is skipped (its pages count fresh)."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:
        return []
    mincore = libc.mincore
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    mincore.restype = ctypes.c_int
    runs: list[tuple[int, int]] = []
    for line in lines:
        fields = line.split()
        if len(fields) < 5 or fields[1] != "rw-p" or fields[4] != "0" or (len(fields) > 5 and fields[5] == "[stack]"):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        n = (end - start) // PAGE
        if n <= 0:
            continue
        vec = (ctypes.c_ubyte * n)()
        if mincore(start, n * PAGE, vec) != 0:
            continue
        flags = bytes(vec).translate(_BIT0)
        i, first = 0, start // PAGE
        while (i := flags.find(1, i)) != -1:
            j = flags.find(0, i)
            j = n if j == -1 else j
            runs.append((first + i, first + j))
            i = j
    return runs


class HostHeap:
    """Blocks of this process's glibc allocator, never written, and the account of which pages a step has
    written since the kernel last mapped them (module docstring)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
        libc.posix_memalign.restype = ctypes.c_int
        libc.free.argtypes = [ctypes.c_void_p]
        libc.free.restype = None
        libc.sbrk.argtypes = [ctypes.c_ssize_t]
        libc.sbrk.restype = ctypes.c_void_p
        self.libc = libc
        self.pages = _Pages()
        self.top = libc.sbrk(0) or 0
        for a, b in _resident_pages(libc):  # written before this account began: no fault at reuse
            self.pages.touch(a, b)

    def alloc(self, nbytes: int) -> tuple[int, int]:
        """A block of ``nbytes`` (as c10 asks: 64-byte aligned); returns its address and how many of its
        pages are fresh (its first write faults them). Raises :class:`ShadowError` when none is given."""
        ptr = ctypes.c_void_p()
        if self.libc.posix_memalign(ctypes.byref(ptr), 64, nbytes) != 0 or not ptr.value:
            raise ShadowError(f"the allocator gave no block of {nbytes} bytes (an address-space limit?)")
        address = ptr.value
        self.top = max(self.top, self.libc.sbrk(0) or 0)
        first, end = address // PAGE, (address + nbytes - 1) // PAGE + 1
        if ctypes.c_size_t.from_address(address - _SIZE_T).value & 2:  # IS_MMAPPED: a new mapping, all fresh
            self.pages.drop((address - 2 * _SIZE_T) // PAGE, end)  # whatever was mapped there before
        return address, self.pages.touch(first, end)

    def free(self, address: int, nbytes: int) -> None:
        mapped = ctypes.c_size_t.from_address(address - _SIZE_T).value & 2  # glibc's IS_MMAPPED bit
        self.libc.free(address)
        if mapped:  # unmapped: the block's pages, its header's included
            self.pages.drop((address - 2 * _SIZE_T) // PAGE, (address + nbytes - 1) // PAGE + 1)
            return
        now = self.libc.sbrk(0) or 0
        if now < self.top:  # the heap's top was trimmed
            self.pages.drop((now + PAGE - 1) // PAGE, (self.top + PAGE - 1) // PAGE)
        self.top = now


class Shadow:
    """Shadow blocks for the storages of fake steps (module docstring). ``born(storage, where)`` gives a
    storage its block (once; freed when the storage dies); the fresh pages it finds are added to
    ``pages[where]`` while :meth:`counting`. After a failed allocation the shadow stops (``failed`` says
    why) and frees what it holds. :meth:`close` frees everything."""

    def __init__(self) -> None:
        self.heap = HostHeap()
        self.live: dict[int, tuple[int, int, Any]] = {}  # storage key -> (address, bytes, weakref)
        self.pages: dict[Hashable, int] = {}
        self.count = False
        self.failed: str | None = None
        self.step_totals: list[int] = []
        # call key -> its kernel's scratch, as optime.kernel_scratch gives it (+n allocated, -(i+1) freed)
        self.scratch: dict[str, tuple[int, ...]] = {}

    def born(self, storage: torch.UntypedStorage, where: Hashable) -> None:
        if self.failed is not None:
            return
        key = storage._cdata
        nbytes = storage.nbytes()
        if key in self.live or nbytes <= 0:
            return
        try:
            address, fresh = self.heap.alloc(nbytes)
        except ShadowError as e:
            self.failed = str(e)
            self.close()
            return
        ref = weakref.ref(storage, lambda _r, key=key: self._died(key))
        self.live[key] = (address, nbytes, ref)
        if self.count and fresh:
            self.pages[where] = self.pages.get(where, 0) + fresh

    def kernel_scratch(self, key: str, where: Hashable) -> None:
        """Replay the blocks call ``key``'s kernel allocates and frees inside the call (:attr:`scratch`),
        its fresh pages added to ``pages[where]`` while :meth:`counting`: a convolution's reorder buffer
        above the mmap threshold faults in the step, every call."""
        events = self.scratch.get(key)
        if not events or self.failed is not None:
            return
        held: dict[int, tuple[int, int]] = {}
        try:
            for e in events:
                if e > 0:
                    address, fresh = self.heap.alloc(e)
                    held[len(held)] = (address, e)
                    if self.count and fresh:
                        self.pages[where] = self.pages.get(where, 0) + fresh
                else:
                    block = held.get(-e - 1)
                    if block is not None:
                        self.heap.free(*block)
                        held[-e - 1] = (0, 0)
        except ShadowError as e:
            self.failed = str(e)
        for address, nbytes in held.values():  # a block the call keeps is none of its scratch: freed here
            if address:
                self.heap.free(address, nbytes)
        if self.failed is not None:
            self.close()

    def _died(self, key: int) -> None:
        block = self.live.pop(key, None)
        if block is not None:
            self.heap.free(block[0], block[1])

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Count one step's fresh pages (in ``pages``, by where); their total goes to ``step_totals``."""
        self.pages, self.count = {}, True
        try:
            yield
        finally:
            self.count = False
            self.step_totals.append(sum(self.pages.values()))

    def close(self) -> None:
        for key in list(self.live):
            self._died(key)


class ShadowMode(TorchDispatchMode):
    """Gives every new storage among each call's outputs its shadow block, counted under ``None`` (the
    traced step's are given theirs by the tracer, counted under their op), then replays the call's kernel
    scratch (:meth:`Shadow.kernel_scratch`). ``record(func, args, kwargs, out)`` gives a call's
    :class:`memplan.planner.probe.optime.OpCall` (its key names its scratch); ``calls``, when given,
    receives each one (the calls whose scratch the profile then finds)."""

    def __init__(self, shadow: Shadow, record: Any = None, calls: list | None = None):
        super().__init__()
        self.shadow = shadow
        self.record = record
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.shadow.failed is None:
            stack = [out]
            while stack:
                x = stack.pop()
                if isinstance(x, torch.Tensor):
                    try:
                        s = x.untyped_storage()
                    except (RuntimeError, NotImplementedError):
                        continue
                    self.shadow.born(s, None)
                elif isinstance(x, (list, tuple)):
                    stack.extend(x)
        if self.record is not None and isinstance(func, torch._ops.OpOverload) and func.namespace != "profiler":
            call = self.record(func, args, kwargs, out)
            if self.calls is not None:
                self.calls.append(call)
            self.shadow.kernel_scratch(call.key, None)
        return out


def fresh_page_cost_s() -> float:
    """Seconds a page's first write costs beyond a write of a resident page, measured on this machine once
    per process: a 64 MiB tensor (above glibc's largest mmap threshold: freshly mapped) filled twice on one
    thread, the difference over the first fill's faults (thread CPU time; median of five). What an isolated
    run's own faults are taken off at (:class:`memplan.planner.probe.optime.OpTimer`)."""
    return _page_costs()[0]


def page_release_cost_s() -> float:
    """Seconds giving a written page back to the kernel costs (the unmapping of a freed mapped block or a
    trimmed heap top: the kernel unmaps and frees each page), measured with :func:`fresh_page_cost_s` as
    the free of its written 64 MiB tensor over its pages. A steady step gives back as many pages as it
    faults in (a page faults again only after it was given back), so a step's fresh page costs both."""
    return _page_costs()[1]


def _page_costs() -> tuple[float, float]:
    if _COST:
        return _COST[0]
    threads = torch.get_num_threads()
    faults_s, releases_s = [], []
    try:
        torch.set_num_threads(1)  # the faults are counted on this thread
        for _ in range(5):
            before = process_faults()
            start = time.thread_time()
            x = torch.empty(16 * 2**20, dtype=torch.float32)
            x.fill_(1.0)
            first = time.thread_time() - start
            faults = process_faults() - before
            start = time.thread_time()
            x.fill_(2.0)
            again = time.thread_time() - start
            start = time.thread_time()
            del x
            freed = time.thread_time() - start
            if faults > 0:
                faults_s.append(max(0.0, first - again) / faults)
                releases_s.append(freed / faults)
    finally:
        torch.set_num_threads(threads)
    _COST.append((statistics.median(faults_s) if faults_s else 0.0,
                  statistics.median(releases_s) if releases_s else 0.0))
    return _COST[0]


def process_faults() -> int:
    """Minor page faults this process has taken so far (all its threads: torch's workers fault too)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
