"""torch.compile under its own ``activation_memory_budget`` (a 0-1 fraction) against memplan's byte budget
(:func:`memplan.api.integrations.torch_compile.compile_with_budget`), at equal measured peak, on this machine's CPU
(inductor's C++ backend).

For each model and each fraction: compile with torch's fraction and its own knapsack, measure the step's
peak with the CPU allocator (forward, backward and AdamW's step; parameters, gradients, optimizer state
and batch included) and time it; then ask memplan for that measured peak as a budget in bytes, and
measure and time what it compiled. Both are timed in the same process, one after the other, ``rounds``
rounds of ``steps`` steps each (the median step of each round; the table gives the median round and the
spread of the rounds). ``--update-doc`` replaces the ``compile_budget`` section of docs/benchmarks.md.

    python benchmarks/compile_budget.py [--update-doc] [--models gpt2 resnet] [--fractions 0.5 0.2 0.05]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
from _doc import publish  # benchmarks/_doc.py (the scripts run from this folder)

from memplan.api.integrations.torch_compile import compile_with_budget, compile_with_fraction
from memplan.planner.core.errors import Infeasible
from memplan.planner.core.units import format_bytes
from memplan.planner.probe.measure import time_steps
from memplan.planner.workloads import default_optimizer, load_workload

MODELS = {
    # dropout off: a compiled graph's RNG is functionalised, which is not what this compares
    "gpt2": dict(n_layer=4, dropout=0.0),  # the "small" preset (n_embd 256, seq 128, batch 4), 4 layers
    "resnet": dict(batch_size=16),         # the "small" preset (basic blocks 2-2-2-2, 64 px), batch 16
}
FRACTIONS = (1.0, 0.5, 0.2, 0.05)


def timed(module: torch.nn.Module, batch, optimizer, rounds: int, steps: int) -> tuple[list[float], list[float]]:
    """The median step of each of ``rounds`` rounds of ``steps`` steps (after one warm-up step), in the
    thread's CPU time (one torch thread: what the step costs, whatever else runs on the machine) and in
    wall time."""
    time_steps(module, batch, lambda m, b: m(b), optimizer, steps=1)
    cpu, wall = [], []
    for _ in range(rounds):
        cpu.append(time_steps(module, batch, lambda m, b: m(b), optimizer, steps=steps, clock=time.thread_time).step_s)
        wall.append(time_steps(module, batch, lambda m, b: m(b), optimizer, steps=steps).step_s)
    return cpu, wall


def spread(times: tuple[list[float], list[float]]) -> str:
    cpu, wall = times
    return (f"{statistics.median(cpu) * 1e3:.0f} ms ({min(cpu) * 1e3:.0f}-{max(cpu) * 1e3:.0f}); "
            f"wall {statistics.median(wall) * 1e3:.0f} ms")


def memplan_row(name: str, label: str, torch_cells: str, budget: int, rounds: int, steps: int) -> str:
    w = load_workload(name, **MODELS[name])
    opt = default_optimizer(w.model)
    start = time.perf_counter()
    try:
        r = compile_with_budget(w.model, w.batch, w.loss_fn, budget, optimizer=opt)
    except Infeasible as e:
        return (f"| {name} | {label} | {torch_cells} | {format_bytes(budget)}: refused, least measured "
                f"{format_bytes(e.min_feasible_bytes or 0)} | | {len(getattr(e, 'attempts', []))} | "
                f"{time.perf_counter() - start:.0f} s |")
    plan_s = time.perf_counter() - start
    ours = timed(r.module, w.batch, opt, rounds, steps)
    last = r.attempts[-1]
    return (f"| {name} | {label} | {torch_cells} | {format_bytes(r.measured_peak_bytes)} | {spread(ours)} | "
            f"{len(r.attempts)} ({last.saved} saved, {last.recomputed} recomputed) | {plan_s:.0f} s |")


def run_model(name: str, fractions: tuple[float, ...], rounds: int, steps: int) -> list[str]:
    rows, peaks = [], []
    for fraction in fractions:
        w = load_workload(name, **MODELS[name])
        opt = default_optimizer(w.model)
        start = time.perf_counter()
        compiled, m = compile_with_fraction(w.model, w.batch, w.loss_fn, fraction, optimizer=opt)
        torch_s = time.perf_counter() - start
        cells = f"{format_bytes(m.peak_bytes)} | {spread(timed(compiled, w.batch, opt, rounds, steps))} | {torch_s:.0f} s"
        peaks.append(m.peak_bytes)
        rows.append(memplan_row(name, f"{fraction:g}", cells, m.peak_bytes, rounds, steps))
        print(rows[-1], flush=True)
    # below every peak torch's fractions reached: how far memplan's splits go
    rows.append(memplan_row(name, f"none (budget 95% of {format_bytes(min(peaks))})", " | | ",
                            int(0.95 * min(peaks)), rounds, steps))
    print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--fractions", nargs="+", type=float, default=list(FRACTIONS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--update-doc", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name in args.models:
        rows += run_model(name, tuple(args.fractions), args.rounds, args.steps)
    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
               f"one torch thread, inductor's C++ backend")
    text = "\n".join([
        f"Measured on this machine ({machine}), by `python benchmarks/compile_budget.py --update-doc`. "
        "Per row: torch.compile with `activation_memory_budget` = the fraction and torch's own knapsack, its "
        "step's measured peak (CPU allocator: forward, backward and AdamW's step, parameters, gradients, "
        "optimizer state and batch included) and step time; then `compile_with_budget` given that peak in "
        "bytes, its measured peak and step time. Step times: the thread's CPU time (one torch thread), the "
        f"median of {args.rounds} rounds of {args.steps} steps (each round's median step), the rounds' range in "
        "brackets, and the median round's wall time (other jobs share this machine's 2 cores: wall reads "
        "above CPU); both in one process, one after the other. Compiles: how many `compile_with_budget` measured "
        "(and the knapsack's split in the one it returned); seconds: torch's compile-and-measure, "
        "memplan's whole call. The last row per model asks memplan for 95% of the least peak torch's "
        "fractions reached.",
        "",
        "| model | torch fraction | torch peak | torch step | torch s | memplan peak (budget: torch's peak) "
        "| memplan step | compiles | memplan s |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
    ])
    publish(text, args.update_doc, "compile_budget", "torch.compile: its fraction against a byte budget")


if __name__ == "__main__":
    main()
