"""maxbatch: the largest batch whose best plan fits a budget, from one shape family. Torch-free: the search
agrees with solving every value. Checked by training (mlp and GPT-2): at the answer the plan, applied
with the family evaluated there, trains with the measured peak the simulator predicts, within the
budget; at one more, even the smallest-memory plan measures above the budget. Every built-in answers,
and the CLI and the service answer too."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memplan.api.cli import app
from memplan.planner.core.errors import GraphError, Infeasible, MemplanError
from memplan.planner.core.graph import FusedStep
from memplan.planner.core.shapes import at_shape, fit_family
from memplan.planner.core.simulator import simulate
from memplan.planner.core.synthetic import linear_chain
from memplan.solvers import keep_all_report, smallest_known_peak, solve
from memplan.solvers.maxbatch import max_dim


def _chain_family(fused: bool = False):
    """A 6-op chain at batch 8, 6, 4; ``fused``: with 600-byte weights, each a bucket stepped with a transient
    its size (fused into backward, its gradients freed there)."""
    def at(b: int):
        g = linear_chain(6, activation_bytes=[100 * b, 300 * b, 50 * b, 200 * b, 100 * b, 10 * b],
                         input_bytes=100 * b, time_s=[1.0, 3.0, 1.0, 2.0, 1.0, 1.0], param_bytes=600 * fused)
        if fused:
            g.fused_backward = [FusedStep(after=i, grad_bytes=600, step_bytes=600) for i in reversed(range(6))]
            g.fixed.optimizer_step_bytes = 6 * 600
        return g
    return fit_family([({"batch": 8}, at(8)), ({"batch": 6}, at(6)), ({"batch": 4}, at(4))])


def _fits(graph, budget: int, b: int, max_overhead: float | None, fuse: str | None = None) -> bool:
    g = at_shape(graph, {"batch": b}, extrapolate=True)
    try:
        r = solve(g, budget, "oracle", fuse=fuse)
    except Infeasible:
        return False
    keep = simulate(g, None, fuse=fuse).time_s
    return max_overhead is None or r.report.time_s <= (1 + max_overhead) * keep + 1e-12


@pytest.mark.parametrize("budget", [1500, 9000])
@pytest.mark.parametrize("max_overhead", [None, 0.1])
def test_search_agrees_with_solving_every_value(budget, max_overhead):
    graph = _chain_family()
    fits = [b for b in range(1, 40) if _fits(graph, budget, b, max_overhead)]
    answer = max_dim(graph, budget, max_overhead=max_overhead, method="oracle")
    assert answer.value == max(fits)
    assert not answer.next.fits and answer.next.value == answer.value + 1
    assert answer.result.report.peak_bytes <= budget
    assert answer.graph.tensors[1].bytes == 100 * answer.value


@pytest.mark.parametrize("budget", [9000, 11000, 20000])
@pytest.mark.parametrize("max_overhead", [None, 0.1])
def test_a_fused_search_agrees_with_solving_every_value_fused(budget, max_overhead):
    """``fuse="backward"``: every value solved for the fused step (its overhead against keeping everything
    in that step), and the answer is larger than the unfused step's (at 9,000 B none fits at all unfused):
    the gradients go early and the optimizer's transient is taken a bucket at a time."""
    graph = _chain_family(fused=True)
    fits = [b for b in range(1, 40) if _fits(graph, budget, b, max_overhead, "backward")]
    answer = max_dim(graph, budget, max_overhead=max_overhead, method="oracle", fuse="backward")
    try:
        plain = max_dim(graph, budget, max_overhead=max_overhead, method="oracle").value
    except Infeasible:
        plain = 0
    assert answer.value == max(fits) > plain
    assert answer.result.report.peak_bytes <= budget and answer.result.plan.solver.settings["fuse"] == "backward"
    assert not answer.next.fits and answer.next.value == answer.value + 1
    with pytest.raises(MemplanError, match="fuse='sideways'"):
        max_dim(graph, budget, fuse="sideways")


def test_bad_input_is_named():
    graph = _chain_family()
    with pytest.raises(Infeasible, match=r"not even batch=1 fits budget 10 B \(10 B\): the minimum feasible "):
        max_dim(graph, 10)
    with pytest.raises(GraphError, match="varies batch, not 'seq'"):
        max_dim(graph, 10_000, dim="seq")
    with pytest.raises(GraphError, match="profiled at one shape"):
        max_dim(linear_chain(3), 10_000)
    capped = max_dim(graph, 10**9, max_value=50, method="oracle")
    assert capped.value == 50 and capped.next.reason == "above the largest value asked for (50)"


# ---- checked by training -----------------------------------------------------------------------------


pytestmark = pytest.mark.usefixtures("one_thread")


TINY = {
    "mlp": dict(depth=6, width=64, batch_size=64),
    "gpt2": dict(n_layer=2, n_embd=32, n_head=2, vocab_size=64, seq_len=32, batch_size=4),
    "bert": dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=64, seq_len=16,
                 batch_size=4),
    "resnet": dict(embedding_size=8, hidden_sizes=(8, 16, 16, 16), depths=(1, 1, 1, 1), image_size=32,
                   batch_size=4),
    "unet": dict(channels=(4, 8, 16), image_size=32, batch_size=4),
}


def _family(name: str):
    from memplan.api.integrations.common import dim_family
    from memplan.planner.probe.family import profile_family
    from memplan.planner.workloads import load_workload

    w = load_workload(name, **TINY[name])
    return profile_family(w.model, dim_family(w.batch, "batch"), w.loss_fn, progress=False, repeats=1,
                          measure=False, device="cpu")


def _measured_peak(name: str, batch_size: int, plan, graph) -> tuple[int, int]:
    from memplan.executor.session import run_plan
    from memplan.planner.workloads import load_workload

    w = load_workload(name, **{**TINY[name], "batch_size": batch_size})
    r = run_plan(w.model, w.batch, w.loss_fn, None, plan, graph, steps=1, warmup=1, keep_all=False)
    return r.measured_peak_bytes, r.predicted_peak_bytes


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "gpt2"])
def test_the_answer_trains_as_predicted_and_one_more_does_not_fit(name):
    if name != "mlp":
        pytest.importorskip("transformers", reason="the models extra (transformers) is not installed")
    graph = _family(name)
    b0 = graph.meta["shape_family"]["at"]["batch"]
    # a budget that lands between profiled shapes' multiples: the answer is extrapolated past them
    budget = keep_all_report(at_shape(graph, {"batch": 2 * b0 + 1}, extrapolate=True)).peak_bytes
    answer = max_dim(graph, budget)
    assert answer.value > 2 * b0  # beyond keep-everything's batch thanks to the plan
    measured, predicted = _measured_peak(name, answer.value, answer.result.plan, answer.graph)
    assert 0.99 * predicted <= measured <= predicted <= budget  # as predicted, to a few scalars
    # one more: no plan fits; the plan with the least memory memplan knows measures above the budget
    assert answer.next.min_feasible_bytes > budget
    more = at_shape(graph, {"batch": answer.value + 1}, extrapolate=True)
    least = solve(more, smallest_known_peak(more))
    measured_more, _ = _measured_peak(name, answer.value + 1, least.plan, more)
    assert measured_more > budget


def test_a_backward_fused_step_fits_a_larger_batch_and_trains_as_predicted():
    """``max_dim(..., fuse="backward")`` (``memplan maxbatch --fuse backward``): sized for the step with the
    optimizer fused into backward, whose gradients are freed inside backward and whose optimizer transient
    is taken bucket by bucket. On the MLP at the budget keep-everything needs at the profiled batch, the
    unfused answer is that batch, the fused one about twice it; trained fused there, the measured peak is the
    prediction to the byte, within the budget."""
    from memplan.executor.session import run_plan
    from memplan.planner.workloads import load_workload

    graph = _family("mlp")
    b0 = graph.meta["shape_family"]["at"]["batch"]
    budget = keep_all_report(at_shape(graph, {"batch": b0}, extrapolate=True)).peak_bytes
    plain = max_dim(graph, budget)
    fused = max_dim(graph, budget, fuse="backward")
    assert plain.value == b0 and fused.value > 1.5 * b0
    assert fused.result.plan.solver.settings["fuse"] == "backward"
    assert simulate(fused.graph, fused.result.plan, fuse="backward").peak_bytes == fused.result.report.peak_bytes
    assert not fused.next.fits and fused.next.min_feasible_bytes > budget
    w = load_workload("mlp", **{**TINY["mlp"], "batch_size": fused.value})
    r = run_plan(w.model, w.batch, w.loss_fn, None, fused.result.plan, fused.graph, steps=1, warmup=1,
                 keep_all=False, fuse="backward")
    assert r.measured_peak_bytes == r.predicted_peak_bytes == fused.result.report.peak_bytes <= budget


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TINY))
def test_every_builtin_answers(name):
    if name != "mlp":
        pytest.importorskip("transformers", reason="the models extra (transformers) is not installed")
    graph = _family(name)
    b0 = graph.meta["shape_family"]["at"]["batch"]
    budget = keep_all_report(at_shape(graph, {"batch": 3 * b0}, extrapolate=True)).peak_bytes
    answer = max_dim(graph, budget, method="greedy")  # the search on every model; the ILP's time is its own
    assert answer.value >= 3 * b0 and answer.result.report.peak_bytes <= budget


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "gpt2"])
def test_a_fake_family_is_the_real_one_and_answers_alike(name, tmp_path):
    """``profile_family(fake=True)`` (``memplan maxbatch --fake``): three fake traces, nothing allocated, fit
    into the real family's polynomials (sizes to the byte); the answer's plan has the same peak on the real
    family's graph at that batch."""
    if name != "mlp":
        pytest.importorskip("transformers", reason="the models extra (transformers) is not installed")
    import torch

    from memplan.api.integrations.common import dim_family
    from memplan.planner.probe.family import profile_family
    from memplan.planner.probe.optime import OpTimer
    from memplan.planner.workloads import load_workload

    real = _family(name)
    w = load_workload(name, **TINY[name])
    timer = OpTimer(torch.device("cpu"), cache_dir=tmp_path, min_runs=1, target_s=0.0)
    fake = profile_family(w.model, dim_family(w.batch, "batch"), w.loss_fn, progress=False, fake=True, timer=timer,
                          device="cpu")
    assert all(op.time_source != "measured" for op in fake.ops)
    for key in ("dims", "at", "points", "tensor_shape", "tensor_bytes", "op_bytes", "inputs_bytes"):
        assert fake.meta["shape_family"][key] == real.meta["shape_family"][key], key
    b0 = real.meta["shape_family"]["at"]["batch"]
    budget = keep_all_report(at_shape(real, {"batch": 3 * b0}, extrapolate=True)).peak_bytes
    # the answers are the heuristic's under each graph's own times; the fake answer's plan holds on the real graph
    answer = max_dim(fake, budget, method="greedy")
    on_real = simulate(at_shape(real, {"batch": answer.value}, extrapolate=True), answer.result.plan)
    assert answer.value >= 3 * b0 and on_real.peak_bytes == answer.result.report.peak_bytes <= budget


def test_cli_maxbatch_fake_sizes_a_meta_model(tmp_path):
    """A workload built on the meta device: a real family cannot be profiled at all; ``--fake`` answers."""
    workload = tmp_path / "wl.py"
    workload.write_text(
        "import torch\n"
        "def build(batch_size: int = 16):\n"
        "    with torch.device('meta'):\n"
        "        model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 32))\n"
        "    return model, torch.randn(batch_size, 32), lambda m, b: m(b).pow(2).mean()\n")
    args = ["maxbatch", f"{workload}:build", "--budget", "2MiB", "--json", "-o", str(tmp_path / "plan.json"),
            "--graph", str(tmp_path / "graph.json")]
    runner = CliRunner()
    res = runner.invoke(app, [*args, "--fake"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    assert got["value"] > 16 and got["predicted_peak_bytes"] <= 2 << 20 < got["next"]["min_feasible_bytes"]
    res = runner.invoke(app, args)  # without --fake the meta model cannot run a step: one line, no traceback
    assert res.exit_code != 0 and "Traceback" not in res.output


# ---- CLI and service ------------------------------------------------------------------------------------


def test_cli_answers_from_a_family_graph_and_refuses_a_percentage(tmp_path):
    path = tmp_path / "family.json"
    _chain_family().save(str(path))
    runner = CliRunner()
    res = runner.invoke(app, ["maxbatch", str(path), "--budget", "4000", "--max-overhead", "10%", "--json",
                              "-o", str(tmp_path / "plan.json"), "--graph", str(tmp_path / "graph.json")])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    assert got["value"] == max_dim(_chain_family(), 4000, max_overhead=0.1).value
    assert got["next"]["value"] == got["value"] + 1 and (tmp_path / "plan.json").is_file()
    res = runner.invoke(app, ["maxbatch", str(path), "--budget", "50%"])
    assert res.exit_code == 2 and "maxbatch takes a budget in bytes" in res.output
    _chain_family(fused=True).save(str(path))
    res = runner.invoke(app, ["maxbatch", str(path), "--budget", "11000", "--fuse", "backward", "--solver", "oracle",
                              "--json", "-o", str(tmp_path / "plan.json"), "--graph", str(tmp_path / "graph.json")])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    assert got["fuse"] == "backward"
    assert got["value"] == max_dim(_chain_family(fused=True), 11000, method="oracle", fuse="backward").value == 8
    res = runner.invoke(app, ["maxbatch", str(path), "--budget", "11000", "--fuse", "sideways"])
    assert res.exit_code != 0 and "--fuse 'sideways': choose backward or forward" in res.output
    assert "Traceback" not in res.output


def test_service_answers_and_bounds_the_search():
    from fastapi.testclient import TestClient

    from memplan.api.app import create_app
    from memplan.api.settings import Settings

    graph = json.loads(_chain_family().model_dump_json())
    settings = Settings(pool="thread", workers=1, max_time_limit_s=20.0)
    with TestClient(create_app(settings)) as c:
        r = c.post("/v1/maxbatch", json={"graph": graph, "budget": 4000, "max_overhead": 0.1, "time_limit_s": 0.5,
                                         "max_value": 1000, "include_graph": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["value"] == max_dim(_chain_family(), 4000, max_overhead=0.1).value
        assert body["next"]["value"] == body["value"] + 1
        assert body["plan"]["graph_fingerprint"] and body["graph"]["tensors"][1]["bytes"] == 100 * body["value"]
        fused = json.loads(_chain_family(fused=True).model_dump_json())
        r = c.post("/v1/maxbatch", json={"graph": fused, "budget": 11000, "fuse": "backward", "solver": "oracle",
                                         "time_limit_s": 0.5, "max_value": 1000})
        assert r.status_code == 200, r.text
        assert r.json()["value"] == 8 and r.json()["plan"]["solver"]["settings"]["fuse"] == "backward"
        r = c.post("/v1/maxbatch", json={"graph": fused, "budget": 11000, "fuse": "sideways"})
        assert r.status_code == 422 and "fuse" in r.text
        r = c.post("/v1/maxbatch", json={"graph": graph, "budget": "50%"})
        assert r.status_code == 422 and "not a percentage" in r.json()["detail"]
        r = c.post("/v1/maxbatch", json={"graph": graph, "budget": 4000, "time_limit_s": 10})
        assert r.status_code == 422 and r.json()["limit"] == "max_time_limit_s"
        r = c.post("/v1/maxbatch", json={"graph": graph, "budget": 10, "time_limit_s": 0.5})
        assert r.status_code == 422 and r.json()["min_feasible_bytes"] > 10
        r = c.post("/v1/maxbatch", json={"graph": json.loads(linear_chain(3).model_dump_json()), "budget": 4000})
        assert r.status_code == 422 and "no shape family" in r.json()["detail"]
