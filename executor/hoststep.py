"""Host-stepped units at run time: their optimizer runs on the host (the cost model is
planner/core/states.py; the order of copies and frees below is exactly the one it scores).

Each host-stepped unit owns a slot of one pinned host pool: its optimizer state, a host copy of its
gradients and a host copy of its parameters. Between steps ``optimizer.state[p]`` of its parameters are
views of the state slot, so ``optimizer.state_dict()`` and ``load_state_dict()`` see and set the real state.

* **backward**: when autograd has accumulated the last gradient of a unit (each parameter's post-accumulate
  hook), the gradients are copied to the host slot on a copy stream of their own (the other direction's:
  it never waits behind the activations' prefetches); at that moment the device gradients of earlier units
  whose copies the schedule says have ended are freed (compute waits for those copies' events, then
  ``p.grad`` is dropped): ``Schedule.grads_released``, wherever the host's clock is, so the step's memory is
  the schedule's;
* **optimizer.step()**: the rest of the device gradients are freed after their copies; the device's updates
  (resident and streamed units) are issued; then the host steps each unit: it waits for the unit's
  gradient copies, runs the user's optimizer, its groups narrowed to the unit's host parameters (the same
  optimizer, its arithmetic on CPU tensors), and queues the updated parameters' copy into the device
  parameters on the activations' copy stream; compute waits for those copies before ``step()`` returns;
* the host copy of a parameter is refreshed from the device where the parameter was written since the last
  step (its version counter moved: ``load_state_dict`` on the model, an in-place edit), so the host never
  steps stale weights.

Gradient clipping with torch's functions works (``clip_grad_norm_``, ``clip_grad_value_``,
``clip_grads_with_norm_``, through executor/apply.py's guard): while a plan with host-stepped units is
applied, they see each host-stepped parameter's host gradient in its place (the norm is taken over both
devices, the clipping scales the host copies). ``torch.amp.GradScaler`` is refused in one line (its
``unscale_`` and inf check would not see the host gradients). Gradient accumulation (a second backward before
``optimizer.step()``) is refused in one line: the device gradients it would add to are gone.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from memplan.executor.recipes import tensor_bytes
from memplan.planner.core.errors import PlanError
from memplan.planner.core.graph import Graph
from memplan.planner.core.schedule import ScheduleEvent
from memplan.planner.core.states import GRADS_RELEASED, GRADS_TO_HOST, STATE_ALIGN, slot_bytes, unit_grads
from memplan.planner.probe.device import Device, Transfer
from memplan.planner.probe.fusion import narrowed_groups


class HostStepper:
    """The host-stepped units: their host pool, the gradients' hooks and the host's optimizer steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, graph: Graph, groups: list[list[nn.Parameter]],
                 hosted: list[int], released: dict[int, int | None], device: Device, copies: Any):
        self.optimizer = optimizer
        self.device = device
        self.copies = copies  # the activations' stream: the parameters' copies back
        self.grad_copies = device.copy_stream()  # the gradients' copies to the host
        self.hosted = list(hosted)
        self.groups = groups
        units = graph.state_units
        grads = unit_grads(graph)
        self.after = {u: grads[u].after for u in hosted}
        self.modules = {u: units[u].module or "the model" for u in hosted}
        # where each unit's device gradients go: at the completion of which unit (None: at optimizer.step())
        self.release_at: dict[int | None, list[int]] = {}
        for u in hosted:
            self.release_at.setdefault(released.get(u), []).append(u)
        at = 0
        self.slots: dict[int, tuple[int, int, int, int]] = {}  # unit -> (state, grads, params, end) offsets
        for u in hosted:
            state = slot_bytes(units[u].state_bytes, units[u].state_tensors)
            tensors = slot_bytes(units[u].param_bytes, units[u].params)
            self.slots[u] = (at, at + state, at + state + tensors, at + state + 2 * tensors)
            at += state + 2 * tensors
        self.bytes = at
        self.pool = device.pinned_empty(at) if at else None
        self.host_params: dict[int, list[torch.Tensor]] = {}
        self.host_grads: dict[int, list[torch.Tensor]] = {}
        for u in hosted:
            self.host_params[u] = self._tensor_views(u, self.slots[u][2], what="parameters")
            self.host_grads[u] = self._tensor_views(u, self.slots[u][1], what="gradients")
        self.versions: dict[int, int] = {}
        self.unit_of: dict[int, int] = {id(p): u for u in hosted for p in groups[u]}
        self.seen: dict[int, set[int]] = {u: set() for u in hosted}  # this backward's accumulated parameters
        self.pending: dict[int, list[tuple[Transfer, torch.Tensor]]] = {}  # unit -> its gradients' copies
        self.copied: dict[int, set[int]] = {}  # unit -> its parameters whose host gradient holds this backward's
        self.log: list = []
        self._refresh(self.hosted, force=True)
        for u in hosted:
            self._store_state(u)
        me = weakref.ref(self)
        self._handles = [p.register_post_accumulate_grad_hook(functools.partial(_accumulated, me))
                         for u in hosted for p in groups[u]]
        self._handles.append(optimizer.register_load_state_dict_post_hook(
            lambda _opt: [s._store_state(u) for s in [me()] if s is not None for u in s.hosted]))
        self._handles.append(optimizer.register_state_dict_pre_hook(lambda _opt: self.grad_copies.drain()))
        _ACTIVE.append(me)

    # ---- the pool ----------------------------------------------------------------------------------------
    def _tensor_views(self, u: int, start: int, what: str) -> list[torch.Tensor]:
        """Views of the pool from ``start`` shaped as unit ``u``'s parameters, each at a multiple of
        ``STATE_ALIGN`` bytes."""
        views, at = [], start
        end = self.slots[u][2] if what == "gradients" else self.slots[u][3]
        for p in self.groups[u]:
            n = p.numel() * p.element_size()
            if at + n > end:
                raise PlanError(f"the {what} of unit {u} ({self.modules[u]}) need more host bytes than the graph "
                                f"recorded for them: re-profile")
            views.append(self.pool[at:at + n].view(p.dtype).view(p.shape))
            at += -(-n // STATE_ALIGN) * STATE_ALIGN
        return views

    def _is_slot(self, t: torch.Tensor) -> bool:
        return self.pool is not None and t.untyped_storage().data_ptr() == self.pool.untyped_storage().data_ptr()

    def _store_state(self, u: int) -> None:
        """Unit ``u``'s optimizer state into its slot (from the device after a ``load_state_dict``, or from
        where the host's first step created it); the entries then point at the slot."""
        start, end = self.slots[u][0], self.slots[u][1]
        at = start
        for p in self.groups[u]:
            for key, value in list(self.optimizer.state.get(p, {}).items()):
                if not isinstance(value, torch.Tensor) or not (value.device == p.device or value.dim() > 0):
                    continue  # a host scalar (a GPU Adam's step counter): it stays where it is, as the graph has it
                n = value.numel() * value.element_size()
                if at + n > end:
                    raise PlanError(f"the optimizer state of unit {u} ({self.modules[u]}) needs more than the "
                                    f"{end - start} B the graph recorded for it: re-profile")
                chunk = self.pool[at:at + n]
                view = chunk.view(value.dtype).view(value.shape) if value.dim() else chunk.view(value.dtype).view(())
                if view.data_ptr() != value.data_ptr():
                    self.copies.to_host(tensor_bytes(view), tensor_bytes(value)).synchronize()
                self.optimizer.state[p][key] = view
                at += -(-n // STATE_ALIGN) * STATE_ALIGN

    def _refresh(self, units: list[int], force: bool = False) -> None:
        """The host copies of ``units``' parameters from the device where a parameter was written since the
        host last wrote it (or ``force``)."""
        for u in units:
            for p, hp in zip(self.groups[u], self.host_params[u], strict=True):
                if force or self.versions.get(id(p)) != p._version:
                    self.copies.to_host(tensor_bytes(hp), tensor_bytes(p.detach())).synchronize()
                    self.versions[id(p)] = p._version

    # ---- backward ----------------------------------------------------------------------------------------
    def accumulated(self, p: nn.Parameter) -> None:
        u = self.unit_of[id(p)]
        seen = self.seen[u]
        if not seen and u in self.copied:
            raise PlanError(f"a second backward before optimizer.step(): the plan steps {len(self.hosted)} units' "
                            f"optimizer on the host ({self.modules[u]} among them), whose gradients leave the "
                            f"device during backward, so gradient accumulation cannot add to them; plan with "
                            f"states='stream' (--states-on stream) to accumulate")
        seen.add(id(p))
        if len(seen) == len(self.groups[u]):
            seen.clear()
            self._complete(u)

    def _complete(self, u: int) -> None:
        """Backward has completed unit ``u``'s gradients: their copies to the host, then the device gradients
        the schedule frees here."""
        self._copy_grads(u)
        self.log.append(ScheduleEvent("d2h", "backward", self.after[u], reason=f"{GRADS_TO_HOST} ({self.modules[u]})"))
        for v in self.release_at.get(u, ()):
            self._release(v)
            self.log.append(ScheduleEvent("free", "backward", self.after[u], reason=GRADS_RELEASED))

    def _copy_grads(self, u: int) -> None:
        copies, copied = [], set()
        for p, hg in zip(self.groups[u], self.host_grads[u], strict=True):
            if p.grad is not None:
                copies.append((self.grad_copies.to_host(tensor_bytes(hg), tensor_bytes(p.grad)), p.grad))
                copied.add(id(p))
        self.pending[u] = copies
        self.copied[u] = copied

    def _release(self, u: int) -> None:
        """Compute waits for unit ``u``'s gradient copies; its device gradients go."""
        for copy, _grad in self.pending.get(u, ()):
            copy.wait()  # the gradient stays referenced until its copy is ordered before any reuse
        for p in self.groups[u]:
            p.grad = None
        self.pending[u] = []

    # ---- the step ----------------------------------------------------------------------------------------
    def before_step(self) -> None:
        """At ``optimizer.step()``, before the device's updates: the gradients backward did not complete a
        unit of (a parameter without one) copied now, and every device gradient still held freed after its
        copy."""
        for u in self.hosted:
            if self.seen[u] and u not in self.pending:
                self._copy_grads(u)  # part of the unit had gradients: copied as they are
        for u in self.release_at.get(None, ()):
            self._release(u)
        for u in self.hosted:  # a unit released at another's completion that never came
            if self.pending.get(u):
                self._release(u)

    def step(self, real_step: Any) -> None:
        """Each unit's optimizer on the host, in the plan's order, its parameters copied back after it."""
        back: list[Transfer] = []
        try:
            for u in self.hosted:
                if u not in self.copied:
                    continue  # no gradient this step: plain training's step skips its parameters
                for copy, _ in self.pending.pop(u, ()):
                    copy.synchronize()
                self._refresh([u])
                try:
                    self._host_step(u, real_step)
                finally:  # a step that raised part-way: what it updated on the host reaches the device too
                    for p, hp in zip(self.groups[u], self.host_params[u], strict=True):
                        if id(p) in self.copied[u]:
                            back.append(self.copies.to_device(tensor_bytes(p.detach()), tensor_bytes(hp)))
                self.log.append(ScheduleEvent("h2d", "optimizer", u, reason="updated parameters copied back"))
        finally:
            for t in back:
                t.wait()  # the next forward reads the parameters
            self.abandon()

    def abandon(self) -> None:
        """This step's gradients are done with (stepped, or a step that failed before reaching them): the next
        backward starts clean."""
        self.copied.clear()
        self.pending.clear()
        for s in self.seen.values():
            s.clear()

    def zero_grad(self) -> None:
        """``optimizer.zero_grad()``: the host gradients of a backward not stepped are dropped too."""
        self.before_step()
        self.abandon()

    def _host_step(self, u: int, real_step: Any) -> None:
        """The user's optimizer on unit ``u``'s host parameters: its state entries keyed by the host
        parameters for the call, by the device parameters again after it (and moved into the slot where the
        call created them)."""
        state = self.optimizer.state
        params = self.groups[u]
        hosts = self.host_params[u]
        stepped = []
        for p, hp, hg in zip(params, hosts, self.host_grads[u], strict=True):
            if id(p) in self.copied[u]:
                hp.grad = hg
                stepped.append(hp)
            if p in state:
                state[hp] = state.pop(p)
        try:
            with self.device.host_side(), _swapped(self.optimizer, dict(zip(map(id, params), hosts, strict=True))), \
                    narrowed_groups(self.optimizer, stepped), torch.no_grad():
                real_step()
        finally:
            created = False
            for p, hp in zip(params, hosts, strict=True):
                hp.grad = None
                if hp in state:
                    created = created or any(isinstance(v, torch.Tensor) and not self._is_slot(v)
                                             for v in state[hp].values())
                    state[p] = state.pop(hp)
            if created:
                self._store_state(u)
            for p in params:
                self.versions[id(p)] = p._version

    # ---- clipping --------------------------------------------------------------------------------------------
    def stand_ins(self, parameters: Any) -> Any:
        """``parameters`` with each host-stepped parameter whose gradient is on the host replaced by its host
        copy carrying that gradient (after the copy has landed), for :func:`torch.nn.utils.clip_grad_norm_`."""
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        out = []
        for p in parameters:
            u = self.unit_of.get(id(p))
            if u is None or id(p) not in self.copied.get(u, ()):
                out.append(p)
                continue
            for copy, _ in self.pending.get(u, ()):
                copy.synchronize()
            i = next(k for k, q in enumerate(self.groups[u]) if q is p)
            hp = self.host_params[u][i]
            hp.grad = self.host_grads[u][i]
            out.append(hp)
        return out

    def remove(self) -> None:
        """Every state back on its parameter's device; the hooks go (plain training from here on)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for u in self.hosted:
            for p in self.groups[u]:
                for key, t in list(self.optimizer.state.get(p, {}).items()):
                    if isinstance(t, torch.Tensor) and self._is_slot(t):
                        self.optimizer.state[p][key] = t.to(p.device, copy=True)
        self.pool = None
        _ACTIVE[:] = [r for r in _ACTIVE if r() is not None and r() is not self]


@contextlib.contextmanager
def _swapped(optimizer: torch.optim.Optimizer, hosts: dict[int, torch.Tensor]) -> Iterator[None]:
    """The optimizer's groups with each device parameter in ``hosts`` replaced by its host copy."""
    groups = optimizer.param_groups
    saved = [g["params"] for g in groups]
    try:
        for g in groups:
            g["params"] = [hosts.get(id(p), p) for p in g["params"]]
        yield
    finally:
        for g, ps in zip(groups, saved, strict=True):
            g["params"] = ps


def _accumulated(me: weakref.ref, p: nn.Parameter) -> None:
    stepper = me()
    if stepper is not None:
        stepper.accumulated(p)



_ACTIVE: list[weakref.ref] = []  # the applied host steppers, for torch's clipping functions


def host_stand_ins(parameters: list[torch.Tensor]) -> list[torch.Tensor]:
    """``parameters`` as torch's clipping functions should see them while host steppers are applied: each
    host-stepped parameter whose gradient is on the host replaced by its host copy carrying it
    (executor/apply.py's guard on ``clip_grad_norm_``, ``clip_grad_value_``, ``clip_grads_with_norm_``)."""
    for ref in list(_ACTIVE):
        stepper = ref()
        if stepper is not None:
            parameters = stepper.stand_ins(parameters)
    return parameters

