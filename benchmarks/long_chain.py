"""The solvers on a 1,000-op chain at GPU byte scale (``gpu_scale(linear_chain(1000), 7)``: tensors of 64 MiB
to 4 GiB, keeping everything about 2 TB), at budgets above the least peak memplan finds, side by side in one
run: the chain DP (past its exact tables: memory rounded to a unit), the heuristics and ``auto``, each with the
same time limit. Per solver and budget: the predicted overhead over keeping everything, the status, and the
wall time (median, range over ``--repeats``).

    python benchmarks/long_chain.py [--repeats 2] [--time-limit 10] [--update-doc]
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

from memplan.planner.core.synthetic import gpu_scale, linear_chain  # noqa: E402
from memplan.solvers import keep_all_report, solve  # noqa: E402
from memplan.solvers.min_memory import least_peak  # noqa: E402

FRACTIONS = (0.05, 0.3, 0.6)
METHODS = ("dp", "capuchin", "greedy", "hierarchical", "auto")


def run(repeats: int, time_limit_s: float) -> list[dict]:
    g = gpu_scale(linear_chain(1000), 7)
    keep = keep_all_report(g)
    least, _ = least_peak(g, deadline=time.perf_counter() + 10)
    rows: dict[tuple[float, str], dict] = {}
    for _ in range(repeats):
        for frac in FRACTIONS:
            budget = least + int((keep.peak_bytes - least) * frac)
            for method in METHODS:
                t0 = time.perf_counter()
                r = solve(g, budget, method, time_limit_s=time_limit_s)
                row = rows.setdefault((frac, method), dict(frac=frac, method=method, budget=budget, wall=[]))
                row["wall"].append(time.perf_counter() - t0)
                row["overhead"] = r.report.time_s / keep.time_s - 1
                row["status"] = r.status
                row["unit"] = r.stats.get("unit_bytes")
    return list(rows.values())


def markdown(rows: list[dict], repeats: int, time_limit_s: float) -> str:
    import torch

    head = (f"Machine: {platform.machine()}; {platform.processor() or 'CPU'}; 2 cores; torch {torch.__version__}; "
            f"Python {platform.python_version()}; time limit {time_limit_s:g} s; {repeats} repeats. "
            "`python benchmarks/long_chain.py --update-doc`. Budget: the least peak memplan finds plus a fraction of "
            "what keeping everything adds to it; overheads predicted (simulated).\n\n"
            "| budget | solver | overhead | status | dp's memory unit | wall, median (range) |\n"
            "|--:|---|--:|---|--:|--:|\n")
    body = "".join(
        f"| +{r['frac']:.0%} ({r['budget'] / 2**30:.0f} GiB) | {r['method']} | {r['overhead']:+.1%} | {r['status']} | "
        f"{'-' if r['unit'] is None else format(r['unit'] / 2**20, '.0f') + ' MiB'} | "
        f"{statistics.median(r['wall']):.1f} s ({min(r['wall']):.1f}–{max(r['wall']):.1f}) |\n" for r in rows)
    return head + body


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--update-doc", action="store_true")
    a = ap.parse_args()
    publish(markdown(run(a.repeats, a.time_limit), a.repeats, a.time_limit), a.update_doc, "long-chain",
            "The chain DP on a 1,000-op chain at GPU scale")


if __name__ == "__main__":
    main()
