"""Simulator speed: ``simulate_actions`` (what solvers call in their inner loops, timeline off) on synthetic
chains and DAGs of 1,000 and 5,000 ops and on a profiled GPT-2, under four plans (keep everything; a random
mix of keep / recompute / offload with some prefetch points; the same with recompute_each; recompute
everything), split into the lowering (``schedule_actions``) and the score (``score``).

``--against REV`` also times the simulator of git revision ``REV`` (its ``planner/core/simulator.py`` and
``replay.py``, loaded from git as modules; e.g. 5a85208, the last one-pass simulator) in interleaved
rounds, and prints the ratio of the minima and the median of the per-round ratios. Process time, so
that other jobs on a shared machine count less (they still do: caches, frequency).

    python benchmarks/simulator.py [--rounds 15] [--against 5a85208] [--gpt2 graph.json]
"""

from __future__ import annotations

import argparse
import importlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Action
from memplan.planner.core.schedule import schedule_actions
from memplan.planner.core.simulator import score, simulate_actions
from memplan.planner.core.synthetic import linear_chain, random_dag

ROOT = Path(__file__).resolve().parent.parent


def plans(g: Graph) -> dict[str, tuple[dict[int, Action], dict[int, int]]]:
    def mixed(seed: int, each: bool) -> tuple[dict[int, Action], dict[int, int]]:
        rng = random.Random(seed)
        options = [Action.KEEP, Action.RECOMPUTE, Action.OFFLOAD] + ([Action.RECOMPUTE_EACH] if each else [])
        actions, prefetch = {}, {}
        for t in g.saved_activations:
            a = rng.choice(options)
            if a.rebuilds and not g.tensors[t].recomputable:
                a = Action.KEEP
            if a != Action.KEEP:
                actions[t] = a
            if a == Action.OFFLOAD and rng.random() < 0.5:
                prefetch[t] = rng.randint(max(g.savers[t]), len(g.ops) - 1)
        return actions, prefetch

    return {"keep": ({}, {}), "mixed": mixed(1, False), "mixed+each": mixed(2, True),
            "recompute-all": ({t: Action.RECOMPUTE for t in g.saved_activations if g.tensors[t].recomputable}, {})}


def old_simulator(rev: str):
    """The simulator module of git revision ``rev``, with its own replay module."""
    tmp = Path(tempfile.mkdtemp(prefix="memplan-sim-"))
    for name in ("simulator", "replay"):
        text = subprocess.run(["git", "show", f"{rev}:planner/core/{name}.py"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout
        text = text.replace("from memplan.planner.core.replay import", "from old_replay import")
        text = text.replace('"_memplan_sim_static"', '"_old_sim_static"').replace('"_memplan_replay_facts"',
                                                                                  '"_old_replay_facts"')
        (tmp / f"old_{name}.py").write_text(text)
    sys.path.insert(0, str(tmp))
    return importlib.import_module("old_simulator")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--against", help="git revision whose simulator to compare with")
    ap.add_argument("--gpt2", help="a GPT-2 graph file (memplan profile gpt2 -o graph.json)")
    args = ap.parse_args()
    graphs = {f"chain {n}": linear_chain(n, time_s=[0.001 * (1 + i % 7) for i in range(n)],
                                         activation_bytes=[100 + i % 13 for i in range(n)]) for n in (1000, 5000)}
    graphs.update({f"dag {n}": random_dag(n, seed=n) for n in (1000, 5000)})
    if args.gpt2:
        graphs["gpt2"] = Graph.model_validate_json(Path(args.gpt2).read_text())
    old = old_simulator(args.against) if args.against else None
    print("| graph | ops | plan | events | lowering ms | score ms | simulate ms |"
          + (f" {args.against} ms | ratio of minima | median ratio |" if old else ""))
    print("|---|---|---|---|---|---|---|" + ("---|---|---|" if old else ""))
    for name, g in graphs.items():
        for label, (actions, prefetch) in plans(g).items():
            lowering, scoring, new, before, ratios = [], [], [], [], []
            for _ in range(args.rounds):
                t0 = time.process_time()
                sched = schedule_actions(g, actions, prefetch_at=prefetch)
                t1 = time.process_time()
                score(g, sched, timeline=False)
                t2 = time.process_time()
                simulate_actions(g, actions, prefetch_at=prefetch)
                t3 = time.process_time()
                lowering.append(t1 - t0)
                scoring.append(t2 - t1)
                new.append(t3 - t2)
                if old:
                    old.simulate_actions(g, actions, prefetch_at=prefetch)
                    before.append(time.process_time() - t3)
                    ratios.append(new[-1] / before[-1])
            row = (f"| {name} | {len(g.ops)} | {label} | {len(sched.events)} | {min(lowering) * 1e3:.1f} | "
                   f"{min(scoring) * 1e3:.1f} | {min(new) * 1e3:.1f} |")
            if old:
                row += f" {min(before) * 1e3:.1f} | {min(new) / min(before):.2f} | {statistics.median(ratios):.2f} |"
            print(row, flush=True)


if __name__ == "__main__":
    main()
