"""Solver benchmark: solve time and predicted overhead at 30/50/70% (chains) and 50/70/90% (models) of
keep-all activation memory.

Side by side on the same graphs and budgets: memplan's solvers (``dp``: the exact chain DP on chains, the
hierarchical solver on models), PyTorch's own knapsack solvers
(torch/_functorch/_activation_checkpointing/knapsack.py: dp, greedy, ilp) fed the same costs, PyTorch's
module-level SAC MILP (torch/distributed/_tools/sac_ilp.py) fed memplan's module costs, Chen's sqrt(n)
and 'every k-th block'. Every plan is scored by memplan's simulator, so "overhead at equal
memory" means: predicted step time over keep-all's, minus one, for a plan whose simulated peak fits the
budget. A budget of X% is the fixed memory plus X% of what keeping every activation adds on top of it.

PyTorch's knapsack picks which activations to *save* under a capacity, the rest are recomputed; its
capacity is not our budget (total peak), so we scan 41 capacities and keep the fastest plan that fits the
budget in the simulator, which is how a user would tune ``activation_memory_budget`` by hand. Its solve
time is the time of those 41 knapsack calls (the simulations are not counted).

Graphs: profiled training steps of GPT-2 (12 layers, ``gpt2`` size ``base``), BERT-base (``bert`` size
``base``), a ResNet-50 (``resnet`` size ``50``), a U-Net (``unet`` size ``large``) and a 48-layer GPT
(``gpt2`` small width, ``n_layer=48``), profiled once and
cached under ``benchmarks/.cache`` (``MEMPLAN_BENCH_CACHE``), and synthetic chains of 100 and 1000 ops.
Also: the ILP's optimality gap after ``--gap-time-limit`` seconds on the GPT-2 op graph at 50%.

    python benchmarks/solvers.py [--quick] [--time-limit 20] [--gap-time-limit 60] [--update-doc]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

from _doc import update_section  # benchmarks/_doc.py (the scripts run from this folder)

from memplan.planner.core.errors import MemplanError
from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Action
from memplan.planner.core.simulator import simulate_actions
from memplan.planner.core.synthetic import linear_chain
from memplan.solvers import activation_bytes, keep_all_report, solve, solvers

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("MEMPLAN_BENCH_CACHE", Path(__file__).resolve().parent / ".cache"))
DOC = ROOT / "docs" / "benchmarks.md"
FRACTIONS = (0.3, 0.5, 0.7)         # synthetic chains
MODEL_FRACTIONS = (0.5, 0.7, 0.9)   # profiled models (at 30% no method finds a plan on most of them)
METHODS = ("dp", "ilp", "greedy", "capuchin", "chen", "every-k")
PEERS = ("greedy", "capuchin", "torch-dp", "torch-greedy", "torch-ilp", "sac-milp")  # what dp must not lose to
TIMING_RUNS = 3
TORCH = ("dp", "greedy", "ilp")


# ---- PyTorch's knapsack solvers, fed memplan's costs ----------------------------------------------
def torch_knapsack_actions(graph: Graph, budget: int, kind: str) -> tuple[dict[int, Action] | None, float]:
    """Actions from torch's ``{kind}_knapsack`` at the capacity (of 41 tried, 0 to all) whose plan is
    fastest while fitting ``budget`` in the simulator, or None if none fits; and the total time spent
    inside the knapsack solver (seconds)."""
    from torch._functorch._activation_checkpointing import knapsack

    fn = {"dp": knapsack.dp_knapsack, "greedy": knapsack.greedy_knapsack, "ilp": knapsack.ilp_knapsack}[kind]
    items = [t for t in graph.saved_activations if graph.tensors[t].recomputable]
    # as the partitioner feeds them: memory as fractions of the total (dp_knapsack quantises to 1e-4 of
    # the unit, so bytes would make a table of n x total*1e4 cells), runtimes in seconds
    sizes = [max(graph.tensors[t].bytes, 1) for t in items]
    memory = [b / sum(sizes) for b in sizes]
    runtimes = [float(graph.ops[graph.tensors[t].producer].time_s) + 1e-12 for t in items]
    total = 1.0
    spent_s = 0.0

    def plan_at(capacity: float) -> dict[int, Action]:
        nonlocal spent_s
        t0 = time.perf_counter()
        _, save, _recompute = fn(memory, runtimes, capacity)
        spent_s += time.perf_counter() - t0
        keep = {items[i] for i in save}
        return {t: Action.RECOMPUTE for t in items if t not in keep}

    # The simulated peak is not monotone in the capacity (recomputing everything rebuilds everything at
    # once), so scan capacities and keep the fastest plan that fits, as a user tuning it would.
    best: dict[int, Action] | None = None
    best_time_s = float("inf")
    for k in range(41):
        actions = plan_at(total * k / 40)
        r = simulate_actions(graph, actions)
        if r.peak_bytes <= budget and r.time_s < best_time_s:
            best, best_time_s = actions, r.time_s
    return best, spent_s


# ---- PyTorch's module-level SAC MILP (torch.distributed._tools.sac_ilp), fed memplan's costs ---------
SAC_ESTIMATOR_NOTE = ("SACEstimator (torch.distributed._tools.sac_estimator) could not run here: its runtime "
                      "estimates need CUDA in both modes (the roofline asserts CUDA capabilities, the benchmark "
                      "times with CUDA events), and on this CPU-only torch the process aborts inside its "
                      "dispatch mode; so sac_milp is fed memplan's module-level costs instead")


def _tradeoff(graph: Graph, items: list[int]) -> tuple[list[int], list[float], list[float]]:
    """A module's discard / recompute trade-off as SACEstimator builds it: its recomputable saved
    activations, cheapest recompute time per byte first; returns the order and the lower convex hull of
    (fraction of memory discarded, fraction of recompute time) as sac_milp's slopes and intercepts."""
    order = sorted(items, key=lambda t: graph.ops[graph.tensors[t].producer].time_s / max(1, graph.tensors[t].bytes))
    mem = sum(graph.tensors[t].bytes for t in order) or 1
    run = sum(graph.ops[graph.tensors[t].producer].time_s for t in order) or 1e-12
    pts, x, y = [(0.0, 0.0)], 0.0, 0.0
    for t in order:
        x += graph.tensors[t].bytes / mem
        y += graph.ops[graph.tensors[t].producer].time_s / run
        pts.append((x, y))
    hull: list[tuple[float, float]] = []
    for p in pts:  # lower convex hull (Andrew's monotone chain)
        while len(hull) >= 2 and ((hull[-1][0] - hull[-2][0]) * (p[1] - hull[-2][1])
                                  - (hull[-1][1] - hull[-2][1]) * (p[0] - hull[-2][0])) <= 0:
            hull.pop()
        hull.append(p)
    slopes, intercepts = [], []
    for (x0, y0), (x1, y1) in zip(hull, hull[1:], strict=False):
        if x1 > x0:
            slopes.append((y1 - y0) / (x1 - x0))
            intercepts.append(y0 - slopes[-1] * x0)
    return order, slopes or [0.0], intercepts or [0.0]


def sac_milp_graph(graph: Graph):
    """sac_ilp's module tree (torch.distributed._tools.ilp_utils.Graph) from memplan's graph: one node per
    module path (and the root), with the fields ``aggregate_stats`` would fill from MemTracker,
    RuntimeEstimator and SACEstimator computed from memplan's op costs instead; and, per module, the
    recompute order its discard fraction is translated with."""
    from torch.distributed._tools.ilp_utils import Graph as ModGraph

    ops, tensors = graph.ops, graph.tensors
    root = "model"
    names: dict[str, list[int]] = {root: []}
    for op in ops:
        parts = [p for p in op.module.split(".") if p]
        names[root].append(op.id)
        for d in range(1, len(parts) + 1):
            names.setdefault(root + "." + ".".join(parts[:d]), []).append(op.id)
    first = {m: min(o) for m, o in names.items() if o}
    last = {m: max(o) for m, o in names.items() if o}
    pre = sorted(first, key=lambda m: (first[m], m.count(".")))
    post = sorted(first, key=lambda m: (last[m], -m.count(".")))
    saved = set(graph.saved_activations)
    net = [op.backward_grad_alloc_bytes - op.backward_grad_free_bytes for op in ops]
    after = [0] * (len(ops) + 1)
    for i in range(len(ops) - 1, -1, -1):
        after[i] = after[i + 1] + net[i]
    produced_before = [0] * (len(ops) + 1)
    for i, op in enumerate(ops):
        produced_before[i + 1] = produced_before[i] + sum(tensors[t].bytes for t in op.outputs if t in saved)
    g = ModGraph(len(pre))
    g.fw_post_order = post
    orders = {}
    for i, m in enumerate(pre):
        mops = set(names[m])
        acts = [t for t in saved if tensors[t].producer in mops]
        rec = [t for t in acts if tensors[t].recomputable]
        order, slopes, intercepts = _tradeoff(graph, rec)
        orders[m] = order
        params = {t for o in mops for t in ops[o].inputs if tensors[t].kind == "param"}
        act = sum(tensors[t].bytes for t in acts)
        inputs = {t for o in mops for t in ops[o].inputs if tensors[t].kind == "activation"
                  and tensors[t].producer not in mops}
        outputs = {t for o in mops for t in ops[o].outputs
                   if any(c not in mops for c in graph.consumers.get(t, ()))}
        node = {"fqn": m, "index": i, "pos_fw_post_order": post.index(m),
                "param_per_module": graph.fixed.params_bytes if m == root else sum(tensors[t].bytes for t in params),
                "grad_per_module": sum(tensors[t].bytes for t in params), "grad_total": max(0, after[first[m]]),
                "act_fw_per_module": act, "act_bw_per_module": act,
                "act_grad_per_module": sum(tensors[t].bytes for t in outputs),
                "act_total": produced_before[last[m] + 1],  # live at its backward peak: all saved so far
                "input_per_module": sum(tensors[t].bytes for t in inputs),
                "output_per_module": sum(tensors[t].bytes for t in outputs),
                "fw_runtime_per_module": sum(ops[o].time_s for o in mops) * 1e3,
                "bw_runtime_per_module": sum(ops[o].backward_time_s for o in mops) * 1e3,
                # a module saving nothing has nothing to discard: a leaf to sac_milp (which divides by
                # its activation memory when it may checkpoint it)
                "is_leaf": act == 0 or not any(n.startswith(m + ".") for n in first), "sac_runtime":
                sum(ops[tensors[t].producer].time_s for t in rec) * 1e3, "sac_memory": act,
                "n_segments": len(slopes), "slopes": slopes, "intercepts": intercepts, "breakpoints": [],
                "tradeoff_curve": {}}
        g.add_node(node)
    for i in range(len(pre)):
        for j in range(i, len(pre)):
            if pre[j] == pre[i] or pre[j].startswith(pre[i] + "."):
                g.ad_matrix[i][j] = 1
            else:
                break
    return g, orders


def sac_milp_actions(graph: Graph, budget: int, scan: int = 7) -> tuple[dict[int, Action] | None, float]:
    """Actions from torch's ``sac_milp`` (module-level: which modules to checkpoint and what fraction of
    their activation memory to discard), each discard fraction translated into recomputing the module's
    activations cheapest-per-byte first (what SAC's per-module policy does). Its memory model is its own
    (parameters, gradients, activations; no optimizer state or batch), so, as with the knapsack, ``scan``
    budgets around ours are tried and the fastest plan fitting ``budget`` in memplan's simulator is kept.
    Returns (actions or None, seconds inside sac_milp)."""
    import logging

    from torch.distributed._tools.sac_ilp import sac_milp

    logging.getLogger("torch.distributed._tools.sac_ilp").setLevel(logging.CRITICAL)
    from memplan.solvers.hierarchical import block_depth

    g, orders = sac_milp_graph(graph)
    # AC units as torch's users name them (transformer layers, ResNet bottlenecks): the modules at the block
    # level; over every module CBC does not finish within its own 180 s limit on GPT-2
    depth = block_depth(graph)
    units = sorted({"model." + ".".join([p for p in op.module.split(".") if p][:depth]) for op in graph.ops
                    if len([p for p in op.module.split(".") if p]) >= depth})
    units = [u for u in units if u in g.name2node and not g.name2node[u]["is_leaf"]]
    other_fixed = graph.fixed.resident_bytes - graph.fixed.params_bytes
    best, best_s, spent_s = None, float("inf"), 0.0
    for k in range(scan):
        model_budget = (budget - other_fixed) * (0.5 + k / (scan - 1))
        t0 = time.perf_counter()
        decisions, _, peak = sac_milp(g, memory_budget=model_budget / 2**30, ac_units=units)
        spent_s += time.perf_counter() - t0
        if peak < 0:
            continue
        actions: dict[int, Action] = {}
        for fqn, ratio in decisions.items():
            order = orders[fqn]
            goal = ratio * sum(graph.tensors[t].bytes for t in order)
            dropped = 0
            for t in order:
                if dropped >= goal - 1e-9:
                    break
                actions[t] = Action.RECOMPUTE
                dropped += graph.tensors[t].bytes
        r = simulate_actions(graph, actions)
        if r.peak_bytes <= budget and r.time_s < best_s:
            best, best_s = actions, r.time_s
    return best, spent_s


# ---- graphs --------------------------------------------------------------------------------------
def profiled(name: str, **overrides) -> Graph:
    """The profiled graph of built-in workload ``name`` (cached as JSON; profiled on first use)."""
    from memplan.planner.probe.profiler import profile
    from memplan.planner.workloads import load_workload

    key = name + "".join(f"-{k}{v}" for k, v in sorted(overrides.items()))
    path = CACHE / f"{key}.json"
    if path.exists():
        return Graph.load(str(path))
    CACHE.mkdir(parents=True, exist_ok=True)
    w = load_workload(name, **overrides)
    g = profile(w.model, w.batch, w.loss_fn, name=key, progress=False, measure=False)
    g.save(str(path))
    return g


def _chain(n: int) -> Graph:
    return linear_chain(n, time_s=[1 + (i % 7) / 7 for i in range(n)],
                        backward_time_s=[2 + (i % 5) / 5 for i in range(n)],
                        activation_bytes=[1000 + 100 * (i % 5) for i in range(n)], name=f"chain-{n}")


def graphs(quick: bool) -> list[tuple[str, Graph]]:
    """(label, graph) pairs: the synthetic chains and the profiled models (small presets with --quick)."""
    out = [("chain-100", _chain(100)), ("chain-1000", _chain(1000))]
    specs = [("gpt2", {}), ("bert", {}), ("resnet", {}), ("unet", {})] if quick else \
        [("gpt2", {"size": "base"}), ("bert", {"size": "base"}), ("resnet", {"size": "50"}),
         ("unet", {"size": "large"}), ("gpt2", {"n_layer": 48})]
    labels = {"gpt2": "GPT-2 (12 layers)", "bert": "BERT-base", "resnet": "ResNet-50", "unet": "U-Net (large)",
              "gpt2-48": "GPT (48 layers, small width)"}
    for name, kw in specs:
        label = labels[name + ("-48" if kw.get("n_layer") == 48 else "")]
        try:
            out.append((label if not quick else name, profiled(name, **kw)))
        except (MemplanError, TypeError) as e:
            print(f"skipping {name}{kw}: {e}", file=sys.stderr)
    return out


# ---- the run -------------------------------------------------------------------------------------
Cell = tuple[float | None, float, str]  # (overhead or None when no plan fits, solve seconds, status)


def run_graph(g: Graph, time_limit_s: float) -> dict[float, dict[str, Cell]]:
    """Every method and peer at every budget fraction of one graph."""
    reg = solvers()
    base_s = keep_all_report(g).time_s
    act = activation_bytes(g)
    out: dict[float, dict[str, Cell]] = {}
    for frac in (FRACTIONS if g.name.startswith("chain") else MODEL_FRACTIONS):
        budget = g.fixed.resident_bytes + int(frac * act)
        cells: dict[str, Cell] = {}
        for m in METHODS:
            if m not in reg or (reg[m].max_ops is not None and len(g.saved_activations) > reg[m].max_ops):
                continue
            t0 = time.perf_counter()
            try:
                r = solve(g, budget, m, time_limit_s=time_limit_s)
                cells[m] = (r.report.time_s / base_s - 1, time.perf_counter() - t0, r.status)
            except MemplanError:
                cells[m] = (None, time.perf_counter() - t0, "infeasible")
            print(f"  {g.name} {frac:.0%} {m}: {cells[m]}", file=sys.stderr, flush=True)
        for kind in TORCH:
            try:
                actions, spent_s = torch_knapsack_actions(g, budget, kind)
            except Exception as e:  # noqa: BLE001 - a baseline failing is a result to report
                print(f"torch {kind} knapsack failed on {g.name}: {e}", file=sys.stderr)
                actions, spent_s = None, float("nan")
            if actions is None:
                cells[f"torch-{kind}"] = (None, spent_s, "infeasible")
            else:
                cells[f"torch-{kind}"] = (simulate_actions(g, actions).time_s / base_s - 1, spent_s, "feasible")
        if not g.name.startswith("chain"):  # module-level: chains have no modules to checkpoint
            try:
                actions, spent_s = sac_milp_actions(g, budget)
            except Exception as e:  # noqa: BLE001 - a baseline failing is a result to report
                print(f"sac_milp failed on {g.name}: {e}", file=sys.stderr)
                actions, spent_s = None, float("nan")
            cells["sac-milp"] = ((None, spent_s, "infeasible") if actions is None else
                                 (simulate_actions(g, actions).time_s / base_s - 1, spent_s, "feasible"))
            print(f"  {g.name} {frac:.0%} sac-milp: {cells['sac-milp']}", file=sys.stderr, flush=True)
        out[frac] = cells
    return out


def dp_timing(g: Graph, frac: float, runs: int = TIMING_RUNS) -> list[float]:
    """Wall seconds of ``solve(g, budget, "dp")`` at ``frac``, ``runs`` times (interleaved with nothing
    else: the machine's load is what varies)."""
    budget = g.fixed.resident_bytes + int(frac * activation_bytes(g))
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        try:
            solve(g, budget, "dp")
        except MemplanError:
            pass
        out.append(time.perf_counter() - t0)
    return out


def ilp_gap(g: Graph, frac: float, time_limit_s: float) -> dict:
    """The ILP at ``frac`` of ``g``'s activation memory with ``time_limit_s``: status, gap, times."""
    budget = g.fixed.resident_bytes + int(frac * activation_bytes(g))
    base_s = keep_all_report(g).time_s
    t0 = time.perf_counter()
    r = solve(g, budget, "ilp", time_limit_s=time_limit_s)
    return {"status": r.status, "gap": r.gap, "wall_s": time.perf_counter() - t0,
            "overhead": r.report.time_s / base_s - 1, "bound_overhead":
            None if r.lower_bound_s is None else r.lower_bound_s / base_s - 1,
            "warm_overhead": None if r.stats.get("warm_start_s") is None else r.stats["warm_start_s"] / base_s - 1,
            "warm_start": r.stats.get("warm_start", "none"),
            "model_bound_overhead": None if r.stats.get("model_bound_s") is None
            else r.stats["model_bound_s"] / base_s - 1, "model_status": r.stats.get("model_status"),
            "variables": r.stats.get("variables"), "rows": r.stats.get("rows")}


def _fmt(c: Cell | None) -> str:
    if c is None:
        return "n/a"
    ov, el, status = c
    if ov is None:
        return f"— / {el:.2f} s"
    mark = "*" if status == "timeout" else ""
    return f"{ov * 100:.1f}%{mark} / {el:.2f} s"


def _gap(cells: dict[str, Cell]) -> str:
    """dp's overhead minus the best peer's (percentage points; negative: dp is ahead)."""
    dp = cells.get("dp")
    peers = [cells[p][0] for p in PEERS if p in cells and cells[p][0] is not None]
    if dp is None or dp[0] is None:
        return "—" if peers else "both —"
    if not peers:
        return "only dp fits"
    return f"{(dp[0] - min(peers)) * 100:+.2f}"


def render(results, gap: dict | None, time_limit_s: float, gap_limit_s: float, wall_s: float,
           timings: dict[str, list[float]] | None = None) -> str:
    cols = [m for m in METHODS] + [f"torch-{k}" for k in TORCH] + ["sac-milp"]
    try:
        import torch

        torch_v = torch.__version__
    except ImportError:
        torch_v = "not installed"
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    lines = [
        f"Machine: {cpu}; {os.cpu_count()} cores, shared with other engineers' test runs while this ran "
        f"(timings are under load: compare the columns of one row, not absolute seconds); torch {torch_v}; "
        f"Python {platform.python_version()}; no GPU. ILP time limit {time_limit_s:.0f} s per solve (the other "
        f"methods finish well before theirs); whole run {wall_s / 60:.0f} min.",
        "",
        "Each cell: predicted overhead (simulated step time over keep-all's, minus 1) / solve wall time. "
        "'—': no plan within the budget; 'n/a': the method refuses a graph this size (the ILP above 400 "
        "saved activations); '*': the time limit stopped the search (the best plan found is shown). "
        "`dp` is the exact chain DP on the chains and the hierarchical solver (`solvers/hierarchical.py`) on "
        "the models. torch-*: PyTorch's knapsack solvers fed memplan's costs (time: the 41 knapsack calls). "
        "sac-milp: PyTorch's module-level selective-checkpointing MILP (`torch.distributed._tools.sac_ilp."
        "sac_milp`, CBC) fed memplan's module costs, AC units the block-level modules, its discard fractions "
        "recomputed cheapest-per-byte first, 7 of its budgets scanned (time: the 7 MILP calls); "
        + SAC_ESTIMATOR_NOTE + ". 'dp − best peer': dp's overhead minus the best of greedy, Capuchin, the "
        "torch knapsacks and sac-milp, in percentage points (negative: dp is ahead).",
        "",
        "| graph | ops | saved | budget | " + " | ".join(cols) + " | dp − best peer |",
        "|---|--:|--:|--:|" + "--:|" * (len(cols) + 1),
    ]
    for label, g, per in results:
        for frac, cells in per.items():
            lines.append(f"| {label} | {len(g.ops)} | {len(g.saved_activations)} | {int(frac * 100)}% | "
                         + " | ".join(_fmt(cells.get(c)) for c in cols) + f" | {_gap(cells)} |")
    if timings:
        lines += ["", f"`dp` solve time on the models at 50%, {TIMING_RUNS} runs each, median (min–max), same "
                      "shared machine: " + "; ".join(
                          f"{label} {sorted(ts)[len(ts) // 2]:.1f} s ({min(ts):.1f}–{max(ts):.1f})"
                          for label, ts in timings.items()) + "."]
    if gap is not None:
        g_txt = "none" if gap["gap"] is None else f"{gap['gap'] * 100:.2f}%"
        bound = "none" if gap["bound_overhead"] is None else f"{gap['bound_overhead'] * 100:.1f}%"
        warm = "none" if gap["warm_overhead"] is None else f"{gap['warm_overhead'] * 100:.1f}%"
        limited = ""
        if gap.get("model_status") is not None:
            mb = gap["model_bound_overhead"]
            limited = (f"; its depth-limited model ended {gap['model_status']} with bound "
                       f"{'none' if mb is None else f'{mb * 100:.1f}%'} over the plans it admits")
        lines += ["", f"ILP on the GPT-2 (12 layers) op graph at 50%, time limit {gap_limit_s:.0f} s (CP-SAT, 2 "
                      f"workers): status {gap['status']}, gap {g_txt} (plan overhead "
                      f"{gap['overhead'] * 100:.1f}%, bound {bound}, warm start ({gap['warm_start']}) {warm}"
                      f"{limited}), {gap['variables']} variables, {gap['rows']} rows, {gap['wall_s']:.0f} s wall."]
    return "\n".join(lines)


def update_doc(text: str) -> None:
    update_section("solvers", "Solvers", text, DOC)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small model presets")
    ap.add_argument("--time-limit", type=float, default=20.0, help="per solve, seconds (caps the ILP)")
    ap.add_argument("--gap-time-limit", type=float, default=60.0, help="the ILP gap run on GPT-2, seconds")
    ap.add_argument("--update-doc", action="store_true", help=f"write the table into {DOC.relative_to(ROOT)}")
    args = ap.parse_args()
    t0 = time.perf_counter()
    results = []
    gap = None
    timings: dict[str, list[float]] = {}
    for label, g in graphs(args.quick):
        print(f"{label}: {len(g.ops)} ops, {len(g.saved_activations)} saved", file=sys.stderr, flush=True)
        results.append((label, g, run_graph(g, args.time_limit)))
        if not g.name.startswith("chain"):
            timings[label] = dp_timing(g, 0.5)
        if g.name == "gpt2-sizebase" and args.gap_time_limit > 0:  # the 12-layer GPT-2 (the ILP refuses 48)
            gap = ilp_gap(g, 0.5, args.gap_time_limit)
            print(f"  ILP gap: {gap}", file=sys.stderr, flush=True)
    text = render(results, gap, args.time_limit, args.gap_time_limit, time.perf_counter() - t0, timings)
    print(text)
    if args.update_doc:
        update_doc(text)


if __name__ == "__main__":
    main()
