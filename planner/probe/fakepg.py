"""One rank's training step under FSDP2 or DDP for N ranks, in this process: PyTorch's fake process group
(``torch.testing._internal.distributed.fake_pg``: collectives return at once and move nothing), so N
ranks need neither N processes nor, under FSDP2, any rank's memory.

:func:`trace_rank_step` (FSDP2) initialises ``torch.distributed`` with the ``"fake"`` backend as rank *r*
of *N*, copies the bare module with fake parameters, wraps it as a real run does (``fully_shard`` on each
unit, then the root), makes the optimizer and runs a warm-up step and one traced step under
``FakeTensorMode``. Nothing is approximated by a formula: the sharded parameters and optimizer state, the
all-gather outputs, unsharded parameters, reduce-scatter inputs and sharded gradients are the tensors
FSDP2 itself creates, and a dispatch mode (:class:`_RankMemory`) follows every storage from the call that
makes it until its last reference goes (and FSDP2's storage resizes), as the allocator sees them. What
fake tensors cannot show is added from measurements:

* kernel scratch: each compute call's allocator high-water mark, from running it alone once
  (:class:`memplan.planner.probe.optime.OpTimer`, cached: the figures a fake profile uses);
* the backend's own copies: under ``backend="gloo"`` every ``all_gather_into_tensor`` and
  ``reduce_scatter_tensor`` allocates one copy of its full flat buffer while it runs (docs/model.md,
  "Distributed"); ``"nccl"`` allocates nothing through the caching allocator.

DDP cannot be traced so in torch 2.13: its C++ reducer reads tensor data (the parameter-shape check at
construction, the bucket indices it broadcasts when it rebuilds its buckets in the second forward, the
unused-parameter map with ``find_unused_parameters=True``), which fake tensors do not have.
:func:`measure_ddp_rank` runs a DDP rank with the fake process group and real tensors instead and reads
the allocator: exact, for one rank's real memory.

The figures are those :func:`memplan.planner.probe.measure.measure_rank_step` reads from the allocator
in a real run: ``start_bytes`` live when the measured step begins (gradients released), ``peak_bytes`` the
highest live bytes during it, the batch included.
"""

from __future__ import annotations

import contextlib
import copy
import time
import weakref
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from memplan.planner.core.devicespec import round_allocation
from memplan.planner.core.errors import MemplanError
from memplan.planner.probe.distributed import ENGINES, DistributedPlanError, check_unit_prefixes
from memplan.planner.probe.fake import fake_call, quiet_meta_failures
from memplan.planner.probe.optime import OpTimer, record_call
from memplan.planner.probe.storage import tensors_in
from memplan.planner.workloads import LossFn, default_optimizer, training_step

BACKENDS = ("gloo", "nccl")
# collectives whose CPU (gloo) implementation copies its full flat buffer once: (op, index of that buffer)
_GLOO_COPIES = {
    torch.ops.c10d._allgather_base_.default: 0,        # all_gather_into_tensor: the output
    torch.ops.c10d._reduce_scatter_base_.default: 1,   # reduce_scatter_tensor: the input
}
_METADATA = frozenset({torch.ops.prim.device.default, torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int,
                       torch.ops.aten.sym_numel.default, torch.ops.aten.sym_storage_offset.default})


class FakeProcessGroupError(MemplanError):
    """A rank's step cannot be traced under the fake process group (the message says why)."""


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """``torch.distributed`` initialised with the fake backend as ``rank`` of ``world_size`` (nothing is
    communicated; every collective returns at once), destroyed on exit. Refuses to replace a process
    group that is already initialised (a real run's)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if world_size < 1 or not 0 <= rank < world_size:
        raise DistributedPlanError(f"rank {rank} of world size {world_size}: need world_size >= 1 and "
                                   f"0 <= rank < world_size")
    if dist.is_initialized():
        raise FakeProcessGroupError("torch.distributed is already initialised in this process: the fake "
                                    "process group cannot replace it")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True)
class RankTrace:
    """One rank's traced step. Bytes as the allocator counts them: ``start_bytes`` live when the step
    begins, ``peak_bytes`` the highest during it (both with the batch); ``peak_phase`` ("forward",
    "backward", "optimizer") and ``peak_call`` (the ATen call, and the engine's ``record_function`` range
    around it if any) say where. ``params_bytes`` / ``optimizer_state_bytes``: this rank's parameters
    (shards under FSDP2) and optimizer state; ``engine_bytes``: what the engine keeps between steps beyond
    them (DDP's buckets). ``collectives``: collective calls in the step; ``scratch_calls``: calls whose
    kernel scratch was measured; ``trace_s``: wall seconds of the trace (op timing included)."""

    rank: int
    world_size: int
    engine: str
    backend: str
    peak_bytes: int
    start_bytes: int
    peak_phase: str
    peak_call: str
    params_bytes: int
    optimizer_state_bytes: int
    engine_bytes: int
    collectives: int
    scratch_calls: int
    trace_s: float
    tensors: str = "fake"  # "fake": traced under FakeTensorMode; "real": allocated and measured (DDP)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _RankMemory(TorchDispatchMode):
    """Live bytes of every storage the calls under it create, each tracked by a weakref (the count drops
    the moment the program lets go of it). Per call it notes the bytes live before the call and the new
    storages it made (to add the kernel's scratch once measured), and under gloo the collective's copy."""

    def __init__(self, gloo: bool):
        super().__init__()
        self.gloo = gloo
        self.live = 0
        self.known: dict[int, int] = {}      # storage _cdata -> bytes
        self.refs: list[weakref.ref] = []
        # storages made inside the engine's ranges: FSDP2 frees and re-allocates its all-gather outputs
        # by resizing their storage (no call, no new storage), so their size is read again at every call
        self.resizable: dict[int, weakref.ref] = {}
        self.phase = "setup"
        self.ranges: list[str] = []          # the engine's record_function names, innermost last
        self.collectives = 0
        # per traced call: (live before, new bytes, the call's record or None, phase, where)
        self.calls: list[tuple[int, int, Any, str, str]] = []
        self.recording = False

    def add(self, t: torch.Tensor) -> int:
        """Count ``t``'s storage (a DTensor's: its local shard's) if it is new; return the bytes added."""
        local = _local(t)
        if local is None:
            return 0
        s = local.untyped_storage()
        key = s._cdata
        if key in self.known:
            return 0
        nbytes = round_allocation(s.nbytes(), local.device.type)
        self.known[key] = nbytes
        self.live += nbytes

        def died(_ref: weakref.ref, key: int = key) -> None:
            self.live -= self.known.pop(key, 0)
            self.resizable.pop(key, None)

        ref = weakref.ref(s, died)
        self.refs.append(ref)
        if self.ranges:
            self.resizable[key] = ref
        return nbytes

    def poll(self) -> None:
        """Bring the engine's storages' sizes up to date (a ``resize_`` of a storage is no call)."""
        for key, ref in list(self.resizable.items()):
            s = ref()
            if s is None:
                continue
            nbytes = round_allocation(s.nbytes(), "cpu")
            if nbytes != self.known.get(key, nbytes):
                self.live += nbytes - self.known[key]
                self.known[key] = nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            return func(*args, **kwargs)
        self.poll()
        if func.namespace == "profiler":  # record_function: the engine's named ranges
            out = func(*args, **kwargs)
            if "enter" in func.__name__ and args and isinstance(args[0], str):
                self.ranges.append(args[0])
            elif "exit" in func.__name__ and self.ranges:
                self.ranges.pop()
            return out
        before = self.live
        transient = 0
        if func.namespace == "c10d" and func not in (torch.ops.c10d.barrier.default,):
            self.collectives += 1
            index = _GLOO_COPIES.get(func)
            if self.gloo and index is not None:
                transient = sum(_nbytes(t) for t in tensors_in(args[index]))
        out = fake_call(func, args, kwargs, self.ranges[-1] if self.ranges else self.phase)
        new = sum(self.add(t) for t in tensors_in(out))
        if self.recording:
            call = None
            tensors = tensors_in((args, kwargs, out))
            if func.namespace == "aten" and tensors and all(type(t) in (FakeTensor, torch.Tensor) for t in tensors):
                call = record_call(func, args, kwargs, out)
            where = f"{func}" + (f" in {self.ranges[-1]}" if self.ranges else "")
            self.calls.append((before, max(new, transient), call, self.phase, where))
        return out


def _local(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor holding ``t``'s memory on this rank: a DTensor's local shard, else ``t``."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t._local_tensor
    if t.layout != torch.strided:
        return None
    return t


def _nbytes(t: torch.Tensor) -> int:
    local = _local(t)
    return 0 if local is None else local.untyped_storage().nbytes()


def _fake_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are new tensors of the same shapes, strides and
    dtypes, made by the active modes (fake: nothing allocated); tied ones stay tied. Other tensor
    attributes are copied as they are."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_strided(tuple(p.shape), p.stride(), dtype=p.dtype, device="cpu"),
                                   requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_strided(tuple(b.shape), b.stride(), dtype=b.dtype, device="cpu")
    with torch.utils._python_dispatch._disable_current_modes():
        return copy.deepcopy(model, memo)


def _allreduce_in_place(process_group, bucket):  # noqa: ANN001, ANN202 - DDP checks the real annotations below
    """DDP's allreduce of a bucket, in place, as its built-in hook does (the fake group's work carries no
    value for DDP's default path to read back): the bucket is returned as its own result."""
    buffer = bucket.buffer()
    dist.all_reduce(buffer, group=process_group)
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buffer)
    return fut


_allreduce_in_place.__annotations__ = {"process_group": dist.ProcessGroup, "bucket": dist.GradBucket,
                                       "return": torch.futures.Future[torch.Tensor]}


def trace_rank_step(model: nn.Module, batch: Any, loss_fn: LossFn, *, engine: str, world_size: int, rank: int = 0,
                    prefixes: list[str] | tuple[str, ...] = (), backend: str = "gloo", warmup: int | None = None,
                    timer: OpTimer | None = None) -> RankTrace:
    """Trace one training step of rank ``rank`` of ``world_size`` under ``engine`` ("ddp" or "fsdp":
    ``fully_shard`` on each of ``prefixes``, then the root) with AdamW (foreach), after ``warmup`` steps
    (None: 1, which creates the optimizer state; FSDP2's steps after the first are alike). Under "ddp" this
    is :func:`measure_ddp_rank` (real tensors: DDP's reducer cannot run on fake ones). ``model``: the bare
    module (left untouched; it may be large: only its shapes are read); ``batch``: one rank's batch (real
    tensors, counted). ``backend``: whose collectives' own copies to charge ("gloo" or "nccl"). ``timer``
    measures each compute call's kernel scratch (None: a CPU :class:`OpTimer` with the default cache).
    Raises :class:`DistributedPlanError` for a bad engine, world size, rank or unit, and
    :class:`FakeProcessGroupError` if the step cannot be traced (the message names the call)."""
    if engine not in ENGINES:
        raise DistributedPlanError(f"engine {engine!r}: expected one of {', '.join(ENGINES)}")
    if backend not in BACKENDS:
        raise DistributedPlanError(f"backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    if engine == "ddp":  # DDP's reducer cannot run on fake tensors: see measure_ddp_rank
        return measure_ddp_rank(model, batch, loss_fn, world_size=world_size, rank=rank, backend=backend)
    if warmup is None:
        warmup = 1
    if warmup < 1:
        raise DistributedPlanError(f"warmup must be >= 1 (to create the optimizer state), got {warmup}")
    check_unit_prefixes(model, prefixes)
    started = time.perf_counter()
    batch_bytes = _batch_bytes(batch)
    with fake_process_group(rank, world_size):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world_size,))  # outside fake mode: it reads its rank map
        memory = _RankMemory(gloo=backend == "gloo")
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        try:
            with fake_mode, memory, quiet_meta_failures():
                for t in tensors_in(batch):  # real, allocated before the step as in a real run
                    memory.add(t)
                train_model, bare, optimizer = _wrapped(model, prefixes, mesh)
                params = sum(_nbytes(p) for p in bare.parameters())
                for _ in range(warmup):
                    _step(train_model, batch, loss_fn, optimizer)
                optimizer.zero_grad(set_to_none=True)
                memory.poll()
                state = sum(_nbytes(t) for s in optimizer.state.values() for t in tensors_in(s))
                start = memory.live
                memory.recording = True
                memory.phase = "forward"
                _step(train_model, batch, loss_fn, optimizer, memory)
                memory.recording = False
                optimizer.zero_grad(set_to_none=True)
        except MemplanError:
            raise
        except Exception as e:  # noqa: BLE001 - torch's own error, said in one line with the rank
            raise FakeProcessGroupError(f"rank {rank} of {world_size} under {engine} cannot be traced with the "
                                        f"fake process group: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}") from e
    timer = timer or OpTimer(torch.device("cpu"))
    recorded = [c for c in memory.calls if c[2] is not None]
    highs = dict(zip((id(c) for c in recorded), (t.high_bytes for t in timer.time([c[2] for c in recorded])),
                     strict=True))
    peak, phase, where = start, "forward", ""
    for c in memory.calls:
        before, new, _call, call_phase, call_where = c
        at = before + max(new, highs.get(id(c), 0))
        if at > peak:
            peak, phase, where = at, call_phase, call_where
    return RankTrace(rank=rank, world_size=world_size, engine=engine, backend=backend,
                     peak_bytes=peak, start_bytes=start, peak_phase=phase, peak_call=where,
                     params_bytes=params, optimizer_state_bytes=state,
                     engine_bytes=start - params - state - batch_bytes, collectives=memory.collectives,
                     scratch_calls=len(recorded), trace_s=time.perf_counter() - started)


def _wrapped(model: nn.Module, prefixes: Any, mesh: Any) -> tuple[nn.Module, nn.Module, Any]:
    """(the module to call, the module whose parameters the optimizer steps, the optimizer): a fake copy
    of ``model`` under ``fully_shard`` (each of ``prefixes``, then the root), as
    :func:`memplan.api.distributed.run_distributed` wraps it."""
    from torch.distributed.fsdp import fully_shard

    bare = _fake_copy(model)
    bare.train()
    for p in prefixes:
        fully_shard(bare.get_submodule(p), mesh=mesh)
    train_model = fully_shard(bare, mesh=mesh)
    return train_model, bare, default_optimizer(bare)


def _step(model: nn.Module, batch: Any, loss_fn: LossFn, optimizer: Any, memory: _RankMemory | None = None) -> None:
    """One training step (:func:`memplan.planner.workloads.training_step`), telling ``memory`` each phase."""
    def run_phase(phase: str, fn: Any) -> Any:
        if memory is not None:
            memory.phase = phase
        return fn()

    training_step(model, batch, loss_fn, optimizer, run_phase=run_phase)


def _batch_bytes(batch: Any) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors_in(batch):
        s = t.untyped_storage()
        if s._cdata not in seen:
            seen.add(s._cdata)
            total += s.nbytes()
    return total


def measure_ddp_rank(model: nn.Module, batch: Any, loss_fn: LossFn, *, world_size: int, rank: int = 0,
                     backend: str = "gloo") -> RankTrace:
    """One DDP rank's step with the fake process group and *real* tensors, measured from the allocator
    (:func:`memplan.planner.probe.measure.measure_rank_step`, 2 warm-up steps): DDP's C++ reducer
    cannot run under ``FakeTensorMode`` in torch 2.13 (it reads tensor data: the parameter-shape check at
    construction, the bucket-index broadcast when it rebuilds its buckets in the second forward, the
    unused-parameter map at the end of backward), so a DDP rank costs one rank's real memory here. A DDP
    rank's memory does not depend on the world size (every rank holds the whole model and one bucket
    copy of its gradients); gloo's and NCCL's allreduce allocate nothing through the allocator."""
    from memplan.planner.probe.measure import measure_rank_step

    if backend not in BACKENDS:
        raise DistributedPlanError(f"backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    started = time.perf_counter()
    with fake_process_group(rank, world_size):
        from torch.nn.parallel import DistributedDataParallel

        held: list[Any] = []

        def build() -> tuple[nn.Module, Any]:
            bare = copy.deepcopy(model)  # inside the measured window, as run_distributed builds a rank
            train_model = DistributedDataParallel(bare, init_sync=False)
            train_model.register_comm_hook(None, _allreduce_in_place)
            optimizer = default_optimizer(bare)
            held.append((bare, optimizer))
            return train_model, optimizer

        m = measure_rank_step(build, batch, loss_fn, warmup=2, rank=rank)
        bare, optimizer = held[0]
        params = sum(p.untyped_storage().nbytes() for p in bare.parameters())
        state = sum(t.untyped_storage().nbytes() for s in optimizer.state.values() for t in tensors_in(s))
    return RankTrace(rank=rank, world_size=world_size, engine="ddp", backend=backend, peak_bytes=m.peak_bytes,
                     start_bytes=m.start_bytes, peak_phase="", peak_call="", params_bytes=params,
                     optimizer_state_bytes=state, engine_bytes=m.start_bytes - params - state - _batch_bytes(batch),
                     collectives=0, scratch_calls=0, trace_s=time.perf_counter() - started, tensors="real")


def trace_ranks(model: nn.Module, batch: Any, loss_fn: LossFn, *, engine: str, world_size: int,
                prefixes: list[str] | tuple[str, ...] = (), backend: str = "gloo",
                ranks: list[int] | None = None, timer: OpTimer | None = None) -> list[RankTrace]:
    """Each of ``ranks`` (None: all ``world_size``), one after the other in this process: FSDP2 ranks
    traced under fake tensors (:func:`trace_rank_step`, sharing one op timer), DDP ranks measured with
    real tensors (:func:`measure_ddp_rank`)."""
    if world_size < 1:
        raise DistributedPlanError(f"world_size must be >= 1, got {world_size}")
    todo = list(range(world_size) if ranks is None else ranks)
    timer = timer or OpTimer(torch.device("cpu"))
    return [trace_rank_step(model, batch, loss_fn, engine=engine, world_size=world_size, rank=r,
                            prefixes=prefixes, backend=backend, timer=timer)
            for r in todo]
