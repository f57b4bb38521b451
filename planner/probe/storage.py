"""Storage helpers: how the probe (and the executor, which must agree with it) sees tensors.

A tensor is identified by its storage (:func:`storage_of`): a view or an in-place result is not a new
tensor. The helpers here find the tensors in an op's arguments (:func:`tensors_in`), rebuild arguments leaf
by leaf (:func:`map_leaves`), move a batch (:func:`move_batch`) and count distinct storages' bytes
(:func:`unique_bytes`). Nothing here records or measures anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from memplan.planner.core.devicespec import round_allocation


def storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage behind ``t``, or None when it has none the probe counts (a sparse or meta tensor, a
    functional wrapper)."""
    if t.layout != torch.strided or t.device.type == "meta":
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensors without storage (functional wrappers)
        return None


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or results, in pytree order (tuples, lists, dict values). A plain
    walk: ``tree_flatten``'s generality costs more than the ops themselves on small models."""
    out: list[torch.Tensor] = []
    _collect(tree, out)
    return out


def _collect(x: Any, out: list[torch.Tensor]) -> None:
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (tuple, list)):
        for y in x:
            _collect(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _collect(y, out)


def map_leaves(fn: Callable[[Any], Any], x: Any) -> Any:
    """``fn`` applied to every leaf of an op's arguments (inside tuples, lists and dict values;
    namedtuples kept): ``tree_map`` for the structures ATen arguments have, without its generality."""
    if isinstance(x, tuple):
        items = [map_leaves(fn, y) for y in x]
        return type(x)(*items) if hasattr(x, "_fields") else tuple(items)
    if isinstance(x, list):
        return [map_leaves(fn, y) for y in x]
    if isinstance(x, dict):
        return {k: map_leaves(fn, y) for k, y in x.items()}
    return fn(x)


def storage_keys(args: Any, kwargs: Any) -> set[int]:
    """The storages (``_cdata``) a call reads: an output among them is an in-place result, not a new
    storage."""
    return {s._cdata for s in map(storage_of, tensors_in((args, kwargs))) if s is not None}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``: the graph's dtype field."""
    return str(dtype).removeprefix("torch.")


def unique_bytes(tensors: list[torch.Tensor], seen: set[int], charge_as: str | None = None) -> int:
    """Bytes of the storages of ``tensors`` not already in ``seen`` (their ``_cdata``; updated), each
    rounded as the allocator of ``charge_as`` (None: the tensor's own device type) rounds it."""
    total = 0
    for t in tensors:
        s = storage_of(t)
        if s is not None and s._cdata not in seen:
            seen.add(s._cdata)
            total += round_allocation(s.nbytes(), charge_as or t.device.type)
    return total


def move_batch(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor moved to ``device`` (tensors, dicts, lists, tuples, namedtuples)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return type(batch)({k: move_batch(v, device) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        moved = [move_batch(v, device) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch
