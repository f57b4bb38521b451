"""Plans under torch.distributed: 2 processes, gloo on CPU (127.0.0.1), spawned with bounded timeouts.

Each rank trains the same tiny GPT-2 (dropout on, so replays must restore the RNG) on its own batch, once
under plain DDP / FSDP2 and once per plan, from the same initial weights and seed; the losses and the
final parameters must be bitwise equal. One spawn per engine runs every scenario, so the file pays for
process start-up twice."""

from __future__ import annotations

import copy
import datetime
import json
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from memplan.planner.core.plan import Action, Plan

pytestmark = pytest.mark.slow

WORLD = 2
TINY = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 512, "seq_len": 32, "batch_size": 2}
STEPS = 2
SPAWN_TIMEOUT_S = 120


def _spawn(worker, tmp_path: Path) -> list[dict]:
    """Run ``worker(rank, out_dir)`` on WORLD processes; every rank writes rank{r}.json."""
    ctx = mp.spawn(worker, args=(str(tmp_path),), nprocs=WORLD, join=False)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"distributed workers did not finish within {SPAWN_TIMEOUT_S} s")
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]


# ---- what runs on each rank ------------------------------------------------------------------------------


def _init(rank: int, out_dir: str) -> None:
    torch.set_num_threads(1)  # two ranks share the machine's cores
    # a file store in the spawn's own folder: a TCP port picked by the parent could be taken by another
    # test's processes before rank 0 binds it (the suite runs two files at once)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))


def _leave() -> None:
    """End a rank after its results are written, without the interpreter's finalization: gloo's threads
    can still hold work referencing Python objects, and tearing them down aborted a rank in CI (SIGABRT,
    "terminate called without an active exception", pytorch/pytorch#179291); memplan run --nproc does so."""
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _workload(rank: int):
    from memplan.planner.workloads import load_workload

    wl = load_workload("gpt2", **TINY)
    g = torch.Generator().manual_seed(1000 + rank)  # every rank its own data
    batches = [{"input_ids": torch.randint(0, TINY["vocab_size"], (TINY["batch_size"], TINY["seq_len"]), generator=g),
                "attention_mask": torch.ones(TINY["batch_size"], TINY["seq_len"], dtype=torch.long)}
               for _ in range(2 * STEPS)]
    return wl.model, batches, wl.loss_fn


def _plans(model, batch, loss_fn):
    """Rank 0 profiles the bare module and builds the plans; every rank receives the same ones."""
    from memplan.planner.core.graph import Graph
    from memplan.planner.probe.profiler import profile

    box = [None]
    if dist.get_rank() == 0:
        graph = profile(copy.deepcopy(model), batch, loss_fn, device="cpu", progress=False, measure=False,
                        repeats=1)
        saved = graph.saved_activations
        recompute = {t: Action.RECOMPUTE for t in saved if graph.tensors[t].recomputable}
        offload = {t: Action.OFFLOAD for t in saved[::2]}
        box = [(graph.model_dump_json(), Plan.for_graph(graph, recompute).model_dump_json(),
                Plan.for_graph(graph, offload).model_dump_json())]
    dist.broadcast_object_list(box, src=0)
    graph_json, recompute_json, offload_json = box[0]
    return Graph.from_json(graph_json), {"recompute": Plan.from_json(recompute_json),
                                         "offload": Plan.from_json(offload_json)}


def _train(model, opt, batches, loss_fn, accumulation: int, no_sync=None, before_step=None) -> list[float]:
    losses = []
    for s in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for micro in range(accumulation):
            sync = no_sync() if (no_sync is not None and micro < accumulation - 1) else nullcontext()
            with sync:
                loss = loss_fn(model, batches[s * accumulation + micro]) / accumulation
                loss.backward()
            losses.append(loss.item())
        if before_step is not None:
            before_step()
        opt.step()
    return losses


def _compare(ref_losses, ref_params, losses, params) -> dict:
    worst = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
                for a, b in zip(params, ref_params, strict=True))
    return {"losses_equal": losses == ref_losses, "params_bitwise": all(torch.equal(a, b) for a, b in
                                                                         zip(params, ref_params, strict=True)),
            "max_rel_param_diff": worst, "losses": losses, "ref_losses": ref_losses}


def _ddp_worker(rank: int, out_dir: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from memplan.executor.distributed import apply_distributed

    _init(rank, out_dir)
    model0, batches, loss_fn = _workload(rank)
    graph, plans = _plans(model0, batches[0], loss_fn)
    results = {}
    scenarios = [("recompute", None, 1), ("offload", None, 1), ("recompute", "forward", 1),
                 ("recompute", "backward", 1), ("offload", "backward", 2)]
    refs = {}
    for accumulation in sorted({a for _, _, a in scenarios}):
        torch.manual_seed(7)
        model = copy.deepcopy(model0)
        ddp = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = _train(ddp, opt, batches, loss_fn, accumulation, ddp.no_sync)
        refs[accumulation] = (losses, [p.detach().clone() for p in model.parameters()])
    for plan_name, fuse, accumulation in scenarios:
        torch.manual_seed(7)
        model = copy.deepcopy(model0)
        ddp = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ex = apply_distributed(ddp, plans[plan_name], graph=graph, optimizer=opt, fuse=fuse,
                               accumulation_steps=accumulation)
        losses = _train(ddp, opt, batches, loss_fn, accumulation, ddp.no_sync)
        step = ex.last_step
        bucket_steps = ex._comm_fusion.bucket_steps if ex._comm_fusion is not None else 0
        ex.remove()
        r = _compare(*refs[accumulation], losses, [p.detach() for p in model.parameters()])
        r.update(replays=step.replays, offloaded=len(step.host), bucket_steps=bucket_steps,
                 buckets=len(ddp._get_ddp_logging_data().get("bucket_sizes", "").split(", ")))
        results[f"{plan_name}/fuse={fuse}/accumulation={accumulation}"] = r
    # backward fusion without accumulation_steps: a loop that accumulates (without no_sync) or clips after
    # backward is refused in one line (each bucket was stepped after its allreduce already)
    refusals = {}
    for loop in ("accumulate", "clip"):
        model = copy.deepcopy(model0)
        ddp = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ex = apply_distributed(ddp, plans["recompute"], graph=graph, optimizer=opt, fuse="backward")
        try:
            opt.zero_grad(set_to_none=True)
            loss_fn(ddp, batches[0]).backward()
            if loop == "clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            else:
                loss_fn(ddp, batches[1]).backward()
            refusals[loop] = None
        except Exception as e:  # noqa: BLE001 - the refusal, recorded for the test
            refusals[loop] = f"{type(e).__name__}: {e}"
        finally:
            ex.remove()
    results["refusals"] = refusals
    # optimizer.step(closure) (Lightning's automatic optimization) under the comm-hook fusion: as plain DDP
    trained = []
    for fuse in (None, "backward"):
        torch.manual_seed(7)
        model = copy.deepcopy(model0)
        ddp = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ex = apply_distributed(ddp, plans["recompute"], graph=graph, optimizer=opt, fuse=fuse) if fuse else None

        def closure(batch, ddp=ddp, opt=opt):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(ddp, batch)
            loss.backward()
            return loss

        losses = [float(opt.step(lambda b=b: closure(b))) for b in batches[:STEPS]]
        if ex is not None:
            ex.remove()
        trained.append((losses, [p.detach().clone() for p in model.parameters()]))
    results["closure"] = _compare(*trained[0], *trained[1])
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))
    _leave()


def _fsdp_worker(rank: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from memplan.executor.distributed import apply_distributed

    _init(rank, out_dir)
    model0, batches, loss_fn = _workload(rank)
    graph, plans = _plans(model0, batches[0], loss_fn)
    mesh = init_device_mesh("cpu", (WORLD,))

    def sharded():
        model = copy.deepcopy(model0)
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    def full(model):
        return [p.full_tensor().detach() for p in model.parameters()]

    from memplan.planner.probe.distributed import keep_within_units

    prefixes = [f"transformer.h.{i}" for i in range(TINY["n_layer"])]
    results = {}
    try:
        apply_distributed(sharded(), plans["recompute"], graph=graph)
        results["cross_unit_refused"] = ""
    except Exception as e:  # noqa: BLE001 - reported to the parent, which asserts the type and text
        results["cross_unit_refused"] = f"{type(e).__name__}: {e}"
    plans["recompute"], demoted = keep_within_units(graph, plans["recompute"], prefixes)
    results["demoted"] = len(demoted)
    refs = {}
    for accumulation in (1, 2):  # FSDP2 reduce-scatters every micro-batch (no set_requires_gradient_sync)
        torch.manual_seed(7)
        model = sharded()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        refs[accumulation] = (_train(model, opt, batches, loss_fn, accumulation), full(model))
    ref = refs[1]
    for plan_name in plans:
        torch.manual_seed(7)
        model = sharded()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ex = apply_distributed(model, plans[plan_name], graph=graph, optimizer=opt)
        seen = []

        def first_step_seen(ex=ex, model=model, seen=seen):
            # FSDP's unsharded parameters (plain tensors during forward): met by the executor's first step
            # (which watches every op; later ones watch only the plan's window), never as activations
            if not seen:
                unsharded = [fp._unsharded_param for m in model.modules() if isinstance(m, FSDPModule)
                             for fp in m._get_fsdp_state()._fsdp_param_group.fsdp_params]
                seen.extend(ex.executor.step_state.by_key.get(p.untyped_storage()._cdata) for p in unsharded)

        losses = _train(model, opt, batches, loss_fn, 1, before_step=first_step_seen)
        step = ex.last_step
        ex.remove()
        r = _compare(*ref, losses, full(model))
        r.update(replays=step.replays, offloaded=len(step.host),
                 unsharded_seen=sum(e is not None for e in seen),
                 unsharded_as_activation=sum(e is not None and e[0] >= 0 for e in seen),
                 all_offloaded_are_activations=all(graph.tensors[t].kind == "activation" for t in step.host))
        results[plan_name] = r
    # backward fusion: each module's shards stepped by FSDP2's post-reduce-scatter hook call; with two
    # micro-batches the first one's reduce-scatter must step nothing
    for plan_name, accumulation in (("recompute", 1), ("offload", 2)):
        torch.manual_seed(7)
        model = sharded()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ex = apply_distributed(model, plans[plan_name], graph=graph, optimizer=opt, fuse="backward",
                               accumulation_steps=accumulation)
        left = []  # parameters that backward did not step (their gradient is still there at opt.step())
        losses = _train(model, opt, batches, loss_fn, accumulation,
                        before_step=lambda m=model, out=left: out.append(sum(p.grad is not None for p in m.parameters())))
        ex.remove()
        r = _compare(*refs[accumulation], losses, full(model))
        r.update(left_for_step=left)
        results[f"{plan_name}/fuse=backward/accumulation={accumulation}"] = r
    try:
        apply_distributed(model, plans["recompute"], graph=graph, optimizer=opt, fuse="forward")
        results["fuse_refused"] = ""
    except Exception as e:  # noqa: BLE001 - reported to the parent, which asserts the type and text
        results["fuse_refused"] = f"{type(e).__name__}: {e}"
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))
    _leave()


# ---- the tests -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    return _spawn(_ddp_worker, tmp_path_factory.mktemp("ddp"))


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    return _spawn(_fsdp_worker, tmp_path_factory.mktemp("fsdp"))


@pytest.mark.parametrize("scenario", ["recompute/fuse=None/accumulation=1", "offload/fuse=None/accumulation=1",
                                      "recompute/fuse=forward/accumulation=1",
                                      "recompute/fuse=backward/accumulation=1",
                                      "offload/fuse=backward/accumulation=2"])
def test_ddp_under_a_plan_trains_exactly_like_plain_ddp(ddp_results, scenario):
    for rank, results in enumerate(ddp_results):
        r = results[scenario]
        assert r["losses_equal"], (rank, r["losses"], r["ref_losses"])
        assert r["params_bitwise"], (rank, r["max_rel_param_diff"])
        # the plan really ran: replays for recompute, host copies for offload
        assert (r["replays"] if scenario.startswith("recompute") else r["offloaded"]) > 0
        if "backward" in scenario:
            # every bucket of every optimizer step was stepped by the comm hook, after its allreduce;
            # with accumulation, only on the last micro-batch (no_sync skips the hook on the others)
            assert r["bucket_steps"] == STEPS * r["buckets"]


def test_ddp_backward_fusion_refuses_undeclared_accumulation_and_clipping(ddp_results):
    """Backward fusion under DDP steps each bucket after its allreduce: a second micro-batch without
    ``no_sync`` and ``accumulation_steps``, or a clip after backward, trained otherwise than plain DDP."""
    for results in ddp_results:
        r = results["refusals"]
        assert r["accumulate"].startswith("MemplanError: fuse='backward' stepped the model in the last backward")
        assert r["clip"].startswith("MemplanError: clip_grad_norm_ after a backward under fuse='backward'")


def test_ddp_backward_fusion_takes_a_step_closure_as_plain_ddp(ddp_results):
    for results in ddp_results:
        r = results["closure"]
        assert r["losses_equal"] and r["params_bitwise"], r


def test_fsdp2_under_a_plan_trains_exactly_like_plain_fsdp2(fsdp_results):
    for rank, results in enumerate(fsdp_results):
        for plan_name in ("recompute", "offload"):
            r = results[plan_name]
            assert r["losses_equal"], (rank, plan_name, r["losses"], r["ref_losses"])
            assert r["params_bitwise"], (rank, plan_name, r["max_rel_param_diff"])
            assert (r["replays"] if plan_name == "recompute" else r["offloaded"]) > 0


def test_fsdp2_unsharded_parameters_are_never_activations(fsdp_results):
    for results in fsdp_results:
        for plan_name in ("recompute", "offload"):
            r = results[plan_name]
            assert r["unsharded_seen"] > 0  # the executor did meet them as op inputs
            assert r["unsharded_as_activation"] == 0
            assert r["all_offloaded_are_activations"]


@pytest.mark.parametrize("scenario", ["recompute/fuse=backward/accumulation=1",
                                      "offload/fuse=backward/accumulation=2"])
def test_fsdp2_backward_fusion_trains_exactly_like_plain_fsdp2(fsdp_results, scenario):
    for rank, results in enumerate(fsdp_results):
        r = results[scenario]
        assert r["losses_equal"], (rank, r["losses"], r["ref_losses"])
        assert r["params_bitwise"], (rank, r["max_rel_param_diff"])
        assert r["left_for_step"] == [0] * STEPS  # every shard was stepped inside backward


def test_fsdp2_forward_fusion_is_refused_with_the_reason(fsdp_results):
    for results in fsdp_results:
        assert results["fuse_refused"].startswith("DistributedError: fuse='forward' under FSDP2 is not supported")


def test_fsdp2_refuses_replays_across_units_and_keep_within_units_fixes_them(fsdp_results):
    for results in fsdp_results:
        assert results["cross_unit_refused"].startswith("DistributedError: under FSDP2, recomputing tensor")
        assert "keep_within_units" in results["cross_unit_refused"]
        assert results["demoted"] > 0


# (module, forward workspace, backward workspace, freed gradients) that for_fsdp adds per op, by hand from
# docs/model.md: F = 2 x shard (root 16, blocks.0 120, blocks.1 112), S = shard, G = full gradients, and
# under gloo T = F (its copy inside each collective)
_TOY_FSDP = {
    "gloo": [("blocks.0", 256, 232, 68),  # fwd max(P+A, P+R1, A_root+A+T); bwd P+R1; post-bwd: G-S, root S+T-G
             ("blocks.0", 240, 352, 0),   # bwd pre-backward: R1 + P + A (copy-out beside the prefetched flat)
             ("", 232, 232, 0), ("", 232, 232, 0),  # between units: R1 + prefetched A0
             ("blocks.1", 344, 288, 56),  # fwd all-gather: A0 held + A1 + T1; post-bwd A0 + R1 + S1 + T1 - G1
             ("blocks.1", 232, 352, 0),   # fwd P+A0+R1 (replays); bwd P + prefetch A0 + T0
             ("", 112, 112, 0), ("", 112, 112, 0),
             ("", 112, 224, 0),           # the model's output: root pre-backward prefetches A1 (+T1)
             ("loss", 0, 0, 0)],
    "nccl": [("blocks.0", 240, 232, 68), ("blocks.0", 240, 352, 0), ("", 232, 232, 0), ("", 232, 232, 0),
             ("blocks.1", 232, 232, 56), ("blocks.1", 232, 232, 0), ("", 112, 112, 0), ("", 112, 112, 0),
             ("", 112, 112, 0), ("loss", 0, 0, 0)],
}


def test_per_rank_graph_adjustments_are_exact_on_a_toy(two_blocks):
    from memplan.planner.core.simulator import simulate
    from memplan.planner.probe.distributed import for_ddp, for_fsdp, fsdp_units
    from memplan.planner.probe.profiler import profile

    torch.manual_seed(0)
    model = two_blocks(4, 6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)  # no optimizer state
    graph = profile(model, torch.randn(8, 4), lambda m, x: m(x).sum(), optimizer=opt, device="cpu",
                    progress=False, measure=False, repeats=1)
    params = (6 * 4 + 6 + 4 * 6 + 4 + 4) * 4
    assert graph.fixed.params_bytes == params
    ddp = for_ddp(graph, 2)
    assert ddp.fixed.other_bytes - graph.fixed.other_bytes == params  # one bucket copy of the gradients
    assert simulate(ddp).peak_bytes == simulate(graph).peak_bytes + params
    # dim 0 split in 2: Linear(4, 6) -> weight 3x4, bias 3; Linear(6, 4) -> weight 2x6, bias 2; scale 2
    units = fsdp_units(model, ["blocks.0", "blocks.1"], 2)
    assert [(u.prefix, u.unsharded_bytes, u.shard_bytes) for u in units] == [
        ("", 16, 8), ("blocks.0", 120, 60), ("blocks.1", 112, 56)]
    for backend, expected in _TOY_FSDP.items():
        fsdp = for_fsdp(graph, units, 2, backend=backend)
        assert fsdp.fixed.params_bytes == 124
        assert fsdp.fixed.other_bytes - graph.fixed.other_bytes == 16  # the root's unsharded parameters
        added = [(op.module, op.workspace_bytes - b.workspace_bytes,
                  op.backward_workspace_bytes - b.backward_workspace_bytes,
                  op.backward_grad_free_bytes - b.backward_grad_free_bytes)
                 for op, b in zip(fsdp.ops, graph.ops, strict=True)]
        assert added == expected, backend


def test_frees_the_profiler_missed_are_restored():
    from memplan.planner.probe.measure import restore_missed_frees

    # (time, ±bytes, address, end of the enclosing c10d:: range): a reduce-scatter's copy (100 B at 0xA,
    # range ends at 15) freed on gloo's thread unreported, its address reused at 40; a plain block at 0xB
    # reused at 50 without a reported free; a collective's copy never freed (range ends at 70); a free of a
    # block allocated before the window
    events = [(10, 100, 0xA, 15), (20, 8, 0xB, None), (30, -5, 0xC, None), (40, 60, 0xA, None),
              (45, -60, 0xA, None), (50, 8, 0xB, None), (60, 30, 0xD, 70)]
    assert restore_missed_frees(events) == [(10, 100), (15, -100), (20, 8), (40, 60), (45, -60), (50, -8),
                                            (50, 8), (60, 30), (70, -30)]


def test_replay_ops_include_the_in_place_initialisers():
    # a dropout-like mask: made by op 1, finished in place by op 2; replaying it runs both, so the FSDP2
    # unit check must see op 2 (it could sit in another unit's module)
    from memplan.planner.core.graph import FixedMemory, Graph, Op, TensorInfo
    from memplan.planner.core.synthetic import fill_structural_grads
    from memplan.planner.probe.distributed import _replay_ops

    tensors = [TensorInfo(id=0, kind="input", bytes=100),
               TensorInfo(id=1, kind="activation", producer=0, bytes=100, requires_grad=True),
               TensorInfo(id=2, kind="activation", producer=1, bytes=100, rebuilt_by=[2]),
               TensorInfo(id=3, kind="activation", producer=3, bytes=100, requires_grad=True)]
    ops = [Op(id=0, name="layer", inputs=[0], outputs=[1], saved=[0], has_backward=True),
           Op(id=1, name="empty_like", inputs=[1], outputs=[2]),
           Op(id=2, name="bernoulli_", inputs=[2], random=True),
           Op(id=3, name="mul", inputs=[1, 2], outputs=[3], saved=[1, 2, 3], has_backward=True)]
    g = fill_structural_grads(Graph(name="init", tensors=tensors, ops=ops, fixed=FixedMemory(inputs_bytes=100)))
    assert _replay_ops(g, {2: Action.RECOMPUTE}, 2) == {1, 2}
