"""``run``: profile, solve, train under the plan, and set predicted against measured."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from memplan.api.cli.base import app, emit_json, guard, out, working
from memplan.api.cli.files import writable, writing
from memplan.api.cli.graphs import model_checkpointing, profile_workload
from memplan.api.cli.options import (
    WORKLOAD_HELP,
    FakeOpt,
    HostBudgetOpt,
    JsonOpt,
    OwnCheckpointingOpt,
    SetOpt,
    StatesOnOpt,
    StatesOpt,
    budget_bytes,
    fuse_mode,
    state_choice,
    workload_options,
)
from memplan.api.cli.ranks import ranks_fake, train_ranks
from memplan.api.cli.tables import print_run
from memplan.planner.core.errors import MemplanError
from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Plan
from memplan.planner.core.units import check_budget, parse_budget


# ---- run: profile, solve, train under the plan, predicted against measured ------------------------
@app.command(name="run")
@guard
def run_workload(
    workload: Annotated[str, typer.Argument(help=WORKLOAD_HELP)],
    budget: Annotated[str, typer.Option("--budget", "-b", help="e.g. 6GiB, 512MB or 50% (ignored with --plan)")] = "50%",
    solver: Annotated[str, typer.Option("--solver", "-s", help="auto, dp, ilp, greedy, ... (memplan solvers)")] = "auto",
    offload: Annotated[bool, typer.Option("--offload/--no-offload", help="allow offloading to host memory")] = False,
    host_budget: HostBudgetOpt = None,
    states: StatesOpt = None,
    states_on: StatesOnOpt = "auto",
    fuse: Annotated[str | None, typer.Option(help="fuse optimizer steps into backward or forward")] = None,
    steps: Annotated[int, typer.Option(min=1, max=1000, help="timed steps (median)")] = 5,
    warmup: Annotated[int, typer.Option(min=0, max=100, help="untimed steps first")] = 1,
    time_limit: Annotated[float, typer.Option("--time-limit", help="solver seconds")] = 60.0,
    plan_file: Annotated[Path | None, typer.Option("--plan", help="run this plan instead of solving")] = None,
    graph_file: Annotated[Path | None, typer.Option("--graph", help="the graph --plan was made for "
                                                                     "(default: graph.json beside it)")] = None,
    save_plan: Annotated[Path | None, typer.Option(help="write the solved plan here")] = None,
    save_graph: Annotated[Path | None, typer.Option(help="write the profiled graph here")] = None,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="run report (JSON) to write; "
                                                                       "memplan show --run reads it")] = None,
    snapshot: Annotated[Path | None, typer.Option(
        "--snapshot", help="record the measured step as a PyTorch memory snapshot (pickle) for "
                           "pytorch.org/memory_viz: on CUDA PyTorch's own record, on a CPU from the allocator's "
                           "reports; memplan show --snapshot writes the predicted one")] = None,
    keep_all: Annotated[bool | None, typer.Option("--keep-all/--no-keep-all",
                                                  help="also measure the step without the plan (default: "
                                                       "yes, but not with --fake)")] = None,
    device: Annotated[str | None, typer.Option(help="cpu or cuda (default: cuda when available)")] = None,
    nproc: Annotated[int, typer.Option("--nproc", max=64,
                                       help="processes on this machine (torch.distributed: gloo on CPU, "
                                            "nccl on CUDA); more than 1 trains under --engine")] = 1,
    engine: Annotated[str, typer.Option(help="with --nproc > 1: ddp (DistributedDataParallel) or fsdp "
                                             "(FSDP2 fully_shard per block)")] = "ddp",
    options: SetOpt = None,
    fake: FakeOpt = False,
    own_checkpointing: OwnCheckpointingOpt = "off",
    json_out: JsonOpt = False,
) -> None:
    """Profile WORKLOAD, solve under BUDGET, train STEPS steps under the plan, and print predicted
    against measured peak memory and step time. With --nproc N, every rank does so under DDP or FSDP2
    and each rank's predicted peak is set against its measured one. With --fake nothing beyond the
    plan's memory is allocated: the profile is fake and keep-everything is predicted, not measured."""
    if keep_all is None:
        keep_all = not fake
    if nproc < 1:
        raise MemplanError(f"--nproc {nproc}: need at least 1 rank")
    if nproc > 1 and fake and snapshot is not None:
        raise MemplanError(f"--snapshot records a trained step; memplan run --fake --nproc {nproc} trains none")
    if nproc > 1 and fake:  # every rank's plan in this process, nothing trained
        ranks_fake(workload, nproc=nproc, engine=engine, budget=budget, solver=solver, time_limit=time_limit,
                    options=options, json_out=json_out)
        return
    if nproc > 1:
        train_ranks(workload, nproc=nproc, engine=engine, budget=budget, solver=solver, fuse=fuse,
                         steps=steps, time_limit=time_limit, options=options, json_out=json_out,
                         unsupported={"--offload": offload, "--plan": plan_file is not None,
                                      "--graph": graph_file is not None, "--save-plan": save_plan is not None,
                                      "--save-graph": save_graph is not None, "-o/--output": output is not None,
                                      "--snapshot": snapshot is not None,
                                      "--device": device is not None})
        return
    from memplan.executor.session import run_plan
    from memplan.planner.core.errors import PlanError
    from memplan.planner.workloads import load_workload
    from memplan.solvers import solve as run_solve

    fuse = fuse_mode(fuse)
    if graph_file is not None and plan_file is None:
        raise MemplanError("--graph is the graph of a --plan: give --plan too (without --plan, run profiles)")
    if plan_file is None:
        check_budget(budget)  # before profiling: a typo is not found a minute later
        host = parse_budget(host_budget) if host_budget else None
    writable(save_plan, save_graph, output, snapshot)
    w = load_workload(workload, **workload_options(options))
    if plan_file is not None:
        graph_file = graph_file or plan_file.with_name("graph.json")
        if not graph_file.is_file():
            raise PlanError(f"--plan {plan_file} needs the graph it was made for: --graph graph.json "
                            f"({graph_file} does not exist)")
        graph = Graph.load(str(graph_file))
        plan = Plan.load(str(plan_file))
        plan.check_against(graph)
        model_checkpointing(w.model, own_checkpointing)  # as memplan plan profiled it
    else:
        graph = profile_workload(w, fake=fake, device_spec=None, device=device, json_out=json_out, fuse=fuse,
                                 own_checkpointing=own_checkpointing)
        b = budget_bytes(budget, graph)
        with working(f"solving with {solver} (up to {time_limit:g} s)", quiet=json_out):
            plan = run_solve(graph, b, solver, time_limit_s=time_limit, offload=offload, fuse=fuse,
                             host_budget_bytes=host,
                             states=state_choice(states, states_on)).plan
    if save_graph is not None:
        with writing(save_graph):
            graph.save(str(save_graph))
    if save_plan is not None:
        with writing(save_plan):
            plan.save(str(save_plan))
    with working(f"training {warmup + 1 + steps} steps under the plan"
                  + (" and as many keeping everything" if keep_all else ""), quiet=json_out):
        report = run_plan(w.model, w.batch, w.loss_fn, None, plan, graph, steps=steps, warmup=warmup, fuse=fuse,
                          keep_all=keep_all, name=w.name, snapshot=snapshot is not None)
    doc = report.as_dict()
    written = None
    if snapshot is not None:
        from memplan.planner.core.snapshot import write_snapshot

        with writing(snapshot):
            written = write_snapshot(snapshot, report.memory_snapshot)
        doc_snapshot = {"path": written.path, "allocations": written.allocations, "merged": written.merged}
    if output is not None:
        with writing(output):
            output.write_text(json.dumps(doc, indent=1) + "\n")
    if json_out:
        emit_json({k: v for k, v in doc.items() if k != "timeline"} | ({"report": str(output)} if output else {})
                  | ({"snapshot": doc_snapshot} if written else {}))
        return
    print_run(report)
    if written is not None:
        out.print(f"wrote [bold]{written.line()}[/bold]", soft_wrap=True, highlight=False)
    written = [str(p) for p in (output, save_plan, save_graph) if p is not None]
    if written:
        out.print(f"wrote [bold]{', '.join(written)}[/bold]", soft_wrap=True)
