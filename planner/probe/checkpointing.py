"""A model's own activation checkpointing, as Hugging Face switches it on: found, described in one line, and
switched off for the length of a block.

transformers turns it on with ``model.activation_checkpointing_enable(every_n_layers=1, offload=False)``
(5.24 on; ``gradient_checkpointing_enable`` before, an alias since) or ``TrainingArguments(
activation_checkpointing=True)`` (``gradient_checkpointing=True`` before). Both set a boolean
``gradient_checkpointing`` on the modules that checkpoint (every ``every_n_layers``-th decoder layer) and
give them a ``_gradient_checkpointing_func``: ``torch.utils.checkpoint.checkpoint``, or with ``offload=True``
a wrapper that runs it under ``save_on_cpu`` (a blocking copy to host of what the checkpoint saves).

Profiled with it on, a step already recomputes every checkpointed layer: its graph saves only the layers'
inputs, so a plan over it can keep no more than that, and a budget of "100%" still recomputes every layer.
:func:`own_checkpointing` finds it, :func:`checkpointing_off` switches it off (every flag restored after):
memplan then plans every activation itself (recompute per tensor, offload asynchronously with prefetch).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class OwnCheckpointing:
    """What a model's own checkpointing does: ``layers`` modules checkpoint, of ``of`` that can (transformers'
    ``every_n_layers`` checkpoints 1 in n decoder layers); ``offload``: what they save goes to host memory
    (``offload=True``); ``switch``: how the model turns it off (``activation_checkpointing_disable`` in
    transformers 5.24 on, ``gradient_checkpointing_disable`` before)."""

    layers: int
    of: int
    offload: bool
    switch: str

    def line(self) -> str:
        """One line for the user."""
        which = "every layer" if self.layers == self.of else f"{self.layers} of its {self.of} layers"
        return (f"the model checkpoints {which} itself{' and offloads what they save (offload=True)' if self.offload else ''}: "
                f"profiled so, its step already recomputes them")


def _flagged(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(getattr(m, "gradient_checkpointing", None), bool)]


def own_checkpointing(model: nn.Module) -> OwnCheckpointing | None:
    """The model's own checkpointing (transformers' convention: modules with ``gradient_checkpointing =
    True``), or None when it has none switched on."""
    flagged = _flagged(model)
    on = [m for m in flagged if m.gradient_checkpointing]
    if not on:
        return None
    layers = [m for m in flagged if _is_layer(m)] or flagged
    counted = [m for m in layers if m.gradient_checkpointing] or on
    offload = any(_offloads(getattr(m, "_gradient_checkpointing_func", None)) for m in on)
    switch = next((name for name in ("activation_checkpointing_disable", "gradient_checkpointing_disable")
                   if any(hasattr(m, name) for m in model.modules())), "gradient_checkpointing = False")
    return OwnCheckpointing(len(counted), len(layers), offload, switch)


def _is_layer(m: nn.Module) -> bool:
    """A repeated block transformers checkpoints (its ``GradientCheckpointingLayer``), not a model."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # transformers before the class, or none: every flagged module counts
        return True
    return isinstance(m, GradientCheckpointingLayer)


def _offloads(func: object) -> bool:
    """transformers' ``offload=True`` wraps ``checkpoint`` in a local ``checkpoint_func`` under ``save_on_cpu``."""
    while isinstance(func, functools.partial):
        func = func.func
    return "<locals>.checkpoint_func" in getattr(func, "__qualname__", "")


def switch_off(model: nn.Module) -> OwnCheckpointing | None:
    """Switch the model's own checkpointing off for good (every ``gradient_checkpointing`` flag False);
    returns what was on (None: nothing was)."""
    found = own_checkpointing(model)
    if found is not None:
        for m in _flagged(model):
            m.gradient_checkpointing = False
    return found


@contextlib.contextmanager
def checkpointing_off(model: nn.Module) -> Iterator[OwnCheckpointing | None]:
    """The block runs ``model`` with its own checkpointing switched off (every ``gradient_checkpointing``
    flag set to False), and each flag is put back as it was afterwards; yields what was switched off (None
    when nothing was on: the block then changes nothing)."""
    found = own_checkpointing(model)
    saved = [(m, m.gradient_checkpointing) for m in _flagged(model)] if found else []
    for m, _ in saved:
        m.gradient_checkpointing = False
    try:
        yield found
    finally:
        for m, was in saved:
            m.gradient_checkpointing = was
