"""CUDA's rules on a CPU (``memplan.planner.probe.device.emulate_cuda``): what would fail on a GPU fails here.

The first run on an H100 refused every plan at the first small tensor: a CUDA profile charges storages as
the caching allocator does (rounded up to 512 bytes) and the executor compared the raw ``nbytes()``. Under
the emulation, tensors live on the CPU but the device is ``cuda`` with its rules: allocator rounding in the
graph and in every measurement, a copy stream whose work completes only when an event says so (its
destination poisoned until then), memory a copy still uses that must outlive it, and a workspace that no
tensor owns. The executor, the measurement and offload run here under those rules, bitwise against plain
training and to the byte against the simulator, as they run under plain CPU in test_executor.py and
test_executor_measure.py; and the executor's stream discipline is broken on purpose to show that each
rule catches its bug.
"""

from __future__ import annotations

import functools

import pytest
import torch
from test_executor import TINY, adamw, assert_same, measured_under, reference, run_under

from memplan.executor import apply
from memplan.executor.session import run_plan
from memplan.executor.transfers import Offloading
from memplan.planner import simulate
from memplan.planner.core.errors import Infeasible
from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Action, Plan
from memplan.planner.probe.device import POISON, Device, StreamUseError, device_of, emulate_cuda
from memplan.planner.probe.measure import measure_step
from memplan.planner.probe.profiler import profile
from memplan.planner.workloads import load_workload
from memplan.solvers import keep_all_report, smallest_known_peak, solve

WORKSPACE = 3 * 2**20 + 100  # an emulated cuBLAS workspace (charged: rounded up to 512 B)


pytestmark = pytest.mark.usefixtures("one_thread")  # see test_executor.one_thread


@pytest.fixture
def gpu():
    with emulate_cuda(workspace_bytes=WORKSPACE) as dev:
        yield dev


@functools.cache
def cuda_graph(name: str) -> Graph:
    """``name`` profiled on the emulated GPU (as test_executor.graph_of profiles it on the CPU)."""
    with emulate_cuda(workspace_bytes=WORKSPACE):
        w = load_workload(name, **TINY[name])
        g = profile(w.model, w.batch, w.loss_fn, name=name, device="cuda", progress=False, measure=False,
                    repeats=1)
    g.watch_op_dispatch_s = g.replay_op_dispatch_s = 0.0  # see test_executor.graph_of
    g.host_bandwidth_bytes_per_s = 1e15
    return g


@functools.cache
def cuda_plan(name: str, offload: bool) -> Plan:
    g = cuda_graph(name)
    lo, hi = smallest_known_peak(g, offload=offload), keep_all_report(g).peak_bytes
    wanted = Action.OFFLOAD if offload else Action.RECOMPUTE
    for frac in (0.3, 0.1, 0.0, 0.6):
        try:
            plan = solve(g, lo + int((hi - lo) * frac), "greedy" if offload else "dp", offload=offload,
                         time_limit_s=4.0).plan
        except Infeasible:
            continue
        if plan.count(wanted):
            return plan
    raise AssertionError(f"no plan that uses {wanted.value} on {name}")


# ---- the device layer's rules ----------------------------------------------------------------------------


def test_a_cuda_profile_is_charged_as_the_caching_allocator_charges():
    g = cuda_graph("gpt2")
    assert g.device == "cuda" and g.meta.get("emulated") is True
    sizes = [t.bytes for t in g.tensors if t.bytes]
    assert all(b % 512 == 0 for b in sizes)
    # the small tensors that broke the first GPU run (positions, masks: well under 512 bytes) are there
    assert any(t.bytes == 512 and t.dtype in ("int64", "bool") for t in g.tensors)
    # the workspace no tensor owns is fixed memory, beside the module attributes the step reads
    with emulate_cuda():
        w = load_workload("gpt2", **TINY["gpt2"])
        bare = profile(w.model, w.batch, w.loss_fn, device="cuda", progress=False, measure=False, repeats=1)
    assert g.fixed.other_bytes - bare.fixed.other_bytes == -(-WORKSPACE // 512) * 512


def test_an_emulated_copy_completes_only_when_waited_for_and_in_order(gpu):
    stream = gpu.copy_stream()
    src = torch.arange(16, dtype=torch.float32)
    dst = torch.zeros(16)
    first = stream.to_host(dst.view(torch.uint8), src.view(torch.uint8))
    second_dst = torch.zeros(4)
    second = stream.to_device(second_dst.view(torch.uint8), src[:4].view(torch.uint8))
    assert not first.complete
    assert torch.isnan(dst).all() and torch.isnan(second_dst).all()  # poisoned until known complete
    assert not first.done() and not second.done()  # the host is ahead: a query says "not yet"
    assert torch.isnan(dst).all()
    second.wait()  # in order: the first completes with it
    assert first.done() and second.done()
    assert torch.equal(dst, src) and torch.equal(second_dst, src[:4])
    assert POISON == 0xFF


def test_a_copy_whose_source_is_freed_before_it_is_known_complete_is_an_error(gpu):
    stream = gpu.copy_stream()
    src = torch.arange(8, dtype=torch.float32)
    copy = stream.to_host(torch.empty(32, dtype=torch.uint8), src.view(torch.uint8))
    del src  # on a GPU the block would go back to the allocator while the copy still reads it
    with pytest.raises(StreamUseError, match="source of a device-to-host copy was freed"):
        copy.wait()


def test_synchronize_completes_every_copy(gpu):
    stream = gpu.copy_stream()
    src = torch.ones(8)
    dst = torch.zeros(8)
    stream.to_device(dst.view(torch.uint8), src.view(torch.uint8))
    gpu.synchronize()
    assert torch.equal(dst, src)


def test_device_of_resolves_cuda_to_the_emulation_and_refuses_it_without(gpu):
    assert device_of("cuda") is gpu and device_of(torch.zeros(1)) is gpu
    assert gpu.charged_bytes(1) == 512 and gpu.charged_bytes(0) == 0 and gpu.charged_bytes(513) == 1024
    assert Device().charged_bytes(1) == 1


def test_cuda_without_a_gpu_or_the_emulation_is_one_clear_error():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(Exception, match="no GPU|none is available"):
        device_of("cuda")


# ---- the executor under CUDA's rules ---------------------------------------------------------------------


@pytest.mark.parametrize("offload", [False, True], ids=["recompute", "offload"])
@pytest.mark.parametrize("name", ["mlp", "gpt2"])
def test_plans_on_a_cuda_graph_train_like_plain_training(name, offload, gpu):
    """The failure of the first GPU run (every plan refused at a small tensor) and the copy stream's
    discipline: three steps under the plan equal plain training bitwise."""
    plan = cuda_plan(name, offload)
    run = run_under(name, plan, graph=cuda_graph(name))
    assert_same(run.trained, reference(name))
    if offload:
        assert all(run.offloaded)
    else:
        assert all(run.replays)


@pytest.mark.parametrize("offload", [False, True], ids=["recompute", "offload"])
@pytest.mark.parametrize("name", ["mlp", "gpt2"])
def test_measured_peak_on_a_cuda_graph_is_the_predicted_one(name, offload, gpu):
    """Every allocation charged as the caching allocator charges it, the workspace included: measured equals
    predicted within 1% (as on plain CPU); a copy's device bytes go where the schedule releases them, after
    compute waits for the copy, so offload plans hold while an event query says "not yet" (an executor that
    released on the query measured over: the first GPU run's offload plan, 776 MB over)."""
    g = cuda_graph(name)
    plan = cuda_plan(name, offload)
    w = load_workload(name, **TINY[name])
    measured, _ = measured_under(w.model, w, plan, g)
    predicted = simulate(g, plan).peak_bytes
    # never over (what a late release does: the first GPU run's offload plan); under by up to 3%: one clean
    # CI run measured the gpt2 offload plan 1.6% under its prediction (5,098,496 against 5,181,952 B), which
    # 6 repeats and 14 plans here did not reproduce (the cause is open, docs/model.md "Bytes on CUDA")
    assert 0.97 * predicted <= measured <= 1.01 * predicted, (measured, predicted)


def test_run_plan_reports_an_emulated_cuda_run(gpu):
    g = cuda_graph("mlp")
    plan = cuda_plan("mlp", True)
    w = load_workload("mlp", **TINY["mlp"])
    report = run_plan(w.model, w.batch, w.loss_fn, None, plan, g, steps=1, warmup=1)
    assert report.device == "cuda (emulated)"
    assert abs(report.measured_peak_bytes / report.predicted_peak_bytes - 1) <= 0.01
    assert report.keep_all_measured_peak_bytes >= report.measured_peak_bytes


# ---- each rule catches the bug it is there for --------------------------------------------------------------


def test_reading_a_prefetch_before_waiting_for_it_is_caught(gpu, monkeypatch):
    """Compute that does not wait for the copy reads the poisoned buffer: training diverges from plain."""
    monkeypatch.setattr(Offloading, "_wait_ready", lambda self, tid: self.ready.pop(tid, None))
    try:
        run = run_under("mlp", cuda_plan("mlp", True), graph=cuda_graph("mlp"))
    except StreamUseError:
        return  # the unwaited buffer was freed before its copy was known complete: caught as well
    assert any(torch.isnan(x) for x in run.trained.losses) or any(
        not torch.equal(a, b) for a, b in zip(run.trained.params, reference("mlp").params, strict=True))


def test_releasing_a_copy_source_before_the_copy_is_known_complete_is_caught(gpu, monkeypatch):
    """An executor that drops the device bytes as soon as the copy is issued (no event query)."""
    real = Offloading._offload

    def offload_and_forget(self, tid, s):
        real(self, tid, s)
        self.d2h_pending.clear()

    monkeypatch.setattr(Offloading, "_offload", offload_and_forget)
    with pytest.raises(StreamUseError):
        run_under("mlp", cuda_plan("mlp", True), graph=cuda_graph("mlp"))


def test_comparing_raw_bytes_with_a_cuda_graph_is_caught(gpu, monkeypatch):
    """The first GPU run's bug, put back: the check compares ``nbytes()`` with the graph's charged bytes."""
    monkeypatch.setattr(type(gpu), "charged_bytes", lambda self, n: n)
    with pytest.raises(Exception, match="512 B"):
        run_under("gpt2", cuda_plan("gpt2", False), graph=cuda_graph("gpt2"))


@pytest.mark.slow
def test_a_shape_family_of_a_cuda_graph_runs_dynamic_padding_bitwise(gpu):
    """Sizes under 512 B round to 512 on CUDA: the family keeps the elements' bytes, exact, and charges them
    where it is evaluated and where the executor compares them, so every padded length of the family runs."""
    import copy

    from test_shapes import SEQ, _loss, _padded, plan_family

    from memplan.executor.session import peak_step
    from memplan.planner.core.shapes import at_shape

    model, graph, plan = plan_family()
    assert graph.device == "cuda"
    assert all(t.bytes % 512 == 0 for t in at_shape(graph, {"seq": 5}).tensors)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=True)
    largest = simulate(graph, plan).peak_bytes
    gen = torch.Generator().manual_seed(2)
    with apply(model, plan, graph=graph, optimizer=opt) as ex:
        for lengths in ([3, 5, 2, 4], [SEQ, 11, 30, 7], [17, 29, 2, 9]):
            batch = _padded(lengths, gen)
            rng = torch.get_rng_state()
            peak, _, _, loss = peak_step(model, batch, _loss, opt, ex)
            torch.set_rng_state(rng)
            ref_opt.zero_grad(set_to_none=True)
            ref_loss = _loss(ref, batch)
            ref_loss.backward()
            ref_opt.step()
            assert torch.equal(loss, ref_loss.detach()) and ex.last_step.replays > 0
            assert peak <= largest
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters(), strict=True))


def test_a_device_pin_that_is_no_device_is_one_clear_error(monkeypatch):
    from memplan.planner.core.errors import MemplanError
    from memplan.planner.probe.device import default_device_type

    monkeypatch.setenv("MEMPLAN_DEVICE", "gpu")
    with pytest.raises(MemplanError, match="MEMPLAN_DEVICE='gpu': expected cpu or cuda"):
        default_device_type()
    monkeypatch.setenv("MEMPLAN_DEVICE", "cuda")
    assert default_device_type() == "cuda"


# ---- a host link slower than the step: where an offloaded tensor's bytes leave ------------------------------


@functools.cache
def slow_link_graph() -> Graph:
    """The emulated GPT-2 graph with a host link slow enough that a copy to host spans several forward ops:
    the schedule releases each offloaded tensor several op boundaries after its last forward use, as on a
    GPU (25 GB/s against a step of GiB-sized activations)."""
    g = cuda_graph("gpt2").model_copy(deep=True).invalidate()
    fwd = [op.time_s for op in g.ops]
    big = max(t.bytes for t in g.tensors if t.kind == "activation")
    g.host_bandwidth_bytes_per_s = big / (8 * sorted(fwd)[len(fwd) // 2])  # ~8 median ops per large copy
    return g


def test_a_slow_copy_releases_its_bytes_where_the_schedule_does_not_when_a_query_says_done(gpu):
    """The first GPU run's offload plan measured 776 MB over its prediction: the executor released a copy's
    device bytes when an event query said done, and a host that runs ahead of the device rarely hears it.
    Under the emulation a query says "not yet" until the copy is waited for; the executor releases at the
    position the schedule gives (``Schedule.released``), waiting for the copy there: peak to the byte,
    training bitwise, events as scheduled."""
    from memplan.planner.core.schedule import schedule, static_facts

    g = slow_link_graph()
    last_use = static_facts(g).fwd_free_at
    lo, hi = smallest_known_peak(g, offload=True), keep_all_report(g).peak_bytes
    plan = solve(g, lo + (hi - lo) // 3, "greedy", offload=True, states=False, time_limit_s=4.0).plan
    sched = schedule(g, plan)
    later = [t for t, (phase, at) in sched.released.items()
             if phase == "forward" and at > last_use[t] + 2]
    assert plan.count(Action.OFFLOAD) and later, "the slow link should hold some copies past their last use"
    run = run_under("gpt2", plan, graph=g)
    assert_same(run.trained, reference("gpt2"))
    w = load_workload("gpt2", **TINY["gpt2"])
    opt = adamw(w.model)
    ex = apply(w.model, plan, graph=g, optimizer=opt)
    try:
        measured = measure_step(w.model, w.batch, w.loss_fn, opt, steps=1, warmup=1).peak_bytes
        events = ex.last_step.events
        assert [e.key() for e in events] == sched.executed()
        released = {e.tensor: (e.phase, e.at) for e in events if e.kind == "free"}
        assert released == sched.released  # each at the boundary the schedule gives, none early or late
    finally:
        ex.remove()
    predicted = simulate(g, plan).peak_bytes  # equal here to the byte; under by up to 3% allowed as above
    assert 0.97 * predicted <= measured <= predicted, (measured, predicted)


class _Stretches(torch.nn.Module):
    """Three tanh layers, a Linear submodule, then five more tanh layers, written out in one forward: after the
    submodule the step passes no module boundary until forward ends."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(96, 96) / 10) for _ in range(8))
        self.mid = torch.nn.Linear(96, 96)

    def forward(self, x):
        for w in self.w[:3]:
            x = torch.tanh(x @ w)
        x = self.mid(x)
        for w in self.w[3:]:
            x = torch.tanh(x @ w)
        return x


def _loss(model, x):
    return model(x).square().mean()


def _stretches_graph() -> Graph:
    torch.manual_seed(0)
    model, x = _Stretches(), torch.randn(64, 96)
    g = profile(model, x, _loss, device="cuda", progress=False, measure=False, repeats=1)
    g.watch_op_dispatch_s = g.replay_op_dispatch_s = 0.0
    return g


def test_a_release_past_the_last_module_boundary_is_where_the_schedule_puts_it(gpu):
    """The first two layers' outputs offloaded over a link slow enough that the second copy ends in the
    module-less stretch after ``mid``: the executor's mode would be off there (left at ``mid``'s boundary,
    after the plan's last saver), so the watch window extends to the release (``forward_watch(release_ops=
    ...)``); without it the bytes would leave only at the end of forward."""
    from memplan.planner.core.schedule import schedule, static_facts
    from memplan.planner.core.watch import forward_watch

    torch.manual_seed(0)
    model, x = _Stretches(), torch.randn(64, 96)
    g = _stretches_graph()
    for op in g.ops:  # the schedule's release positions must not depend on this machine's op times
        op.time_s, op.backward_time_s = 1e-4, 2e-4
    tanh = [op.outputs[0] for op in g.ops if op.name == "aten.tanh.default"]
    moved = {t: Action.OFFLOAD for t in tanh[:2]}
    forward_s = sum(op.time_s for op in g.ops)
    g.host_bandwidth_bytes_per_s = g.tensors[tanh[0]].bytes / (0.3 * forward_s)  # a copy: 30% of forward
    # each copied back at its last saver's backward step (the latest point): the window the plan needs
    # otherwise ends at the second layer's savers
    plan = Plan.for_graph(g, moved, prefetch_at={t: max(g.savers[t]) for t in moved})
    sched = schedule(g, plan)
    bare = forward_watch(g, moved, {p for ev in sched.replays() for p in ev.ops}, sched.pins,
                         sched.prefetch_at.values(), static_facts(g).d2h_after)
    mid_end = max(op.id for op in g.ops if op.module == "mid")
    assert any(phase == "forward" and at > max(bare.last, mid_end) + 1 for phase, at in sched.released.values()), \
        (sched.released, bare.last, mid_end)
    ex = apply(model, plan, graph=g, optimizer=adamw(model))
    try:
        measured = measure_step(model, x, _loss, ex.optimizer, steps=1, warmup=1).peak_bytes
        events = ex.last_step.events  # the measured step: the fast path, the mode on only in its window
    finally:
        ex.remove()
    assert [e.key() for e in events] == sched.executed()
    assert {e.tensor: (e.phase, e.at) for e in events if e.kind == "free"} == sched.released
    predicted = simulate(g, plan).peak_bytes
    assert 0.97 * predicted <= measured <= predicted, (measured, predicted)


def test_offloaded_bytes_leave_where_the_schedule_releases_them_whatever_the_op_times(gpu):
    """Op times and link speeds drawn at random put the schedule's releases everywhere: before an op that
    follows an autograd ``detach`` (which the step passes without a dispatch), in backward past the watched
    forward window, and at backward steps with no autograd node (the schedule releases only where backward
    is seen). Prefetch points drawn at random fall on such steps too (started at the next step backward
    shows), and some copies end too late to release anything (the device copy stays for backward). The
    executor releases and fetches exactly where the schedule does. (A CI run failed here once: a copy
    ending before an op after a detach was released one op late.)"""
    import random

    from memplan.planner.core.schedule import schedule

    g = _stretches_graph()
    tanh = [op.outputs[0] for op in g.ops if op.name == "aten.tanh.default"]
    moved = {t: Action.OFFLOAD for t in tanh[:2]}
    after_detach = in_backward = unseen = stayed = 0
    for seed in range(24):
        rng = random.Random(seed)
        for op in g.ops:  # drawn, not profiled: the same schedules on every machine (a detach takes a few
            # microseconds in a real step; a copy may end during it)
            op.time_s, op.backward_time_s = rng.uniform(1e-5, 1e-3), rng.uniform(0.0, 2e-3)
        forward_s = sum(op.time_s for op in g.ops)
        g.host_bandwidth_bytes_per_s = g.tensors[tanh[0]].bytes / (rng.uniform(0.05, 1.5) * forward_s)
        prefetch_at = {t: rng.randint(max(g.savers[t]), len(g.ops) - 1) for t in moved}
        plan = Plan.for_graph(g, moved, prefetch_at=prefetch_at)
        sched = schedule(g, plan)
        torch.manual_seed(0)
        model, x = _Stretches(), torch.randn(64, 96)
        ex = apply(model, plan, graph=g, optimizer=adamw(model))
        try:
            measure_step(model, x, _loss, ex.optimizer, steps=1, warmup=1)
            events = ex.last_step.events
        finally:
            ex.remove()
        assert [e.key() for e in events] == sched.executed(), (seed, sched.released)
        for phase, at in sched.released.values():
            after_detach += phase == "forward" and g.ops[at - 1].name == "aten.detach.default"
            in_backward += phase == "backward"
        unseen += sum(not g.ops[k].has_backward for k in prefetch_at.values())
        stayed += len(moved) - len(sched.released)
    # the draws reach every case
    assert after_detach and in_backward and unseen and stayed, (after_detach, in_backward, unseen, stayed)


@pytest.mark.parametrize("name", ["mlp", "gpt2", "bert"])
def test_random_plans_run_event_for_event_as_the_schedule_says(name, gpu):
    """Random plans mixing recompute, recompute_each and offload (random prefetch points), over random op
    times and link speeds, on the emulated GPU: the executor performs the schedule's events in its order
    (every copy, release, prefetch and replay where the schedule has it), and the measured peak is the
    predicted one within 0.1%, never over. Found by this test's loop: a saved input packed before the op
    after an autograd detach was copied, and a release at the detach made, one position off.
    (The prediction can sit up to two 512 B blocks above the measurement: one tiny tensor's timing at a
    replay, conservative, not chased.)"""
    import copy
    import random

    from memplan.planner.core.schedule import schedule

    g0 = cuda_graph(name)
    w = load_workload(name, **TINY[name])
    for seed in range(6):
        rng = random.Random(seed)
        g = g0.model_copy(deep=True)
        for op in g.ops:  # drawn, not profiled: the same plans and schedules on every machine
            op.time_s, op.backward_time_s = rng.uniform(1e-5, 1e-3), rng.uniform(0.0, 2e-3)
        saved = sum(g.tensors[t].bytes for t in g.saved_activations)
        g.host_bandwidth_bytes_per_s = saved / (sum(op.time_s for op in g.ops) * rng.uniform(0.05, 3.0))
        actions, prefetch_at = {}, {}
        for t in g.saved_activations:
            info, x = g.tensors[t], rng.random()
            if info.held_by_caller:
                continue
            if x < 0.25 and info.recomputable:
                actions[t] = Action.RECOMPUTE if x < 0.15 else Action.RECOMPUTE_EACH
            elif 0.25 <= x < 0.5:
                actions[t] = Action.OFFLOAD
                if rng.random() < 0.5:
                    prefetch_at[t] = rng.randint(max(g.savers[t]), len(g.ops) - 1)
        plan = Plan.for_graph(g, actions, prefetch_at=prefetch_at)
        sched = schedule(g, plan)
        measured, step = measured_under(copy.deepcopy(w.model), w, plan, g)
        events = [e.key() for e in step.events]
        assert events == sched.executed(), seed
        predicted = simulate(g, plan).peak_bytes
        assert 0.999 * predicted <= measured <= predicted, (seed, measured, predicted)


# ---- time: what a synchronisation costs ----------------------------------------------------------------
# On a GPU the host issues kernels ahead of the device; a synchronisation costs the round trip and leaves the
# next kernel to launch into an idle device. The first GPU run timed each op between two synchronisations,
# which charged every op that cost (small ops many times over, after scaling to the plain step) and put
# plans' overhead 2-3x over what they measured. The emulation spends ``sync_latency_s`` per synchronisation,
# so a time with one inside it is too long here as it is there; these use a latency far above any op's.
LATENCY = 2e-3


def _raw_times(monkeypatch, synced_laps: bool = False) -> tuple[int, float, float, float, float]:
    """Tiny GPT-2 profiled on the emulated GPU: its forward op count, the forward and backward seconds its
    ops were timed at before scaling to the plain step (calibrate_times), and that plain step's."""
    from memplan.planner.probe import profiler
    from memplan.planner.probe.device import Stopwatch

    raw: dict[str, float] = {}
    calibrate = profiler.calibrate_times

    def spy(graph, forward_s, backward_s, optimizer_s):
        raw.update(forward=sum(op.time_s for op in graph.ops), backward=sum(op.backward_time_s for op in graph.ops),
                   plain_forward=forward_s, plain_backward=backward_s)
        calibrate(graph, forward_s, backward_s, optimizer_s)

    monkeypatch.setattr(profiler, "calibrate_times", spy)
    with emulate_cuda(sync_latency_s=LATENCY) as dev:
        if synced_laps:  # the first GPU run's timing: each op between two synchronisations
            end = Stopwatch.end
            monkeypatch.setattr(Stopwatch, "end", lambda self, mark: (dev.synchronize(), end(self, mark))[1])
        w = load_workload("gpt2", **TINY["gpt2"])
        g = profile(w.model, w.batch, w.loss_fn, name="gpt2", device="cuda", progress=False, measure=False,
                    repeats=1)
    return len(g.ops), raw["forward"], raw["backward"], raw["plain_forward"], raw["plain_backward"]


def test_a_profile_times_each_op_as_the_device_runs_it_not_with_a_synchronisation_around_it(monkeypatch):
    """The traced steps issue their ops as a plain step does (an event pair per op on a GPU, read after the
    step): the ops' times add up to about the plain step's, not to a synchronisation's cost per op."""
    n, forward, backward, plain_forward, plain_backward = _raw_times(monkeypatch)
    assert n * LATENCY > 10 * plain_forward  # a synchronisation per op would dwarf the step
    assert forward < 2 * plain_forward + 4 * LATENCY, (forward, plain_forward)
    assert backward < 2 * plain_backward + 4 * LATENCY, (backward, plain_backward)


def test_timing_each_op_between_synchronisations_is_caught(monkeypatch):
    """The first GPU run's per-op timing, put back: every op is charged the latency, and the bound above fails."""
    n, forward, _, plain_forward, _ = _raw_times(monkeypatch, synced_laps=True)
    assert forward > n * LATENCY > 10 * plain_forward


def test_an_op_timed_alone_is_timed_without_a_synchronisation_around_it(tmp_path):
    """A fake profile times each call alone (OpTimer): warm runs issued back to back, a cold run behind its
    flush, and this machine's spec (matrix products, copies, a tiny op's cost) all as the device runs them."""
    from memplan.planner.probe.optime import OpTimer, local_device_spec, record_call

    x = torch.rand(256)
    call = record_call(torch.ops.aten.relu.default, (x,), {}, torch.relu(x))
    with emulate_cuda(sync_latency_s=LATENCY) as dev:
        for cold in (False, True):
            timer = OpTimer(torch.device("cuda"), cache_dir=tmp_path / str(cold), cold=cold, sweeps=1)
            before = dev.synchronizations
            (timing,) = timer.time([call])
            assert timing.source == "isolated"
            assert timing.time_s < LATENCY / 4, (cold, timing.time_s)
            assert dev.synchronizations - before < 30  # none per run around the timed call
        spec = local_device_spec(torch.device("cuda"), tmp_path / "spec")
    assert spec.op_overhead_s < LATENCY / 4
