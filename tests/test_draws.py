"""Branches on random draws (planner/probe/draws.py): LayerDrop skips a layer when a draw falls below its
rate, so each step runs other ops. A real profile warns and records where; the executor's refusal of a
step whose ops differ names it; a fake profile refuses it in one line; a branch whose ops do not depend
on the draw trains as any step. Before, the first sign was a refusal at some later step, naming an op."""

import copy

import pytest
import torch
from torch import nn

from memplan.executor import apply
from memplan.planner.core.errors import Infeasible, MemplanError, PlanMismatch
from memplan.planner.core.simulator import simulate
from memplan.planner.probe.draws import Draws
from memplan.planner.probe.fake import FakeTraceError
from memplan.planner.probe.optime import OpTimer
from memplan.planner.probe.profiler import profile
from memplan.solvers import solve
from memplan.solvers.bounds import memory_lower_bound


class LayerDrop(nn.Module):
    """transformers' LayerDrop, as its audio encoders write it: a draw per layer, the layer skipped below
    ``rate``; ``scale_only`` draws and branches too, but runs the same ops either way."""

    def __init__(self, rate: float, scale_only: bool = False):
        super().__init__()
        self.rate, self.scale_only = rate, scale_only
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
                                     for _ in range(4)])
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        for layer in self.layers:
            draw = torch.rand([])
            if self.scale_only:
                x = x + layer(x) * (0.5 if bool(draw < self.rate) else 1.0)
            elif not (self.training and draw < self.rate):
                x = x + layer(x)
        return self.head(x).pow(2).mean()


def _loss(model, x):
    return model(x)


def _plan(graph):
    keep, low = simulate(graph, None).peak_bytes, memory_lower_bound(graph)
    for frac in (0.5, 0.7, 0.9):
        try:
            plan = solve(graph, low + int((keep - low) * frac), "auto", time_limit_s=5).plan
        except Infeasible:
            continue
        assert simulate(graph, plan).recomputed_ops > 0
        return plan
    raise AssertionError("no budget below keep-everything recomputes anything")


def test_the_draws_are_followed_through_comparisons_and_views_only():
    draws = Draws()
    aten = torch.ops.aten
    d, x = torch.rand([]), torch.ones(3)
    draws.note(aten.rand.default, ([],), {}, d)
    lt = d < 0.5
    draws.note(aten.lt.Scalar, (d, 0.5), {}, lt)
    mixed = d * x
    draws.note(aten.mul.Tensor, (d, x), {}, mixed)
    assert draws.is_branch(aten._local_scalar_dense.default, (lt,))
    assert draws.is_branch(aten.is_nonzero.default, (d,))
    assert not draws.is_branch(aten._local_scalar_dense.default, (mixed,))  # reads a value that is no draw
    draws.note(aten.add_.Tensor, (d, x), {}, d)  # written with another tensor: no draw's alone any more
    assert not draws.is_branch(aten._local_scalar_dense.default, (d,))


def test_a_branch_every_draw_answers_alike_is_no_branch_on_a_draw():
    """``torch.rand([]) < 0.0`` is false whatever the draw (LayerDrop at rate 0 in code that draws anyway):
    the real profile does not warn, as the fake one takes that branch (planner/probe/fake.py)."""
    import warnings

    from memplan.planner.core.errors import MemplanWarning

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemplanWarning)
        graph = profile(LayerDrop(0.0), torch.randn(64, 16), _loss, device="cpu", progress=False, measure=False,
                        repeats=1)
    assert "draw_branches" not in graph.meta
    draws, aten = Draws(), torch.ops.aten
    d = torch.rand([])
    draws.note(aten.rand.default, ([],), {}, d)
    for c, constant in ((0.0, True), (1.5, True), (0.5, False)):
        lt = d < c
        draws.note(aten.lt.Scalar, (d, c), {}, lt)
        assert draws.is_branch(aten._local_scalar_dense.default, (lt,)) is not constant


def test_a_real_profile_whose_steps_drop_other_layers_names_the_draw():
    torch.manual_seed(0)
    with pytest.raises(MemplanError, match=r"^profile of graph: the forward op sequence of timed step 1 differs "
                                           r"from the traced step's at op \d+ \(aten\.\w+\.\w+ in layers\.\d+\.\d, "
                                           r"where the traced step ran aten\.\w+\.\w+\); the model branched on "
                                           r"a random draw: .*layerdrop=0\.0\)$"):
        profile(LayerDrop(0.5), torch.randn(64, 16), _loss, device="cpu", progress=False, measure=False, repeats=1)


def test_a_real_profile_warns_of_layerdrop_and_the_refused_step_names_it():
    torch.manual_seed(1)  # a seed whose profiled steps drop no layer (at rate 0.05); a later step does
    model, x = LayerDrop(0.05), torch.randn(64, 16)
    with pytest.warns(UserWarning, match=r"^the model branched on a random draw in the profiled step: if that "
                                         r"decides which ops run, .*layerdrop=0\.0"):
        graph = profile(copy.deepcopy(model), x, _loss, device="cpu", progress=False, measure=False, repeats=1)
    assert graph.meta["draw_branches"] == ["the model"]
    plan = _plan(graph)
    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    torch.manual_seed(1)
    with pytest.raises(PlanMismatch, match=r"the profiled step branched on a random draw in the model: .*"
                                           r"layerdrop=0\.0\)\)$"), apply(m, plan, graph=graph, optimizer=opt):
        for _ in range(20):  # 4 draws a step at rate 0.5: some step's layers differ from the profiled ones
            _loss(m, x).backward()
            opt.step()
            opt.zero_grad()


def test_a_fake_profile_refuses_layerdrop_in_one_line(tmp_path):
    torch.manual_seed(0)
    with pytest.raises(FakeTraceError, match=r"^aten\._local_scalar_dense\.default in the model cannot run under "
                                             r"fake tensors \(its output depends on tensor values\): the model "
                                             r"branches on a random draw; .*layerdrop=0\.0\)$") as e:
        profile(LayerDrop(0.1), torch.randn(64, 16), _loss, device="cpu", progress=False, fake=True,
                timer=OpTimer(torch.device("cpu"), cache_dir=tmp_path, min_runs=1, target_s=0.0))
    assert "\n" not in str(e.value)


def test_a_branch_on_a_draw_that_runs_the_same_ops_trains_bitwise():
    torch.manual_seed(0)
    model, x = LayerDrop(0.5, scale_only=True), torch.randn(64, 16)
    with pytest.warns(UserWarning, match="branched on a random draw"):
        graph = profile(copy.deepcopy(model), x, _loss, device="cpu", progress=False, measure=False, repeats=1)
    plan = _plan(graph)

    def train(plan=None):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        ex = apply(m, plan, graph=graph, optimizer=opt) if plan is not None else None
        torch.manual_seed(1)
        try:
            for _ in range(6):
                _loss(m, x).backward()
                opt.step()
                opt.zero_grad()
        finally:
            if ex is not None:
                ex.remove()
        return list(m.parameters())

    assert all(map(torch.equal, train(plan), train()))


def test_the_cli_prints_the_warning_as_one_line(tmp_path):
    import subprocess
    import sys

    (tmp_path / "drop.py").write_text(
        "import torch\nfrom torch import nn\n\n\n"
        "class Scaled(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = nn.Linear(16, 16)\n\n"
        "    def forward(self, x):\n"
        "        return (self.lin(x) * (0.5 if bool(torch.rand([]) < 0.5) else 1.0)).pow(2).mean()\n\n\n"
        "def build():\n"
        "    return Scaled(), torch.randn(8, 16), lambda m, b: m(b)\n")
    r = subprocess.run([sys.executable, "-m", "memplan.api.cli", "profile", f"{tmp_path / 'drop.py'}:build",
                        "-o", str(tmp_path / "g.json"), "--device", "cpu"], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("warning: the model branched on a random draw in the profiled "
                                                   "step: if that decides which ops run"), r.stderr
