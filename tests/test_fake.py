"""Fake profiling (issue #10): the graph traced under FakeTensorMode equals the real profile's in every
field but the times, on every built-in and on a model defined here (built on the meta device too); op
timing alone (cached) or analytic from a device spec; profiling inside a budget; the refusals.

Fields that differ by design, and are left out of the comparison: ``time_s``, ``backward_time_s``,
``optimizer_time_s`` and ``time_source`` (timed differently), ``measured`` (a fake profile measures no
step), ``meta``, ``host_bandwidth_bytes_per_s`` on CUDA, and ``fixed.optimizer_step_bytes``, which a real
profile takes from the allocator (a few bytes of the optimizer kernels' scratch above the storages it
sees) and a fake one from the storages alone (and with it each backward-fused bucket's share of it,
``fused_backward[].step_bytes``).
"""

import copy
import json

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from memplan.api.cli import app
from memplan.executor.session import run_plan
from memplan.planner.core.devicespec import DeviceSpecError, load_device_spec, parse_device_spec
from memplan.planner.core.simulator import simulate
from memplan.planner.probe.fake import FakeGuard, FakeTraceError
from memplan.planner.probe.optime import OpCall, OpTimer, TensorMeta, analytic_time_s
from memplan.planner.probe.profiler import profile
from memplan.planner.workloads import load_workload
from memplan.solvers import solve


def _real(w, **kw):
    return profile(w.model, w.batch, w.loss_fn, device="cpu", progress=False, measure=False, repeats=1,
                   name=w.name, **kw)


def _fake(w, cache, **kw):
    timer = OpTimer(torch.device("cpu"), cache_dir=cache, min_runs=1, target_s=0.0, eager=False)
    return profile(w.model, w.batch, w.loss_fn, device="cpu", progress=False, fake=True, timer=timer,
                   name=w.name, **kw)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One op-time cache for the module (``$MEMPLAN_CACHE_DIR/optimes`` with the root below)."""
    root = tmp_path_factory.mktemp("memplan-cache")
    (root / "optimes").mkdir()
    return root / "optimes"


@pytest.mark.parametrize("name", ["mlp", pytest.param("unet", marks=pytest.mark.slow),
                                  pytest.param("resnet", marks=pytest.mark.slow),
                                  pytest.param("gpt2", marks=pytest.mark.slow),
                                  pytest.param("bert", marks=pytest.mark.slow)])
def test_fake_graph_equals_the_real_profile_on_builtins(name, cache, same_structure):
    small = {"mlp": {"depth": 4}, "unet": {"channels": (8, 16, 32), "image_size": 32},
             "resnet": {"image_size": 32, "batch_size": 4}, "gpt2": {"n_layer": 2, "seq_len": 64},
             "bert": {"num_hidden_layers": 2, "seq_len": 64}}[name]
    w = load_workload(name, **small)
    fake = _fake(w, cache)
    real = _real(w)
    same_structure(real, fake)
    assert all(op.time_source == "isolated" for op in fake.ops)
    assert all(op.time_source == "measured" for op in real.ops)
    assert fake.meta["fake"] is True and fake.measured.peak_bytes is None


class TwoBlocks(nn.Module):
    """A model of this file: a residual MLP block with layer norm and dropout, and a GELU head."""

    def __init__(self, width=32):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        h = x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))
        return self.head(h)


def _ce(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def test_a_model_built_on_the_meta_device_gives_the_real_graph(cache, same_structure):
    batch = (torch.randn(16, 32), torch.randint(0, 10, (16,)))
    with torch.device("meta"):
        meta_model = TwoBlocks()
    torch.manual_seed(0)
    real_model = TwoBlocks()
    opt = torch.optim.SGD(meta_model.parameters(), lr=0.1, momentum=0.9)
    fake = profile(meta_model, batch, _ce, device="cpu", progress=False, fake=True, optimizer=opt,
                   timer=OpTimer(torch.device("cpu"), cache_dir=cache, min_runs=1, target_s=0.0))
    real = profile(real_model, batch, _ce, device="cpu", progress=False, measure=False, repeats=1,
                   optimizer=torch.optim.SGD(real_model.parameters(), lr=0.1, momentum=0.9))
    same_structure(real, fake)
    assert fake.fixed.optimizer_state_bytes == fake.fixed.params_bytes  # SGD momentum buffers, fake
    # nothing of the model was materialised, and its optimizer kept no state
    assert all(p.device.type == "meta" for p in meta_model.parameters()) and not opt.state


def test_the_users_model_and_optimizer_are_left_untouched(cache):
    torch.manual_seed(0)
    model = TwoBlocks()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    opt = torch.optim.AdamW(model.parameters())
    _fake(type("W", (), {"model": model, "batch": (torch.randn(8, 32), torch.zeros(8, dtype=torch.long)),
                         "loss_fn": staticmethod(_ce), "name": "two"})(), cache, optimizer=opt)
    assert list(model.parameters()) == params and all(type(p) is nn.Parameter for p in params)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not opt.state and all(p.grad is None for p in params)


def test_op_times_are_cached_repeated_layers_and_later_profiles_run_nothing(tmp_path):
    w = load_workload("mlp", depth=6, width=64, batch_size=32)
    first = _fake(w, tmp_path)
    stats = first.meta["op_timing"]
    # six identical layers: each distinct call runs once
    assert stats["distinct"] < stats["calls"] / 3 and stats["isolated_runs"] == stats["distinct"]
    assert (tmp_path / "optimes.sqlite").is_file()
    again = _fake(w, tmp_path)
    assert again.meta["op_timing"]["isolated_runs"] == 0
    assert again.meta["op_timing"]["cache_hits"] == stats["distinct"]
    assert all(op.time_s > 0 for op in first.ops if op.name == "aten.addmm.default")


def test_device_spec_times_ops_analytically_and_rounds_cuda_blocks(tmp_path):
    spec = load_device_spec("h100-80gb")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 3))
    g = profile(model, torch.randn(512, 1024), lambda m, x: m(x).sum(), progress=False, device_spec=spec,
                cache_dir=tmp_path)
    assert g.device == "cuda" and g.meta["device_spec"] == "h100-80gb"
    assert all(op.time_source == "analytic" for op in g.ops)
    assert g.host_bandwidth_bytes_per_s == spec.host_bandwidth_bytes_per_s
    addmm = next(op for op in g.ops if op.name == "aten.addmm.default")
    flops = 2 * 512 * 1024 * 1024
    moved = (1024 + 512 * 1024 + 1024 * 1024 + 512 * 1024) * 4
    flops_per_s, bytes_per_s = spec.rates("matmul", "float32")  # achieved, not the 67 TFLOP/s peak
    assert flops_per_s < 67e12 and bytes_per_s < 3.35e12
    assert addmm.time_s == pytest.approx(spec.op_overhead_s + max(flops / flops_per_s, moved / bytes_per_s))
    # the loss (4 bytes) and the last layer's output (512 x 3 floats) are charged as 512-byte blocks
    assert all(t.bytes % 512 == 0 for t in g.tensors)
    assert g.fixed.params_bytes == sum(-(-p.numel() * 4 // 512) * 512 for p in model.parameters())
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert not (tmp_path / "optimes.sqlite").exists()  # nothing ran


def test_a_call_that_cannot_run_alone_is_timed_analytically(tmp_path):
    bad = OpCall(torch.ops.aten.mm.default,
                 (TensorMeta((4, 5), (5, 1), 0, torch.float32, 0, 80), TensorMeta((6, 7), (7, 1), 0, torch.float32, 1, 168)),
                 {}, "cpu", flops=2 * 4 * 5 * 7, written_bytes=4 * 7 * 4)
    timer = OpTimer(torch.device("cpu"), cache_dir=tmp_path, min_runs=1, target_s=0.0)
    (timing,) = timer.time([bad])
    assert timing.source == "analytic" and timer.stats.analytic == 1 and timer.stats.isolated_runs == 0
    assert timing.time_s == pytest.approx(analytic_time_s(bad, timer.local_spec()))
    assert timer.local_spec().peak_flops_per_s["float32"] > 0
    assert list(tmp_path.glob("device-*.json"))  # this machine's figures, measured once and cached


def _data_dependent(kind):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(4, 4)

        def forward(self, x):
            h = self.gate(x)
            if kind == "nonzero":
                return h[h.nonzero(as_tuple=True)].sum()
            return h.sum() * 2 if h.sum().item() > 0 else h.sum()

    return Model()


@pytest.mark.parametrize("kind, op", [("nonzero", "aten.nonzero"), ("item", "aten._local_scalar_dense")])
def test_a_step_that_cannot_run_under_fake_tensors_names_the_op_and_module(kind, op, tmp_path):
    with pytest.raises(FakeTraceError, match=rf"{op}.* in the model|{op}.* in \w*") as e:
        profile(_data_dependent(kind), torch.randn(3, 4), lambda m, x: m(x), progress=False, fake=True,
                cache_dir=tmp_path)
    assert "profile without --fake" in str(e.value) and "\n" not in str(e.value)


def test_cli_fake_refusals_write_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.py").write_text(
        "import torch\nfrom torch import nn\n"
        "def build():\n"
        "    m = nn.Linear(4, 4)\n"
        "    return m, torch.randn(3, 4), lambda m, x: m(x)[m(x) > 0].sum()\n")
    runner = CliRunner()
    r = runner.invoke(app, ["plan", "bad.py:build", "--fake", "-o", "plan.json", "--graph", "graph.json"])
    assert r.exit_code == 2 and "aten.index.Tensor in loss" in r.output and "without --fake" in r.output
    assert not (tmp_path / "plan.json").exists() and not (tmp_path / "graph.json").exists()
    r = runner.invoke(app, ["plan", "mlp", "--device-spec", "v100"])
    assert r.exit_code == 2 and "a100-80gb, h100-80gb, l4, rtx-4090" in r.output
    (tmp_path / "spec.json").write_text(json.dumps({"name": "x", "device": "cuda", "memory_bytes": 1,
                                                    "peak_flops_per_s": {"float32": -1},
                                                    "memory_bandwidth_bytes_per_s": 1e9,
                                                    "host_bandwidth_bytes_per_s": 1e9}))
    r = runner.invoke(app, ["profile", "mlp", "--device-spec", "spec.json", "-o", "g.json"])
    assert r.exit_code == 2 and "peak_flops_per_s.float32" in r.output and not (tmp_path / "g.json").exists()


def test_device_spec_files_are_validated_by_field():
    with pytest.raises(DeviceSpecError, match="field memory_bandwidth_bytes_per_s"):
        parse_device_spec('{"name": "x", "device": "cuda", "memory_bytes": 1, "peak_flops_per_s": '
                          '{"float32": 1e12}, "host_bandwidth_bytes_per_s": 1e9}', source="x.json")
    with pytest.raises(DeviceSpecError, match="field device"):
        parse_device_spec('{"name": "x", "device": "tpu", "memory_bytes": 1, "peak_flops_per_s": {"float32": 1},'
                          '"memory_bandwidth_bytes_per_s": 1, "host_bandwidth_bytes_per_s": 1}', source="x.json")
    for name in ("a100-80gb", "h100-80gb", "l4", "rtx-4090"):
        spec = load_device_spec(name.upper())
        assert spec.device == "cuda" and spec.flops_per_s("bfloat16") > spec.flops_per_s("float32") / 2


# ---- profiling inside the budget ------------------------------------------------------------------------

OVER = {"depth": 24, "width": 64, "batch_size": 4096}  # keep-everything needs more than twice the budget


@pytest.mark.slow
def test_fake_profile_plan_and_run_never_hold_more_than_the_budget(cache):
    w = load_workload("mlp", **OVER)
    graph = _fake(w, cache)
    keep_all = simulate(graph, None).peak_bytes
    budget = keep_all * 45 // 100
    assert keep_all > 2 * budget
    result = solve(graph, budget, "auto", time_limit_s=3)
    report = run_plan(w.model, w.batch, w.loss_fn, None, result.plan, graph, steps=1, warmup=1, keep_all=False)
    assert report.profile_peak_bytes is not None and report.profile_peak_bytes <= budget
    assert report.measured_peak_bytes == report.predicted_peak_bytes <= budget
    assert report.keep_all_measured_peak_bytes is None and report.keep_all_predicted_peak_bytes == keep_all


@pytest.mark.slow
def test_cli_run_fake_reports_the_profiling_peak(cache, monkeypatch):
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(cache.parent))  # the ops the test above timed
    sets = [x for k, v in OVER.items() for x in ("--set", f"{k}={v}")]
    r = CliRunner().invoke(app, ["run", "mlp", "--fake", "--budget", "14MiB", "--steps", "1", "--time-limit", "3", "--json", *sets])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    budget = doc["budget_bytes"]
    assert doc["profile_peak_bytes"] <= budget and doc["measured_peak_bytes"] <= budget
    assert doc["keep_all_measured_peak_bytes"] is None and doc["keep_all_predicted_peak_bytes"] > 2 * budget


# ---- ranks without the ranks --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_fake_ranks_predict_each_ranks_peak_as_the_real_profile_does(engine, cache, monkeypatch):
    from memplan.api.distributed import block_prefixes, plan_ranks_fake
    from memplan.planner.probe.distributed import for_ddp, for_fsdp, fsdp_units

    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(cache.parent))
    opts = {"n_layer": 2, "seq_len": 64}
    rows = plan_ranks_fake("gpt2", world_size=4, engine=engine, budget="80%", time_limit_s=3, trace=False,
                           workload_options=opts)
    assert sorted(r["rank"] for r in rows if r["plan"] == "keep all") == [0, 1, 2, 3]
    w = load_workload("gpt2", **opts)
    real = _real(w)
    prefixes = block_prefixes(w.model)
    rank_graph = for_ddp(real, 4) if engine == "ddp" else for_fsdp(real, fsdp_units(w.model, prefixes, 4), 4)
    keep = simulate(rank_graph, None).peak_bytes
    assert {r["predicted_peak_bytes"] for r in rows if r["plan"] == "keep all"} == {keep}
    planned = {r["predicted_peak_bytes"] for r in rows if r["plan"] != "keep all"}
    assert len(planned) == 1 and planned.pop() < keep


class PositionCheck(nn.Module):
    """Branches on position ids made by ``torch.arange``, as transformers' packed-sequence check does."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        pos = torch.arange(x.shape[1])
        if bool((pos[1:] - pos[:-1] == 1).all()):  # Python branching on a value
            return self.lin(x).sum(1)
        return self.lin(x * 2).sum(1)


def test_small_constants_are_made_for_real_so_code_branching_on_them_takes_the_real_path(cache, same_structure):
    model, x = PositionCheck(), torch.randn(4, 8, 8)
    real = profile(model, x, lambda m, b: m(b).pow(2).mean(), device="cpu", progress=False, measure=False,
                   repeats=1)
    fake = profile(model, x, lambda m, b: m(b).pow(2).mean(), device="cpu", progress=False, fake=True,
                   timer=OpTimer(torch.device("cpu"), cache_dir=cache, min_runs=1, target_s=0.0))
    same_structure(real, fake)


def _one_step(model, x, loss_fn, plan=None, graph=None):
    """One step of a copy of ``model`` (under ``plan`` when given): its loss, gradients and executor."""
    from memplan.executor import apply

    m = copy.deepcopy(model)
    ex = apply(m, plan, graph=graph) if plan is not None else None
    try:
        loss = loss_fn(m, x)
        loss.backward()
    finally:
        if ex is not None:
            ex.remove()
    return loss.detach(), [p.grad for p in m.parameters()], ex


class SliceWrites(nn.Module):
    """Writes results into views of a fresh buffer, as DeepSeek-V3's attention builds its keys: slices,
    a slice of a select (a view of a view), an in-place op on a view of a buffer that requires grad by then,
    and an item assignment."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(12, 16)

    def forward(self, x):
        k, r = self.a(x), self.b(x)
        buf = k.new_empty(*k.shape[:-1], 12)
        buf[..., :8].copy_(k)
        buf[..., 8:].copy_(r)
        buf[1][..., :4].mul_(2.0)
        buf[2] = buf[2] * 0.5
        return nn.functional.gelu(self.c(torch.tanh(buf))).pow(2).mean()


def test_writes_into_views_of_a_buffer_trace_as_the_real_step_and_train_bitwise(cache, same_structure, tmp_path):
    """Under fake tensors autograd rebuilds a view's grad_fn after an in-place write by replaying the view
    (planner/probe/fake.py ViewReplays) with the view's mutex held: the tracer read that view's grad_fn
    inside the replay and the fake profile waited forever (holding the GIL: nothing in the process ran
    again); the replayed ops were also recorded, ops the real step never runs. The fake profile runs in a
    child process, so that a hang fails the test instead of stopping the suite."""
    import inspect
    import subprocess
    import sys

    from memplan.planner.core.graph import Graph

    out = tmp_path / "fake.json"
    code = "\n".join([
        "import torch", "from torch import nn", "from memplan.planner.probe.optime import OpTimer",
        "from memplan.planner.probe.profiler import profile", inspect.getsource(SliceWrites),
        "torch.manual_seed(0)", "model, x = SliceWrites(), torch.randn(4, 3, 8)",
        f"timer = OpTimer(torch.device('cpu'), cache_dir={str(cache)!r}, min_runs=1, target_s=0.0)",
        "g = profile(model, x, lambda m, b: m(b), device='cpu', progress=False, fake=True, timer=timer)",
        f"open({str(out)!r}, 'w').write(g.model_dump_json())"])
    try:
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120, capture_output=True)
    except subprocess.TimeoutExpired:
        pytest.fail("the fake profile of writes into views did not finish (waited on a view's autograd mutex)")
    fake = Graph.model_validate_json(out.read_text())
    torch.manual_seed(0)
    model, x = SliceWrites(), torch.randn(4, 3, 8)
    loss_fn = lambda m, b: m(b)  # noqa: E731
    real = profile(model, x, loss_fn, device="cpu", progress=False, measure=False, repeats=1)
    same_structure(real, fake)
    assert [op.name for op in fake.ops].count("aten.copy_.default") == 3

    from memplan.solvers.bounds import memory_lower_bound

    keep, low = simulate(fake, None).peak_bytes, memory_lower_bound(fake)
    plans = [solve(fake, low + int((keep - low) * f), "auto", time_limit_s=5).plan for f in (0.3, 0.6, 0.9)]
    plan = max(plans, key=lambda p: simulate(fake, p).recomputed_ops)
    assert simulate(fake, plan).recomputed_ops > 0

    want_loss, want_grads, _ = _one_step(model, x, loss_fn)
    loss, grads, _ = _one_step(model, x, loss_fn, plan, fake)
    assert torch.equal(loss, want_loss) and all(map(torch.equal, grads, want_grads))


class MaskThroughViews(nn.Module):
    """Longformer's ``_mask_invalid_locations``: scores written through a slice of one view of them (a
    view of a view), then that view read again (stale: autograd rebuilds it first), and the same chain
    of views made anew by the program itself beside the stale view."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 24), nn.Linear(6, 8)

    def forward(self, x):
        r = self.a(x)  # [4, 3, 24]
        v = r.view(4, 3, 4, 6).transpose(1, 2)
        head = v[:, :2, :, :3]
        v[:, :2, :, :3] = torch.full_like(head, -1.0).where(head > 0, head)
        tail = v[:, -2:, :, -3:]  # v is stale here
        v[:, -2:, :, -3:] = tail * 0.5
        again = r.view(4, 3, 4, 6).transpose(1, 2)  # the program's own chain, v stale beside it
        return self.b(torch.tanh(again + v)).pow(2).mean()


def test_views_rebuilt_after_a_write_through_another_view_are_not_ops_of_the_step(cache, same_structure):
    """Under fake tensors autograd rebuilds a stale view lazily, by replaying its chain of views on the
    base just before the op that reads it: the fake graph had those ops (8 more than the real step on a
    2-layer Longformer; the executor re-synchronised past them). They are held until the next op shows
    whether it reads the view (planner/probe/fake.py ViewReplays); the program's own identical chain is
    kept. The fake graph is the real one, and its plan trains bitwise."""

    torch.manual_seed(0)
    model, x = MaskThroughViews(), torch.randn(4, 3, 8)
    loss_fn = lambda m, b: m(b)  # noqa: E731
    real = profile(copy.deepcopy(model), x, loss_fn, device="cpu", progress=False, measure=False, repeats=1)
    fake = profile(copy.deepcopy(model), x, loss_fn, device="cpu", progress=False, fake=True,
                   timer=OpTimer(torch.device("cpu"), cache_dir=cache, min_runs=1, target_s=0.0))
    same_structure(real, fake)
    names = [op.name for op in fake.ops]
    assert names.count("aten.transpose.int") == 2 and names.count("aten.copy_.default") == 2

    keep = simulate(fake, None).peak_bytes
    plan = solve(fake, keep - 1, "auto", time_limit_s=5).plan
    assert simulate(fake, plan).recomputed_ops > 0

    want_loss, want_grads, _ = _one_step(model, x, loss_fn)
    loss, grads, ex = _one_step(model, x, loss_fn, plan, fake)
    assert ex.last_step.replays > 0
    assert torch.equal(loss, want_loss) and all(map(torch.equal, grads, want_grads))


def _layer_norm(x):
    return nn.functional.layer_norm(x, x.shape[-1:], torch.ones(x.shape[-1]), torch.zeros(x.shape[-1]))


def _batch_norm(x):
    return nn.functional.batch_norm(x, None, None, torch.ones(x.shape[1]), torch.zeros(x.shape[1]), training=True)


# (function, shape, the permutation its input is stored in, whether the gradient comes in transposed)
LAYOUT_CASES = {
    "native_layer_norm_backward": (_layer_norm, (4, 8, 16), (0, 2, 1), True),
    "_log_softmax_backward_data": (lambda x: nn.functional.log_softmax(x, -1), (4, 8, 16), (0, 2, 1), True),
    "mse_loss_backward": (lambda x: nn.functional.mse_loss(x, torch.zeros_like(x)), (4, 8, 16), (0, 2, 1), False),
    "native_batch_norm": (_batch_norm, (2, 4, 6, 6), (0, 1, 3, 2), False),
    "native_batch_norm_backward": (_batch_norm, (2, 4, 6, 6), (0, 2, 3, 1), True),
    "smooth_l1_loss_backward": (lambda x: nn.functional.smooth_l1_loss(x, torch.zeros_like(x)), (4, 8, 16), (0, 2, 1),
                                False),
    "huber_loss_backward": (lambda x: nn.functional.huber_loss(x, torch.zeros_like(x)), (4, 8, 16), (0, 2, 1), False),
    "log_sigmoid_forward": (nn.functional.logsigmoid, (4, 8, 16), (0, 2, 1), False),
    "softplus_backward": (nn.functional.softplus, (4, 8, 16), (0, 2, 1), True),
    "hardswish_backward": (nn.functional.hardswish, (4, 8, 16), (0, 2, 1), True),
    "hardsigmoid_backward": (nn.functional.hardsigmoid, (4, 8, 16), (0, 2, 1), True),
    "hardtanh_backward": (nn.functional.relu6, (4, 8, 16), (0, 2, 1), True),
    "elu_backward": (nn.functional.selu, (4, 8, 16), (0, 2, 1), True),
}


class _Outputs(FakeGuard):
    """Runs each op for real, or under fake tensors through ``fake_call`` (``FakeGuard``), and records
    ``(op name, [what(output) for each tensor output])``."""

    def __init__(self, fake, what):
        super().__init__([])
        self.fake, self.what, self.rows = fake, what, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs) if self.fake else func(*args, **(kwargs or {}))
        if func is not torch.ops.prim.device.default:
            outs = out if isinstance(out, (tuple, list)) else [out]
            self.rows.append((str(func), [self.what(o) for o in outs if isinstance(o, torch.Tensor)]))
        return out


@pytest.mark.parametrize("op", list(LAYOUT_CASES))
def test_outputs_whose_layout_the_kernel_chooses_have_it_under_fake_tensors(op):
    """Each entry of planner/probe/fake.py's ``KERNEL_LAYOUTS``: the op on permuted inputs (and gradients), run
    for real and under fake tensors through ``fake_call``, makes outputs of the same strides, op by op
    (the meta functions alone follow the incoming strides: without the entry this fails)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memplan.planner.probe.fake import KERNEL_LAYOUTS

    fn, shape, perm, transposed_grad = LAYOUT_CASES[op]
    assert getattr(torch.ops.aten, op).default in KERNEL_LAYOUTS

    def run(fake):
        import contextlib

        with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
            base = torch.randn(*[shape[p] for p in perm], requires_grad=True)
            x = base.permute(*[perm.index(i) for i in range(len(perm))])
            mode = _Outputs(fake, lambda o: tuple(o.stride()))
            with mode:
                y = fn(x)
                if y.dim() == 0:
                    y.backward()
                else:
                    y.backward(torch.ones_like(y.transpose(0, -1).contiguous()).transpose(0, -1)
                               if transposed_grad else torch.ones_like(y))
        return mode.rows

    real, fake = run(False), run(True)
    assert any(name.startswith(f"aten.{op}.") for name, _ in real)
    assert fake == real


def test_only_small_seedless_constants_are_made_for_real():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from memplan.planner.probe.fake import REAL_CONSTANT_MAX_BYTES, fake_call

    aten = torch.ops.aten
    with FakeTensorMode():
        small = fake_call(aten.arange.default, (16,), {}, "m")
        large = fake_call(aten.zeros.default, ([REAL_CONSTANT_MAX_BYTES // 4 + 1],), {}, "m")
        drawn = fake_call(aten.randn.default, ([4],), {}, "m")
    assert not isinstance(small, FakeTensor) and torch.equal(small, torch.arange(16))
    assert isinstance(large, FakeTensor) and isinstance(drawn, FakeTensor)


class LayerDrop(nn.Module):
    """transformers 5.17's LayerDrop: every training step draws ``torch.rand([])`` and skips the layer when
    the draw is below ``layerdrop`` (0.0 by default: never)."""

    def __init__(self, layerdrop: float):
        super().__init__()
        self.layerdrop = layerdrop
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        dropout_probability = torch.rand([])
        if dropout_probability < self.layerdrop:
            return x
        return self.lin(x)


def test_a_branch_on_a_draw_that_every_value_answers_alike_is_taken_and_others_are_refused(cache, same_structure):
    """``torch.rand([]) < 0.0`` is false whatever the draw: the fake trace takes the branch the real step
    takes (it was refused: ``.item()`` of a fake tensor); at ``layerdrop`` 0.1 the branch depends on the
    draw, and the fake trace refuses it naming the op."""
    x = torch.randn(4, 8)

    def loss(m, b):
        return m(b).pow(2).mean()

    real = profile(LayerDrop(0.0), x, loss, device="cpu", progress=False, measure=False, repeats=1)
    fake = profile(LayerDrop(0.0), x, loss, device="cpu", progress=False, fake=True,
                   timer=OpTimer(torch.device("cpu"), cache_dir=cache, min_runs=1, target_s=0.0))
    same_structure(real, fake)
    assert any(op.name == "aten.addmm.default" for op in fake.ops)
    with pytest.raises(FakeTraceError, match="aten._local_scalar_dense"):
        profile(LayerDrop(0.1), x, loss, device="cpu", progress=False, fake=True,
                timer=OpTimer(torch.device("cpu"), cache_dir=cache, min_runs=1, target_s=0.0))


def test_a_draw_written_in_place_or_compared_with_a_number_inside_its_range_stays_fake():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from memplan.planner.probe.fake import fake_call

    aten = torch.ops.aten
    with FakeTensorMode():
        d = fake_call(aten.rand.default, ([],), {}, "m")
        below = fake_call(aten.lt.Scalar, (fake_call(aten.detach.default, (d,), {}, "m"), 0.0), {}, "m")
        above = fake_call(aten.ge.Scalar, (d, 1.5), {}, "m")
        inside = fake_call(aten.lt.Scalar, (d, 0.5), {}, "m")
        fake_call(aten.mul_.Scalar, (d, 4.0), {}, "m")  # values now in [0, 4)
        written = fake_call(aten.lt.Scalar, (d, 2.0), {}, "m")
    assert not isinstance(below, FakeTensor) and not below.item()
    assert not isinstance(above, FakeTensor) and not above.item()
    assert isinstance(inside, FakeTensor) and isinstance(written, FakeTensor)


class GroupedExperts(nn.Module):
    """Tokens routed to one of 4 experts by argmax, sorted, and multiplied in one float32 grouped product
    (a mixture-of-experts layer's static form: the offsets are data, the shapes are not)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(8, 4)
        self.experts = nn.Parameter(torch.randn(4, 8, 8) / 3)

    def forward(self, x):
        expert, order = torch.sort(self.router(x).argmax(-1))
        offs = torch.cumsum(torch.histc(expert.float(), bins=4, min=0, max=3), 0, dtype=torch.int32)
        return torch.nn.functional.grouped_mm(x[order], self.experts, offs=offs)


def test_a_call_whose_meta_function_refuses_what_the_kernel_runs_runs_the_kernel(cache, same_structure, caplog):
    """``_grouped_mm``'s meta function carries CUDA's checks (bfloat16 only) and refused the float32
    product the CPU kernel runs: the step was refused after torch logged a traceback. The kernel now runs
    on zeros for the outputs' metadata, quietly, and the fake graph is the real one."""
    model, x = GroupedExperts(), torch.randn(32, 8)
    loss = lambda m, b: m(b).pow(2).mean()  # noqa: E731
    real = profile(model, x, loss, device="cpu", progress=False, measure=False, repeats=1)
    fake = profile(model, x, loss, device="cpu", progress=False, fake=True,
                   timer=OpTimer(torch.device("cpu"), cache_dir=cache, min_runs=1, target_s=0.0))
    same_structure(real, fake)
    assert "aten._grouped_mm.default" in [op.name for op in fake.ops]
    assert "failed while attempting to run meta" not in caplog.text


MIXED_CASES = {  # a float32 input cast to bfloat16 (as autocast hands a norm a matmul's output), float32 weights
    "layer_norm": (lambda: nn.LayerNorm(16), (4, 8, 16)),
    "layer_norm_without_affine": (lambda: nn.LayerNorm(16, elementwise_affine=False), (4, 8, 16)),
    "group_norm": (lambda: nn.GroupNorm(4, 16), (4, 16, 8)),
    "batch_norm": (lambda: nn.BatchNorm1d(16), (4, 16, 8)),
    "batch_norm_eval": (lambda: nn.BatchNorm1d(16).eval(), (4, 16, 8)),
    "batch_norm_without_running_stats": (lambda: nn.BatchNorm1d(16, track_running_stats=False), (4, 16, 8)),
}


@pytest.mark.parametrize("case", list(MIXED_CASES))
def test_mixed_precision_norms_have_the_cpu_kernels_dtypes_under_fake_tensors(case):
    """planner/probe/fake.py's ``MIXED_DTYPE_OUTPUTS``: a bfloat16 input into a float32-weighted norm on the
    CPU, forward and backward, run for real and under fake tensors through ``fake_call``: every op's
    outputs have the same dtypes (the meta functions give the statistics bfloat16 and group norm's input
    gradient float32: without the table this fails), and the same ops run (no cast autograd adds)."""
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensorMode

    from memplan.planner.probe.fake import MIXED_DTYPE_OUTPUTS

    build, shape = MIXED_CASES[case]

    def run(fake):
        torch.manual_seed(0)
        norm = build()
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
            x = torch.randn(*shape, requires_grad=True)
            mode = _Outputs(fake, lambda o: o.dtype)
            with mode:
                norm(x.to(torch.bfloat16)).float().sum().backward()
        return mode.rows

    real, fake = run(False), run(True)
    assert fake == real
    assert any(f in {str(op) for op in MIXED_DTYPE_OUTPUTS} for f, _ in real)


def test_fold_unfold_gradients_have_the_cpu_kernels_storage_under_fake_tensors():
    """``STORAGE_OF_INPUT``: ``F.unfold``'s backward (``col2im``) returns the image's gradient in a storage the
    size of the columns on a CPU; under fake tensors every op's outputs now have the kernel's storage bytes
    (the meta function's were smaller, and the fake graph read the rest as scratch)."""
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensorMode


    def run(fake):
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
            x = torch.randn(6, 4, 4, 4, requires_grad=True)
            mode = _Outputs(fake, lambda o: o.untyped_storage().nbytes())
            with mode:
                torch.nn.functional.unfold(x * 2, 2).pow(2).sum().backward()
        return mode.rows

    real, fake = run(False), run(True)
    assert ("aten.col2im.default", [6 * 16 * 9 * 4]) in real
    assert fake == real


def test_a_timer_made_for_another_device_layer_is_refused(tmp_path):
    """An OpTimer reads kernel scratch with the device layer it was made with: one made on the CPU and used
    by a profile under the CUDA emulation charged unrounded bytes, silently. Refused in one line; made
    inside, it works."""
    from memplan.planner.core.errors import MemplanError
    from memplan.planner.probe.device import emulate_cuda
    from memplan.planner.probe.optime import OpTimer
    from memplan.planner.probe.profiler import profile

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    outside = OpTimer(torch.device("cpu"), cache_dir=tmp_path, min_runs=1, target_s=0.0)
    with emulate_cuda():
        with pytest.raises(MemplanError, match=r"^the op timer runs on Device\(cpu\) and this profile on "
                                               r"EmulatedCudaDevice\(cpu\).*inside emulate_cuda"):
            profile(model, torch.randn(4, 8), lambda m, b: m(b).sum(), progress=False, fake=True, timer=outside)
        inside = OpTimer(torch.device("cuda"), cache_dir=tmp_path, min_runs=1, target_s=0.0)
        graph = profile(model, torch.randn(4, 8), lambda m, b: m(b).sum(), progress=False, fake=True, timer=inside)
    assert graph.device == "cuda" and all(t.bytes % 512 == 0 for t in graph.tensors)
