"""Cache hits over real HTTP, one request at a time, for two builds of memplan side by side.

Starts one ``memplan serve`` (2 worker processes, a fresh SQLite cache) per build: this checkout, and, with
``--before DIR``, another source tree (a folder holding a ``memplan`` package, e.g. an extracted
``git archive`` of an older commit, put first on ``PYTHONPATH``). Then, in ``--rounds`` rounds whose build
order alternates (the machine's other load falls on both alike), per build:

* **hit**: ``--requests`` identical ``POST /v1/plans`` of the ``mlp`` graph (65 ops: a small answer), then
  of a ``--chain``-op chain (every-k at 80%: an answer with a decision per activation), each solved once
  before the rounds and answered from the plan cache.

Then the same two builds' server-side work alone, in-process (no sockets, no worker processes: FastAPI's
test client, a thread pool), ``--requests`` times per round: a cache hit of the chain's plan.

Prints each build's median latency per round and the median and range over the rounds (markdown).

    python benchmarks/service_hits.py --before /tmp/before_pkg [--rounds 5] [--requests 100]
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

import httpx
from load import start_server  # benchmarks/load.py (the scripts run from this folder)


def timed(client: httpx.Client, path: str, body: bytes, n: int, check) -> float:
    """Median seconds of ``n`` POSTs of ``body`` to ``path``, one at a time; ``check(response)`` must hold."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = client.post(path, content=body, headers={"content-type": "application/json"})
        out.append(time.perf_counter() - t0)
        if not check(r):
            raise SystemExit(f"{path}: unexpected answer {r.status_code} {r.text[:200]}")
    return statistics.median(out)


def in_process(requests: int, chain_ops: int) -> dict[str, float]:
    """This process's build: median seconds of a cache hit (test client)."""
    from fastapi.testclient import TestClient

    from memplan.api.app import create_app
    from memplan.api.settings import Settings
    from memplan.planner.core.synthetic import linear_chain

    chain = linear_chain(chain_ops).model_dump(mode="json")
    body = json.dumps({"graph": chain, "budget": "80%", "solver": "every-k", "time_limit_s": 60}).encode()
    settings = Settings(pool="thread", workers=1, max_ops=50_000, max_body_bytes=64 << 20)
    out: dict[str, float] = {}
    with TestClient(create_app(settings)) as c:
        assert c.post("/v1/plans", content=body).status_code == 200
        times = []
        for _ in range(requests):
            t0 = time.perf_counter()
            r = c.post("/v1/plans", content=body)
            times.append(time.perf_counter() - t0)
            assert r.json()["cache_hit"]
        out["hit"] = statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="a folder holding the other build's memplan package (PYTHONPATH)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--chain", type=int, default=2000, help="ops of the chain whose plan is served")
    ap.add_argument("--in-process-only", action="store_true", help="skip the HTTP rounds")
    ap.add_argument("--in-process-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.in_process_worker:  # run by in_process_rounds, under one build's PYTHONPATH
        print(json.dumps(in_process(args.requests, args.chain)))
        return
    if args.in_process_only:
        in_process_rounds(args)
        return

    from memplan.planner.core.synthetic import linear_chain
    from memplan.planner.probe.profiler import profile
    from memplan.planner.workloads import load_workload

    w = load_workload("mlp")
    graph = profile(w.model, w.batch, w.loss_fn, name="mlp", progress=False, repeats=1).model_dump(mode="json")
    chain = linear_chain(args.chain).model_dump(mode="json")
    plan_bodies = {"mlp": json.dumps({"graph": graph, "budget": "80%", "solver": "greedy"}).encode(),
                   "chain": json.dumps({"graph": chain, "budget": "80%", "solver": "every-k", "time_limit_s": 60}
                                       ).encode()}
    builds = {"this checkout": None, **({"before": args.before} if args.before else {})}
    servers = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for i, (name, path) in enumerate(builds.items()):
                servers[name] = start_server(2, Path(tmp) / f"plans{i}.sqlite", path)
            clients = {name: httpx.Client(base_url=url, timeout=120) for name, (_, url) in servers.items()}
            sizes = {}
            for c in clients.values():  # solve once; warm both routes
                for what, plan_body in plan_bodies.items():
                    r = c.post("/v1/plans", content=plan_body, headers={"content-type": "application/json"})
                    assert r.status_code == 200, r.text
                    sizes[what] = len(r.content)
                    timed(c, "/v1/plans", plan_body, 5, lambda r: r.json()["cache_hit"])
            hits: dict[tuple[str, str], list[float]] = {(n, w): [] for n in builds for w in plan_bodies}
            for rnd in range(args.rounds):
                order = list(builds) if rnd % 2 == 0 else list(reversed(builds))
                for name in order:
                    for what, plan_body in plan_bodies.items():
                        hits[name, what].append(timed(clients[name], "/v1/plans", plan_body, args.requests,
                                                      lambda r: r.status_code == 200 and r.json()["cache_hit"]))
                print(f"round {rnd + 1}: " + ", ".join(
                    f"{n}: hits {hits[n, 'mlp'][-1] * 1e3:.1f} / {hits[n, 'chain'][-1] * 1e3:.1f} ms" for n in order),
                    flush=True)
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(timeout=30)
    print(f"\nOne request at a time; median of each round's median, [min-max] over {args.rounds} rounds "
          f"({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end). Answers: mlp "
          f"{sizes['mlp'] // 1024} KiB, chain {sizes['chain'] // 1024} KiB.\n")
    print(f"| build | hit, mlp plan | hit, {args.chain}-op chain plan |\n|---|--:|--:|")

    def cell(xs: list[float], digits: int) -> str:
        return f"{statistics.median(xs) * 1e3:.{digits}f} ms [{min(xs) * 1e3:.{digits}f}-{max(xs) * 1e3:.{digits}f}]"
    for n in builds:
        print(f"| {n} | {cell(hits[n, 'mlp'], 1)} | {cell(hits[n, 'chain'], 1)} |")
    in_process_rounds(args)


def in_process_rounds(args: argparse.Namespace) -> None:
    """:func:`in_process` under each build, a process per build and round, the order alternating."""
    builds = {"this checkout": None, **({"before": args.before} if args.before else {})}
    results: dict[str, list[dict[str, float]]] = {n: [] for n in builds}
    for rnd in range(args.rounds):
        for name in (list(builds) if rnd % 2 == 0 else list(reversed(builds))):
            env = dict(os.environ)
            if builds[name]:
                env["PYTHONPATH"] = builds[name]
            done = subprocess.run([sys.executable, __file__, "--in-process-worker", "--requests", str(args.requests),
                                   "--chain", str(args.chain)], env=env, capture_output=True, text=True,
                                  cwd=tempfile.gettempdir(), check=True)
            results[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"in-process round {rnd + 1}, {name}: {results[name][-1]}", flush=True)
    print(f"\nIn-process (test client, thread pool), {args.chain}-op chain; median [min-max] over {args.rounds} "
          f"rounds:\n\n| build | cache hit |\n|---|--:|")
    for n in builds:
        h = [r["hit"] for r in results[n]]
        print(f"| {n} | {statistics.median(h) * 1e3:.1f} ms [{min(h) * 1e3:.1f}-{max(h) * 1e3:.1f}] |")


if __name__ == "__main__":
    main()
