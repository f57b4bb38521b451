"""Model states placed by the plan (planner/core/states.py, executor/states.py, solvers/states.py): units'
optimizer state kept in a host pool and streamed through the device for its update.

* the cost model: the search graph the solvers read scores every placement exactly as the simulator scores
  the plan with it (peak and time), on a real model's graph and at GPU byte scale; the joint search against
  an exhaustive search over every subset of units;
* the executor, on real models, on a CPU and under the CUDA emulation: training bitwise equal to plain
  training, the measured peak equal to the prediction, below the fixed memory of plain training;
* "does not fit": a model whose parameters and optimizer state exceed the budget trains under a plan made
  from a fake profile, measured within the budget and within 0.5% of its prediction, equal to plain
  training on an unlimited device;
* the optimizer's ``state_dict`` sees the real state (a checkpoint saved under a plan loads without one, and
  the other way round); a step that fails part-way loses no state;
* the plan file: placements round-trip and are checked against the graph.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools

import pytest
import torch
from test_executor import TINY, graph_of, workload

from memplan.executor import apply
from memplan.planner import simulate
from memplan.planner.core.errors import Infeasible, PlanError, PlanMismatch
from memplan.planner.core.graph import Graph, StateUnit
from memplan.planner.core.plan import Action, Plan
from memplan.planner.core.states import host_state_bytes, states_search_graph, stream_order
from memplan.planner.core.synthetic import gpu_scale, random_dag
from memplan.planner.probe.device import emulate_cuda, is_host_buffer
from memplan.planner.probe.measure import measure_step
from memplan.planner.probe.profiler import profile
from memplan.planner.workloads import Workload, load_workload
from memplan.solvers import keep_all_report, smallest_known_peak, solve
from memplan.solvers.bounds import memory_lower_bound

pytestmark = pytest.mark.usefixtures("one_thread")


# weights-heavy shapes (a short batch against wide layers), where the model states are most of the memory
WEIGHTY: dict[str, dict] = {
    "gpt2": dict(n_layer=2, n_embd=128, n_head=2, vocab_size=512, seq_len=16, batch_size=1),
    "resnet": dict(embedding_size=16, hidden_sizes=(32, 64, 64, 128), depths=(1, 1, 1, 1), image_size=16,
                   batch_size=2),
}


@functools.cache
def weighty(name: str) -> tuple[Workload, Graph]:
    w = load_workload(name, **WEIGHTY[name])
    g = profile(copy.deepcopy(w.model), w.batch, w.loss_fn, name=name, device="cpu", progress=False,
                measure=False, repeats=1)
    g.watch_op_dispatch_s = g.replay_op_dispatch_s = 0.0
    return w, g


def _realistic(g: Graph) -> Graph:
    """The test graphs price copies as free (test_executor.graph_of): streaming would cost nothing."""
    out = g.model_copy(deep=True)
    out.host_bandwidth_bytes_per_s = 12e9
    return out


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)


# ---- the cost model ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["gpt2", "resnet"])
def test_the_search_graph_scores_every_placement_as_the_simulator_does(name):
    g = _realistic(graph_of(name))
    assert g.state_units and sum(u.state_bytes for u in g.state_units) == g.fixed.optimizer_state_bytes
    order = stream_order(g)
    plans = [Plan.keep_all(g), solve(g, None, "greedy").plan]
    for k in range(len(order) + 1):
        for plan in plans:
            with_states = simulate(g, plan.with_states(g, order[:k]))
            search = simulate(states_search_graph(g, order[:k]), plan)
            assert with_states.peak_bytes == search.peak_bytes
            assert with_states.time_s == pytest.approx(search.time_s, rel=1e-12)
            assert with_states.host_peak_bytes >= host_state_bytes(g, order[:k])
    # streaming every unit moves every state byte off the device for forward and backward
    every = simulate(g, Plan.keep_all(g).with_states(g, order))
    assert every.fixed_bytes == g.fixed.resident_bytes - g.fixed.optimizer_state_bytes
    assert every.exposed_transfer_s > 0


def _with_units(g: Graph, sizes: list[int]) -> Graph:
    """``g`` with state units of ``sizes`` bytes (an AdamW's moments: twice the parameters)."""
    out = g.model_copy(deep=True)
    out.state_units = [StateUnit(module=f"layer{i}", params=2, param_bytes=s // 2, state_bytes=s, state_tensors=4)
                       for i, s in enumerate(sizes)]
    out.fixed.params_bytes = sum(s // 2 for s in sizes)
    out.fixed.optimizer_state_bytes = sum(sizes)
    out.fixed.optimizer_step_bytes = max(sizes)
    out.optimizer_time_s = 0.05
    out.host_bandwidth_bytes_per_s = 25e9
    return out.invalidate()


def test_the_joint_search_against_every_subset_of_units_at_gpu_scale():
    """A random DAG at GPU byte scale with four units of 0.5-6 GiB of state: at budgets from below the fixed
    memory to keep-everything, the joint search's plan fits and is within 2% of the best plan over every
    subset of streamed units (each subset's activations solved by the same solver), and it refuses only
    where no subset fits."""
    sizes = [int(s * 2**30) | 1 for s in (6, 0.5, 3, 2)]
    g = _with_units(gpu_scale(random_dag(24, seed=3), seed=3), sizes)
    top = keep_all_report(g).peak_bytes
    bottom = keep_all_report(states_search_graph(g, stream_order(g))).peak_bytes
    for frac in (0.0, 0.4, 1.0):
        budget = int(bottom * 0.8 + (top - bottom * 0.8) * frac)
        best = None
        for r in range(len(sizes) + 1):
            for subset in itertools.combinations(range(len(sizes)), r):
                search = states_search_graph(g, list(subset))
                if memory_lower_bound(search) > budget:
                    continue
                try:
                    res = solve(search, budget, "dp", time_limit_s=1)
                except Infeasible:
                    continue
                t = simulate(g, res.plan.with_states(g, list(subset))).time_s
                best = t if best is None else min(best, t)
        try:
            got = solve(g, budget, "dp", states=True, time_limit_s=4)
        except Infeasible:
            assert best is None, f"refused {budget} B where a placement fits"
            continue
        assert best is not None
        report = simulate(g, got.plan)
        assert report.peak_bytes <= budget
        assert report.time_s <= best * 1.02, (frac, report.time_s, best)


# ---- the executor ------------------------------------------------------------------------------------------

def train_under(name: str, plan: Plan | None, graph: Graph, steps: int = 4, w: Workload | None = None,
                capacity_bytes: int | None = None):
    """``steps`` training steps of a copy of ``name``'s model (or ``w``'s) under ``plan`` (None: plain), then
    one measured: ``(losses, parameters, measured peak, optimizer state_dict)``. ``capacity_bytes``: the steps
    and the measurement on an emulated GPU of that memory (the plan's removal after them puts every state
    back on the device, which need not fit)."""
    w = w or workload(name)
    model = copy.deepcopy(w.model)
    opt = _adamw(model)
    with emulate_cuda(capacity_bytes=capacity_bytes) if capacity_bytes is not None else contextlib.nullcontext():
        ex = apply(model, plan, graph=graph, optimizer=opt) if plan is not None else None
        losses = []
        for i in range(steps):
            torch.manual_seed(i)
            opt.zero_grad(set_to_none=True)
            loss = w.loss_fn(model, w.batch)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        peak = measure_step(model, w.batch, w.loss_fn, opt, steps=1, warmup=1).peak_bytes
        state = opt.state_dict()
    if ex is not None:
        streamed = [p for u in plan.streamed() for p in _unit_params(model, opt, graph, u)]
        assert streamed and all(is_host_buffer(opt.state[p]["exp_avg"]) for p in streamed)
        ex.remove()
        assert not any(is_host_buffer(t) for s in opt.state.values() for t in s.values()
                       if isinstance(t, torch.Tensor))
    return losses, [p.detach().clone() for p in model.parameters()], peak, state


def _unit_params(model, opt, graph, u):
    from memplan.planner.probe.fusion import buckets
    return buckets(model, opt)[0][u]


def assert_same_training(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True)), "losses differ"
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True)), "parameters differ"


@pytest.mark.parametrize("name", ["gpt2", pytest.param("resnet", marks=pytest.mark.slow)])
def test_a_joint_plan_where_no_activation_plan_fits_trains_bitwise_at_its_predicted_peak(name):
    """A budget below the least peak of every activation plan (offload included), and on GPT-2 below the fixed
    memory of plain training (parameters, optimizer state, batch): only a plan that streams optimizer state
    fits; solve(offload=True) finds one (with activations recomputed or offloaded where that is faster), and
    it trains as plain training, at its predicted peak. (ResNet's gradients, all live at an unfused
    optimizer step, are above its fixed memory less the state: there the budget is above the fixed memory.)"""
    w, g = weighty(name)
    # between the least peak with every unit's state streamed (gradients, parameters and two units' states
    # at the unfused optimizer step) and the least peak of the activations alone
    bottom = keep_all_report(states_search_graph(g, stream_order(g))).peak_bytes
    activations_only = smallest_known_peak(g, offload=True)
    top = min(activations_only, g.fixed.resident_bytes) if name == "gpt2" else activations_only
    budget = (bottom + top) // 2
    assert bottom < budget < activations_only
    if name == "gpt2":
        assert budget < g.fixed.resident_bytes
    result = solve(g, budget, offload=True, states="stream", time_limit_s=10)
    assert result.plan.streamed() and result.report.peak_bytes <= budget
    plain = train_under(name, None, g, w=w)
    planned = train_under(name, result.plan, g, w=w)
    assert_same_training(planned, plain)
    # the peak is at a streamed unit's update: its share of the optimizer's transient is by parameter bytes,
    # rounded up, with a margin for the call's scalar temporaries (planner/core/states.py: CALL_BYTES)
    assert 0 <= result.report.peak_bytes - planned[2] <= 1e-4 * result.report.peak_bytes
    assert planned[2] < plain[2]


def test_streamed_state_under_the_cuda_emulation_waits_for_its_copies():
    """Under the emulation a copy lands only when waited for (its destination poisoned until then): an update
    that read a state early, or a slot read before its copy back, would train NaNs; the peak is the allocator's
    rounded count, equal to the prediction."""
    name = "gpt2"
    with emulate_cuda():
        w = load_workload(name, **TINY[name])
        g = profile(copy.deepcopy(w.model), w.batch, w.loss_fn, device="cuda", progress=False, measure=False,
                    repeats=1)
        assert g.device == "cuda"
        plan = Plan.keep_all(g).with_states(g, stream_order(g))
        plain = train_under(name, None, g, steps=3, w=w)
        planned = train_under(name, plan, g, steps=3, w=w)
    assert_same_training(planned, plain)
    assert planned[2] == simulate(g, plan).peak_bytes < plain[2]


def small_llama() -> Workload:
    """A Llama from ``transformers`` with random weights, cut to two layers of width 128 and a sequence of 16:
    its model states (parameters, AdamW state) are most of its memory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=32, use_cache=False)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 256, (1, 16))

    def loss_fn(m, batch):
        return m(input_ids=batch, labels=batch).loss

    return Workload(name="llama", model=model, batch=ids, loss_fn=loss_fn)


@pytest.mark.slow
def test_a_llama_whose_model_states_do_not_fit_trains_under_a_fake_profiled_plan():
    """A Llama of the 1.1B's width cut to two layers and a short sequence, under the CUDA emulation: the
    budget is below its parameters and optimizer state alone; the plan comes from a fake profile (nothing of
    the step allocated); the real step's measured peak is within the budget and within 0.5% of the
    prediction, and after three steps the model equals plain training's on an unlimited device."""
    w = small_llama()
    with emulate_cuda():
        g = profile(copy.deepcopy(w.model), w.batch, w.loss_fn, device="cuda", fake=True, progress=False)
        fixed_states = g.fixed.params_bytes + g.fixed.optimizer_state_bytes
        budget = int(fixed_states * 0.9)
        result = solve(g, budget, offload=True, states="stream", time_limit_s=20)
        assert result.plan.streamed()
        plain = train_under("llama", None, g, steps=3, w=w)
        planned = train_under("llama", result.plan, g, steps=3, w=w)
    assert_same_training(planned, plain)
    assert planned[2] <= budget < fixed_states
    assert abs(planned[2] - result.report.peak_bytes) <= 0.005 * result.report.peak_bytes


# ---- checkpoints and failures ----------------------------------------------------------------------------

def test_a_checkpoint_saved_under_a_plan_loads_without_one_and_the_other_way_round():
    name = "gpt2"
    g = _realistic(graph_of(name))
    plan = Plan.keep_all(g).with_states(g, stream_order(g)[:5])
    w = workload(name)

    def steps(model, opt, seeds):
        for i in seeds:
            torch.manual_seed(i)
            opt.zero_grad(set_to_none=True)
            w.loss_fn(model, w.batch).backward()
            opt.step()

    ref = copy.deepcopy(w.model)
    ref_opt = _adamw(ref)
    steps(ref, ref_opt, range(4))
    # two steps under the plan, saved; two more without it, from the checkpoint
    a = copy.deepcopy(w.model)
    a_opt = _adamw(a)
    ex = apply(a, plan, graph=g, optimizer=a_opt)
    steps(a, a_opt, range(2))
    saved = copy.deepcopy(a_opt.state_dict())
    ex.remove()
    b_opt = _adamw(a)
    b_opt.load_state_dict(saved)
    steps(a, b_opt, range(2, 4))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), ref.parameters(), strict=True))
    # two plain steps, saved; loaded under a plan: the streamed units' state goes to the pool at once
    c = copy.deepcopy(w.model)
    c_opt = _adamw(c)
    steps(c, c_opt, range(2))
    plain_saved = copy.deepcopy(c_opt.state_dict())
    d_opt = _adamw(c)
    ex = apply(c, plan, graph=g, optimizer=d_opt)
    d_opt.load_state_dict(plain_saved)
    streamed = [p for u in plan.streamed() for p in _unit_params(c, d_opt, g, u)]
    assert all(is_host_buffer(d_opt.state[p]["exp_avg"]) for p in streamed)
    steps(c, d_opt, range(2, 4))
    ex.remove()
    assert all(torch.equal(x, y) for x, y in zip(c.parameters(), ref.parameters(), strict=True))


def test_a_streamed_step_that_fails_part_way_loses_no_state():
    """An exception in the optimizer at the third unit's update: the units stepped before it stay stepped
    (as a backward-fused step's), every state is back in the pool, and the retry trains on: the result is
    plain training's with exactly those units stepped once more."""
    name = "gpt2"
    g = _realistic(graph_of(name))
    order = stream_order(g)
    plan = Plan.keep_all(g).with_states(g, order)
    w = workload(name)
    model = copy.deepcopy(w.model)
    opt = _adamw(model)
    ex = apply(model, plan, graph=g, optimizer=opt)
    calls = []

    def fail_third(*_a):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")

    for i in range(2):
        torch.manual_seed(i)
        opt.zero_grad(set_to_none=True)
        w.loss_fn(model, w.batch).backward()
        opt.step()
    torch.manual_seed(2)
    opt.zero_grad(set_to_none=True)
    w.loss_fn(model, w.batch).backward()
    before = {id(p): int(opt.state[p]["step"]) for p in model.parameters()}
    h = opt.register_step_pre_hook(fail_third)
    with pytest.raises(RuntimeError, match="injected"):
        opt.step()
    h.remove()
    stepped = [i for i, p in enumerate(model.parameters()) if int(opt.state[p]["step"]) != before[id(p)]]
    assert stepped and len(stepped) < len(list(model.parameters()))
    assert all(is_host_buffer(t) for p in model.parameters() for t in opt.state[p].values()
               if isinstance(t, torch.Tensor) and t.dim())
    opt.step()  # the retry of the step: the other units
    ex.remove()
    # plain training: the same, the stepped units' update applied twice with the same gradients
    from memplan.planner.probe.fusion import narrowed_groups
    ref = copy.deepcopy(w.model)
    ref_opt = _adamw(ref)
    for i in range(3):
        torch.manual_seed(i)
        ref_opt.zero_grad(set_to_none=True)
        w.loss_fn(ref, w.batch).backward()
        if i == 2:
            params = list(ref.parameters())
            with narrowed_groups(ref_opt, [params[j] for j in stepped]):
                ref_opt.step()
        ref_opt.step()
    assert all(torch.equal(x, y) for x, y in zip(model.parameters(), ref.parameters(), strict=True))


# ---- the plan file ---------------------------------------------------------------------------------------

def test_placements_round_trip_and_are_checked_against_the_graph(tmp_path):
    g = graph_of("gpt2")
    plan = Plan.for_graph(g, {g.saved_activations[0]: Action.RECOMPUTE}).with_states(g, [3, 1])
    plan.save(str(tmp_path / "plan.json"))
    back = Plan.load(str(tmp_path / "plan.json"))
    assert back.streamed() == [3, 1] and back.actions() == plan.actions()
    assert len(back.states) == len(g.state_units)
    # a plan without placements reads as today's: every state resident
    assert Plan.for_graph(g, {}).streamed() == []
    wrong = back.model_copy(deep=True)
    wrong.states[0].unit = len(g.state_units)
    with pytest.raises(PlanError, match="state units"):
        simulate(g, wrong)
    other = back.model_copy(deep=True)
    other.states[0].module = "nowhere"
    with pytest.raises(PlanMismatch, match="nowhere"):
        simulate(g, other)
    with pytest.raises(PlanError, match="fuse='forward'"):
        simulate(g, back, fuse="forward")


def test_a_plan_that_streams_state_is_refused_for_another_optimizer_or_none():
    g = graph_of("gpt2")
    plan = Plan.keep_all(g).with_states(g, stream_order(g)[:2])
    model = copy.deepcopy(workload("gpt2").model)
    with pytest.raises(Exception, match="optimizer=opt"):
        apply(model, plan, graph=g)
    head = [p for n, p in model.named_parameters() if n.startswith("transformer.h.0")]
    with pytest.raises(PlanMismatch, match="re-profile with this model and optimizer"):
        apply(model, plan, graph=g, optimizer=torch.optim.AdamW(head, lr=1e-3))


def test_the_executor_performs_a_joint_plans_schedule_event_for_event():
    """The streamed units' copies are logged in the schedule's terms (tests/test_schedule.py does the same for
    activation plans): after the first step, which creates each unit's state on the device, every step
    performs the schedule's state copies in its order (a step whose plan moves no activation is not watched
    op by op: its forward and backward are plain training's)."""
    from memplan.planner.core.schedule import schedule

    w, g = weighty("gpt2")
    bottom = keep_all_report(states_search_graph(g, stream_order(g))).peak_bytes
    result = solve(g, (bottom + g.fixed.resident_bytes) // 2, offload=True, states="stream", time_limit_s=10)
    assert result.plan.streamed()
    want = [k for k in schedule(g, result.plan).executed() if k[2] is None and k[0] in ("h2d", "d2h")]
    assert sum(1 for k in want if k[0] == "h2d" and k[2] is None) == len(result.plan.streamed())
    model = copy.deepcopy(w.model)
    opt = _adamw(model)
    ex = apply(model, result.plan, graph=g, optimizer=opt)
    try:
        for i in range(3):
            torch.manual_seed(i)
            opt.zero_grad(set_to_none=True)
            w.loss_fn(model, w.batch).backward()
            opt.step()
            performed = [e.key() for e in ex.last_step.events if e.tensor is None and e.kind in ("h2d", "d2h")]
            expected = want if i else [k for k in want if k[0] != "h2d"]
            assert performed == expected, i
    finally:
        ex.remove()


def test_the_command_line_streams_state_with_offload_and_refuses_a_bad_host_budget(tmp_path):
    import json
    import subprocess
    import sys

    _, g = weighty("gpt2")
    path = tmp_path / "graph.json"
    g.save(str(path))
    bottom = keep_all_report(states_search_graph(g, stream_order(g))).peak_bytes
    budget = str((bottom + g.fixed.resident_bytes) // 2)

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "memplan.api.cli", "solve", str(path), "--budget", budget,
                               "-o", str(tmp_path / "plan.json"), "--time-limit", "10", *args],
                              capture_output=True, text=True, timeout=300)

    r = cli("--offload", "--host-budget", "1GiB", "--states-on", "stream", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["streamed_units"] > 0 and out["peak_bytes"] <= int(budget) < g.fixed.resident_bytes
    assert out["host_peak_bytes"] >= out["streamed_state_bytes"] > 0
    assert Plan.load(str(tmp_path / "plan.json")).streamed()
    r = cli("--states-on", "host", "--json")  # model states alone, stepped on the host
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["hosted_units"] > 0 and out["streamed_units"] == 0 and out["peak_bytes"] <= int(budget)
    assert out["predicted_parts_s"]["host_optimizer"] > 0 and Plan.load(str(tmp_path / "plan.json")).hosted()
    r = cli("--states-on", "host", "--no-states")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--states-on" in r.stderr
    r = cli("--offload", "--no-states")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "budget" in r.stderr
    r = cli("--offload", "--host-budget", "lots")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "lots" in r.stderr
    r = cli("--offload", "--host-budget", "1KiB")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "host" in r.stderr


@pytest.mark.parametrize("fuse", [None, "backward"])
def test_a_budget_string_is_refused_in_one_line_by_every_search(fuse):
    """Bytes inside the code: the fused and the model-state searches did arithmetic on a string first."""
    from memplan.planner.core.errors import MemplanError

    with pytest.raises(MemplanError, match="number of bytes, got '60%'"):
        solve(graph_of("gpt2"), "60%", offload=True, fuse=fuse)
