"""torch.compile under a byte budget (memplan.api.integrations.torch_compile): a real compiled GPT-2 step measured within
the budget by the CPU allocator, memplan's solver answering the partitioner's knapsack, and the refusals.

Compiles are slow on a CPU: the module's fixture compiles once (every candidate saved) and each slow test
adds one to three compiles of a one-layer GPT-2."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memplan.api.integrations.torch_compile import (
    CompileInfeasible,
    compile_with_budget,
)
from memplan.planner.core.errors import Infeasible, MemplanError, WorkloadError
from memplan.planner.core.simulator import simulate
from memplan.planner.probe.measure import measure_step
from memplan.planner.workloads import default_optimizer, load_workload

# the knapsack is AOTAutograd's min-cut partitioner's, which this backend runs without generating kernels: the
# partition and its measured memory without inductor's minutes of C++ compiles on a cold cache (one test below
# compiles with inductor)
BACKEND = "aot_eager_decomp_partition"
TINY = dict(n_layer=1, n_embd=64, n_head=2, vocab_size=512, seq_len=64, batch_size=4, dropout=0.0)


def tiny():
    return load_workload("gpt2", **TINY)


@pytest.fixture(scope="module")
def saved_everything():
    """The compiled step with every candidate saved (a budget nothing reaches): its result and workload."""
    w = tiny()
    return compile_with_budget(w.model, w.batch, w.loss_fn, 10**12, backend=BACKEND), w


@pytest.mark.slow
def test_an_ample_budget_compiles_once_saving_every_candidate(saved_everything):
    r, w = saved_everything
    assert len(r.attempts) == 1 and r.attempts[0].recomputed == 0 and r.attempts[0].saved > 0
    assert r.measured_peak_bytes == r.attempts[0].measured_peak_bytes
    # the compiled graph as memplan saw it: every candidate of the knapsack stands for a storage of its own
    assert r.graph is not None and len(r.graph.ops) > 50
    recomputable = [t for t in r.graph.saved_activations if r.graph.tensors[t].recomputable]
    assert len(recomputable) >= r.attempts[0].saved
    assert simulate(r.graph, timeline=False).peak_bytes == r.attempts[0].simulated_peak_bytes
    # the model was restored after the measured steps: the compiled loss is the eager loss of the same weights
    eager = w.loss_fn(w.model, w.batch)
    assert torch.allclose(r.module(w.batch), eager, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_budget_below_saving_everything_recomputes_and_the_step_stays_within_it(saved_everything):
    full = saved_everything[0].measured_peak_bytes
    budget = full - 1  # anything below saving everything: how far recomputation reaches depends on the kernels
    w = tiny()
    opt = default_optimizer(w.model)
    r = compile_with_budget(w.model, w.batch, w.loss_fn, budget, optimizer=opt, backend=BACKEND)
    assert r.measured_peak_bytes <= budget < full
    accepted = r.attempts[-1]
    assert accepted.recomputed > 0 and accepted.solver_budget_bytes is not None
    assert accepted.simulated_peak_bytes <= accepted.solver_budget_bytes  # memplan's plan fit its budget
    # trained afterwards, outside compile_with_budget (no config patched): the same compiled code, within budget
    again = measure_step(r.module, w.batch, lambda m, b: m(b), opt, steps=1, warmup=1)
    assert again.peak_bytes <= budget


@pytest.mark.slow
def test_a_budget_the_partitioner_cannot_reach_is_refused_with_the_least_measured_peak(saved_everything):
    w = tiny()
    params = sum(p.numel() * p.element_size() for p in w.model.parameters())
    batch = sum(t.numel() * t.element_size() for t in w.batch.values())
    budget = 2 * params + batch  # above what every step holds, far below what any compile reaches
    with pytest.raises(CompileInfeasible, match="below every compiled step the partitioner reached") as e:
        compile_with_budget(w.model, w.batch, w.loss_fn, budget, tries=1, backend=BACKEND)
    measured = [a.measured_peak_bytes for a in e.value.attempts]
    assert [a.note for a in e.value.attempts] == ["every candidate saved", "every candidate recomputed"]
    assert e.value.min_feasible_bytes == min(measured) > budget


def test_a_budget_below_what_every_step_holds_is_refused_before_compiling():
    w = tiny()
    with pytest.raises(Infeasible, match=r"below the parameters, their gradients and the batch") as e:
        compile_with_budget(w.model, w.batch, w.loss_fn, 1000)
    assert e.value.budget_bytes == 1000 and e.value.min_feasible_bytes is None


@pytest.mark.parametrize("budget", [0, -5, 2.5e6, "3MiB", True])
def test_a_budget_that_is_not_a_positive_byte_count_is_refused(budget):
    w = tiny()
    with pytest.raises(MemplanError, match="budget_bytes must be a positive number of bytes"):
        compile_with_budget(w.model, w.batch, w.loss_fn, budget)


def test_an_already_compiled_model_is_refused():
    w = tiny()
    with pytest.raises(WorkloadError, match="compiled with torch.compile"):
        compile_with_budget(torch.compile(w.model), w.batch, w.loss_fn, 10**9)


class Breaks(nn.Module):
    """A graph break: control flow on a tensor's value."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        return self.b(h) if h.sum().item() > 0 else -self.b(h)


def test_a_graph_break_is_refused_in_one_line():
    torch.manual_seed(0)
    model, x = Breaks(), torch.randn(4, 8)
    with pytest.raises(MemplanError, match=r"does not compile as one graph \(a graph break") as e:
        compile_with_budget(model, x, lambda m, b: m(b).square().mean(), 10**9)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_memplans_op_times_serve_torchs_own_knapsack():
    from torch._functorch import config as functorch_config

    from memplan.api.integrations.torch_compile import MemplanRuntimeEstimator

    timed = []

    class Recording(MemplanRuntimeEstimator):
        def __call__(self, node):
            seconds = super().__call__(node)
            timed.append((str(node.target), seconds))
            return seconds

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 1))
    x = torch.randn(128, 64)
    torch.compiler.reset()
    with functorch_config.patch(activation_memory_budget=0.3, activation_memory_budget_runtime_estimator=Recording()):
        torch.compile(model, fullgraph=True)(x).sum().backward()
    assert timed and all(seconds > 0 for _, seconds in timed)  # the candidates torch's knapsack priced
    assert any("mm" in name for name, _ in timed)
