"""The emulated GPU's capacity (``emulate_cuda(capacity_bytes=...)``, planner/probe/device.py): "does not fit"
proved on a CPU.

* the capacity itself: an allocation past it raises ``torch.OutOfMemoryError`` as CUDA does, before the caller
  gets the tensor; a free makes room; host buffers, views and copies' sources are not charged; a model made
  before the block is charged at its first use; without a capacity nothing is counted and no mode is entered;
* a real model whose parameters and AdamW state alone exceed the capacity: plain training runs out of memory;
  a plan made from a fake profile, streaming the optimizer state through the device, trains within it, its
  measured peak within the budget and within 0.5% of the prediction, equal to plain training on an unlimited
  device.
"""

from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys

import pytest
import torch
from test_states import assert_same_training, small_llama, train_under
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from memplan.planner.core.errors import MemplanError
from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Plan
from memplan.planner.probe.device import (
    CAPACITY_ENV,
    EMULATE_ENV,
    DeviceMemory,
    device_of,
    emulate_cuda,
    emulation,
)
from memplan.planner.probe.profiler import profile
from memplan.planner.workloads import Workload
from memplan.solvers import SolveResult, solve

pytestmark = pytest.mark.usefixtures("one_thread")  # bitwise comparisons (see conftest.one_thread)

KiB = 1024


# ---- the capacity ------------------------------------------------------------------------------------------

def test_an_allocation_past_the_capacity_raises_as_cuda_does_and_a_free_makes_room():
    with emulate_cuda(capacity_bytes=10 * KiB) as gpu:
        assert gpu.total_memory() == 10 * KiB and device_of("cuda") is gpu
        a = torch.empty(1000)  # 4000 B, charged 4096 (512-byte blocks)
        b = torch.empty(1)  # 4 B, charged 512
        assert gpu.memory.allocated_bytes == 4096 + 512
        with pytest.raises(torch.OutOfMemoryError,
                           match=r"^CUDA out of memory\. Tried to allocate 8\.00 KiB .*\(emulated capacity 10240 B; "
                                 r"4608 B allocated\)$"):
            torch.empty(2048)
        assert gpu.memory.allocated_bytes == 4096 + 512  # the refused tensor is not held
        del a  # its storage's last reference: the bytes go back
        assert gpu.memory.allocated_bytes == 512
        c = torch.empty(2048)
        assert gpu.memory.allocated_bytes == 512 + 8192 == gpu.memory.max_allocated_bytes
        v = c.view(2, 1024)[0]  # a view allocates nothing, and keeps its storage
        del c
        assert gpu.memory.allocated_bytes == 512 + 8192
        del v, b
        assert gpu.memory.allocated_bytes == 0


def test_a_storage_that_grows_is_charged_its_new_size_and_one_resized_away_is_given_back():
    with emulate_cuda(capacity_bytes=40 * KiB) as gpu:
        a = torch.empty(1024)
        a.resize_(4096)  # CUDA: a new block, the old one live while it is copied
        assert gpu.memory.allocated_bytes == 16 * KiB and gpu.memory.max_allocated_bytes == 20 * KiB
        with pytest.raises(torch.OutOfMemoryError):
            a.resize_(8192)
        a.untyped_storage().resize_(0)  # outside the dispatcher: seen at the storage's next use
        total = a.resize_(0).sum()
        assert gpu.memory.allocated_bytes == 512 and total == 0  # the sum's


def test_autograd_and_the_optimizer_are_charged_and_refused_too():
    """Backward's ops (a CPU backward runs on the calling thread, with its modes) and foreach updates."""
    lin = torch.nn.Linear(64, 64, bias=False)  # 16 KiB of weight
    opt = torch.optim.AdamW(lin.parameters(), foreach=True)
    x = torch.ones(4, 64)
    with emulate_cuda(capacity_bytes=40 * KiB) as gpu:
        lin(x).sum().backward()  # weight (read: charged at first use), input, gradient: under 40 KiB
        assert lin.weight.grad is not None and gpu.memory.allocated_bytes >= 32 * KiB
        with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
            opt.step()  # two more 16 KiB states do not fit
    with emulate_cuda(capacity_bytes=24 * KiB):
        lin.weight.grad = None
        with pytest.raises(torch.OutOfMemoryError):
            lin(x).sum().backward()  # weight + its gradient + the activations


def test_host_buffers_views_and_the_sources_of_copies_are_not_charged():
    outside = torch.nn.Linear(256, 256)  # made before the block: a host model
    with emulate_cuda(capacity_bytes=1024 * KiB) as gpu:
        pool = gpu.pinned_empty(512 * KiB)  # host memory, however large
        assert gpu.memory.allocated_bytes == 0
        pool[:KiB].fill_(1)
        _ = pool[: 4 * KiB].view(torch.float32)
        assert gpu.memory.allocated_bytes == 0
        inside = copy.deepcopy(outside)  # a copy reads its source where it is: counted once, as its copy
        weight = -(-inside.weight.nbytes // 512) * 512
        bias = -(-inside.bias.nbytes // 512) * 512
        assert gpu.memory.allocated_bytes == weight + bias
        # a tensor an op computes with is the device's (a model moved to the GPU before the block)
        (outside.weight * 2).sum()
        assert gpu.memory.allocated_bytes >= 2 * weight + bias


def test_without_a_capacity_nothing_is_counted_and_no_mode_is_entered():
    before = list(_get_current_dispatch_mode_stack())
    with emulate_cuda() as gpu:
        assert gpu.memory is None and gpu.total_memory() is None and gpu.capacity_bytes is None
        assert list(_get_current_dispatch_mode_stack()) == before
        torch.empty(10**6)
        with gpu.host_side():
            pass
    with emulate_cuda(capacity_bytes=KiB) as gpu:
        assert isinstance(_get_current_dispatch_mode_stack()[-1], DeviceMemory)
    assert list(_get_current_dispatch_mode_stack()) == before


def test_the_capacity_leaves_the_mode_stack_when_a_failed_step_left_a_mode_above_it():
    """A step that ran out of memory inside another dispatch mode (an executor's, before its removal)."""
    class Other(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    other = Other()
    with pytest.raises(torch.OutOfMemoryError), emulate_cuda(capacity_bytes=KiB):
        other.__enter__()
        torch.empty(10**4)
    assert _get_current_dispatch_mode_stack() == [other]
    other.__exit__(None, None, None)


def test_the_environment_sets_the_capacity_for_a_process():
    code = ("import torch\n"
            "from memplan.planner.probe.device import device_of\n"
            "gpu = device_of('cuda')\n"
            "print(gpu.total_memory())\n"
            "a = torch.empty(256)\n"
            "try:\n"
            "    torch.empty(1024)\n"
            "except torch.OutOfMemoryError as e:\n"
            "    print(type(e).__name__)\n")
    env = {**os.environ, EMULATE_ENV: "1", CAPACITY_ENV: "2KiB"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2048", "OutOfMemoryError"]


def test_a_capacity_the_environment_gives_that_is_not_a_size_is_one_clear_error(monkeypatch):
    monkeypatch.setenv(EMULATE_ENV, "1")
    monkeypatch.setenv(CAPACITY_ENV, "lots")
    with pytest.raises(MemplanError, match=f"{CAPACITY_ENV}='lots': cannot read size"):
        emulation()


# ---- a model whose states do not fit -------------------------------------------------------------------------

@functools.cache
def llama_plan() -> tuple[Workload, Graph, SolveResult, int]:
    """:func:`test_states.small_llama` profiled fake on the emulated GPU (nothing of the step allocated), and a
    plan at a budget of 90% of its parameters and optimizer state, with the model states streamed."""
    w = small_llama()
    with emulate_cuda():
        g = profile(copy.deepcopy(w.model), w.batch, w.loss_fn, device="cuda", fake=True, progress=False)
    budget = int((g.fixed.params_bytes + g.fixed.optimizer_state_bytes) * 0.9)
    return w, g, solve(g, budget, offload=True, states="stream", time_limit_s=4), budget


def test_plain_training_of_a_model_whose_states_exceed_the_capacity_runs_out_of_memory():
    w, g, _, capacity = llama_plan()
    assert g.fixed.params_bytes + g.fixed.optimizer_state_bytes > capacity
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        train_under("llama", None, g, steps=3, w=w, capacity_bytes=capacity)


def test_a_fake_profiled_plan_trains_within_a_capacity_its_states_exceed_as_plain_training_does():
    """The plan's budget is the capacity; every allocation of six steps (three, then measure_step's warm-up,
    measured and timed ones) fits it; the measured peak is within the budget and 0.5% of the prediction;
    the parameters and the optimizer state equal plain training's on an unlimited device, bitwise."""
    w, g, result, budget = llama_plan()
    plan: Plan = result.plan
    assert plan.streamed() and result.report.peak_bytes <= budget
    with emulate_cuda():
        plain = train_under("llama", None, g, steps=3, w=w)
    planned = train_under("llama", plan, g, steps=3, w=w, capacity_bytes=budget)
    assert_same_training(planned, plain)
    states, plain_states = planned[3]["state"], plain[3]["state"]  # by parameter (stepped in another order)
    assert states.keys() == plain_states.keys()
    for k, s in states.items():
        assert s.keys() == plain_states[k].keys() and all(torch.equal(s[n], plain_states[k][n]) for n in s), k
    predicted = result.report.peak_bytes
    assert planned[2] <= budget < g.fixed.params_bytes + g.fixed.optimizer_state_bytes
    assert abs(planned[2] - predicted) <= 0.005 * predicted, (planned[2], predicted)
