"""A model planned on the meta device, built for real: :func:`materialize`.

    with torch.device("meta"):
        model = build()                                   # nothing of its size is allocated
    graph = profile(model, batch, loss_fn, fake=True)     # plan it (memplan --fake)
    plan = solve(graph, budget_bytes).plan
    materialize(model, "cuda")                            # allocate on the device, initialise
    with apply(model, plan, graph=graph, optimizer=opt): ...

The model's meta tensors are allocated on the device, in place (the same tensor objects: ties and
optimizers stay valid; its other tensors are moved with their values) and initialised by the model's own code: transformers' ``init_weights`` for a
``PreTrainedModel`` (its ``_init_weights``, which also recomputes rotary frequencies, then weight tying),
else every module's ``reset_parameters``; or the caller's ``init``. Allocation is what the plan budgets
(parameters and buffers, as in the graph's fixed memory); initialisation allocates no more than one
tensor's temporaries.

Nothing uninitialised is handed on: before initialisation every floating-point tensor that was on the meta
device is filled with NaN and every integer one with its type's least value, and a tensor that still
holds them afterwards is refused, by name (a parameter of a custom module without ``reset_parameters``,
a buffer computed in a constructor). Boolean tensors cannot be told apart this way and are trusted.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from memplan.planner.core.errors import MemplanError


def materialize(model: nn.Module, device: str | torch.device, *,
                init: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """Put ``model`` on ``device`` for training: tensors on the meta device are allocated there and
    initialised (``init(model)`` if given, else transformers' ``init_weights`` for a ``PreTrainedModel``,
    else each module's ``reset_parameters``); the others are moved with their values. Parameters stay the
    same ``nn.Parameter`` objects (an optimizer built over them stays valid). Returns ``model``.

    Raises :class:`MemplanError` naming the first tensors that no initialiser wrote, and when ``device``
    is the meta device."""
    device = torch.device(device)
    if device.type == "meta":
        raise MemplanError("materialize: the target device is the meta device; give the device to train on")
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    on_meta = {name for name, t in tensors.items() if t.is_meta}
    if not on_meta:
        return model.to(device)
    with torch.no_grad():
        _allocate([t for name, t in tensors.items() if name in on_meta], device)
        model.to(device)  # the tensors that have values
        kept = {name: t.detach().clone() for name, t in tensors.items() if name not in on_meta}
        for name in on_meta:
            _poison(tensors[name])
        how = _initialise(model, init)
        for name, value in kept.items():  # reset_parameters may have re-drawn a module's real tensors too
            tensors[name].copy_(value)
    unset = sorted(name for name in on_meta if _poisoned(tensors[name]))
    if unset:
        shown = ", ".join(unset[:5]) + (f" and {len(unset) - 5} more" if len(unset) > 5 else "")
        raise MemplanError(f"materialize: {shown} came from the meta device and {how} did not initialise "
                           f"{'it' if len(unset) == 1 else 'them'}; pass init=<a function that does> "
                           f"(or give the module a reset_parameters method)")
    return model


def _allocate(on_meta: list[torch.Tensor], device: torch.device) -> None:
    """Give each tensor (each once: tied ones are one) uninitialised storage on ``device`` in place: the
    same Python object, so ties, optimizers and references stay valid (``nn.Module.to_empty`` makes new
    ``nn.Parameter`` objects for a meta tensor, untying tied weights)."""
    done: set[int] = set()
    for t in on_meta:
        if id(t) in done:
            continue
        done.add(id(t))
        new = torch.empty_like(t, device=device)
        if isinstance(t, nn.Parameter):
            new = nn.Parameter(new, t.requires_grad)
        new.__dict__.update(t.__dict__)  # attributes set on the tensor (swap_tensors swaps them too)
        torch.utils.swap_tensors(t, new)


def _initialise(model: nn.Module, init: Callable[[nn.Module], None] | None) -> str:
    """Run the model's initialisation; return how, for messages."""
    if init is not None:
        init(model)
        return "init"
    if callable(getattr(model, "init_weights", None)) and hasattr(model, "_init_weights"):
        # transformers marks what it initialised (a model built on meta may carry the marks already)
        for m in model.modules():
            for t in [m, *m.parameters(recurse=False), *m.buffers(recurse=False)]:
                if getattr(t, "_is_hf_initialized", False):
                    t._is_hf_initialized = False
        model.init_weights()
        return f"{type(model).__name__}.init_weights()"
    for m in model.modules():
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            reset()
    return "the modules' reset_parameters()"


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(torch.iinfo(t.dtype).min)


def _poisoned(t: torch.Tensor) -> bool:
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).any())
    if t.dtype == torch.bool or t.numel() == 0:
        return False
    return bool((t == torch.iinfo(t.dtype).min).any())
