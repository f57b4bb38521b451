"""The profiler on small models whose graph can be written down by hand: op names, storages, saves,
lifetimes, module paths, the JSON round trip and the model fingerprint."""

import pytest
import torch
from torch import nn

from memplan.planner.core.errors import WorkloadError
from memplan.planner.core.graph import Graph
from memplan.planner.core.replay import reads_mid_chain
from memplan.planner.probe.profiler import model_fingerprint, profile


def _profile(model, batch, loss_fn, **kw):
    kw.setdefault("optimizer", torch.optim.SGD(model.parameters(), lr=1e-3, foreach=False))
    return profile(model, batch, loss_fn, device="cpu", progress=False, measure=False, repeats=1, **kw)


def _sum_loss(model, x):
    return model(x).sum()


@pytest.fixture(scope="module")
def mlp_graph():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    return _profile(model, torch.randn(5, 4), _sum_loss)


def _names(graph):
    return [op.name for op in graph.ops]


def test_linear_relu_ops_and_modules(mlp_graph):
    assert _names(mlp_graph) == [
        "aten.t.default", "aten.addmm.default",            # 0: Linear(4, 3)
        "aten.relu.default", "aten.detach.default",        # 1: ReLU (autograd saves its result)
        "aten.t.default", "aten.addmm.default",            # 2: Linear(3, 2)
        "aten.sum.default",                                # the loss
    ]
    assert [op.module for op in mlp_graph.ops] == ["0", "0", "1", "1", "2", "2", "loss"]


def test_kinds_and_bytes(mlp_graph):
    g = mlp_graph
    kinds = [t.kind for t in g.tensors]
    assert kinds[:5] == ["param"] * 4 + ["input"]
    assert all(t.requires_grad for t in g.tensors[:4]) and not g.tensors[4].requires_grad
    assert g.fixed.params_bytes == (4 * 3 + 3 + 3 * 2 + 2) * 4
    assert g.fixed.inputs_bytes == 5 * 4 * 4
    h1, r1, h2, loss = (g.ops[i].outputs for i in (1, 2, 5, 6))
    assert [g.tensors[t].bytes for t in h1 + r1 + h2 + loss] == [5 * 3 * 4, 5 * 3 * 4, 5 * 2 * 4, 4]
    # t() and detach are views: they create no storage, so nothing is counted twice
    assert g.ops[0].outputs == g.ops[3].outputs == g.ops[4].outputs == []
    assert len(g.tensors) == 5 + 4


def test_saved_tensors_and_lifetimes(mlp_graph):
    g = mlp_graph
    w2 = 2  # the second Linear's weight: the second t()'s input
    (h1,), (r1,), (h2,), (loss,) = (g.ops[i].outputs for i in (1, 2, 5, 6))
    assert g.ops[2].saved == [r1]                 # relu saves its result
    assert set(g.ops[5].saved) == {r1, w2}        # addmm saves mat1 (r1) and mat2 (the weight's storage)
    assert g.ops[1].saved == [4]                  # the first addmm saves the input batch only
    assert g.saved_activations == [r1]
    # addmm's output is read by relu, then dropped by Sequential before the next layer
    assert g.tensors[h1].freed_after == 3 and g.consumers[h1] == [2]
    assert g.tensors[loss].held_by_caller and not g.tensors[r1].held_by_caller
    assert all(g.tensors[t].recomputable for t in (h1, r1, h2))
    assert [op.has_backward for op in g.ops] == [True, True, True, False, True, True, True]


def test_backward_gradient_figures(mlp_graph):
    g = mlp_graph
    # step of the last addmm: grad of r1 (5x3) + grad of W2 (2x3) + grad of b2 (2) are created and kept
    assert g.ops[5].backward_grad_alloc_bytes == (5 * 3 + 2 * 3 + 2) * 4
    # relu's step creates the grad of h1 and releases the grad of r1
    assert g.ops[2].backward_grad_alloc_bytes == 5 * 3 * 4
    assert g.ops[2].backward_grad_free_bytes == 5 * 3 * 4
    assert all(op.backward_time_s >= 0 for op in g.ops) and g.ops[1].backward_time_s > 0


def test_graph_round_trips_through_json(mlp_graph):
    again = Graph.from_json(mlp_graph.model_dump_json())
    assert again == mlp_graph and again.fingerprint == mlp_graph.fingerprint


def test_nested_module_paths_and_inplace():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.act = nn.ReLU(inplace=True)

        def forward(self, x):
            return self.act(self.fc(x)).transpose(0, 1)

    model = nn.Sequential()
    model.add_module("encoder", nn.Sequential(Block(), Block()))
    g = _profile(model, torch.randn(4, 4), _sum_loss)
    assert {op.module for op in g.ops} == {"encoder.0.fc", "encoder.0.act", "encoder.0", "encoder.1.fc",
                                           "encoder.1.act", "encoder.1", "loss"}
    relu = next(op for op in g.ops if op.name == "aten.relu_.default")
    addmm_out = g.ops[relu.id - 1].outputs[0]
    # relu_ writes addmm's output in place: no new storage; nothing read it before, so replaying addmm
    # and then relu_ rebuilds what backward saw
    assert relu.outputs == [] and relu.inputs == [addmm_out]
    assert g.meta["mutated_by"][str(addmm_out)] == [relu.id]
    assert g.tensors[addmm_out].recomputable and g.tensors[addmm_out].rebuilt_by == [relu.id]


def test_a_reader_before_an_inplace_chain_is_replayed_mid_chain(mid_chain_reader):
    g = _profile(mid_chain_reader(), torch.randn(4, 4), lambda m, x: m(x))
    mutated = {int(t): ops for t, ops in g.meta["mutated_by"].items()}
    assert len(mutated) == 2
    for t, ops in mutated.items():  # h (addmm + relu_) and r (addmm + add_ of y)
        assert g.tensors[t].recomputable and g.tensors[t].rebuilt_by == ops
    mul = next(op for op in g.ops if op.name == "aten.mul.Tensor")
    (y,) = mul.outputs
    (h,) = [t for t in mul.inputs if reads_mid_chain(g, mul.id, t)]
    assert g.tensors[y].recomputable and h in mutated


def test_dropout_mask_is_rebuilt_by_its_initialisers():
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    g = _profile(model, torch.randn(4, 8), lambda m, x: m(x).sum())
    rebuilt = [t for t in g.tensors if t.rebuilt_by]
    if not rebuilt:
        pytest.skip("this build's dropout is one op (native_dropout): nothing is initialised in place")
    (mask,) = rebuilt
    names = [g.ops[m].name for m in mask.rebuilt_by]
    assert names[0].startswith("aten.bernoulli_") and mask.recomputable
    assert all(g.ops[m].random == ("bernoulli" in g.ops[m].name) for m in mask.rebuilt_by)
    assert mask.id in g.saved_activations  # the mul that applies it keeps it for backward


def test_dropout_is_random_and_storages_alias():
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    g = _profile(model, torch.randn(4, 8), lambda m, x: m(x).view(-1).sum())
    assert any(op.random for op in g.ops)
    assert not any(op.random for op in g.ops if "bernoulli" not in op.name)
    # every activation is one storage: the sum of storages equals what the ops created
    created = sum(g.tensors[t].bytes for op in g.ops for t in op.outputs)
    assert created == sum(t.bytes for t in g.tensors if t.kind == "activation")


def test_model_fingerprint():
    torch.manual_seed(0)
    a = model_fingerprint(nn.Linear(4, 3))
    assert len(a) == 16 and int(a, 16) >= 0
    assert model_fingerprint(nn.Linear(4, 3)) == a                   # other weights, same model
    assert model_fingerprint(nn.Linear(4, 2)) != a                   # a shape changed
    assert model_fingerprint(nn.Linear(4, 3).double()) != a          # a dtype changed
    assert model_fingerprint(nn.Sequential(nn.Linear(4, 3))) != a    # a name changed


def test_graph_carries_the_model_fingerprint(mlp_graph):
    torch.manual_seed(0)
    assert mlp_graph.model_fingerprint == model_fingerprint(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)))


def test_bad_loss_and_arguments():
    model = nn.Linear(4, 3)
    with pytest.raises(WorkloadError, match=r"scalar tensor that requires grad, got a tensor of shape \[2, 3\]"):
        _profile(model, torch.randn(2, 4), lambda m, x: m(x))
    with pytest.raises(ValueError, match="warmup >= 1"):
        profile(model, torch.randn(2, 4), _sum_loss, warmup=0, progress=False)


def test_profiling_measures_and_leaves_the_model_as_it_was_unless_asked():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    before = model.weight.detach().clone()
    g = profile(model, torch.randn(2, 4), _sum_loss, device="cpu", progress=False, repeats=1)
    assert torch.equal(before, model.weight) and model.weight.grad is None  # the profile's steps were undone
    profile(model, torch.randn(2, 4), _sum_loss, device="cpu", progress=False, repeats=1, restore=False)
    assert not torch.equal(before, model.weight)
    assert g.measured.peak_bytes is not None and g.measured.peak_bytes >= g.fixed.resident_bytes
    assert g.fixed.optimizer_state_bytes == 2 * g.fixed.params_bytes + 4 * 2  # exp_avg, exp_avg_sq, step
    assert g.optimizer_time_s > 0 and g.device == "cpu"


def test_a_saved_tensor_the_model_keeps_past_its_last_use_is_charged_until_dropped():
    # h is saved (by tanh, its own producer, and by the next Linear) and last read by b, but the model
    # keeps a reference until its forward returns; autograd holds it in the traced step, so only the
    # profiler's forward without autograd's hold can see that
    class Keeps(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            h = torch.tanh(self.a(x))
            kept = [h]
            y = self.c(torch.tanh(self.b(h)))
            return y * 2 + 0 * len(kept)

    g = _profile(Keeps(), torch.randn(16, 8), _sum_loss)
    assert g.meta["lifetimes_aligned"] is True
    tanh = next(op for op in g.ops if op.name == "aten.tanh.default")
    (h,) = tanh.outputs
    last_reader = max(op.id for op in g.ops if h in op.inputs)
    assert g.tensors[h].freed_after is not None and g.tensors[h].freed_after > last_reader
    # dropped when the forward returns: after the model's last op, before the loss's
    assert g.tensors[h].freed_after == max(op.id for op in g.ops if op.module != "loss")


def test_op_times_sum_to_a_plain_steps():
    """The traced op times are scaled to what plain eager training pays (profile: the measured or a plain
    step's forward, backward and optimizer times); the factors are kept in the graph's meta."""
    from memplan.planner.core.synthetic import linear_chain
    from memplan.planner.probe.profiler import calibrate_times

    g = linear_chain(4)  # forward 1 s, backward 2 s per op
    calibrate_times(g, 2.0, 4.0, 0.5)
    assert [op.time_s for op in g.ops] == [0.5] * 4 and [op.backward_time_s for op in g.ops] == [1.0] * 4
    assert g.optimizer_time_s == 0.5
    assert g.meta["time_calibration"]["forward"] == 0.5 and g.meta["time_calibration"]["backward"] == 0.5


def test_a_profiled_graph_is_timed_as_plain_training(mlp_graph):
    cal = mlp_graph.meta["time_calibration"]
    assert sum(op.time_s for op in mlp_graph.ops) == pytest.approx(cal["plain_forward_s"])
    assert sum(op.backward_time_s for op in mlp_graph.ops) == pytest.approx(cal["plain_backward_s"])
    assert mlp_graph.optimizer_time_s == cal["plain_optimizer_s"] and mlp_graph.replay_op_dispatch_s > 0
