"""Solver benchmark: solve time and predicted overhead at 30/50/70% of keep-all activation memory.

Side by side on the same graphs and budgets: memplan's solvers, PyTorch's own knapsack solvers
(torch/_functorch/_activation_checkpointing/knapsack.py: dp, greedy, ilp) fed the same costs, Chen's
sqrt(n) and 'every k-th block'. Every plan is scored by memplan's simulator, so "overhead at equal
memory" means: predicted step time over keep-all's, for a plan whose simulated peak fits the budget.

PyTorch's knapsack picks which activations to *save* under a capacity, the rest are recomputed; its
capacity is not our budget (total peak), so we binary-search the largest capacity whose plan fits the
budget in the simulator, which is how a user would tune ``activation_memory_budget`` by hand.

    python benchmarks/solvers.py [--quick] [--out docs/benchmarks_solvers.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

from memplan.planner.graph import Graph
from memplan.planner.plan import Action
from memplan.planner.simulator import simulate_actions
from memplan.planner.synthetic import linear_chain
from memplan.solvers import activation_bytes, keep_all_report, solve, solvers
from memplan.planner.errors import MemplanError

CACHE = Path(os.environ.get("MEMPLAN_BENCH_CACHE", Path(__file__).resolve().parent / ".cache"))
FRACTIONS = (0.3, 0.5, 0.7)


# ---- PyTorch's knapsack solvers, fed memplan's costs ----------------------------------------------
def torch_knapsack_actions(graph: Graph, budget: int, kind: str) -> tuple[dict[int, Action] | None, float]:
    """Actions from torch's ``{kind}_knapsack`` at the capacity (of 41 tried, 0 to all) whose plan is
    fastest while fitting ``budget`` in the simulator; (None, time) if none fits. Also returns the total
    time spent inside the knapsack solver."""
    from torch._functorch._activation_checkpointing import knapsack

    fn = {"dp": knapsack.dp_knapsack, "greedy": knapsack.greedy_knapsack, "ilp": knapsack.ilp_knapsack}[kind]
    items = [t for t in graph.saved_activations if graph.tensors[t].recomputable]
    memory = [float(max(graph.tensors[t].bytes, 1)) for t in items]
    runtimes = [float(graph.ops[graph.tensors[t].producer].time_s) + 1e-12 for t in items]
    total = sum(memory)
    spent = 0.0

    def plan_at(capacity: float) -> dict[int, Action]:
        nonlocal spent
        t0 = time.perf_counter()
        _, save, _recompute = fn(memory, runtimes, capacity)
        spent += time.perf_counter() - t0
        keep = {items[i] for i in save}
        return {t: Action.RECOMPUTE for t in items if t not in keep}

    # The simulated peak is not monotone in the capacity (recomputing everything rebuilds everything at
    # once), so scan capacities and keep the fastest plan that fits, as a user tuning it would.
    best: dict[int, Action] | None = None
    best_time = float("inf")
    for k in range(41):
        actions = plan_at(total * k / 40)
        r = simulate_actions(graph, actions)
        if r.peak_bytes <= budget and r.time_s < best_time:
            best, best_time = actions, r.time_s
    return best, spent


# ---- graphs --------------------------------------------------------------------------------------
def profiled(name: str, **overrides) -> Graph:
    from memplan.planner.profiler import profile
    from memplan.planner.workloads import load_workload

    key = name + "".join(f"-{k}{v}" for k, v in sorted(overrides.items()))
    path = CACHE / f"{key}.json"
    if path.exists():
        return Graph.load(str(path))
    CACHE.mkdir(parents=True, exist_ok=True)
    w = load_workload(name, **overrides)
    g = profile(w.model, w.batch, w.loss_fn, name=key, progress=False)
    g.save(str(path))
    return g


def graphs(quick: bool) -> list[Graph]:
    out = [linear_chain(100, time_s=[1 + (i % 7) / 7 for i in range(100)],
                        activation_bytes=[1000 + 100 * (i % 5) for i in range(100)], name="chain-100"),
           linear_chain(1000, time_s=[1 + (i % 7) / 7 for i in range(1000)],
                        activation_bytes=[1000 + 100 * (i % 5) for i in range(1000)], name="chain-1000")]
    specs = [("gpt2", {}), ("bert", {}), ("resnet", {}), ("unet", {})] if quick else \
        [("gpt2", {"n_layer": 12}), ("bert", {"size": "base"}), ("resnet", {"size": "50"}), ("unet", {})]
    for name, kw in specs:
        try:
            out.append(profiled(name, **kw))
        except (MemplanError, TypeError) as e:
            print(f"skipping {name}{kw}: {e}", file=sys.stderr)
    return out


# ---- the run -------------------------------------------------------------------------------------
def run(quick: bool, time_limit_s: float) -> str:
    reg = solvers()
    methods = [m for m in ("dp", "ilp", "greedy", "capuchin", "chen", "every-k", "revolve") if m in reg]
    rows = []
    for g in graphs(quick):
        base = keep_all_report(g)
        act = activation_bytes(g)
        for frac in FRACTIONS:
            budget = g.fixed.resident_bytes + int(frac * act)
            cells = {}
            for m in methods:
                if reg[m].max_ops is not None and len(g.saved_activations) > reg[m].max_ops:
                    continue
                t0 = time.perf_counter()
                try:
                    r = solve(g, budget, m, time_limit_s=time_limit_s)
                    cells[m] = (r.report.time_s / base.time_s - 1, time.perf_counter() - t0, r.status)
                except MemplanError:
                    cells[m] = (None, time.perf_counter() - t0, "infeasible")
            for kind in ("dp", "greedy", "ilp"):
                t0 = time.perf_counter()
                try:
                    actions, _ = torch_knapsack_actions(g, budget, kind)
                except Exception as e:  # noqa: BLE001 - a baseline failing is a result to report
                    print(f"torch {kind} knapsack failed on {g.name}: {e}", file=sys.stderr)
                    actions = None
                el = time.perf_counter() - t0
                if actions is None:
                    cells[f"torch-{kind}"] = (None, el, "infeasible")
                else:
                    r = simulate_actions(g, actions)
                    cells[f"torch-{kind}"] = (r.time_s / base.time_s - 1, el, "feasible")
            rows.append((g.name, len(g.ops), len(g.saved_activations), frac, cells))
    cols = methods + ["torch-dp", "torch-greedy", "torch-ilp"]
    lines = [f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
             f"torch {torch.__version__}, Python {platform.python_version()}; time limit {time_limit_s:.0f} s per solve.",
             "",
             "Each cell: predicted overhead (step time over keep-all, minus 1) / wall time of the solve. "
             "'—' = no plan within the budget.", "",
             "| graph | ops | saved | budget | " + " | ".join(cols) + " |",
             "|---|---:|---:|---:|" + "---:|" * len(cols)]
    for name, n_ops, n_saved, frac, cells in rows:
        def fmt(c):
            if c is None:
                return "n/a"
            ov, el, _ = c
            return f"— / {el:.2f}s" if ov is None else f"{ov * 100:.1f}% / {el:.2f}s"
        lines.append(f"| {name} | {n_ops} | {n_saved} | {int(frac * 100)}% | "
                     + " | ".join(fmt(cells.get(c)) for c in cols) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small model configurations")
    ap.add_argument("--time-limit", type=float, default=60.0)
    args = ap.parse_args()
    print(run(args.quick, args.time_limit))


if __name__ == "__main__":
    main()
