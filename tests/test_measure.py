"""The measurement module (planner/probe/measure.py) and the one training step it runs: exact byte counts
on allocations made on purpose, and the step's phases in order. Seconds each, CPU."""

import copy

import torch
from torch import nn

from memplan.planner.probe.measure import (
    PhaseClock,
    allocation_highs,
    allocator_events,
    allocator_walk,
    cpu_allocations,
    max_prefix,
    measure_rank_step,
    measure_step,
    step_peak,
)
from memplan.planner.workloads import STEP_PHASES, default_optimizer, load_workload, training_step

MIB = 2**20


def _bytes(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def test_one_walk_gives_ranges_highs_and_the_running_sum():
    with allocator_events() as prof:
        with torch._C._profiler._RecordFunctionFast("memplan:1"):
            a, b = _bytes(MIB), _bytes(2 * MIB)
            del a, b
        with torch._C._profiler._RecordFunctionFast("memplan:2"):
            c = _bytes(5 * MIB)
            del c
        d = _bytes(MIB)  # outside any range: in the running sum only
        del d
    walk = allocator_walk(prof)
    assert set(walk.ranges) == {"memplan:1", "memplan:2"}
    assert {r.scope for r in walk.reports if r.bytes >= MIB} == {"memplan:1", "memplan:2", None}
    assert allocation_highs(prof) == {"memplan:1": 3 * MIB, "memplan:2": 5 * MIB}
    reports = cpu_allocations(prof)
    assert [t for t, _ in reports] == sorted(t for t, _ in reports)
    assert sum(size for _, size in reports) == 0
    assert max_prefix([size for _, size in reports]) == 5 * MIB


def _mlp():
    w = load_workload("mlp", depth=2, width=64, batch_size=8)
    return w.model, w.batch, w.loss_fn


def test_training_step_runs_its_phases_in_order_and_returns_the_loss_detached():
    model, batch, loss_fn = _mlp()
    opt = default_optimizer(model)
    seen = []

    def run_phase(phase, fn):
        seen.append(phase)
        return fn()

    expected = loss_fn(model, batch).item()
    loss = training_step(model, batch, loss_fn, opt, run_phase=run_phase)
    assert seen == list(STEP_PHASES)
    assert not loss.requires_grad and loss.item() == expected
    clock = PhaseClock()
    for _ in range(2):
        training_step(model, batch, loss_fn, opt, run_phase=clock)
    assert {p: len(s) for p, s in clock.seconds.items()} == {"forward": 2, "backward": 2, "optimizer": 2}
    assert all(t > 0 for s in clock.seconds.values() for t in s)


def test_step_peak_counts_what_the_setup_holds_inside_the_window():
    """What ``cpu_setup`` allocates is live all through the measured step: the peak grows by exactly its
    bytes, and its free (after the window) is not among the reports."""
    model, batch, loss_fn = _mlp()
    opt = default_optimizer(model)
    training_step(model, batch, loss_fn, opt)
    plain, _ = step_peak(model, batch, loss_fn, opt)
    held, loss = step_peak(model, batch, loss_fn, opt, cpu_setup=lambda: _bytes(3 * MIB))
    assert held.baseline_bytes == plain.baseline_bytes
    assert held.peak_bytes - plain.peak_bytes == 3 * MIB
    assert sum(s for _, s in held.reports) - sum(s for _, s in plain.reports) == 3 * MIB
    assert loss.ndim == 0 and not loss.requires_grad


def test_a_rank_without_an_engine_measures_as_one_process_does():
    """measure_rank_step builds the model inside its window; on a bare model (no DDP, no FSDP) its peak
    and start are measure_step's peak and baseline."""
    model, batch, loss_fn = _mlp()
    rank = measure_rank_step(lambda: (m := copy.deepcopy(model), default_optimizer(m)), batch, loss_fn, warmup=1)
    m = measure_step(copy.deepcopy(model), batch, loss_fn, steps=1, warmup=1)
    assert (rank.peak_bytes, rank.start_bytes) == (m.peak_bytes, m.baseline_bytes)


def test_measure_step_peak_exceeds_its_baseline_by_the_step():
    model = nn.Linear(256, 256)
    batch = torch.randn(64, 256)
    m = measure_step(model, batch, lambda mod, x: mod(x).square().mean(), steps=1, warmup=1)
    # parameters 256*257*4 B, AdamW's two moments and steps, the batch: all live at the start
    assert m.baseline_bytes >= 3 * 256 * 257 * 4 + 64 * 256 * 4
    assert m.peak_bytes >= m.baseline_bytes + 64 * 256 * 4  # at least the output activation
