"""One table of behaviour that every registered solver must show, proved against the exhaustive oracle.

Each registered method (whatever modules are present: heuristics, dp, ilp, ...) is run on the same small
random chains and DAGs. Whatever it returns must fit the budget in the simulator and must not be faster
than the oracle's optimum (a faster plan would mean the solver and the simulator disagree on the cost
model); a plan marked ``optimal`` must equal the optimum. Bad requests get a clear error.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from memplan.planner.core.errors import Infeasible, MemplanError
from memplan.planner.core.plan import Action, Plan
from memplan.planner.core.simulator import simulate, simulate_actions
from memplan.planner.core.synthetic import gpu_scale, inplace_dag, linear_chain, random_dag
from memplan.solvers import (
    Proposal,
    SolverSpec,
    keep_all_report,
    smallest_known_peak,
    solve,
    solve_frontier,
    solvers,
)
from memplan.solvers.oracle import oracle_min_peak

REGISTRY = solvers()
# the oracle is the reference; "manual" needs the user's list (tested on its own below)
METHODS = sorted(n for n in REGISTRY if n not in ("oracle", "manual"))
REL = 1e-9


def _graph(kind: str, n: int, seed: int):
    if kind == "chain":
        import random

        rng = random.Random(seed)
        return linear_chain(n, time_s=[rng.uniform(0.2, 3.0) for _ in range(n)],
                            backward_time_s=[rng.uniform(0.2, 4.0) for _ in range(n)],
                            activation_bytes=[rng.randint(8, 256) for _ in range(n)])
    if kind == "inplace":  # in-place chains: replays with scratch copies
        return inplace_dag(n + 3, seed=seed, chain_prob=0.5, skip_prob=0.5)
    return random_dag(n, seed=seed)


def _budget(graph, frac: float, offload: bool = False) -> int:
    lo = oracle_min_peak(graph, offload=offload)
    hi = keep_all_report(graph).peak_bytes
    return lo + int(frac * (hi - lo))


def _oracle(graph, budget, offload=False, per_use=False):
    return solve(graph, budget, "oracle", offload=offload, per_use=per_use)



cases = st.tuples(st.sampled_from(["chain", "dag"]), st.integers(3, 8), st.integers(0, 10_000),
                  st.floats(0.0, 1.0))


@pytest.mark.parametrize("method", METHODS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases)
def test_fits_and_never_beats_the_oracle(method, case):
    kind, n, seed, frac = case
    g = _graph(kind, n, seed)
    budget = _budget(g, frac)
    best = _oracle(g, budget)  # the budget is >= the exact minimum peak: the oracle always has a plan
    try:
        r = solve(g, budget, method, time_limit_s=10)
    except Infeasible as e:
        # a heuristic may miss a plan, but it must say what is achievable, and an exact one must not miss
        assert not (REGISTRY[method].exact and REGISTRY[method].graphs == "dag"), f"{method}: {e}"
        assert e.min_feasible_bytes is not None and e.min_feasible_bytes <= budget
        return
    assert r.report.peak_bytes <= budget
    assert simulate(g, r.plan).peak_bytes == r.report.peak_bytes  # the plan file says what was solved
    # a plan with recompute_each is outside the plain oracle's space: the oracle with it bounds that one
    floor = _oracle(g, budget, per_use=True) if r.plan.count(Action.RECOMPUTE_EACH) else best
    assert r.report.time_s >= floor.report.time_s * (1 - REL), f"{method} beat the oracle: model inconsistent"
    if r.status == "optimal" and not r.plan.count(Action.RECOMPUTE_EACH):
        assert r.report.time_s == pytest.approx(best.report.time_s, rel=1e-6), f"{method} claims optimal"


def _offload_optimum(graph, frac):
    """A budget ``frac`` of the way from the exact minimum peak (offload and prefetch points included) to
    keep-all's, and the oracle's optimal time there, from one enumeration of the plans."""
    from memplan.solvers.oracle import _plans

    scored = [simulate_actions(graph, a, prefetch_at=p) for a, p in _plans(graph, True, "choose")]
    lo, hi = min(r.peak_bytes for r in scored), keep_all_report(graph).peak_bytes
    budget = lo + int(frac * (hi - lo))
    return budget, min(r.time_s for r in scored if r.peak_bytes <= budget)


@pytest.mark.parametrize("method", [m for m in METHODS if REGISTRY[m].offload])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases)
# CP-SAT 9.15's inclusion presolve proved 9.600 s "optimal" here, where the oracle has 8.975 s
# (google/or-tools#5293; the backend now turns that presolve off)
@example(case=("dag", 5, 2013, 0.0))
def test_offload_plans_fit_and_never_beat_the_oracle(method, case):
    kind, n, seed, frac = case
    g = _graph(kind, min(n, 5), seed)  # the oracle enumerates actions x prefetch points
    budget, best_s = _offload_optimum(g, frac)
    try:
        r = solve(g, budget, method, offload=True, time_limit_s=10)
    except Infeasible:
        assert not REGISTRY[method].exact or REGISTRY[method].graphs != "dag"
        return
    assert r.report.peak_bytes <= budget
    # The oracle enumerates every prefetch point too. (This used to compare against the oracle's time
    # minus its exposed transfers, on the belief that a chosen prefetch point could only hide transfers;
    # a late prefetch point also holds less memory, which can spare a recomputation, so the ILP beat that
    # "floor" with a plan the oracle could not express. The oracle was incomplete, not the ILP.)
    assert r.report.time_s >= best_s * (1 - REL), f"{method} beat the oracle: model inconsistent"
    if r.status == "optimal":
        assert r.report.time_s == pytest.approx(best_s, rel=1e-6), f"{method} claims optimal"


@pytest.mark.parametrize("method", METHODS + ["oracle"])
def test_budget_below_the_minimum_names_the_minimum(method):
    g = random_dag(7, seed=3)
    floor = oracle_min_peak(g, per_use=True)  # the least peak of any plan, recompute_each included
    with pytest.raises(Infeasible) as info:
        solve(g, floor - 1, method)
    e = info.value
    assert e.min_feasible_bytes == floor
    assert "minimum feasible budget" in str(e) and f"{floor} B" in str(e)


@pytest.mark.parametrize("method", METHODS + ["oracle"])
def test_no_budget_and_ample_budget_keep_everything(method):
    g = linear_chain(6, activation_bytes=[10, 200, 30, 400, 50, 60])
    base = keep_all_report(g)
    for budget in (None, base.peak_bytes, 10 * base.peak_bytes):
        r = solve(g, budget, method)
        assert r.report.time_s == pytest.approx(base.time_s), f"{method} pays for memory it was given"
        assert r.report.peak_bytes <= (budget or base.peak_bytes)


@pytest.mark.parametrize("method", METHODS)
def test_plan_round_trips_through_its_file(method, tmp_path):
    g = random_dag(8, seed=11)
    budget = _budget(g, 0.5)
    try:
        r = solve(g, budget, method)
    except Infeasible:
        pytest.skip(f"{method} finds no plan for this graph at this budget (allowed for a heuristic)")
    path = tmp_path / "plan.json"
    r.plan.save(str(path))
    loaded = Plan.load(str(path))
    # auto names the strategy whose plan it returns, and records that auto was asked
    assert method in (loaded.solver.name, loaded.solver.settings.get("requested")) and loaded.budget_bytes == budget
    assert simulate(g, loaded).peak_bytes == r.report.peak_bytes
    assert loaded.predicted.peak_bytes == r.report.peak_bytes


def test_unknown_method_lists_the_known_ones():
    with pytest.raises(MemplanError, match=r"unknown solver 'magic'; known: .*oracle"):
        solve(linear_chain(3), None, "magic")


@pytest.mark.parametrize("bad", [-1, 1.5, "1GiB"])
def test_bad_budget_is_refused(bad):
    with pytest.raises(MemplanError, match="budget must be a non-negative number of bytes"):
        solve(linear_chain(3), bad, "oracle")


@pytest.mark.parametrize("bad", [0, -2, float("nan"), float("inf")])
def test_bad_time_limit_is_refused(bad):
    with pytest.raises(MemplanError, match="time limit must be a positive number"):
        solve(linear_chain(3), None, "oracle", time_limit_s=bad)


def test_offload_on_a_solver_without_it_is_refused():
    no_offload = [m for m in METHODS if not REGISTRY[m].offload]
    if not no_offload:
        pytest.skip("every registered solver plans offload")
    with pytest.raises(MemplanError, match=rf"solver '{no_offload[0]}' does not plan offload; use one of"):
        solve(linear_chain(3), None, no_offload[0], offload=True)


def test_oracle_refuses_large_graphs():
    with pytest.raises(MemplanError, match="handles at most 14 saved activations; this graph has 30"):
        solve(linear_chain(30), None, "oracle")


def test_auto_picks_a_registered_method_and_fits():
    for g in (linear_chain(6), random_dag(30, seed=1), linear_chain(300)):
        budget = (keep_all_report(g).peak_bytes + g.fixed.resident_bytes) // 2
        try:
            r = solve(g, budget, "auto")
        except Infeasible as e:
            assert e.min_feasible_bytes > budget
            continue
        # "min-memory": auto's documented last fallback (the least-peak plan memplan finds)
        assert r.plan.solver.name in {*REGISTRY, "min-memory"} and r.report.peak_bytes <= budget


def test_frontier_is_monotone_for_exact_methods():
    g = random_dag(8, seed=5)
    lo, hi = oracle_min_peak(g), keep_all_report(g).peak_bytes
    budgets = [lo - 1] + [lo + (hi - lo) * k // 4 for k in range(5)]
    pts = solve_frontier(g, budgets, "oracle")
    assert pts[0] == (lo - 1, None)
    overheads = [ov for _, ov in pts[1:]]
    assert all(a >= b - 1e-12 for a, b in zip(overheads, overheads[1:], strict=False))
    assert overheads[-1] == pytest.approx(0.0)


def test_manual_plan_from_module_names():
    if "manual" not in REGISTRY:
        pytest.skip("heuristics not installed")
    g = linear_chain(6)
    r = solve(g, None, "manual", checkpoint=["layers.2", "layers.3"])
    recomputed = {d.tensor for d in r.plan.decisions if d.action == Action.RECOMPUTE}
    # linear_chain: op i saves its input (produced by op i-1); checkpointing modules 2 and 3 means their
    # outputs (tensors 3 and 4) are recomputed in backward
    assert recomputed == {3, 4}
    assert r.report.recompute_time_s > 0
    with pytest.raises(MemplanError, match="layers.9"):
        solve(g, None, "manual", checkpoint=["layers.9"])


def test_solvers_never_choose_recompute_for_what_cannot_be_recomputed():
    g = random_dag(8, seed=2)
    for t in g.saved_activations[::2]:
        g.tensors[t].recomputable = False
    g.invalidate()
    budget = _budget(g, 0.3)
    for method in METHODS:
        try:
            r = solve(g, budget, method)
        except Infeasible:
            continue
        bad = [d.tensor for d in r.plan.decisions
               if d.action == Action.RECOMPUTE and not g.tensors[d.tensor].recomputable]
        assert not bad, f"{method} recomputes non-recomputable tensors {bad}"
        assert simulate_actions(g, {d.tensor: d.action for d in r.plan.decisions}).peak_bytes <= budget


def test_auto_falls_back_when_its_method_misses_a_plan_memplan_knows(monkeypatch):
    from memplan.solvers import auto, registry

    def always_fails(graph, budget_bytes, **_):
        return Proposal(status="infeasible")

    monkeypatch.setitem(registry._REGISTRY, "always-fails",
                        SolverSpec("always-fails", always_fails, "test: finds nothing", "dag", False, False, None))
    monkeypatch.setattr(auto, "choose_method", lambda graph, offload=False: "always-fails")
    g = random_dag(10, seed=3)
    budget = smallest_known_peak(g)  # a plan exists at exactly this budget
    with pytest.raises(Infeasible):
        solve(g, budget, "always-fails")
    r = solve(g, budget, "auto")
    assert r.report.peak_bytes <= budget
    assert r.stats["fallback_from"] == "always-fails" and r.plan.solver.settings["requested"] == "auto"
    assert r.plan.solver.name in ("greedy", "multilevel", "min-memory")
    with pytest.raises(Infeasible) as e:  # below the exact minimum (10 saved: the oracle knows it)
        solve(g, budget - 1, "auto")
    assert e.value.min_feasible_bytes == budget


def test_auto_on_a_large_graph_keeps_the_fastest_of_dp_and_the_heuristics(monkeypatch):
    from memplan.solvers import auto

    monkeypatch.setattr(auto, "choose_method", lambda graph, offload=False: "dp")  # as past the ILP's size
    g = random_dag(40, seed=2, max_bytes=800)
    budget = smallest_known_peak(g) + (keep_all_report(g).peak_bytes - smallest_known_peak(g)) // 2
    r = solve(g, budget, "auto")
    tried = r.stats["portfolio_s"]
    assert set(tried) >= {"dp", "greedy", "capuchin"} and r.plan.solver.name in tried
    assert r.report.time_s == pytest.approx(min(tried.values()))
    for name, t in tried.items():
        assert t == pytest.approx(solve(g, budget, name).report.time_s)


def test_auto_is_bounded_by_its_time_limit_as_a_whole(monkeypatch):
    """auto's limit bounds all it runs: a first strategy that uses its whole share and finds nothing, and
    fallbacks that each use whatever limit they get, end within the limit (plus one simulation), and
    the refusal says the search was cut (before, each got the whole limit: 31 s for 10 s on a 1,000-op GPU-scale
    chain)."""
    import time

    from memplan.solvers import auto, registry

    def slow(name):
        def run(graph, budget_bytes, *, time_limit_s, **_):
            time.sleep(time_limit_s)  # uses all it is given
            return Proposal(status="infeasible", stats={"stopped": "time limit"})
        return SolverSpec(name, run, "test: slow, finds nothing", "dag", False, False, None)

    def least_peak_plan(graph, *, time_limit_s, **_):
        time.sleep(time_limit_s)
        return {}, {}  # keep-everything: over the budget

    for name in ("slow-first", "greedy", "multilevel"):
        monkeypatch.setitem(registry._REGISTRY, name, slow(name))
    monkeypatch.setattr(auto, "choose_method", lambda graph, offload=False: "slow-first")
    monkeypatch.setattr(auto, "min_memory_actions", least_peak_plan)
    g = linear_chain(30)
    t0 = time.perf_counter()
    # the refusal names the time limit: "within its time limit of 2 s" where nothing was left to quote a
    # peak, else the least peak its quote found with "... or a longer time limit"
    with pytest.raises(Infeasible, match="time limit"):
        solve(g, keep_all_report(g).peak_bytes // 2, "auto", time_limit_s=2.0)
    assert time.perf_counter() - t0 < 2.0 + 1.0


@pytest.mark.parametrize("bad", [2**50 + 1, 2**63])
def test_budget_beyond_any_device_is_refused(bad):
    with pytest.raises(MemplanError, match=r"budget .* beyond any device"):
        solve(linear_chain(3), bad, "greedy")
    with pytest.raises(MemplanError, match=r"host budget .* beyond any device"):
        solve(linear_chain(3), None, "greedy", offload=True, host_budget_bytes=bad)


def test_the_least_peak_search_stops_at_its_deadline():
    """``smallest_known_peak(deadline=...)``: past the deadline it starts nothing but keep-everything's
    simulation (achievable, not the least); with time, the exact least; Infeasible says which it was."""
    import time

    g = linear_chain(8)
    assert smallest_known_peak(g, deadline=time.perf_counter() - 1) == keep_all_report(g).peak_bytes == 1000
    assert smallest_known_peak(g, deadline=time.perf_counter() + 60) == smallest_known_peak(g) == 400  # recompute_each reaches it
    big = linear_chain(2000)  # the search takes ~60 s undisturbed
    t0 = time.perf_counter()
    least = smallest_known_peak(big, deadline=t0 + 0.5)
    assert time.perf_counter() - t0 < 0.5 + 3.0  # at most one simulation past it (~1 s on a loaded machine)
    assert least <= keep_all_report(big).peak_bytes
    with pytest.raises(Infeasible, match="the search for it stopped at the time limit of 0.2 s"):
        solve(big, 0, time_limit_s=0.2)
    with pytest.raises(Infeasible, match=r"minimum feasible budget memplan knows is 400 B \(fixed memory alone is "
                                         r"100 B\)$"):
        solve(g, 0)


@pytest.mark.parametrize("budget", [0, 1])
def test_a_budget_below_the_lower_bound_is_refused_fast_whatever_the_time_limit(budget):
    """Issue #22: a budget below the lower bound is proven infeasible before any strategy runs, so the search
    for the least peak to quote gets QUOTE_SEARCH_S, not the time limit (on a 2,000-op chain it ran for the
    whole 60 s): the refusal names the budget, an achievable peak and why the search stopped."""
    import time

    from memplan.solvers.core import QUOTE_SEARCH_S

    big = linear_chain(2000)
    t0 = time.perf_counter()
    with pytest.raises(Infeasible) as info:
        solve(big, budget, "auto", time_limit_s=60.0)
    assert time.perf_counter() - t0 < QUOTE_SEARCH_S + 2.0  # one simulation past it at most (~0.2 s here)
    e = info.value
    assert e.budget_bytes == budget and 100 < e.min_feasible_bytes <= keep_all_report(big).peak_bytes
    assert f"no plan fits budget {budget} B for graph 'chain'" in str(e)
    assert str(e).endswith(f"the search for it stopped after {QUOTE_SEARCH_S:g} s, as budgets below the lower "
                           f"bound 400 B are refused at once: a budget near it gets the whole time limit")


def test_the_least_peak_search_keeps_what_it_scored_before_its_deadline(monkeypatch):
    """min_memory_actions: a start scored before the deadline counts after it. Once only keep-everything did,
    so a search whose last start ran past the deadline quoted keep-everything's (or recompute-everything's)
    peak although its segmentations, simulated in time, went far lower (GPT-2: 3.44 GiB for 2.31 GiB)."""
    import time

    from memplan.solvers import min_memory

    g = linear_chain(40)
    deadline = time.perf_counter() + 0.5

    def every_k_past_the_deadline(graph, budget, *, deadline=None):
        time.sleep(max(0.0, deadline - time.perf_counter()) + 0.05)
        return None, {}

    monkeypatch.setattr(min_memory, "every_k_search", every_k_past_the_deadline)
    scores = min_memory.Scores(g)
    actions, _ = min_memory.min_memory_actions(g, deadline=deadline, scores=scores)
    assert time.perf_counter() > deadline
    assert scores(actions).peak_bytes < keep_all_report(g).peak_bytes / 2  # a segmentation's, not keep-all's


@pytest.mark.parametrize(("method", "steps", "budget"), [("greedy", 7, 500), ("greedy", 6, 500), ("capuchin", 6, 500)])
def test_heuristics_rebuild_per_use_where_replays_leave_too_much_behind(method, steps, budget):
    """On a recurrent-like in-place chain, recomputing states makes each backward replay leave the states
    it passes behind (checkpointing's rule); greedy and Capuchin then rebuild some per use
    (``recompute_each``) and reach a lower simulated peak than their recompute-only loop, at or below
    the least peak of any keep / recompute plan."""
    import time

    from memplan.planner.core.synthetic import inplace_chain
    from memplan.solvers.capuchin import pick_capuchin
    from memplan.solvers.evict import graph_facts, shrink
    from memplan.solvers.greedy import pick_dtr

    g = inplace_chain(steps)
    pick = {"greedy": pick_dtr, "capuchin": pick_capuchin}[method]
    without = shrink(g, budget, graph_facts(g), pick, offload=False, host_budget_bytes=None,
                     deadline=time.perf_counter() + 10)
    assert without.report.peak_bytes > budget  # the recompute-only loop gets stuck above the budget
    r = solve(g, budget, method)
    assert r.plan.count(Action.RECOMPUTE_EACH) > 0
    assert simulate(g, r.plan).peak_bytes == r.report.peak_bytes <= budget < without.lowest[0]
    assert budget <= oracle_min_peak(g)  # (7 steps: below every keep / recompute plan's peak)
    best = _oracle(g, budget, per_use=True)
    assert r.report.time_s >= best.report.time_s * (1 - REL)


GiB = 2**30


@pytest.mark.parametrize("method", METHODS)
@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.tuples(st.sampled_from(["chain", "dag", "inplace"]), st.integers(3, 8), st.integers(0, 10_000),
                      st.floats(0.0, 1.0)))
def test_claims_hold_at_gpu_scale_against_the_oracle(method, case):
    """The table above at GPU byte scale, in-place DAGs included: every family's plan fits, never beats
    the oracle, and its ``optimal``, bound and ``infeasible`` hold."""
    kind, n, seed, frac = case
    g = gpu_scale(_graph(kind, n, seed), seed)
    budget = _budget(g, frac)
    best = _oracle(g, budget)
    try:
        r = solve(g, budget, method, time_limit_s=10)
    except Infeasible as e:
        assert not (REGISTRY[method].exact and REGISTRY[method].graphs == "dag"), f"{method}: {e}"
        assert e.min_feasible_bytes is not None and e.min_feasible_bytes <= budget, str(e)
        return
    assert simulate(g, r.plan).peak_bytes == r.report.peak_bytes <= budget
    per_use = r.plan.count(Action.RECOMPUTE_EACH)
    floor = _oracle(g, budget, per_use=True) if per_use else best
    assert r.report.time_s >= floor.report.time_s * (1 - REL), f"{method} beat the oracle"
    if r.lower_bound_s is not None and not per_use:
        assert r.lower_bound_s <= best.report.time_s * (1 + 1e-6), f"{method}: bound over the optimum"
    if r.status == "optimal" and not per_use:
        assert r.report.time_s == pytest.approx(best.report.time_s, rel=1e-6), f"{method} claims optimal"


def test_claims_hold_on_a_1000_op_gpu_scale_chain():
    """1,000 ops, tensors of 64 MiB to 4 GiB, a budget of about a hundred GB: the exact chain DP's ``optimal`` and
    bound hold against the heuristics' simulated plans, every plan fits in the simulator, and a baseline
    that finds nothing does not call the budget infeasible when its search for a floor was cut short
    (it once said "no plan fits" and quoted a floor above the greedy plan's peak)."""
    from memplan.solvers.bounds import memory_lower_bound

    g = gpu_scale(linear_chain(1000), 0)
    lo, hi = memory_lower_bound(g), keep_all_report(g).peak_bytes
    budget = lo + (hi - lo) // 20
    assert 10 * GiB < budget < 200 * GiB  # (keep-everything: 2 TiB)
    plans = {m: solve(g, budget, m, time_limit_s=30) for m in ("greedy", "capuchin", "dp")}
    for m, r in plans.items():
        assert simulate(g, r.plan).peak_bytes == r.report.peak_bytes <= budget, m
    dp = plans["dp"]
    fastest = min(r.report.time_s for r in plans.values())
    if dp.status == "optimal":
        assert dp.report.time_s <= fastest * (1 + 1e-9)
    if dp.lower_bound_s is not None:
        assert dp.lower_bound_s <= fastest * (1 + 1e-9)
    with pytest.raises(Infeasible) as err:  # sqrt(n) equal segments hold more than the budget here
        solve(g, budget, "chen", time_limit_s=1)
    e = err.value
    assert e.min_feasible_bytes is not None
    assert e.min_feasible_bytes <= budget or "no plan fits" not in str(e), str(e)


def test_an_oracle_cut_short_does_not_call_the_budget_infeasible():
    """The first plan the oracle tries is keep-everything; stopped right after it, below that peak, it
    has tried too little to say that no plan fits (it used to return ``infeasible`` as a finding)."""
    from memplan.solvers.oracle import solve_oracle

    g = linear_chain(8)
    p = solve_oracle(g, 700, time_limit_s=1e-9)
    assert p.status == "infeasible" and p.stats["stopped"] == "time limit" and p.stats["plans_tried"] == 1
    with pytest.raises(Infeasible, match="found no plan within its time limit"):
        solve(g, 700, "oracle", time_limit_s=1e-9)


def test_a_strategy_that_finds_no_plan_does_not_call_a_budget_that_another_fits_infeasible():
    """Chen and every-k find nothing at a budget greedy fits, and the least-peak search (no proof on 13 saved
    activations) stops one byte above it: the refusal quotes the search's peak as that, not as the minimum
    (it called the budget infeasible and the peak the minimum; on an 80-layer Llama Capuchin fits 154 GiB
    where Chen's refusal quoted 262 GiB)."""
    from memplan.planner.core.synthetic import repeated_blocks
    from memplan.solvers import memory_lower_bound

    g = repeated_blocks(4, 4, seed=3)
    budget = memory_lower_bound(g) + int(0.2 * (keep_all_report(g).peak_bytes - memory_lower_bound(g)))
    assert solve(g, budget, "greedy").report.peak_bytes <= budget
    for method in ("chen", "every-k"):
        with pytest.raises(Infeasible) as info:
            solve(g, budget, method)
        e = info.value
        assert "no plan fits" not in str(e) and "minimum feasible" not in str(e)
        assert f"solver {method!r} found no plan within {budget} B; the least peak memplan's search reached is " \
               f"{e.min_feasible_bytes} B (this solver's own: " in str(e)
        assert str(e).endswith("not a proven minimum: a plan may still fit the budget (try auto)")
        assert e.min_feasible_bytes > budget  # achievable: the search's own plan


def test_below_every_keep_recompute_plan_the_solvers_find_the_per_use_plans_the_oracle_finds_atgpu_scale():
    """Random DAGs with long skips at GPU byte scale, at every budget (every distinct peak of the exhaustive
    oracle over keep / recompute / recompute_each) that only recompute_each plans reach. ``dp``'s stage
    search keeps or recomputes; where none of those fits it falls back to per-use plans (the multilevel
    family's, recompute_each-everything, and now the least-peak search's, each polished within the budget).
    Before the least-peak plan and the polishing it refused 7 of these 58 budgets and took up to 1.90x the
    optimum (measured 1 refusal, under the least peak its search finds, and at most 1.04x). Greedy and
    Capuchin evict at the peak and stopped above what multi-level replays reach: now, where
    recompute_each-everything fits, they return it polished (Capuchin refused 13 of the 58, now 7)."""
    import itertools

    from memplan.solvers.multilevel import per_use_everything

    ratios, refused = [], 0
    for seed in range(60):
        g = gpu_scale(random_dag(10, seed=seed, skip_prob=0.6), seed)
        saved = [t for t in g.saved_activations if g.tensors[t].recomputable]
        if len(saved) > 8:
            continue
        plans = []
        for combo in itertools.product([Action.KEEP, Action.RECOMPUTE, Action.RECOMPUTE_EACH], repeat=len(saved)):
            r = simulate_actions(g, {t: a for t, a in zip(saved, combo, strict=True) if a != Action.KEEP})
            plans.append((r.peak_bytes, r.time_s, Action.RECOMPUTE_EACH in combo))
        keep_recompute_floor = min(p for p, _, each in plans if not each)
        every = simulate_actions(g, per_use_everything(g)).peak_bytes
        for budget in sorted({p for p, _, _ in plans if p < keep_recompute_floor}):
            optimum = min(t for p, t, _ in plans if p <= budget)
            for method in ("greedy", "capuchin"):
                if every <= budget:
                    r = solve(g, budget, method, time_limit_s=5)
                    assert simulate(g, r.plan).peak_bytes == r.report.peak_bytes <= budget, method
                    assert r.report.time_s >= optimum * (1 - REL), method
            try:
                r = solve(g, budget, "dp", time_limit_s=5)
            except Infeasible as e:
                # only below the least peak memplan's own search finds: never "try another solver" beside a
                # plan it knows
                assert e.min_feasible_bytes > budget, str(e)
                refused += 1
                continue
            assert simulate(g, r.plan).peak_bytes == r.report.peak_bytes <= budget
            assert r.report.time_s >= optimum * (1 - REL)
            ratios.append(r.report.time_s / optimum)
    assert len(ratios) + refused >= 40
    assert refused <= len(ratios) // 10
    assert max(ratios) < 1.1
    assert sum(r <= 1 + 1e-9 for r in ratios) >= len(ratios) // 2


@pytest.mark.parametrize("frac", [0.3, 0.6])
def test_a_rounded_chain_dp_on_a_1000_op_gpu_scale_chain_is_near_the_heuristics_and_its_bound_holds(frac):
    """Where neither exact table fits (a 1,000-op chain at GPU scale, budgets far above its least peak), the
    chain DP rounds memory up to a unit. That unit was a 1,500th of keeping everything's spare (2.8 GB of
    tensors from 64 MiB): +24.9% at 30% where Capuchin found +14.9%. It is now as fine as the exact grid's
    cells allow (12 M: 0.35 GB here), and the exact Pareto attempt, which ran 4.7 s before proving too large,
    gets half the time left, and what the rounding left room for is kept again (``give_back``): within 1% of
    the heuristics (measured: faster than both), its rounded-down bound below every plan found."""
    from memplan.solvers.min_memory import least_peak

    g = gpu_scale(linear_chain(1000), 7)
    keep = keep_all_report(g)
    least, _ = least_peak(g, deadline=time.perf_counter() + 10)
    budget = least + int((keep.peak_bytes - least) * frac)
    plans = {m: solve(g, budget, m, time_limit_s=30) for m in ("greedy", "capuchin", "dp")}
    for m, r in plans.items():
        assert simulate(g, r.plan).peak_bytes == r.report.peak_bytes <= budget, m
    dp, fastest = plans["dp"], min(r.report.time_s for r in plans.values())
    assert dp.stats["engine"] == "grid" and not dp.stats["exact_memory"]
    assert dp.report.time_s <= min(plans["greedy"].report.time_s, plans["capuchin"].report.time_s) * 1.01
    assert dp.lower_bound_s is not None and dp.lower_bound_s <= fastest * (1 + 1e-9)
