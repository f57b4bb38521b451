"""Grouped matrix products (``aten._grouped_mm``): what an isolated timing and a FLOP count must know of them.

A grouped product multiplies ``G`` groups at once, each a slice of one dimension given by ``offs``, the
groups' cumulative ends (mixture-of-experts layers: the tokens routed to each expert, sorted by expert).
The work is every row of the grouped dimension, whatever the split; offsets of zeros (how an isolated
timing fills integer arguments, to keep indices valid) make every group empty, and the call was timed as
no work at all (a Mixtral layer's expert products, 98% of its forward time, read 0.02 ms against 32 ms).
So :func:`fill_offsets` splits the grouped dimension evenly (the balanced routing; the total work is the
step's), and :func:`grouped_mm_flops` counts the work, which ``torch.utils.flop_counter`` has no formula for.

Which dimension ``offs`` splits, by the operands' ranks (``torch.nn.functional.grouped_mm``): ``a`` 2D and
``b`` 3D, ``a``'s rows (forward, and the input's gradient); ``a`` 2D and ``b`` 2D, the contraction (the
weights' gradient, one product per group); ``a`` 3D and ``b`` 2D, ``b``'s columns; 3D by 3D, none.
"""

from __future__ import annotations

from typing import Any

import torch

# the grouped products and where their offsets are (the position in the schema; also a keyword)
_OFFSETS = {"_grouped_mm": 2, "_scaled_grouped_mm": 4}

# part of a timing's cache key for these ops: times taken on zero offsets (no work) are not reused
TIMING_VALUES = "offs=even"


def is_grouped_mm(func: Any) -> bool:
    """Whether ``func`` is a grouped matrix product whose offsets :func:`fill_offsets` fills."""
    packet = getattr(func, "overloadpacket", None)
    return packet is not None and packet.__name__ in _OFFSETS


def _operands(func: Any, args: tuple, kwargs: dict) -> tuple[Any, Any, Any]:
    at = _OFFSETS[func.overloadpacket.__name__]
    offs = args[at] if len(args) > at else kwargs.get("offs")
    return args[0], args[1], offs


def _grouped_length(a: Any, b: Any) -> int | None:
    """The length of the dimension the offsets split, or None (3D by 3D: no groups)."""
    if len(a.shape) == 2:
        return a.shape[0] if len(b.shape) == 3 else a.shape[1]
    return b.shape[-1] if len(b.shape) == 2 else None


def fill_offsets(func: Any, args: tuple, kwargs: dict) -> None:
    """In place: the real ``offs`` of a grouped product about to be timed alone split its grouped
    dimension into ``offs.numel()`` groups as evenly as integers allow (the last ends at its length).
    Any other call is left as it is."""
    if not is_grouped_mm(func):
        return
    a, b, offs = _operands(func, args, kwargs)
    length = _grouped_length(a, b)
    if offs is None or length is None or offs.numel() == 0:
        return
    groups = offs.numel()
    ends = [(g + 1) * length // groups for g in range(groups)]
    offs.copy_(torch.tensor(ends, dtype=offs.dtype).reshape(offs.shape))


def grouped_mm_flops(func: Any, args: tuple, kwargs: dict) -> int | None:
    """FLOPs of a grouped product (``args``: tensors or anything with ``.shape``), 2 per multiply-add
    over every group; None for any other call. ``a``'s elements each meet a row of ``b``'s last dimension,
    but where ``a`` is 3D and ``b`` 2D each group of ``a`` meets only its own columns."""
    if not is_grouped_mm(func):
        return None
    a, b, _ = _operands(func, args, kwargs)
    numel = 1
    for n in a.shape:
        numel *= n
    flops = 2 * numel * b.shape[-1]
    if len(a.shape) == 3 and len(b.shape) == 2:
        flops //= a.shape[0]
    return flops
