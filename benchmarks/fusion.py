"""Fused optimizer steps, predicted against measured (issue 20 item 5), written to docs/benchmarks.md with
``--update-doc``.

Per built-in (default: mlp, gpt2, bert): one real profile that also measures what fusion adds
(``profile(fuse=("backward", "forward"))``: ``Graph.fused_extra_s``), a plan at 50% of the activation
memory, then six variants side by side in one process: plain training, the keep-everything plan fused
into backward and into forward, the 50% plan unfused and fused both ways. Each variant's step is timed
``--steps`` times per round, the rounds interleaved across variants (so that the machine's load hits all
alike); the measured overhead is against plain training's median step, the predicted one is the
simulator's (``simulate(graph, plan, fuse=...)``) against its keep-everything step. ``--repeats`` whole
runs (fresh profile, fresh plan) give the spread. One torch thread and thread CPU time, as the other CPU
benchmarks.

    python benchmarks/fusion.py [--models mlp,gpt2,bert] [--repeats 3] [--update-doc]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _doc import publish  # benchmarks/_doc.py (the scripts run from this folder)
from fidelity import machine

from memplan.executor import apply
from memplan.planner.core.plan import Plan
from memplan.planner.core.simulator import simulate
from memplan.planner.probe.profiler import profile
from memplan.planner.workloads import default_optimizer, load_workload, training_step
from memplan.solvers import activation_bytes, solve

VARIANTS = [("keep everything, fused backward", "keep", "backward"),
            ("keep everything, fused forward", "keep", "forward"),
            ("50%", "half", None), ("50%, fused backward", "half", "backward"),
            ("50%, fused forward", "half", "forward")]


def one_run(name: str, steps: int, rounds: int) -> dict[str, tuple[float, float]]:
    """label -> (predicted, measured) overhead against keep-everything / plain training."""
    w = load_workload(name)
    graph = profile(w.model, w.batch, w.loss_fn, device="cpu", progress=False, name=name,
                    fuse=("backward", "forward"))
    plans = {"keep": Plan.keep_all(graph),
             "half": solve(graph, graph.fixed.resident_bytes + activation_bytes(graph) // 2, "auto",
                           time_limit_s=20).plan}
    keep_s = simulate(graph, None, timeline=False).time_s
    runs: dict[str, tuple] = {}
    for label, which, fuse in [("plain", None, None), *VARIANTS]:
        model = copy.deepcopy(w.model)
        opt = default_optimizer(model)
        ex = None if which is None else apply(model, plans[which], graph=graph, optimizer=opt, fuse=fuse)
        predicted = 0.0 if which is None else simulate(graph, plans[which], timeline=False, fuse=fuse).time_s / keep_s - 1
        for _ in range(2):
            training_step(model, w.batch, w.loss_fn, opt)
        runs[label] = (model, opt, ex, predicted, [])
    for _ in range(rounds):
        for model, opt, _ex, _p, times in runs.values():
            for _ in range(steps):
                start = time.thread_time()
                training_step(model, w.batch, w.loss_fn, opt)
                times.append(time.thread_time() - start)
    base = statistics.median(runs["plain"][4])
    out = {label: (p, statistics.median(times) / base - 1) for label, (_m, _o, _e, p, times) in runs.items()
           if label != "plain"}
    for _m, _o, ex, _p, _t in runs.values():
        if ex is not None:
            ex.remove()
    return out


def render(results: dict[str, list[dict]], repeats: int) -> str:
    lines = [f"Machine: {machine()}; torch pinned to 1 thread, thread CPU time. `python benchmarks/fusion.py "
             f"--update-doc`: per built-in, {repeats} runs (each a fresh profile that also measures fusion's cost, "
             "`profile(fuse=...)`, and a fresh plan at 50% of the activation memory), the variants' steps "
             "interleaved in one process. *Predicted*: the simulator's overhead against its keep-everything "
             "step (`simulate(graph, plan, fuse=...)`); *measured*: the median step against plain training's. "
             "Medians over the runs, each run's in brackets. Target (issue 20 item 5): within 5 points.", "",
             "| model | variant | predicted | measured | measured - predicted |", "|---|---|---:|---:|---:|"]
    for name, runs in results.items():
        for label, _w, _f in VARIANTS:
            pred = [r[label][0] for r in runs]
            meas = [r[label][1] for r in runs]
            diff = [m - p for p, m in zip(pred, meas, strict=True)]
            each = ", ".join(f"{d * 100:+.0f}" for d in diff)
            lines.append(f"| {name} | {label} | {statistics.median(pred) * 100:+.1f}% | "
                         f"{statistics.median(meas) * 100:+.1f}% | {statistics.median(diff) * 100:+.1f} pts ({each}) |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="mlp,gpt2,bert")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=1, help="timed steps per variant per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--update-doc", action="store_true")
    ap.add_argument("--results", type=Path, default=Path(tempfile.gettempdir()) / "memplan-fusion-bench.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results: dict[str, list[dict]] = {}
    for name in args.models.split(","):
        results[name] = []
        for r in range(args.repeats):
            results[name].append(one_run(name, args.steps, args.rounds))
            print(name, r, {k: f"{p * 100:+.1f}% / {m * 100:+.1f}%" for k, (p, m) in results[name][-1].items()},
                  flush=True)
    args.results.write_text(json.dumps(results, indent=1))
    publish(render(results, args.repeats), args.update_doc, "fusion", "Fused optimizer steps: predicted against measured")


if __name__ == "__main__":
    main()
