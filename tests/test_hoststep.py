"""Host-stepped model states (planner/core/states.py, executor/hoststep.py, solvers/states.py): a unit's
gradients leave the device as backward completes them, the host runs its optimizer, the updated parameters
come back.

* the executor on a real model (GPT-2), on a CPU and under the CUDA emulation (copies land only when waited
  for): training bitwise equal to plain training (the same optimizer on CPU tensors), the measured peak at the
  prediction, far below plain training's; the copies and frees performed where the schedule puts them;
* gradient clipping with ``torch.nn.utils.clip_grad_norm_`` equals plain training's; gradient accumulation is
  refused in one line; a checkpoint saved under the plan loads without it; weights loaded into the model
  after ``apply`` are the ones the host steps;
* the search: the search graph never under-counts a host-stepped placement; ``states="host"`` /
  ``"stream"`` restrict the ways, and ``auto`` is at least as fast as either;
* with backward fusion: the moved units are updated at ``optimizer.step()`` (streamed or on the host), the
  others inside backward; bitwise plain training at the predicted peak, and ``solve(fuse="backward")``
  searches the placements for that step;
* the plan file: the placement round-trips, and a graph without a host rate refuses it in one line.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_executor import TINY
from test_states import _adamw, weighty

from memplan.executor import apply
from memplan.planner import simulate
from memplan.planner.core.errors import PlanError
from memplan.planner.core.plan import Plan
from memplan.planner.core.schedule import schedule
from memplan.planner.core.states import states_search_graph, stream_order
from memplan.planner.probe.device import emulate_cuda, is_host_buffer
from memplan.planner.probe.measure import measure_step
from memplan.planner.probe.profiler import profile
from memplan.planner.workloads import load_workload
from memplan.solvers import keep_all_report, solve

pytestmark = pytest.mark.usefixtures("one_thread")


def _train(w, g, plan, steps=3, clip=None, between=None, clip_value=None, fuse=None):
    model = copy.deepcopy(w.model)
    opt = _adamw(model)
    ex = apply(model, plan, graph=g, optimizer=opt, fuse=fuse) if plan is not None else None
    logs = []
    for i in range(steps):
        torch.manual_seed(i)
        opt.zero_grad(set_to_none=True)
        w.loss_fn(model, w.batch).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
        opt.step()
        if between is not None:
            between(model, i)
        if ex is not None:
            logs.append([e.key() for e in ex.last_step.events if e.tensor is None and e.kind in ("h2d", "d2h", "free")])
    peak = measure_step(model, w.batch, w.loss_fn, opt, steps=1, warmup=1).peak_bytes
    state = copy.deepcopy(opt.state_dict())
    if ex is not None:
        assert any(is_host_buffer(t) for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))
        ex.remove()
        assert not any(is_host_buffer(t) for s in opt.state.values() for t in s.values()
                       if isinstance(t, torch.Tensor))
    return [p.detach().clone() for p in model.parameters()], peak, state, logs


def _same(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True)), "parameters differ"
    assert sorted(a[2]["state"]) == sorted(b[2]["state"])
    for key, sa in a[2]["state"].items():
        sb = b[2]["state"][key]
        assert sorted(sa) == sorted(sb) and all(torch.equal(sa[k], sb[k]) for k in sa), f"state of {key} differs"


def _hosted(g, units=None):
    return Plan.keep_all(g).with_states(g, [], stream_order(g) if units is None else units)


def test_host_stepped_training_is_bitwise_plain_at_its_predicted_peak_and_schedule():
    w, g = weighty("gpt2")
    assert g.host_optimizer_bytes_per_s and len(g.fused_backward) == len(g.state_units)
    plan = _hosted(g)
    report = simulate(g, plan)
    assert report.host_optimizer_time_s > 0 and report.host_peak_bytes > 0
    plain = _train(w, g, None)
    planned = _train(w, g, plan)
    _same(planned, plain)
    # the gradients leave during backward: a third of plain training's peak here
    assert 0 <= report.peak_bytes - planned[1] <= 1e-4 * report.peak_bytes
    assert planned[1] < plain[1] / 2
    want = [k for k in schedule(g, plan).executed() if k[2] is None and k[0] in ("h2d", "d2h", "free")]
    assert sum(k[0] == "d2h" for k in want) == len(g.state_units)
    assert planned[3][1:] == [want] * 2  # the first step creates the state on the host: the same copies


def test_host_stepped_training_under_the_cuda_emulation():
    """The copies land only when waited for, their destinations poisoned until then: a host step that read
    its gradients before their copy, or a forward that read parameters before theirs came back, would train
    NaNs. The peak is the allocator's rounded count."""
    with emulate_cuda():
        w = load_workload("gpt2", **TINY["gpt2"])
        g = profile(copy.deepcopy(w.model), w.batch, w.loss_fn, device="cuda", progress=False, measure=False,
                    repeats=1)
        plan = _hosted(g)
        plain = _train(w, g, None)
        planned = _train(w, g, plan)
    _same(planned, plain)
    report = simulate(g, plan)
    assert 0 <= report.peak_bytes - planned[1] <= 1e-3 * report.peak_bytes
    assert planned[1] < plain[1]


def test_clipping_works_and_accumulation_and_loss_scaling_are_refused_in_one_line():
    w, g = weighty("gpt2")
    plan = _hosted(g)
    _same(_train(w, g, plan, clip=0.05), _train(w, g, None, clip=0.05))
    _same(_train(w, g, plan, clip_value=1e-4, steps=2), _train(w, g, None, clip_value=1e-4, steps=2))
    model = copy.deepcopy(w.model)
    opt = _adamw(model)
    ex = apply(model, plan, graph=g, optimizer=opt)
    try:
        w.loss_fn(model, w.batch).backward()
        with pytest.raises(PlanError, match="gradient accumulation") as e:
            w.loss_fn(model, w.batch).backward()
        assert "\n" not in str(e.value)
        opt.zero_grad()  # a loop that drops the batch: the next step is a clean one
        w.loss_fn(model, w.batch).backward()
        opt.step()
        scaler = torch.amp.GradScaler("cpu")
        with pytest.raises(Exception, match="GradScaler") as e:
            scaler.scale(w.loss_fn(model, w.batch))
        assert "\n" not in str(e.value)
    finally:
        ex.remove()


def test_checkpoints_and_weights_loaded_after_apply():
    """A checkpoint saved under the plan loads into plain training (and back); weights loaded into the model
    between steps are those the host steps next (its copy is refreshed where a parameter's version moved)."""
    w, g = weighty("gpt2")
    plan = _hosted(g)
    other = copy.deepcopy(w.model)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)

    def reload(model, i):
        if i == 0:
            model.load_state_dict(other.state_dict())

    _same(_train(w, g, plan, between=reload), _train(w, g, None, between=reload))
    planned = _train(w, g, plan, steps=2)
    model = copy.deepcopy(w.model)
    opt = _adamw(model)
    opt.load_state_dict(planned[2])
    ex = apply(model, plan, graph=g, optimizer=opt)
    try:
        assert all(is_host_buffer(opt.state[p]["exp_avg"]) for p in model.parameters() if p in opt.state)
        assert all(torch.equal(a, b) for a, b in zip(
            [opt.state_dict()["state"][k]["exp_avg"] for k in sorted(planned[2]["state"])],
            [planned[2]["state"][k]["exp_avg"] for k in sorted(planned[2]["state"])], strict=True))
    finally:
        ex.remove()


def test_the_search_graph_never_under_counts_and_the_ways_are_searched():
    w, g = weighty("gpt2")
    g = g.model_copy(deep=True)
    g.host_bandwidth_bytes_per_s = 2e9
    order = stream_order(g)
    for k in (1, len(order) // 2, len(order)):
        plan = _hosted(g, order[:k])
        real = simulate(g, plan)
        search = keep_all_report(states_search_graph(g, [], hosted=order[:k]))
        assert search.peak_bytes >= real.peak_bytes and search.time_s >= real.time_s - 1e-12
    bottom = max(simulate(g, _hosted(g)).peak_bytes, keep_all_report(states_search_graph(g, order)).peak_bytes)
    budget = (bottom + g.fixed.resident_bytes) // 2
    assert budget < keep_all_report(g).peak_bytes
    results = {how: solve(g, budget, offload=True, states=how, time_limit_s=5) for how in ("stream", "host", "auto")}
    assert results["host"].plan.hosted() and not results["host"].plan.streamed()
    assert results["stream"].plan.streamed() and not results["stream"].plan.hosted()
    assert results["auto"].report.time_s <= min(r.report.time_s for r in results.values()) + 1e-12
    for r in results.values():
        assert r.report.peak_bytes <= budget and "state" in r.space


def test_the_placement_round_trips_and_a_graph_without_a_host_rate_refuses_it(tmp_path):
    _, g = weighty("gpt2")
    plan = _hosted(g, stream_order(g)[:3])
    path = tmp_path / "plan.json"
    plan.save(str(path))
    again = Plan.load(str(path))
    assert again.hosted() == plan.hosted() and simulate(g, again).peak_bytes == simulate(g, plan).peak_bytes
    bare = g.model_copy(update={"host_optimizer_bytes_per_s": None})
    with pytest.raises(PlanError, match="no host optimizer rate"):
        simulate(bare, plan)
    with pytest.raises(PlanError, match="both streamed and stepped"):
        Plan.keep_all(g).with_states(g, [0], [0])


@pytest.mark.parametrize("placement", ["stream", "host", "both"])
def test_under_backward_fusion_the_moved_units_step_at_the_step_bitwise_at_the_predicted_peak(placement):
    w, g = weighty("gpt2")
    order = stream_order(g)
    streamed, hosted = {"stream": (order[:6], []), "host": ([], order[:6]), "both": (order[:3], order[3:8])}[placement]
    plan = Plan.keep_all(g).with_states(g, streamed, hosted)
    report = simulate(g, plan, fuse="backward")
    planned = _train(w, g, plan, fuse="backward")
    _same(planned, _train(w, g, None))
    # the buckets' gradients leave in backward, stepped, and the moved units' state is off the device; the
    # streamed ones are fetched inside backward, each stepped there and copied back
    assert 0 <= report.peak_bytes - planned[1] <= 1e-4 * report.peak_bytes
    assert report.peak_bytes < simulate(g, fuse="backward").peak_bytes
    want = [k for k in schedule(g, plan, fuse="backward").executed() if k[2] is None and k[0] in ("h2d", "d2h", "free")]
    assert planned[3][-1] == want
    assert sum(k[0] == "h2d" and k[1] is not None for k in want) >= len(streamed)


def test_streamed_inside_backward_under_the_cuda_emulation():
    """A fused step that read a unit's state before its copy in had landed (poisoned until waited for), or a
    slot read before the copy back, would train NaNs."""
    with emulate_cuda():
        w = load_workload("gpt2", **TINY["gpt2"])
        g = profile(copy.deepcopy(w.model), w.batch, w.loss_fn, device="cuda", progress=False, measure=False,
                    repeats=1)
        plan = Plan.keep_all(g).with_states(g, stream_order(g)[:5])
        plain = _train(w, g, None)
        planned = _train(w, g, plan, fuse="backward")
    _same(planned, plain)
    report = simulate(g, plan, fuse="backward")
    assert 0 <= report.peak_bytes - planned[1] <= 1e-3 * report.peak_bytes


def test_solve_with_backward_fusion_searches_the_placements():
    _, g = weighty("gpt2")
    fused_keep = simulate(g, fuse="backward").peak_bytes
    budget = int(fused_keep * 0.6)  # below every activation plan's fused step: only moved state fits
    r = solve(g, budget, offload=True, fuse="backward", time_limit_s=6)
    assert r.plan.hosted() or r.plan.streamed()
    assert r.report.peak_bytes == simulate(g, r.plan, fuse="backward").peak_bytes <= budget
    with pytest.raises(Exception, match="budget"):
        solve(g, budget, offload=True, states=False, fuse="backward", time_limit_s=3)


def test_the_memory_viewers_trace_is_the_timeline_under_every_placement():
    """planner/core/memtrace.py (``memplan show --snapshot``) follows the host-stepped gradients' frees and
    the states streamed inside backward, to the byte of the simulator's timeline."""
    from test_snapshot import assert_trace_is_the_timeline

    _, g = weighty("gpt2")
    order = stream_order(g)
    for streamed, hosted in [(order[:6], []), ([], order[:6]), (order[:3], order[3:8])]:
        plan = Plan.keep_all(g).with_states(g, streamed, hosted)
        for fuse in (None, "backward"):
            assert_trace_is_the_timeline(g, schedule(g, plan, fuse=fuse), {})


def test_maxbatch_answers_with_the_state_placements_and_forward_fusion_refuses_them():
    """The activations' lower bound is no bound on a step whose model states may leave the device: maxbatch
    asks the solver (the bound refused every batch there before); forward fusion with moved state is one line."""
    from memplan.api.integrations.common import dim_family
    from memplan.planner.core.errors import MemplanError
    from memplan.planner.probe.family import profile_family
    from memplan.solvers.maxbatch import max_dim

    w = load_workload("mlp", depth=4, width=256, batch_size=4)
    fam = profile_family(w.model, dim_family(w.batch, "batch"), w.loss_fn, progress=False, repeats=1,
                         measure=False, device="cpu")
    budget = 4 * 2**20
    with pytest.raises(Exception, match="budget"):
        max_dim(fam, budget, offload=True, states=False, method="greedy", time_limit_s=3)
    assert max_dim(fam, budget, offload=True, states="host", method="greedy", time_limit_s=3).value >= 1
    _, g = weighty("gpt2")
    with pytest.raises(MemplanError, match="fuse='forward'"):
        solve(g, g.fixed.resident_bytes, offload=True, states="host", fuse="forward")


class _Failing(torch.optim.AdamW):
    """AdamW whose call raises once where ``fail(params)`` says so (a fault in one unit's update)."""

    fail = None

    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"]]
        if self.fail is not None and params and self.fail(params):
            self.fail = None
            raise RuntimeError("injected fault in an update")
        return super().step(closure)


@pytest.mark.parametrize("where", ["host", "stream"])
def test_a_step_that_fails_part_way_is_a_transaction(where):
    """A fault in the second host-stepped unit's update (or in the first streamed unit's, before any host
    step): the units updated before it stay updated, the rest are not, nothing is lost or half-copied (the
    device parameters are the host's), and training goes on: equal to plain training whose step updated
    exactly those units, then stepped on."""
    from memplan.planner.probe.fusion import buckets, narrowed_groups

    w, g = weighty("gpt2")
    order = stream_order(g)
    streamed, hosted = (order[4:6], order[:4]) if where == "stream" else ([], order[:4])
    plan = Plan.keep_all(g).with_states(g, streamed, hosted)

    def make():
        model = copy.deepcopy(w.model)
        return model, _Failing(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)

    def batch_step(model, opt, i):
        torch.manual_seed(i)
        opt.zero_grad(set_to_none=True)
        w.loss_fn(model, w.batch).backward()

    model, opt = make()
    units = buckets(model, opt)[0]
    ex = apply(model, plan, graph=g, optimizer=opt)
    calls = []

    def fail(params):
        if where == "host":
            calls.append(all(is_host_buffer(p) for p in params))
            return sum(calls) == 2  # the second unit stepped on the host
        return {id(p) for p in params} == {id(p) for p in units[streamed[0]]}

    try:
        batch_step(model, opt, 0)
        opt.step()
        batch_step(model, opt, 1)
        opt.fail = fail
        with pytest.raises(RuntimeError, match="injected"):
            opt.step()
        for i in (2, 3):
            batch_step(model, opt, i)
            opt.step()
        got = ([p.detach().clone() for p in model.parameters()], 0, copy.deepcopy(opt.state_dict()))
    finally:
        ex.remove()

    ref, ref_opt = make()
    ref_units = buckets(ref, ref_opt)[0]
    moved = set(streamed) | set(hosted)
    done = [u for u in range(len(ref_units)) if u not in moved] + ([hosted[0]] if where == "host" else [])
    batch_step(ref, ref_opt, 0)
    ref_opt.step()
    batch_step(ref, ref_opt, 1)
    with narrowed_groups(ref_opt, [p for u in done for p in ref_units[u]]):
        ref_opt.step()
    for i in (2, 3):
        batch_step(ref, ref_opt, i)
        ref_opt.step()
    _same(got, ([p.detach().clone() for p in ref.parameters()], 0, ref_opt.state_dict()))
