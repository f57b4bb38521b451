"""memplan inside PyTorch Lightning: one callback, no change to the LightningModule.

    from memplan.api.integrations.lightning import MemplanCallback
    trainer = lightning.Trainer(max_steps=1000, callbacks=[MemplanCallback(budget="50%")])
    trainer.fit(module, train_dataloaders=loader)

**Which step is profiled.** Lightning's own: the module's ``training_step(batch, batch_idx)`` on the
first training batch (after Lightning moved it to the device), its returned loss, backward and a twin of
the module's optimizer, with the parameters, gradients and random streams restored afterwards. So that a
plan's step begins where ``training_step`` begins (it may call ``self(x)`` or any submodule), the module's
``training_step`` is routed, for the fit, through a thin :class:`StepModule` whose forward calls it: the
executor counts the step's ops from there, as the profile did. The plan is solved, applied to the module
and its optimizer, and the first batch already runs under it.

**Prediction.** Lightning zeroes the gradients after ``training_step``, so the last step's live through
the forward: the predicted peak is the plan's plus the parameters' gradient bytes (an upper bound).

**Logs.** The budget, the predicted peak and (for the next batch, measured as memplan measures: CUDA's
allocator peak, on CPU the allocator's reports) the measured peak are logged with ``pl_module.log`` as
``memplan_budget_bytes``, ``memplan_predicted_peak_bytes`` and ``memplan_measured_peak_bytes``.

Automatic optimization with one optimizer, ``accumulate_grad_batches``, ``precision="bf16-mixed"`` (the
profile runs the step in the precision plugin's context, as Lightning does) and ``gradient_clip_val``
work with ``fuse=None``, and all but the clipping with ``fuse="backward"``; a module with
``automatic_optimization = False`` or several optimizers is refused in one line. ``self.log`` is silenced during the profile's steps; a ``training_step`` that logs before its
last model op runs ops the profile did not see, and is refused naming the op.

Requires the ``lightning`` extra (``pip install memplan[lightning]``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from memplan.api.integrations.common import PlannedCallback, StepPlanner
from memplan.planner.core.errors import MemplanError

try:
    import lightning.pytorch as pl
except ImportError as e:  # pragma: no cover - the extra is missing
    raise ImportError("memplan.api.integrations.lightning needs the lightning extra: "
                      "pip install 'memplan[lightning]'") from e

log = logging.getLogger("memplan")


def step_loss(out: Any) -> torch.Tensor:
    """The loss ``training_step`` returned (a tensor, or a dict's ``"loss"``); :class:`MemplanError` when
    there is none (``None`` skips a batch in Lightning, and cannot be planned)."""
    loss = out.get("loss") if isinstance(out, dict) else out
    if not isinstance(loss, torch.Tensor):
        raise MemplanError("MemplanCallback plans the step training_step returns a loss for; it returned "
                           f"{type(out).__name__}")
    return loss


class StepModule(nn.Module):
    """``forward(batch, batch_idx)`` is ``module``'s original ``training_step``: the root of the planned
    step (its parameters are ``module``'s, under the name ``module.``)."""

    def __init__(self, module: pl.LightningModule):
        super().__init__()
        self.module = module
        self.step_fn = type(module).training_step.__get__(module)

    def forward(self, batch: Any, batch_idx: int = 0) -> Any:
        return self.step_fn(batch, batch_idx)


def _profiled_step(trainer: pl.Trainer) -> Any:
    """The profiled step's loss function: the step as Lightning runs it, inside the precision plugin's
    training-step context (``precision="bf16-mixed"``: autocast), as the trained steps run."""
    context = trainer.precision_plugin.train_step_context

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        with context():
            return step_loss(model(batch, 0))

    return loss_fn


class MemplanCallback(PlannedCallback, pl.Callback):
    """Profile Lightning's first training step, solve it under ``budget`` and fit under the plan.

    ``budget``: bytes or a string (``"6GiB"``, ``"50%"`` of the activation memory); ``solver``: a memplan
    solver or ``"auto"``; ``fuse``: None or ``"backward"`` (refused with ``gradient_clip_val``);
    ``max_seq_len``: batches vary in sequence length up to this (a shape family over ``seq``);
    ``own_checkpointing``: ``"off"`` (the default: switched off under the plan, back on after) or ``"keep"``,
    for a module whose model checkpoints itself (transformers' ``activation_checkpointing_enable``; see
    :class:`memplan.api.integrations.common.StepPlanner`). A budget below what any plan reaches raises :class:`memplan.planner.core.errors.Infeasible` (the line ``memplan
    solve`` prints) at the first batch, before any parameter is updated.
    """

    def __init__(self, budget: str | int = "50%", solver: str = "auto", fuse: str | None = None, *,
                 time_limit_s: float = 60.0, offload: bool = False, max_seq_len: int | None = None,
                 own_checkpointing: str = "off"):
        if fuse == "forward":
            raise MemplanError("MemplanCallback takes fuse=None or 'backward' under Lightning: its clipping and "
                               "schedulers would act on gradients forward fusion still holds")
        self.planner = StepPlanner(budget, solver, fuse, time_limit_s=time_limit_s, offload=offload,
                                   max_seq_len=max_seq_len, own_checkpointing=own_checkpointing)
        self.measured_peak_bytes: int | None = None
        self.wrapper: StepModule | None = None
        self._measuring = False

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not pl_module.automatic_optimization:
            raise MemplanError("MemplanCallback plans automatic optimization; this module sets "
                               "automatic_optimization = False")
        if len(trainer.optimizers) != 1:
            raise MemplanError(f"MemplanCallback plans a module with one optimizer; it has {len(trainer.optimizers)}")
        if self.planner.fuse == "backward" and trainer.gradient_clip_val:
            raise MemplanError(f"fuse='backward' steps inside backward, before Lightning clips to "
                               f"gradient_clip_val={trainer.gradient_clip_val}; use fuse=None")
        self.wrapper = StepModule(pl_module)
        wrapper = self.wrapper
        # Lightning calls ``pl_module.training_step``: route it through the wrapper's forward (and its hooks)
        pl_module.training_step = self._removing_on_error(lambda batch, batch_idx=0, *a, **kw: wrapper(batch, batch_idx))
        # an error in the step's forward or backward removes the plan where it is raised: Lightning runs both
        # inside optimizer.step (a closure), whose profiler range would meet the plan's op-matching mode on
        # the way out and report a plan mismatch instead of the error; on_exception comes after that
        pl_module.backward = self._removing_on_error(pl_module.backward)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        optimizer = trainer.optimizers[0]
        if self.planner.executor is None:
            # the profile's steps log nothing: Lightning's logging runs other ops on a first call than on
            # later ones, and after the loss they are outside the plan, as ops after a graph's last are
            pl_module.log = pl_module.log_dict = lambda *a, **kw: None
            try:
                # Lightning zeroes gradients after training_step: the last step's live through the forward
                self.planner.plan(self.wrapper, batch, _profiled_step(trainer), optimizer,
                                  accumulation_steps=trainer.accumulate_grad_batches, gradients_held=True)
            finally:
                del pl_module.log, pl_module.log_dict
            s = self.summary
            log.info("memplan: %s plan (%d recomputed, %d offloaded), predicted peak %d B under %d B",
                     s.solver, s.recomputed, s.offloaded, s.predicted_peak_bytes, s.budget_bytes)
        elif self.measured_peak_bytes is None and not self._measuring:
            self._measuring = True
            self.planner.start_measure(pl_module, batch, optimizer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        s = self.summary
        logs = {"memplan_budget_bytes": float(s.budget_bytes),
                "memplan_predicted_peak_bytes": float(s.predicted_peak_bytes)}
        peak = self.planner.stop_measure()
        if peak is not None:
            self.measured_peak_bytes = peak
            log.info("memplan: measured peak %d B, predicted %d B", peak, s.predicted_peak_bytes)
        if self.measured_peak_bytes is not None:
            logs["memplan_measured_peak_bytes"] = float(self.measured_peak_bytes)
        pl_module.log_dict(logs, on_step=True, on_epoch=False)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.planner.remove()
        pl_module.__dict__.pop("training_step", None)  # the class's own again
        pl_module.__dict__.pop("backward", None)
        self.wrapper = None

    def _removing_on_error(self, fn: Any) -> Any:
        """``fn`` that removes the plan before an exception leaves it."""
        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except BaseException:
                self.planner.remove()
                raise

        return guarded

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.on_fit_end(trainer, pl_module)
