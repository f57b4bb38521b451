"""The plan cache, the same on both backends: SQLite (one server's, embedded) and PostgreSQL (a store a
team's replicas share; a throwaway server from the ``postgres`` fixture, skipped where none is installed).
The same keys, the same answers, the same size bound and eviction, damaged rows skipped and counted; and
what only the shared store does: a schema version and its migration, solve leases, jobs, and going on
without the database (degraded) when it cannot be reached."""

import json
import time

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from memplan.api.cache import CacheError, PlanCache, cache_backend, content_hash, plan_key
from memplan.api.settings import Settings
from memplan.api.store import open_cache
from memplan.planner.core.synthetic import linear_chain

ANSWER = {"graph_fingerprint": "f", "solver": {"name": "greedy", "status": "optimal"}, "pad": "x" * 5000}
CHAIN = linear_chain(8).model_dump(mode="json")


def fresh_store(url: str) -> None:
    """Drop every table memplan made: each test starts from an empty database."""
    import psycopg

    from memplan.api.pgcache import TABLES

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {', '.join(TABLES)}")


def sql(cache, statement: str, params=()) -> list:
    """Run ``statement`` on the cache's own database (SQLite file or PostgreSQL)."""
    if isinstance(cache, PlanCache):
        with cache._lock:
            return cache._db.execute(statement.replace("%s", "?").replace("memplan_plans", "plans"), params).fetchall()
    import psycopg

    with psycopg.connect(cache.url, autocommit=True) as conn:
        cur = conn.execute(statement, params)
        return cur.fetchall() if cur.description else []


@pytest.fixture(params=["sqlite", "postgresql"])
def make_cache(request, tmp_path):
    """``make(max_bytes=0)``: a new handle on one store of the backend (two handles: two replicas)."""
    made = []
    if request.param == "sqlite":
        location = str(tmp_path / "plans.sqlite")
    else:
        location = request.getfixturevalue("postgres").url
        fresh_store(location)

    def make(max_bytes: int = 0):
        made.append(open_cache(location, max_bytes=max_bytes))
        return made[-1]

    yield make
    for c in made:
        c.close()


# ---- the same cache on both backends ---------------------------------------------------------------
def test_an_answer_comes_back_as_it_was_stored(make_cache):
    a, b = make_cache(), make_cache()
    key = plan_key(graph_sha256="g", budget="50%", solver="greedy", time_limit_s=1, offload=False,
                   host_budget=None, context="c")
    text = json.dumps(ANSWER, separators=(",", ":"))
    assert a.get(key) is None and a.put(key, ANSWER) is True
    assert a.get(key) == text and b.get(key) == text  # another handle (replica) on the same store sees it
    assert len(b) == 1 and b.stored_bytes() == len(text)
    b.clear()
    assert a.get(key) is None and len(a) == 0


def test_a_requests_states_and_the_key_version_are_part_of_its_key(monkeypatch):
    """Requests differing only in ``states`` (absent included: it follows ``offload``) never share an
    answer, and a new key version leaves every answer stored under the old one unserved."""
    from memplan.api import cache

    def key(**kw):
        return plan_key(graph_sha256="g", budget="50%", solver="greedy", time_limit_s=1, offload=True,
                        host_budget=None, context="c", **kw)

    keys = [key(states=s) for s in (None, "auto", "stream", "host", "none")]
    assert len(set(keys)) == 5 and key() == keys[0]
    monkeypatch.setattr(cache, "PLAN_KEY_VERSION", cache.PLAN_KEY_VERSION + 1)
    assert key() != keys[0]


def test_incomplete_answers_are_not_cached(make_cache):
    cache = make_cache()
    assert cache.put("k", {**ANSWER, "solver": {"name": "ilp", "status": "timeout"}}) is False
    assert cache.get("k") is None and len(cache) == 0


def test_the_least_recently_used_are_evicted(make_cache):
    cache = make_cache(max_bytes=10_000)
    cache.touch_every_s = 0  # PostgreSQL's: record every hit's recency, as SQLite does (default: every 10 s)
    answer = {**ANSWER, "pad": "x" * 1900}
    for i in range(4):
        cache.put(f"k{i}", answer)
        time.sleep(0.002)  # distinct recency
    assert cache.get("k0") is not None  # k0 used: k1 is now the least recent
    for i in range(4, 6):
        time.sleep(0.002)
        cache.put(f"k{i}", answer)
    assert cache.stored_bytes() <= 10_000
    assert cache.get("k1") is None and cache.get("k0") is not None and cache.get("k5") is not None


def test_a_damaged_or_foreign_row_is_skipped_and_counted(make_cache):
    cache = make_cache()
    cache.put("damaged", ANSWER)
    cache.put("foreign", ANSWER)
    sql(cache, "UPDATE memplan_plans SET response = %s WHERE key = %s", ('{"plan": "not what was stored"}', "damaged"))
    sql(cache, "UPDATE memplan_plans SET status = %s WHERE key = %s", ("timeout", "foreign"))
    assert cache.get("damaged") is None and cache.get("foreign") is None
    assert cache.skipped == 2
    assert cache.put("damaged", ANSWER) and cache.get("damaged") == json.dumps(ANSWER, separators=(",", ":"))


def test_two_backends_key_and_serve_a_request_alike(postgres, tmp_path):
    """The same request through a service on each backend: the same key stored; an answer moved from the
    SQLite store to the PostgreSQL one is served from there byte for byte."""
    fresh_store(postgres.url)
    req = {"graph": CHAIN, "budget": "70%", "solver": "oracle"}
    keys, answers = {}, {}
    for name, location in (("sqlite", str(tmp_path / "plans.sqlite")), ("postgresql", postgres.url)):
        with TestClient(__import__("memplan.api.app", fromlist=["create_app"]).create_app(
                Settings(pool="thread", workers=1, cache_path=location))) as c:
            first = c.post("/v1/plans", json=req)
            assert first.status_code == 200 and first.json()["cache_hit"] is False
            cache = c.app.state.service.cache
            keys[name] = [k for (k,) in sql(cache, "SELECT key FROM memplan_plans")]
            if name == "postgresql":  # the SQLite store's answer, served by the PostgreSQL one
                sql(cache, "UPDATE memplan_plans SET response = %s, checksum = %s WHERE key = %s",
                    (answers["sqlite"], content_hash(answers["sqlite"]), keys[name][0]))
                hit = c.post("/v1/plans", json={**req, "budget": " 70%"})  # other bytes, same key: read, then a hit
                assert hit.status_code == 200
                assert hit.content == b'{"cache_hit":true,' + answers["sqlite"][1:].encode()
            answers[name] = sql(cache, "SELECT response FROM memplan_plans")[0][0]
    assert keys["sqlite"] == keys["postgresql"] and len(keys["sqlite"]) == 1


# ---- what a location may be ------------------------------------------------------------------------
def test_a_cache_location_it_does_not_understand_is_refused_in_one_line(tmp_path, monkeypatch):
    assert cache_backend("plans.sqlite") == ("sqlite", "plans.sqlite")
    assert cache_backend("sqlite:///srv/plans.sqlite") == ("sqlite", "/srv/plans.sqlite")
    assert cache_backend("postgres://u@h/db")[0] == "postgresql"
    with pytest.raises(CacheError, match=r"unknown scheme 'mysql'; give a SQLite file path"):
        open_cache("mysql://me:secret@db/plans")
    monkeypatch.chdir(tmp_path)
    from memplan.api.cli import app

    r = CliRunner().invoke(app, ["serve", "--cache", "redis://me:secret@cache:6379/0"])
    assert r.exit_code == 2
    assert r.output.strip().splitlines() == [
        "error: plan cache 'redis://me:***@cache:6379/0': unknown scheme 'redis'; give a SQLite file path, "
        "':memory:', sqlite:///absolute/path or a postgresql://user@host:port/dbname URL"]
    assert list(tmp_path.iterdir()) == []  # nothing taken as a path
    bad = CliRunner().invoke(app, ["serve", "--cache", "postgresql://me@db/plans?colour=blue"])
    assert bad.exit_code == 2 and "not a PostgreSQL URL libpq can read (invalid URI query parameter" in bad.output
    port = CliRunner().invoke(app, ["serve", "--cache", "postgresql://me@db:fivefour/plans"])
    assert port.exit_code == 2 and "port 'fivefour' is not a number" in port.output


# ---- the shared store only -------------------------------------------------------------------------
def test_an_older_store_is_migrated_and_a_newer_one_refused(postgres):
    from memplan.api.pgcache import MIGRATIONS, SCHEMA_VERSION, PostgresPlanCache

    fresh_store(postgres.url)
    text = json.dumps(ANSWER)
    import psycopg

    with psycopg.connect(postgres.url, autocommit=True) as conn:  # a store as version 1 left it
        conn.execute("CREATE TABLE memplan_schema (version INTEGER NOT NULL)")
        conn.execute("INSERT INTO memplan_schema VALUES (1)")
        for statement in MIGRATIONS[0]:
            conn.execute(statement)
        conn.execute("INSERT INTO memplan_plans VALUES ('old', 'f', 'greedy', 'optimal', %s, 0, 0)", (text,))
    cache = PostgresPlanCache(postgres.url, max_bytes=1 << 20)
    assert cache.get("old") == text  # kept, and served
    assert sql(cache, "SELECT version FROM memplan_schema") == [(SCHEMA_VERSION,)]
    assert sql(cache, "SELECT size_bytes FROM memplan_plans") == [(len(text),)]
    cache.close()
    sql(cache, "UPDATE memplan_schema SET version = 99")
    with pytest.raises(CacheError, match="schema version 99, written by a newer memplan"):
        PostgresPlanCache(postgres.url)


def test_one_replica_solves_and_another_takes_over_when_its_lease_expires(postgres):
    from memplan.api.pgcache import PostgresPlanCache

    fresh_store(postgres.url)
    a, b = PostgresPlanCache(postgres.url), PostgresPlanCache(postgres.url)
    assert a.claim_solve("k", "A", 0.5) is True and b.claim_solve("k", "B", 0.5) is False
    assert b.solve_state("k").owner == "A" and not b.solve_state("k").done
    time.sleep(0.7)  # A stopped renewing: its lease expired
    assert b.solve_state("k") is None and b.claim_solve("k", "B", 5) is True
    b.finish_solve("k", "B", 200, b'{"x":1}')
    state = a.solve_state("k")
    assert state.done and state.status_code == 200 and state.answer == b'{"x":1}'
    assert a.claim_solve("k", "A", 5) is False  # its answer is kept a while for late waiters
    # jobs: one whose replica died is adopted once
    a.create_job("j1", "k", b"request", 3.0, "A", 0.3)
    assert b.adopt_jobs("B", 5) == []  # A's lease is live
    time.sleep(0.5)
    assert b.adopt_jobs("B", 5) == [("j1", b"request")] and a.adopt_jobs("A", 5) == []
    row = a.get_job("j1")
    assert row.owner == "B" and row.adopted == 1 and not row.done
    b.finish_job("j1", 422, b'{"detail":"no"}')
    row = a.get_job("j1")
    assert row.done and (row.status_code, row.answer) == (422, b'{"detail":"no"}')
    a.close(), b.close()


def test_writes_made_while_the_database_is_away_are_retried(postgres):
    from memplan.api.pgcache import PostgresPlanCache

    fresh_store(postgres.url)
    cache = PostgresPlanCache(postgres.url, store_timeout_s=1)
    postgres.stop()
    try:
        assert cache.get("k") is None and not cache.available  # a miss: the caller solves
        assert cache.put("k", ANSWER) is False and cache.pending == 1
    finally:
        postgres.start()
    cache.tick("A", 5, 60)
    assert cache.available and cache.pending == 0 and cache.get("k") is not None
    cache.close()


def test_a_database_unreachable_at_start_serves_degraded():
    """Nothing listens on port 1: the server starts, says ``degraded`` naming the store, solves every
    plan request, and refuses jobs with 503 and Retry-After; no 500."""
    from memplan.api.app import create_app

    url = "postgresql://memplan:secret@127.0.0.1:1/plans"
    with TestClient(create_app(Settings(pool="thread", workers=1, cache_path=url, store_timeout_s=0.5))) as c:
        h = c.get("/healthz").json()
        assert h["status"] == "degraded" and h["store"] == "postgresql://memplan:***@127.0.0.1:1/plans"
        assert h["store_error"].startswith("unreachable:")
        req = {"graph": CHAIN, "budget": "70%", "solver": "oracle"}
        assert [c.post("/v1/plans", json=req).json()["cache_hit"] for _ in range(2)] == [False, False]
        job = c.post("/v1/jobs", json=req)
        assert job.status_code == 503 and job.headers["retry-after"] == "5"
        assert job.json()["error"] == "store_unavailable" and "unreachable" in job.json()["detail"]
        assert c.get("/v1/jobs/abc").status_code == 503


def test_jobs_on_one_server(tmp_path):
    """With a SQLite cache: 202 and a URL at once, 200 with the plan when done, the plan request's own
    error for a bad one (422 at once when the body is invalid, later when infeasible), 404 for no job."""
    from memplan.api.app import create_app

    with TestClient(create_app(Settings(pool="thread", workers=1, cache_path=str(tmp_path / "p.sqlite")))) as c:
        r = c.post("/v1/jobs", json={"graph": CHAIN, "budget": "70%", "solver": "oracle"})
        assert r.status_code == 202 and r.headers["location"] == r.json()["url"] == f"/v1/jobs/{r.json()['id']}"
        answer = wait_job(c, r.json()["url"])
        assert answer.status_code == 200 and answer.json()["solver"]["status"] == "optimal"
        plain = c.post("/v1/plans", json={"graph": CHAIN, "budget": "70%", "solver": "oracle"})
        assert plain.json()["cache_hit"] is True and plain.json()["plan"] == answer.json()["plan"]
        bad = c.post("/v1/jobs", json={"graph": CHAIN, "budget": "70%", "solver": "oracle", "offload": 3})
        assert bad.status_code == 422 and bad.json()["field"] == "offload"
        late = wait_job(c, c.post("/v1/jobs", json={"graph": CHAIN, "budget": 1, "solver": "oracle"}).json()["url"])
        assert late.status_code == 422 and late.json()["error"] == "infeasible"
        assert late.json() == c.post("/v1/plans", json={"graph": CHAIN, "budget": 1, "solver": "oracle"}).json()
        missing = c.get("/v1/jobs/0123")
        assert missing.status_code == 404 and "never submitted here, or finished more than 3600 s ago" in missing.text


def wait_job(c, url: str, timeout_s: float = 30):
    deadline = time.monotonic() + timeout_s
    while True:
        r = c.get(url)
        if r.status_code != 202 or time.monotonic() > deadline:
            return r
        assert r.headers["retry-after"] == "1" and r.json()["status"] == "running"
        time.sleep(0.05)


def test_a_store_broken_under_a_running_replica_is_a_miss_not_an_error(postgres):
    """Someone drops the cache's table: reads are misses (solves), writes wait, the store says why."""
    from memplan.api.pgcache import PostgresPlanCache

    fresh_store(postgres.url)
    cache = PostgresPlanCache(postgres.url)
    cache.put("k", ANSWER)
    sql(cache, "DROP TABLE memplan_plans")
    assert cache.get("k") is None and not cache.available
    assert "memplan_plans" in cache.error
    assert cache.put("k", ANSWER) is False and cache.pending == 1
    cache.close()
