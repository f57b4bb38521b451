"""Ranks without the ranks (issue #10 item 6): one rank's DDP / FSDP2 step traced in this process under
PyTorch's fake process group. The FSDP2 trace runs under fake tensors and must equal, byte for byte, what
the allocator measures when the same rank runs with real tensors under the same fake group (with gloo's
collective copies left out on both sides: backend "nccl"); it must agree with the for_fsdp transform on a
toy; 8 ranks must trace in one process; bad input is refused in one line. The real 2-process gloo figures
of GPT-2 are compared in docs/benchmarks.md and, for the tiny GPT-2, by the slow test at the end."""

from __future__ import annotations

import copy
import itertools
import json

import pytest
import torch
from typer.testing import CliRunner

from memplan.api.cli import app
from memplan.planner.core.simulator import simulate
from memplan.planner.probe.distributed import (
    DistributedPlanError,
    for_ddp,
    for_fsdp,
    fsdp_units,
)
from memplan.planner.probe.fakepg import (
    FakeProcessGroupError,
    fake_process_group,
    measure_ddp_rank,
    trace_rank_step,
    trace_ranks,
)
from memplan.planner.probe.measure import measure_rank_step
from memplan.planner.probe.optime import OpTimer
from memplan.planner.probe.profiler import profile
from memplan.planner.workloads import default_optimizer

PREFIXES = ["blocks.0", "blocks.1"]


def _loss(m, x):
    return m(x).sum()


@pytest.fixture
def toy(two_blocks):
    torch.manual_seed(0)
    return two_blocks(16, 24), torch.randn(32, 16)


@pytest.fixture
def timer(tmp_path):
    return OpTimer(torch.device("cpu"), cache_dir=tmp_path, min_runs=1, target_s=0.0)


def _fsdp_measured_with_real_tensors(model, batch, world_size: int, rank: int):
    """The allocator's figures for this rank's FSDP2 step: real tensors, fake process group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with fake_process_group(rank, world_size):
        mesh = init_device_mesh("cpu", (world_size,))

        def build():
            m = copy.deepcopy(model)
            for p in PREFIXES:
                fully_shard(m.get_submodule(p), mesh=mesh)
            fully_shard(m, mesh=mesh)
            return m, default_optimizer(m)

        return measure_rank_step(build, batch, _loss, warmup=2, rank=rank)


@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp_trace_under_fake_tensors_equals_the_allocator(toy, timer, world_size):
    model, batch = toy
    traced = trace_rank_step(model, batch, _loss, engine="fsdp", world_size=world_size, rank=world_size - 1,
                             prefixes=PREFIXES, backend="nccl", timer=timer)
    real = _fsdp_measured_with_real_tensors(model, batch, world_size, world_size - 1)
    assert (traced.start_bytes, traced.peak_bytes) == (real.start_bytes, real.peak_bytes)
    units = fsdp_units(model, PREFIXES, world_size)
    assert traced.params_bytes == sum(u.shard_bytes for u in units)
    assert traced.optimizer_state_bytes == 2 * traced.params_bytes + 4 * 5  # exp_avg, exp_avg_sq; 5 steps
    assert traced.collectives > 0 and traced.tensors == "fake"


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_fsdp_trace_agrees_with_the_transform_on_a_toy(toy, timer, backend):
    model, batch = toy
    graph = profile(model, batch, _loss, device="cpu", progress=False, measure=False, repeats=1)
    rank_graph = for_fsdp(graph, fsdp_units(model, PREFIXES, 2), 2, backend=backend)
    traced = trace_rank_step(model, batch, _loss, engine="fsdp", world_size=2, prefixes=PREFIXES,
                             backend=backend, timer=timer)
    predicted = simulate(rank_graph).peak_bytes
    # the transform scales all optimizer state by 1/N, but AdamW's step counters (one 4-byte scalar per
    # parameter) are whole on every rank: it under-counts them by half, and the trace does not
    steps_bytes = 4 * len(list(model.parameters()))
    assert traced.params_bytes == rank_graph.fixed.params_bytes
    assert traced.optimizer_state_bytes - rank_graph.fixed.optimizer_state_bytes == steps_bytes // 2
    if backend == "nccl":
        assert traced.peak_bytes - predicted == steps_bytes // 2
    else:
        # under gloo the transform charges each collective's copy on top of its neighbours' buffers where
        # the step holds less (the traced figure is what 2 real gloo processes measure on rank 0 of this toy:
        # 20,396 B; docs/benchmarks.md)
        assert traced.peak_bytes < predicted


def test_eight_fsdp_ranks_trace_in_one_process(toy, timer):
    model, batch = toy
    ranks = trace_ranks(model, batch, _loss, engine="fsdp", world_size=8, prefixes=PREFIXES, timer=timer)
    assert [r.rank for r in ranks] == list(range(8))
    assert len({(r.peak_bytes, r.start_bytes) for r in ranks}) == 1  # padded shards: every rank the same
    two = trace_rank_step(model, batch, _loss, engine="fsdp", world_size=2, prefixes=PREFIXES, timer=timer)
    assert ranks[0].params_bytes < two.params_bytes  # 1/8 of the parameters, not 1/2


def test_ddp_rank_with_real_tensors_equals_the_transform(toy):
    model, batch = toy
    graph = profile(model, batch, _loss, device="cpu", progress=False, measure=False, repeats=1)
    measured = measure_ddp_rank(model, batch, _loss, world_size=4, rank=3)
    assert measured.tensors == "real"
    params = sum(p.numel() * 4 for p in model.parameters())
    assert measured.params_bytes == params and measured.engine_bytes == params  # the gradient buckets
    assert measured.peak_bytes == simulate(for_ddp(graph, 4)).peak_bytes


def test_ddp_cannot_run_on_fake_tensors_in_this_torch():
    # why DDP ranks are measured with real tensors: the reducer reads tensor data in C++ (here the bucket
    # indices it broadcasts when it rebuilds its buckets, in the second forward). When a torch release
    # lets this pass, measure_ddp_rank can become a fake trace like FSDP2's.
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.parallel import DistributedDataParallel

    from memplan.planner.probe.fakepg import _allreduce_in_place

    with fake_process_group(0, 2), FakeTensorMode():
        model = torch.nn.Linear(4, 4)
        ddp = DistributedDataParallel(model, init_sync=False)
        ddp.register_comm_hook(None, _allreduce_in_place)
        with pytest.raises(RuntimeError, match="data is not allocated yet"):
            for _ in range(2):
                ddp(torch.randn(2, 4)).sum().backward()
    assert not dist.is_initialized()


@pytest.mark.parametrize(("kwargs", "error", "text"), [
    ({"engine": "zero", "world_size": 2}, DistributedPlanError, "engine 'zero'"),
    ({"engine": "fsdp", "world_size": 0}, DistributedPlanError, "world size 0"),
    ({"engine": "fsdp", "world_size": 2, "rank": 2}, DistributedPlanError, "rank 2 of world size 2"),
    ({"engine": "fsdp", "world_size": 2, "prefixes": ["blocks.9"]}, DistributedPlanError, "'blocks.9'"),
    ({"engine": "fsdp", "world_size": 2, "backend": "mpi"}, DistributedPlanError, "backend 'mpi'"),
])
def test_bad_set_ups_are_refused_naming_the_culprit(toy, kwargs, error, text):
    model, batch = toy
    with pytest.raises(error, match=text):
        trace_rank_step(model, batch, _loss, **kwargs)


def test_a_model_fully_shard_refuses_is_one_line(timer):
    class Stages(torch.nn.Module):  # units that are containers without a forward: fully_shard refuses them
        def __init__(self):
            super().__init__()
            self.stages = torch.nn.ModuleList([torch.nn.ModuleList([torch.nn.Linear(4, 4)]) for _ in range(2)])

        def forward(self, x):
            for stage in self.stages:
                for layer in stage:
                    x = layer(x)
            return x

    with pytest.raises(FakeProcessGroupError, match="fully_shard does not support containers") as e:
        trace_rank_step(Stages(), torch.randn(2, 4), _loss, engine="fsdp", world_size=2,
                        prefixes=["stages.0", "stages.1"], timer=timer)
    assert "\n" not in str(e.value)


def test_a_real_process_group_is_not_replaced():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(FakeProcessGroupError, match="already initialised"), fake_process_group(0, 2):
            pass
    finally:
        dist.destroy_process_group()


# ---- the CLI ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "text"), [
    (["plan", "mlp", "--fake", "--nproc", "2", "--engine", "zero"], "--engine 'zero': choose ddp or fsdp"),
    (["plan", "mlp", "--fake", "--nproc", "0"], "--nproc 0: need at least 1 rank"),
    (["run", "mlp", "--fake", "--nproc", "-1"], "--nproc -1: need at least 1 rank"),
    (["run", "mlp", "--fake", "--nproc", "2", "--engine", "zero"], "--engine 'zero': choose ddp or fsdp"),
    (["profile", "mlp", "--nproc", "2"], "memplan profile --nproc 2 needs --fake"),
    (["plan", "mlp", "--fake", "--nproc", "2", "--budget", "lots"], "lots"),
])
def test_cli_refuses_bad_rank_options_in_one_line(argv, text):
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2, result.output
    assert text in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_cli_prints_every_ranks_traced_and_predicted_peak(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path))
    argv = ["plan", "mlp", "--set", "depth=2", "--set", "width=32", "--set", "batch_size=8", "--fake",
            "--nproc", "4", "--engine", "fsdp", "--budget", "1MiB", "--time-limit", "2", "--json"]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    keep = [r for r in doc["ranks"] if r["plan"] == "keep all"]
    assert [r["rank"] for r in keep] == [0, 1, 2, 3]
    for r in keep:
        assert r["traced_peak_bytes"] > r["traced_start_bytes"] > 0
        assert r["trace"]["world_size"] == 4 and r["trace"]["engine"] == "fsdp"
    assert any(r["plan"] != "keep all" for r in doc["ranks"])


# ---- against two real gloo processes -----------------------------------------------------------------------


TINY_GPT2 = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 512, "seq_len": 32, "batch_size": 2}


def _gloo_fsdp_rank(rank: int, out_dir: str) -> None:
    """One of 2 real gloo ranks: the tiny GPT-2 under FSDP2, its step measured from the allocator as
    ``memplan run --nproc`` measures it (keep everything)."""
    import datetime
    from pathlib import Path

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from memplan.api.distributed import block_prefixes
    from memplan.planner.workloads import load_workload

    torch.set_num_threads(1)
    # a file store in the test's folder: a TCP port picked by the parent could be taken by another test's
    # processes before rank 0 binds it
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    wl = load_workload("gpt2", **TINY_GPT2)

    # a CPU mesh: without one fully_shard moves the shards to a GPU wherever one is visible
    mesh = init_device_mesh("cpu", (2,))

    def build():
        m = copy.deepcopy(wl.model)
        for p in block_prefixes(m):
            fully_shard(m.get_submodule(p), mesh=mesh)
        fully_shard(m, mesh=mesh)
        return m, default_optimizer(m)

    r = measure_rank_step(build, wl.batch, wl.loss_fn, warmup=2, rank=rank)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(r.as_dict()))
    dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp_traced_ranks_match_two_real_gloo_processes(tmp_path):
    """The tiny GPT-2 of tests/test_distributed.py under FSDP2: each rank's traced start and peak against
    the allocator's in 2 real gloo processes. gloo itself keeps a few bytes the fake group cannot show (88 B
    on this model: docs/model.md), so the trace may be below the real figure by at most 0.01%, never above.

    The real figure may also hold units' all-gather outputs more (one, or in a clean-clone CI run two:
    3,198,160 B against 2,798,200 B), by a race between the ranks' threads
    (docs/model.md, "Measuring a rank on CPU"): gloo's work object holds the gathered buffer, and when the
    rank's worker thread drops it after the main thread, late (the rank had waited for its peer; on 2
    shared cores the worker is then often descheduled), the free is made on a thread the profiler does not
    follow and its time is unknown: the measurement keeps the buffer until its address is reused. Seen in
    full-suite runs (2,998,224 B against 2,798,288 B) and made to appear by delaying one rank's backward.
    Held during the step, such a buffer can move the peak to an earlier moment: the peak then reads more by
    less than the buffer (6 of 80 rank measurements: +16,384 B), never less than the trace."""
    import torch.multiprocessing as mp

    from memplan.api.distributed import block_prefixes
    from memplan.planner.workloads import load_workload

    mp.spawn(_gloo_fsdp_rank, args=(str(tmp_path),), nprocs=2, join=True)
    real = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)}
    wl = load_workload("gpt2", **TINY_GPT2)
    timer = OpTimer(torch.device("cpu"), cache_dir=tmp_path / "cache", min_runs=1, target_s=0.0)
    traced = trace_ranks(wl.model, wl.batch, wl.loss_fn, engine="fsdp", world_size=2,
                         prefixes=block_prefixes(wl.model), timer=timer)
    units = [u.unsharded_bytes for u in fsdp_units(wl.model, block_prefixes(wl.model), 2)]
    # the buffers of any set of units may be held late, each at most once
    late_frees = {sum(c) for k in range(len(units) + 1) for c in itertools.combinations(units, k)}
    for t in traced:
        for what in ("peak_bytes", "start_bytes"):
            measured, fake = real[t.rank][what], getattr(t, what)
            exact = any(0 <= measured - late - fake <= 1e-4 * measured for late in late_frees)
            # a buffer held late during the step can move the peak to another moment, where the step holds
            # less: the peak then reads more than the trace's by less than the buffer (seen: 16,384 B, a unit
            # of 199,936 B held at a moment 16 KiB under the peak). The start is one moment: exact there.
            shifted = what == "peak_bytes" and 0 <= measured - fake <= max(late_frees)
            assert exact or shifted, (t.rank, what, measured, fake, sorted(late_frees))
