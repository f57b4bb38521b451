"""Which class of work an ATen operator does, for a device spec's achievable throughput per class.

A device reaches its peak FLOP/s only in large matrix products and its memory bandwidth only in long
streams; what it achieves differs by kind of kernel. :func:`op_class` names the kind from the operator's
name alone (``"aten.addmm.default"``), so that it works on a graph's op names and on traced calls alike:

* ``matmul``: dense matrix products (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``linear``...);
* ``attention``: fused attention kernels (``_scaled_dot_product_*``, ``_flash_attention_*``,
  ``_efficient_attention_*``, forward and backward);
* ``convolution``: convolutions and their backward;
* ``normalization``: layer, batch, group and RMS norms, forward and backward;
* ``reduction``: sums, means, maxima, softmax and log-softmax, losses that reduce;
* ``copy``: data movement without arithmetic (``copy_``, ``clone``, ``cat``, indexing, embedding,
  padding, fills);
* ``elementwise``: everything else (pointwise arithmetic, activations, dropout, the optimizer's
  ``_foreach_*`` ops).

Views cost no bytes whatever their class (the timer charges them the op overhead only). Torch-free.
"""

from __future__ import annotations

from typing import Literal

OpClass = Literal["matmul", "attention", "convolution", "normalization", "reduction", "elementwise", "copy"]
OP_CLASSES: tuple[str, ...] = ("matmul", "attention", "convolution", "normalization", "reduction",
                               "elementwise", "copy")

_MATMUL = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "addmv", "mv", "dot", "vdot",
           "addr", "outer", "_int_mm", "_scaled_mm", "_addmm_activation", "_grouped_mm",
           "_scaled_grouped_mm"}
_ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")
_CONVOLUTION = ("convolution", "_convolution", "conv", "cudnn_convolution", "mkldnn_convolution", "_slow_conv",
                "slow_conv", "thnn_conv", "_nnpack_spatial_convolution")
_NORMALIZATION = ("native_layer_norm", "native_batch_norm", "_native_batch_norm_legit", "native_group_norm",
                  "batch_norm", "cudnn_batch_norm", "miopen_batch_norm", "layer_norm", "group_norm",
                  "_fused_rms_norm", "rms_norm", "instance_norm")
_REDUCTION = {"sum", "mean", "amax", "amin", "max", "min", "aminmax", "argmax", "argmin", "prod", "var", "std",
              "var_mean", "std_mean", "norm", "linalg_vector_norm", "_softmax", "_log_softmax",
              "_softmax_backward_data", "_log_softmax_backward_data", "softmax", "log_softmax", "logsumexp",
              "nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward", "nll_loss2d_backward", "mse_loss",
              "cross_entropy_loss", "cumsum", "cumprod", "all", "any", "count_nonzero", "_foreach_norm"}
_COPY = {"copy_", "copy", "clone", "_to_copy", "contiguous", "cat", "stack", "index_select", "embedding",
         "embedding_dense_backward", "gather", "scatter", "scatter_add", "scatter_add_", "scatter_", "index",
         "_unsafe_index", "index_put", "index_put_", "_index_put_impl_", "index_add", "index_add_",
         "slice_scatter", "select_scatter", "as_strided_scatter", "diagonal_scatter", "constant_pad_nd",
         "repeat", "expand_copy", "fill_", "fill", "zero_", "zeros", "zeros_like", "ones", "ones_like", "full",
         "full_like", "new_zeros", "new_ones", "new_full", "_foreach_copy_", "_foreach_zero_", "roll", "flip",
         "masked_scatter", "masked_select", "take", "_unsafe_view_copy", "unfold_backward", "im2col", "col2im"}


def packet_name(op_name: str) -> str:
    """The operator's base name: ``"aten.addmm.default"`` -> ``"addmm"``; a bare ``"addmm"`` stays."""
    parts = op_name.split(".")
    if len(parts) >= 2 and parts[0] in ("aten", "prims", "_ops"):
        return parts[1]
    return parts[0]


def op_class(op_name: str) -> str:
    """The class of ``op_name`` (an ATen operator's name, overload or not): one of :data:`OP_CLASSES`."""
    name = packet_name(op_name)
    base = name.removesuffix("_backward").removesuffix("_backward_input").removesuffix("_backward_weight")
    if name in _MATMUL:
        return "matmul"
    if any(key in name for key in _ATTENTION):
        return "attention"
    if name.startswith(_CONVOLUTION) or base.startswith(_CONVOLUTION):
        return "convolution"
    if name.startswith(_NORMALIZATION):
        return "normalization"
    if name in _REDUCTION:
        return "reduction"
    if name in _COPY:
        return "copy"
    return "elementwise"
