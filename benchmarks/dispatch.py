"""The executor's own costs per op, measured: what the simulator charges per watched forward op
(``graph.watch_op_dispatch_s``) and per replayed op (``graph.replay_op_dispatch_s``) beyond the op itself.

On a tiny GPT-2 and BERT (width 8, sequence 8: every op costs microseconds, so the step is the executor's
dispatch) the step runs plain and under a 70% plan, interleaved, in CPU time of the process (1 torch
thread). The watched-op cost is (planned forward - plain forward) / watched ops; the replayed-op cost is
(planned backward - plain backward) / replayed ops (the tiny ops' own time included, so an upper bound),
once with replays reused from earlier steps (runtime.Segment: every step after the first) and once with
every replay planned and traced afresh (``Executor.reuse_replays = False``: what a first step pays).
The minimum over rounds is taken: load from other jobs only adds. The replayed-op cost is also taken
from the slope between the 70% plan and a tighter one (extra backward time per extra replayed op, which
leaves out the saved-tensor hooks every planned backward pays), and on 16-step GRU and LSTM cells under
multi-level plans (deep replays of tiny ops) as backward time beyond the replayed ops' own time. Prints
each, and the medians planner/probe/profiler.py's constants are set from (watched: the transformers';
replayed: the two slopes and the two cells).

    python benchmarks/dispatch.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from memplan.executor import apply
from memplan.planner.core.errors import Infeasible
from memplan.planner.core.simulator import simulate
from memplan.planner.probe.profiler import profile
from memplan.planner.workloads import compute_loss, default_optimizer, load_workload
from memplan.solvers import activation_bytes, memory_lower_bound, smallest_known_peak, solve

TINY = {"gpt2": {"n_embd": 8, "n_head": 2, "seq_len": 8, "batch_size": 2, "vocab_size": 64},
        "bert": {"hidden_size": 8, "num_attention_heads": 2, "seq_len": 8,
                 "batch_size": 2, "vocab_size": 64}}


def step_parts(model, optimizer, w) -> tuple[float, float]:
    """CPU seconds of one step's forward (with the loss) and its backward."""
    optimizer.zero_grad(set_to_none=True)
    t0 = time.process_time()
    loss = compute_loss(model, w.batch, w.loss_fn)
    t1 = time.process_time()
    loss.backward()
    t2 = time.process_time()
    optimizer.step()
    return t1 - t0, t2 - t1


def measure(name: str, rounds: int) -> dict[str, float]:
    """On tiny ``name``, plain training and two plans (at 70% and at a tighter budget), interleaved: seconds
    per watched op (70% plan), backward seconds per replayed op at 70% with replays reused and with every
    replay planned and traced (as on a first step), and the slope between the two plans (extra backward
    seconds per extra replayed op, replays reused), which leaves out what a planned backward pays whatever
    it replays (the saved-tensor hooks on every saved tensor, node hooks)."""
    w = load_workload(name, **TINY[name])
    graph = profile(w.model, w.batch, w.loss_fn, name=name, progress=False, measure=False)
    at70 = graph.fixed.resident_bytes + activation_bytes(graph) * 7 // 10
    lowest = smallest_known_peak(graph)
    plans = [solve(graph, at70, "auto", time_limit_s=10).plan]
    for frac in (0.2, 0.5, 0.8):  # the tight plan: between the smallest known peak and 70%
        try:
            plans.append(solve(graph, lowest + int((at70 - lowest) * frac), "auto", time_limit_s=10).plan)
            break
        except Infeasible:
            continue
    reports = [simulate(graph, p, timeline=False) for p in plans]
    runs: dict[str, tuple] = {"plain": (copy.deepcopy(w.model),)}
    for label, plan, reuse in (("70%", plans[0], True), ("70% first", plans[0], False), ("tight", plans[1], True)):
        model = copy.deepcopy(w.model)
        opt = default_optimizer(model)
        ex = apply(model, plan, graph=graph, optimizer=opt)
        ex.reuse_replays = reuse  # False: what a first step pays (every replay planned and traced)
        runs[label] = (model, opt, ex)
    runs["plain"] = (runs["plain"][0], default_optimizer(runs["plain"][0]), None)
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
    for i in range(3 + rounds):  # the first planned step learns (every op watched); warm all
        for label, (model, opt, _) in runs.items():
            t = step_parts(model, opt, w)
            if i >= 3:
                times[label].append(t)
    for _, _, ex in runs.values():
        if ex is not None:
            ex.remove()
    fwd = {k: min(x[0] for x in v) for k, v in times.items()}
    bwd = {k: min(x[1] for x in v) for k, v in times.items()}
    n70, ntight = reports[0].recomputed_ops, reports[1].recomputed_ops
    return {"watched": reports[0].watched_ops, "replayed": n70, "replayed tight": ntight,
            "watch_s": (fwd["70%"] - fwd["plain"]) / max(reports[0].watched_ops, 1),
            "replay_s": (bwd["70%"] - bwd["plain"]) / max(n70, 1),
            "first_s": (bwd["70% first"] - bwd["plain"]) / max(n70, 1),
            "slope_s": (bwd["tight"] - bwd["70%"]) / (ntight - n70) if ntight > n70 else float("nan")}


def measure_rnn(cell: str, rounds: int) -> dict[str, float]:
    """On a 16-step ``cell`` (the ``rnn`` built-in) under a ``multilevel`` plan at 1.15x its memory lower
    bound (deep replays, hundreds of replayed ops whose own time is a few microseconds), plain and planned,
    interleaved: backward seconds per replayed op beyond the ops' own time as the graph has it (its op
    times scaled to a plain step's), with replays reused and planned and traced afresh."""
    w = load_workload("rnn", cell=cell, steps=16, input_size=16, hidden_size=64, batch_size=32)
    graph = profile(w.model, w.batch, w.loss_fn, name=f"{cell} x16", progress=False)
    plan = solve(graph, int(memory_lower_bound(graph) * 1.15), "multilevel", time_limit_s=30).plan
    report = simulate(graph, plan, timeline=False)
    n = max(report.recomputed_ops, 1)
    own_s = report.recompute_time_s - report.recomputed_ops * graph.replay_op_dispatch_s  # the ops' own time
    runs = {"plain": None, "reused": True, "first": False}
    models = {}
    for label, reuse in runs.items():
        model = copy.deepcopy(w.model)
        opt = default_optimizer(model)
        ex = apply(model, plan, graph=graph, optimizer=opt) if reuse is not None else None
        if ex is not None:
            ex.reuse_replays = reuse
        models[label] = (model, opt, ex, [])
    for i in range(3 + rounds):
        for model, opt, _, out in models.values():
            t = step_parts(model, opt, w)
            if i >= 3:
                out.append(t)
    for _, _, ex, _ in models.values():
        if ex is not None:
            ex.remove()
    bwd = {k: min(x[1] for x in v[3]) for k, v in models.items()}
    return {"replayed": report.recomputed_ops, "replay_s": (bwd["reused"] - bwd["plain"] - own_s) / n,
            "first_s": (bwd["first"] - bwd["plain"] - own_s) / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = []
    for name in TINY:
        r = measure(name, args.rounds)
        results.append(r)
        print(f"{name} (tiny): {r['watch_s'] * 1e6:.1f} us per watched op ({r['watched']} watched); "
              f"{r['replay_s'] * 1e6:.1f} us per replayed op ({r['replayed']} replayed; "
              f"{r['first_s'] * 1e6:.1f} us when planned and traced, as on a first step); "
              f"slope to {r['replayed tight']} replayed ops: {r['slope_s'] * 1e6:.1f} us per extra replayed op")

    per_op = [r["slope_s"] for r in results]
    for cell in ("gru", "lstm"):
        r = measure_rnn(cell, args.rounds)
        per_op.append(r["replay_s"])
        print(f"{cell} x16 (multilevel at 1.15x the bound): {r['replay_s'] * 1e6:.1f} us per replayed op beyond "
              f"the ops' own time ({r['replayed']} replayed; {r['first_s'] * 1e6:.1f} us when planned and traced, "
              f"as on a first step)")

    def med(key: str) -> float:
        return statistics.median(r[key] for r in results) * 1e6

    print(f"median: {med('watch_s'):.1f} us per watched op (tiny transformers); per replayed op "
          f"{statistics.median(per_op) * 1e6:.1f} us (the two slopes and the two cells; the transformers' "
          f"average at 70%: {med('replay_s'):.1f} us, {med('first_s'):.1f} us on a first step)")


if __name__ == "__main__":
    main()
