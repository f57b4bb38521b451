"""The executor's own costs per op, measured: what the simulator charges per watched forward op
(``graph.watch_op_dispatch_s``) and per replayed op (``graph.replay_op_dispatch_s``) beyond the op itself.

On a tiny GPT-2 and BERT (width 8, sequence 8: every op costs microseconds, so the step is the executor's
dispatch) the step runs plain and under a 70% plan, interleaved, in CPU time of the process (1 torch
thread). The watched-op cost is (planned forward - plain forward) / watched ops; the replayed-op cost is
(planned backward - plain backward) / replayed ops (the tiny ops' own time included, so an upper bound),
once with replays reused from earlier steps (runtime.Segment: every step after the first) and once with
every replay planned and traced afresh (``Executor.reuse_replays = False``: what a first step pays).
The minimum over rounds is taken: load from other jobs only adds. Prints both per model, and their
median over models, which planner/probe/profiler.py's constants are set from.

    python benchmarks/dispatch.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from memplan.executor import apply
from memplan.planner.core.simulator import simulate
from memplan.planner.probe.profiler import profile
from memplan.planner.workloads import compute_loss, default_optimizer, load_workload
from memplan.solvers import activation_bytes, solve

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


def measure(name: str, rounds: int) -> tuple[float, float, float, int, int]:
    """(seconds per watched op, seconds per replayed op with replays reused, the same with every replay
    planned and traced as on a first step, watched ops, replayed ops) on tiny ``name``."""
    w = load_workload(name, **TINY[name])
    graph = profile(w.model, w.batch, w.loss_fn, name=name, progress=False, measure=False)
    plan = solve(graph, graph.fixed.resident_bytes + activation_bytes(graph) * 7 // 10, "auto", time_limit_s=10).plan
    report = simulate(graph, plan, timeline=False)
    plain = copy.deepcopy(w.model)
    plain_opt = default_optimizer(plain)
    planned = copy.deepcopy(w.model)
    planned_opt = default_optimizer(planned)
    ex = apply(planned, plan, graph=graph, optimizer=planned_opt)
    fresh = copy.deepcopy(w.model)
    fresh_opt = default_optimizer(fresh)
    ex_fresh = apply(fresh, plan, graph=graph, optimizer=fresh_opt)
    ex_fresh.reuse_replays = False  # what a first step pays: every replay planned and traced
    for _ in range(3):  # the first planned step learns (every op watched); warm all three
        step_parts(plain, plain_opt, w)
        step_parts(planned, planned_opt, w)
        step_parts(fresh, fresh_opt, w)
    a, b, c = [], [], []
    for _ in range(rounds):
        a.append(step_parts(plain, plain_opt, w))
        b.append(step_parts(planned, planned_opt, w))
        c.append(step_parts(fresh, fresh_opt, w))
    ex.remove()
    ex_fresh.remove()
    fwd = min(x[0] for x in b) - min(x[0] for x in a)
    bwd = min(x[1] for x in b) - min(x[1] for x in a)
    bwd_fresh = min(x[1] for x in c) - min(x[1] for x in a)
    n = max(report.recomputed_ops, 1)
    return fwd / max(report.watched_ops, 1), bwd / n, bwd_fresh / n, report.watched_ops, report.recomputed_ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    watch, rep, first = [], [], []
    for name in TINY:
        w_s, r_s, f_s, n_w, n_r = measure(name, args.rounds)
        watch.append(w_s)
        rep.append(r_s)
        first.append(f_s)
        print(f"{name} (tiny): {w_s * 1e6:.1f} us per watched op ({n_w} watched), "
              f"{r_s * 1e6:.1f} us per replayed op ({n_r} replayed; {f_s * 1e6:.1f} us planned and traced, "
              f"as on a first step)")
    print(f"median: {statistics.median(watch) * 1e6:.1f} us per watched op, "
          f"{statistics.median(rep) * 1e6:.1f} us per replayed op ({statistics.median(first) * 1e6:.1f} us on a "
          f"first step)")


if __name__ == "__main__":
    main()
