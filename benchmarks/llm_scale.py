"""Certified plans at the size of the models people train: each strategy's plan against the best proven
lower bound, on a 1.1B Llama at 22, 32 and 80 layers and on GPT-2 and BERT (base, 12 layers).

Graphs are fake-profiled under the ``h100-80gb`` device spec (``memplan profile ... --device-spec
h100-80gb``; Llama batch 8, sequence 2048), once, cached as JSON under ``benchmarks/.cache``
(``MEMPLAN_BENCH_CACHE``). Budgets: fixed memory plus 50% and 70% of the keep-everything activation
memory. Per model, budget and strategy, over ``--repeats`` runs (interleaved): the plan's overhead
(simulated step time over keep-everything's, minus 1), the solve wall time, and the gap to the highest
lower bound proven in that row by any strategy (plan minus bound, over the plan's step time), each as
median and range. ``bound`` is that lower bound as an overhead; it holds over every keep / recompute /
recompute_each plan without offload (solvers/ilp/staircase.py). The ILP runs past its replay model's
size (400 saved activations) only, with ``--time-limit`` seconds, ``--ilp-repeats`` times (1 by default:
each run takes the whole limit).

    python benchmarks/llm_scale.py [--quick] [--repeats 3] [--time-limit 60] [--update-doc]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _doc import update_section  # benchmarks/_doc.py (the scripts run from this folder)

from memplan.planner.core.errors import Infeasible
from memplan.planner.core.graph import Graph
from memplan.solvers import activation_bytes, keep_all_report, solve

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("MEMPLAN_BENCH_CACHE", HERE / ".cache"))
LLAMA = str(HERE / "llama1b.py") + ":build"
MODELS = [  # (label, workload, --set options)
    ("Llama 1.1B, 22 layers", LLAMA, {"batch_size": 8}),
    ("Llama 1.1B shape, 32 layers", LLAMA, {"batch_size": 8, "n_layer": 32}),
    ("Llama 1.1B shape, 80 layers", LLAMA, {"batch_size": 8, "n_layer": 80}),
    ("GPT-2 (12 layers)", "gpt2", {"size": "base"}),
    ("BERT-base", "bert", {"size": "base"}),
]
FRACTIONS = (0.5, 0.7)
STRATEGIES = ("greedy", "capuchin", "hierarchical", "ilp")


def graph_for(workload: str, options: dict) -> Graph:
    """The workload's graph, fake-profiled under h100-80gb once and cached."""
    tag = "_".join(f"{k}{v}" for k, v in sorted(options.items()))
    path = CACHE / f"scale_{Path(workload.split(':')[0]).stem}_{tag}_h100.json"
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        sets = [x for k, v in options.items() for x in ("--set", f"{k}={v}")]
        subprocess.run([sys.executable, "-m", "memplan.api.cli", "profile", workload, "--device-spec", "h100-80gb",
                        *sets, "-o", str(path)], check=True, capture_output=True)
    return Graph.from_json(path.read_text())


def run(graph: Graph, budget: int, method: str, time_limit_s: float) -> tuple[float, float | None, float] | None:
    """(step time, lower bound or None, solve wall seconds), or None when the method finds no plan."""
    t0 = time.perf_counter()
    try:
        r = solve(graph, budget, method, time_limit_s=time_limit_s)
    except Infeasible:
        return None
    return r.report.time_s, r.lower_bound_s, time.perf_counter() - t0


def fmt(values: list[float], pct: bool = True) -> str:
    if not values:
        return "-"
    f = (lambda v: f"{100 * v:.2f}%") if pct else (lambda v: f"{v:.1f}")
    med = statistics.median(values)
    return f(med) if len(values) == 1 or min(values) == max(values) else f"{f(med)} [{f(min(values))}-{f(max(values))}]"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the 22-layer Llama only, one repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ilp-repeats", type=int, default=1, help="ILP repeats (each takes the whole time limit)")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--update-doc", action="store_true")
    args = ap.parse_args()
    models = MODELS[:1] if args.quick else MODELS
    repeats = 1 if args.quick else args.repeats
    lines = ["| model | budget | strategy | overhead | bound | gap to bound | solve s |", "|---|---|---|---|---|---|---|"]
    for label, workload, options in models:
        g = graph_for(workload, options)
        base = keep_all_report(g).time_s
        big = len(g.saved_activations) > 400
        print(f"{label}: {len(g.ops)} ops, {len(g.saved_activations)} saved activations", flush=True)
        for frac in FRACTIONS:
            budget = g.fixed.resident_bytes + int(frac * activation_bytes(g))
            results: dict[str, list[tuple[float, float | None, float]]] = {m: [] for m in STRATEGIES}
            for rep in range(repeats):
                for m in STRATEGIES:
                    if m == "ilp" and (not big or rep >= args.ilp_repeats):
                        continue
                    out = run(g, budget, m, args.time_limit)
                    if out is not None:
                        results[m].append(out)
                    print(f"  {frac:.0%} {m} rep {rep}: {out}", flush=True)
            bounds = [b for rs in results.values() for _, b, _ in rs if b is not None]
            bound = max(bounds) if bounds else None
            for m in STRATEGIES:
                rs = results[m]
                if not rs and m == "ilp" and not big:
                    continue
                over = [t / base - 1 for t, _, _ in rs]
                gaps = [(t - bound) / t for t, _, _ in rs] if bound is not None else []
                lines.append(f"| {label} | {frac:.0%} | {m} | {fmt(over) if rs else 'no plan'} | "
                             f"{'-' if bound is None else f'{100 * (bound / base - 1):.2f}%'} | {fmt(gaps)} | "
                             f"{fmt([s for _, _, s in rs], pct=False)} |")
            print("\n".join(lines[-len(STRATEGIES):]), flush=True)
    load = os.getloadavg()[0]
    text = "\n".join([
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.machine()} ({os.cpu_count()} cores) shared with four "
        f"other agents' jobs (load average {load:.1f} at the end): solve times are wall times under that load. "
        f"{repeats} repeats (the ILP: {args.ilp_repeats}), time limit "
        f"{args.time_limit:g} s, `python benchmarks/llm_scale.py`.", "", *lines])
    print(text)
    if args.update_doc:
        update_section("llm-scale", "Certified plans for LLM-sized graphs", text)


if __name__ == "__main__":
    main()
