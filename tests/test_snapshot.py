"""The plan in PyTorch's memory viewer (issue 40.1): ``memplan show --snapshot`` writes the predicted step and
``memplan run --snapshot`` the measured one as PyTorch memory snapshots. Each file is read back with torch's
own ``torch.cuda._memory_viz`` (``trace``, ``segsum``, ``trace_plot``), its events are the simulator's
memory byte for byte, every block says what memplan decided for it, and the viewer's traps are avoided
(pickle protocol 4, an ``'unknown'`` category among those used, no bytes objects)."""

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch.cuda._memory_viz as memory_viz

from memplan.planner.core.graph import Graph, StateUnit
from memplan.planner.core.memtrace import CATEGORIES, memory_trace
from memplan.planner.core.plan import Action, Plan
from memplan.planner.core.schedule import schedule
from memplan.planner.core.simulator import score
from memplan.planner.core.snapshot import (
    VIEWER_MAX_ALLOCATIONS,
    predicted_snapshot,
    summarize,
    write_snapshot,
)
from memplan.planner.core.synthetic import linear_chain
from memplan.solvers import solve

MEMPLAN = [sys.executable, "-m", "memplan.api.cli"]
GPT2 = ["--set", "n_layer=2", "--set", "n_embd=32", "--set", "n_head=2", "--set", "vocab_size=64",
        "--set", "seq_len=64", "--set", "batch_size=4"]


def run(*args, cwd=None):
    env = {k: v for k, v in os.environ.items() if k != "MEMPLAN_DEBUG"}
    return subprocess.run([*MEMPLAN, *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def assert_trace_is_the_timeline(graph, sched, actions=None):
    """Every entry of the simulator's timeline is what the trace's events add up to, to the byte: its peak
    the most they hold during it, its live bytes what they hold after it."""
    report = score(graph, sched)
    trace = memory_trace(graph, sched, actions)
    live = trace.live_bytes()
    assert len(trace.entries) == len(report.timeline)
    for event, entry in zip(report.timeline, trace.entries, strict=True):
        before = live[entry.body - 1] if entry.body else 0
        assert max([before, *live[entry.body:entry.end]]) == event.peak_bytes, event
        assert (live[entry.end - 1] if entry.end else 0) == event.live_bytes, event
    assert trace.peak_bytes() == report.peak_bytes
    assert {b.category for b in trace.blocks()} <= set(CATEGORIES) - {"unknown"}
    return trace, report


def no_bytes(x):
    if isinstance(x, dict):
        return all(no_bytes(k) and no_bytes(v) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return all(no_bytes(v) for v in x)
    return not isinstance(x, (bytes, bytearray))


def assert_opens_in_the_viewer(path):
    """What PyTorch's viewer needs, checked with its own helpers; returns the snapshot."""
    raw = path.read_bytes()
    assert raw[:2] == b"\x80\x04", "pickle protocol 4: the viewer's unpickler refuses 5"
    snap = pickle.loads(raw)
    assert no_bytes(snap)
    events = snap["device_traces"][0]
    categories = {e["category"] for e in events if "category" in e}
    assert "unknown" in categories  # the viewer's own code fails appending it when it is missing
    text = memory_viz.trace(snap)
    frees = [line for line in text.splitlines() if line.startswith("del ")]
    assert frees and all(not line.split()[1][0].isdigit() for line in frees), "a free of a block never allocated"
    memory_viz.segsum(snap)  # asserts that the segments' blocks tile them
    html = memory_viz.trace_plot(snap)
    assert "MemoryViz.js" in html and "Active Memory Timeline" in html
    return snap


def running_peak(events):
    live = peak = 0
    for e in events:
        if e["action"] == "alloc":
            live += e["size"]
            peak = max(peak, live)
        elif e["action"] == "free_completed":
            live -= e["size"]
    return live, peak


def test_the_trace_is_the_simulators_memory_under_every_kind_of_plan(tmp_path):
    graph = linear_chain(8)
    keep = Plan.keep_all(graph)
    budget = score(graph, schedule(graph, keep)).peak_bytes
    plans = [keep, solve(graph, int(budget * 0.7), "oracle").plan,
             solve(graph, int(budget * 0.7), "greedy", offload=True).plan]
    assert any(a == Action.OFFLOAD for a in plans[2].actions().values())
    for plan in plans:
        for fuse in (None, "backward", "forward"):
            assert_trace_is_the_timeline(graph, schedule(graph, plan, fuse=fuse), plan.actions())
    # a plan that streams optimizer state: the step starts without it, each unit's a block while streamed in
    units = graph.model_copy(deep=True)
    units.fixed.optimizer_state_bytes += 600
    units.state_units = [StateUnit(module=f"m{i}", params=1, param_bytes=100, state_bytes=200, state_tensors=2)
                         for i in range(3)]
    streamed = Plan.keep_all(units).with_states(units, [2, 0])
    trace, report = assert_trace_is_the_timeline(units, schedule(units, streamed), {})
    assert trace.host[0][1] == report.host_peak_bytes > 0
    assert sum(e.block.bytes for e in trace.events if e.action == "alloc" and "streamed in" in e.block.note) == 400
    trace, report = assert_trace_is_the_timeline(graph, schedule(graph, plans[2]), plans[2].actions())
    assert max(b for _, b in trace.host) == report.host_peak_bytes > 0 and trace.host[-1][1] == 0
    snap = predicted_snapshot(graph, trace)
    summary = write_snapshot(tmp_path / "p.pickle", snap)
    assert summary.peak_bytes == report.peak_bytes and summary.merged == 0
    loaded = assert_opens_in_the_viewer(tmp_path / "p.pickle")
    # the file's events are the trace's, one for one: allocations, then a requested and a completed free
    mine = [(e.action, e.block.bytes, e.block.category, e.block.note) for e in trace.events]
    theirs = [(e["action"], e["size"], e["category"], e["user_metadata"]) for e in loaded["device_traces"][0]
              if e["action"] in ("alloc", "free_completed")]
    assert [(a if a == "alloc" else "free", *rest) for a, *rest in theirs] == mine
    assert {"offloaded", "fetched", "replayed"} & {e.get("category") for e in loaded["device_traces"][0]} \
        == {"offloaded", "fetched"}


def test_more_allocations_than_the_viewer_draws_are_said():
    snap = {"device_traces": [[{"action": "alloc", "addr": i, "size": i + 1} for i in range(VIEWER_MAX_ALLOCATIONS + 3)]]}
    summary = summarize(snap, "big.pickle")
    assert (summary.allocations, summary.merged, summary.merged_max_bytes) == (VIEWER_MAX_ALLOCATIONS + 3, 3, 3)
    assert "merges the other 3 (each at most 3 bytes)" in summary.line()


def test_bad_snapshot_paths_are_one_line_before_any_work(tmp_path):
    graph, plan = tmp_path / "graph.json", tmp_path / "plan.json"
    chain = linear_chain(6)
    chain.save(str(graph))
    Plan.keep_all(chain).save(str(plan))
    folder = tmp_path / "a-folder"
    folder.mkdir()
    r = run("show", plan, "--graph", graph, "-o", tmp_path / "t.png", "--snapshot", folder)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "it is a folder" in r.stderr
    assert not (tmp_path / "t.png").exists()
    r = run("run", "mlp", "--snapshot", folder)  # refused before profiling
    assert r.returncode == 2 and "it is a folder" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_predicted_and_measured_snapshots_of_a_gpt2_step_open_side_by_side(tmp_path):
    """GPT-2 (random weights) trained under an offload plan by ``memplan run --snapshot``, then the plan
    shown with ``memplan show --snapshot``: both files open with torch's helpers; the measured one holds the
    allocator's peak, the predicted one the simulator's, each to the byte."""
    files = {k: tmp_path / f"{k}" for k in ("graph.json", "plan.json", "run.json", "measured.pickle",
                                           "predicted.pickle", "timeline.png")}
    r = run("run", "gpt2", *GPT2, "--budget", "60%", "--offload", "--steps", "1", "--no-keep-all", "--json", "--time-limit", "10",
            "--snapshot", files["measured.pickle"], "--save-plan", files["plan.json"],
            "--save-graph", files["graph.json"], "-o", files["run.json"])
    assert r.returncode == 0, r.stderr
    report = json.loads(files["run.json"].read_text())
    assert json.loads(r.stdout)["snapshot"]["path"] == str(files["measured.pickle"])
    measured = assert_opens_in_the_viewer(files["measured.pickle"])
    live, peak = running_peak(measured["device_traces"][0])
    assert peak == report["measured_peak_bytes"]
    starting = [e for e in measured["device_traces"][0]
                if e["action"] == "alloc" and e["frames"][0]["filename"] == "live when the step began"]
    assert {"parameter", "optimizer state", "input"} <= {e["category"] for e in starting}
    assert sum(e["size"] for e in starting) == report["baseline_bytes"]
    assert any(f["name"].startswith("aten::") for e in measured["device_traces"][0] for f in e["frames"])

    r = run("show", files["plan.json"], "--graph", files["graph.json"], "--run", files["run.json"],
            "-o", files["timeline.png"], "--snapshot", files["predicted.pickle"], "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["snapshot"]["peak_bytes"] == report["predicted_peak_bytes"]
    predicted = assert_opens_in_the_viewer(files["predicted.pickle"])
    graph, plan = Graph.load(str(files["graph.json"])), Plan.load(str(files["plan.json"]))
    trace, _ = assert_trace_is_the_timeline(graph, schedule(graph, plan), plan.actions())
    assert running_peak(predicted["device_traces"][0])[1] == report["predicted_peak_bytes"]
    allocs = [e for e in predicted["device_traces"][0] if e["action"] == "alloc"]
    # the frames name the module and the ATen op; each block says what memplan decided
    assert any(f["filename"].startswith("transformer.h.") and f["name"].startswith("aten.")
               for e in allocs for f in e["frames"])
    notes = {e["category"]: e["user_metadata"] for e in allocs}
    assert notes["parameter"].startswith("parameter") and "optimizer" in notes["optimizer state"]
    if "offloaded" in notes:
        assert notes["offloaded"].startswith("offloaded") and notes["fetched"].startswith("offloaded tensor")
    assert any(n.startswith("kept for the backward") for n in (e["user_metadata"] for e in allocs))
    # what is live at the end (parameters, optimizer state, the parameters' gradients) is the segment's
    end_live = running_peak(predicted["device_traces"][0])[0]
    assert sum(b["size"] for b in predicted["segments"][0]["blocks"] if b["state"] == "active_allocated") == end_live
