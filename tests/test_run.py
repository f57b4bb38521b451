"""``memplan run``: profile, solve, train under the plan, and report predicted against measured, as a user
runs it (typer's CliRunner, in process: one torch import for the file). Models are shrunk with ``--set``
so that a run takes seconds on 2 cores."""

import json
import math
import statistics

import numpy as np
import pytest
from matplotlib.image import imread
from typer.testing import CliRunner

from memplan.api.cli import app
from memplan.executor.session import run_plan
from memplan.planner.core.errors import MemplanError, PlanMismatch
from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Plan
from memplan.planner.workloads import load_workload

MLP = ["--set", "depth=6", "--set", "width=64", "--set", "batch_size=256"]
GPT2 = ["--set", "n_layer=2", "--set", "n_embd=64", "--set", "n_head=2", "--set", "vocab_size=128",
        "--set", "seq_len=64", "--set", "batch_size=4"]
FIELDS = ("budget_bytes", "predicted_peak_bytes", "measured_peak_bytes", "predicted_step_s", "measured_step_s")


def memplan(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def check_report(doc, *, steps, warmup=1):
    for f in FIELDS:
        assert doc[f] > 0, f
    # the simulator against the allocator (CPU: exact up to what the executor adds)
    assert doc["measured_peak_bytes"] == pytest.approx(doc["predicted_peak_bytes"], rel=0.10)
    assert doc["measured_peak_bytes"] <= doc["budget_bytes"] * 1.05 and doc["within_budget_5pct"] is True
    # the plan saves memory that keeping everything spends, as measured
    assert doc["measured_peak_bytes"] < doc["keep_all_measured_peak_bytes"]
    assert doc["predicted_peak_bytes"] <= doc["budget_bytes"] < doc["keep_all_predicted_peak_bytes"]
    assert doc["decisions"]["recompute"] > 0 and doc["replays_per_step"] > 0
    assert len(doc["losses"]) == warmup + 1 + steps and all(math.isfinite(x) for x in doc["losses"])
    assert len(doc["step_times_s"]) == steps
    assert doc["measured_step_s"] == pytest.approx(statistics.median(doc["step_times_s"]))
    assert doc["peak_error"] == pytest.approx(doc["predicted_peak_bytes"] / doc["measured_peak_bytes"] - 1)
    # the overhead the plan costs, predicted (simulator) and measured (against plain training)
    assert doc["predicted_overhead"] == pytest.approx(doc["predicted_step_s"] / doc["keep_all_predicted_step_s"] - 1)
    assert doc["measured_overhead"] == pytest.approx(doc["measured_step_s"] / doc["keep_all_measured_step_s"] - 1)


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory):
    """One solve-and-run of a small MLP at 70%, its plan, graph and report written."""
    d = tmp_path_factory.mktemp("run")
    r = memplan("run", "mlp", *MLP, "--budget", "70%", "--steps", "3", "--json", "-o", d / "run.json",
                "--save-plan", d / "plan.json", "--save-graph", d / "graph.json")
    assert r.exit_code == 0, r.stderr
    return d, json.loads(r.stdout)


def test_run_mlp_json_report(mlp_run):
    d, doc = mlp_run
    check_report(doc, steps=3)
    assert doc["workload"] == "mlp" and doc["device"] == "cpu" and doc["fuse"] is None
    plan = Plan.load(str(d / "plan.json"))
    assert doc["budget_bytes"] == plan.budget_bytes and doc["predicted_peak_bytes"] == plan.predicted.peak_bytes
    assert doc["graph_fingerprint"] == Graph.load(str(d / "graph.json")).fingerprint
    assert "timeline" not in doc  # stdout stays short; the file has it
    written = json.loads((d / "run.json").read_text())
    assert written["format"] == "memplan.run/1"
    assert max(p["bytes"] for p in written["timeline"]) == doc["measured_peak_bytes"]
    assert doc.pop("report") == str(d / "run.json")
    assert {k: v for k, v in written.items() if k != "timeline"} == doc


def test_run_prints_predicted_against_measured(mlp_run):
    d, _ = mlp_run
    r = memplan("run", "mlp", *MLP, "--plan", d / "plan.json", "--graph", d / "graph.json", "--steps", "1",
                "--no-keep-all")
    assert r.exit_code == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "peak under the plan" in text and "step time under the plan" in text and "within budget" in text
    assert "step overhead vs keep-all" in text


def test_show_draws_a_run_of_memplan_run(mlp_run):
    d, doc = mlp_run
    plain, measured = d / "plain.png", d / "measured.png"
    assert memplan("show", d / "plan.json", "--graph", d / "graph.json", "-o", plain).exit_code == 0
    r = memplan("show", d / "plan.json", "--graph", d / "graph.json", "--run", d / "run.json", "-o", measured,
                "--json")
    assert r.exit_code == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["measured_peak_bytes"] == doc["measured_peak_bytes"]
    assert summary["measured_step_s"] == doc["measured_step_s"]
    assert summary["step_error"] == pytest.approx(summary["time_s"] / doc["measured_step_s"] - 1)
    assert not np.array_equal(imread(plain), imread(measured))  # the measured timeline is drawn


def test_run_fused_backward(mlp_run):
    d, _ = mlp_run
    r = memplan("run", "mlp", *MLP, "--plan", d / "plan.json", "--fuse", "backward", "--steps", "2", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["fuse"] == "backward"
    check_report(doc, steps=2)


@pytest.mark.slow
def test_run_small_gpt2(tmp_path):
    # 60%: at 50% this shrunken GPT-2 is within 2% of the smallest peak any plan reaches, where a solver
    # can miss a feasible plan (the budget, not the executor, would be under test)
    r = memplan("run", "gpt2", *GPT2, "--budget", "60%", "--steps", "2", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    check_report(doc, steps=2)
    assert doc["workload"] == "gpt2"


@pytest.mark.parametrize("args, message", [
    (["nope"], "unknown workload 'nope'"),
    (["mlp", "--set", "depth"], "expected KEY=VALUE"),
    (["mlp", "--set", "colour=red"], "has no option colour"),
    (["mlp", "--fuse", "sideways"], "choose backward or forward"),
    (["mlp", "--graph", "graph.json"], "give --plan too"),
    (["mlp", "--plan", "missing/plan.json"], "needs the graph it was made for"),
])
def test_bad_input_one_line_exit_2(args, message):
    r = memplan("run", *args)
    assert r.exit_code == 2, r.output
    assert message in r.stderr and r.stderr.strip().count("\n") == 0


def test_budget_below_the_minimum_one_line_exit_2():
    r = memplan("run", "mlp", *MLP, "--budget", "1KiB", "--json")
    assert r.exit_code == 2 and r.stdout == ""
    assert "no plan fits budget" in r.stderr and "minimum feasible budget" in r.stderr
    assert r.stderr.strip().count("\n") == 0


def test_plan_for_another_model_one_line_exit_2(mlp_run):
    d, _ = mlp_run
    r = memplan("run", "mlp", "--set", "depth=7", "--set", "width=64", "--set", "batch_size=256",
                "--plan", d / "plan.json", "--graph", d / "graph.json")
    assert r.exit_code == 2
    assert "the plan was made for model" in r.stderr and "re-profile and re-solve" in r.stderr
    assert r.stderr.strip().count("\n") == 0


def test_show_refuses_a_run_of_another_graph(mlp_run, tmp_path):
    d, doc = mlp_run
    other = tmp_path / "run.json"
    other.write_text(json.dumps({**doc, "graph_fingerprint": "0" * 16}))
    r = memplan("show", d / "plan.json", "--graph", d / "graph.json", "--run", other, "-o", tmp_path / "x.png")
    assert r.exit_code == 2 and "give the run of this graph" in r.stderr
    assert not (tmp_path / "x.png").exists()


def test_run_plan_refuses_before_training(mlp_run):
    d, _ = mlp_run
    w = load_workload("mlp", depth=5, width=64, batch_size=256)
    before = [p.detach().clone() for p in w.model.parameters()]
    with pytest.raises(PlanMismatch):
        run_plan(w.model, w.batch, w.loss_fn, None, Plan.load(str(d / "plan.json")),
                 Graph.load(str(d / "graph.json")), steps=1)
    assert all(p.equal(b) for p, b in zip(w.model.parameters(), before, strict=True))  # no step was taken
    with pytest.raises(MemplanError, match="steps >= 1"):
        run_plan(w.model, w.batch, w.loss_fn, None, Plan.load(str(d / "plan.json")),
                 Graph.load(str(d / "graph.json")), steps=0)


# ---- memplan run --nproc: every rank under DDP ----------------------------------------------------------
@pytest.mark.slow
def test_run_two_processes_ddp_json():
    r = memplan("run", "mlp", *MLP, "--nproc", "2", "--engine", "ddp", "--budget", "70%", "--steps", "2",
                "--time-limit", "10", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["world_size"] == 2 and doc["engine"] == "ddp"
    rows = doc["ranks"]
    assert sorted((row["rank"], row["plan"] == "keep all") for row in rows) == [
        (0, False), (0, True), (1, False), (1, True)]
    for row in rows:
        # per rank, the simulator against the allocator (DDP's buckets included in the rank's graph)
        assert row["measured_peak_bytes"] == pytest.approx(row["predicted_peak_bytes"], rel=0.05)
    planned = [row for row in rows if row["plan"] != "keep all"]
    kept = {row["rank"]: row for row in rows if row["plan"] == "keep all"}
    for row in planned:
        assert row["recomputed"] > 0 and row["measured_peak_bytes"] < kept[row["rank"]]["measured_peak_bytes"]
    # DDP keeps the replicas equal: the same batch on each rank gives the same losses
    assert planned[0]["losses"] == planned[1]["losses"] and len(planned[0]["losses"]) == 2


def test_run_nproc_refuses_what_it_cannot_do_yet():
    r = memplan("run", "mlp", "--nproc", "2", "--offload")
    assert r.exit_code == 2 and "does not take --offload" in r.stderr
    r = memplan("run", "mlp", "--nproc", "2", "--engine", "zero3")
    assert r.exit_code == 2 and "--engine 'zero3'" in r.stderr
