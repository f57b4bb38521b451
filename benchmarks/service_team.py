"""Cache hits for a team: one ``memplan serve`` with its SQLite cache against two replicas sharing one
PostgreSQL plan store, side by side in one run, over real HTTP on loopback.

Starts, on free loopback ports: replica S (``--cache`` a fresh SQLite file), and replicas P1, P2 (``--cache``
one PostgreSQL URL: ``--pg-url``, or a throwaway server started here with the tests' helper,
tests/pgcluster.py, as the ``postgres`` user when run as root), each with one worker process. Two plan
requests are solved once on each setup before the rounds (on P1; P2's first answer is then a hit from
the store): a 64-op chain (greedy: a small answer) and a ``--chain``-op chain (every-k at 80%: an answer
with a decision per activation).

Then ``--rounds`` rounds, the setups' order alternating, per setup and request:

* **one at a time**: ``--requests`` identical POSTs, each waited for (on two replicas: alternately to P1
  and P2, as a round-robin balancer sends them);
* **concurrent**: the same count from ``--concurrency`` client threads (each its own keep-alive
  connection; on two replicas half the threads on each).

Each cell: requests per second, and p50 / p99 latency; median [min-max] over the rounds. Every answer is
checked to be a cache hit. ``--update-doc`` writes the table into docs/benchmarks.md.

    python benchmarks/service_team.py [--rounds 5] [--requests 200] [--concurrency 8] [--update-doc]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from _doc import publish  # benchmarks/_doc.py (the scripts run from this folder)
from load import start_server  # benchmarks/load.py

TESTS = Path(__file__).resolve().parent.parent / "tests"


def hits(urls: list[str], body: bytes, n: int, concurrency: int) -> dict[str, float]:
    """``n`` POSTs of ``body`` spread over ``urls``; requests per second, p50 and p99 seconds."""
    latencies: list[float] = []
    lock = threading.Lock()
    headers = {"content-type": "application/json"}

    def client(k: int, count: int) -> None:
        mine = []
        with httpx.Client(timeout=120) as c:
            for i in range(count):
                url = urls[(k + i) % len(urls)] if concurrency == 1 else urls[k % len(urls)]
                t0 = time.perf_counter()
                r = c.post(f"{url}/v1/plans", content=body, headers=headers)
                mine.append(time.perf_counter() - t0)
                if r.status_code != 200 or not r.content.startswith(b'{"cache_hit":true'):
                    raise SystemExit(f"{url}: not a cache hit: {r.status_code} {r.text[:200]}")
        with lock:
            latencies.extend(mine)

    per = [n // concurrency + (1 if k < n % concurrency else 0) for k in range(concurrency)]
    threads = [threading.Thread(target=client, args=(k, per[k])) for k in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    q = statistics.quantiles(latencies, n=100, method="inclusive")
    return {"rps": n / wall, "p50": statistics.median(latencies), "p99": q[98]}


def cpu_name() -> str:
    """The CPU's model name (Linux), else the machine type."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def commit() -> str:
    import subprocess

    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent)
    return done.stdout.strip() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--chain", type=int, default=2000, help="ops of the larger chain whose plan is served")
    ap.add_argument("--pg-url", help="a PostgreSQL database to use (default: a throwaway server started here)")
    ap.add_argument("--update-doc", action="store_true")
    args = ap.parse_args()

    from memplan.planner.core.synthetic import linear_chain

    bodies = {"64-op chain": json.dumps({"graph": linear_chain(64).model_dump(mode="json"), "budget": "80%",
                                         "solver": "greedy"}).encode(),
              f"{args.chain}-op chain": json.dumps({"graph": linear_chain(args.chain).model_dump(mode="json"),
                                                   "budget": "80%", "solver": "every-k", "time_limit_s": 60}).encode()}
    cluster = None
    url = args.pg_url
    if url is None:
        sys.path.insert(0, str(TESTS))
        from pgcluster import Cluster, server_bin

        bin_dir = server_bin()
        if bin_dir is None:
            raise SystemExit("no PostgreSQL server binaries found (apt-get install postgresql), and no --pg-url")
        cluster = Cluster(bin_dir, fsync=True)
        cluster.start()
        url = cluster.url
    procs = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            s_proc, s_url = start_server(1, Path(tmp) / "plans.sqlite")
            procs.append(s_proc)
            team = []
            for _ in range(2):
                proc, u = start_server(1, url)  # type: ignore[arg-type]  # a URL where a path goes
                procs.append(proc)
                team.append(u)
            setups = {"1 replica, SQLite": [s_url], "2 replicas, PostgreSQL": team}
            sizes = {}
            for urls in setups.values():  # solve once (on the first replica), then warm every replica
                for what, body in bodies.items():
                    r = httpx.post(f"{urls[0]}/v1/plans", content=body, headers={"content-type": "application/json"},
                                   timeout=300)
                    assert r.status_code == 200, r.text
                    sizes[what] = len(r.content)
                    hits(urls, body, 10 * len(urls), 1)
            modes = {"one at a time": 1, f"{args.concurrency} at once": args.concurrency}
            results: dict[tuple[str, str, str], list[dict[str, float]]] = {}
            for rnd in range(args.rounds):
                order = list(setups) if rnd % 2 == 0 else list(reversed(setups))
                for name in order:
                    for what, body in bodies.items():
                        for mode, conc in modes.items():
                            results.setdefault((name, what, mode), []).append(
                                hits(setups[name], body, args.requests, conc))
                print(f"round {rnd + 1} done", file=sys.stderr, flush=True)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
        if cluster is not None:
            cluster.remove()

    def cell(xs: list[float], scale: float, digits: int) -> str:
        xs = [x * scale for x in xs]
        return f"{statistics.median(xs):.{digits}f} [{min(xs):.{digits}f}-{max(xs):.{digits}f}]"

    lines = [f"`python benchmarks/service_team.py --rounds {args.rounds} --requests {args.requests} --concurrency "
             f"{args.concurrency}` (commit {commit()}) on {cpu_name()}, {os.cpu_count()} cores (shared "
             f"with the clients and the database; load average {os.getloadavg()[0]:.1f} at the end), every replica "
             f"with 1 worker process, PostgreSQL {'a throwaway local server (fsync on)' if cluster else 'at --pg-url'} on "
             f"loopback. Cache hits only (every answer checked); median [min-max] over {args.rounds} rounds. "
             f"Answers: " + ", ".join(f"{w} {sizes[w] // 1024} KiB" for w in bodies) + ".", "",
             "| setup | plan | clients | requests/s | p50 ms | p99 ms |", "|---|---|---|--:|--:|--:|"]
    for name in setups:
        for what in bodies:
            for mode in modes:
                rs = results[name, what, mode]
                lines.append(f"| {name} | {what} | {mode} | {cell([r['rps'] for r in rs], 1, 0)} | "
                             f"{cell([r['p50'] for r in rs], 1e3, 1)} | {cell([r['p99'] for r in rs], 1e3, 1)} |")
    publish("\n".join(lines), args.update_doc, "service_team", "Cache hits: one replica on SQLite, two on PostgreSQL")


if __name__ == "__main__":
    main()
