"""In-place chains: how low memplan's plans go on an unrolled recurrent cell, against the lower bound.

For ``nn.GRUCell`` and ``nn.LSTMCell`` unrolled over 64 steps (the ``rnn`` built-in): profile one step,
then report ``memory_lower_bound``, keep-everything, how much of the saved activations can be rebuilt, and
the smallest simulated peak found: the smallest known peak (``smallest_known_peak``) and, per solver, a
bisection on the budget between the lower bound and keep-everything (each solve limited to 10 s). Then
the time side: per solver, the simulated step time of its plan at budgets of 1.15x and 1.5x the lower
bound, against keep-everything's. Prints markdown tables; ``--update-doc`` replaces the ``inplace``
section of docs/benchmarks.md.

    python benchmarks/inplace.py [--update-doc] [--solvers capuchin greedy multilevel]
"""

from __future__ import annotations

import argparse
import time

import torch
from _doc import update_section  # benchmarks/_doc.py (the scripts run from this folder)

from memplan.planner.core.errors import Infeasible
from memplan.planner.core.units import format_bytes
from memplan.planner.probe.profiler import profile
from memplan.planner.workloads import load_workload
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--solvers", nargs="*", default=["capuchin", "greedy", "multilevel"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--update-doc", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = [row(cell, args.solvers, args.rounds) for cell in ("gru", "lstm")]
    text = table(rows, args.solvers)
    print(text)
    if args.update_doc:
        update_section("inplace", "In-place chains: unrolled recurrent cells against the lower bound", text)


if __name__ == "__main__":
    main()
