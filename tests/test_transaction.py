"""A step under a plan is a transaction: whatever ends it, the next step starts clean, nothing stays
allocated that plain PyTorch would free, and training ends where plain PyTorch (or plain fused PyTorch)
ends.

Each case trains four steps of a tiny model; the third is first attempted with a fault (an exception in a
layer's forward hook, in ``loss_fn`` after the model, in backward (a tensor hook on a module's output, an
exception or a ``KeyboardInterrupt``), in a module's backward hook, in the optimizer's step; a
``KeyboardInterrupt`` in forward; an out-of-memory error in a replay or in a prefetch; a forward whose backward
never runs), then recovered from (the loop retries under the same executor; the executor is removed and
applied again; an evaluation forward runs first), then retried. Plain training runs the same loop; losses,
parameters and the optimizer's step counts must be equal bitwise, and the CPU allocator's own reports over
the whole sequence must show no byte left allocated once the loop drops its references (plain PyTorch leaves
none either).

A fault inside backward leaves, under backward fusion, the modules stepped before it updated (as PyTorch's
optimizer-in-backward does): plain training's oracle for those is the same batch's full backward, then a step
of exactly the parameters the planned run stepped in the failed attempt (none without backward fusion), and
the retry.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import pytest
import torch
from test_executor import TINY, fresh_model, graph_of, plan_of, workload
from torch.utils._python_dispatch import _get_current_dispatch_mode

from memplan.executor import apply
from memplan.executor.step import Step
from memplan.planner.probe.fusion import narrowed_groups
from memplan.planner.probe.measure import allocator_events, cpu_allocations

pytestmark = pytest.mark.usefixtures("one_thread")

FAULTS = ("forward", "interrupt", "loss", "backward", "optimizer", "no_backward")
# faults raised inside backward (the optimizer's step is one under backward fusion)
IN_BACKWARD = ("backward", "backward_interrupt", "backward_hook", "replay_oom", "prefetch_oom")
EXECUTOR_FAULTS = {"replay_oom": "_replay", "prefetch_oom": "_prefetch"}  # Step methods that fail once
RECOVERIES = ("retry", "reenter", "eval")
STEPS, FAULTY = 4, 2


class Fault(Exception):
    """The injected failure."""


def _inner_module(model: torch.nn.Module) -> torch.nn.Module:
    """A module in the middle of the model (its forward hook fires mid-forward)."""
    mods = [m for m in model.modules() if not list(m.children()) and list(m.parameters(recurse=False))]
    return mods[len(mods) // 2]


def _raise(kind: str) -> None:
    raise KeyboardInterrupt() if "interrupt" in kind else Fault(kind)


_FIRED: list[list[int]] = []  # per run_case: how many injected executor faults fired


def _count_executor_faults() -> list[int]:
    _FIRED.append([0])
    return _FIRED[-1]


def _fails_once(name: str) -> Callable[[], None]:
    """Make ``Step.<name>`` (a replay, a prefetch) raise an out-of-memory error at its first call; returns
    the undo. The error is CUDA's (``torch.OutOfMemoryError``), as a GPU's allocator raises it there."""
    real = getattr(Step, name)
    armed = [True]

    def failing(self, *args, **kwargs):
        if armed[0]:
            armed[0] = False
            if _FIRED:
                _FIRED[-1][0] += 1
            raise torch.OutOfMemoryError(f"injected: out of memory in {name}")
        return real(self, *args, **kwargs)

    setattr(Step, name, failing)
    return lambda: setattr(Step, name, real)


def _step_counts(opt: torch.optim.Optimizer) -> dict[int, int]:
    return {id(p): int(opt.state[p]["step"]) for g in opt.param_groups for p in g["params"]
            if "step" in opt.state.get(p, {})}


def _loop(name: str, model: torch.nn.Module, opt: torch.optim.Optimizer, fault: str, recovery: str,
          make_executor: Callable[[], object] | None, partial: list[int] | None = None,
          failed_steps: list[weakref.ref] | None = None) -> list[torch.Tensor]:
    """The training loop, under the plan (``make_executor``) or plain. Under the plan, ``partial`` receives
    the indices of the parameters the failed attempt stepped (backward fusion steps modules inside
    backward) and ``failed_steps`` a reference to the failed attempt's :class:`Step`; plain, ``partial``
    says which parameters the failed attempt's oracle steps."""
    w = workload(name)
    losses: list[torch.Tensor] = []
    ex = make_executor() if make_executor else None
    params = list(model.parameters())
    for step in range(STEPS):
        attempts = ("fault", "ok") if step == FAULTY else ("ok",)
        for attempt in attempts:
            faulty = attempt == "fault"
            handles, undo = [], []
            oracle = faulty and ex is None and (fault in IN_BACKWARD or fault == "optimizer")
            if faulty and not oracle:
                if fault in ("forward", "interrupt"):
                    handles.append(_inner_module(model).register_forward_hook(lambda *_a, k=fault: _raise(k)))
                if fault in ("backward", "backward_interrupt", "backward_hook"):
                    def tensor_hook(_m, _a, out, k=fault):
                        if k == "backward_hook":  # a hook on the module's autograd node, before it runs
                            out.grad_fn.register_prehook(lambda _g: _raise(k))
                        else:  # the module's backward, as a custom autograd function's raising would
                            out.register_hook(lambda _g: _raise(k))
                    handles.append(_inner_module(model).register_forward_hook(tensor_hook))
                if fault == "optimizer":
                    handles.append(opt.register_step_pre_hook(lambda *_a: _raise("optimizer")))
                if fault in EXECUTOR_FAULTS:
                    undo.append(_fails_once(EXECUTOR_FAULTS[fault]))
            before = _step_counts(opt) if faulty and ex is not None else None
            try:
                opt.zero_grad(set_to_none=True)
                torch.manual_seed(1000 + step)
                loss = w.loss_fn(model, w.batch)
                if faulty and fault == "loss":
                    raise Fault("loss")
                if faulty and fault == "no_backward":
                    del loss  # the loop skips the batch (a loss that is not finite)
                    continue
                loss.backward()
                if oracle:
                    # plain training's outcome of the failed attempt: the parameters the planned run stepped
                    # before the fault are stepped with this batch's gradients, nothing else
                    chosen = [params[i] for i in partial or ()]
                    if chosen:
                        with narrowed_groups(opt, chosen):
                            opt.step()
                    del loss
                    continue
                opt.step()
                if not faulty:
                    losses.append(loss.detach())
                del loss
            except (Fault, KeyboardInterrupt, torch.OutOfMemoryError):
                pass
            finally:
                for h in handles:
                    h.remove()
                for u in undo:
                    u()
            if faulty:
                if before is not None and partial is not None:
                    after = _step_counts(opt)
                    partial.extend(i for i, p in enumerate(params) if after.get(id(p)) != before.get(id(p)))
                if failed_steps is not None and ex is not None:
                    failed = ex.step_state or ex.last_step
                    if failed is not None:
                        failed_steps.append(weakref.ref(failed))
                    del failed
                # the step is over: nothing of it is left active for the loop's own code, at once when the
                # exception left the model's forward, else from the loop's next zero_grad() (or forward)
                if fault in ("forward", "interrupt"):
                    assert _get_current_dispatch_mode() is None
                opt.zero_grad(set_to_none=True)
                assert _get_current_dispatch_mode() is None
                assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
                if recovery == "reenter" and ex is not None:
                    ex.remove()
                    ex = make_executor()
                if recovery == "eval":
                    model.eval()
                    with torch.no_grad():
                        w.loss_fn(model, w.batch)
                    model.train()
            elif failed_steps:
                # the failed attempt's Step (and what it held) went with the step after it, by reference
                # counting: not only at remove() or a collection
                assert all(r() is None for r in failed_steps), "the failed step is still referenced"
    if ex is not None:
        ex.remove()
    return losses


def _state(opt: torch.optim.Optimizer) -> list[int]:
    return [int(s["step"]) for s in opt.state.values() if "step" in s]


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)


def _planned(name: str, plan: object, fuse: str | None, fault: str, recovery: str, partial: list[int],
             failed_steps: list[weakref.ref] | None = None, refs: list[weakref.ref] | None = None):
    model = fresh_model(name)
    opt = _adamw(model)

    def make():
        ex = apply(model, plan, graph=graph_of(name), optimizer=opt, fuse=fuse)
        if refs is not None:
            refs.append(weakref.ref(ex))
        return ex

    return model, opt, lambda: _loop(name, model, opt, fault, recovery, make, partial, failed_steps)


def _warm(name: str, fuse: str | None, fault: str, recovery: str, plan: object) -> None:
    """Both sequences once, unmeasured: what a process allocates once and keeps (kernels' and the autograd
    engine's first-use buffers) must not count as a leak of whichever sequence ran first."""
    partial: list[int] = []
    _planned(name, plan, fuse, fault, recovery, partial)[2]()
    model = fresh_model(name)
    _loop(name, model, _adamw(model), fault, recovery, None, partial)
    gc.collect()


def run_case(name: str, fuse: str | None, fault: str, recovery: str, plan_kind: str = "dp") -> None:
    plan = plan_of(name, plan_kind, offload=plan_kind != "dp")
    _warm(name, fuse, fault, recovery, plan)
    # under the plan, inside the allocator's reports
    refs: list[weakref.ref] = []
    partial: list[int] = []
    failed_steps: list[weakref.ref] = []
    fired = _count_executor_faults() if fault in EXECUTOR_FAULTS else None
    # forward fusion applies the last step's pending updates in the failed attempt's forward: its changes
    # are not the failure's, and are not compared
    measured = partial if fuse != "forward" else None
    model, opt, run = _planned(name, plan, fuse, fault, recovery, measured, failed_steps, refs)
    before = {id(p): p.detach().clone() for p in model.parameters()}
    with allocator_events() as prof:
        got = run()
        opt.zero_grad(set_to_none=True)
        gc.collect()
    leaked = sum(size for _, size in cpu_allocations(prof))
    if fired is not None:
        assert fired[0] == 1, f"the plan ran no {EXECUTOR_FAULTS[fault]}: the fault was never injected"
    if fuse != "backward":
        assert not partial, "a step that failed changed parameters without backward fusion"
    elif fault in ("backward", "backward_interrupt", "backward_hook"):
        assert partial, "backward fusion stepped nothing before a fault in the middle of backward"
    # plain PyTorch under the same faults (inside backward: the oracle of the failed attempt)
    plain = fresh_model(name)
    plain_opt = _adamw(plain)
    with allocator_events() as prof:
        want = _loop(name, plain, plain_opt, fault, recovery, None, partial)
        plain_opt.zero_grad(set_to_none=True)
        gc.collect()
    plain_leaked = sum(size for _, size in cpu_allocations(prof))
    assert len(got) == len(want) == STEPS
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"loss of step {i}: {a.item()!r} under the plan, {b.item()!r} plain"
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)
    counts = [STEPS + (i in partial) for i, p in enumerate(model.parameters())]
    assert [int(opt.state[p]["step"]) for p in model.parameters()] == counts
    assert [int(plain_opt.state[p]["step"]) for p in plain.parameters()] == counts
    assert any(not torch.equal(before[id(p)], p) for p in model.parameters())
    assert all(r() is None for r in refs), "a removed executor is still alive"
    # what the sequence allocated and never freed: the first step's optimizer state (updated in place after),
    # as plain PyTorch's sequence, measured alike, leaves it; nothing more
    assert leaked == plain_leaked, f"{leaked - plain_leaked} B more never freed than plain PyTorch"


ALL_FAULTS = (*FAULTS, "backward_interrupt", "backward_hook", "replay_oom", "prefetch_oom")


def _kind(fault: str, default: str = "dp") -> str:
    """A prefetch fails only under a plan that offloads, a replay under one that recomputes."""
    return {"prefetch_oom": "greedy", "replay_oom": "dp"}.get(fault, default)


@pytest.mark.parametrize(("fault", "recovery"), [
    *((f, "retry") for f in ALL_FAULTS), *((f, r) for f in ("forward", "loss", "no_backward") for r in RECOVERIES[1:])])
def test_mlp_recovers_from_every_fault(fault, recovery):
    run_case("mlp", None, fault, recovery, _kind(fault))


@pytest.mark.parametrize("fault", ALL_FAULTS)
@pytest.mark.parametrize("fuse", ["backward", "forward"])
def test_fused_steps_recover(fuse, fault):
    run_case("mlp", fuse, fault, "retry", _kind(fault))


@pytest.mark.parametrize("fault", FAULTS)
def test_offload_plans_recover(fault):
    run_case("mlp", None, fault, "retry", plan_kind="greedy")


# a transformer and a CNN, recompute and offload plans: every fault inside backward under backward fusion (its
# partial steps), and the executor's own out-of-memory faults unfused and forward-fused (the MLP cases above
# run every fault under every fusion)
MODEL_CASES = [(name, kind) for name in ("gpt2", "resnet") for kind in ("dp", "greedy")]
IN_BACKWARD_CASES = [*((f, "backward") for f in (*IN_BACKWARD, "optimizer")),
                     ("replay_oom", None), ("prefetch_oom", None), ("replay_oom", "forward"), ("prefetch_oom", "forward")]


@pytest.mark.slow
@pytest.mark.parametrize(("fault", "fuse"), IN_BACKWARD_CASES)
def test_a_transformer_and_a_cnn_recover_from_faults_in_backward(fault, fuse):
    name, kind = MODEL_CASES[IN_BACKWARD_CASES.index((fault, fuse)) % len(MODEL_CASES)]
    run_case(name, fuse, fault, "retry", _kind(fault, kind))


@pytest.mark.slow
@pytest.mark.parametrize(("name", "fuse", "fault"), [
    ("gpt2", None, "forward"), ("gpt2", None, "no_backward"), ("bert", None, "no_backward")])
def test_transformers_recover(name, fuse, fault):
    run_case(name, fuse, fault, "retry")


def test_a_forward_without_backward_frees_what_plain_pytorch_frees():
    """The issue's leak: forward, no backward, on GPT-2: every activation goes when the loop drops the
    loss (no reference cycle through autograd), and the executor and the model go after remove()."""
    name = "gpt2"
    w = workload(name)
    model = fresh_model(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    ex = apply(model, plan_of(name, "dp"), graph=graph_of(name), optimizer=opt)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        w.loss_fn(model, w.batch).backward()
        opt.step()
    with allocator_events() as prof:
        loss = w.loss_fn(model, w.batch)
        del loss
        gc.collect()
    assert sum(size for _, size in cpu_allocations(prof)) == 0
    ex.remove()
    ref = weakref.ref(ex)
    del ex
    gc.collect()
    assert ref() is None
    assert TINY[name]


@pytest.mark.parametrize(("fuse", "offload"), [(None, False), ("backward", False), ("forward", False),
                                               (None, True)])
def test_a_removed_executor_its_model_and_optimizer_are_freed_without_a_collection(fuse, offload):
    """Plain PyTorch frees a model and its optimizer the moment the loop drops them. After ``remove()`` the
    executor must not hold them in reference cycles (its mode, its steps, its saved-tensor hooks and the
    optimizer's shadows referred back to it), else a GPU keeps a whole model and optimizer state until the
    next collection: an acceptance run on an H100 held 45 GiB of earlier runs' models that way, and the
    next model did not fit. Checked with the collector off."""
    name = "mlp"
    w = workload(name)
    model = fresh_model(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    ex = apply(model, plan_of(name, "dp", offload=offload), graph=graph_of(name), optimizer=opt, fuse=fuse)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        w.loss_fn(model, w.batch).backward()
        opt.step()
    ex.remove()
    refs = [weakref.ref(o) for o in (model, opt, ex)]
    gc.collect()
    gc.disable()
    try:
        del model, opt, ex
        assert [r() is None for r in refs] == [True, True, True]
    finally:
        gc.enable()
