"""What the profiler records of the model states a plan may place (planner/core/states.py): per unit of the
optimizer's parameters, as optimizer fusion buckets them (a module's own parameters that the optimizer steps,
:func:`memplan.planner.probe.fusion.buckets`), its parameters' and its optimizer state's device bytes."""

from __future__ import annotations

import torch
from torch import nn

from memplan.planner.core.graph import StateUnit
from memplan.planner.probe.fusion import bucket_modules, buckets
from memplan.planner.probe.storage import tensors_in, unique_bytes


def unit_state_tensors(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> list[tuple[nn.Parameter, str]]:
    """The optimizer state entries of ``params`` that live on their parameter's device (a GPU's Adam keeps its
    step counters on the host already), as (parameter, key)."""
    out = []
    for p in params:
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor) and value.device == p.device:
                out.append((p, key))
    return out


def state_units(model: nn.Module, optimizer: torch.optim.Optimizer, charge_as: str) -> list[StateUnit]:
    """One :class:`StateUnit` per bucket, after a step has created the optimizer's state; storages charged as
    ``charge_as``'s allocator charges them, each counted once (a storage shared by two units: the first)."""
    groups, _, module_buckets = buckets(model, optimizer)
    names = bucket_modules(model, module_buckets, len(groups))
    seen_params: set[int] = set()
    seen_state: set[int] = set()
    units = []
    for name, params in zip(names, groups, strict=True):
        entries = unit_state_tensors(optimizer, params)
        state = [t for p, k in entries for t in tensors_in(optimizer.state[p][k])]
        units.append(StateUnit(module=name, params=len(params),
                               param_bytes=unique_bytes(list(params), seen_params, charge_as),
                               state_bytes=unique_bytes(state, seen_state, charge_as),
                               state_tensors=len(entries)))
    return units
