"""The CLI as a user runs it: real subprocesses, exit codes, one-line errors, --json output."""

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from memplan.api import cli
from memplan.planner.core.plan import Plan
from memplan.planner.core.synthetic import linear_chain

MEMPLAN = [sys.executable, "-m", "memplan.api.cli"]


def run(*args, cwd=None):
    env = dict(os.environ)
    env.pop("MEMPLAN_DEBUG", None)
    return subprocess.run([*MEMPLAN, *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env, timeout=120)


@pytest.fixture
def graph_file(tmp_path):
    path = tmp_path / "graph.json"
    linear_chain(8).save(str(path))
    return path


def test_simulate_keep_all_json(graph_file):
    r = run("simulate", graph_file, "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["peak_bytes"] == 1000 and report["time_s"] == 24.0
    assert "timeline" not in report


def test_solve_then_simulate_round_trip(graph_file, tmp_path):
    plan_path = tmp_path / "plan.json"
    r = run("solve", graph_file, "--budget", "60%", "--solver", "oracle", "-o", plan_path, "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    # 60% of the keep-all activation memory (900 B) plus the 100 B of fixed memory
    assert summary["budget_bytes"] == 100 + 540
    assert summary["space"] == "keep/recompute"  # the oracle's default plans: its "optimal" says so
    assert summary["peak_bytes"] <= summary["budget_bytes"]
    plan = Plan.load(str(plan_path))
    assert plan.budget_bytes == 640 and plan.predicted.peak_bytes == summary["peak_bytes"]
    r = run("simulate", graph_file, plan_path, "--json")
    assert json.loads(r.stdout)["peak_bytes"] == summary["peak_bytes"]


def test_schema_commands():
    for which, field in (("graph", "ops"), ("plan", "decisions")):
        r = run("schema", which)
        assert r.returncode == 0
        assert field in json.loads(r.stdout)["properties"]


@pytest.mark.parametrize(("args", "message"), [
    (("simulate", "{bad}"), "not valid JSON"),
    (("simulate", "{missing}"), "cannot read graph file"),
    (("simulate", "{old}"), "unknown graph format version"),
    (("solve", "{graph}", "--budget", "10B"), "minimum feasible budget"),
    (("solve", "{graph}", "--budget", "5 parsecs"), "cannot read size"),
    (("solve", "{graph}", "--budget", "50%", "--solver", "nope"), "unknown solver 'nope'"),
    (("simulate", "{graph}", "{otherplan}"), "plan was made for graph"),
    (("schema", "both"), "unknown schema 'both'"),
    (("profile", "no-such-workload"), "unknown workload"),
])
def test_bad_input_gets_one_clear_line(args, message, graph_file, tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "old.json").write_text(json.dumps({"format": "memplan.graph/0"}))
    Plan.keep_all(linear_chain(3)).save(str(tmp_path / "other.json"))
    paths = {"bad": tmp_path / "bad.json", "missing": tmp_path / "nope.json", "old": tmp_path / "old.json",
             "graph": graph_file, "otherplan": tmp_path / "other.json"}
    r = run(*[a.format(**paths) for a in args])
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    assert len(r.stderr.strip().splitlines()) <= 3  # one logical line, maybe wrapped


def test_manual_plan_from_the_command_line(graph_file, tmp_path):
    # linear_chain(8): op i runs in module layers.i and its output is saved by op i+1
    plan_path = tmp_path / "plan.json"
    r = run("solve", graph_file, "--budget", "100%", "--solver", "manual", "--checkpoint", "layers.2",
            "--checkpoint", "layers.4", "-o", plan_path, "--json")
    assert r.returncode == 0, r.stderr
    plan = Plan.load(str(plan_path))
    recomputed = {t for t, a in plan.actions().items() if a == "recompute"}
    assert len(recomputed) == 2 and plan.solver.name == "manual"
    assert json.loads(r.stdout)["recompute"] == 2
    r = run("solve", graph_file, "--budget", "100%", "--checkpoint", "layers.2")
    assert r.returncode == 2 and "use them with --solver manual" in r.stderr
    r = run("solve", graph_file, "--budget", "100%", "--solver", "manual", "--checkpoint", "nosuch")
    assert r.returncode == 2 and "no op of graph" in r.stderr and "nosuch" in r.stderr


# ---- user-side failures: exit 2 and one line (issue #14) -------------------------------------------
WORKLOADS = '''
import sys
import torch
from torch import nn


def raises():
    raise ValueError("my model is broken")


def exits():
    sys.exit(0)


def bad_loss():
    def loss_fn(model, batch):
        raise RuntimeError("shapes do not match in my loss")
    return nn.Linear(4, 4), torch.randn(2, 4), loss_fn


def no_parameters(width=4):
    return nn.ReLU(), torch.randn(2, width), lambda model, batch: model(batch).sum()
'''


@pytest.mark.parametrize(("args", "message"), [
    (("profile", "{workloads}:raises", "-o", "{tmp}/g.json"), "raised ValueError: my model is broken"),
    (("profile", "{workloads}:exits", "-o", "{tmp}/g.json"), "called sys.exit(0)"),
    (("profile", "{workloads}:bad_loss", "-o", "{tmp}/g.json"), "loss_fn(model, batch) raised RuntimeError: shapes"),
    (("profile", "mlp", "--set", "depth=abc", "-o", "{tmp}/g.json"), "option depth='abc' does not fit int"),
    (("profile", "resnet", "--set", "hidden_sizes=8", "-o", "{tmp}/g.json"), "option hidden_sizes=8 does not fit"),
    # a workload that cannot be built from the options given (issue #22): once an optimizer's "empty parameter
    # list" at profiling time, an internal error
    (("profile", "mlp", "--set", "depth=-1", "-o", "{tmp}/g.json"), "workload 'mlp': option depth=-1 does not "
                                                                    "fit int: Input should be greater than 0"),
    (("run", "mlp", "--set", "depth=-1"), "workload 'mlp': option depth=-1 does not fit int"),
    (("plan", "mlp", "--set", "width=0"), "workload 'mlp': option width=0 does not fit int"),
    (("profile", "gpt2", "--set", "n_head=5", "-o", "{tmp}/g.json"),
     "workload 'gpt2' with n_head=5 raised ValueError: `embed_dim` must be divisible by num_heads"),
    (("profile", "{workloads}:no_parameters", "--set", "width=3", "-o", "{tmp}/g.json"),
     "workloads.py:no_parameters' with width=3 has no parameter that requires grad: nothing to train"),
    (("profile", "mlp", "-o", "/proc/nope/graph.json"), "cannot write /proc/nope/graph.json: cannot create folder"),
    (("solve", "{graph}", "--budget", "50%", "-o", "{tmp}"), "it is a folder"),
    (("show", "{plan}", "--graph", "{graph}", "--run", "{garbage}", "-o", "{tmp}/t.png"), "not valid JSON"),
    (("frontier", "{graph}", "--budgets", ",,"), "no budget in it"),
    (("run", "mlp", "--budget", "abc"), "cannot read size 'abc'"),
    (("solve", "{graph}", "--budget", "0"), "no plan fits budget 0 B for graph 'chain'; the minimum feasible budget "
                                            "memplan knows is 400 B"),
    (("solve", "{graph}", "--budget", "399"), "no plan fits budget 399 B"),
    (("plan", "mlp", "--budget", "0", "--set", "depth=2", "--set", "width=16", "--set", "batch_size=8"),
     "no plan fits budget 0 B for graph 'mlp'; the minimum feasible budget memplan knows is"),
    (("plan", "mlp", "--budget", "1", "--set", "depth=2", "--set", "width=16", "--set", "batch_size=8"),
     "no plan fits budget 1 B for graph 'mlp'"),
    (("plan", "mlp", "--fuse", "sideways"), "--fuse 'sideways': choose backward or forward"),
    (("profile", "mlp", "--fuse", "sideways", "-o", "{tmp}/g.json"), "--fuse 'sideways': choose backward or forward"),
    (("simulate", "{graph}", "{plan}", "--fuse", "bogus"), "--fuse 'bogus': choose backward or forward (or none)"),
    (("serve", "--cache", "/proc/nope/x.sqlite"), "cannot create the plan cache's folder /proc/nope"),
    (("serve", "--cache", "{tmp}"), "is a folder"),
])
def test_user_side_failures_exit_2_with_one_line(args, message, graph_file, tmp_path):
    (tmp_path / "workloads.py").write_text(WORKLOADS)
    (tmp_path / "garbage.json").write_bytes(b"\xff\xfe garbage \x00")
    plan = tmp_path / "plan.json"
    Plan.keep_all(linear_chain(8)).save(str(plan))
    paths = {"workloads": tmp_path / "workloads.py", "tmp": tmp_path, "graph": graph_file, "plan": plan,
             "garbage": tmp_path / "garbage.json"}
    # in this process (typer's runner): a subprocess per case would import torch a dozen times
    r = CliRunner().invoke(cli.app, [a.format(**paths) for a in args], env={"MEMPLAN_DEBUG": ""})
    assert r.exit_code == 2, (r.stdout, r.stderr, r.exception)
    assert message in " ".join(r.stderr.split()), r.stderr
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr
    assert len(r.stderr.strip().splitlines()) <= 3  # one logical line, maybe wrapped
    assert not (tmp_path / "g.json").exists()


@pytest.mark.parametrize("budget", ["0", "1"])
def test_solve_refuses_a_budget_below_every_plan_of_a_long_chain_fast(budget, tmp_path):
    """Issue #22: ``memplan solve --budget 0`` on a 2,000-op chain searched for the least peak to quote for
    its whole time limit (60 s); it now answers within about a second, exit 2, one line naming the least
    peak it found and why the search stopped."""
    import time

    from memplan.solvers.core import QUOTE_SEARCH_S

    path = tmp_path / "chain.json"
    linear_chain(2000).save(str(path))
    t0 = time.perf_counter()
    r = CliRunner().invoke(cli.app, ["solve", str(path), "--budget", budget, "-o", str(tmp_path / "plan.json")],
                           env={"MEMPLAN_DEBUG": ""})
    assert time.perf_counter() - t0 < QUOTE_SEARCH_S + 3.0  # loading the graph, one simulation past the search
    assert r.exit_code == 2, (r.stdout, r.stderr)
    line = " ".join(r.stderr.split())
    assert line.startswith(f"error: no plan fits budget {budget} B for graph 'chain'; the minimum feasible budget "
                           f"memplan knows is ")
    assert line.endswith(f"stopped after {QUOTE_SEARCH_S:g} s, as budgets below the lower bound 400 B are refused "
                         f"at once: a budget near it gets the whole time limit")
    assert not (tmp_path / "plan.json").exists()


def test_the_workload_help_names_every_built_in():
    from memplan.api.cli import WORKLOAD_HELP
    from memplan.planner.workloads import BUILTINS

    assert WORKLOAD_HELP.startswith(f"built-in ({', '.join(BUILTINS)}) ")


def test_plan_profile_and_simulate_take_the_fused_step(tmp_path):
    """``plan --fuse backward`` profiles (timing the fused steps too) and plans for the step with the optimizer
    stepped inside backward; ``simulate`` scores a plan in the step it was solved for unless told otherwise
    (``--fuse none``: unfused); ``profile --fuse backward`` records the fused step's measured cost."""
    from memplan.planner.core.graph import Graph
    from memplan.planner.core.simulator import simulate

    small = ["--set", "depth=3", "--set", "width=32", "--set", "batch_size=16"]
    runner = CliRunner()
    graph_path, plan_path = tmp_path / "graph.json", tmp_path / "plan.json"
    r = runner.invoke(cli.app, ["plan", "mlp", "--budget", "60%", "--fuse", "backward", "--json", *small,
                                "-o", str(plan_path), "--graph", str(graph_path)])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    graph, plan = Graph.load(str(graph_path)), Plan.load(str(plan_path))
    assert summary["fuse"] == "backward" and plan.solver.settings["fuse"] == "backward"
    assert "backward" in graph.fused_extra_s and graph.fused_backward
    fused, plain = simulate(graph, plan, fuse="backward"), simulate(graph, plan)
    assert summary["predicted_peak_bytes"] == fused.peak_bytes <= summary["budget_bytes"]
    assert summary["keep_all_step_s"] == simulate(graph, None, fuse="backward").time_s
    r = runner.invoke(cli.app, ["simulate", str(graph_path), str(plan_path), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["fuse"] == "backward"
    assert json.loads(r.stdout)["peak_bytes"] == fused.peak_bytes
    r = runner.invoke(cli.app, ["simulate", str(graph_path), str(plan_path), "--json", "--fuse", "none"])
    assert json.loads(r.stdout)["fuse"] is None and json.loads(r.stdout)["peak_bytes"] == plain.peak_bytes
    r = runner.invoke(cli.app, ["profile", "mlp", *small, "--fuse", "backward", "-o", str(tmp_path / "g.json")])
    assert r.exit_code == 0, r.output
    assert "backward" in Graph.load(str(tmp_path / "g.json")).fused_extra_s


@pytest.mark.parametrize(("given", "read"), [
    ("channels=4,8,16", (4, 8, 16)), ("channels=[4,8,16]", (4, 8, 16)), ("channels=[4, 8, 16]", (4, 8, 16)),
    ("channels=(4, 8)", (4, 8)), ("channels=[8]", (8,)), ("channels=(8,)", (8,)), ("channels=[]", ()),
    ("channels=8", 8), ("name=[x]", ("x",)), ("name=abc", "abc"), ("rate=0.5", 0.5), ("flag=true", True),
])
def test_set_reads_lists_as_python_and_json_write_them(given, read):
    """``--set channels=[4,8,16]`` read as the string '[4', 8 and '16]' and was refused: a list in brackets is
    a list."""
    from memplan.api.cli.options import workload_options

    assert workload_options([given]) == {given.partition("=")[0]: read}


def test_a_bracketed_list_reaches_the_workload(tmp_path):
    r = CliRunner().invoke(cli.app, ["profile", "unet", "--set", "channels=[4, 8]", "--set", "image_size=16",
                                     "--set", "batch_size=1", "-o", str(tmp_path / "g.json")])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "g.json").read_text())["ops"]
