"""``every-k`` honours its time limit: past it, it simulates no further k and answers with the best plan it
has (status ``timeout``), or says that its search was cut when none of the k it tried fits."""

from __future__ import annotations

import time

import pytest

from memplan.planner.core.errors import Infeasible
from memplan.planner.core.simulator import simulate
from memplan.planner.core.synthetic import linear_chain
from memplan.solvers import every_k, solve
from memplan.solvers.bounds import memory_lower_bound

SIM_S = 0.05  # each of every-k's simulations made this slow, so that the limit falls inside the search


@pytest.fixture
def slow_simulations(monkeypatch):
    """Counts every-k's simulations and makes each take ``SIM_S`` more."""
    calls = []
    real = every_k._simulate

    def slow(graph, actions):
        calls.append(len(actions))
        time.sleep(SIM_S)
        return real(graph, actions)

    monkeypatch.setattr(every_k, "_simulate", slow)
    return calls


def test_without_a_limit_in_the_way_it_tries_many_k(slow_simulations):
    g = linear_chain(60)
    r = solve(g, simulate(g).peak_bytes, "every-k", time_limit_s=60)
    assert r.status == "feasible" and len(slow_simulations) > 10  # what the limit below cuts short


def test_past_its_time_limit_it_answers_with_the_best_plan_so_far(slow_simulations):
    g = linear_chain(60)
    budget = simulate(g).peak_bytes  # every k fits: the search would go on to the largest
    t0 = time.perf_counter()
    r = solve(g, budget, "every-k", time_limit_s=3.5 * SIM_S)
    took_s = time.perf_counter() - t0
    assert r.status == "timeout" and r.report.peak_bytes <= budget
    assert len(slow_simulations) <= 5  # the limit's worth, and one more at most
    assert took_s < 20 * SIM_S + 1.0


def test_when_no_k_tried_in_time_fits_it_says_the_search_was_cut(slow_simulations):
    g = linear_chain(60)
    budget = memory_lower_bound(g)  # past the solve's own check: every-k runs, and no plan of it fits
    with pytest.raises(Infeasible, match=r"solver 'every-k' found no plan within its time limit of 0.01 s"):
        solve(g, budget, "every-k", time_limit_s=0.01)
    assert len(slow_simulations) <= 2
