"""Device specs' achievable throughput per op class (planner/core/devicespec.py, planner/core/opclass.py):
which class an operator is, the rates a class gets (its own figure, its fallback's, the peak), the
validation of a spec file's figures and sources, and the analytic time built from them. No torch step
runs: specs are parsed and one recorded call is timed analytically."""

import json

import pytest
import torch

from memplan.planner.core.devicespec import (
    DeviceSpecError,
    load_device_spec,
    parse_device_spec,
    shipped_specs,
)
from memplan.planner.core.opclass import OP_CLASSES, op_class
from memplan.planner.probe.optime import analytic_time_s, record_call

BASE = {"name": "x", "device": "cuda", "memory_bytes": 2**30, "memory_bandwidth_bytes_per_s": 1000.0,
        "host_bandwidth_bytes_per_s": 10.0, "op_overhead_s": 0.0,
        "peak_flops_per_s": {"float32": 100.0, "bfloat16": 400.0}}


def _spec(achieved=None, **extra):
    return parse_device_spec(json.dumps({**BASE, **extra, "achieved": achieved or {}}), source="t.json")


@pytest.mark.parametrize("name, cls", [
    ("aten.addmm.default", "matmul"), ("aten.bmm.default", "matmul"), ("aten.mm", "matmul"),
    ("aten._scaled_dot_product_flash_attention_for_cpu.default", "attention"),
    ("aten._scaled_dot_product_efficient_attention_backward.default", "attention"),
    ("aten.convolution_backward.default", "convolution"), ("aten.convolution.default", "convolution"),
    ("aten.native_layer_norm_backward.default", "normalization"), ("aten._fused_rms_norm.default", "normalization"),
    ("aten._log_softmax.default", "reduction"), ("aten.sum.dim_IntList", "reduction"),
    ("aten.nll_loss_forward.default", "reduction"),
    ("aten.embedding_dense_backward.default", "copy"), ("aten.clone.default", "copy"), ("aten.cat.default", "copy"),
    ("aten.gelu.default", "elementwise"), ("aten._foreach_addcdiv_.ScalarList", "elementwise"),
    ("aten.mul.Tensor", "elementwise")])
def test_op_class_names_the_kind_of_kernel(name, cls):
    assert op_class(name) == cls and cls in OP_CLASSES


def test_a_class_takes_its_own_figure_then_its_fallbacks_then_the_peak():
    spec = _spec({"matmul": {"flops_per_s": {"float32": 50.0}, "source": "a"},
                  "copy": {"bytes_per_s": 600.0, "source": "b"},
                  "reduction": {"bytes_per_s": 300.0, "source": "c"}})
    assert spec.rates("matmul", "float32") == (50.0, 600.0)      # own FLOP/s; bytes: copy's (achieved bandwidth)
    assert spec.rates("attention", "float32") == (50.0, 600.0)   # attention -> matmul
    assert spec.rates("attention", "bfloat16") == (400.0, 600.0)  # no bf16 figure anywhere: the peak
    assert spec.rates("normalization", "float32") == (100.0, 300.0)  # normalization -> reduction's bytes
    assert spec.rates("elementwise", "float32") == (100.0, 600.0)    # elementwise -> copy
    assert spec.rates("elementwise", "float16") == (100.0, 600.0)    # no float16 peak: float32's
    bare = _spec()
    assert bare.rates("matmul", "bfloat16") == (400.0, 1000.0)  # no achieved figures: the roofline's peaks


@pytest.mark.parametrize("achieved, field", [
    ({"matmul": {"flops_per_s": {"float32": 50.0}}}, "achieved.matmul.source"),
    ({"matmul": {"flops_per_s": {"float32": 50.0}, "source": ""}}, "achieved.matmul.source"),
    ({"matmul": {"source": "a"}}, "neither flops_per_s nor bytes_per_s"),
    ({"gemm": {"flops_per_s": {"float32": 50.0}, "source": "a"}}, "achieved.gemm"),
    ({"matmul": {"flops_per_s": {"float32": 50e12}, "source": "a"}}, "achieved.matmul.flops_per_s.float32"),
    ({"copy": {"bytes_per_s": 2000.0, "source": "a"}}, "above the memory bandwidth"),
    ({"copy": {"bytes_per_s": -1, "source": "a"}}, "achieved.copy.bytes_per_s")])
def test_achieved_figures_need_a_source_a_known_class_and_a_plausible_rate(achieved, field):
    with pytest.raises(DeviceSpecError, match=field):
        _spec(achieved)


def test_every_shipped_achieved_figure_cites_where_it_comes_from():
    specs = {name: load_device_spec(name) for name in shipped_specs()}
    assert specs["h100-80gb"].achieved  # the device carries figures
    for spec in specs.values():
        for entry in spec.achieved.values():
            assert "https://" in entry.source


def test_the_analytic_time_uses_the_rates_of_the_calls_class():
    spec = load_device_spec("h100-80gb")
    a, b = torch.rand(64, 128), torch.rand(128, 32)
    mm = record_call(torch.ops.aten.mm.default, (a, b), {}, a @ b)
    relu = record_call(torch.ops.aten.relu.default, (a,), {}, torch.relu(a))
    flops_per_s, bytes_per_s = spec.rates("matmul", "float32")
    assert flops_per_s == 51.88e12 and bytes_per_s == 2.49e12  # the H100's measured fp32 GEMM, achieved copy
    moved = (64 * 128 + 128 * 32 + 64 * 32) * 4
    assert analytic_time_s(mm, spec) == pytest.approx(spec.op_overhead_s + max(2 * 64 * 128 * 32 / 51.88e12,
                                                                                 moved / 2.49e12))
    assert analytic_time_s(relu, spec) == pytest.approx(spec.op_overhead_s + 2 * 64 * 128 * 4 / 2.49e12)


def test_the_cpu_attention_kernel_counts_the_flops_of_the_gpu_kernel_it_stands_in_for():
    """A fake trace for CUDA without a GPU runs the CPU's op choices; torch counts no FLOPs for its flash
    kernel, so an H100's attention cost only its bytes. It is counted as the GPU flash kernel is."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    q, k, v = (torch.rand(2, 4, 64, 16, requires_grad=True) for _ in range(3))
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v)
    call = record_call(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, (q, k, v), {}, out)
    assert call.flops == sdpa_flop_count(q.shape, k.shape, v.shape) > 0
    assert op_class(call.name) == "attention"
    grad = torch.ones_like(out[0])
    args = (grad, q, k, v, out[0], out[1], 0.0, False)
    back = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(*args)
    call = record_call(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default, args, {}, back)
    assert call.flops == sdpa_backward_flop_count(grad.shape, q.shape, k.shape, v.shape) > 0


def test_a_spec_host_optimizer_figure_needs_its_source_and_a_fake_profile_takes_it():
    """Host-stepped model states cost the host's optimizer time: a spec may give its machine's rate, with where
    it comes from; a fake profile for the spec takes it (and says so in the graph), else measures this host."""
    from memplan.planner.probe.profiler import profile
    from memplan.planner.workloads import load_workload

    with pytest.raises(DeviceSpecError, match="host_source"):
        _spec(host_optimizer_bytes_per_s=1e9)
    spec = _spec(host_optimizer_bytes_per_s=3e9, host_source="a measurement of the machine's host")
    w = load_workload("mlp")
    g = profile(w.model, w.batch, w.loss_fn, fake=True, device_spec=spec, progress=False)
    assert g.host_optimizer_bytes_per_s == 3e9 and g.meta["host_optimizer_source"] == spec.host_source
    g = profile(w.model, w.batch, w.loss_fn, fake=True, device_spec=_spec(), progress=False)
    assert g.host_optimizer_bytes_per_s > 0 and g.meta["host_optimizer_source"] == "measured on the profiling machine"
