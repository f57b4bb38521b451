"""Training state put back after a profile: a profile trains real steps, and the model must not notice.

A real profile runs a few whole training steps (warm-up, traced and measured ones) with an optimizer: they
update the parameters, move batch norm's running statistics, leave gradients and optimizer state behind
and draw from the random streams. Left so, ``memplan.profile(model, ...)`` followed by training would
start from weights that a throw-away AdamW moved on one batch: silent damage to a pretrained model.
:func:`restored` copies what those steps change to host memory (so the device's peak while profiling is
the step's own, not inflated by a second copy of the model) and writes it back, bit for bit, afterwards.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from memplan.planner.probe.device import generator_devices


def _to_host(x: Any) -> Any:
    """``x`` with every tensor in it copied to host memory (containers copied, anything else as is)."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", copy=True)
    if isinstance(x, dict):
        return {k: _to_host(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_host(v) for v in x)
    return x


def _like(saved: Any, current: Any) -> Any:
    """``saved`` (host copies) back on the devices of ``current`` (the same structure as it was saved
    from, or missing: then where the saved copy came from is unknown and it stays on the host)."""
    if isinstance(saved, torch.Tensor):
        device = current.device if isinstance(current, torch.Tensor) else saved.device
        return saved.to(device, copy=True)
    if isinstance(saved, dict):
        cur = current if isinstance(current, dict) else {}
        return {k: _like(v, cur.get(k)) for k, v in saved.items()}
    if isinstance(saved, (list, tuple)):
        cur = current if isinstance(current, (list, tuple)) and len(current) == len(saved) else [None] * len(saved)
        return type(saved)(_like(v, c) for v, c in zip(saved, cur, strict=True))
    return saved


@contextlib.contextmanager
def restored(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Iterator[None]:
    """Run the block, then put back ``model``'s parameters, buffers and gradients (bit for bit), the
    ``optimizer``'s state when one is given, and the CPU and CUDA random streams: whatever steps the block
    trains, training continues as if it had not run. The copies wait in host memory."""
    tensors = list(itertools.chain(model.parameters(), model.buffers()))
    saved = [_to_host(t) for t in tensors]
    grads = [None if p.grad is None else (p.grad.device, _to_host(p.grad)) for p in model.parameters()]
    # each state's host copy, and the state itself: where its tensors live (Adam's ``step`` on the host)
    state = [] if optimizer is None else [(p, _to_host(s), s) for p, s in optimizer.state.items()]
    with torch.random.fork_rng(devices=generator_devices(tensors)):
        try:
            yield
        finally:
            with torch.no_grad():
                for t, v in zip(tensors, saved, strict=True):
                    t.copy_(v)
                for p, g in zip(model.parameters(), grads, strict=True):
                    p.grad = None if g is None else g[1].to(g[0])
            if optimizer is not None:
                optimizer.state.clear()
                for p, host, before in state:
                    optimizer.state[p] = _like(host, before)
