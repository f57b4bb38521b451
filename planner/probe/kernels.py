"""A GPU's kernel choices for a fake step traced on the CPU (a ``--device-spec`` GPU that is not here).

Where torch has no CUDA, a fake trace for a GPU runs on CPU fake tensors
(:func:`memplan.planner.probe.device.fake_trace_device`), and the step's composite functions pick the
CPU's kernels. Two of those choices change what backward keeps:

* ``scaled_dot_product_attention``: the CPU's fused kernel refuses dropout, so training with attention
  dropout runs the math path, which saves every layer's attention probabilities and a float mask of the
  same size. A GPU (compute capability 8.0 and later) runs a fused kernel that saves the inputs, the output
  and the log-sum-exp: on GPT-2 base (fp32, batch 8, sequence 1024) the CPU's choice put 4.8 GB of
  probabilities and 5.5 GB of float dropout masks into the graph, and the spec's predicted peak 15.7% over
  the H100's measured one (docs/benchmarks.md).
* ``dropout``: the CPU's keeps a mask in the input's dtype (``bernoulli_``); CUDA's fused
  ``native_dropout`` a bool mask, a quarter of it in fp32.

Inside :func:`cuda_kernel_choices` both functions call the kernels CUDA's dispatch picks for them, as
ATen ops whose meta functions run them on fake tensors, so the graph has a GPU's ops, saved tensors and
bytes. The attention rules are PyTorch's (``sdp_utils.cpp``) for a GPU of compute capability 8.0 or later:
half precision without a mask goes to the flash kernel (cuDNN's, which a torch whose cuDNN is newer than
9.15 prefers on Hopper and Blackwell, saves the same tensors), a mask or fp32 to the memory-efficient
kernel, and what neither takes (grouped-query heads outside flash, misaligned head sizes, float64) to
the function as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

aten = torch.ops.aten
HALF = (torch.float16, torch.bfloat16)
EFFICIENT_DTYPES = (torch.float32, *HALF)
FLASH_MAX_HEAD_DIM = 256
MASK_ALIGNMENT = 16  # the memory-efficient kernel's attention bias is padded to this many key positions


def attention_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                      enable_gqa: bool = False) -> str:
    """The kernel a GPU of compute capability 8.0+ runs for these arguments: ``flash``,
    ``efficient``, or ``other`` (left to the function as it is)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.is_nested:
        return "other"
    if not (q.dtype == k.dtype == v.dtype):
        return "other"
    heads_differ = q.size(1) != k.size(1) or k.size(1) != v.size(1)
    if heads_differ and not enable_gqa:
        return "other"
    d = q.size(-1)
    if (q.dtype in HALF and attn_mask is None and d == k.size(-1) == v.size(-1) and d <= FLASH_MAX_HEAD_DIM
            and d % 8 == 0):
        return "flash"
    alignment = 8 if q.dtype in HALF else 4
    if (q.dtype in EFFICIENT_DTYPES and not heads_differ and d == k.size(-1) and d % alignment == 0
            and v.size(-1) % alignment == 0):
        return "efficient"
    return "other"


def _bias(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The attention bias the memory-efficient kernel is given (``convert_boolean_attn_mask`` and
    ``preprocess_mask``): a boolean mask as an additive one, expanded to (batch, heads, queries, keys) and,
    unless its rows are already strided by the alignment, copied into rows padded by one alignment's
    worth past the last multiple (``pad_bias``: 16 more where the length is a multiple) and sliced back."""
    if mask.dtype == torch.bool:
        mask = torch.where(mask.logical_not(), float("-inf"), torch.zeros((), dtype=q.dtype, device=q.device))
    n = k.size(2)
    mask = mask.expand(q.size(0), q.size(1), q.size(2), n)
    if mask.stride(-1) % MASK_ALIGNMENT:
        mask = F.pad(mask, (0, MASK_ALIGNMENT - n % MASK_ALIGNMENT))[..., :n]
    return mask


def _attention(original: Any):
    def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                     attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                     is_causal: bool = False, scale: float | None = None,
                                     enable_gqa: bool = False) -> torch.Tensor:
        backend = attention_backend(query, key, value, attn_mask, enable_gqa)
        if backend == "flash":
            return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                             scale=scale)[0]
        if backend == "efficient":
            lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
            bias = _bias(attn_mask, query, key) if attn_mask is not None else None
            return aten._scaled_dot_product_efficient_attention(query, key, value, bias, lse, dropout_p,
                                                                is_causal, scale=scale)[0]
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)
    return scaled_dot_product_attention


def _dropout(original: Any):
    def dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        # CUDA's at::dropout: the fused kernel for 0 < p < 1 on a non-empty tensor (is_fused_kernel_acceptable)
        if training and not inplace and 0.0 < p < 1.0 and input.numel() > 0:
            return aten.native_dropout(input, p, True)[0]
        return original(input, p, training, inplace)
    return dropout


_ACTIVE = [0]  # how many cuda_kernel_choices blocks are open


def gpu_choices_active() -> bool:
    """Whether the running fake trace is for a GPU (inside :func:`cuda_kernel_choices`): the kernels whose
    choices it models are CUDA's, not this CPU's."""
    return _ACTIVE[0] > 0


@contextlib.contextmanager
def cuda_kernel_choices() -> Iterator[None]:
    """Inside the block, ``torch.nn.functional.scaled_dot_product_attention`` and ``dropout`` (what
    ``nn.Dropout`` calls) run the kernels a GPU picks (see the module docstring). For fake tensors only:
    the CPU has no kernel for the GPU's attention."""
    saved = F.scaled_dot_product_attention, F.dropout
    F.scaled_dot_product_attention = _attention(saved[0])
    F.dropout = _dropout(saved[1])
    _ACTIVE[0] += 1
    try:
        yield
    finally:
        _ACTIVE[0] -= 1
        F.scaled_dot_product_attention, F.dropout = saved
