"""``auto`` (and the ILP it runs first) on the small real graphs it meets most: the built-in workloads at
their default sizes, profiled on this CPU (op times, the executor's replay and watch dispatch measured), at
50% and 70% of the keep-everything activation memory, with the default 60 s time limit.

Per model and budget: the plan's predicted overhead, its status and gap, the ILP's lazy-cut rounds (each a
re-solve after the simulator priced the model's plan differently), the strategy that won, and the solve
wall time, median and range over ``--repeats`` interleaved repeats. This is what the Lightning and HF
callbacks and ``memplan run`` wait for before the first step.

    python benchmarks/auto_small.py [--repeats 3] [--models mlp,resnet,unet,bert] [--update-doc]

Graphs are profiled once (real profiles, one thread) and cached as JSON under ``benchmarks/.cache``
(``MEMPLAN_BENCH_CACHE`` moves it).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _doc import publish  # noqa: E402

from memplan.planner.core.errors import Infeasible  # noqa: E402
from memplan.planner.core.graph import Graph  # noqa: E402
from memplan.solvers import activation_bytes, keep_all_report, solve  # noqa: E402

CACHE = Path(os.environ.get("MEMPLAN_BENCH_CACHE", Path(__file__).resolve().parent / ".cache"))


def _graph(name: str) -> Graph:
    """The built-in ``name`` profiled here once, then read from the cache (two versions of the code
    compared on the same graph)."""
    import torch

    from memplan.planner.probe.profiler import profile
    from memplan.planner.workloads import load_workload

    path = CACHE / f"auto_small-{name}.json"
    if path.exists():
        return Graph.model_validate_json(path.read_text())
    torch.manual_seed(0)
    w = load_workload(name)
    g = profile(w.model, w.batch, w.loss_fn, name=name, progress=False)
    CACHE.mkdir(parents=True, exist_ok=True)
    path.write_text(g.model_dump_json())
    return g


def run(models: list[str], repeats: int) -> list[dict]:
    import torch

    torch.set_num_threads(1)
    graphs = {m: _graph(m) for m in models}
    rows: dict[tuple[str, float], list[dict]] = {}
    for _ in range(repeats):
        for name, g in graphs.items():
            keep = keep_all_report(g)
            for frac in (0.5, 0.7):
                budget = int(g.fixed.resident_bytes + frac * activation_bytes(g))
                t0 = time.perf_counter()
                try:
                    r = solve(g, budget, "auto")
                except Infeasible:
                    r = None
                wall = time.perf_counter() - t0
                rows.setdefault((name, frac), []).append(dict(
                    overhead=None if r is None else r.report.time_s / keep.time_s - 1,
                    status="infeasible" if r is None else r.status, gap=None if r is None else r.gap,
                    won="-" if r is None else r.stats.get("won", "auto"),
                    rounds=None if r is None else r.stats.get("rounds"), wall=wall,
                    ops=len(g.ops), saved=len(g.saved_activations)))
    out = []
    for (name, frac), rs in rows.items():
        walls = [x["wall"] for x in rs]
        last = rs[-1]
        out.append(dict(model=name, frac=frac, ops=last["ops"], saved=last["saved"],
                        overhead=statistics.median([x["overhead"] for x in rs if x["overhead"] is not None] or [math.nan]),
                        statuses=sorted({x["status"] for x in rs}), gap=max((x["gap"] or 0.0) for x in rs),
                        won=sorted({str(x["won"]) for x in rs}), rounds=[x["rounds"] for x in rs],
                        wall=statistics.median(walls), lo=min(walls), hi=max(walls)))
    return out


def markdown(rows: list[dict], repeats: int) -> str:
    import torch

    head = (f"Machine: {platform.machine()}; {platform.processor() or 'CPU'}; 2 cores; torch {torch.__version__}; "
            f"Python {platform.python_version()}; torch on one thread; {repeats} interleaved repeats. "
            "`python benchmarks/auto_small.py --update-doc`.\n\n"
            "| model | ops | saved | budget | overhead | status | worst gap | won | ILP rounds (each repeat) "
            "| wall, median (range) |\n|---|--:|--:|---|--:|---|--:|---|---|--:|\n")
    body = "".join(
        f"| {r['model']} | {r['ops']} | {r['saved']} | {int(r['frac'] * 100)}% | "
        f"{'—' if math.isnan(r['overhead']) else format(r['overhead'], '+.2%')} | "
        f"{', '.join(r['statuses'])} | {r['gap']:.3%} | {', '.join(r['won'])} | "
        f"{', '.join('-' if x is None else str(x) for x in r['rounds'])} | "
        f"{r['wall']:.1f} s ({r['lo']:.1f}–{r['hi']:.1f}) |\n" for r in rows)
    return head + body


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="mlp,resnet,unet,bert")
    ap.add_argument("--update-doc", action="store_true")
    a = ap.parse_args()
    publish(markdown(run(a.models.split(","), a.repeats), a.repeats), a.update_doc, "auto-small",
            "auto on the built-ins' real graphs")


if __name__ == "__main__":
    main()
