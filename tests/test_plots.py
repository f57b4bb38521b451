"""The plots, produced as a user produces them (``memplan show``, ``memplan frontier --plot`` in a
subprocess): the PNG is written, is not blank, and has the documented pixel size."""

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
from matplotlib.image import imread

from memplan.api.plots import MeasuredRun, frontier_png, read_run_report, timeline_png
from memplan.planner.core.errors import MemplanError
from memplan.planner.core.plan import Plan
from memplan.planner.core.simulator import simulate
from memplan.planner.core.synthetic import linear_chain

MEMPLAN = [sys.executable, "-m", "memplan.api.cli"]
CHAIN = linear_chain(8)


def run(*args, cwd=None):
    env = {k: v for k, v in os.environ.items() if k != "MEMPLAN_DEBUG"}
    return subprocess.run([*MEMPLAN, *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env, timeout=120)


def png_size(path) -> tuple[int, int]:
    """(width, height) from the PNG header: the IHDR chunk comes first."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def assert_drawn(path, width, height):
    assert path.stat().st_size > 0
    assert png_size(path) == (width, height)
    pixels = imread(path)
    assert pixels.shape[:2] == (height, width)
    # data drawn in colour, not only the white background and the black axes (an empty axes, of ~10 KB,
    # has no coloured pixel)
    assert np.count_nonzero(np.ptp(pixels[..., :3], axis=2) > 0.2) > 500


@pytest.fixture
def files(tmp_path):
    graph = tmp_path / "graph.json"
    CHAIN.save(str(graph))
    plan = tmp_path / "plan.json"
    r = run("solve", graph, "--budget", "60%", "--solver", "oracle", "-o", plan, "--json")
    assert r.returncode == 0, r.stderr
    return graph, plan


def test_show_writes_the_timeline_png_and_a_summary(files, tmp_path):
    graph, plan = files
    png = tmp_path / "timeline.png"
    r = run("show", plan, "--graph", graph, "-o", png)
    assert r.returncode == 0, r.stderr
    assert_drawn(png, 1200, 600)
    assert "recompute" in r.stdout and f"wrote {png}" in " ".join(r.stdout.split())
    r = run("show", plan, "--graph", graph, "-o", png, "--json")
    summary = json.loads(r.stdout)
    expected = simulate(CHAIN, Plan.load(str(plan)))
    assert summary["peak_bytes"] == expected.peak_bytes <= summary["budget_bytes"] == 640
    assert summary["actions"]["recompute"]["count"] == Plan.load(str(plan)).count("recompute") > 0


def test_show_against_a_measured_run(files, tmp_path):
    graph, plan = files
    run_report = tmp_path / "run.json"
    run_report.write_text(json.dumps({"measured_peak_bytes": 660,
                                      "timeline": [{"time_s": 0.0, "bytes": 100}, {"time_s": 10.0, "bytes": 660},
                                                   {"time_s": 30.0, "bytes": 100}]}))
    plain, measured = tmp_path / "plain.png", tmp_path / "measured.png"
    assert run("show", plan, "--graph", graph, "-o", plain).returncode == 0
    r = run("show", plan, "--graph", graph, "--run", run_report, "-o", measured, "--json")
    assert r.returncode == 0, r.stderr
    assert_drawn(measured, 1200, 600)
    summary = json.loads(r.stdout)
    assert summary["measured_peak_bytes"] == 660
    assert summary["peak_error"] == pytest.approx(summary["peak_bytes"] / 660 - 1)
    assert not np.array_equal(imread(plain), imread(measured))  # the measured line is drawn


def test_show_refuses_a_plan_of_another_graph(files, tmp_path):
    _, plan = files
    other = tmp_path / "other.json"
    linear_chain(9).save(str(other))
    r = run("show", plan, "--graph", other, "-o", tmp_path / "x.png")
    assert r.returncode == 2 and "re-solve for this graph" in r.stderr
    assert not (tmp_path / "x.png").exists()


def test_frontier_plot_one_line_per_solver(files, tmp_path):
    graph, _ = files
    png = tmp_path / "frontier.png"
    r = run("frontier", graph, "--solver", "oracle,greedy", "--budgets", "50%,60%,80%,100%", "--plot", png, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["plot"] == str(png) and [s["solver"] for s in doc["series"]] == ["oracle", "greedy"]
    assert_drawn(png, 1000, 600)
    # each point says what its solve claims: the oracle's optimum holds over keep / recompute plans
    oracle = doc["series"][0]["points"]
    assert all((p["status"], p["space"]) == ("infeasible", None) if p["overhead"] is None
               else (p["status"], p["space"]) == ("optimal", "keep/recompute") for p in oracle)
    r = run("frontier", graph, "--solver", "oracle", "--budgets", "100%")
    text = " ".join(r.stdout.split())  # the caption wraps at the table's width
    assert r.returncode == 0 and "0.0% optimal*" in text and "optimal over keep/recompute plans only" in text


def test_plot_functions_size_and_refusals(tmp_path):
    report = simulate(CHAIN, None, timeline=True)
    path = timeline_png(tmp_path / "a" / "t.png", report.timeline, budget_bytes=900, width_px=640, height_px=480,
                        measured=MeasuredRun(950))
    assert png_size(path) == (640, 480)
    path = frontier_png(tmp_path / "f.png", {"x": [(600, 0.5), (1000, 0.0)], "y": [(500, None)]}, width_px=300,
                        height_px=200)
    assert png_size(path) == (300, 200)
    with pytest.raises(MemplanError, match="timeline is empty"):
        timeline_png(tmp_path / "e.png", [])
    with pytest.raises(MemplanError, match="too small"):
        frontier_png(tmp_path / "s.png", {"x": []}, width_px=10)


@pytest.mark.parametrize("data, message", [
    ({}, "no measured peak"),
    ({"peak_bytes": -5}, "peak_bytes must be a non-negative integer"),
    ({"timeline": [{"time_s": 0.0}]}, r"timeline\[0\] needs a time"),
    ([1, 2], "expected a JSON object"),
])
def test_run_report_errors_name_the_problem(data, message):
    with pytest.raises(MemplanError, match=message):
        read_run_report(data)


def test_run_report_forms():
    assert read_run_report({"measured": {"peak_bytes": 7}}).peak_bytes == 7
    run_ = read_run_report({"timeline": [{"start_s": 1, "allocated_bytes": 5}]})
    assert run_ == MeasuredRun(None, [(1.0, 5)])


def _purple_pixels(path, rows=slice(None)):
    """Pixels of the host axis's fill (#af7aa1 at alpha 0.7 on white)."""
    pixels = imread(path)[rows, :, :3] * 255
    return int(np.count_nonzero(np.all(np.abs(pixels - np.array([199, 162, 189])) < 14, axis=2)))


def test_the_timeline_stacks_the_memory_by_what_holds_it(tmp_path):
    from memplan.api.plots import _RoundBytes, stacked_series
    from memplan.planner.core.memtrace import memory_trace
    from memplan.planner.core.schedule import schedule
    from memplan.solvers import solve

    keep_all = simulate(CHAIN, None)
    drawn = {}
    for name, offload in (("recompute", False), ("offload", True)):
        plan = solve(CHAIN, int(keep_all.peak_bytes * 0.7), "greedy", offload=offload).plan
        sched = schedule(CHAIN, plan)
        report = simulate(CHAIN, plan)
        trace = memory_trace(CHAIN, sched, plan.actions())
        times, series = stacked_series(trace)
        totals = [sum(col) for col in zip(*series.values(), strict=True)]
        assert len(times) == len(totals) and times == sorted(times)
        assert max(totals) == report.peak_bytes  # the stack's top is the simulator's memory, its peak kept
        held = {label for label, ys in series.items() if any(ys)}
        assert {"batch", "gradients", "kept activations"} <= held  # the synthetic chain has no parameters
        assert ("offloaded / fetched back" in held) == offload and ("replay transients" in held) == (not offload)
        drawn[name] = timeline_png(tmp_path / f"{name}.png", report.timeline, budget_bytes=plan.budget_bytes,
                                   trace=trace, keep_all=keep_all.timeline, measured=MeasuredRun(report.peak_bytes))
        assert_drawn(drawn[name], 1200, 600)
    bottom = slice(480, None)  # the host axis, drawn below only where the plan offloads
    assert _purple_pixels(drawn["offload"], bottom) > 2000 and _purple_pixels(drawn["recompute"], bottom) == 0
    # ticks at round sizes in binary units
    assert _RoundBytes.step(100 * 2**20) == 20 * 2**20 and _RoundBytes.step(3 * 2**30) == 1000 * 2**20
    assert _RoundBytes.step(1080) == 200 and _RoundBytes.step(13 * 2**30) == 2.5 * 2**30
