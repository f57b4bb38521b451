"""Does the simulator, fed the profiler's graph, predict the peak that a real training step reaches?

The measured peak (planner/probe/measure.py) comes from the allocator's own accounting, not from the graph.
A toy model pins both numbers to a hand computation; the built-in models must agree within 10%
(docs/benchmarks.md records the actual errors)."""

import pytest
import torch
from torch import nn

from memplan.planner.core.plan import Plan
from memplan.planner.core.simulator import simulate
from memplan.planner.probe.measure import measure_step
from memplan.planner.probe.profiler import profile
from memplan.planner.workloads import load_workload

KIB4 = 1024 * 4  # one float32 vector of 1024 elements


class ExpChain(nn.Module):
    """x * w, then exp twice: every tensor is 4 KiB and each op's saves are known."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(1024))

    def forward(self, x):
        a = x * self.w      # MulBackward saves x (w's gradient is grad * x)
        b = a.exp()         # ExpBackward saves its result b
        c = b.exp()         # ... and c
        return c            # a dies when this frame ends; b and c live on in the autograd graph


def _sgd(model):
    # plain SGD: no state and no temporaries in step(), so the optimizer adds nothing
    return torch.optim.SGD(model.parameters(), lr=1e-3, foreach=False)


def test_exact_peak_of_a_hand_computed_toy():
    torch.manual_seed(0)
    model = ExpChain()
    x = torch.randn(1024)
    g = profile(model, x, lambda m, x: m(x).sum(), optimizer=_sgd(model), device="cpu", progress=False)
    # fixed: w and x. Forward: a, b, c live together (locals of forward), then the 4-byte loss:
    #   2 + 3 vectors + 4 B = 20484 B. Backward of the second exp adds the 4-byte seed gradient and the
    #   gradient of b: 2 (fixed) + b + c + 4 B (loss) + 4 B (seed) + grad b = 20488 B (the first exp's
    #   step reaches it again: c has gone, grad of a has come).
    fixed = 2 * KIB4
    forward_peak = fixed + 3 * KIB4 + 4
    backward_peak = fixed + 2 * KIB4 + 4 + 4 + KIB4
    assert backward_peak == 20488 > forward_peak
    assert g.fixed.resident_bytes == fixed and g.fixed.optimizer_step_bytes == 0
    assert g.measured.peak_bytes == backward_peak
    assert simulate(g, Plan.keep_all(g)).peak_bytes == backward_peak
    # the figures that produce it
    mul, exp1, _, exp2, _, total = g.ops
    assert [op.name for op in (mul, exp1, exp2, total)] == [
        "aten.mul.Tensor", "aten.exp.default", "aten.exp.default", "aten.sum.default"]
    a, b, c, loss = mul.outputs[0], exp1.outputs[0], exp2.outputs[0], total.outputs[0]
    assert (mul.saved, exp1.saved, exp2.saved) == ([1], [b], [c])  # tensor 1 is the input x
    assert g.tensors[a].freed_after == 4 and g.tensors[loss].held_by_caller
    assert [(op.backward_grad_alloc_bytes, op.backward_grad_free_bytes) for op in (total, exp2, exp1, mul)] == [
        (4, 0),            # the seed gradient of the loss (torch.autograd.backward holds it to the end)
        (KIB4, 0),         # grad of b
        (KIB4, KIB4),      # grad of a; grad of b goes
        (KIB4, KIB4 + 4),  # grad of w (kept as w.grad); grad of a and the seed go
    ]


def test_measured_baseline_is_the_fixed_memory():
    w = load_workload("mlp", depth=4)
    g = profile(w.model, w.batch, w.loss_fn, device="cpu", progress=False, repeats=1)
    m = measure_step(w.model, w.batch, w.loss_fn, steps=1, warmup=1)
    # AdamW state (exp_avg, exp_avg_sq, a 4-byte step per parameter) built by a fresh optimizer's warm-up
    assert m.baseline_bytes == g.fixed.resident_bytes
    assert m.peak_bytes == g.measured.peak_bytes


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "resnet", "gpt2", "unet", "bert"])
def test_simulated_peak_matches_measured(name):
    w = load_workload(name)
    g = profile(w.model, w.batch, w.loss_fn, device="cpu", progress=False, repeats=1, name=name)
    simulated = simulate(g, Plan.keep_all(g)).peak_bytes
    measured = g.measured.peak_bytes
    assert abs(simulated - measured) <= 0.10 * measured, (
        f"{name}: simulated {simulated} B vs measured {measured} B ({(simulated - measured) / measured:+.1%})")
