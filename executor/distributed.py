"""A plan applied under ``torch.distributed``: DDP and FSDP2 (``fully_shard``).

    ddp = DistributedDataParallel(model)
    ex = memplan.executor.distributed.apply_distributed(ddp, plan, graph=graph, optimizer=opt, fuse=...)
    for batch in data:                       # the loop does not change
        opt.zero_grad(set_to_none=True)
        loss_fn(ddp, batch).backward()
        opt.step()
    ex.remove()

The plan is profiled and solved on the bare module with one rank's batch; every rank applies the same plan
(the op sequence of a rank's step is the bare module's).

* **DDP**: the executor is applied to ``ddp.module`` (the module DDP runs); DDP's own work (buffer
  broadcast, bucket rebuilds) runs outside the module's forward and is never counted. Forward fusion
  needs nothing more: ``optimizer.step()`` takes gradients after DDP has averaged them, and each update is
  applied before its module's next forward. Backward fusion is moved from AccumulateGrad (which fires
  before the allreduce) to a DDP communication hook: each bucket is allreduced (``allreduce_hook``: divide
  by the world size, then sum, as DDP does without a hook) and, once the allreduce future completes, its
  parameters are stepped with the averaged gradients. Under ``no_sync()`` DDP calls no hook, and a synced
  micro-batch that is not the last of ``accumulation_steps`` steps nothing. DDP then copies each bucket
  back into ``.grad``; ``optimizer.step()`` drops the gradients of what the hook stepped and steps the rest.
* **FSDP2**: the executor is applied to the root ``fully_shard``-ed module. FSDP's forward hooks
  (all-gather, reshard, backward-hook registration) run as the executor's own work, so their ops are not
  matched against the graph and the unsharded parameters they produce are first seen as inputs of model
  ops: like every parameter, they are never offloaded or recomputed (``DTensor`` shards have no storage
  of their own to the executor). Recompute replays single ops, so a replay never spans FSDP units.
  Backward fusion steps each module's sharded parameters once FSDP2's reduce-scatter has given them their
  averaged shard gradients: FSDP2 calls the sharded parameters' post-accumulate-grad hooks right after it
  sets ``.grad`` (``foreach_reduce``), and those are the hooks the single-process fusion registers (on
  ``model.parameters()``, which are the shards; autograd itself never accumulates into them). With
  ``set_requires_gradient_sync(False)`` FSDP2 reduces nothing and calls no hook; a synced micro-batch
  that is not the last of ``accumulation_steps`` steps nothing. The root's parameters are stepped in
  FSDP2's final backward callback. Forward fusion is refused: FSDP2 all-gathers a unit's shards in its
  pre-forward, before any update could be applied.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memplan.executor.apply import Executor, apply, refuse_clipping_after_fused_backward
from memplan.planner.core.errors import MemplanError
from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Plan
from memplan.planner.probe.distributed import DistributedPlanError, cross_unit_recomputes
from memplan.planner.probe.fusion import BACKWARD_STEPPERS, SUPPORTED, accumulation_refused, narrowed_groups


class DistributedError(DistributedPlanError):
    """A distributed set-up the executor cannot run correctly (named in the message)."""


def engine_of(model: nn.Module) -> str:
    """``"ddp"``, ``"fsdp"`` (a root ``fully_shard``-ed module) or ``"none"``."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return "ddp"
    if isinstance(model, FSDPModule):
        return "fsdp"
    return "none"


class DistributedExecutor:
    """A plan applied to a DDP- or FSDP2-wrapped model. ``executor`` is the single-process
    :class:`Executor` underneath (its ``last_step``, ``host_pool_bytes``...)."""

    def __init__(self, model: nn.Module, plan: Plan | str | Path, *, graph: Graph | str | Path | None,
                 optimizer: torch.optim.Optimizer | None, fuse: str | None, accumulation_steps: int,
                 max_grad_norm: float | None):
        self.engine = engine_of(model)
        if self.engine == "none":
            raise DistributedError(f"apply_distributed expects a DistributedDataParallel or a fully_shard-ed "
                                   f"module, got {type(model).__name__}; use memplan.executor.apply")
        if accumulation_steps < 1:
            raise MemplanError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
        self.model = model
        self.optimizer = optimizer
        self._comm_fusion: _CommHookFusion | None = None
        self._unwrapped: list[tuple[dict, Any, Any]] = []
        self._handles: list[Any] = []
        if self.engine == "ddp":
            self._check_ddp(model, fuse, optimizer)
            inner_fuse = None if fuse == "backward" else fuse
            self.executor = apply(model.module, plan, graph=graph, optimizer=optimizer, fuse=inner_fuse,
                                  accumulation_steps=accumulation_steps, max_grad_norm=max_grad_norm)
            if fuse == "backward":
                self._comm_fusion = _CommHookFusion(model, optimizer, accumulation_steps)
            self._hide_ddp_post_forward()
        else:
            if fuse == "forward":
                raise DistributedError("fuse='forward' under FSDP2 is not supported: a unit's pending update would "
                                       "be applied after FSDP2 has all-gathered the unit's old shards (its "
                                       "pre-forward runs first); use fuse='backward' or fuse=None with fully_shard")
            # fuse="backward": the single-process fusion's post-accumulate-grad hooks sit on the sharded
            # parameters (model.parameters() under fully_shard), which autograd never accumulates into:
            # FSDP2 calls them itself, after the unit's reduce-scatter has set the averaged shard as .grad
            self.executor = apply(model, plan, graph=graph, optimizer=optimizer, fuse=fuse,
                                  accumulation_steps=accumulation_steps, max_grad_norm=max_grad_norm)
            try:
                self._check_units()
            except DistributedError:
                self.executor.remove()
                raise
            self._hide_fsdp_hooks()

    # ---- DDP -----------------------------------------------------------------------------------------
    @staticmethod
    def _check_ddp(ddp: nn.Module, fuse: str | None, optimizer: torch.optim.Optimizer | None) -> None:
        if getattr(ddp, "find_unused_parameters", False) or getattr(ddp, "static_graph", False):
            # both route the outputs through DDP's _DDPSink after the module's forward: ops the graph
            # of the bare module does not have
            raise DistributedError("DDP with find_unused_parameters=True or static_graph=True adds ops after "
                                   "the module's forward that the bare module's graph does not have; construct "
                                   "DistributedDataParallel with both False")
        if fuse == "backward":
            if optimizer is None:
                raise MemplanError("fuse='backward' needs the optimizer: apply_distributed(..., optimizer=opt)")
            if not isinstance(optimizer, SUPPORTED):
                raise MemplanError(f"optimizer fusion supports SGD, Adam and AdamW; got {type(optimizer).__name__}")
            if ddp.gradient_as_bucket_view:
                raise DistributedError("fuse='backward' under DDP with gradient_as_bucket_view=True is not "
                                       "supported yet (gradients alias the buckets the hook steps from)")

    def _hide_ddp_post_forward(self) -> None:
        """DDP's forward goes on after the module's (its post-forward, a profiler range's exit): those ops
        are DDP's, not the model's, so they run as the executor's own work until DDP's forward returns."""
        ex = self.executor
        hidden = [False]

        def after_module(_module, _args, _out):
            if ex.step_state is not None and not ex.busy:
                ex.busy = hidden[0] = True

        def after_ddp(_module, _args, _out):
            if hidden[0]:
                ex.busy = hidden[0] = False

        self._handles = [self.model.module.register_forward_hook(after_module),
                         self.model.register_forward_hook(after_ddp, always_call=True)]

    # ---- FSDP2 ---------------------------------------------------------------------------------------
    def _check_units(self) -> None:
        """Refuse a plan whose replays, in one unit's backward, would read another unit's parameters
        (resharded by then): keep_within_units() makes such a plan safe."""
        bad = cross_unit_recomputes(self.executor.graph, self.executor.plan, fsdp_prefixes(self.model))
        if bad:
            t, home, other = bad[0]
            raise DistributedError(
                f"under FSDP2, recomputing tensor {t} (first read in the backward of unit {home or '<root>'!r}) "
                f"replays ops of unit {other!r}, whose parameters are resharded by then; {len(bad)} recomputed "
                f"tensor(s) cross units: memplan.planner.probe.distributed.keep_within_units(graph, plan, prefixes) "
                f"keeps them instead")

    def _hide_fsdp_hooks(self) -> None:
        """Run every forward (pre-)hook that fully_shard registered as the executor's own work."""
        from torch.distributed.fsdp import FSDPModule

        ex = self.executor
        for module in self.model.modules():
            if not isinstance(module, FSDPModule):
                continue
            for hooks in (module._forward_pre_hooks, module._forward_hooks):
                for key, hook in list(hooks.items()):
                    if getattr(hook, "__self__", None) is ex or getattr(hook, "__func__", None) is Executor._begin:
                        continue
                    hooks[key] = _internal(ex, hook)
                    self._unwrapped.append((hooks, key, hook))

    # ---- public ------------------------------------------------------------------------------------------
    @property
    def last_step(self):
        return self.executor.last_step

    def flush(self) -> None:
        self.executor.flush()

    def remove(self) -> None:
        """Undo everything: the executor's hooks, the comm hook's optimizer wrapper, FSDP's hooks."""
        if self._comm_fusion is not None:
            self._comm_fusion.remove()
            self._comm_fusion = None
        for h in self._handles:
            h.remove()
        self._handles = []
        self.executor.remove()
        for hooks, key, hook in self._unwrapped:
            if key in hooks:
                hooks[key] = hook
        self._unwrapped = []

    def __enter__(self) -> DistributedExecutor:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def fsdp_prefixes(model: nn.Module) -> list[str]:
    """Module paths of the ``fully_shard``-ed submodules of ``model`` (the root excluded)."""
    from torch.distributed.fsdp import FSDPModule

    return [name for name, m in model.named_modules() if name and isinstance(m, FSDPModule)]


def _internal(ex: Executor, hook):
    @functools.wraps(hook)
    def run(*args, **kwargs):
        with ex.internal():
            return hook(*args, **kwargs)
    return run


class _CommHookFusion:
    """Backward-fused optimizer steps under DDP, after each bucket's allreduce (see the module doc)."""

    def __init__(self, ddp: nn.Module, optimizer: torch.optim.Optimizer, accumulation_steps: int):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self.optimizer = optimizer
        self.accumulation_steps = accumulation_steps
        self.micro = -1
        self.stepped: list[nn.Parameter] = []
        self.bucket_steps = 0  # buckets stepped inside backward (after their allreduce), over all steps
        self.lock = threading.Lock()  # gloo may complete futures on its own threads
        self._allreduce = allreduce_hook
        self._real_step = optimizer.step  # the executor's shadow (it ends the step, then steps)
        self._handle = ddp.module.register_forward_pre_hook(self._count)
        ddp.register_comm_hook(None, self._hook)
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        BACKWARD_STEPPERS.add(self)
        refuse_clipping_after_fused_backward()

        def step(closure=None):
            loss = None
            if closure is not None:  # Lightning's: the training step and its backward, run first (as torch does)
                with torch.enable_grad():
                    loss = closure()
            with self.lock:
                stepped, self.stepped = self.stepped, []
            for p in stepped:  # DDP copied the bucket back into .grad; these were already stepped
                p.grad = None
            self._real_step()
            return loss

        optimizer.step = step  # type: ignore[method-assign]
        self._shadow = step

    @property
    def stepped_in_backward(self) -> bool:
        """Buckets were stepped after their allreduce in the last backward, and no optimizer.step() came since."""
        return bool(self.stepped)

    def _count(self, module: nn.Module, _args) -> None:
        if module.training and torch.is_grad_enabled():
            if self.stepped:  # a micro-batch after a stepping backward: plain DDP would accumulate (as fusion.py)
                raise MemplanError(accumulation_refused(self.accumulation_steps))
            self.micro += 1

    def _last_micro_batch(self) -> bool:
        return self.micro % self.accumulation_steps == self.accumulation_steps - 1

    def _hook(self, state, bucket):
        fut = self._allreduce(state, bucket)  # divides by the world size, then sums: DDP's own arithmetic
        if not self._last_micro_batch():
            return fut

        def step_bucket(done):
            averaged = done.value()  # allreduce_hook's future yields the bucket
            params = bucket.parameters()
            grads = bucket.gradients()  # views of the bucket: the allreduced values
            with self.lock:
                self._step(params, [g.view_as(p) for g, p in zip(grads, params, strict=True)])
                self.stepped.extend(params)
                self.bucket_steps += 1
            return averaged

        return fut.then(step_bucket)

    def _step(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """Step ``params`` with the user's optimizer, their groups narrowed to them, on the bucket's
        averaged gradients (the parameters' own gradients are put back after)."""
        kept_grads = [p.grad for p in params]
        try:
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            with narrowed_groups(self.optimizer, params), torch.no_grad():
                type(self.optimizer).step(self.optimizer)
        finally:
            for p, g in zip(params, kept_grads, strict=True):
                p.grad = g

    def remove(self) -> None:
        self._handle.remove()
        BACKWARD_STEPPERS.discard(self)
        if self.optimizer.__dict__.get("step") is self._shadow:
            self.optimizer.step = self._real_step  # type: ignore[method-assign]


def apply_distributed(model: nn.Module, plan: Plan | str | Path, *, graph: Graph | str | Path | None = None,
                      optimizer: torch.optim.Optimizer | None = None, fuse: str | None = None,
                      accumulation_steps: int = 1, max_grad_norm: float | None = None) -> DistributedExecutor:
    """Apply ``plan`` (profiled and solved on the bare module with one rank's batch) to ``model``, a
    ``DistributedDataParallel`` or a root ``fully_shard``-ed module, on this rank.

    The arguments are those of :func:`memplan.executor.apply`. ``fuse="backward"`` under DDP steps each
    bucket after its allreduce (a communication hook; DDP must not have one already); under FSDP2 each
    module's shards after the unit's reduce-scatter (``fuse="forward"`` is refused there). Raises :class:`DistributedError` for a set-up the executor cannot run correctly, and what
    :func:`memplan.executor.apply` raises.
    """
    return DistributedExecutor(model, plan, graph=graph, optimizer=optimizer, fuse=fuse,
                               accumulation_steps=accumulation_steps, max_grad_norm=max_grad_norm)
