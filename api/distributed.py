"""Train with a plan on N processes (DDP or FSDP2), one rank's predicted against measured peak.

    torchrun --nproc-per-node 2 -m memplan.api.distributed gpt2 --budget 50% --ddp --steps 3
    torchrun --nproc-per-node 2 -m memplan.api.distributed gpt2 --budget 50% --fsdp --steps 3

Rank 0 profiles the bare module with one rank's batch, adjusts the graph for what a rank holds
(:mod:`memplan.planner.probe.distributed`) and solves on it; every rank receives the same graph and plan, wraps
the model (``DistributedDataParallel``, or ``fully_shard`` on each block and the root), applies the plan
(:mod:`memplan.executor.distributed`) and trains. Each rank's peak is measured from the allocator
(CPU) or ``max_memory_allocated`` (CUDA) for a step without the plan and one with it, and rank 0 prints
one row per rank and plan. CPU runs use gloo; CUDA runs nccl, one device per local rank.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from memplan.api.jobs import resolve_budget
from memplan.executor.distributed import apply_distributed
from memplan.planner import simulate
from memplan.planner.core.errors import MemplanError
from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Plan
from memplan.planner.core.units import check_budget, format_bytes
from memplan.planner.probe.device import default_device_type
from memplan.planner.probe.distributed import (
    ENGINES,
    for_ddp,
    for_fsdp,
    fsdp_units,
    keep_within_units,
)
from memplan.planner.probe.measure import measure_rank_step
from memplan.planner.probe.profiler import profile
from memplan.planner.probe.storage import move_batch
from memplan.planner.workloads import default_optimizer, load_workload, training_step
from memplan.solvers import solve


def block_prefixes(model: nn.Module) -> list[str]:
    """The FSDP units: the children of the model's largest ``nn.ModuleList`` (a transformer's blocks)."""
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return []
    name, blocks = max(lists, key=lambda nm: len(nm[1]))
    return [f"{name}.{i}" if name else str(i) for i in range(len(blocks))]


def _wrap(engine: str, prefixes: list[str], plan: Plan | None, graph: Graph | None, fuse: str | None,
          device: torch.device, *, measured: bool = False):
    """``wrap(model) -> (train_model, optimizer)`` for :func:`measure_rank_step`: DDP or fully_shard,
    AdamW (foreach), and the plan applied if any. ``device``: where the rank trains; fully_shard is given
    a mesh of that device's type (without one it takes CUDA wherever a GPU is visible, and a CPU run
    pinned with ``MEMPLAN_DEVICE=cpu`` moves its shards to the GPU while its batch stays on the CPU).
    ``measured``: the model is built inside a measurement's window, where DDP does not broadcast its
    parameters from rank 0 (``init_sync=False``; the measured step's bytes are the same either way): the
    broadcast's flat buffer is freed by whichever thread drops the work's last reference, and when that is
    gloo's worker thread the profiler never hears of the free; on the tests' MLP 10 of 80 rank
    measurements then counted the buffer live through the step (99,840 bytes, 9% over the prediction),
    none of 80 without the broadcast."""
    if engine == "fsdp":  # (made here, outside the measured window that builds the model)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))

    def wrap(model: nn.Module):
        if engine == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            train_model = DistributedDataParallel(model, init_sync=not measured)
        else:
            from torch.distributed.fsdp import fully_shard

            for p in prefixes:
                fully_shard(model.get_submodule(p), mesh=mesh)
            train_model = fully_shard(model, mesh=mesh)
        optimizer = default_optimizer(model)
        if plan is not None:
            apply_distributed(train_model, plan, graph=graph, optimizer=optimizer, fuse=fuse)
        return train_model, optimizer

    return wrap


def run_distributed(workload: str, *, budget: str, engine: str, steps: int = 3, solver: str = "auto",
                    fuse: str | None = None, time_limit_s: float = 30.0,
                    workload_options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Profile, solve and train ``workload`` under ``engine`` ("ddp" or "fsdp") on every rank of the
    process group (initialised here from torchrun's environment if it is not yet: gloo on CPU, nccl on
    CUDA). ``budget``: bytes or a percentage of the *rank's* activation memory. ``steps`` planned steps
    after the measured ones. Returns, on every rank, the rows of all ranks: rank, plan ("keep all" or the
    solver), predicted and measured peak bytes, error, and the planned steps' losses.

    This is what ``memplan run WORKLOAD --nproc N`` calls in each process it starts under torchrun.
    Raises :class:`MemplanError` for a bad engine or budget, what the solver and the executor raise.
    """
    if engine not in ENGINES:
        raise MemplanError(f"engine {engine!r}: expected one of {', '.join(ENGINES)}")
    if steps < 1:
        raise MemplanError(f"steps must be >= 1, got {steps}")
    on_cuda = default_device_type() == "cuda" and torch.cuda.is_available()  # a real GPU per rank (nccl)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if on_cuda else "gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if on_cuda else torch.device("cpu")
    if on_cuda:
        torch.cuda.set_device(device)
    wl = load_workload(workload, **(workload_options or {}))
    model0 = wl.model.to(device)
    prefixes = block_prefixes(model0) if engine == "fsdp" else []

    box: list[Any] = [None]
    if rank == 0:
        graph = profile(copy.deepcopy(model0), wl.batch, wl.loss_fn, device=device, progress=False, measure=False,
                        name=workload)
        if engine == "ddp":
            rank_graph = for_ddp(graph, world)
        else:
            rank_graph = for_fsdp(graph, fsdp_units(model0, prefixes, world), world, backend=dist.get_backend())
        budget_bytes = resolve_budget(budget, rank_graph)
        plan = solve(rank_graph, budget_bytes, solver, time_limit_s=time_limit_s).plan
        if engine == "fsdp":
            plan, _ = keep_within_units(rank_graph, plan, prefixes)
        box = [(graph.model_dump_json(), rank_graph.model_dump_json(), plan.model_dump_json())]
    dist.broadcast_object_list(box, src=0)
    graph = Graph.from_json(box[0][0])
    rank_graph = Graph.from_json(box[0][1])
    plan = Plan.from_json(box[0][2])

    rows = []
    batch = wl.batch if not on_cuda else move_batch(wl.batch, device)
    for label, p in (("keep all", None), (plan.solver.name, plan)):
        wrap = _wrap(engine, prefixes, p, graph, fuse, device, measured=True)

        def build(wrap=wrap):
            return wrap(copy.deepcopy(model0))  # the rank's model is made inside the measured window

        m = measure_rank_step(build, batch, wl.loss_fn, warmup=2, rank=rank, device=device)  # 2: DDP rebuilds buckets
        peak, start = m.peak_bytes, m.start_bytes
        predicted = simulate(rank_graph, p or Plan.keep_all(rank_graph), timeline=False).peak_bytes
        rows.append({"rank": rank, "engine": engine, "world_size": world, "plan": label,
                     "recomputed": sum(a == "recompute" for a in (p.actions() if p else {}).values()),
                     "predicted_peak_bytes": predicted, "measured_peak_bytes": peak,
                     "measured_start_bytes": start, "error": predicted / peak - 1 if peak else None})
    model = copy.deepcopy(model0)
    train_model, optimizer = _wrap(engine, prefixes, plan, graph, fuse, device)(model)
    losses = []
    for _ in range(steps):
        losses.append(training_step(train_model, batch, wl.loss_fn, optimizer).item())
    rows[-1]["losses"] = losses
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, rows)
    return [r for ranks in everyone for r in ranks]




def plan_ranks_fake(workload: str, *, world_size: int, engine: str, budget: str | None, solver: str = "auto",
                    time_limit_s: float = 30.0, workload_options: dict[str, Any] | None = None,
                    device_spec: Any = None, trace: bool = True, ranks: list[int] | None = None,
                    backend: str = "gloo") -> list[dict[str, Any]]:
    """Each rank's memory for ``world_size`` ranks, in this one process and without training.

    The plan: the bare module profiled under fake tensors (one rank's batch), adjusted for what an
    ``engine`` rank holds (:func:`for_ddp`, :func:`for_fsdp` over :func:`block_prefixes`), solved under
    ``budget`` (None: no plan, keep-everything rows only). With ``trace``, each of ``ranks`` (None: all)
    also runs its real wrapped step under PyTorch's fake process group
    (:func:`memplan.planner.probe.fakepg.trace_ranks`: FSDP2 under fake tensors, DDP with real tensors),
    whose figures go into the keep-everything rows as ``traced_start_bytes`` / ``traced_peak_bytes``
    (``error``: the prediction against them), and whose parameter and optimizer-state bytes replace the
    transform's in the rank's graph before solving (docs/model.md, "Ranks without the ranks"). Rows as :func:`run_distributed`'s, with
    ``measured_*`` None and ``fake`` True. ``memplan plan|run|profile --fake --nproc N`` prints them."""
    from memplan.planner.probe.fakepg import trace_ranks

    if engine not in ENGINES:
        raise MemplanError(f"engine {engine!r}: expected one of {', '.join(ENGINES)}")
    if world_size < 1:
        raise MemplanError(f"--nproc {world_size}: need at least 1 rank")
    if budget is not None:
        check_budget(budget)  # before profiling: a typo is not found a minute later
    wl = load_workload(workload, **(workload_options or {}))
    graph = profile(wl.model, wl.batch, wl.loss_fn, progress=False, fake=True, device_spec=device_spec,
                    name=workload)
    prefixes = block_prefixes(wl.model) if engine == "fsdp" else []
    if engine == "ddp":
        rank_graph = for_ddp(graph, world_size)
    else:
        rank_graph = for_fsdp(graph, fsdp_units(wl.model, prefixes, world_size), world_size,
                              backend="nccl" if graph.device == "cuda" else backend)
    traced = {}
    if trace:
        traced = {t.rank: t for t in trace_ranks(wl.model, wl.batch, wl.loss_fn, engine=engine,
                                                 world_size=world_size, prefixes=prefixes, ranks=ranks,
                                                 backend="nccl" if graph.device == "cuda" else backend)}
    if traced:
        # what a rank holds between steps is the trace's, not the transform's scaling: the shards as FSDP2
        # pads them and the optimizer state as the optimizer makes it (AdamW's step counters are whole on
        # every rank, not 1/N)
        held = traced[min(traced)]
        rank_graph.fixed.params_bytes = held.params_bytes
        rank_graph.fixed.optimizer_state_bytes = held.optimizer_state_bytes
        rank_graph = rank_graph.invalidate()
    plans: list[tuple[str, Plan | None]] = [("keep all", None)]
    if budget is not None:
        budget_bytes = resolve_budget(budget, rank_graph)
        plan = solve(rank_graph, budget_bytes, solver, time_limit_s=time_limit_s).plan
        if engine == "fsdp":
            plan, _ = keep_within_units(rank_graph, plan, prefixes)
        plans.append((plan.solver.name, plan))
    rows = []
    for label, p in plans:
        predicted = simulate(rank_graph, p or Plan.keep_all(rank_graph), timeline=False).peak_bytes
        for rank in (range(world_size) if ranks is None else ranks):
            t = traced.get(rank) if p is None else None
            rows.append({"rank": rank, "engine": engine, "world_size": world_size, "plan": label,
                         "recomputed": sum(a == "recompute" for a in (p.actions() if p else {}).values()),
                         "predicted_peak_bytes": predicted, "measured_peak_bytes": None,
                         "measured_start_bytes": None,
                         "traced_peak_bytes": t.peak_bytes if t else None,
                         "traced_start_bytes": t.start_bytes if t else None,
                         "trace": t.as_dict() if t else None,
                         "error": predicted / t.peak_bytes - 1 if t and t.peak_bytes else None, "fake": True})
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    """A markdown table of :func:`run_distributed`'s rows."""
    seen = "traced" if rows and all(r.get("fake") for r in rows) else "measured"  # --fake: the fake-pg trace
    out = [f"| engine | rank | plan | recomputed | {seen} start | {seen} peak | predicted peak | error |",
           "|---|--:|---|--:|--:|--:|--:|--:|"]
    for r in sorted(rows, key=lambda r: (r["plan"] != "keep all", r["rank"])):
        if r.get("fake"):  # plan_ranks_fake: traced under the fake process group (keep all), not measured
            traced = r.get("traced_peak_bytes") is not None
            start = format_bytes(r["traced_start_bytes"]) if traced else "-"
            peak = format_bytes(r["traced_peak_bytes"]) if traced else "-"
            error = f"{r['error']:+.2%}" if traced else "-"
            out.append(f"| {r['engine']} ({r['world_size']} ranks) | {r['rank']} | {r['plan']} | {r['recomputed']} | "
                       f"{start} | {peak} | {format_bytes(r['predicted_peak_bytes'])} | {error} |")
            continue
        out.append(f"| {r['engine']} ({r['world_size']} ranks) | {r['rank']} | {r['plan']} | {r['recomputed']} | "
                   f"{format_bytes(r['measured_start_bytes'])} | {format_bytes(r['measured_peak_bytes'])} | "
                   f"{format_bytes(r['predicted_peak_bytes'])} | {r['error']:+.2%} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m memplan.api.distributed",
                                 description="run under torchrun: train WORKLOAD with a plan on every rank")
    ap.add_argument("workload")
    ap.add_argument("--budget", default="50%", help="bytes (6GiB) or a percentage of a rank's activation memory")
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--ddp", action="store_const", const="ddp", dest="engine")
    group.add_argument("--fsdp", action="store_const", const="fsdp", dest="engine")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--solver", default="auto")
    ap.add_argument("--fuse", choices=("backward", "forward"), default=None)
    ap.add_argument("--json", action="store_true", help="rows as JSON on stdout (rank 0)")
    args = ap.parse_args(argv)
    try:
        rows = run_distributed(args.workload, budget=args.budget, engine=args.engine, steps=args.steps,
                               solver=args.solver, fuse=args.fuse)
    except MemplanError as e:
        print(f"error (rank {os.environ.get('RANK', '?')}): {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(rows, indent=1) if args.json else format_rows(rows))
    return 0


if __name__ == "__main__":
    code = main()
    # without the interpreter's finalization, which can abort a rank whose gloo threads still hold work
    # (SIGABRT after all its work; pytorch/pytorch#179291): torchrun would report the rank failed
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
