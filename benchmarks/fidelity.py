"""Fidelity: the simulator's peak for the keep-everything plan against the measured peak of a real step.

For each workload: profile it (planner/probe/profiler.py), simulate ``Plan.keep_all`` (planner/core/simulator.py),
and compare with the peak of a real training step measured by the allocator (planner/probe/measure.py, which
shares nothing with the profiler's bookkeeping). Prints a markdown table; ``--update-doc`` also replaces
the table in docs/benchmarks.md (between the ``fidelity:begin``/``fidelity:end`` markers).

    python benchmarks/fidelity.py [--full] [--update-doc]
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch
from _doc import update_section  # benchmarks/_doc.py (the scripts run from this folder)

from memplan.planner.core.plan import Plan
from memplan.planner.core.simulator import simulate
from memplan.planner.core.units import format_bytes
from memplan.planner.probe.measure import measure_step
from memplan.planner.probe.profiler import profile
from memplan.planner.workloads import load_workload

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
DEFAULT = [("mlp", {}), ("resnet", {}), ("gpt2", {}), ("unet", {}), ("bert", {}),
           ("gpt2", {"n_layer": 12}), ("resnet", {"size": "18"})]
FULL = [("gpt2", {"size": "base"}), ("bert", {"size": "base"}), ("resnet", {"size": "50"}),
        ("unet", {"size": "large"}), ("mlp", {"size": "large"})]


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    return f"{cpu}; {device}; torch {torch.__version__}; Python {platform.python_version()}"


def row(name: str, overrides: dict) -> dict:
    label = name + "".join(f" {k}={v}" for k, v in overrides.items())
    w = load_workload(name, **overrides)
    start = time.perf_counter()
    g = profile(w.model, w.batch, w.loss_fn, name=label, progress=False, measure=False)
    profile_s = time.perf_counter() - start
    # measured after profiling, on the same model and optimizer state: an independent, real step
    m = measure_step(w.model, w.batch, w.loss_fn, steps=3, warmup=1)
    r = simulate(g, Plan.keep_all(g))
    return {"model": label, "ops": len(g.ops), "tensors": len(g.tensors), "saved": len(g.saved_activations),
            "measured": m.peak_bytes, "simulated": r.peak_bytes,
            "error": (r.peak_bytes - m.peak_bytes) / m.peak_bytes, "peak_at": f"{r.peak_phase} {r.peak_op or ''}".strip(),
            "measured_s": m.step_time_s, "simulated_s": r.time_s, "profile_s": profile_s}


def table(rows: list[dict]) -> str:
    lines = ["| model | ops | tensors | saved | measured peak | simulated peak | error | simulated peak at "
             "| measured step | simulated step | profiling |",
             "|---|--:|--:|--:|--:|--:|--:|---|--:|--:|--:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['ops']} | {r['tensors']} | {r['saved']} | {format_bytes(r['measured'])} "
                     f"| {format_bytes(r['simulated'])} | {r['error']:+.2%} | {r['peak_at']} "
                     f"| {r['measured_s'] * 1e3:.0f} ms | {r['simulated_s'] * 1e3:.0f} ms | {r['profile_s']:.1f} s |")
    return "\n".join(lines)


def update_doc(text: str) -> None:
    update_section("fidelity", "Fidelity: simulated vs measured peak (keep everything)", text, DOC)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="also the base-size models (minutes on a CPU)")
    ap.add_argument("--update-doc", action="store_true", help=f"write the table into {DOC}")
    args = ap.parse_args()
    rows = [row(name, kw) for name, kw in DEFAULT + (FULL if args.full else [])]
    text = f"Machine: {machine()}.\n\n{table(rows)}"
    print(text)
    if args.update_doc:
        update_doc(text)


if __name__ == "__main__":
    main()
