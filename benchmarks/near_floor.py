"""``auto`` near the least peak: budgets from the least peak memplan finds up to where keep / recompute plans
fit again, on the built-ins' real graphs (profiled on this CPU, cached as ``benchmarks/auto_small.py``
caches them), with a 20 s time limit.

Below every keep / recompute plan's peak only plans with per-use replays (``recompute_each``) fit. ``auto``
used to return the first such plan that fit (the multilevel family's, else the least-peak plan); it now
polishes every fallback that fits (``solvers/evict.py``, ``polish``) and keeps the fastest. Side by side in
one run, per budget: auto's plan, the multilevel plan (what the previous rule returned first) and the
least-peak plan (``min_memory_actions``), each as its predicted overhead over keeping everything; auto's
median and range over ``--repeats`` interleaved repeats, and its wall time.

    python benchmarks/near_floor.py [--repeats 2] [--models unet,resnet,bert] [--update-doc]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _doc import publish  # noqa: E402
from auto_small import _graph  # noqa: E402

from memplan.planner.core.errors import Infeasible  # noqa: E402
from memplan.planner.core.simulator import simulate_actions  # noqa: E402
from memplan.solvers import keep_all_report, solve  # noqa: E402
from memplan.solvers.min_memory import least_peak, min_memory_actions  # noqa: E402

FRACTIONS = (0.0, 0.025, 0.05, 0.1, 0.2)
TIME_LIMIT_S = 20.0


def _overhead(g, budget: int, method: str, keep_s: float) -> float | None:
    try:
        return solve(g, budget, method, time_limit_s=TIME_LIMIT_S).report.time_s / keep_s - 1
    except Infeasible:
        return None


def run(models: list[str], repeats: int) -> list[dict]:
    import torch

    torch.set_num_threads(1)
    rows: dict[tuple[str, float], dict] = {}
    graphs = {m: _graph(m) for m in models}
    for rep in range(repeats):
        for name, g in graphs.items():
            keep = keep_all_report(g)
            least, _ = least_peak(g, deadline=time.perf_counter() + 5)
            lowest, prefetch_at = min_memory_actions(g, time_limit_s=5)
            low = simulate_actions(g, lowest, prefetch_at=prefetch_at)
            for frac in FRACTIONS:
                budget = least + int((keep.peak_bytes - least) * frac)
                row = rows.setdefault((name, frac), dict(model=name, frac=frac, budget=budget, auto=[], wall=[],
                                                         keep_peak=keep.peak_bytes))
                t0 = time.perf_counter()
                try:
                    r = solve(g, budget, "auto", time_limit_s=TIME_LIMIT_S)
                    row["auto"].append(r.report.time_s / keep.time_s - 1)
                    row.setdefault("won", set()).add(r.stats.get("won", "auto"))
                except Infeasible:
                    row.setdefault("won", set()).add("refused")
                row["wall"].append(time.perf_counter() - t0)
                if rep == 0:
                    row["multilevel"] = _overhead(g, budget, "multilevel", keep.time_s)
                    row["least_peak"] = (low.time_s / keep.time_s - 1) if low.peak_bytes <= budget else None
    return list(rows.values())


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:+.1%}"


def markdown(rows: list[dict], repeats: int) -> str:
    import torch

    head = (f"Machine: {platform.machine()}; {platform.processor() or 'CPU'}; 2 cores; torch {torch.__version__}; "
            f"Python {platform.python_version()}; torch on one thread; time limit {TIME_LIMIT_S:g} s; {repeats} "
            "interleaved repeats of auto. `python benchmarks/near_floor.py --update-doc`. Budget: the least peak "
            "memplan finds plus a fraction of what keeping everything adds to it. Overheads are predicted "
            "(simulated) against keeping everything.\n\n"
            "| model | budget | bytes | auto (median, range) | won | multilevel plan | least-peak plan | auto wall, median |\n"
            "|---|--:|--:|--:|---|--:|--:|--:|\n")
    body = ""
    for r in rows:
        a = r["auto"]
        spread = f" ({min(a):+.1%}..{max(a):+.1%})" if len(a) > 1 else ""
        body += (f"| {r['model']} | +{r['frac']:.1%} | {r['budget'] / 2**20:.2f} MiB | "
                 f"{_pct(statistics.median(a)) if a else 'refused'}{spread} | {', '.join(sorted(r['won']))} | "
                 f"{_pct(r.get('multilevel'))} | {_pct(r.get('least_peak'))} | {statistics.median(r['wall']):.1f} s |\n")
    return head + body


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--models", default="unet,resnet,bert")
    ap.add_argument("--update-doc", action="store_true")
    a = ap.parse_args()
    publish(markdown(run(a.models.split(","), a.repeats), a.repeats), a.update_doc, "near-floor",
            "auto near the least peak: per-use plans polished")


if __name__ == "__main__":
    main()
