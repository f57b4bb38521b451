"""The ILP on large graphs: its full-graph retention-interval model against every heuristic and peer.

For each profiled model and budget (fixed memory plus 30%, 50% and 70% of the keep-everything activation
memory), the ILP (``formulation="auto"``: the interval model on these graphs) runs with a time limit of
``--time-limit`` seconds per solve, ``--repeats`` times, interleaved with the other methods; each row
reports the plan's predicted overhead (simulated step time over keep-everything's, minus 1), the proven
lower bound as an overhead, the gap (plan minus bound, over the plan's step time) and the solve wall
time (median and range over the repeats). The other columns are memplan's heuristics, the DP family
and PyTorch's knapsack solvers fed memplan's costs (``benchmarks/solvers.py``'s
``torch_knapsack_actions``), each scored by the same simulator at the same budget.

    python benchmarks/ilp_scale.py [--quick] [--time-limit 60] [--repeats 3] [--backends cpsat,cbc,highs]
                                   [--update-doc]

Graphs are profiled once and cached as JSON under ``benchmarks/.cache`` (as ``benchmarks/solvers.py``
does; ``MEMPLAN_BENCH_CACHE`` moves it). Use :func:`ilp_rows` from another benchmark to get the rows.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import importlib.util  # noqa: E402

from _doc import update_section  # noqa: E402

from memplan.planner.core.errors import Infeasible  # noqa: E402
from memplan.planner.core.graph import Graph  # noqa: E402
from memplan.planner.core.simulator import simulate_actions  # noqa: E402
from memplan.solvers import activation_bytes, keep_all_report, solve  # noqa: E402

# the solver benchmark's graph cache and PyTorch-knapsack peers (by path: "solvers" is also a folder here)
_spec = importlib.util.spec_from_file_location("bench_solvers", Path(__file__).resolve().parent / "solvers.py")
bench_solvers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_solvers)
profiled, torch_knapsack_actions = bench_solvers.profiled, bench_solvers.torch_knapsack_actions

FRACTIONS = (0.3, 0.5, 0.7)
OTHERS = ("greedy", "capuchin", "dp", "chen", "every-k", "rotor", "revolve")
PEERS = ("dp", "greedy", "ilp")  # PyTorch's knapsack solvers
MODELS = [("GPT-2 (12 layers)", "gpt2", {"size": "base"}), ("BERT-base", "bert", {"size": "base"}),
          ("ResNet-50", "resnet", {"size": "50"}), ("U-Net (large)", "unet", {"size": "large"})]
QUICK = [("GPT-2 (12 layers)", "gpt2", {"size": "base"})]


@dataclass
class IlpRun:
    status: str
    overhead: float | None
    bound: float | None
    gap: float | None
    wall_s: float


def run_ilp(graph: Graph, budget: int, backend: str, time_limit_s: float) -> IlpRun:
    """One ILP solve: status, overhead, bound (as an overhead), gap and wall time; overhead None when no
    plan was found."""
    base = keep_all_report(graph).time_s
    t0 = time.perf_counter()
    try:
        r = solve(graph, budget, "ilp", backend=backend, time_limit_s=time_limit_s)
    except Infeasible:
        return IlpRun("infeasible", None, None, None, time.perf_counter() - t0)
    bound = None if r.lower_bound_s is None else r.lower_bound_s / base - 1
    return IlpRun(r.status, r.report.time_s / base - 1, bound, r.gap, time.perf_counter() - t0)


def run_other(graph: Graph, budget: int, method: str) -> tuple[float | None, float]:
    """(overhead or None, wall seconds) of one of the other methods at ``budget``."""
    base = keep_all_report(graph).time_s
    t0 = time.perf_counter()
    if method.startswith("torch-"):
        actions, _ = torch_knapsack_actions(graph, budget, method.removeprefix("torch-"))
        wall = time.perf_counter() - t0
        return (None if actions is None else simulate_actions(graph, actions).time_s / base - 1), wall
    try:
        r = solve(graph, budget, method, time_limit_s=60)
    except Infeasible:
        return None, time.perf_counter() - t0
    return r.report.time_s / base - 1, time.perf_counter() - t0


def ilp_rows(graphs: list[tuple[str, Graph]], *, backends: tuple[str, ...] = ("cpsat",), time_limit_s: float = 60,
             repeats: int = 3) -> list[dict]:
    """One dict per (graph, budget): the ILP's runs per backend and the other methods' (overhead, wall)."""
    rows = []
    others = OTHERS + tuple(f"torch-{k}" for k in PEERS)
    for label, g in graphs:
        for frac in FRACTIONS:
            budget = g.fixed.resident_bytes + int(frac * activation_bytes(g))
            row = {"graph": label, "ops": len(g.ops), "saved": len(g.saved_activations), "frac": frac,
                   "ilp": {b: [] for b in backends}, "others": {m: [] for m in others}}
            for rep in range(repeats):  # interleaved: each repeat runs every method once
                for b in backends:
                    if b == "cpsat" or rep == 0:  # the PuLP backends once (they are the slow ones)
                        row["ilp"][b].append(run_ilp(g, budget, b, time_limit_s))
                for m in others:
                    row["others"][m].append(run_other(g, budget, m))
            rows.append(row)
            print(_fmt_row(row), flush=True)
    return rows


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.2f}%"


def _wall(ws: list[float]) -> str:
    if len(ws) == 1:
        return f"{ws[0]:.1f} s"
    return f"{statistics.median(ws):.1f} s ({min(ws):.1f}–{max(ws):.1f})"


def _ilp_cell(runs: list[IlpRun]) -> str:
    best = min(runs, key=lambda r: (r.overhead is None, r.overhead or 0.0))
    if best.overhead is None:
        return f"— / {_wall([r.wall_s for r in runs])}"
    gaps = [r.gap for r in runs if r.gap is not None]
    gap = "none" if not gaps else f"{100 * statistics.median(gaps):.2f}%"
    return (f"{_pct(statistics.median([r.overhead for r in runs if r.overhead is not None]))} "
            f"(bound {_pct(best.bound)}, gap {gap}, {best.status}) / {_wall([r.wall_s for r in runs])}")


def _other_cell(runs: list[tuple[float | None, float]]) -> str:
    ov = runs[0][0]
    return f"{_pct(ov)} / {_wall([w for _, w in runs])}" if ov is not None else f"— / {_wall([w for _, w in runs])}"


def _fmt_row(row: dict) -> str:
    ilp = " | ".join(_ilp_cell(runs) for runs in row["ilp"].values())
    others = " | ".join(_other_cell(runs) for runs in row["others"].values())
    return f"| {row['graph']} | {row['ops']} | {row['saved']} | {int(100 * row['frac'])}% | {ilp} | {others} |"


def table(rows: list[dict], backends: tuple[str, ...], time_limit_s: float, repeats: int, wall_s: float) -> str:
    others = OTHERS + tuple(f"torch-{k}" for k in PEERS)
    head = ["graph", "ops", "saved", "budget", *(f"ilp ({b})" for b in backends), *others]
    lines = [
        f"Machine: {platform.processor() or platform.machine()}; 2 cores, shared with other engineers' test runs "
        f"while this ran (wall times are under load); torch {_torch_version()}; Python {platform.python_version()}. "
        f"ILP time limit {time_limit_s:g} s per solve, CP-SAT with 2 workers; {repeats} interleaved repeats "
        f"(CBC and HiGHS once); whole run {wall_s / 60:.0f} min.",
        "",
        "ILP cells: predicted overhead (median over repeats) (proven lower bound on the overhead, gap = plan "
        "minus bound over the plan's step time, status) / solve wall time, median (range). Other cells: "
        "predicted overhead / wall time. '—': no plan within the budget.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * 4 + "--:|" * (len(head) - 4),
    ]
    lines += [_fmt_row(r) for r in rows]
    return "\n".join(lines)


def _torch_version() -> str:
    try:
        import torch

        return torch.__version__
    except ImportError:
        return "(not installed)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="GPT-2 (12 layers) only")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backends", default="cpsat")
    ap.add_argument("--update-doc", action="store_true")
    args = ap.parse_args()
    backends = tuple(b.strip() for b in args.backends.split(",") if b.strip())
    t0 = time.perf_counter()
    graphs = [(label, profiled(name, **kw)) for label, name, kw in (QUICK if args.quick else MODELS)]
    rows = ilp_rows(graphs, backends=backends, time_limit_s=args.time_limit, repeats=args.repeats)
    text = table(rows, backends, args.time_limit, args.repeats, time.perf_counter() - t0)
    print(text)
    if args.update_doc:
        update_section("ilp-scale", "Solvers at scale: the full-graph ILP", text)


if __name__ == "__main__":
    main()
