"""Offload: the pinned host pool and the copies of a step under a plan (the part of
:class:`memplan.executor.step.Step` that moves tensors to the host and back).

One pinned host pool (:class:`HostPool`) is allocated once from the plan and reused every step. The
copies go through the device layer's copy stream (:class:`memplan.planner.probe.device.CopyStream`):

* **device -> host** (``_offload``): starts after the producing op (an event recorded on the compute
  stream); the device storage is held until the position where the schedule releases it
  (``Schedule.released``: the first op boundary after the copy ends on the schedule's clock), where
  compute waits for the copy's event and the storage is dropped (``release_copied``). The release is
  where the schedule puts it whatever the host sees: a host that runs ahead of the device (a GPU step)
  would find the copy's event unfinished at every boundary and hold the bytes to the end of forward, so
  the step's memory would depend on the clock instead of the plan. Never ``record_stream``: after the
  wait, the block goes back to the compute stream's pool in stream order, so the allocator cannot hand it
  to another tensor while the copy reads it. A copy slower than planned costs compute time there, never
  memory. A tensor the schedule never releases (its copy ends after backward reads it) is settled where
  it is found on the device (``_settle_d2h``);
* **host -> device** (``_prefetch``): the buffer is allocated on the compute stream, filled on the copy
  stream, and compute waits for the copy's event before it reads the buffer (``_wait_ready``: the
  exposed transfer time) -- or before the buffer is released, when nothing read it.

On a CPU the copies are synchronous; under the CUDA emulation they complete only when waited for (an
event query says "not yet" until then, as a GPU's does while the host runs ahead;
:mod:`memplan.planner.probe.device`), so a read before the wait, a release before the copy is known
complete or a release that waits for an event query fails the CPU tests as it would corrupt a GPU step or
overrun its memory.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from memplan.executor.recipes import byte_view
from memplan.planner.core.errors import PlanMismatch
from memplan.planner.core.graph import Graph
from memplan.planner.core.schedule import COPY_ENDED, ScheduleEvent
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
    -> its slot, device and bytes), ``d2h_pending`` (offloaded tensor id -> its copy to host and the device
    bytes it reads, until released), ``release_queue`` (the schedule's release positions still ahead, in
    step order: ``(in backward, op, tensor id)``) and ``ready`` (prefetched tensor id -> its copy, until
    compute has waited for it)."""

    host: dict[int, tuple[torch.Tensor, torch.device, int]]
    d2h_pending: dict[int, tuple[Transfer, torch.Tensor]]
    release_queue: list[tuple[bool, int, int]]
    ready: dict[int, Transfer]

    def _offload(self, tid: int, s: torch.UntypedStorage) -> None:
        if tid in self.host:
            return
        k = self.cursor
        ops = self.g.ops
        j = self.ex.next_real[k]  # past autograd's detaches (they save nothing)
        if k < j < len(ops) and tid in self.saved_at[j] and tid not in ops[j].outputs:
            # a saved input of op j, packed before op j reaches the dispatch mode, with only autograd's
            # detaches between (never dispatched under the hooks: op j is being called): the step has
            # passed them, as the schedule has when it copies the tensor at op j's start
            while self.cursor < j:
                self._passed_detach()
            k = j
        if self.release_queue and k < len(ops) and tid in self.saved_at[k] and tid not in ops[k].outputs:
            # a saved input of op k, packed by autograd before the op reaches the dispatch mode: the
            # releases at the boundary before op k come first, as the schedule orders them
            self.release_copied(k)
        ex = self.ex
        nbytes = s.nbytes()
        with ex.internal():  # the executor's own ops, not the model's
            src = byte_view(s)
            dst = ex.pool.slot(tid, nbytes)
            copy = ex.copies.to_host(dst, src)
            self.d2h_pending[tid] = (copy, src)  # the device bytes stay until the schedule releases them
        self.host[tid] = (dst, s.device, nbytes)
        self.log.append(ScheduleEvent("d2h", "forward", self.cursor - 1, tid, reason="offloaded"))

    def release_copied(self, k: int, backward: bool = False) -> None:
        """The step is at the boundary before forward op ``k`` (``backward``: before backward step ``k``):
        release the device bytes of the offloaded tensors the schedule releases at or before it."""
        q = self.release_queue
        while q:
            in_backward, at, tid = q[0]
            if in_backward:
                if not backward or at < k:
                    return
            elif not backward and at > k:
                return
            q.pop(0)
            if tid in self.d2h_pending:
                self._settle_d2h(tid)
                # logged where it happened (the schedule's position, when the step is where it should be)
                self.log.append(ScheduleEvent("free", "backward" if backward else "forward", k, tid,
                                              reason=COPY_ENDED))

    def _settle_d2h(self, tid: int) -> None:
        """Compute waits for tensor ``tid``'s copy to host (an event wait: no host sync), then the step lets
        go of its device bytes: after the wait, reusing them is ordered after the copy."""
        entry = self.d2h_pending.pop(tid, None)
        if entry is not None:
            with self.ex.internal():  # an emulated copy runs when waited for: not the model's op
                entry[0].wait()

    def _prefetch(self, tid: int, why: str, at: int | None = None) -> torch.UntypedStorage:
        """Start the copy back of an offloaded tensor (its device buffer counts from now)."""
        s = self.available(tid)
        if s is not None:  # never released (its copy ran late, or the caller holds it): nothing moves, and
            self._settle_d2h(tid)  # the device copy is backward's now: freed where its last reader has run
            self.cache[tid] = s  # held for its unpacks (the copy's entry held it until now)
            return s
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
        for tid in list(self.d2h_pending):
            self._settle_d2h(tid)
        self.release_queue = []

    ex: Any
    g: Graph
    saved_at: list[list[int]]
    cursor: int
    log: list[Any]
    cache: dict[int, torch.UntypedStorage]
    storages: dict[int, weakref.ref]
