"""Arguments that carry a kernel's private state from its forward to its backward, for an isolated timing.

An isolated timing (:func:`memplan.planner.probe.optime.materialise`) fills each argument with random
floats or zeros of its recorded size. Most kernels read any values; a few read a *workspace* their forward
wrote in a layout of their own. oneDNN's LSTM backward (``aten.mkldnn_rnn_layer_backward``, what
``nn.LSTM``'s backward runs on a CPU) reads its forward's workspace as a primitive's memory: given one of
the meta function's size (none at all), it read past it and segfaulted, taking the fake profile's process
with it.

:func:`fill_workspaces` rebuilds such an argument the way the step made it: it runs the forward the
backward belongs to on the same materialised arguments and copies its workspace in (the backward's own
shapes, so the timing's work is the step's); where the recorded workspace has another size than the
forward makes, it refuses, and the call is timed analytically. Any other call is left as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _mkldnn_rnn_layer(args: tuple, kwargs: dict) -> torch.Tensor:
    """``mkldnn_rnn_layer_backward(input, w1, w2, w3, w4, hx, cx, output, hy, cy, grad_output, grad_hy,
    grad_cy, reverse, mode, hidden_size, num_layers, has_biases, train, bidirectional, batch_sizes,
    batch_first, workspace)``: the forward ``mkldnn_rnn_layer(input, w1, w2, w3, w4, hx, cx, reverse,
    batch_sizes, mode, hidden_size, num_layers, has_biases, bidirectional, batch_first, train)`` returns
    ``(output, hy, cy, workspace)``."""
    (inp, w1, w2, w3, w4, hx, cx, _out, _hy, _cy, _go, _ghy, _gcy, reverse, mode, hidden, layers, biases, train,
     bidirectional, batch_sizes, batch_first) = args[:22]
    return torch.ops.aten.mkldnn_rnn_layer.default(inp, w1, w2, w3, w4, hx, cx, reverse, batch_sizes, mode, hidden,
                                                   layers, biases, bidirectional, batch_first, train)[3]


#: backward op -> (its workspace argument's position, the forward that makes that workspace from the rest)
WORKSPACES: dict[str, tuple[int, Callable[[tuple, dict], torch.Tensor]]] = {
    "mkldnn_rnn_layer_backward": (22, _mkldnn_rnn_layer),
}


def has_workspace(func: Any) -> bool:
    """Whether ``func`` reads a workspace that :func:`fill_workspaces` rebuilds."""
    packet = getattr(func, "overloadpacket", None)
    return packet is not None and packet.__name__ in WORKSPACES


def fill_workspaces(func: Any, args: tuple, kwargs: dict) -> None:
    """In place: the workspace argument of a backward in :data:`WORKSPACES` holds what its forward writes
    for these arguments. Raises ``ValueError`` when the forward's workspace has another size than the
    recorded argument (the call cannot be timed alone: the caller falls back to the analytic time)."""
    if not has_workspace(func):
        return
    at, forward = WORKSPACES[func.overloadpacket.__name__]
    target = args[at] if len(args) > at else kwargs.get("workspace")
    if target is None:
        return
    made = forward(args, kwargs)
    if made.numel() != target.numel() or made.dtype != target.dtype:
        raise ValueError(f"{func}: the forward's workspace is {made.dtype}[{made.numel()}], the recorded one "
                         f"{target.dtype}[{target.numel()}]")
    target.copy_(made.reshape(target.shape))
