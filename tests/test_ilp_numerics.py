"""The ILP's claims hold for the exact problem at every scale, on every backend (issue #12 item 1).

Random chains and DAGs get tensors at KiB, MiB and GPU scale (64 MiB to 4 GiB, budgets in the tens of
GB; odd byte counts, so no common unit makes the model byte-exact). The exhaustive oracle enumerates every
plan (keep, recompute, recompute_each); the budgets are the trade-off points of its frontier (the peaks where the optimal step time drops)
and one byte below each. At each: the ILP returns a plan exactly when one exists, never a plan faster
than the optimum, ``optimal`` only at the optimum, and a lower bound that is one. Byte-exact
coefficients of GPU tensors once made CP-SAT and CBC claim false optima, bounds and infeasibility.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memplan.planner.core.errors import Infeasible
from memplan.planner.core.graph import Graph
from memplan.planner.core.simulator import simulate_actions
from memplan.planner.core.synthetic import fill_structural_grads, linear_chain, random_dag
from memplan.solvers import solve
from memplan.solvers.oracle import _plans

KiB, MiB, GiB = 2**10, 2**20, 2**30
SCALES = {"KiB": (1 * KiB, 64 * KiB), "MiB": (1 * MiB, 256 * MiB), "GPU": (64 * MiB, 4 * GiB)}
BACKENDS = ["cpsat", "cbc", "highs"]
REL = 1e-6


def scaled_graph(kind: str, n: int, seed: int, scale: str) -> Graph:
    """A chain or DAG of ``n`` ops whose tensors (and the input) have random odd sizes in ``scale``'s
    range; gradients follow the sizes."""
    rng = random.Random(seed)
    g = (linear_chain(n, time_s=[rng.uniform(0.2, 3.0) for _ in range(n)],
                      backward_time_s=[rng.uniform(0.2, 4.0) for _ in range(n)])
         if kind == "chain" else random_dag(n, seed=seed))
    lo, hi = SCALES[scale]
    d = g.model_dump()
    for t in d["tensors"]:
        t["bytes"] = rng.randint(lo, hi) | 1
    d["fixed"]["inputs_bytes"] = d["tensors"][0]["bytes"]
    d["fixed"]["params_bytes"] = rng.randint(lo, hi) * 3 + 1
    return fill_structural_grads(Graph.model_validate(d))


def frontier(g: Graph) -> list[tuple[int, float]]:
    """(peak, optimal time at budget = peak) at each trade-off point of the oracle's frontier over every
    action (recompute_each included: the ILP's space)."""
    scored = sorted((r.peak_bytes, r.time_s) for r in (simulate_actions(g, a, prefetch_at=p)
                                                        for a, p in _plans(g, False, "choose", per_use=True)))
    points: list[tuple[int, float]] = []
    for peak, time_s in scored:
        if not points or time_s < points[-1][1] * (1 - 1e-12):
            points.append((peak, time_s))
    return points


def check(g: Graph, budget: int, optimum_s: float | None, backend: str) -> None:
    try:
        r = solve(g, budget, "ilp", backend=backend, time_limit_s=30)
    except Infeasible as e:
        assert optimum_s is None, f"{backend}: 'infeasible' at {budget} B, where a plan takes {optimum_s} s ({e})"
        return
    assert optimum_s is not None, f"{backend}: a plan at {budget} B, below the exact minimum peak"
    assert r.report.peak_bytes <= budget
    assert r.report.time_s >= optimum_s * (1 - REL), f"{backend} beat the oracle"
    if r.lower_bound_s is not None:
        assert r.lower_bound_s <= optimum_s * (1 + REL), f"{backend}: bound {r.lower_bound_s} over {optimum_s}"
    if r.status == "optimal":
        assert r.report.time_s == pytest.approx(optimum_s, rel=REL), f"{backend} claims optimal"
    # the model leaves no plan out on graphs this small: it must also find the optimum and prove it
    assert r.status == "optimal" and r.report.time_s == pytest.approx(optimum_s, rel=REL), \
        f"{backend}: {r.status} at {r.report.time_s} s, optimum {optimum_s} s (stats {r.stats})"


cases = st.tuples(st.sampled_from(["chain", "dag"]), st.integers(3, 7), st.integers(0, 10_000),
                  st.integers(0, 50), st.booleans())


@pytest.mark.parametrize("scale", list(SCALES))
@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases)
def test_claims_hold_at_and_below_every_trade_off_point(backend, scale, case):
    kind, n, seed, pick, below = case
    g = scaled_graph(kind, n, seed, scale)
    points = frontier(g)
    k = pick % len(points)
    peak, optimum_s = points[k]
    if below:  # one byte below a trade-off point: the previous point's optimum, or no plan at all
        check(g, peak - 1, points[k - 1][1] if k > 0 else None, backend)
    else:
        check(g, peak, optimum_s, backend)


# graphs on which byte-exact coefficients gave false claims (CP-SAT: a plan called optimal up to 2.3% over
# the optimum; CBC: "infeasible" where plans exist, false optima), checked at every point
GPU_CASES = [("chain", 7, 0), ("chain", 7, 2), ("chain", 6, 4), ("dag", 7, 3)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("kind", "n", "seed"), GPU_CASES)
def test_gpu_scale_every_trade_off_point(backend, kind, n, seed):
    g = scaled_graph(kind, n, seed, "GPU")
    points = frontier(g)
    assert points[-1][0] > 10 * GiB  # budgets in the tens of GB
    for k, (peak, optimum_s) in enumerate(points):
        check(g, peak, optimum_s, backend)
        check(g, peak - 1, points[k - 1][1] if k > 0 else None, backend)


# ---- the full-graph retention-interval model (large graphs) -------------------------------------------
def _rows_hold(im, actions) -> tuple[bool, float]:
    """Whether the plan ``actions`` satisfies every row of the interval model (each replay indicator at
    its least value), and the model's time for it."""
    m = im.model
    x = [0] * len(m.lb)
    for u, v in im.r.items():
        x[v] = int(u in actions)
    for terms, lo, hi in m.rows:  # y[p] - r[u] >= 0: set y[p] when u is recomputed
        if lo == 0 and hi is None and len(terms) == 2 and sorted(terms.values()) == [-1, 1]:
            (y,) = [v for v, c in terms.items() if c == 1]
            (r,) = [v for v, c in terms.items() if c == -1]
            x[y] |= x[r]
    ok = all((lo is None or sum(c * x[v] for v, c in terms.items()) >= lo)
             and (hi is None or sum(c * x[v] for v, c in terms.items()) <= hi) for terms, lo, hi in m.rows)
    return ok, im.time_s(sum(c * x[v] for v, c in m.objective.items()))


@pytest.mark.parametrize("scale", list(SCALES))
@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases)
def test_interval_model_is_a_relaxation(scale, case):
    """Every plan that fits the budget in the simulator satisfies the interval model's rows, at a model
    time no higher than its simulated time: so the model's bound and 'infeasible' hold."""
    from memplan.solvers.ilp.config import Config
    from memplan.solvers.ilp.intervals import build_intervals
    from memplan.solvers.ilp.linear import ConstantlyViolated

    kind, n, seed, pick, below = case
    g = scaled_graph(kind, n, seed, scale)
    points = frontier(g)
    budget = points[pick % len(points)][0] - int(below)
    try:
        im = build_intervals(g, budget, Config())
    except ConstantlyViolated:
        assert budget < points[0][0], "a plan fits, yet the model calls a row constantly violated"
        return
    for actions, prefetch in _plans(g, False, "choose"):
        rep = simulate_actions(g, actions, prefetch_at=prefetch)
        if rep.peak_bytes > budget:
            continue
        ok, model_s = _rows_hold(im, actions)
        assert ok, f"a plan peaking at {rep.peak_bytes} <= {budget} B violates the interval model"
        assert model_s <= rep.time_s * (1 + 1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", ["KiB", "GPU"])
@settings(max_examples=4, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases)
def test_interval_formulation_claims_hold(backend, scale, case):
    kind, n, seed, pick, below = case
    g = scaled_graph(kind, n, seed, scale)
    points = frontier(g)
    k = pick % len(points)
    budget, optimum_s = (points[k][0] - 1, points[k - 1][1] if k else None) if below else points[k]
    try:
        r = solve(g, budget, "ilp", backend=backend, formulation="intervals", time_limit_s=20)
    except Infeasible as e:
        # a miss is allowed (the relaxation's plans may all be over budget), a false claim is not: the
        # error must name a feasible minimum when a keep / recompute plan exists, and otherwise one only
        # a recompute_each plan reaches (outside the ILP's space; never below the exact minimum of all)
        if optimum_s is not None:
            assert e.min_feasible_bytes <= budget, str(e)
        elif e.min_feasible_bytes <= budget:
            per_use = min(simulate_actions(g, a, prefetch_at=p).peak_bytes for a, p in _plans(g, False, "choose", True))
            assert per_use <= e.min_feasible_bytes, str(e)
        return
    assert optimum_s is not None and r.report.peak_bytes <= budget
    assert r.report.time_s >= optimum_s * (1 - REL)
    if r.lower_bound_s is not None:
        assert r.lower_bound_s <= optimum_s * (1 + REL)
    if r.status == "optimal":
        assert r.report.time_s == pytest.approx(optimum_s, rel=REL)


# ---- offload: the copy-stream clock's big-M rows (HiGHS once mis-solved them at MiB scale) -------------
def offload_frontier(g: Graph) -> list[tuple[int, float]]:
    scored = sorted((r.peak_bytes, r.time_s) for r in (simulate_actions(g, a, prefetch_at=p)
                                                        for a, p in _plans(g, True, "choose")))
    points: list[tuple[int, float]] = []
    for peak, time_s in scored:
        if not points or time_s < points[-1][1] * (1 - 1e-12):
            points.append((peak, time_s))
    return points


@pytest.mark.parametrize("scale", list(SCALES))
@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.tuples(st.sampled_from(["chain", "dag"]), st.integers(3, 4), st.integers(0, 10_000),
                      st.integers(0, 50), st.booleans()))
def test_offload_claims_hold(backend, scale, case):
    kind, n, seed, pick, below = case
    g = scaled_graph(kind, n, seed, scale)
    if scale == "GPU":
        g.host_bandwidth_bytes_per_s = 12e9  # a PCIe-class link: copies of GiB tensors take ~0.1 s
        g.invalidate()
    points = offload_frontier(g)
    k = pick % len(points)
    budget, optimum_s = (points[k][0] - 1, points[k - 1][1] if k else None) if below else points[k]
    try:
        r = solve(g, budget, "ilp", backend=backend, offload=True, time_limit_s=20)
    except Infeasible as e:
        assert optimum_s is None, f"{backend}: 'infeasible' where a plan takes {optimum_s} s ({e})"
        return
    assert optimum_s is not None and r.report.peak_bytes <= budget
    assert r.report.time_s >= optimum_s * (1 - REL), f"{backend} beat the oracle"
    if r.lower_bound_s is not None:
        assert r.lower_bound_s <= optimum_s * (1 + REL)
    if r.status == "optimal":
        assert r.report.time_s == pytest.approx(optimum_s, rel=REL), f"{backend} claims optimal"


# ---- in-place chains: scratch copies (replay.reads_mid_chain) ------------------------------------------
# (seed, budget) of synthetic.inplace_dag(8 + seed % 8, chain_prob=0.5, skip_prob=0.5) where the model
# once mis-counted a replayed op that reads a tensor mid-chain: it rebuilt the tensor in full and kept it
# to its own backward (the simulator re-creates a private copy, freed after the reader), so a plan of the
# oracle's peak was over budget in the model (seed 127: "optimal" and a bound 4% over the optimum); and it
# left out what the copy's producer reads (seed 230: a tensor the simulator rebuilds there, and keeps, was
# charged again later: the model over-priced the optimum, "optimal" 0.2% over it)
SCRATCH_CASES = [(127, 245), (230, 203)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("seed", "budget"), SCRATCH_CASES)
def test_scratch_copies_are_counted(backend, seed, budget):
    from memplan.planner.core.replay import reads_mid_chain
    from memplan.planner.core.synthetic import inplace_dag

    g = inplace_dag(8 + seed % 8, seed=seed, chain_prob=0.5, skip_prob=0.5)
    assert any(reads_mid_chain(g, op.id, v) for op in g.ops for v in op.inputs)
    optimum_s = min(r.time_s for r in (simulate_actions(g, a, prefetch_at=p) for a, p in _plans(g, False, "choose"))
                    if r.peak_bytes <= budget)
    check(g, budget, optimum_s, backend)
