"""Ranks without the ranks (issue #10 item 6): each rank's figures from the fake process group against two
real gloo processes, written to docs/benchmarks.md with ``--update-doc``.

1. GPT-2 in three shapes (the tiny one of tests/test_distributed.py, 2 layers of the small preset, and the
   small preset with a batch of 1x32 tokens) under FSDP2 and DDP on 2 ranks: the real run
   (``memplan run gpt2 --nproc 2 --engine E --json``, 2 gloo processes, each rank's step measured from
   the allocator) against, in this process, the fake-pg figures
   (:func:`memplan.planner.probe.fakepg.trace_ranks`: FSDP2 traced on fake tensors, DDP measured on real
   ones), the transform's keep-everything prediction (``for_ddp``/``for_fsdp`` on the fake profile), and
   the transform with the traced parameter and optimizer-state bytes (what ``--fake --nproc`` solves on).
2. ``memplan profile gpt2 --fake --nproc 8 --engine fsdp`` (FSDP2 over 8 ranks, small preset) in a child
   process, ``--repeats`` times with a fresh op-time cache each: wall time and peak RSS.

    python benchmarks/fakepg.py [--repeats 3] [--update-doc]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _doc import update_section  # benchmarks/_doc.py (the scripts run from this folder)
from fidelity import machine

from memplan.api.distributed import plan_ranks_fake
from memplan.planner.core.units import format_bytes

MEMPLAN = str(Path(sys.executable).with_name("memplan"))
SHAPES = {
    "tiny (2x64, vocab 512, 2x32 tokens)": {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 512,
                                            "seq_len": 32, "batch_size": 2},
    "small, 2 layers": {"n_layer": 2},
    "small, 1x32 tokens": {"batch_size": 1, "seq_len": 32},
}


def _sets(options: dict) -> list[str]:
    return [a for k, v in options.items() for a in ("--set", f"{k}={v}")]


def real_ranks(engine: str, options: dict) -> dict[int, dict]:
    """Rank -> the keep-everything row of a real 2-process gloo run."""
    out = subprocess.run([MEMPLAN, "run", "gpt2", *_sets(options), "--budget", "100%", "--nproc", "2",
                          "--engine", engine, "--steps", "1", "--json"], capture_output=True, text=True, check=True)
    return {r["rank"]: r for r in json.loads(out.stdout)["ranks"] if r["plan"] == "keep all"}


def fake_ranks(engine: str, options: dict) -> tuple[dict[int, dict], int]:
    """(rank -> the traced keep-everything row, the transform's keep-everything prediction)."""
    traced = plan_ranks_fake("gpt2", world_size=2, engine=engine, budget=None, workload_options=options)
    plain = plan_ranks_fake("gpt2", world_size=2, engine=engine, budget=None, workload_options=options,
                            trace=False, ranks=[0])
    return {r["rank"]: r for r in traced}, plain[0]["predicted_peak_bytes"]


def eight_ranks(repeats: int) -> list[tuple[float, int]]:
    """(wall seconds, child peak RSS bytes) of ``memplan profile gpt2 --fake --nproc 8 --engine fsdp``."""
    runs = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "MEMPLAN_CACHE_DIR": cache}
            start = time.perf_counter()
            pid = os.fork()
            if pid == 0:
                with open(os.devnull, "w") as null:
                    os.dup2(null.fileno(), 1)
                    os.dup2(null.fileno(), 2)
                os.execve(MEMPLAN, [MEMPLAN, "profile", "gpt2", "--fake", "--nproc", "8", "--engine", "fsdp",
                                    "--json"], env)
            _, status, usage = os.wait4(pid, 0)
            if status != 0:
                raise SystemExit(f"memplan profile --nproc 8 failed with status {status}")
            runs.append((time.perf_counter() - start, usage.ru_maxrss * 1024))
    return runs


def _delta(a: int, b: int) -> str:
    return "0 B" if a == b else f"{a - b:+,} B"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--update-doc", action="store_true")
    args = ap.parse_args()
    rows = ["| GPT-2 | engine | rank | real start | real peak | fake-pg start | fake-pg peak (vs real) | "
            "transform (vs real) | transform + traced fixed (vs real) |",
            "|---|---|--:|--:|--:|--:|--:|--:|--:|"]
    for shape, options in SHAPES.items():
        for engine in ("fsdp", "ddp"):
            real = real_ranks(engine, options)
            traced, plain = fake_ranks(engine, options)
            for rank in sorted(real):
                r, t = real[rank], traced[rank]
                peak = r["measured_peak_bytes"]
                rows.append(f"| {shape} | {engine} | {rank} | {format_bytes(r['measured_start_bytes'])} | "
                            f"{format_bytes(peak)} | {format_bytes(t['traced_start_bytes'])} | "
                            f"{format_bytes(t['traced_peak_bytes'])} ({_delta(t['traced_peak_bytes'], peak)}) | "
                            f"{format_bytes(plain)} ({_delta(plain, peak)}) | "
                            f"{format_bytes(t['predicted_peak_bytes'])} ({_delta(t['predicted_peak_bytes'], peak)}) |")
                print(rows[-1], flush=True)
    runs = eight_ranks(args.repeats)
    walls = [w for w, _ in runs]
    rss = [m for _, m in runs]
    timing = (f"`memplan profile gpt2 --fake --nproc 8 --engine fsdp` (small preset; the bare model's fake "
              f"profile, then 8 ranks traced one after the other; a fresh op-time cache each run), "
              f"{args.repeats} runs: wall median {statistics.median(walls):.1f} s (min {min(walls):.1f}, "
              f"max {max(walls):.1f}), child peak RSS median {format_bytes(int(statistics.median(rss)))} "
              f"(max {format_bytes(max(rss))}).")
    print(timing)
    text = "\n".join([f"Machine: {machine()}; 2 cores shared with other engineers' jobs while this ran. "
                      f"Command: `python benchmarks/fakepg.py --repeats {args.repeats} --update-doc`. "
                      "Real: 2 gloo processes, each rank's step measured from the allocator (`measure_rank_step`). "
                      "Fake-pg: this process, FSDP2 traced on fake tensors with gloo's collective copies "
                      "charged, DDP measured on real tensors under the fake process group.", "", *rows, "",
                      timing])
    if args.update_doc:
        update_section("fakepg", "Ranks without the ranks: the fake process group against real gloo ranks", text)


if __name__ == "__main__":
    main()
