"""The REST service through its test client: status codes and exact error details, the plan cache, the
limits, and the worker pool's queue and timeout."""

import asyncio
import json
import threading
import time

import pytest
from fastapi.testclient import TestClient

from memplan.api import jobs
from memplan.api.app import create_app
from memplan.api.cache import PlanCache
from memplan.api.errors import Overloaded, SolveTimeout
from memplan.api.pool import WorkerPool
from memplan.api.schemas import FrontierResponse, PlanResponse, SimulationResponse
from memplan.api.settings import Settings
from memplan.planner.core.errors import MemplanError
from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Plan
from memplan.planner.core.simulator import simulate
from memplan.planner.core.synthetic import linear_chain
from memplan.solvers import keep_all_report, solve

CHAIN8 = linear_chain(8)  # keep-all peak 1000 B (100 B fixed), the smallest feasible peak is 600 B
FAST = Settings(pool="thread", workers=2, max_ops=50, max_time_limit_s=10.0, default_time_limit_s=5.0,
                max_body_bytes=64 * 1024, max_frontier_points=12)


def body(graph=CHAIN8, **kw):
    return {"graph": graph.model_dump(mode="json"), **kw}


@pytest.fixture(scope="module")
def client():
    with TestClient(create_app(FAST)) as c:
        yield c


# ---- plans --------------------------------------------------------------------------------------
def test_plan_fits_budget_and_simulates_to_its_prediction(client):
    r = client.post("/v1/plans", json=body(budget="60%", solver="oracle"))
    assert r.status_code == 200, r.text
    res = PlanResponse.model_validate(r.json())
    assert res.budget_bytes == 640  # 100 B fixed + 60% of the 900 B of activations
    assert res.solver.name == "oracle" and res.solver.status == "optimal" and res.solver.gap == 0.0
    # the oracle's default enumeration keeps or recomputes: its "optimal" says over which plans (issue #25)
    assert res.solver.space == "keep/recompute" == res.plan.solver.space
    assert res.plan.graph_fingerprint == CHAIN8.fingerprint == res.graph_fingerprint
    report = simulate(CHAIN8, res.plan)
    assert report.peak_bytes == res.predicted.peak_bytes <= 640
    assert report.time_s == pytest.approx(res.predicted.step_time_s)
    assert res.predicted.keep_all_peak_bytes == 1000 and res.predicted.keep_all_step_time_s == 24.0
    assert res.predicted.overhead == pytest.approx(report.time_s / 24.0 - 1.0)


@pytest.mark.parametrize("budget, expected_bytes", [(700, 700), ("700", 700), ("1KiB", 1024), ("100%", 1000)])
def test_budget_forms(client, budget, expected_bytes):
    r = client.post("/v1/plans", json=body(budget=budget, solver="oracle"))
    assert r.status_code == 200, r.text
    assert r.json()["budget_bytes"] == expected_bytes
    assert r.json()["predicted"]["peak_bytes"] <= expected_bytes


def test_budget_as_a_fraction(client):
    r = client.post("/v1/plans", json=body(budget_fraction=0.6, solver="oracle"))
    assert r.status_code == 200, r.text
    assert r.json()["budget_bytes"] == 640  # the same as "60%"
    assert r.json()["predicted"]["peak_bytes"] <= 640
    r = client.post("/v1/plans", json=body(budget="60%", budget_fraction=0.6))
    assert r.status_code == 422
    assert r.json() == {"detail": "budget and budget_fraction: give one of them, not both", "error": "invalid_request"}
    r = client.post("/v1/plans", json=body(budget_fraction=11))
    assert r.status_code == 422 and r.json()["field"] == "budget_fraction"


def test_identical_request_is_a_cache_hit_with_the_same_plan(client):
    req = body(budget=777, solver="oracle")
    first_raw = client.post("/v1/plans", json=req)
    second_raw = client.post("/v1/plans", json=req)
    # a hit serves the bytes validated when the plan was solved, the flag set: nothing is validated again
    assert second_raw.content == first_raw.content.replace(b'{"cache_hit":false,', b'{"cache_hit":true,', 1)
    first, second = first_raw.json(), second_raw.json()
    assert first["cache_hit"] is False and second["cache_hit"] is True
    PlanResponse.model_validate(second)  # and they are a PlanResponse
    assert {k: v for k, v in second.items() if k != "cache_hit"} == {k: v for k, v in first.items() if k != "cache_hit"}
    # another budget, solver setting or graph timing is another key
    assert client.post("/v1/plans", json=body(budget=778, solver="oracle")).json()["cache_hit"] is False
    assert client.post("/v1/plans", json={**req, "time_limit_s": 4.0}).json()["cache_hit"] is False
    slower = linear_chain(8, time_s=3.0)
    assert slower.fingerprint == CHAIN8.fingerprint  # the structural fingerprint ignores timings...
    r = client.post("/v1/plans", json=body(slower, budget=777, solver="oracle")).json()
    assert r["cache_hit"] is False  # ...the cache key does not
    assert r["predicted"]["keep_all_step_time_s"] == 40.0


def test_concurrent_identical_requests_share_one_solve(client):
    req = body(budget=801, solver="oracle")
    results = []

    def post():
        results.append(client.post("/v1/plans", json=req).json())

    threads = [threading.Thread(target=post) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # each answer is a cache hit or carries the one solve's own timing: one solve ran, not four
    solve_times = {r["solver"]["solve_time_s"] for r in results}
    assert len(solve_times) == 1


def test_infeasible_budget_names_the_minimum(client):
    r = client.post("/v1/plans", json=body(budget=10, solver="oracle"))
    assert r.status_code == 422
    assert r.json() == {
        # 400 B: every activation recompute_each (a keep / recompute plan needs 600 B)
        "detail": "no plan fits budget 10 B for graph 'chain'; the minimum feasible budget memplan knows is "
                  "400 B (fixed memory alone is 100 B)",
        "error": "infeasible", "budget_bytes": 10, "min_feasible_bytes": 400}


def test_bad_budget_and_unknown_solver_are_422(client):
    r = client.post("/v1/plans", json=body(budget="6 bananas"))
    assert r.status_code == 422 and r.json()["error"] == "invalid_request" and r.json()["field"] == "budget"
    assert r.json()["detail"].startswith("budget: cannot read '6 bananas' as a budget")
    r = client.post("/v1/plans", json=body(budget=-1))
    assert r.status_code == 422
    assert r.json()["detail"] == "budget: budget -1 is out of range: 0 to 2^50 bytes (1 PiB)"
    r = client.post("/v1/plans", json=body(solver="nope"))
    assert r.status_code == 422 and r.json()["detail"].startswith("solver: unknown solver 'nope'; known: auto, ")


# ---- model states --------------------------------------------------------------------------------
MiB = 1 << 20


def _chain_with_states() -> tuple[Graph, int]:
    """An 8-op chain at MiB scale holding four 64 MiB units of optimizer state (an AdamW's moments: twice
    the parameters), and a budget only streaming them fits: between the least peak with every unit
    streamed and the least peak of the activations alone."""
    from memplan.planner.core.graph import StateUnit
    from memplan.planner.core.states import states_search_graph, stream_order
    from memplan.solvers import smallest_known_peak

    g = linear_chain(8, activation_bytes=4 * MiB, input_bytes=4 * MiB, time_s=1e-3, backward_time_s=2e-3)
    g.state_units = [StateUnit(module=f"layers.{i}", params=2, param_bytes=32 * MiB, state_bytes=64 * MiB,
                               state_tensors=4) for i in range(4)]
    g.fixed.params_bytes, g.fixed.optimizer_state_bytes, g.fixed.optimizer_step_bytes = 128 * MiB, 256 * MiB, 64 * MiB
    g.optimizer_time_s = 0.05
    g = g.invalidate()
    every_streamed = keep_all_report(states_search_graph(g, stream_order(g))).peak_bytes
    activations_only = smallest_known_peak(g, offload=True)
    assert every_streamed < activations_only
    return g, (every_streamed + activations_only) // 2


def test_states_moves_model_states_alone_or_with_offload(client):
    """``states`` without ``offload`` moves model states alone (no activation offloaded); absent, it follows
    ``offload``: without it a budget only streaming fits is infeasible, with it the units are streamed."""
    g, budget = _chain_with_states()
    r = client.post("/v1/plans", json=body(g, budget=budget, solver="greedy", states="stream"))
    assert r.status_code == 200, r.text
    res = PlanResponse.model_validate(r.json())
    assert res.plan.streamed() and res.plan.count("offload") == 0 and res.predicted.peak_bytes <= budget
    assert res.state_summary.streamed_units == len(res.plan.streamed()) and res.state_summary.hosted_units == 0
    assert res.state_summary.streamed_state_bytes == 64 * MiB * len(res.plan.streamed())
    r = client.post("/v1/plans", json=body(g, budget=budget, solver="greedy"))
    assert r.status_code == 422 and r.json()["error"] == "infeasible", r.text
    r = client.post("/v1/plans", json=body(g, budget=budget, solver="greedy", offload=True))
    assert r.status_code == 200 and r.json()["state_summary"]["streamed_units"] > 0, r.text


def test_states_on_the_frontier(client):
    """A frontier point only a placement of model states fits has an overhead with ``states``, none without."""
    g, budget = _chain_with_states()
    keep_all = keep_all_report(g).peak_bytes

    def overheads(**kw):
        r = client.post("/v1/frontier", json=body(g, budgets=[budget, keep_all], solvers=["greedy"], **kw))
        assert r.status_code == 200, r.text
        return [p["overhead"] for p in r.json()["series"][0]["points"]]

    moved = overheads(states="stream")
    assert moved[0] is not None and moved[0] > 0 and moved[1] == 0.0
    assert overheads() == overheads(states="none") == [None, 0.0]
    r = client.post("/v1/frontier", json=body(g, budgets=[budget], states="disk"))
    assert r.status_code == 422 and r.json()["field"] == "states"


def test_states_that_cannot_be_honoured_are_422(client):
    """An unknown placement names the field; a placement with forward fusion (for which the solver places
    no model states) is refused rather than planned without them, on plans and on maxbatch."""
    r = client.post("/v1/plans", json=body(budget="60%", states="everywhere"))
    assert r.status_code == 422 and r.json() == {
        "detail": "states: Input should be 'auto', 'stream', 'host' or 'none'", "error": "invalid_request",
        "field": "states"}
    r = client.post("/v1/plans", json=body(budget="60%", states=True))
    assert r.status_code == 422 and r.json()["field"] == "states"
    forward = ("states 'host' with fuse 'forward': model states are placed for unfused or backward-fused steps "
               "only; give fuse 'backward', no fuse, or states 'none'")
    r = client.post("/v1/plans", json=body(budget="60%", states="host", fuse="forward"))
    assert r.status_code == 422 and r.json() == {"detail": forward, "error": "invalid_request"}
    assert client.post("/v1/plans", json=body(budget="60%", states="none", fuse="forward")).status_code == 200
    family = {"graph": _chain_family().model_dump(mode="json"), "budget": 4000, "max_value": 8, "time_limit_s": 1.0}
    r = client.post("/v1/maxbatch", json={**family, "states": "host", "fuse": "forward"})
    assert r.status_code == 422 and r.json()["detail"] == forward
    r = client.post("/v1/maxbatch", json={**family, "states": "up"})
    assert r.status_code == 422 and r.json()["field"] == "states"
    r = client.post("/v1/maxbatch", json={**family, "states": "stream"})
    assert r.status_code == 200, r.text
    assert r.json()["state_summary"]["state_units"] == 0  # a chain without units: nothing to place


def _chain_family() -> Graph:
    """A shape family over ``batch`` of chains (as tests/test_e2e_service.py's)."""
    from memplan.planner.core.shapes import fit_family

    def at(b: int) -> Graph:
        return linear_chain(6, activation_bytes=[100 * b, 300 * b, 50 * b, 200 * b, 100 * b, 10 * b],
                            input_bytes=100 * b, time_s=[1.0, 3.0, 1.0, 2.0, 1.0, 1.0])
    return fit_family([({"batch": 8}, at(8)), ({"batch": 6}, at(6)), ({"batch": 4}, at(4))])


# ---- malformed input -----------------------------------------------------------------------------
def _graph_dict(**edits):
    g = CHAIN8.model_dump(mode="json")
    for path, value in edits.items():
        *head, last = path.split("__")
        node = g
        for k in head:
            node = node[int(k)] if k.isdigit() else node[k]
        node[int(last) if last.isdigit() else last] = value
    return g


@pytest.mark.parametrize("edits, detail, field", [
    ({"ops__3__time_s": -1.0}, "graph: ops.3.time_s: Input should be greater than or equal to 0", "graph.ops.3.time_s"),
    ({"tensors__2__bytes": "lots"}, "graph: tensors.2.bytes: Input should be a valid integer", "graph.tensors.2.bytes"),
    ({"ops__3__inputs": [99]}, "graph: dangling edge: op 3 (synthetic.layer) inputs names tensor 99, but the graph "
                               "has 9 tensors", "graph"),
    ({"format": "memplan.graph/9"}, "graph: format: unknown graph format version 'memplan.graph/9'; this memplan "
                                    "reads 'memplan.graph/1'", "graph.format"),
])
def test_malformed_graph_is_422_naming_the_field(client, edits, detail, field):
    r = client.post("/v1/plans", json={"graph": _graph_dict(**edits)})
    assert r.status_code == 422
    assert r.json() == {"detail": detail, "error": "graph_error", "field": field}


def test_graph_messages_are_memplans_own(client):
    """The service words a bad graph as ``Graph.from_dict`` (the CLI's loader) does."""
    g = _graph_dict(ops__3__inputs=[99])
    with pytest.raises(MemplanError) as e:
        Graph.from_dict(g, source="graph")
    assert client.post("/v1/simulate", json={"graph": g}).json()["detail"] == str(e.value)


def test_unreadable_bodies(client):
    r = client.post("/v1/plans", content=b'{"graph": ', headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["detail"].startswith("request body is not valid JSON")
    r = client.post("/v1/plans", json={})
    assert r.status_code == 422 and r.json() == {"detail": "graph: Field required", "error": "graph_error",
                                                 "field": "graph"}
    r = client.post("/v1/plans", json={**body(), "colour": "red"})
    assert r.status_code == 422 and r.json()["field"] == "colour"


def test_overflowing_times_are_refused_not_crashed(client):
    g = _graph_dict(ops__0__time_s=1e308, ops__1__time_s=1e308)
    r = client.post("/v1/plans", json={"graph": g})
    assert r.status_code == 422 and r.json()["error"] == "graph_error"
    assert "too large to add up" in r.json()["detail"]


# ---- limits --------------------------------------------------------------------------------------
def test_body_over_the_cap_is_413_naming_the_limit(client):
    big = json.dumps({**body(), "padding": "x" * 70_000}).encode()
    r = client.post("/v1/plans", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert r.json() == {"detail": f"request body is {len(big)} bytes; this server accepts at most 65536 bytes "
                                  "(max_body_bytes)", "error": "limit_exceeded", "limit": "max_body_bytes",
                        "limit_value": 65536}


def test_chunked_body_over_the_cap_is_413(client):
    def chunks():
        yield b'{"graph": {"name": "'
        for _ in range(100):
            yield b"x" * 1000
        yield b'"}}'

    r = client.post("/v1/plans", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["limit"] == "max_body_bytes"


def test_node_cap_is_422_naming_the_limit(client):
    r = client.post("/v1/plans", json=body(linear_chain(60)))
    assert r.status_code == 422
    assert r.json() == {"detail": "graph has 60 ops; this server plans graphs of at most 50 ops (max_ops)",
                        "error": "limit_exceeded", "limit": "max_ops", "limit_value": 50}


def test_time_limit_cap_is_422_naming_the_limit(client):
    r = client.post("/v1/plans", json=body(time_limit_s=11))
    assert r.status_code == 422
    assert r.json() == {"detail": "time_limit_s 11 s is over this server's cap of 10 s (max_time_limit_s)",
                        "error": "limit_exceeded", "limit": "max_time_limit_s", "limit_value": 10.0}
    r = client.post("/v1/frontier", json=body(budgets=["60%", "80%"], solvers=["oracle"], time_limit_s=6))
    assert r.status_code == 422 and r.json()["limit"] == "max_time_limit_s"
    assert r.json()["detail"].startswith("2 solves of time_limit_s 6 s (12 s) is over")


# ---- simulate ------------------------------------------------------------------------------------
def test_simulate_keep_all_and_timeline_only_when_asked(client):
    r = client.post("/v1/simulate", json=body())
    assert r.status_code == 200
    res = SimulationResponse.model_validate(r.json())
    assert (res.peak_bytes, res.time_s, res.timeline) == (1000, 24.0, None)
    r = client.post("/v1/simulate", json=body(timeline=True)).json()
    assert [e["phase"] for e in r["timeline"]][:2] == ["start", "forward"]
    assert max(e["peak_bytes"] for e in r["timeline"]) == 1000


def test_simulate_a_plan_and_a_mismatched_plan(client):
    plan = Plan.for_graph(CHAIN8, {1: "recompute", 3: "recompute"})
    r = client.post("/v1/simulate", json=body(plan=plan.model_dump(mode="json")))
    assert r.status_code == 200 and r.json()["peak_bytes"] == simulate(CHAIN8, plan).peak_bytes
    other = linear_chain(9)
    r = client.post("/v1/simulate", json=body(other, plan=plan.model_dump(mode="json")))
    assert r.status_code == 422
    assert r.json() == {"detail": f"plan was made for graph {CHAIN8.fingerprint}, but this graph is "
                                  f"{other.fingerprint} (chain): re-solve for this graph", "error": "plan_mismatch"}
    bad = Plan.for_graph(CHAIN8, {}).model_dump(mode="json")
    bad["decisions"][0]["tensor"] = 0  # the input: not a saved activation
    r = client.post("/v1/simulate", json=body(plan=bad))
    assert r.status_code == 422 and r.json()["error"] == "plan_error"


# ---- frontier, solvers, health, docs ---------------------------------------------------------------
def test_frontier_per_solver(client):
    r = client.post("/v1/frontier", json=body(budgets=["50%", "60%", "100%", 2000], solvers=["oracle", "greedy"]))
    assert r.status_code == 200, r.text
    res = FrontierResponse.model_validate(r.json())
    assert [s.solver for s in res.series] == ["oracle", "greedy"]
    oracle = res.series[0].points
    assert [p.budget_bytes for p in oracle] == [550, 640, 1000, 2000]
    assert oracle[0].overhead is None  # below the 600 B minimum
    assert oracle[1].overhead == pytest.approx(1 / 6) and oracle[2].overhead == 0.0 == oracle[3].overhead
    # no heuristic beats the exhaustive oracle; below its keep / recompute minimum greedy may fit with
    # recompute_each, which the oracle with per_use covers
    for o, g in zip(oracle, res.series[1].points, strict=True):
        if g.overhead is not None and o.overhead is None:
            per_use = solve(CHAIN8, g.budget_bytes, "oracle", per_use=True)
            assert g.overhead >= per_use.report.time_s / keep_all_report(CHAIN8).time_s - 1 - 1e-9
            continue
        assert g.overhead is None or g.overhead >= o.overhead - 1e-9


def test_frontier_point_cap(client):
    r = client.post("/v1/frontier", json=body(budgets=[f"{p}%" for p in range(30, 100, 10)], solvers=["oracle", "greedy"]))
    assert r.status_code == 422
    assert r.json()["detail"] == ("7 budgets x 2 solvers = 14 solves; this server computes at most 12 per "
                                  "request (max_frontier_points)")


def test_solvers_health_and_docs(client):
    solvers = {s["name"]: s for s in client.get("/v1/solvers").json()["solvers"]}
    assert solvers["oracle"]["exact"] is True and solvers["oracle"]["max_saved_activations"] == 14
    h = client.get("/healthz").json()
    assert h["status"] == "ok" and h["pool"] == "thread" and h["workers"] == 2 and h["busy"] == 0
    assert client.get("/docs").status_code == 200
    spec = client.get("/openapi.json").json()
    assert {"/v1/plans", "/v1/simulate", "/v1/frontier", "/v1/solvers", "/healthz"} <= set(spec["paths"])
    assert "413" in spec["paths"]["/v1/plans"]["post"]["responses"]


def test_unexpected_errors_are_500_without_internals_and_logged(monkeypatch, caplog):
    def broken(*a, **kw):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(jobs, "plan_job", broken)
    # Starlette answers the 500 and then re-raises for the server to log; a real server does not raise
    # into its client, so neither may this one.
    with TestClient(create_app(FAST), raise_server_exceptions=False) as c, caplog.at_level("ERROR", "memplan.api"):
        r = c.post("/v1/plans", json=body(budget=999, solver="oracle"))
        assert r.status_code == 500
        assert r.json() == {"detail": "internal error (RuntimeError); it has been logged", "error": "internal_error"}
        assert "secret" not in r.text
        assert c.get("/healthz").status_code == 200  # the server carries on
    logged = [rec for rec in caplog.records if rec.name == "memplan.api"]
    assert [rec.getMessage() for rec in logged] == ["unhandled error on POST /v1/plans"]
    assert "secret internals" in str(logged[0].exc_info[1])  # the internals go to the log, with the traceback


# ---- the cache on disk ----------------------------------------------------------------------------
def test_cache_file_survives_a_restart(tmp_path):
    path = str(tmp_path / "plans.sqlite")
    settings = Settings(pool="thread", workers=1, cache_path=path)
    with TestClient(create_app(settings)) as c:
        assert c.post("/v1/plans", json=body(budget="70%", solver="oracle")).json()["cache_hit"] is False
    with TestClient(create_app(settings)) as c:
        assert c.post("/v1/plans", json=body(budget="70%", solver="oracle")).json()["cache_hit"] is True
    assert len(PlanCache(path)) == 1


# ---- the worker pool -------------------------------------------------------------------------------
def test_pool_queue_limit_and_timeout():
    async def scenario():
        pool = WorkerPool("thread", workers=1, max_queue=0)
        await pool.start()
        try:
            slow = asyncio.ensure_future(pool.run(time.sleep, 0.5, timeout_s=0.1))
            await asyncio.sleep(0.05)
            assert pool.busy == 1
            with pytest.raises(Overloaded):  # the one worker is busy and no request may wait
                await pool.run(time.sleep, 0, timeout_s=1)
            with pytest.raises(SolveTimeout):
                await slow
            assert pool.busy == 1  # the job keeps its worker until it returns...
            await asyncio.sleep(0.6)
            assert pool.busy == 0  # ...and then hands it back
            assert await pool.run(sum, [1, 2], timeout_s=1) == 3
        finally:
            pool.close()

    asyncio.run(scenario())


@pytest.mark.slow
def test_pool_stops_overruns_and_replaces_dead_workers():
    """A worker killed under a job (out of memory, a native crash) fails that job alone (503); a job past
    its time is stopped at once and its worker replaced; a job past the memory cap is an
    ``OutOfMemory`` naming the limit. After each, the pool answers the next job."""
    import os

    from memplan.api.errors import OutOfMemory, WorkerLost

    async def scenario():
        pool = WorkerPool("process", workers=1, max_queue=4, memory_bytes=2**30, spare=True)
        await pool.start()
        try:
            with pytest.raises(WorkerLost, match="the worker process running this request died"):
                await pool.run(os._exit, 3, timeout_s=30)
            assert pool.busy == 0
            assert await pool.run(sum, [1, 2], timeout_s=30) == 3
            t0 = time.perf_counter()
            with pytest.raises(SolveTimeout, match="was stopped"):
                await pool.run(time.sleep, 60, timeout_s=0.5)
            assert time.perf_counter() - t0 < 2.0  # answered at its limit, not after the job's 60 s
            assert await pool.run(sum, [3, 4], timeout_s=30) == 7  # on the spare (or a new process)
            with pytest.raises(OutOfMemory) as e:
                await pool.run(bytearray, 2 * 2**30, timeout_s=30)
            assert e.value.limit == "worker_memory_bytes"
            assert await pool.run(sum, [5, 6], timeout_s=30) == 11
            assert pool.replaced == 3
        finally:
            pool.close()

    asyncio.run(scenario())


def test_pool_queue_wait_is_bounded():
    async def scenario():
        pool = WorkerPool("thread", workers=1, max_queue=4, queue_timeout_s=0.2)
        await pool.start()
        try:
            slow = asyncio.ensure_future(pool.run(time.sleep, 0.6, timeout_s=5))
            await asyncio.sleep(0.05)
            t0 = time.perf_counter()
            with pytest.raises(Overloaded, match="stayed busy for 0.2 s"):
                await pool.run(sum, [1], timeout_s=5)
            assert 0.15 < time.perf_counter() - t0 < 0.5
            await slow
        finally:
            pool.close()

    asyncio.run(scenario())


# ---- the plan cache heals itself and stays within its size ------------------------------------------
@pytest.mark.parametrize("damage", ["garbage", "half", "header"])
def test_a_damaged_cache_file_is_moved_aside_and_started_afresh(tmp_path, damage, caplog):
    path = tmp_path / "plans.sqlite"
    cache = PlanCache(str(path))
    cache.put("k", {"graph_fingerprint": "f", "solver": {"name": "x", "status": "optimal"}, "pad": "x" * 5000})
    cache.close()
    good = path.read_bytes()
    broken = {"garbage": b"not a database" * 500, "half": good[: len(good) // 2],
              "header": b"\0" * 100 + good[100:]}[damage]
    path.write_bytes(broken)
    for side in ("-wal", "-shm"):
        (tmp_path / f"plans.sqlite{side}").unlink(missing_ok=True)
    with caplog.at_level("WARNING", "memplan.api"):
        healed = PlanCache(str(path))
    assert len(healed) == 0
    assert healed.put("k2", {"graph_fingerprint": "f", "solver": {"name": "x", "status": "optimal"}})
    assert [p.read_bytes() for p in tmp_path.glob("plans.sqlite.corrupt-*")] == [broken]
    assert "moved it to" in caplog.text


def test_an_unusable_cache_path_is_one_line():
    from memplan.api.cache import CacheError

    with pytest.raises(CacheError, match="cannot create the plan cache's folder /proc/nope"):
        PlanCache("/proc/nope/plans.sqlite")


def test_settings_from_env():
    s = Settings.from_env({"MEMPLAN_MAX_OPS": "77", "MEMPLAN_POOL": "thread", "MEMPLAN_GRACE_S": "1.5"}, workers=3)
    assert (s.max_ops, s.pool, s.grace_s, s.workers) == (77, "thread", 1.5, 3)
    with pytest.raises(MemplanError, match="MEMPLAN_MAX_OPS='many' is not a int"):
        Settings.from_env({"MEMPLAN_MAX_OPS": "many"})
    with pytest.raises(MemplanError, match="workers must be >= 1"):
        Settings(workers=0)


def test_repeated_bytes_are_answered_without_reading_them_again(monkeypatch):
    """The same request bytes again are answered from the cache without a parse worker; other bytes for
    the same plan are read, then a hit too; a remembered body whose answer left the cache is solved."""
    from memplan.api import service as service_module  # where bodies are read (Service.read_body)

    with TestClient(create_app(FAST)) as c:
        raw = json.dumps(body(budget=700, solver="oracle")).encode()
        headers = {"content-type": "application/json"}
        first = c.post("/v1/plans", content=raw, headers=headers)
        assert first.status_code == 200 and first.json()["cache_hit"] is False

        def unreachable(*a, **kw):
            raise AssertionError("read again")

        with monkeypatch.context() as m:
            m.setattr(service_module, "read_request", unreachable)
            again = c.post("/v1/plans", content=raw, headers=headers)
        assert again.status_code == 200 and again.json() == {**first.json(), "cache_hit": True}
        spaced = c.post("/v1/plans", content=json.dumps(json.loads(raw), indent=2).encode(), headers=headers)
        assert spaced.json() == again.json()
        c.app.state.service.cache.clear()
        assert c.post("/v1/plans", content=raw, headers=headers).json()["cache_hit"] is False


def test_token_and_allowed_hosts():
    settings = Settings(pool="thread", workers=1, token="t0k", allowed_hosts="localhost")
    with TestClient(create_app(settings), base_url="http://localhost") as c:
        assert c.get("/healthz").status_code == 200
        r = c.get("/v1/solvers")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json() == {"detail": "this server requires a token: send 'Authorization: Bearer <token>'",
                            "error": "unauthorized"}
        ok = {"Authorization": "Bearer t0k"}
        assert c.get("/v1/solvers", headers=ok).status_code == 200
        spec = c.get("/openapi.json", headers=ok).json()
        assert spec["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
        assert spec["paths"]["/v1/plans"]["post"]["security"] == [{"bearer": []}]
        assert "security" not in spec["paths"]["/healthz"]["get"]
        assert c.get("/healthz", headers={"Host": "evil.example"}).status_code == 400
    assert Settings().hosts_for("127.0.0.1") == ["127.0.0.1", "localhost", "::1", "[::1]"]
    assert Settings().hosts_for("0.0.0.0") == ["*"]
    assert Settings(allowed_hosts="a.example, b.example").hosts_for("127.0.0.1") == ["a.example", "b.example"]
