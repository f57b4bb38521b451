"""Planning commands: ``solve`` a graph, the ``frontier`` of memory against time, the registered
``solvers``, and ``plan`` (profile and solve in one go)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import Progress, TextColumn
from rich.table import Table

from memplan.api.cli.base import app, emit_json, err, guard, out, working
from memplan.api.cli.files import writable, writing
from memplan.api.cli.graphs import profile_workload
from memplan.api.cli.options import (
    WORKLOAD_HELP,
    EngineOpt,
    FakeOpt,
    FuseOpt,
    HostBudgetOpt,
    JsonOpt,
    NprocOpt,
    OwnCheckpointingOpt,
    SetOpt,
    SpecOpt,
    StatesOnOpt,
    StatesOpt,
    budget_bytes,
    budget_list,
    fuse_mode,
    needs_fake,
    state_choice,
    workload_options,
)
from memplan.api.cli.ranks import ranks_fake
from memplan.api.cli.tables import print_report
from memplan.api.jobs import state_summary
from memplan.planner.core.errors import MemplanError
from memplan.planner.core.graph import Graph
from memplan.planner.core.units import check_budget, format_bytes, parse_budget


# ---- solve --------------------------------------------------------------------------------------
def print_states(summary: dict[str, Any]) -> None:
    if not summary["streamed_units"] and not summary.get("hosted_units"):
        return
    parts = summary["predicted_parts_s"]
    where = []
    if summary["streamed_units"]:
        where.append(f"{summary['streamed_units']} streamed through the device "
                     f"({format_bytes(summary['streamed_state_bytes'])})")
    if summary.get("hosted_units"):
        where.append(f"{summary['hosted_units']} stepped on the host ({format_bytes(summary['hosted_state_bytes'])}, "
                     f"host steps {parts['host_optimizer'] * 1e3:.1f} ms, compute waits "
                     f"{parts['waits_for_host'] * 1e3:.1f} ms for them)")
    out.print(f"optimizer state of {summary['state_units']} units: {'; '.join(where)}; host memory "
              f"{format_bytes(summary['host_peak_bytes'])}; step: forward {parts['forward'] * 1e3:.1f} ms, backward "
              f"{parts['backward'] * 1e3:.1f} ms, recompute {parts['recompute'] * 1e3:.1f} ms, exposed copies "
              f"{parts['exposed_transfers'] * 1e3:.1f} ms, optimizer {parts['optimizer'] * 1e3:.1f} ms")


@app.command()
@guard
def solve(
    graph_file: Annotated[Path, typer.Argument(help="graph.json")],
    budget: Annotated[str, typer.Option("--budget", "-b", help="e.g. 6GiB, 512MB, 123456 or 50% (of keep-all activation memory)")],
    solver: Annotated[str, typer.Option("--solver", "-s", help="auto, dp, ilp, greedy, ... (memplan solvers)")] = "auto",
    output: Annotated[Path, typer.Option("-o", "--output", help="plan file to write")] = Path("plan.json"),
    time_limit: Annotated[float, typer.Option("--time-limit", help="seconds")] = 60.0,
    offload: Annotated[bool, typer.Option("--offload/--no-offload", help="allow offloading to host memory")] = False,
    host_budget: HostBudgetOpt = None,
    states: StatesOpt = None,
    states_on: StatesOnOpt = "auto",
    checkpoint: Annotated[list[str] | None, typer.Option(
        "--checkpoint", help="--solver manual: recompute what this module (a path prefix such as "
                             "transformer.h.3) saves; repeat for more")] = None,
    keep_tensor: Annotated[list[int] | None, typer.Option(
        "--keep-tensor", help="--solver manual: keep this saved activation (a tensor id), recompute the "
                              "others; repeat for more")] = None,
    fuse: Annotated[str | None, typer.Option(help="the training loop fuses optimizer steps into backward: "
                                                  "plan for that step's peak")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Find the fastest plan whose simulated peak fits the budget, and write it."""
    from memplan.planner.core.simulator import simulate as run_sim
    from memplan.solvers import solve as run_solve

    writable(output)
    graph = Graph.load(str(graph_file))
    b = budget_bytes(budget, graph)
    host = parse_budget(host_budget) if host_budget else None
    manual = {k: v for k, v in (("checkpoint", checkpoint), ("tensors", keep_tensor)) if v}
    if manual and solver != "manual":
        raise MemplanError("--checkpoint and --keep-tensor write a plan by hand: use them with --solver manual")
    with working(f"solving with {solver} (up to {time_limit:g} s)", quiet=json_out):
        result = run_solve(graph, b, solver, time_limit_s=time_limit, offload=offload, host_budget_bytes=host,
                           fuse=fuse, states=state_choice(states, states_on), **manual)
    with writing(output):
        result.plan.save(str(output))
    # keeping everything in the same step (fused as asked, as solve planned for it)
    base = run_sim(graph, None, timeline=False, fuse=fuse if fuse in ("backward", "forward") else None)
    summary = {
        "plan": str(output), "fuse": fuse, "solver": result.plan.solver.name, "status": result.status,
        "budget_bytes": b, "peak_bytes": result.report.peak_bytes, "time_s": result.report.time_s,
        "keep_all_peak_bytes": base.peak_bytes, "keep_all_time_s": base.time_s,
        "overhead": result.report.time_s / base.time_s - 1.0 if base.time_s else 0.0,
        "solve_time_s": result.solve_time_s, "gap": result.gap, "lower_bound_s": result.lower_bound_s,
        "space": result.space,
        "recompute": result.plan.count("recompute"), "offload": result.plan.count("offload"),
        "keep": result.plan.count("keep"), "recompute_each": result.plan.count("recompute_each"),
        **state_summary(graph, result),
    }
    if json_out:
        emit_json(summary)
        return
    over = "" if result.space == "all" else f" over {result.space} plans"  # a narrower space than executed
    print_report(result.report, title=f"{graph.name}: {summary['solver']} ({summary['status']}{over}), "
                                       f"solved in {summary['solve_time_s']:.2f} s", budget=b)
    out.print(f"keep-all: {format_bytes(base.peak_bytes)}, {base.time_s * 1e3:.2f} ms -> overhead "
              f"{summary['overhead'] * 100:.1f}%; {summary['recompute']} recomputed, "
              + (f"{summary['recompute_each']} recomputed per use, " if summary["recompute_each"] else "")
              + f"{summary['offload']} "
              f"offloaded, {summary['keep']} kept; wrote [bold]{output}[/bold]")
    print_states(summary)
    if result.lower_bound_s is not None and result.gap is not None:  # a proven bound on the step time
        out.print(f"proven lower bound{over} {result.lower_bound_s * 1e3:.2f} ms: gap {result.gap * 100:.2f}%")


# ---- frontier -----------------------------------------------------------------------------------
@app.command()
@guard
def frontier(
    graph_file: Annotated[Path, typer.Argument(help="graph.json, or a workload to profile (mlp, gpt2, "
                                                    "path/to/file.py:function)")],
    budgets: Annotated[str, typer.Option(help="comma-separated budgets")] = "30%,40%,50%,60%,70%,80%,90%,100%",
    solver: Annotated[str, typer.Option("--solver", "-s", help="a solver, or several: a,b,c")] = "auto",
    time_limit: Annotated[float, typer.Option("--time-limit", help="seconds per budget")] = 30.0,
    plot: Annotated[Path | None, typer.Option("--plot", help="write a PNG of memory against overhead per solver")] = None,
    options: SetOpt = None,
    fake: FakeOpt = False,
    device_spec: SpecOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Predicted step-time overhead at each budget: memory against time, and what each solve claims."""
    from memplan.solvers import frontier_points, keep_all_report
    from memplan.solvers.registry import ALL_PLANS

    texts = budget_list(budgets)
    writable(plot)
    if graph_file.is_file() and not str(graph_file).endswith(".py"):
        graph = Graph.load(str(graph_file))
    else:  # a workload: profiled here (--fake and --device-spec as for memplan plan)
        from memplan.planner.workloads import load_workload

        w = load_workload(str(graph_file), **workload_options(options))
        graph = profile_workload(w, fake=fake, device_spec=device_spec, json_out=json_out)
    pairs = [(text, budget_bytes(text, graph)) for text in texts]
    names = [n.strip() for n in solver.split(",") if n.strip()] or ["auto"]
    series: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    # One solve per (solver, budget): a bar on stderr (hidden under --json; rich draws none off a terminal).
    with Progress(*Progress.get_default_columns(), TextColumn("{task.fields[what]}"), console=err,
                  transient=True, disable=json_out) as progress:
        task = progress.add_task("frontier", total=len(names) * len(pairs), what="")
        for name in names:
            for label, b in pairs:
                progress.update(task, what=f"{name} at {label}")
                (p,) = frontier_points(graph, [b], name, time_limit_s=time_limit)
                series[name].append({"budget": label, "budget_bytes": b, "overhead": p.overhead,
                                     "status": p.status, "space": p.space})
                progress.advance(task)
    if plot is not None:
        from memplan.api.plots import frontier_png

        with writing(plot):
            frontier_png(plot, {n: [(r["budget_bytes"], r["overhead"]) for r in rows] for n, rows in series.items()},
                         keep_all_peak_bytes=keep_all_report(graph).peak_bytes,
                         title=f"{graph.name}: memory against overhead")
    rows = series[names[0]]
    if json_out:
        doc: dict[str, Any] = {"graph": graph.name, "solver": solver, "points": rows}
        if len(names) > 1:
            doc["series"] = [{"solver": n, "points": series[n]} for n in names]
        if plot is not None:
            doc["plot"] = str(plot)
        emit_json(doc)
        return
    t = Table(title=f"{graph.name}: frontier ({solver})")
    t.add_column("budget")
    t.add_column("bytes", justify="right")
    for n in names:
        t.add_column("overhead" if len(names) == 1 else n, justify="right")
    spaces: set[str] = set()

    def cell(r: dict[str, Any]) -> str:
        if r["overhead"] is None:
            return "infeasible"
        text = f"{r['overhead'] * 100:.1f}%"
        if r["status"] != "optimal":
            return text
        if r["space"] not in (None, ALL_PLANS):
            spaces.add(r["space"])
            return f"{text} optimal*"
        return f"{text} optimal"

    for i, r in enumerate(rows):
        t.add_row(r["budget"], format_bytes(r["budget_bytes"]), *(cell(series[n][i]) for n in names))
    if spaces:
        t.caption = (f"* optimal over {', '.join(sorted(spaces))} plans only: a plan from outside that space "
                     f"(recompute_each, offload) can be faster")
    out.print(t)
    if plot is not None:
        out.print(f"wrote [bold]{plot}[/bold]", soft_wrap=True)


# ---- solvers ------------------------------------------------------------------------------------
@app.command(name="solvers")
@guard
def list_solvers(json_out: JsonOpt = False) -> None:
    """List the registered solvers."""
    from memplan.solvers import solvers as registry

    reg = registry()
    rows = [{"name": s.name, "description": s.description, "graphs": s.graphs, "exact": s.exact,
             "offload": s.offload, "max_saved_activations": s.max_ops} for s in reg.values()]
    if json_out:
        emit_json(rows)
        return
    t = Table(title="solvers")
    for c in ("name", "exact", "offload", "description"):
        t.add_column(c)
    for r in rows:
        t.add_row(r["name"], str(r["exact"]), str(r["offload"]), r["description"])
    out.print(t)


# ---- plan: profile + solve in one go ----------------------------------------------------------
@app.command(name="plan")
@guard
def plan_workload(
    workload: Annotated[str, typer.Argument(help=WORKLOAD_HELP)],
    budget: Annotated[str, typer.Option("--budget", "-b")] = "50%",
    solver: Annotated[str, typer.Option("--solver", "-s")] = "auto",
    output: Annotated[Path, typer.Option("-o", "--output", help="plan file to write")] = Path("plan.json"),
    graph_output: Annotated[Path, typer.Option("--graph", help="graph file to write")] = Path("graph.json"),
    time_limit: Annotated[float, typer.Option("--time-limit")] = 60.0,
    offload: Annotated[bool, typer.Option("--offload/--no-offload")] = False,
    host_budget: HostBudgetOpt = None,
    states: StatesOpt = None,
    states_on: StatesOnOpt = "auto",
    options: SetOpt = None,
    fake: FakeOpt = False,
    device_spec: SpecOpt = None,
    nproc: NprocOpt = 1,
    engine: EngineOpt = "ddp",
    fuse: FuseOpt = None,
    own_checkpointing: OwnCheckpointingOpt = "off",
    json_out: JsonOpt = False,
) -> None:
    """Profile WORKLOAD, solve under BUDGET and write the graph and the plan. With --fake --nproc N, print
    each rank's plan, predicted and traced peak under --engine instead (nothing written). --fuse backward:
    plan for a loop that steps the optimizer inside backward (as run --fuse backward trains)."""
    from memplan.planner.core.simulator import simulate as run_sim
    from memplan.planner.workloads import load_workload
    from memplan.solvers import solve as run_solve

    fuse = fuse_mode(fuse)
    needs_fake("plan", nproc, fake)
    if nproc > 1:
        ranks_fake(workload, nproc=nproc, engine=engine, budget=budget, solver=solver, time_limit=time_limit,
                    options=options, json_out=json_out)
        return
    check_budget(budget)  # before profiling: a typo is not found a minute later
    host = parse_budget(host_budget) if host_budget else None
    writable(output, graph_output)
    w = load_workload(workload, **workload_options(options))
    graph = profile_workload(w, fake=fake, device_spec=device_spec, json_out=json_out, fuse=fuse,
                             own_checkpointing=own_checkpointing)
    with writing(graph_output):
        graph.save(str(graph_output))
    b = budget_bytes(budget, graph)
    result = run_solve(graph, b, solver, time_limit_s=time_limit, offload=offload, fuse=fuse,
                       host_budget_bytes=host, states=state_choice(states, states_on))
    with writing(output):
        result.plan.save(str(output))
    base = run_sim(graph, None, timeline=False, fuse=fuse)  # keeping everything in the step solve planned
    summary = {"workload": w.name, "fuse": fuse, "device": graph.meta.get("device_spec") or graph.device, "graph": str(graph_output), "plan": str(output), "solver": result.plan.solver.name,
               "status": result.status, "budget_bytes": b, "keep_all_peak_bytes": base.peak_bytes,
               "measured_keep_all_peak_bytes": graph.measured.peak_bytes,
               "predicted_peak_bytes": result.report.peak_bytes, "keep_all_step_s": base.time_s,
               "predicted_step_s": result.report.time_s, "solve_time_s": result.solve_time_s,
               **state_summary(graph, result)}
    if json_out:
        emit_json(summary)
        return
    print_report(result.report, title=f"{w.name}: {summary['solver']} ({summary['status']})", budget=b)
    measured = graph.measured.peak_bytes
    out.print(f"keep-all predicted {format_bytes(base.peak_bytes)}"
              + (f" (measured {format_bytes(measured)})" if measured else "")
              + f", {base.time_s * 1e3:.1f} ms; plan: {format_bytes(result.report.peak_bytes)}, "
              f"{result.report.time_s * 1e3:.1f} ms; wrote {graph_output} and {output}")
    print_states(summary)
