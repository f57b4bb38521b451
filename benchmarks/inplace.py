"""In-place chains: how low memplan's plans go on an unrolled recurrent cell, against the lower bound.

For ``nn.GRUCell`` and ``nn.LSTMCell`` unrolled over 64 steps (the ``rnn`` built-in): profile one step,
then report ``memory_lower_bound``, keep-everything, how much of the saved activations can be rebuilt, and
the smallest simulated peak found: the smallest known peak (``smallest_known_peak``) and, per solver, a
bisection on the budget between the lower bound and keep-everything (each solve limited to 10 s). Then
the time side: per solver, the simulated step time of its plan at budgets of 1.15x and 1.5x the lower
bound, against keep-everything's. Prints markdown tables; ``--update-doc`` replaces the ``inplace``
section of docs/benchmarks.md.

    python benchmarks/inplace.py [--update-doc] [--solvers capuchin greedy multilevel]
    python benchmarks/inplace.py --executor [--executor-rounds 5]   # the executor's measured step
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from _doc import update_section  # benchmarks/_doc.py (the scripts run from this folder)

from memplan.executor import apply
from memplan.executor.session import peak_step
from memplan.planner.core.errors import Infeasible
from memplan.planner.core.simulator import simulate
from memplan.planner.core.units import format_bytes
from memplan.planner.probe.profiler import profile
from memplan.planner.workloads import default_optimizer, load_workload, training_step
from memplan.solvers import keep_all_report, memory_lower_bound, smallest_known_peak, solve

SIZE = dict(steps=64, input_size=16, hidden_size=64, batch_size=32)
TIME_AT = (1.15, 1.5)  # budgets, as multiples of the lower bound, at which step times are reported


def smallest_peak(graph, method: str, lo: int, hi: int, rounds: int) -> int:
    """The smallest simulated peak ``method`` reaches, by bisecting the budget in [lo, hi]."""
    best = hi
    for _ in range(rounds):
        mid = (lo + hi) // 2
        try:
            best = min(best, solve(graph, mid, method, time_limit_s=10.0).report.peak_bytes)
            hi = mid
        except Infeasible:
            lo = mid
    return best


def step_time_at(graph, method: str, budget: int, keep_s: float) -> str:
    """``method``'s simulated step time at ``budget`` relative to keep-everything's, or '—'."""
    try:
        return f"{solve(graph, budget, method, time_limit_s=10.0).report.time_s / keep_s:.2f}x"
    except Infeasible:
        return "—"


def row(cell: str, solvers: list[str], rounds: int) -> dict:
    w = load_workload("rnn", cell=cell, **SIZE)
    g = profile(w.model, w.batch, w.loss_fn, name=f"{cell} x{SIZE['steps']}", device="cpu", progress=False,
                measure=False, repeats=1)
    lb, keep = memory_lower_bound(g), keep_all_report(g).peak_bytes
    saved = g.saved_activations
    rebuildable = sum(g.tensors[t].bytes for t in saved if g.tensors[t].recomputable)
    total = sum(g.tensors[t].bytes for t in saved)
    peaks = {"smallest known": smallest_known_peak(g)}
    for m in solvers:
        start = time.perf_counter()
        peaks[m] = smallest_peak(g, m, lb, keep, rounds)
        print(f"  {cell} {m}: {peaks[m]} B ({time.perf_counter() - start:.0f} s)", flush=True)
    best = min(peaks.values())
    keep_s = keep_all_report(g).time_s
    times = {m: [step_time_at(g, m, int(lb * f), keep_s) for f in TIME_AT] for m in solvers}
    return {"cell": cell, "lb": lb, "keep": keep, "rebuildable": rebuildable / total, "peaks": peaks, "best": best,
            "times": times}


def table(rows: list[dict], solvers: list[str]) -> str:
    head = ["cell", "lower bound", "keep all", "saved bytes rebuildable", "smallest known", *solvers,
            "best / lower bound"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["cell"], format_bytes(r["lb"]), format_bytes(r["keep"]), f"{100 * r['rebuildable']:.0f}%",
                 *(format_bytes(r["peaks"][k]) for k in ["smallest known", *solvers]),
                 f"{r['best'] / r['lb']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    head = ["cell", *(f"{m} at {f}x lower bound" for m in solvers for f in TIME_AT)]
    lines += ["", "Simulated step time (keep-everything = 1.00x; '—': no plan at that budget):", "",
              "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([r["cell"], *(t for m in solvers for t in r["times"][m])]) + " |")
    return "\n".join(lines)


def executor_row(cell: str, rounds: int) -> dict:
    """The executor on ``cell``: a ``multilevel`` plan at 1.15x the lower bound trained beside plain
    training (and beside the same plan with every replay planned and traced, as a first step runs it),
    interleaved, one torch thread, CPU time of the process (median of ``rounds``); peaks from the
    allocator (``peak_step``); predicted = the simulator's step under the plan over its keep-everything
    step. The graph is profiled with its op times scaled to a plain step's (as ``memplan run`` does)."""
    w = load_workload("rnn", cell=cell, **SIZE)
    g = profile(w.model, w.batch, w.loss_fn, name=f"{cell} x{SIZE['steps']}", device="cpu", progress=False)
    lb = memory_lower_bound(g)
    plan = solve(g, int(lb * TIME_AT[0]), "multilevel", time_limit_s=60.0).plan
    rep, keep = simulate(g, plan, timeline=False), keep_all_report(g)
    base = copy.deepcopy(w.model)
    runs = {}
    for label in ("plain", "plan", "plan, first-step cost"):
        model = copy.deepcopy(base)
        opt = default_optimizer(model)
        ex = apply(model, plan, graph=g, optimizer=opt) if label != "plain" else None
        if label == "plan, first-step cost":
            ex.reuse_replays = False  # every replay planned and traced, as on a first step
        training_step(model, w.batch, w.loss_fn, opt)
        peak = peak_step(model, w.batch, w.loss_fn, opt, ex)[0]
        runs[label] = (model, opt, ex, peak, [])
    for _ in range(rounds):
        for model, opt, _, _, cpu in runs.values():  # one step of each in turn
            c0 = time.process_time()
            training_step(model, w.batch, w.loss_fn, opt)
            cpu.append(time.process_time() - c0)
    plain_s = statistics.median(runs["plain"][4])
    out = {"cell": cell, "lb": lb, "predicted peak": rep.peak_bytes, "keep": keep.peak_bytes,
           "predicted x": rep.time_s / keep.time_s, "replayed": rep.recomputed_ops, "watched": rep.watched_ops,
           "charged": (rep.recomputed_ops * g.replay_op_dispatch_s + rep.watched_ops * g.watch_op_dispatch_s)
           / rep.time_s}
    for label, (_, _, ex, peak, cpu) in runs.items():
        out[label] = (peak, statistics.median(cpu), min(cpu), max(cpu))
        if ex is not None:
            ex.remove()
    out["plain_s"] = plain_s
    return out


def executor_table(rows: list[dict], rounds: int) -> str:
    lines = [f"Measured (the executor; `python benchmarks/inplace.py --executor`, {rounds} interleaved rounds, CPU "
             f"time, median (range)); *x plain* is the step over plain training's:", "",
             "| cell | plan | predicted peak | measured peak | predicted x keep-all | measured x plain "
             "| replayed / watched ops | executor charged | measured / predicted | CPU step (range) |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        for label in ("plain", "plan", "plan, first-step cost"):
            peak, med, lo, hi = r[label]
            x = med / r["plain_s"]
            planned = label != "plain"
            lines.append("| " + " | ".join([
                r["cell"], label if planned else "plain training",
                format_bytes(r["predicted peak"]) if planned else format_bytes(r["keep"]), format_bytes(peak),
                f"{r['predicted x']:.2f}x" if planned else "1.00x", f"{x:.2f}x",
                f"{r['replayed']} / {r['watched']}" if planned else "", f"{100 * r['charged']:.0f}%" if planned else "",
                f"{100 * (x / r['predicted x'] - 1):+.0f}%" if planned else "",
                f"{med * 1e3:.0f} ms ({lo * 1e3:.0f}-{hi * 1e3:.0f})"]) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--solvers", nargs="*", default=["capuchin", "greedy", "multilevel"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--update-doc", action="store_true")
    ap.add_argument("--executor", action="store_true",
                    help="only the executor's measured step under a multilevel plan (printed, not written)")
    ap.add_argument("--executor-rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.executor:
        print(executor_table([executor_row(cell, args.executor_rounds) for cell in ("gru", "lstm")],
                             args.executor_rounds))
        return
    rows = [row(cell, args.solvers, args.rounds) for cell in ("gru", "lstm")]
    text = table(rows, args.solvers)
    print(text)
    if args.update_doc:
        update_section("inplace", "In-place chains: unrolled recurrent cells against the lower bound", text)


if __name__ == "__main__":
    main()
