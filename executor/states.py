"""Model states under a plan, at run time: the optimizer state of the plan's streamed units lives in one
pinned host pool between steps and goes through the device for its update (the cost model is
planner/core/states.py; the order of copies and waits below is exactly the one it scores).

Between steps ``optimizer.state[p][key]`` of a streamed unit is a view of the unit's slot in the pool, so
``optimizer.state_dict()`` (and a checkpoint saved from it) reads the real state wherever it lives; a
``load_state_dict()`` moves a streamed unit's loaded state to its slot at once, and :meth:`remove` puts
every state back on its parameter's device, as plain training has it. ``optimizer.step()`` steps the
resident units together, then each streamed unit with its state copied in (the next unit's copy runs during
its update), updated on the device by the user's optimizer (its groups narrowed to the unit: the same
kernels and arithmetic as plain training), and copied back; the device buffers are dropped once the copy
back is known complete. A unit's first step creates its state on the device (as plain training does),
which then moves to the pool. A step that raises part-way (an out-of-memory error, a hook) keeps every
state: what is on the device goes back to the pool before the error propagates.

The copies are the device layer's (:mod:`memplan.planner.probe.device`): a CUDA copy stream, pinned host
memory; under the CUDA emulation a copy completes only when waited for, its destination poisoned until
then, so an update that read a state before its copy arrived would train wrong numbers in the CPU tests.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memplan.executor.hoststep import HostStepper
from memplan.executor.recipes import tensor_bytes
from memplan.planner.core.errors import PlanMismatch
from memplan.planner.core.graph import Graph
from memplan.planner.core.schedule import ScheduleEvent
from memplan.planner.core.states import (
    STATE_ALIGN,
    STATE_BACK,
    STATE_IN,
    STATE_RELEASED,
    slot_bytes,
    unit_grads,
)
from memplan.planner.probe.device import Device
from memplan.planner.probe.fusion import bucket_modules, buckets, narrowed_groups
from memplan.planner.probe.states import unit_state_tensors


class StateStreamer:
    """The streamed units' optimizer state: its host pool, and the optimizer step that streams it."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, graph: Graph, streamed: list[int],
                 device: Device, copies: Any, hosted: list[int] = (), grads_released: dict | None = None):
        groups, _, module_buckets = buckets(model, optimizer)
        names = bucket_modules(model, module_buckets, len(groups))
        units = graph.state_units
        if [(n, len(g)) for n, g in zip(names, groups, strict=True)] != [(u.module, u.params) for u in units]:
            raise PlanMismatch(f"the plan places the optimizer state of {len(units)} units (modules "
                               f"{', '.join(repr(u.module) for u in units[:3])}...), but this optimizer steps "
                               f"{len(groups)} (modules {', '.join(repr(n) for n in names[:3])}...): re-profile "
                               f"with this model and optimizer")
        self.optimizer = optimizer
        self.device = device
        self.copies = copies
        self.groups = groups
        self.streamed = list(streamed)
        chosen = set(streamed) | set(hosted)
        self.resident = [p for u, ps in enumerate(groups) if u not in chosen for p in ps]
        # the host-stepped units (executor/hoststep.py): their own pool, hooks and host steps
        self.hoststep = (HostStepper(optimizer, graph, groups, list(hosted), grads_released or {}, device, copies)
                         if hosted else None)
        self.slots: dict[int, tuple[int, int]] = {}
        at = 0
        for u in streamed:
            n = slot_bytes(units[u].state_bytes, units[u].state_tensors)
            self.slots[u] = (at, n)
            at += n
        self.pool = device.pinned_empty(at) if at else None
        self.bytes = at + (self.hoststep.bytes if self.hoststep is not None else 0)
        self.steps = 0
        self.fused = False  # backward fusion steps the resident and streamed units (apply sets it)
        # backward fusion's streaming: the units in the order backward completes them, the next to fetch,
        # the copies in flight and the last unit stepped (its copy back and device state, freed at the next)
        grads = unit_grads(graph)
        rank = {id(f): n for n, f in enumerate(graph.fused_backward)}
        self.after = {u: f.after for u, f in grads.items()}
        self.modules = {u: units[u].module or "the model" for u in range(len(units))}
        self.streamed_set = set(self.streamed)
        self.fetch_order = sorted((u for u in self.streamed if u in grads), key=lambda u: rank[id(grads[u])])
        self.fetch_next = 0
        self.fetched_any = False
        self.in_flight: dict[int, list] = {}
        self.back: tuple[int, list] | None = None
        self.back_copies = device.copy_stream() if self.streamed else None
        self.log: list = []
        self._hook = optimizer.register_load_state_dict_post_hook(lambda _opt: self.to_host(self.streamed))
        # a checkpoint reads the pool on the host: the copies back into it must have landed (on a GPU the
        # host runs ahead of the copy stream)
        self._sync = optimizer.register_state_dict_pre_hook(lambda _opt: self.copies.drain())

    # ---- where a unit's state lives ------------------------------------------------------------------
    def _entries(self, u: int) -> list[tuple[nn.Parameter, str]]:
        return unit_state_tensors(self.optimizer, self.groups[u])

    def _host_views(self, u: int) -> list[torch.Tensor]:
        """Views of unit ``u``'s slot laid out like its state tensors now (each at a multiple of
        ``STATE_ALIGN`` bytes); :class:`PlanMismatch` if they do not fit the slot the graph sized."""
        start, n = self.slots[u]
        views, at = [], 0
        for p, key in self._entries(u):
            t = self.optimizer.state[p][key]
            nbytes = t.numel() * t.element_size()
            if at + nbytes > n:
                raise PlanMismatch(f"the optimizer state of {self.groups[u][0].shape}-shaped parameters in unit {u} "
                                   f"needs more than the {n} B the graph recorded for it: re-profile")
            chunk = self.pool[start + at:start + at + nbytes]
            views.append(chunk.view(t.dtype).view(t.shape) if t.dim() else chunk.view(t.dtype).view(()))
            at += -(-nbytes // STATE_ALIGN) * STATE_ALIGN
        return views

    def _on_host(self, u: int) -> bool:
        entries = self._entries(u)
        return bool(entries) and all(self._is_slot(self.optimizer.state[p][k]) for p, k in entries)

    def _is_slot(self, t: torch.Tensor) -> bool:
        return self.pool is not None and t.untyped_storage().data_ptr() == self.pool.untyped_storage().data_ptr()

    def _fetch(self, u: int, log: bool = True) -> list[Any]:
        """Unit ``u``'s state from its slot into new device buffers (allocated on the compute stream, filled
        on the copy stream); the state entries point at the buffers from now. Returns the copies."""
        copies = []
        if not self._on_host(u):
            return copies  # its first step (no state yet), or already on the device (a failed step's)
        if log:
            self.log.append(ScheduleEvent("h2d", "optimizer", u, reason="optimizer state streamed in"))
        for (p, key), host in zip(self._entries(u), self._host_views(u), strict=True):
            dst = torch.empty_like(host, device=p.device)  # on the compute stream
            copies.append(self.copies.to_device(tensor_bytes(dst), tensor_bytes(host)))
            self.optimizer.state[p][key] = dst
        return copies

    def _store(self, u: int) -> None:
        """Copy unit ``u``'s device state back to its slot, wait for the copy, and point the state at the slot:
        the device buffers go with their last reference."""
        entries = [(p, k) for p, k in self._entries(u) if not self._is_slot(self.optimizer.state[p][k])]
        if not entries:
            return
        views = self._host_views(u)
        copies = []
        for (p, key), host in zip(self._entries(u), views, strict=True):
            src = self.optimizer.state[p][key]
            if self._is_slot(src):
                continue
            copies.append((self.copies.to_host(tensor_bytes(host), tensor_bytes(src)), src))
        self.log.append(ScheduleEvent("d2h", "optimizer", u, reason="optimizer state copied back"))
        for copy, _src in copies:
            copy.wait()  # the source stays referenced until its copy is known complete
        for (p, key), host in zip(self._entries(u), views, strict=True):
            self.optimizer.state[p][key] = host

    def hosted_params(self) -> list[nn.Parameter]:
        """The parameters of the host-stepped units: stepped on the host, never by fusion."""
        hosted = self.hoststep.hosted if self.hoststep is not None else []
        return [p for u in hosted for p in self.groups[u]]

    # ---- inside backward (backward fusion) --------------------------------------------------------------
    def fused_bucket(self, b: int, step: Any) -> None:
        """Backward fusion steps bucket ``b`` (= state unit ``b``), in the schedule's order: the first bucket
        fetches the first streamed unit's state; a streamed unit's step frees the last one's device state
        (after its copy back), fetches the next one's, waits for its own, steps, and copies it back."""
        at = self.after[b]
        if not self.fetched_any:
            self.fetched_any = True
            self._fetch_next(at)
        if b not in self.streamed_set:
            step()
            return
        self._release_back("backward", at)
        self._fetch_next(at)
        for c in self.in_flight.pop(b, []):
            c.wait()
        step()
        self.back = (b, self._copy_back(b, at))

    def _fetch_next(self, at: int) -> None:
        if self.fetch_next >= len(self.fetch_order):
            return
        u = self.fetch_order[self.fetch_next]
        self.fetch_next += 1
        if self._on_host(u):
            self.log.append(ScheduleEvent("h2d", "backward", at, reason=f"{STATE_IN} ({self.modules[u]})"))
        self.in_flight[u] = self._fetch(u, log=False)

    def _copy_back(self, u: int, at: int) -> list:
        """Unit ``u``'s device state copied to its slot on the copy stream back (not waited for)."""
        copies = []
        for (p, key), host in zip(self._entries(u), self._host_views(u), strict=True):
            src = self.optimizer.state[p][key]
            if not self._is_slot(src):
                copies.append((self.back_copies.to_host(tensor_bytes(host), tensor_bytes(src)), p, key, host, src))
        self.log.append(ScheduleEvent("d2h", "backward", at, reason=f"{STATE_BACK} ({self.modules[u]})"))
        return copies

    def _release_back(self, phase: str, at: int | None) -> None:
        """Compute waits for the last stepped unit's copy back; its state is the slot's from now."""
        if self.back is None:
            return
        _u, copies = self.back
        self.back = None
        for copy, p, key, host, _src in copies:
            copy.wait()
            self.optimizer.state[p][key] = host
        if phase == "backward":
            self.log.append(ScheduleEvent("free", phase, at, reason=STATE_RELEASED))

    def _end_backward_streaming(self) -> None:
        """At ``optimizer.step()``: the last unit's state released; any state a failed backward fetched and
        never stepped goes back to its slot; the next backward fetches from the first unit again."""
        self._release_back("optimizer", None)
        for copies in list(self.in_flight.values()):
            for c in copies:
                c.wait()
        self.in_flight.clear()
        self.to_host(self.streamed)
        self.fetch_next = 0
        self.fetched_any = False

    def to_host(self, units: list[int]) -> None:
        """Move ``units``' state to their slots now (after a ``load_state_dict``)."""
        for u in units:
            self._store(u)

    # ---- the step ---------------------------------------------------------------------------------------
    def step(self, real_step: Any, closure: Any = None, log: list | None = None) -> Any:
        """``optimizer.step()`` under the plan: the resident units, then each streamed unit through the device
        (the module docstring's order). ``real_step`` is the optimizer's own step; ``log`` (the step's record)
        receives each unit's copies as the schedule names them (a unit's first step has no copy in: its
        state is created on the device)."""
        self.log = log if log is not None else []
        loss = None
        if closure is not None:  # Lightning's: the training step and its backward, run first (as torch does)
            with torch.enable_grad():
                loss = closure()
        self.steps += 1
        if self.hoststep is not None:
            self.hoststep.log = self.log
            self.hoststep.before_step()
        try:
            self._device_updates(real_step)
        except BaseException:
            if self.hoststep is not None:  # the host units after the failure are not stepped (as plain
                self.hoststep.abandon()    # training's would not be): the next backward starts clean
            raise
        if self.hoststep is not None:
            self.hoststep.step(real_step)
        return loss

    def _device_updates(self, real_step: Any) -> None:
        """The resident units' update, then each streamed unit's through the device (unfused); under backward
        fusion, what backward's streaming left."""
        if self.fused:  # backward fusion stepped the resident and streamed units
            self._end_backward_streaming()
            return
        if self.resident:
            with narrowed_groups(self.optimizer, self.resident), torch.no_grad():
                real_step()
        todo = self.streamed
        try:
            pending = self._fetch(todo[0]) if todo else []
            for i, u in enumerate(todo):
                for c in pending:
                    c.wait()  # compute waits for the unit's state (exposed copy time)
                pending = self._fetch(todo[i + 1]) if i + 1 < len(todo) else []
                with narrowed_groups(self.optimizer, self.groups[u]), torch.no_grad():
                    real_step()
                self._store(u)
        finally:
            # a step that raised part-way: every state on the device (fetched, or created) goes to its slot
            for c in pending if todo else []:
                c.wait()
            self.to_host(todo)

    def remove(self) -> None:
        """Every streamed state back on its parameter's device (plain training from here on)."""
        self._hook.remove()
        self._sync.remove()
        if self.hoststep is not None:
            self.hoststep.remove()
        for u in self.streamed:
            for p, key in self._entries(u):
                t = self.optimizer.state[p][key]
                if self._is_slot(t):
                    self.optimizer.state[p][key] = t.to(p.device, copy=True)
        self.pool = None

