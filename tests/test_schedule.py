"""One schedule for cost and execution: for every built-in workload and every solver family (with and
without offload), the events the executor performs in a training step -- forward ops, copies to host,
copies back, replays with their ops -- equal, event for event and in order, the events of the schedule
the simulator scores (``planner/core/schedule.py``), in the first step (every op watched) and the second
(the fast path, which learned from the first). And the schedule itself, on hand-built graphs: every
event at its position with its reason.

The workloads, graphs and plans are test_executor's (cached per session), so this adds two steps per
case."""

from __future__ import annotations

import pytest
import torch
from test_executor import (
    MODELS,
    OFFLOAD_SOLVERS,
    RECOMPUTE_SOLVERS,
    adamw,
    fresh_model,
    graph_of,
    plan_of,
    workload,
)

from memplan.executor import apply
from memplan.planner.core.graph import FixedMemory, Graph, Op, TensorInfo
from memplan.planner.core.plan import Action, Plan
from memplan.planner.core.schedule import EXECUTED_KINDS, schedule
from memplan.planner.core.simulator import simulate

pytestmark = pytest.mark.usefixtures("one_thread")


CASES = [(m, s, False) for s in RECOMPUTE_SOLVERS for m in ("mlp", "gpt2")]
CASES += [(m, s, True) for s in OFFLOAD_SOLVERS for m in ("mlp", "gpt2")]
SLOW = [pytest.param(m, s, o, marks=pytest.mark.slow) for m in ("resnet", "bert", "unet")
        for s, o in [*((s, False) for s in RECOMPUTE_SOLVERS), *((s, True) for s in OFFLOAD_SOLVERS)]]
assert {getattr(m, "values", [m])[0] for m in MODELS} == {"mlp", "gpt2", "resnet", "bert", "unet"}


@pytest.mark.parametrize(("name", "method", "offload"), CASES + SLOW)
def test_executor_performs_the_schedule_event_for_event(name, method, offload):
    g = graph_of(name)
    try:
        plan = plan_of(name, method, offload)
    except AssertionError as e:  # the solver offloads nothing on this graph at any budget tried
        pytest.skip(str(e))
    sched = schedule(g, plan)
    model = fresh_model(name)
    opt = adamw(model)
    ex = apply(model, plan, graph=g, optimizer=opt)
    steps = []
    try:
        w = workload(name)
        torch.manual_seed(1000)
        for _ in range(2):  # the first step watches every op; the second takes the fast path (step.py)
            opt.zero_grad(set_to_none=True)
            w.loss_fn(model, w.batch).backward()
            opt.step()
            steps.append([e.key() for e in ex.last_step.events])
    finally:
        ex.remove()

    want = sched.executed()
    # a streamed unit's first step creates its state on the device: nothing to copy in yet
    steps[0] = [k for k in steps[0] if k[0] != "h2d" or k[2] is not None]
    first = [k for k in want if k[0] != "h2d" or k[2] is not None]
    for performed, wanted_keys in zip(steps, (first, want), strict=True):
        assert performed == wanted_keys, _first_difference(performed, wanted_keys)
    # the plan was exercised, and the schedule's replays are the simulator's
    wanted = "d2h" if offload else "replay"
    assert any(k[0] == wanted for k in want)
    assert sum(len(e.ops) for e in sched.replays()) == simulate(g, plan).recomputed_ops
    assert ex.schedule == sched


def _first_difference(got: list, want: list) -> str:
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return (f"event {i}: the executor performed {a}, the schedule has {b}; around it, performed "
                    f"{got[max(i - 3, 0):i + 4]}, scheduled {want[max(i - 3, 0):i + 4]}")
    return f"the executor performed {len(got)} events, the schedule has {len(want)}"


# ---- the schedule on hand-built graphs -------------------------------------------------------------------


def _chain_with_dropout() -> Graph:
    """x -> mm (a, saved by gelu) -> gelu (b) -> empty_like (m) + bernoulli_ + div_ (its mask) -> mul (c),
    which saves b and the mask; a tiny loss reads c."""
    t = [TensorInfo(id=0, kind="input", bytes=100), TensorInfo(id=1, kind="param", bytes=100)]
    t += [TensorInfo(id=2, kind="activation", producer=0, bytes=400),
          TensorInfo(id=3, kind="activation", producer=1, bytes=400),
          TensorInfo(id=4, kind="activation", producer=2, bytes=400, rebuilt_by=[3, 4]),
          TensorInfo(id=5, kind="activation", producer=5, bytes=400, held_by_caller=True)]
    ops = [Op(id=0, name="aten.mm.default", inputs=[0, 1], outputs=[2], saved=[0, 1], time_s=1.0,
              backward_time_s=2.0, has_backward=True),
           Op(id=1, name="aten.gelu.default", inputs=[2], outputs=[3], saved=[2], time_s=1.0,
              backward_time_s=1.0, has_backward=True),
           Op(id=2, name="aten.empty_like.default", inputs=[3], outputs=[4], time_s=0.1),
           Op(id=3, name="aten.bernoulli_.float", inputs=[4], random=True, time_s=0.2),
           Op(id=4, name="aten.div_.Scalar", inputs=[4], time_s=0.1),
           Op(id=5, name="aten.mul.Tensor", inputs=[3, 4], outputs=[5], saved=[4, 3], time_s=1.0,
              backward_time_s=1.0, has_backward=True)]
    return Graph(tensors=t, ops=ops, fixed=FixedMemory(params_bytes=100, inputs_bytes=100),
                 host_bandwidth_bytes_per_s=400.0)


def test_a_recompute_plan_lowers_to_its_events_with_reasons():
    g = _chain_with_dropout()
    plan = Plan.for_graph(g, {3: Action.RECOMPUTE, 4: Action.RECOMPUTE})
    sched = schedule(g, plan)
    kinds = [(e.kind, e.at, e.tensor) for e in sched.events]
    # forward: compute every op; b and the mask go after their last forward use (op 5)
    assert kinds[:6] == [("compute", k, None) for k in range(6)]
    assert ("free", 5, 3) in kinds and ("free", 5, 4) in kinds
    # backward of op 5 reads the mask, then b (its saved order): the mask's replay runs empty_like and its
    # initialisers, and gelu first for b, which empty_like reads (a is kept: gelu saves it); b, saved
    # for this very step, stays, so the second read finds it and replays nothing
    replays = [(e.at, e.tensor, e.ops) for e in sched.replays()]
    assert replays == [(5, 4, (1, 2, 3, 4))]
    assert all(e.reason == "op 5's backward reads it" for e in sched.replays())
    assert [e.at for e in sched.of("backward")] == [5, 4, 3, 2, 1, 0]
    assert sched.events[-1].kind == "optimizer"
    # the executor-visible part is forward compute and the replays
    assert {k[0] for k in sched.executed()} <= {*EXECUTED_KINDS, "free"}


def test_an_offload_plan_lowers_to_copies_at_the_savers_and_back():
    g = _chain_with_dropout()
    plan = Plan.for_graph(g, {4: Action.OFFLOAD}, prefetch_at={4: 5})
    sched = schedule(g, plan)
    d2h = sched.of("d2h")
    # the mask's content is final only after its initialisers: its copy starts when its first saver
    # (mul, which saves it as an input) starts, not after its producer
    assert [(e.at, e.tensor) for e in d2h] == [(5, 4)]
    pos = sched.events.index(d2h[0])
    assert sched.events[pos + 1] == next(e for e in sched.events if e.kind == "compute" and e.at == 5)
    h2d = sched.of("h2d")
    assert [(e.at, e.tensor, e.reason) for e in h2d] == [(5, 4, "scheduled at op 5")]
    assert sched.prefetch_at == {4: 5}
    assert [e.tensor for e in sched.of("wait")] == [4]
    # the simulator scores this very pass: its transfers are the schedule's copies
    moved = sum(g.tensors[e.tensor].bytes for e in sched.events if e.kind in ("d2h", "h2d"))
    assert moved == simulate(g, plan).transfer_bytes == 800


def test_a_pinned_tensor_is_named_in_the_schedule():
    """b cannot be rebuilt (mutated in place later, say) and is not saved: a replay of the mask reads it,
    so the schedule pins it until that backward step and frees it there."""
    g = _chain_with_dropout()
    g.tensors[3].recomputable = False
    g.ops[5].saved = [4]
    g.invalidate()
    plan = Plan.for_graph(g, {4: Action.RECOMPUTE})
    sched = schedule(g, plan)
    assert sched.pins == {3: 5}
    assert [(e.at, e.tensor, e.ops) for e in sched.replays()] == [(5, 4, (2, 3, 4))]
    frees = [(e.at, e.reason) for e in sched.of("free") if e.tensor == 3]
    assert frees == [(5, "pinned: the last replay that reads it has run")]


def test_the_events_carry_what_they_cost():
    """On the dropout chain with b and the mask recomputed: each step's event carries the bytes it
    allocates, holds and frees and its time, and a replayed op is a recompute event beside its replay."""
    g = _chain_with_dropout()
    g.ops[2].workspace_bytes = 50
    g.replay_op_dispatch_s = 0.5
    sched = schedule(g, Plan.for_graph(g, {3: Action.RECOMPUTE, 4: Action.RECOMPUTE}))
    compute = {e.at: e for e in sched.of("compute")}
    assert [(compute[k].alloc_bytes, compute[k].duration_s) for k in range(6)] == \
        [(400, 1.0), (400, 1.0), (400, 0.1), (0, 0.2), (0, 0.1), (400, 1.0)]  # in-place ops allocate nothing
    assert compute[2].workspace_bytes == 50
    # the replay of the mask for op 5's backward: gelu (b again), empty_like, bernoulli_, div_
    recompute = sched.of("recompute")
    assert [(e.at, e.tensor, e.ops, e.alloc_bytes) for e in recompute] == \
        [(5, 4, (1,), 400), (5, 4, (2,), 400), (5, 4, (3,), 0), (5, 4, (4,), 0)]
    assert [e.duration_s for e in recompute] == [1.5, 0.6, 0.7, 0.6]  # time_s + the replay dispatch
    frees = [(e.phase, e.at, e.tensor, e.free_bytes) for e in sched.of("free")]
    assert ("forward", 5, 3, 400) in frees and ("forward", 5, 4, 400) in frees
    backward = {e.at: e for e in sched.of("backward")}
    assert (backward[0].duration_s, backward[0].alloc_bytes) == (2.0, g.ops[0].backward_grad_alloc_bytes)
    report = simulate(g, Plan.for_graph(g, {3: Action.RECOMPUTE, 4: Action.RECOMPUTE}))
    assert report.recompute_time_s == pytest.approx(3.4) and report.recomputed_ops == 4
    assert sched.events[-1] == ("optimizer", "optimizer", None, None, (), "optimizer step", 0,
                                g.fixed.optimizer_step_bytes, 0, g.optimizer_time_s, 0, 0)
