"""Offload: the pinned host pool and the copies of a step under a plan (the part of
:class:`memplan.executor.step.Step` that moves tensors to the host and back).

One pinned host pool (:class:`HostPool`) is allocated once from the plan and reused every step. The
copies go through the device layer's copy stream (:class:`memplan.planner.probe.device.CopyStream`):

* **device -> host** (``_offload``): starts after the producing op (an event recorded on the compute
  stream); the device storage is held until the copy is known complete (polled at every op and module
  boundary the step passes, ``poll_d2h``) and then released: never ``record_stream``, so the allocator
  never hands the block to another tensor while the copy reads it;
* **host -> device** (``_prefetch``): the buffer is allocated on the compute stream, filled on the copy
  stream, and compute waits for the copy's event before it reads the buffer (``_wait_ready``: the
  exposed transfer time) -- or before the buffer is released, when nothing read it.

On a CPU the copies are synchronous; under the CUDA emulation they complete only when asked
(:mod:`memplan.planner.probe.device`), so a read before the wait or a release before the copy is known
complete fails the CPU tests as it would corrupt a GPU step.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from memplan.executor.recipes import byte_view
from memplan.planner.core.errors import PlanMismatch
from memplan.planner.core.graph import Graph
from memplan.planner.core.schedule import ScheduleEvent
from memplan.planner.probe.device import Device, Transfer


class HostPool:
    """One host buffer (pinned on CUDA) with a fixed slot per offloaded tensor id, allocated once. A slot
    holds the graph's bytes for its tensor (on CUDA the allocator's rounded size: at least the storage's
    own ``nbytes()``), each starting at a multiple of ``ALIGN``."""

    ALIGN = 512

    def __init__(self, graph: Graph, tids: list[int], device: Device):
        self.slots: dict[int, tuple[int, int]] = {}
        at = 0
        for t in tids:
            n = graph.tensors[t].bytes
            self.slots[t] = (at, n)
            at += -(-n // self.ALIGN) * self.ALIGN
        self.bytes = at
        self.buffer = device.pinned_empty(at) if at else None

    def slot(self, tid: int, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of tensor ``tid``'s slot; :class:`PlanMismatch` if they do not fit."""
        start, n = self.slots[tid]
        if nbytes > n:
            raise PlanMismatch(f"offloaded tensor {tid} has {nbytes} bytes at run time, {n} in the graph")
        return self.buffer[start:start + nbytes]


class Offloading:
    """Offload methods of a step. They read the step's ``ex`` (the executor: its pool, copy stream and
    ``internal()``), ``cursor``, ``log``, ``cache`` and ``storages``, and keep ``host`` (offloaded tensor id
    -> its slot, device and bytes), ``d2h_pending`` (copies to host not known complete, with the device
    bytes they read) and ``ready`` (prefetched tensor id -> its copy, until compute has waited for it)."""

    host: dict[int, tuple[torch.Tensor, torch.device, int]]
    d2h_pending: list[tuple[Transfer, torch.Tensor]]
    ready: dict[int, Transfer]

    def _offload(self, tid: int, s: torch.UntypedStorage) -> None:
        if tid in self.host:
            return
        ex = self.ex
        nbytes = s.nbytes()
        with ex.internal():  # the executor's own ops, not the model's
            src = byte_view(s)
            dst = ex.pool.slot(tid, nbytes)
            copy = ex.copies.to_host(dst, src)
            if not copy.complete:  # hold the device bytes until the copy has read them
                self.d2h_pending.append((copy, src))
        self.host[tid] = (dst, s.device, nbytes)
        self.log.append(ScheduleEvent("d2h", "forward", self.cursor - 1, tid, reason="offloaded"))

    def poll_d2h(self) -> None:
        """Release the device bytes of the copies to host known complete (an event query each)."""
        if self.d2h_pending:
            with self.ex.internal():  # an emulated copy runs when it is found complete: not the model's op
                self.d2h_pending = [(c, src) for c, src in self.d2h_pending if not c.done()]

    def _prefetch(self, tid: int, why: str, at: int | None = None) -> torch.UntypedStorage:
        """Start the copy back of an offloaded tensor (its device buffer counts from now)."""
        s = self.available(tid)
        if s is not None:
            return s  # never released (its copy ran late, or the caller holds it): nothing moves
        self.log.append(ScheduleEvent("h2d", "backward", at, tid, reason=why))
        src, device, nbytes = self.host[tid]
        ex = self.ex
        with ex.internal():
            dst = torch.empty(nbytes, dtype=torch.uint8, device=device)  # allocated on the compute stream
            copy = ex.copies.to_device(dst, src)
        if not copy.complete:
            self.ready[tid] = copy
        s = dst.untyped_storage()
        self.cache[tid] = s
        self.storages[tid] = weakref.ref(s)  # found while anyone holds it (see Replaying._replay)
        return s

    def _wait_ready(self, tid: int) -> None:
        """Make compute wait for tensor ``tid``'s prefetch copy (exposed transfer time), once."""
        copy = self.ready.pop(tid, None)
        if copy is not None:
            with self.ex.internal():
                copy.wait()

    def finish_transfers(self) -> None:
        """Backward is over: every copy a buffer or a source is still held for must be known complete
        before they are released (a prefetch nothing read, a copy to host still running)."""
        for tid in list(self.ready):
            self._wait_ready(tid)
        with self.ex.internal():
            for copy, _src in self.d2h_pending:
                copy.wait()
        self.d2h_pending = []

    ex: Any
    cursor: int
    log: list[Any]
    cache: dict[int, torch.UntypedStorage]
    storages: dict[int, weakref.ref]
