"""``show``: a plan, readable, and its memory timeline (against a measured one)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from memplan.api.cli.base import app, emit_json, guard, out
from memplan.api.cli.files import writable, writing
from memplan.api.cli.options import (
    JsonOpt,
)
from memplan.api.cli.tables import print_report
from memplan.planner.core.errors import PlanMismatch
from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Plan
from memplan.planner.core.units import format_bytes


# ---- show: a plan, readable, and its memory timeline ---------------------------------------------
@app.command()
@guard
def show(
    plan_file: Annotated[Path, typer.Argument(help="plan.json")],
    graph_file: Annotated[Path, typer.Option("--graph", "-g", help="the graph.json the plan was made for")],
    run_file: Annotated[Path | None, typer.Option("--run", help="a run report with a measured peak / timeline")] = None,
    output: Annotated[Path, typer.Option("-o", "--output", help="PNG of the memory timeline to write")] = Path("timeline.png"),
    top: Annotated[int, typer.Option(min=0, help="largest non-kept activations to list")] = 10,
    snapshot: Annotated[Path | None, typer.Option(
        "--snapshot", help="also write the predicted step as a PyTorch memory snapshot (pickle): open it at "
                           "pytorch.org/memory_viz or with python -m torch.cuda._memory_viz trace_plot")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Summarise a plan (what it keeps, recomputes, offloads; predicted peak and time) and plot its
    memory timeline by what holds the memory, against keeping everything and the measured run when a run
    report is given; optionally write the predicted step as a PyTorch memory snapshot."""
    from memplan.api.plots import load_run_report, timeline_png
    from memplan.planner.core.memtrace import memory_trace
    from memplan.planner.core.schedule import schedule
    from memplan.planner.core.simulator import score
    from memplan.planner.core.snapshot import predicted_snapshot, write_snapshot
    from memplan.solvers import keep_all_report

    writable(output, snapshot)
    graph = Graph.load(str(graph_file))
    plan = Plan.load(str(plan_file))
    sched = schedule(graph, plan)  # checks the plan against the graph (fingerprint, tensor ids)
    report = score(graph, sched)
    trace = memory_trace(graph, sched, plan.actions())
    base = keep_all_report(graph)
    keep_all = score(graph, schedule(graph, None))
    measured = load_run_report(run_file) if run_file else None
    if measured and measured.graph_fingerprint and measured.graph_fingerprint != graph.fingerprint:
        raise PlanMismatch(f"run report {run_file} is of graph {measured.graph_fingerprint}, not of "
                           f"{graph_file} ({graph.fingerprint}); give the run of this graph")
    with writing(output):
        timeline_png(output, report.timeline, budget_bytes=plan.budget_bytes, measured=measured,
                     title=f"{graph.name}: {plan.solver.name} plan ({plan.solver.status})", trace=trace,
                     keep_all=keep_all.timeline)
    written = None
    if snapshot is not None:
        with writing(snapshot):
            written = write_snapshot(snapshot, predicted_snapshot(graph, trace))
    tensors = graph.tensors
    by_action: dict[str, dict[str, int]] = {}
    for d in plan.decisions:
        row = by_action.setdefault(d.action.value, {"count": 0, "bytes": 0})
        row["count"] += 1
        row["bytes"] += tensors[d.tensor].bytes
    moved = sorted((d for d in plan.decisions if d.action.value != "keep"), key=lambda d: -tensors[d.tensor].bytes)
    summary: dict[str, Any] = {
        "graph": graph.name, "graph_fingerprint": graph.fingerprint, "solver": plan.solver.name,
        "status": plan.solver.status, "solve_time_s": plan.solver.solve_time_s, "gap": plan.solver.gap,
        "budget_bytes": plan.budget_bytes, "peak_bytes": report.peak_bytes, "peak_at": report.peak_note,
        "time_s": report.time_s, "recompute_time_s": report.recompute_time_s,
        "exposed_transfer_s": report.exposed_transfer_s, "host_peak_bytes": report.host_peak_bytes,
        "keep_all_peak_bytes": base.peak_bytes, "keep_all_time_s": base.time_s,
        "overhead": report.time_s / base.time_s - 1.0 if base.time_s else 0.0,
        "actions": by_action,
        "stale_prediction": plan.predicted is not None and plan.predicted.peak_bytes != report.peak_bytes,
        "measured_peak_bytes": measured.peak_bytes if measured else None,
        "measured_step_s": measured.step_time_s if measured else None,
        "timeline_png": str(output),
        "snapshot": None if written is None else {"path": written.path, "allocations": written.allocations,
                                                  "peak_bytes": written.peak_bytes, "merged": written.merged,
                                                  "merged_max_bytes": written.merged_max_bytes},
        "largest_moved": [{"tensor": d.tensor, "action": d.action.value, "bytes": tensors[d.tensor].bytes,
                           "producer": graph.ops[tensors[d.tensor].producer].name,
                           "module": graph.ops[tensors[d.tensor].producer].module} for d in moved[:top]],
    }
    if measured and measured.peak_bytes:
        summary["peak_error"] = report.peak_bytes / measured.peak_bytes - 1.0
    if measured and measured.step_time_s:
        summary["step_error"] = report.time_s / measured.step_time_s - 1.0
    if json_out:
        emit_json(summary)
        return
    print_report(report, title=f"{graph.name}: {plan.solver.name} plan ({plan.solver.status}, solved in "
                                f"{plan.solver.solve_time_s:.2f} s)", budget=plan.budget_bytes)
    out.print(f"keep-all: {format_bytes(base.peak_bytes)}, {base.time_s * 1e3:.2f} ms -> peak "
              f"{report.peak_bytes / base.peak_bytes * 100 if base.peak_bytes else 0:.0f}% of it, overhead "
              f"{summary['overhead'] * 100:.1f}%")
    counts = ", ".join(f"{v['count']} {k} ({format_bytes(v['bytes'])})" for k, v in sorted(by_action.items()))
    out.print(f"decisions: {counts or 'none'}")
    if summary["stale_prediction"]:
        out.print(f"[yellow]the plan file predicted {format_bytes(plan.predicted.peak_bytes)}; the simulator now "
                  f"says {format_bytes(report.peak_bytes)}[/yellow]")
    if measured and measured.peak_bytes:
        out.print(f"measured peak {format_bytes(measured.peak_bytes)}: predicted is "
                  f"{summary['peak_error'] * 100:+.1f}% off")
    if measured and measured.step_time_s:
        out.print(f"measured step time {measured.step_time_s * 1e3:.1f} ms: predicted is "
                  f"{summary['step_error'] * 100:+.1f}% off")
    if moved:
        t = Table(title=f"largest activations not kept (of {len(moved)})")
        for c in ("tensor", "action", "bytes", "producer", "module"):
            t.add_column(c, justify="right" if c in ("tensor", "bytes") else "left")
        for r in summary["largest_moved"]:
            t.add_row(str(r["tensor"]), r["action"], format_bytes(r["bytes"]), r["producer"], r["module"])
        out.print(t)
    out.print(f"wrote [bold]{output}[/bold]", soft_wrap=True)
    if written is not None:
        out.print(f"wrote [bold]{written.line()}[/bold]", soft_wrap=True, highlight=False)
