"""Replays planned once and compiled (``executor/recipes.py``: ``Segment``, ``CompiledOp``): the first step
plans every replay with ``replay()`` and traces it; later steps reuse both while the step answers
``replay()``'s questions alike and the recipes keep their signatures (op, constants, tensor geometry), and
trace afresh when a constant changes. Throughout, training stays bitwise equal to plain training (dropout
on: the replays' random ops run from the states forward drew from) and every step's replays are the
schedule's, event for event. On the tiny GPT-2 built-in with its default dropout."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from memplan.executor import apply
from memplan.executor.recipes import recipe_signature
from memplan.planner.core.plan import Action, Plan
from memplan.planner.core.schedule import schedule
from memplan.planner.probe.profiler import profile
from memplan.planner.workloads import Workload, load_workload
from memplan.solvers import keep_all_report, smallest_known_peak, solve

# profiling and solving the tiny GPT-2 takes ~10 s on a loaded 2-core machine; each test then seconds
pytestmark = pytest.mark.slow

TINY = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=64, seq_len=64, batch_size=4)
STEPS = 4


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.cache
def setup() -> tuple[Workload, Plan]:
    w = load_workload("gpt2", **TINY)
    pristine = copy.deepcopy(w.model)
    g = profile(w.model, w.batch, w.loss_fn, name="gpt2", device="cpu", progress=False, measure=False, repeats=1)
    g.watch_op_dispatch_s = g.replay_op_dispatch_s = 0.0  # as tests/test_executor.py: replays wanted here
    # Op times from the bytes each op reads and writes, not profiled: the plan is then the same on every
    # machine. With profiled times, a loaded 14-worker machine's plan replayed no dropout, and the tests
    # below, which need replays that run one, failed there.
    for op in g.ops:
        op.time_s = 1e-7 + 1e-10 * sum(g.tensors[t].bytes for t in (*op.inputs, *op.outputs))
        op.backward_time_s = 2 * op.time_s
    g.invalidate()
    lo, hi = smallest_known_peak(g), keep_all_report(g).peak_bytes
    plan = solve(g, lo + (hi - lo) // 4, "dp", time_limit_s=2.0).plan
    assert plan.count(Action.RECOMPUTE) > 0
    replayed = {p for e in schedule(g, plan).replays() for p in e.ops}
    assert any(g.ops[p].random for p in replayed), "the plan replays no dropout: the tests below need one"
    w.model = pristine
    return w, plan, g


def dropouts(model: torch.nn.Module) -> list[torch.nn.Dropout]:
    return [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]


def train(model, w, p_at: dict[int, float], ex_of=None, before=None,
          after=None) -> tuple[list[torch.Tensor], list[torch.Tensor], list]:
    """``STEPS`` steps of the unchanged loop; before step ``i`` in ``p_at`` every dropout's probability is
    set to ``p_at[i]`` (a constant of the replayed ``native_dropout`` ops). ``ex_of(opt)``: the executor
    to train under (applied to the loop's optimizer), whose segment counts and replay events are
    returned per step. ``before(i)`` / ``after(i)``: called around step ``i``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    ex = ex_of(opt) if ex_of is not None else None
    losses, seen = [], []
    try:
        for i in range(STEPS):
            if i in p_at:
                for d in dropouts(model):
                    d.p = p_at[i]
            if before is not None:
                before(i)
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(100 + i)
            loss = w.loss_fn(model, w.batch)
            loss.backward()
            losses.append(loss.detach())
            opt.step()
            if after is not None:
                after(i)
            if ex is not None:
                seen.append((dict(ex.segment_stats),
                             [e.key() for e in ex.last_step.events if e.kind == "replay"]))
    finally:
        if ex is not None:
            ex.remove()
    return losses, [p.detach().clone() for p in model.parameters()], seen


def run(p_at: dict[int, float]):
    """Train plain and under the plan; assert bitwise equality; return each step's segment counts and
    replay events, and the schedule's replay events."""
    w, plan, g = setup()
    want_losses, want_params, _ = train(copy.deepcopy(w.model), w, p_at)
    model = copy.deepcopy(w.model)
    executors = []

    def ex_of(opt):
        executors.append(apply(model, plan, graph=g, optimizer=opt))
        return executors[-1]

    losses, params, seen = train(model, w, p_at, ex_of)
    for a, b in zip(losses, want_losses, strict=True):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(params, want_params, strict=True))
    schedule = [e.key() for e in executors[0].schedule.replays()]
    return [s for s, _ in seen], [e for _, e in seen], schedule


def test_replays_are_planned_and_compiled_once_then_reused_by_later_steps():
    stats, events, schedule = run({})
    n = len(schedule)
    assert n > 0
    # every step replays what the schedule says, event for event, compiled or not
    assert events == [schedule] * STEPS
    # the first step plans and traces each replay; every later one reuses both
    assert stats[0] == {"planned": n, "compiled": n}
    assert stats[-1] == {"planned": n, "compiled": n, "plan reused": (STEPS - 1) * n,
                         "compiled reused": (STEPS - 1) * n}


def test_a_changed_constant_is_traced_afresh_and_trains_bitwise():
    stats, events, schedule = run({2: 0.3})
    n = len(schedule)
    w, plan, g = setup()
    random = sum(1 for e in schedule if any(g.ops[p].random for p in e[3]))  # replays that run a dropout
    assert events == [schedule] * STEPS
    assert stats[1].get("recompiled", 0) == 0 and stats[1]["compiled reused"] == n
    changed = stats[2].get("recompiled", 0)
    assert 0 < changed <= random
    # plans are reused throughout (the questions replay() asks do not depend on the constant), and the
    # step after the change reuses the new compilation
    assert stats[-1]["plan reused"] == (STEPS - 1) * n
    assert stats[3]["compiled reused"] - stats[2]["compiled reused"] == n
    assert stats[3].get("recompiled", 0) == changed


def test_a_signature_names_constants_and_geometry_not_values():
    w, plan, g = setup()
    model = copy.deepcopy(w.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    with apply(model, plan, graph=g, optimizer=opt) as ex:
        w.loss_fn(model, w.batch).backward()
        recipes = ex.step_state.recipes
        k, rec = next((k, r) for k, r in recipes.items() if g.ops[k].random and any(type(a) is float for a in r.args))
        sig = recipe_signature(rec)
        again = copy.copy(rec)
        again.args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in rec.args)
        assert recipe_signature(again) == sig  # other tensors of the same geometry: the same signature
        other = copy.copy(rec)
        other.args = tuple(a / 2 if type(a) is float else a for a in rec.args)
        assert recipe_signature(other) != sig  # another probability: another signature
        odd = copy.copy(rec)
        odd.args = (*rec.args, object())
        assert recipe_signature(odd) is None  # nothing it cannot compare: never run compiled


def test_a_replay_is_planned_afresh_when_what_it_reads_differs():
    """A step in which the caller holds some activations (a forward hook keeps every GELU output) answers
    ``replay()``'s questions otherwise: its replays are planned afresh (those tensors are read, not
    rebuilt), never taken from the cache, and training stays bitwise equal."""
    w, plan, g = setup()
    want_losses, want_params, _ = train(copy.deepcopy(w.model), w, {})
    model = copy.deepcopy(w.model)
    held: list[torch.Tensor] = []
    gelus = [m for m in model.modules() if "Activation" in type(m).__name__ or "GELU" in type(m).__name__]
    assert gelus
    executors = []

    def ex_of(opt):
        executors.append(apply(model, plan, graph=g, optimizer=opt))
        return executors[-1]

    def hold(_module, _args, out):
        if hold.on:
            held.append(out)
    hold.on = False
    handles = [m.register_forward_hook(hold) for m in gelus]

    def before(i):
        hold.on = i == 2

    try:
        losses, params, seen = train(model, w, {}, ex_of, before, lambda i: held.clear())
    finally:
        for h in handles:
            h.remove()
    per_step = [stats for stats, _ in seen]
    for a, b in zip(losses, want_losses, strict=True):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(params, want_params, strict=True))
    n = per_step[0]["planned"]
    assert per_step[1]["planned"] == n                 # step 2: all reused
    assert per_step[2]["planned"] > n                  # step 3: the held tensors change some replays
    assert per_step[3]["planned"] == per_step[2]["planned"]  # step 4: as steps 1-2 again, from the cache
