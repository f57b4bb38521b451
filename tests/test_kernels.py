"""A fake step for a GPU traced on this CPU takes the GPU's kernels where the CPU's keep other tensors
(planner/probe/kernels.py). Found on an H100: ``--device-spec h100-80gb`` predicted GPT-2 base's peak
15.7% over the measured one, because the CPU's dropout keeps float masks (``bernoulli_``) where CUDA's
fused ``native_dropout`` keeps bool ones; with the GPU's kernels the spec's activation bytes equal the
H100 profile's to the byte (docs/benchmarks.md)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memplan.planner.core.devicespec import load_device_spec, round_allocation
from memplan.planner.probe.device import emulate_cuda
from memplan.planner.probe.kernels import attention_backend, cuda_kernel_choices
from memplan.planner.probe.profiler import profile
from memplan.planner.workloads import load_workload
from memplan.solvers import activation_bytes

TINY_GPT2 = dict(n_layer=2, n_embd=64, n_head=2, vocab_size=128, seq_len=32, batch_size=2)


def _t(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.mark.parametrize(("q", "k", "mask", "gqa", "expected"), [
    (_t(2, 4, 16, 64), _t(2, 4, 16, 64), None, False, "efficient"),                     # fp32: no flash
    (_t(2, 4, 16, 64, dtype=torch.bfloat16), _t(2, 4, 16, 64, dtype=torch.bfloat16), None, False, "flash"),
    (_t(2, 4, 16, 64, dtype=torch.float16), _t(2, 4, 16, 64, dtype=torch.float16), _t(16, 16), False,
     "efficient"),                                                                     # a mask: no flash
    (_t(2, 8, 16, 64, dtype=torch.bfloat16), _t(2, 2, 16, 64, dtype=torch.bfloat16), None, True, "flash"),
    (_t(2, 8, 16, 64), _t(2, 2, 16, 64), None, True, "other"),             # grouped heads in fp32: math
    (_t(2, 4, 16, 264, dtype=torch.bfloat16), _t(2, 4, 16, 264, dtype=torch.bfloat16), None, False,
     "efficient"),                                                           # past flash's head size
    (_t(2, 4, 16, 62), _t(2, 4, 16, 62), None, False, "other"),                          # misaligned
    (_t(2, 4, 16, 64, dtype=torch.float64), _t(2, 4, 16, 64, dtype=torch.float64), None, False, "other"),
])
def test_attention_goes_where_a_gpus_dispatch_sends_it(q, k, mask, gqa, expected):
    assert attention_backend(q, k, k, mask, gqa) == expected


def _spec_graph(w, cache):
    return profile(w.model, w.batch, w.loss_fn, progress=False, device_spec=load_device_spec("h100-80gb"),
                   cache_dir=cache)


def test_a_spec_trace_keeps_cudas_bool_dropout_masks_and_the_emulation_the_cpus(tmp_path):
    """The same tiny GPT-2 (dropout 0.1) traced for the H100's spec and under the CUDA emulation (whose
    step runs here, with the CPU's kernels): the spec's graph has CUDA's fused dropout and each mask as
    bool, the emulation's the CPU's; the bytes they save for backward differ by exactly the masks' (4 - 1)
    bytes per element, charged as CUDA's allocator charges them."""
    w = load_workload("gpt2", **TINY_GPT2)
    spec = _spec_graph(w, tmp_path)
    with emulate_cuda():
        w2 = load_workload("gpt2", **TINY_GPT2)
        emulated = profile(w2.model, w2.batch, w2.loss_fn, progress=False, fake=True, device="cuda",
                           cache_dir=tmp_path)
    assert spec.meta["kernel_choices"] == "cuda" and emulated.meta["kernel_choices"] == "cpu"
    spec_ops = [op.name for op in spec.ops]
    assert "aten.native_dropout.default" in spec_ops and "aten.bernoulli_.float" not in spec_ops
    assert "aten.bernoulli_.float" in [op.name for op in emulated.ops]
    masks = [spec.tensors[op.outputs[1]] for op in spec.ops if op.name == "aten.native_dropout.default"]
    assert masks and all(t.dtype == "bool" for t in masks)
    numel = [t.bytes for t in masks]  # one byte per element
    float_masks = sum(round_allocation(n * 4, "cuda") for n in numel)
    bool_masks = sum(round_allocation(n, "cuda") for n in numel)
    assert emulated.activation_bytes_kept() - spec.activation_bytes_kept() == float_masks - bool_masks
    assert activation_bytes(emulated) > activation_bytes(spec)  # and keep-everything's peak is lower


class _Attention(nn.Module):
    def __init__(self, width: int = 64, heads: int = 4):
        super().__init__()
        self.qkv, self.heads = nn.Linear(width, 3 * width), heads

    def forward(self, x, mask):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.1)


def test_masked_fp32_attention_saves_what_the_memory_efficient_kernel_saves(tmp_path):
    """fp32 attention with a boolean mask and dropout, for the H100's spec: one memory-efficient kernel
    call whose backward keeps q, k, v, the output, the log-sum-exp (queries rounded up to 32) and the
    additive bias in rows padded to 16 past the last multiple of 16 keys; on the CPU the same call runs the
    math path and keeps the attention probabilities instead."""
    b, s, width, heads = 2, 40, 64, 4
    model = _Attention(width, heads)
    batch = (torch.randn(b, s, width), torch.ones(s, s, dtype=torch.bool).tril())
    g = profile(model, batch, lambda m, xb: m(*xb).sum(), progress=False,
                device_spec=load_device_spec("h100-80gb"), cache_dir=tmp_path)
    [att] = [op for op in g.ops if op.name == "aten._scaled_dot_product_efficient_attention.default"]
    assert att.has_backward and att.time_s > 0
    saved = {tuple(g.tensors[t].shape): g.tensors[t] for t in att.saved}  # (storages: q, k, v are views)
    d, padded = width // heads, s - s % 16 + 16
    assert (b * s, 3 * width) in saved                                 # q, k and v: the projection's output
    assert (b, heads, s, d) in saved                                   # the output
    assert saved[(b, heads, (s + 31) // 32 * 32)].dtype == "float32"    # the log-sum-exp
    assert saved[(b, heads, s, padded)].bytes == round_allocation(b * heads * s * padded * 4, "cuda")  # bias
    assert not [op for op in g.ops if op.name in ("aten._softmax.default", "aten._safe_softmax.default")]


def test_the_functions_are_given_back_after_the_block_and_after_an_error():
    before = F.scaled_dot_product_attention, F.dropout
    with pytest.raises(RuntimeError), cuda_kernel_choices():
        assert F.dropout is not before[1]
        raise RuntimeError("the step failed")
    assert (F.scaled_dot_product_attention, F.dropout) == before
