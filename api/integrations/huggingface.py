"""memplan inside Hugging Face's ``Trainer``: one callback, no change to the training loop.

    from memplan.api.integrations.huggingface import MemplanCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[MemplanCallback(budget="50%")])
    trainer.train()

**Which step is profiled.** The Trainer's own: a forward pre-hook on the model sees the first training
forward of ``trainer.train()`` (inside ``training_step`` -> ``compute_loss``, under the Trainer's autocast
context and accelerate's patched ``forward`` when ``bf16``/``fp16`` is on) and profiles, right there, the
model called with exactly those arguments (the batch as the Trainer prepared it, labels and
``num_items_in_batch`` included) with the loss the model returns, as ``compute_loss`` takes it. The
profile trains a twin of the Trainer's optimizer; the model's parameters, gradients and random streams
are restored afterwards, so training goes on as if it had not run. The plan is then solved, applied to
the model and the Trainer's optimizer, and the current step already runs under it. Ops the Trainer runs
after the model (the loss divided by the accumulation steps) are outside the plan, as they are outside
the graph.

**Dynamic padding.** With ``max_seq_len``, the first batch is cut or repeated along its sequence
dimension to ``max_seq_len``, 3/4 and 1/2 of it, the step is profiled at the three and fitted into one
shape family (:mod:`memplan.planner.core.shapes`), and the plan, made for ``max_seq_len``, runs every batch up
to it. A model that branches on the batch's content cannot be one graph: transformers' ``sdpa`` attention
skips building the mask when the attention mask is all ones, so under it a batch without padding and one
with padding run different ops (the second is refused, naming the op); ``attn_implementation="eager"``
builds the mask every time.

**Logs.** Once planned, the budget and the plan's predicted peak go to the Trainer's logs
(``memplan_budget_bytes``, ``memplan_predicted_peak_bytes``, ...); the peak measured over the next
optimizer step (``memplan_measured_peak_bytes``: CUDA's allocator peak; on CPU the allocator's reports,
which slow that one step) follows in the next log.

With gradient accumulation the predicted peak adds the gradients that earlier micro-batches leave for
the later ones (the profiled step starts without gradients). Gradient accumulation, ``max_grad_norm`` (the Trainer clips as usual) and bf16 mixed precision work with
``fuse=None``. ``fuse="backward"`` steps the optimizer inside backward, before the Trainer clips: it is
refused when ``max_grad_norm`` is set; ``fuse="forward"`` is refused (the Trainer's clipping and
scheduler would run on gradients the executor still holds). A model whose output has no ``loss`` (a
``compute_loss_func`` or an overridden ``compute_loss``) is refused in one line: the loss must be part of
the profiled step.

**The model's own checkpointing.** A model whose checkpointing is on (``activation_checkpointing_enable``,
``gradient_checkpointing_enable``, ``TrainingArguments(activation_checkpointing=True)``, ``offload=True``
or not) is said so in one warning line; by default the callback switches it off for the profile and the
training under the plan and back on at the end, so that memplan plans every activation
(``own_checkpointing="keep"`` plans over the checkpointed step instead).

Requires the ``hf`` extra (``pip install memplan[hf]``: transformers, accelerate).
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any

import torch
from torch import nn

from memplan.api.integrations.common import PlannedCallback, StepPlanner
from memplan.planner.core.errors import MemplanError

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - the extra is missing
    raise ImportError("memplan.api.integrations.huggingface needs the hf extra: pip install 'memplan[hf]'") from e

log = logging.getLogger("memplan")


def model_loss(outputs: Any) -> torch.Tensor:
    """The loss in a model's outputs, as ``Trainer.compute_loss`` takes it (``outputs["loss"]`` of a
    ModelOutput or dict, else the first element). Raises :class:`MemplanError` when there is none."""
    loss = None
    if isinstance(outputs, dict):
        loss = outputs.get("loss")
    elif isinstance(outputs, (tuple, list)) and outputs:
        loss = outputs[0]
    if not isinstance(loss, torch.Tensor):
        raise MemplanError("MemplanCallback profiles the model's own loss, and the model returned none: pass "
                           "labels in the batch (a compute_loss_func or an overridden compute_loss is outside "
                           "the profiled step)")
    return loss


class MemplanCallback(PlannedCallback, TrainerCallback):
    """Profile the Trainer's first training step, solve it under ``budget`` and train under the plan.

    ``budget``: bytes or a string (``"6GiB"``, ``"50%"`` of the activation memory); ``solver``: a memplan
    solver or ``"auto"``; ``fuse``: None or ``"backward"`` (see the module docstring); ``time_limit_s``
    and ``offload`` as for ``memplan solve``; ``max_seq_len``: with dynamic padding, the longest sequence a
    batch may have (the plan then covers a shape family over the sequence length, see
    :func:`memplan.api.integrations.common.sequence_family`; without it a batch longer than the first is
    refused in one line); ``own_checkpointing``: ``"off"`` (the default) or ``"keep"``, what to do with the
    model's own activation checkpointing (``activation_checkpointing_enable`` in transformers 5.24 on,
    ``gradient_checkpointing_enable`` before, or ``TrainingArguments(activation_checkpointing=True)``,
    ``offload=True`` included; :class:`memplan.api.integrations.common.StepPlanner` says why off is the
    default). A budget below what any plan reaches raises
    :class:`memplan.planner.core.errors.Infeasible` (the line ``memplan solve`` prints, naming the minimum
    feasible budget) in the first forward, before any parameter is updated.

    After training, ``graph``, ``plan``, ``summary`` and ``measured_peak_bytes`` hold what was used.
    An exception escaping ``trainer.train()`` removes the plan from the model and optimizer on its way
    out (the Trainer has no exception event: the callback wraps the ``train`` of the Trainer it was given
    to; one added later with ``add_callback`` wraps its ``training_step``, or call :meth:`remove`).
    """

    def __init__(self, budget: str | int = "50%", solver: str = "auto", fuse: str | None = None, *,
                 time_limit_s: float = 60.0, offload: bool = False, max_seq_len: int | None = None,
                 own_checkpointing: str = "off"):
        if fuse == "forward":
            raise MemplanError("MemplanCallback takes fuse=None or 'backward': with forward fusion the Trainer "
                               "would clip and schedule gradients the executor still holds")
        self.planner = StepPlanner(budget, solver, fuse, time_limit_s=time_limit_s, offload=offload,
                                   max_seq_len=max_seq_len, own_checkpointing=own_checkpointing)
        self.measured_peak_bytes: int | None = None
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._args: Any = None
        self._hook: Any = None
        self._busy = False
        self._pending_logs: dict[str, float] = {}
        self._measure_step: int | None = None
        self._guarded: Any = None  # the Trainer whose train (or training_step) removes the plan on an error

    def remove(self) -> None:
        """Give the model and optimizer back as they were: the first-forward hook and the plan's executor
        removed (pending fused updates applied). Done at the end of training, and when it raises."""
        self._remove_hook()
        self.planner.remove()

    # ---- the Trainer's events ----------------------------------------------------------------------------
    def on_init_end(self, args, state, control, **kwargs):
        trainer = _calling_trainer()
        if trainer is not None:
            trainer.train = self._removing_on_error(trainer.train)
            self._guarded = trainer

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        trainer = _calling_trainer()
        if trainer is not None and trainer is not self._guarded:  # added after the Trainer was made
            trainer.training_step = self._removing_on_error(trainer.training_step)
            self._guarded = trainer
        if model is None or optimizer is None:
            raise MemplanError("MemplanCallback needs the Trainer's model and optimizer at on_train_begin")
        if self.planner.fuse == "backward" and args.max_grad_norm:
            raise MemplanError(f"fuse='backward' steps the optimizer inside backward, before the Trainer clips "
                               f"to max_grad_norm={args.max_grad_norm}; set max_grad_norm=0 or fuse=None")
        self._model = model
        # accelerate wraps the optimizer; the executor patches the torch optimizer's own step
        self._optimizer = getattr(optimizer, "optimizer", optimizer)
        self._args = args
        if self.planner.executor is None:
            self._hook = model.register_forward_pre_hook(self._first_forward, with_kwargs=True)

    def on_step_begin(self, args, state, control, **kwargs):
        if self.planner.executor is not None and self._measure_step is None and self.measured_peak_bytes is None:
            self._measure_step = state.global_step  # the first step wholly under the plan: measure it

    def on_step_end(self, args, state, control, **kwargs):
        peak = self.planner.stop_measure()
        if peak is not None:
            self.measured_peak_bytes = peak
            self._pending_logs["memplan_measured_peak_bytes"] = peak
            log.info("memplan: measured peak %d B, predicted %d B", peak, self.summary.predicted_peak_bytes)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self._pending_logs:
            return
        # the Trainer recorded this log in log_history just before calling back: add ours to that record
        if state.log_history:
            state.log_history[-1].update(self._pending_logs)
        if logs is not None:
            logs.update(self._pending_logs)
        self._pending_logs = {}

    def on_train_end(self, args, state, control, **kwargs):
        if self._pending_logs:
            state.log_history.append({**self._pending_logs, "step": state.global_step})
            self._pending_logs = {}
        self.remove()

    def _removing_on_error(self, method: Any) -> Any:
        """``method`` that calls :meth:`remove` before an exception leaves it."""
        @functools.wraps(method)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            except BaseException:
                self.remove()
                raise

        return guarded

    # ---- the first forward -------------------------------------------------------------------------------
    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _first_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._busy:
            return  # the profile's own calls of the model
        if self.planner.executor is not None:
            if self._measure_step is not None and self._measure_step >= 0:
                self._measure_step = -1
                self.planner.start_measure(module, (args, kwargs), self._optimizer)
            return
        if not (module.training and torch.is_grad_enabled()):
            return
        self._busy = True
        try:
            ex = self.planner.plan(module, (args, kwargs), _call_model, self._optimizer,
                                   accumulation_steps=self._args.gradient_accumulation_steps)
        finally:
            self._busy = False
        ex.begin_step(module)  # this call's own pre-hooks ran before the executor's was registered
        s = self.summary
        log.info("memplan: %s plan (%d recomputed, %d offloaded), predicted peak %d B under a budget of %d B "
                 "(keeping everything: %d B)", s.solver, s.recomputed, s.offloaded, s.predicted_peak_bytes,
                 s.budget_bytes, s.keep_all_peak_bytes)
        self._pending_logs.update(s.logs())


def _calling_trainer() -> Any:
    """The ``transformers.Trainer`` whose callback handler is calling (found on the stack: a Trainer
    passes its callbacks no reference to itself), or None."""
    from transformers import Trainer

    frame = sys._getframe(1)
    while frame is not None:
        if isinstance(frame.f_locals.get("self"), Trainer):
            return frame.f_locals["self"]
        frame = frame.f_back
    return None


def _call_model(model: nn.Module, batch: tuple[tuple, dict]) -> torch.Tensor:
    args, kwargs = batch
    return model_loss(model(*args, **kwargs))

