"""A team's service: two ``memplan serve`` replicas (subprocesses on two loopback ports) sharing one
PostgreSQL plan store (a throwaway server, the ``postgres`` fixture), spoken to over HTTP: a plan solved on
one is a hit on the other; identical requests spread over both are solved once; a replica killed
mid-solve loses nothing the other cannot answer; the database stopped and started under load costs no
5xx but 503 with Retry-After, and nothing accepted is lost."""

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from typer.testing import CliRunner

from memplan.planner.core.synthetic import linear_chain

pytestmark = pytest.mark.slow  # two server starts, a third killed, a database restarted: ~40 s

LEASE_S = 1.5
ENV = {"MEMPLAN_LEASE_S": str(LEASE_S), "MEMPLAN_STORE_TIMEOUT_S": "1", "MEMPLAN_DEFAULT_TIME_LIMIT_S": "5",
       "MEMPLAN_MAX_TIME_LIMIT_S": "20", "MEMPLAN_GRACE_S": "3"}
CHAIN = linear_chain(200).model_dump(mode="json")
# a solve that runs to its time limit: an exhaustive search of a 14-op chain with offload
LONG = {"graph": linear_chain(14).model_dump(mode="json"), "solver": "oracle", "offload": True, "time_limit_s": 4.0}


@pytest.fixture(scope="module")
def store(postgres):
    import psycopg

    from memplan.api.pgcache import TABLES

    with psycopg.connect(postgres.url, autocommit=True) as conn:  # an empty database: memplan makes its tables
        conn.execute(f"DROP TABLE IF EXISTS {', '.join(TABLES)}")
    return postgres


@pytest.fixture(scope="module")
def replicas(serve, store):
    """Two replicas' base URLs (one worker each: the machine has two cores)."""
    return [serve(store.url, env=ENV, workers=1)[0] for _ in range(2)]


def solved(urls) -> int:
    return sum(httpx.get(f"{u}/healthz").json()["solved"] for u in urls)


def wait_job(url: str, timeout_s: float = 60) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.get(url, timeout=10)
        if r.status_code not in (202, 503) or time.monotonic() > deadline:
            return r
        time.sleep(0.1)


def test_both_replicas_name_the_shared_store(replicas, store):
    health = [httpx.get(f"{u}/healthz").json() for u in replicas]
    assert [h["status"] for h in health] == ["ok", "ok"]
    assert {h["store"] for h in health} == {store.url}
    assert health[0]["replica"] != health[1]["replica"]


def test_a_plan_solved_on_one_replica_is_a_hit_on_the_other(replicas):
    a, b = replicas
    req = {"graph": CHAIN, "budget": "75%", "solver": "greedy"}
    before = solved(replicas)
    first = httpx.post(f"{a}/v1/plans", json=req, timeout=60)
    assert first.status_code == 200 and first.json()["cache_hit"] is False
    read_on_b = httpx.get(f"{b}/healthz").json()["bodies_read"]
    second = httpx.post(f"{b}/v1/plans", content=first.request.content, timeout=60,
                        headers={"content-type": "application/json"})
    assert second.status_code == 200
    assert second.content == first.content.replace(b'{"cache_hit":false,', b'{"cache_hit":true,', 1)
    assert solved(replicas) == before + 1  # B answered without a solve...
    assert httpx.get(f"{b}/healthz").json()["bodies_read"] == read_on_b  # ...and without reading the body
    spaced = httpx.post(f"{b}/v1/plans", json={**req, "budget": " 75%"}, timeout=60)  # other bytes: read, a hit
    assert spaced.json()["cache_hit"] is True and spaced.json()["plan"] == first.json()["plan"]


def test_twenty_identical_requests_over_both_replicas_are_solved_once(replicas):
    req = {"graph": linear_chain(400).model_dump(mode="json"), "budget": "50%", "solver": "ilp", "time_limit_s": 15}
    before = solved(replicas)
    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(lambda i: httpx.post(f"{replicas[i % 2]}/v1/plans", json=req, timeout=60), range(20)))
    assert [r.status_code for r in answers] == [200] * 20
    assert solved(replicas) == before + 1
    plans = {r.content.replace(b'{"cache_hit":true,', b'{"cache_hit":false,', 1) for r in answers}
    assert len(plans) == 1  # one answer, the same bytes everywhere (hits marked so)


def test_a_replica_killed_mid_solve_loses_nothing(serve, store, replicas):
    """C takes a job and starts solving; B is asked the same plan meanwhile (it waits on C's lease); C is
    killed. B takes the solve over when C's lease expires, and A, asked for the job, adopts it: both
    answer, with the one plan B solved."""
    a, b = replicas
    c, c_proc = serve(store.url, env=ENV, workers=1)
    job = httpx.post(f"{c}/v1/jobs", json=LONG, timeout=30)
    assert job.status_code == 202
    deadline = time.monotonic() + 20
    while httpx.get(f"{c}/healthz").json()["busy"] == 0:  # C's worker is solving it
        assert time.monotonic() < deadline, "C never started solving the job"
        time.sleep(0.05)
    waiting: list[httpx.Response] = []
    waiter = threading.Thread(target=lambda: waiting.append(httpx.post(f"{b}/v1/plans", json=LONG, timeout=60)))
    waiter.start()
    time.sleep(0.5)
    os.kill(c_proc.pid, signal.SIGKILL)
    c_proc.wait(timeout=10)
    progress = httpx.get(f"{a}{job.json()['url']}")
    assert progress.status_code == 202 and progress.json()["status"] == "running"
    answer = wait_job(f"{a}{job.json()['url']}")
    waiter.join(timeout=60)
    assert answer.status_code == 200, answer.text
    assert waiting and waiting[0].status_code == 200, waiting and waiting[0].text
    assert answer.json()["plan"] == waiting[0].json()["plan"]
    assert httpx.get(f"{b}{job.json()['url']}").json()["solver"] == answer.json()["solver"]  # from any replica


def test_the_database_stopped_and_started_under_load(replicas, store):
    """Four clients for a bounded time, plan requests (hits and solves) and jobs over both replicas,
    while the database is stopped for a few seconds and started again: every answer is 200, 202 or 503
    with Retry-After; /healthz says degraded meanwhile; every job accepted is answered after, and the
    plans solved meanwhile reach the store."""
    statuses: list[tuple[int, str | None]] = []
    jobs: list[str] = []
    solved_meanwhile: list[dict] = []
    degraded: list[dict] = []
    stop = threading.Event()
    outage = threading.Event()

    def client(n: int) -> None:
        i = 0
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                url = replicas[(n + i) % 2]
                req = {"graph": CHAIN, "budget": f"{60 + (7 * i + n) % 35}%", "solver": "greedy"}
                if i % 4 == 3:
                    r = http.post(f"{url}/v1/jobs", json=req)
                    if r.status_code == 202:
                        jobs.append(f"{url}{r.json()['url']}")
                else:
                    r = http.post(f"{url}/v1/plans", json=req)
                    if r.status_code == 200 and outage.is_set() and not r.json()["cache_hit"]:
                        solved_meanwhile.append(req)
                statuses.append((r.status_code, r.headers.get("retry-after")))
                i += 1

    threads = [threading.Thread(target=client, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(2)
        store.stop()
        outage.set()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            h = httpx.get(f"{replicas[0]}/healthz").json()
            if h["status"] == "degraded":
                degraded.append(h)
            time.sleep(0.2)
    finally:
        store.start()
        outage.clear()
    time.sleep(2)
    stop.set()
    for t in threads:
        t.join(timeout=60)
    bad = [(s, ra) for s, ra in statuses if s >= 500 and not (s == 503 and ra)]
    assert not bad, f"answers other than 503 with Retry-After: {bad[:5]}"
    assert {s for s, _ in statuses} <= {200, 202, 503}
    assert any(s == 503 for s, _ in statuses)  # jobs were refused while the database was away
    assert degraded and degraded[0]["store"] == store.url and degraded[0]["store_error"].startswith("unreachable")
    deadline = time.monotonic() + 20
    while any(httpx.get(f"{u}/healthz").json()["status"] != "ok" for u in replicas):
        assert time.monotonic() < deadline, "a replica did not reconnect"
        time.sleep(0.2)
    assert jobs and all(wait_job(j).status_code == 200 for j in jobs)  # nothing accepted is lost
    deadline = time.monotonic() + 10  # writes of the outage are retried within a few upkeep rounds
    while any(httpx.get(f"{u}/healthz").json()["pending_writes"] for u in replicas):
        assert time.monotonic() < deadline, "writes made during the outage were not retried"
        time.sleep(0.2)
    for req in solved_meanwhile[:5]:  # solved during the outage, on one replica: in the store now
        r = httpx.post(f"{replicas[0]}/v1/plans", json=req, timeout=60)
        r2 = httpx.post(f"{replicas[1]}/v1/plans", json=req, timeout=60)
        assert r.json()["cache_hit"] or r2.json()["cache_hit"]


def test_submit_and_wait_from_the_command_line(replicas, tmp_path):
    from memplan.api.cli import app
    from memplan.planner.core.plan import Plan

    graph = tmp_path / "graph.json"
    graph.write_text(linear_chain(12).model_dump_json())
    runner = CliRunner()
    sub = runner.invoke(app, ["submit", str(graph), "-b", "70%", "--solver", "oracle", "--server", replicas[0]])
    assert sub.exit_code == 0, sub.output
    job_url = sub.stdout.strip().splitlines()[0]
    assert job_url.startswith(f"{replicas[0]}/v1/jobs/")
    other = job_url.replace(replicas[0], replicas[1])  # the answer from the other replica
    done = runner.invoke(app, ["wait", other, "-o", str(tmp_path / "plan.json"), "--json"])
    assert done.exit_code == 0, done.output
    assert Plan.load(str(tmp_path / "plan.json")).solver.name == "oracle"
    gone = runner.invoke(app, ["wait", "nope", "--server", replicas[1], "-o", str(tmp_path / "p2.json")])
    assert gone.exit_code == 2
    assert gone.output.strip().startswith("error: the server answered 404: no job 'nope'")
    away = runner.invoke(app, ["wait", "abc", "--server", "http://127.0.0.1:1", "--timeout", "1.5",
                               "-o", str(tmp_path / "p4.json")])  # retried for 1.5 s, then one line
    assert away.exit_code == 2 and away.output.startswith("error: cannot reach the memplan server at http://127.0.0.1:1")
    bad = runner.invoke(app, ["submit", str(graph), "-b", "1", "--server", replicas[0]])
    assert bad.exit_code == 0  # accepted; its answer is the refusal
    refused = runner.invoke(app, ["wait", bad.stdout.strip().splitlines()[0], "-o", str(tmp_path / "p3.json")])
    assert refused.exit_code == 2 and "the server answered 422: no plan fits budget 1 B" in refused.output
