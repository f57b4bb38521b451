"""Load: concurrent plan requests against ``memplan serve`` on loopback; latency, throughput and errors,
cache misses and cache hits apart.

Starts a server (worker processes, a fresh SQLite cache file) on a free loopback port unless ``--url``
names one, profiles a built-in workload into a graph (or reads ``--graph``), then runs two phases with
``--concurrency`` requests in flight (httpx, asyncio):

1. **miss**: ``--requests`` plan requests, each with its own budget (spread between the smallest feasible
   budget and keep-everything), so each is solved;
2. **hit**: the same requests again, in another order: each is answered from the plan cache.

3. **saturated**: for ``--saturate-seconds``, ``--overrun-concurrency`` requests at a time that overrun
   their time limit (rotor at 50% of a 2,000-op chain with ``time_limit_s`` 0.3: its DP table, filled in
   one go, takes ~20 s on the shared 2-core machine), so every worker is busy until the server
   stops the job and replaces its process; meanwhile ``/healthz`` and cache hits are sent one at a time and timed.

Each answer is classed by its ``cache_hit`` flag, not by phase. Both phases are bounded: by
``--requests`` and by ``--max-seconds`` (requests not started by then are not sent and are counted as
such). Prints a markdown table; ``--update-doc`` also replaces the table in docs/benchmarks.md (between
the ``load:begin``/``load:end`` markers).

    python benchmarks/load.py [--requests 200] [--concurrency 16] [--workload mlp] [--update-doc]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from _doc import update_section  # benchmarks/_doc.py (the scripts run from this folder)

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


@dataclass
class Tally:
    latencies_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """5xx answers and transport failures: what the target of 0 is about."""
    refused: list[str] = field(default_factory=list)
    """4xx answers (e.g. no plan found at that budget): answers, but not plans."""


@dataclass
class Phase:
    name: str
    wall_s: float = 0.0
    not_sent: int = 0
    by_kind: dict[str, Tally] = field(default_factory=lambda: {"miss": Tally(), "hit": Tally()})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(workers: int, cache: Path, pythonpath: str | None = None) -> tuple[subprocess.Popen, str]:
    """``memplan serve`` on a free loopback port, (process, URL) once ``/healthz`` answers. ``pythonpath``:
    a folder holding another build's ``memplan`` package, put first on ``PYTHONPATH`` (None: this one)."""
    port = free_port()
    env = {**os.environ, **({"PYTHONPATH": pythonpath} if pythonpath else {})}
    proc = subprocess.Popen([sys.executable, "-m", "memplan.api.cli", "serve", "--port", str(port),
                             "--cache", str(cache), "--workers", str(workers)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=tempfile.gettempdir() if pythonpath else None)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"memplan serve exited with {proc.returncode}: {proc.stderr.read()}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("memplan serve did not answer /healthz within 120 s")


def load_graph(args: argparse.Namespace) -> dict:
    if args.graph:
        return json.loads(Path(args.graph).read_text())
    from memplan.planner.probe.profiler import profile
    from memplan.planner.workloads import load_workload

    w = load_workload(args.workload)
    return profile(w.model, w.batch, w.loss_fn, name=w.name, progress=False, repeats=1).model_dump(mode="json")


def budgets_for(graph: dict, n: int) -> list[int]:
    """``n`` distinct byte budgets from a quarter of the way between the smallest known feasible one and
    keep-everything up to keep-everything (near the minimum a heuristic may rightly find no plan)."""
    from memplan.planner.core.graph import Graph
    from memplan.solvers import keep_all_report, smallest_known_peak

    g = Graph.model_validate(graph)
    low, high = smallest_known_peak(g), keep_all_report(g).peak_bytes
    low += (high - low) // 4
    if high - low < n:
        raise SystemExit(f"graph has only {high - low} bytes between its smallest plan and keep-everything; "
                         f"fewer than the {n} distinct budgets asked for")
    return [low + (high - low) * (i + 1) // n for i in range(n)]


async def run_phase(name: str, client: httpx.AsyncClient, bodies: list[bytes], concurrency: int,
                    deadline: float) -> Phase:
    phase = Phase(name)
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    for b in bodies:
        queue.put_nowait(b)

    async def worker() -> None:
        while not queue.empty():
            if time.monotonic() > deadline:
                phase.not_sent += queue.qsize()
                while not queue.empty():
                    queue.get_nowait()
                return
            body = queue.get_nowait()
            t0 = time.perf_counter()
            try:
                r = await client.post("/v1/plans", content=body, headers={"content-type": "application/json"})
                elapsed = time.perf_counter() - t0
                doc = r.json()
                kind = "hit" if doc.get("cache_hit") else "miss"
                if r.status_code != 200:
                    bucket = phase.by_kind[kind].refused if r.status_code < 500 else phase.by_kind[kind].errors
                    bucket.append(f"{r.status_code}: {doc.get('detail', r.text)[:200]}")
                else:
                    phase.by_kind[kind].latencies_s.append(elapsed)
            except (httpx.HTTPError, ValueError) as e:
                phase.by_kind["miss"].errors.append(f"{type(e).__name__}: {e}")

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    phase.wall_s = time.perf_counter() - t0
    return phase


@dataclass
class Saturated:
    """What the saturated phase saw."""

    wall_s: float = 0.0
    overrun_status: dict[int, int] = field(default_factory=dict)
    """Status code -> count of the over-limit requests (504: stopped at its limit; 503: no worker free)."""
    overrun_s: list[float] = field(default_factory=list)
    healthz_s: list[float] = field(default_factory=list)
    hit_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """/healthz or cache-hit requests that failed or were not hits."""


async def run_saturated(client: httpx.AsyncClient, hit_bodies: list[bytes], overrun_body: bytes, seconds: float,
                        overrun_concurrency: int) -> Saturated:
    out = Saturated()
    stop = time.monotonic() + seconds
    json_type = {"content-type": "application/json"}

    async def overrun() -> None:
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            try:
                r = await client.post("/v1/plans", content=overrun_body, headers=json_type)
                out.overrun_status[r.status_code] = out.overrun_status.get(r.status_code, 0) + 1
                out.overrun_s.append(time.perf_counter() - t0)
            except httpx.HTTPError as e:
                out.errors.append(f"overrun: {type(e).__name__}: {e}")

    async def probe() -> None:
        await asyncio.sleep(1.0)  # let the overruns fill the workers first
        i = 0
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            try:
                h = await client.get("/healthz")
                out.healthz_s.append(time.perf_counter() - t0)
                if h.status_code != 200:
                    out.errors.append(f"/healthz {h.status_code}")
                t0 = time.perf_counter()
                r = await client.post("/v1/plans", content=hit_bodies[i % len(hit_bodies)], headers=json_type)
                out.hit_s.append(time.perf_counter() - t0)
                if r.status_code != 200 or not r.json().get("cache_hit"):
                    out.errors.append(f"hit: {r.status_code} {r.text[:100]}")
            except httpx.HTTPError as e:
                out.errors.append(f"probe: {type(e).__name__}: {e}")
            i += 1
            await asyncio.sleep(0.05)

    t0 = time.perf_counter()
    await asyncio.gather(probe(), *(overrun() for _ in range(overrun_concurrency)))
    out.wall_s = time.perf_counter() - t0
    return out


def saturated_markdown(sat: Saturated, overrun_concurrency: int, workers: int) -> str:
    def row(what: str, values: list[float]) -> str:
        if not values:
            return f"| {what} | 0 | - | - | - |"
        return (f"| {what} | {len(values)} | {percentile(values, 50) * 1e3:.1f} ms | "
                f"{percentile(values, 99) * 1e3:.1f} ms | {max(values) * 1e3:.1f} ms |")

    statuses = ", ".join(f"{n} x {code}" for code, n in sorted(sat.overrun_status.items()))
    return "\n".join([
        f"Saturated: {sat.wall_s:.0f} s with {overrun_concurrency} over-limit requests in flight against "
        f"{workers} workers (answers: {statuses}); /healthz and a cache hit sent one at a time meanwhile "
        f"({len(sat.errors)} of them failed or were not hits).", "",
        "| request | count | p50 | p99 | max |", "|---|--:|--:|--:|--:|",
        row("over-limit plan (stopped)", sat.overrun_s), row("/healthz", sat.healthz_s),
        row("cache hit", sat.hit_s)])


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(n q / 100), at least the first
    return ordered[int(rank) - 1]


def table(phases: list[Phase]) -> list[dict]:
    rows = []
    for phase in phases:
        for kind, t in phase.by_kind.items():
            n = len(t.latencies_s) + len(t.errors) + len(t.refused)
            if n == 0:
                continue
            lat = t.latencies_s or [float("nan")]
            rows.append({"phase": phase.name, "answer": f"cache {kind}", "requests": n, "errors": len(t.errors),
                         "refused": len(t.refused),
                         "not_sent": phase.not_sent, "p50_ms": percentile(lat, 50) * 1e3,
                         "p99_ms": percentile(lat, 99) * 1e3, "mean_ms": statistics.fmean(lat) * 1e3,
                         "throughput_rps": n / phase.wall_s if phase.wall_s else 0.0, "wall_s": phase.wall_s})
    return rows


def markdown(rows: list[dict], setup: str) -> str:
    lines = [setup, "",
             "| phase | answer | requests | errors (5xx, transport) | refused (4xx) | not sent | p50 | p99 | mean "
             "| throughput |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        lines.append(f"| {r['phase']} | {r['answer']} | {r['requests']} | {r['errors']} | {r['refused']} | {r['not_sent']} | "
                     f"{r['p50_ms']:.1f} ms | {r['p99_ms']:.1f} ms | {r['mean_ms']:.1f} ms | "
                     f"{r['throughput_rps']:.0f} req/s |")
    return "\n".join(lines)


def update_doc(text: str) -> None:
    update_section("load", "Service load: concurrent plan requests on loopback", text, DOC)


async def main_async(args: argparse.Namespace, url: str, graph: dict) -> tuple[list[Phase], Saturated | None]:
    budgets = budgets_for(graph, args.requests)
    graph_text = json.dumps(graph, separators=(",", ":"))
    bodies = [(f'{{"graph":{graph_text},"budget":{b},"solver":"{args.solver}",'
               f'"time_limit_s":{args.time_limit}}}').encode() for b in budgets]
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=args.time_limit + 60, limits=limits) as client:
        deadline = time.monotonic() + args.max_seconds
        miss = await run_phase("miss", client, bodies, args.concurrency, deadline)
        shuffled = random.Random(0).sample(bodies, len(bodies))
        hit = await run_phase("hit", client, shuffled, args.concurrency, time.monotonic() + args.max_seconds)
        # hits one at a time: the latency of a lookup itself, without waiting behind other requests
        serial = await run_phase("hit, 1 in flight", client, shuffled[: min(len(bodies), 100)], 1,
                                 time.monotonic() + args.max_seconds)
        sat = None
        if args.saturate_seconds > 0:
            from memplan.planner.core.synthetic import linear_chain

            overrun = json.dumps({"graph": linear_chain(2000).model_dump(mode="json"), "budget": "50%",
                                  "solver": "rotor", "time_limit_s": 0.3}).encode()
            sat = await run_saturated(client, shuffled[:20], overrun, args.saturate_seconds,
                                      args.overrun_concurrency)
    return [miss, hit, serial], sat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200, help="distinct plan requests (each sent twice)")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight at once")
    ap.add_argument("--workload", default="mlp", help="built-in workload to profile into the graph")
    ap.add_argument("--graph", help="a graph.json to plan instead of profiling --workload")
    ap.add_argument("--solver", default="greedy")
    ap.add_argument("--time-limit", type=float, default=5.0, help="time_limit_s of each request")
    ap.add_argument("--workers", type=int, default=2, help="solve workers of the server started")
    ap.add_argument("--max-seconds", type=float, default=120.0, help="bound on each phase")
    ap.add_argument("--saturate-seconds", type=float, default=30.0,
                    help="length of the saturated phase (over-limit requests on every worker); 0: none")
    ap.add_argument("--overrun-concurrency", type=int, default=4, help="over-limit requests in flight then")
    ap.add_argument("--url", help="an already running server instead of starting one")
    ap.add_argument("--json", action="store_true", help="rows as JSON instead of a markdown table")
    ap.add_argument("--update-doc", action="store_true", help="write the table into docs/benchmarks.md")
    args = ap.parse_args()
    if args.requests < 1 or args.concurrency < 1:
        raise SystemExit("--requests and --concurrency must be >= 1")

    graph = load_graph(args)
    proc = None
    with tempfile.TemporaryDirectory() as tmp:
        if args.url:
            url = args.url
        else:
            proc, url = start_server(args.workers, Path(tmp) / "plans.sqlite")
        try:
            phases, sat = asyncio.run(main_async(args, url, graph))
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
    rows = table(phases)
    if args.json:
        print(json.dumps(rows, indent=1))
    setup = (f"{args.requests} distinct `POST /v1/plans` ({graph.get('name')}: {len(graph['ops'])} ops, "
             f"{len(json.dumps(graph)) // 1024} KiB of graph JSON; solver {args.solver}), {args.concurrency} in "
             f"flight, server with {args.workers} worker processes, client and server on one machine "
             f"({os.cpu_count()} cores, Python {platform.python_version()}).")
    text = markdown(rows, setup)
    if sat is not None:
        text += "\n\n" + saturated_markdown(sat, args.overrun_concurrency, args.workers)
        for e in sorted(set(sat.errors))[:5]:
            print(f"saturated: {e}", file=sys.stderr)
    if not args.json:
        print(text)
    for phase in phases:
        for kind, t in phase.by_kind.items():
            for e in sorted(set(t.errors) | set(t.refused))[:5]:
                print(f"{phase.name} / {kind}: {e}", file=sys.stderr)
    if args.update_doc:
        update_doc(text)


if __name__ == "__main__":
    main()
