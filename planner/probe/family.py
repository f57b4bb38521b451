"""Profiling a shape family: the same training step at a few batch shapes, fitted into one graph.

    graph = profile_family(model, [({"seq": 128}, batch_128), ({"seq": 96}, batch_96),
                                   ({"seq": 64}, batch_64)], loss_fn)
    at_64 = memplan.planner.core.shapes.at_shape(graph, {"seq": 64})   # any shape up to the largest

The first batch is the largest shape: it is profiled as :func:`memplan.planner.probe.profiler.profile` profiles
(its timings and measurement are the graph's). The others only need the step's structure and sizes: one
warm-up and one traced step each, on a twin of the optimizer. The model's parameters, buffers and
gradients, the optimizer's state and the random streams are restored afterwards (:func:`restored`). With
``fake=True`` every shape is a fake trace instead. The fit itself is
:func:`memplan.planner.core.shapes.fit_family` (torch-free; its docstring states the size and time models).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from memplan.planner.core.devicespec import DeviceSpec
from memplan.planner.core.errors import MemplanError
from memplan.planner.core.graph import Graph
from memplan.planner.core.shapes import fit_family
from memplan.planner.probe.optime import OpTimer
from memplan.planner.probe.profiler import profile
from memplan.planner.probe.restore import restored
from memplan.planner.workloads import LossFn, default_optimizer


def twin_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A fresh optimizer of ``optimizer``'s class over the same parameters with the same per-group
    settings and no state: profiling with it records the same optimizer memory and leaves the original's
    state untouched. Raises :class:`MemplanError` when the class cannot be rebuilt from its groups."""
    groups = [{**g, "params": list(g["params"])} for g in optimizer.param_groups]
    try:
        return type(optimizer)(groups)
    except TypeError as e:
        raise MemplanError(f"cannot make a twin of optimizer {type(optimizer).__name__} from its parameter "
                           f"groups ({e}); pass a standard torch.optim optimizer") from None


def profile_family(model: nn.Module, batches: Sequence[tuple[Mapping[str, int], Any]], loss_fn: LossFn, *,
                   optimizer: torch.optim.Optimizer | None = None, warmup: int = 1, repeats: int = 3,
                   device: str | torch.device | None = None, progress: bool = True, measure: bool = True,
                   name: str = "graph", restore: bool = True, fake: bool = False,
                   device_spec: DeviceSpec | None = None, timer: OpTimer | None = None) -> Graph:
    """Profile ``model``'s training step at each ``(dimensions, batch)`` and return the largest shape's
    graph with its shape family (``graph.meta["shape_family"]``).

    ``batches[0]`` is the largest shape, profiled with ``optimizer``, ``warmup``, ``repeats`` and
    ``measure`` as :func:`memplan.planner.probe.profiler.profile` does; the others get a structure-only profile
    each, on a twin of the optimizer. The model, its gradients, ``optimizer``'s state and the random streams
    are put back afterwards, as ``profile`` puts them back (:func:`restored`; ``restore=False``: not). With
    ``fake`` (implied by ``device_spec``) every shape is traced under fake tensors, as ``profile(fake=True)``
    does, timed by ``timer`` or on the op-time cache (a call the shapes share is timed once): nothing of any
    step is allocated, and a model on the meta device works. Raises :class:`GraphError` when the step's
    structure differs between shapes or a size is no polynomial of the dimensions (see
    :func:`memplan.planner.core.shapes.fit_family`), :class:`MemplanError` as ``profile`` does.
    """
    if len(batches) < 2:
        raise MemplanError("profile_family needs batches at two or more shapes (three for sizes such as "
                           "seq - 1, which have two terms)")
    if fake or device_spec is not None:  # nothing trained: no copies to put back (profile keeps the streams)
        graphs = [(point, profile(model, batch, loss_fn, optimizer=optimizer, device=device, progress=progress,
                                  name=name, fake=True, device_spec=device_spec, timer=timer, restore=restore))
                  for point, batch in batches]
        return fit_family(graphs)
    optimizer = optimizer or default_optimizer(model)
    graphs = []
    with restored(model, optimizer) if restore else contextlib.nullcontext():
        for point, batch in batches[1:]:
            g = profile(model, batch, loss_fn, optimizer=twin_optimizer(optimizer), warmup=1, repeats=1,
                        device=device, progress=progress, measure=False, name=name, restore=False)
            graphs.append((point, g))
        largest = profile(model, batches[0][1], loss_fn, optimizer=optimizer, warmup=warmup, repeats=repeats,
                          device=device, progress=progress, measure=measure, name=name, restore=False)
    return fit_family([(batches[0][0], largest), *graphs])
