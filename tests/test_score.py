"""The simulator in two pieces: ``schedule(graph, plan)`` takes every timing decision and emits events that
carry their cost; ``score(graph, schedule)`` sums the events and decides nothing; ``simulate`` is the two
in a row (planner/core/schedule.py, planner/core/simulator.py).

* On random chains and DAGs under random plans (keep, recompute, recompute_each, offload with and without
  prefetch points, tensors that cannot be rebuilt and so get pinned), scoring the plan's schedule gives
  exactly ``simulate``'s report, timeline included, and what a report says agrees with its events (the
  peak is the timeline's highest point, the times add up, every copy and replayed op is counted, host
  memory and device memory come back).
* The same for a plan of every registered solver family on a small profiled GPT-2 (the oracle on a
  small MLP), against the report the solver scored from its actions.
* Edited by hand, a schedule scores differently: score reads the events, not the plan.

The numbers themselves are worked out by hand in test_simulator.py.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Action, Plan
from memplan.planner.core.schedule import Schedule, schedule
from memplan.planner.core.simulator import Report, score, simulate
from memplan.planner.core.states import unit_grads
from memplan.planner.core.synthetic import linear_chain, random_dag

pytestmark = pytest.mark.usefixtures("one_thread")  # the profiled graphs below

# ---- what any report must say of its schedule --------------------------------------------------------------


def check_sums(graph: Graph, sched: Schedule, report: Report) -> None:
    """The report's figures against the schedule's events, whatever the plan."""
    events, tensors = sched.events, graph.tensors
    assert report.timeline, "needs the timeline"
    assert report.peak_bytes == max(e.peak_bytes for e in report.timeline)
    assert math.isclose(report.time_s, report.forward_time_s + report.backward_time_s + report.recompute_time_s
                        + report.exposed_transfer_s + report.optimizer_time_s + report.host_wait_s,
                        rel_tol=1e-9, abs_tol=1e-12)
    # an activation's copies move its bytes; a streamed state unit's (tensor None) the unit's state; a
    # host-stepped unit's its gradients (to the host) and parameters (back)
    assert report.transfer_bytes == sum(tensors[e.tensor].bytes if e.tensor is not None else e.copy_bytes
                                        for e in events if e.kind in ("d2h", "h2d"))
    assert all(e.copy_bytes == graph.state_units[e.at].state_bytes for e in events
               if e.kind in ("d2h", "h2d") and e.tensor is None and e.at in sched.streamed
               and e.phase == "optimizer")
    assert all(e.copy_bytes == graph.state_units[e.at].param_bytes for e in events
               if e.kind == "h2d" and e.tensor is None and e.at in sched.hosted)
    assert report.recomputed_ops == sum(len(e.ops) for e in sched.replays()) == len(sched.of("recompute"))
    assert report.watched_ops == sum(len(e.ops) for e in sched.of("watch"))
    # every host copy is given back at its tensor's last backward reader
    assert sum(e.host_bytes for e in events) == 0
    # every activation allocated (by forward, a replay or a prefetch) is freed, but what the caller holds:
    # the step ends with the fixed memory, the gradients backward leaves, and the held tensors
    held = sum(t.bytes for t in tensors if t.kind == "activation" and t.held_by_caller)
    grads = sum(op.backward_grad_alloc_bytes - op.backward_grad_free_bytes for op in graph.ops)
    grads -= sum(unit_grads(graph)[u].grad_bytes for u in sched.hosted)  # on the host by then
    # (streamed optimizer state starts and ends the step in the host pool)
    assert report.timeline[-1].live_bytes == graph.fixed.resident_bytes - sched.state_off_device_bytes + grads + held


def check_scores_as_simulate(graph: Graph, plan: Plan) -> Report:
    sched = schedule(graph, plan)
    report = score(graph, sched)
    assert report == simulate(graph, plan)
    without = score(graph, sched, timeline=False)
    assert without == report.model_copy(update={"timeline": []})
    check_sums(graph, sched, report)
    return report


# ---- random graphs, random plans ----------------------------------------------------------------------------


def random_graph(rng: random.Random) -> Graph:
    n = rng.randint(2, 24)
    if rng.random() < 0.5:
        g = linear_chain(n, time_s=[rng.uniform(0.1, 2.0) for _ in range(n)],
                         activation_bytes=[rng.randint(1, 300) for _ in range(n)])
    else:
        g = random_dag(n, seed=rng.randrange(1 << 30))
    g.host_bandwidth_bytes_per_s = rng.choice([10.0, 100.0, 1000.0, 1e9])  # copies exposed .. free
    g.replay_op_dispatch_s = rng.choice([0.0, 0.05])
    g.watch_op_dispatch_s = rng.choice([0.0, 0.01])
    for t in g.tensors:  # some cannot be rebuilt: replays that read them pin them
        if t.kind == "activation" and rng.random() < 0.1:
            t.recomputable = False
    return g.invalidate()


def random_plan(graph: Graph, rng: random.Random) -> Plan:
    actions: dict[int, Action] = {}
    prefetch_at: dict[int, int] = {}
    for t in graph.saved_activations:
        a = rng.choice(list(Action))
        if a.rebuilds and not graph.tensors[t].recomputable:
            a = Action.KEEP
        actions[t] = a
        if a == Action.OFFLOAD and rng.random() < 0.5:
            prefetch_at[t] = rng.randint(max(graph.savers[t]), len(graph.ops) - 1)
    return Plan.for_graph(graph, actions, prefetch_at)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1))
def test_score_of_the_schedule_is_simulate_on_random_plans(seed):
    rng = random.Random(seed)
    g = random_graph(rng)
    check_scores_as_simulate(g, random_plan(g, rng))


def test_the_random_plans_exercise_every_kind_of_event():
    """The property above sees pins, replays (with the prefetches they need), scheduled prefetches,
    exposed waits and the watch charge (so it cannot pass vacuously)."""
    seen: set[str] = set()
    for seed in range(200):
        rng = random.Random(seed)
        g = random_graph(rng)
        sched = schedule(g, random_plan(g, rng))
        seen.update(e.kind for e in sched.events)
        seen.update("exposed wait" for e in sched.of("wait") if e.duration_s > 0)
        seen.update("pin" for _ in sched.pins)
        seen.update(e.reason.split(":")[0] for e in sched.of("h2d"))
        seen.update("scratch" for e in sched.of("free") if e.reason.startswith("scratch"))
    assert {"compute", "d2h", "free", "h2d", "wait", "replay", "recompute", "backward", "watch", "optimizer",
            "exposed wait", "pin"} <= seen
    assert any(s.startswith("scheduled") for s in seen)


# ---- hand-edited schedules ----------------------------------------------------------------------------------


def _edited(sched: Schedule, events: list) -> Schedule:
    return Schedule(sched.graph_fingerprint, tuple(events), sched.prefetch_at, sched.pins)


def test_a_free_moved_later_raises_memory_until_it_comes():
    g = linear_chain(4)
    plan = Plan.for_graph(g, {1: "recompute", 2: "recompute"})
    sched = schedule(g, plan)
    before = score(g, sched)
    events = list(sched.events)
    # a1 is freed after op 1 (its last forward use); move that free to after op 3
    i = next(k for k, e in enumerate(events) if e.kind == "free" and e.tensor == 1)
    free = events.pop(i)
    j = next(k for k, e in enumerate(events) if e.kind == "compute" and e.at == 3)
    events.insert(j + 1, free._replace(at=3))
    after = score(g, _edited(sched, events))
    live = [e.live_bytes for e in before.timeline if e.phase == "forward"]
    assert live == [200, 200, 200, 300]
    assert [e.live_bytes for e in after.timeline if e.phase == "forward"] == [200, 300, 300, 300]
    assert after.peak_bytes == before.peak_bytes  # the peak is in backward (500), untouched
    assert simulate(g, plan) == before  # the plan is not what is scored
    # freed later still: after backward step 2, the peak, whose replay re-creates a1 beside it
    events = list(sched.events)
    free = events.pop(i)
    j = next(k for k, e in enumerate(events) if e.kind == "backward" and e.at == 2)
    events.insert(j + 1, free._replace(phase="backward", at=2))
    assert score(g, _edited(sched, events)).peak_bytes == before.peak_bytes + 100


def test_edited_durations_and_dropped_replays_change_the_time():
    g = linear_chain(4)
    g.host_bandwidth_bytes_per_s = 50.0  # 100 B take 2 s: the prefetch of a1 is exposed
    plan = Plan.for_graph(g, {1: "offload", 2: "recompute"}, prefetch_at={1: 1})
    sched = schedule(g, plan)
    before = score(g, sched)
    assert before.exposed_transfer_s > 0 and before.recomputed_ops == 1
    # the wait made free, and the replay of a2 dropped (with its op): time and counts follow
    events = [e._replace(duration_s=0.0) if e.kind == "wait" else e for e in sched.events
              if e.kind not in ("replay", "recompute")]
    after = score(g, _edited(sched, events))
    assert after.exposed_transfer_s == 0 and after.recomputed_ops == 0 and after.recompute_time_s == 0
    assert after.time_s == pytest.approx(before.time_s - before.exposed_transfer_s - before.recompute_time_s)
    assert not [e for e in after.timeline if e.phase in ("wait", "recompute")]


# ---- every solver family on a real graph --------------------------------------------------------------------


SLOW_SOLVERS = {"dp", "hierarchical"}  # about 3 s each on the tiny GPT-2 (their time limit is not theirs alone)
# these search until their time limit and return their best plan: 1 s; the others finish within a
# fraction of a second on an idle machine, and get 10 s so that a loaded one does not cut them short
SEARCH_UNTIL_LIMIT = {"ilp", "auto", "multilevel", "dp", "hierarchical"}


def _profiled(name: str, **size) -> Graph:
    from memplan.planner.probe.profiler import profile
    from memplan.planner.workloads import load_workload

    w = load_workload(name, **size)
    return profile(w.model, w.batch, w.loss_fn, name=name, device="cpu", progress=False, measure=False, repeats=1)


@pytest.fixture(scope="module")
def tiny_gpt2() -> Graph:
    return _profiled("gpt2", n_layer=2, n_embd=32, n_head=2, vocab_size=64, seq_len=32, batch_size=2)


def _solver_cases():
    from memplan.solvers import solvers

    out = []
    for name, spec in solvers().items():
        for offload in (False, True) if spec.offload else (False,):
            marks = [pytest.mark.slow] if name in SLOW_SOLVERS else []
            out.append(pytest.param(name, offload, marks=marks, id=f"{name}{'-offload' if offload else ''}"))
    return out


@pytest.mark.parametrize(("method", "offload"), _solver_cases())
def test_every_solver_family_scores_its_schedule_as_it_simulated_it(tiny_gpt2, method, offload):
    from memplan.solvers import keep_all_report, smallest_known_peak, solve

    g = tiny_gpt2
    if method == "oracle":  # exhaustive: a graph of few saved activations
        g = _profiled("mlp", depth=4, width=16, batch_size=512)
    options: dict = {}
    budget = None
    if method == "manual":
        options["checkpoint"] = ["transformer.h.0"]
    else:
        lo, hi = smallest_known_peak(g, offload=offload), keep_all_report(g).peak_bytes
        budget = lo + (hi - lo) // 3
    limit_s = 1.0 if method in SEARCH_UNTIL_LIMIT else 10.0
    result = solve(g, budget, method, offload=offload, time_limit_s=limit_s, **options)
    report = check_scores_as_simulate(g, result.plan)
    # the solver scored its actions (simulate_actions); the plan file's path gives the same report
    assert report.model_copy(update={"timeline": []}) == result.report.model_copy(update={"timeline": []})
    moved = {a for a in result.plan.actions().values() if a != Action.KEEP}
    assert moved, f"{method} moved nothing at {budget} B"


def test_a_gru_s_scratch_copies_are_scored_from_their_events():
    """A GRU cell's clones read its gates mid-chain: replays re-create scratch copies up to them, allocated
    by their recompute event and given back by a free of their own (the resident tensor stays)."""
    g = _profiled("rnn", cell="gru", steps=6, input_size=8, hidden_size=16, batch_size=4)
    scratch = 0
    for seed in range(20):
        plan = random_plan(g, random.Random(seed))
        check_scores_as_simulate(g, plan)
        scratch += len([e for e in schedule(g, plan).of("free") if e.reason.startswith("scratch")])
    assert scratch > 0


def test_a_schedule_lowered_for_another_graph_is_refused():
    from memplan.planner.core.errors import PlanMismatch

    sched = schedule(linear_chain(4))
    with pytest.raises(PlanMismatch, match="schedule was lowered for graph .* but this graph is"):
        score(linear_chain(5), sched)
