"""solvers/multilevel.py and the recompute_each plan space on synthetic graphs: the cut points, the
two-level family's plans, and the exhaustive oracle with recompute_each (``per_use``) against the one
without it and against the multilevel solver. The recurrent cells themselves are in tests/test_inplace.py
(bitwise training, measured peak equal to the prediction) and benchmarks/inplace.py."""

from __future__ import annotations

import pytest

from memplan.planner.core.errors import Infeasible
from memplan.planner.core.plan import Action
from memplan.planner.core.simulator import simulate_actions
from memplan.planner.core.synthetic import linear_chain, random_dag
from memplan.solvers import keep_all_report, solve
from memplan.solvers.multilevel import cut_points, family_actions, per_use_everything
from memplan.solvers.oracle import oracle_min_peak, plan_count


def test_cut_points_of_a_chain_and_of_a_dag():
    # a uniform chain: every boundary is as narrow as the median, so each is a cut
    assert cut_points(linear_chain(6)) == [(1,), (2,), (3,), (4,), (5,)]
    # a DAG: only the waists at most half the median crossing
    assert cut_points(random_dag(8, seed=3)) == [(1,), (4,), (6,)]


def test_the_family_keeps_every_k0th_cut_leaves_every_k1th_and_recomputes_the_rest_per_use():
    g = linear_chain(8)
    cuts = cut_points(g)  # tensors 1..7
    n = len(cuts)
    actions = family_actions(g, cuts, (3, 2, Action.RECOMPUTE_EACH))
    # cuts 0, 3, 6 kept (tensors 1, 4, 7); cuts 2, 4 left behind by replays (tensors 3, 5)
    assert [t for t in g.saved_activations if t not in actions] == [1, 4, 7]
    assert {t for t, a in actions.items() if a == Action.RECOMPUTE} == {3, 5}
    assert {t for t, a in actions.items() if a == Action.RECOMPUTE_EACH} == {2, 6, 8}
    assert family_actions(g, cuts, (1, n + 1, Action.KEEP)) == {}
    assert family_actions(g, cuts, (n + 1, n + 1, Action.RECOMPUTE_EACH)) == per_use_everything(g)


@pytest.mark.parametrize("n", [4, 6, 7])
def test_recompute_each_goes_below_every_keep_recompute_plan_and_multilevel_finds_it(n):
    """On a chain, every keep / recompute plan keeps what its replays pass, so it peaks at two or more
    activations above the fixed memory; a recompute_each plan holds one replay's working set. The
    oracle over both spaces says so exactly; the multilevel solver reaches the per-use minimum, and the
    chain DP (which searches recompute_each too on chains this short, issue #25) returns the optimum there
    and refuses one byte less naming the recompute_each plan's peak."""
    g = linear_chain(n)
    floor, per_use = oracle_min_peak(g), oracle_min_peak(g, per_use=True)
    assert per_use < floor
    saved = len(g.saved_activations)
    assert plan_count(g) == 2 ** saved and plan_count(g, per_use=True) == 3 ** saved
    r = solve(g, per_use, "multilevel")
    assert r.report.peak_bytes <= per_use and r.plan.count(Action.RECOMPUTE_EACH)
    assert r.report.time_s > keep_all_report(g).time_s  # memory bought with compute
    dp = solve(g, per_use, "dp")
    assert dp.report.peak_bytes <= per_use and dp.plan.count(Action.RECOMPUTE_EACH)
    assert dp.status == "optimal" and dp.space == "all"  # its DP searches recompute_each on chains this short
    with pytest.raises(Infeasible) as info:
        solve(g, per_use - 1, "dp")
    assert info.value.min_feasible_bytes == simulate_actions(g, per_use_everything(g)).peak_bytes == per_use


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_multilevel_never_beats_the_per_use_oracle_and_fits(seed):
    g = random_dag(7, seed=seed)
    lo, hi = oracle_min_peak(g, per_use=True), keep_all_report(g).peak_bytes
    for budget in (lo, (lo + hi) // 2, hi):
        best = solve(g, budget, "oracle", per_use=True)
        try:
            r = solve(g, budget, "multilevel")
        except Infeasible:
            continue  # a heuristic may miss a plan
        assert r.report.peak_bytes <= budget
        assert r.report.time_s >= best.report.time_s * (1 - 1e-9)
    # the per-use oracle's plans are a superset: never worse than the plain oracle's
    assert solve(g, hi, "oracle", per_use=True).report.time_s <= solve(g, hi, "oracle").report.time_s
