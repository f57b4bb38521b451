"""Fused optimizer steps ("optimizer fusion", Jiang et al., arXiv 2104.00237).

* **backward** fusion: the parameters of one module (a bucket) are stepped as soon as all their gradients
  are final in the last micro-batch's backward (``register_post_accumulate_grad_hook``), and their
  gradients are freed at once. The training loop's ``optimizer.step()`` then only steps what backward did
  not reach (parameters without a gradient are skipped by every torch optimizer). A training forward
  after a stepping backward and before ``optimizer.step()`` (undeclared accumulation) and gradient
  clipping after such a backward are refused (executor/apply.py guards the clip functions).
* **forward** fusion: ``optimizer.step()`` only takes the gradients (so that ``zero_grad`` does not touch
  them); each bucket's update is applied just before its module's next forward (a forward pre-hook), and
  its gradients are freed then, or when the model's or the optimizer's ``state_dict()`` is read (a
  checkpoint saved between steps) or ``torch.optim.swa_utils.AveragedModel`` averages the model (EMA,
  SWA). Global information (the gradient norm) is available at ``step()``, so ``max_grad_norm`` clipping
  works. ``flush()`` applies what is still pending (before evaluation, saving,
  or comparing parameters). A deferred update that fails stays pending and is applied by the retry.

A bucket is stepped by the user's optimizer itself, its parameter groups narrowed to the bucket for the
call: the same hyper-parameters, state, foreach/fused kernels per group, and per-parameter arithmetic, so
the parameters are those of plain training. Supported: SGD (with or without momentum), Adam, AdamW.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from memplan.planner.core.errors import MemplanError
from memplan.planner.core.graph import FUSE_MODES

SUPPORTED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def buckets(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[
        list[list[nn.Parameter]], dict[nn.Parameter, int], dict[nn.Module, list[int]]]:
    """The buckets fusion steps: each module's own parameters that ``optimizer`` steps and that require a
    gradient, in ``model.modules()`` order, a parameter in the first module that owns it (tied ones). Returns
    the buckets, each parameter's bucket, and each owning module's buckets (a tied parameter's bucket is
    applied before the forward of any module that owns it). The profiler records where backward completes
    each (:class:`memplan.planner.core.graph.FusedStep`) with the same rule."""
    in_opt = {p for g in optimizer.param_groups for p in g["params"]}
    bucket_of: dict[nn.Parameter, int] = {}
    out: list[list[nn.Parameter]] = []
    module_buckets: dict[nn.Module, list[int]] = {}
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if p in in_opt and p.requires_grad]
        fresh = [p for p in own if p not in bucket_of]
        if fresh:
            for p in fresh:
                bucket_of[p] = len(out)
            out.append(fresh)
        if own:
            module_buckets[module] = sorted({bucket_of[p] for p in own})
    return out, bucket_of, module_buckets


def bucket_modules(model: nn.Module, module_buckets: dict[nn.Module, list[int]], n: int) -> list[str]:
    """The path of the module that owns each of the ``n`` buckets :func:`buckets` made (its first owner)."""
    names = [""] * n
    named = [False] * n
    for path, module in model.named_modules():
        for b in module_buckets.get(module, ()):
            if not named[b]:
                names[b], named[b] = path, True
    return names


class FusedOptimizer:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, mode: str, *,
                 accumulation_steps: int = 1, max_grad_norm: float | None = None,
                 exclude: Iterable[nn.Parameter] = ()):
        if mode not in FUSE_MODES:
            raise MemplanError(f"fuse={mode!r}: expected one of {', '.join(FUSE_MODES)} or None")
        if not isinstance(optimizer, SUPPORTED):
            raise MemplanError(f"optimizer fusion supports SGD, Adam and AdamW; got {type(optimizer).__name__}")
        if accumulation_steps < 1:
            raise MemplanError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
        if mode == "backward" and max_grad_norm is not None:
            raise MemplanError("global-norm gradient clipping cannot run in backward fusion: each parameter is "
                               "stepped before the other gradients exist; use fuse='forward' (it clips at "
                               "optimizer.step()) or no fusion")
        self.model = model
        self.optimizer = optimizer
        self.mode = mode
        self.accumulation_steps = accumulation_steps
        self.max_grad_norm = max_grad_norm
        self.micro = -1                                   # micro-batch index of the running forward
        in_opt = {p for g in optimizer.param_groups for p in g["params"]}
        self.buckets, self.bucket_of, self.module_buckets = buckets(model, optimizer)
        # parameters stepped elsewhere (a plan's model states off the device, executor/states.py): never
        # stepped here, in backward or at step()
        self.excluded = {id(p) for p in exclude}
        # what steps a bucket when backward completes it: ``around(bucket, step)`` runs ``step`` (a plan's
        # streamed state fetched around it, executor/states.py); None: the step alone
        self.around: Any = None
        missing = [p for p in in_opt if p not in self.bucket_of and p.requires_grad]
        if missing:
            raise MemplanError(f"optimizer fusion: {len(missing)} optimizer parameter(s) belong to no module of "
                               f"the model (first shape {list(missing[0].shape)}); fuse only the model's own")
        self.ready = [0] * len(self.buckets)
        # backward fusion: a backward stepped the model and the loop's optimizer.step() has not come since
        self.stepped_in_backward = False
        # backward fusion: the running backward reached a parameter (its end is queued on autograd's engine),
        # and whether that backward ran to its end: a backward that raised (an OOM, a fault in a hook,
        # KeyboardInterrupt) never runs the engine's final callbacks
        self.backward_seen = False
        self.backward_ended = False
        self.pending: dict[nn.Parameter, torch.Tensor] = {}   # forward fusion: parameter -> its gradient
        self.pending_settings: list[dict[str, Any]] | None = None  # the groups' settings at its step()
        self.pending_keys: set[int] = set()
        self.handles = []
        self._step = optimizer.step  # the real step (the executor shadows optimizer.step with user_step)
        if mode == "backward":
            for p in self.bucket_of:
                if id(p) not in self.excluded:
                    self.handles.append(p.register_post_accumulate_grad_hook(self._grad_ready))
            BACKWARD_STEPPERS.add(self)
        else:
            # a checkpoint saved between steps (``model.state_dict()``, ``optimizer.state_dict()``, what
            # torch.save and save_pretrained read) gets the updates of every step() so far, as in plain
            # training: they were one update behind, silently
            def flush_before_saving(*_args: Any) -> None:
                self.flush()

            for module in model.modules():
                self.handles.append(module.register_state_dict_pre_hook(flush_before_saving))
            self.handles.append(optimizer.register_state_dict_pre_hook(flush_before_saving))
            _FORWARD_FUSED.add(self)
            _flush_before_averaging()

    # ---- the training loop's calls ------------------------------------------------------------
    def begin_forward(self) -> None:
        if self.backward_seen and not self.backward_ended:
            # the last backward failed: its step is over. The buckets it stepped stay stepped (as with
            # PyTorch's optimizer-in-backward); this forward is that micro-batch again, not the next one
            self.stepped_in_backward = False
            self.micro -= 1
        elif self.stepped_in_backward:
            # plain training would add this micro-batch's gradients to the last one's before a step; backward
            # fusion has already applied and freed those (the last backward updated the model)
            raise MemplanError(accumulation_refused(self.accumulation_steps))
        self.backward_seen = self.backward_ended = False
        self.micro += 1
        self.ready = [0] * len(self.buckets)

    def _last_micro_batch(self) -> bool:
        return self.micro % self.accumulation_steps == self.accumulation_steps - 1

    def user_step(self, closure=None):
        """What the training loop's ``optimizer.step()`` does under fusion. A ``closure`` (Lightning's: the
        training step and its backward) runs first, as torch's optimizers run it, and its loss is returned."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.mode == "backward":
            self.stepped_in_backward = False
            if self.excluded:  # what backward did not step, but the parameters stepped elsewhere
                kept = [p for g in self.optimizer.param_groups for p in g["params"] if id(p) not in self.excluded]
                with narrowed_groups(self.optimizer, kept):
                    self._step()
            else:
                self._step()  # what backward did not step (parameters whose hook never fired)
            return loss
        self.flush()  # a step not followed by a forward yet: apply it before taking new gradients
        params = [p for p in self.bucket_of if p.grad is not None]
        if self.max_grad_norm is not None and params:
            torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        # the update is the one this step() makes: with the groups' settings of now, not of when it is applied
        # (an LR scheduler's step() in between would change the learning rate of the pending update)
        self.pending_settings = group_settings(self.optimizer)
        for p in params:  # keep the gradients away from zero_grad until the update is applied
            self.pending[p] = p.grad
            self.pending_keys.add(p.untyped_storage()._cdata)
            p.grad = None
        return loss

    # ---- backward fusion --------------------------------------------------------------------------
    def _grad_ready(self, p: torch.Tensor) -> None:
        if not self.backward_seen:
            self.backward_seen = True
            me = weakref.ref(self)
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_backward_ended, me))
        if not self._last_micro_batch():
            return
        b = self.bucket_of[p]
        self.ready[b] += 1
        if self.ready[b] == len(self.buckets[b]):
            self.stepped_in_backward = True
            if self.around is not None:
                self.around(b, functools.partial(self.step_params, self.buckets[b]))
            else:
                self.step_params(self.buckets[b])

    # ---- forward fusion ----------------------------------------------------------------------------
    def before_module(self, module: nn.Module) -> None:
        """Forward pre-hook work: apply the pending updates of the buckets ``module`` owns."""
        for b in self.module_buckets.get(module, ()):
            params = [p for p in self.buckets[b] if p in self.pending]
            if params:
                self._apply_pending(params)

    def _apply_pending(self, params: list[nn.Parameter]) -> None:
        """Apply the pending updates of ``params``. An update that fails (the optimizer raised) is not lost:
        its gradients go back to the pending list, out of ``zero_grad``'s reach, and the next forward of
        their module (a retry) or ``flush()`` applies it, so every bucket gets every update, as plain training
        whose step succeeded and whose next forward failed."""
        grads = {p: self.pending.pop(p) for p in params}
        for p, g in grads.items():
            p.grad = g
            self.pending_keys.discard(p.untyped_storage()._cdata)
        try:
            self.step_params(params, self.pending_settings)
        except BaseException:
            for p, g in grads.items():
                p.grad = None
                self.pending[p] = g
                self.pending_keys.add(p.untyped_storage()._cdata)
            raise

    def flush(self) -> None:
        """Apply every pending update now (forward fusion)."""
        if self.pending:
            self._apply_pending(list(self.pending))

    def check_not_pending(self, inputs: Iterable[torch.Tensor], op) -> None:
        for t in inputs:
            try:
                key = t.untyped_storage()._cdata
            except (RuntimeError, NotImplementedError):
                continue
            if key in self.pending_keys:
                raise MemplanError(f"forward fusion: op {op.id} ({op.name}, module {op.module or '?'}) reads a "
                                   f"parameter whose update is still pending: it is used outside the module that "
                                   f"owns it; use fuse='backward' or no fusion for this model")

    # ---- stepping a subset ------------------------------------------------------------------------
    def step_params(self, params: list[nn.Parameter], settings: list[dict[str, Any]] | None = None) -> None:
        """Step only ``params`` with the user's optimizer (its groups' ``settings`` for the call when given),
        then free their gradients."""
        with narrowed_groups(self.optimizer, params, settings), torch.no_grad():
            self._step()
        for p in params:
            p.grad = None

    def remove(self) -> None:
        self.flush()
        for h in self.handles:
            h.remove()
        self.handles = []
        _FORWARD_FUSED.discard(self)
        BACKWARD_STEPPERS.discard(self)

    @property
    def params(self) -> Iterable[nn.Parameter]:
        return self.bucket_of


def _backward_ended(fused: weakref.ref) -> None:
    """Autograd's final callback of a backward that reached a fused parameter: it ran to its end."""
    f = fused()
    if f is not None:
        f.backward_ended = True


_FORWARD_FUSED: weakref.WeakSet[FusedOptimizer] = weakref.WeakSet()  # forward fusions with updates to defer
# what steps parameters inside backward (a backward FusedOptimizer, DDP's comm-hook fusion): each has
# ``stepped_in_backward`` (its last backward stepped, and no optimizer.step() came since) and ``params``
BACKWARD_STEPPERS: weakref.WeakSet[Any] = weakref.WeakSet()


def _flush_before_averaging() -> None:
    """Guard ``torch.optim.swa_utils.AveragedModel.update_parameters`` (EMA and SWA), installed once: the
    model it averages from gets its pending forward-fused updates first. It reads the parameters directly,
    after ``optimizer.step()``: without the flush every average lagged one update behind plain training's."""
    from torch.optim.swa_utils import AveragedModel

    if getattr(AveragedModel.update_parameters, "_memplan_guard", False):
        return
    unguarded = AveragedModel.update_parameters

    def update_parameters(self, model):  # noqa: ANN001, ANN202 - AveragedModel's own signature
        pending = [f for f in list(_FORWARD_FUSED) if f.pending]
        if pending:
            params = {id(p) for p in model.parameters()}
            for fused in pending:
                if any(id(p) in params for p in fused.bucket_of):
                    fused.flush()
        return unguarded(self, model)

    update_parameters._memplan_guard = True  # type: ignore[attr-defined]
    update_parameters.__doc__ = unguarded.__doc__
    AveragedModel.update_parameters = update_parameters  # type: ignore[method-assign]


def accumulation_refused(accumulation_steps: int) -> str:
    """The refusal of a training forward after a backward that stepped the model, before optimizer.step()."""
    return (f"fuse='backward' stepped the model in the last backward, and a training forward began before "
            f"optimizer.step(): gradient accumulation? apply(..., accumulation_steps=N) with the loop's "
            f"micro-batches per step (now {accumulation_steps}), or fuse='forward' or no fusion")


def group_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """A copy of each parameter group's settings (everything but its parameters: learning rate, betas,
    weight decay...), tensors cloned (a scheduler updates a tensor learning rate in place)."""
    return [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in g.items() if k != "params"}
            for g in optimizer.param_groups]


@contextlib.contextmanager
def narrowed_groups(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor],
                    settings: list[dict[str, Any]] | None = None) -> Iterator[None]:
    """The optimizer's parameter groups narrowed to ``params`` for the block (each group keeps its
    hyper-parameters and state; emptied groups are skipped by every torch optimizer), restored after. With
    ``settings`` (:func:`group_settings` taken earlier) the groups also have those settings for the block,
    and their own again after it."""
    chosen = {id(p) for p in params}
    groups = optimizer.param_groups
    saved = [g["params"] for g in groups]
    own = [dict(g) for g in groups] if settings is not None else None
    try:
        for i, g in enumerate(groups):
            g["params"] = [p for p in g["params"] if id(p) in chosen]
            if settings is not None and i < len(settings):
                g.update(settings[i])
        yield
    finally:
        for i, (g, ps) in enumerate(zip(groups, saved, strict=True)):
            if own is not None:
                g.clear()
                g.update(own[i])
            g["params"] = ps


@contextlib.contextmanager
def fused_training(model: nn.Module, optimizer: torch.optim.Optimizer, mode: str) -> Iterator[FusedOptimizer]:
    """Plain training loops under fused optimizer steps, without a plan: the root's forward pre-hook starts
    each step (and, in forward fusion, every module's applies its pending updates) and ``optimizer.step``
    is the fused one (:meth:`FusedOptimizer.user_step`). What the profiler times to learn what fusion costs
    here (``Graph.fused_extra_s``); the executor wires the same calls into its own step. On exit the pending
    updates are applied and everything is removed."""
    fused = FusedOptimizer(model, optimizer, mode)

    def begin(module: nn.Module, _args: Any) -> None:  # a pre-hook's return value would replace the args
        fused.begin_forward()
        fused.before_module(module)

    def before(module: nn.Module, _args: Any) -> None:
        fused.before_module(module)

    handles = [model.register_forward_pre_hook(begin)]
    if mode == "forward":
        handles += [m.register_forward_pre_hook(before) for m in fused.module_buckets if m is not model]
    shadowed = optimizer.__dict__.get("step")
    optimizer.step = fused.user_step  # an instance attribute shadows the class's step
    try:
        yield fused
    finally:
        try:
            fused.remove()
        finally:
            if shadowed is None:
                del optimizer.step
            else:
                optimizer.step = shadowed
            for h in handles:
                h.remove()
