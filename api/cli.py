"""The ``memplan`` command line (typer + rich). The only place, with the REST service, that prints.

Every command takes ``--json`` for machine-readable output on stdout. Errors the user can fix (a bad
file, an infeasible budget, an unknown workload) exit with status 2 and one line naming the problem;
anything else exits 1 with one line (set ``MEMPLAN_DEBUG=1`` for the traceback).
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from memplan.planner.errors import Infeasible, MemplanError
from memplan.planner.graph import Graph
from memplan.planner.plan import Plan
from memplan.planner.units import format_bytes, parse_budget

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="memplan: plan what to keep, recompute or offload so a training step fits a memory budget.")
out = Console()
err = Console(stderr=True)

EXIT_USER = 2
EXIT_INTERNAL = 1

JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable JSON on stdout")]


def _guard(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Map memplan's errors to one red line and an exit code: the one place this is decided."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except Infeasible as e:
            err.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(EXIT_USER) from None
        except MemplanError as e:
            err.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(EXIT_USER) from None
        except KeyboardInterrupt:
            err.print("[red]interrupted[/red]")
            raise typer.Exit(130) from None
        except Exception as e:  # noqa: BLE001 - the last line of defence: no traceback for users
            if os.environ.get("MEMPLAN_DEBUG"):
                raise
            err.print(f"[red]internal error:[/red] {type(e).__name__}: {e} (set MEMPLAN_DEBUG=1 for the traceback)",
                      highlight=False, soft_wrap=True)
            raise typer.Exit(EXIT_INTERNAL) from None

    return wrapper


def _emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=1, default=str) + "\n")


def _report_dict(report: Any) -> dict[str, Any]:
    d = report.model_dump(exclude={"timeline"})
    return d


def _budget(text: str, graph: Graph) -> int:
    from memplan.solvers import activation_bytes

    if text.strip().endswith("%"):
        return parse_budget(text, activation_bytes=activation_bytes(graph), fixed_bytes=graph.fixed.resident_bytes)
    return parse_budget(text)


# ---- profile ------------------------------------------------------------------------------------
@app.command()
@_guard
def profile(
    workload: Annotated[str, typer.Argument(help="built-in (mlp, resnet, gpt2, unet, bert) or path/to/file.py:function")],
    output: Annotated[Path, typer.Option("-o", "--output", help="graph file to write")] = Path("graph.json"),
    device: Annotated[str | None, typer.Option(help="cpu or cuda (default: cuda when available)")] = None,
    repeats: Annotated[int, typer.Option(min=1, max=100, help="timed repeats (median)")] = 3,
    json_out: JsonOpt = False,
) -> None:
    """Profile a real training step of WORKLOAD and write its graph."""
    from memplan.planner.profiler import profile as run_profile
    from memplan.planner.workloads import load_workload

    w = load_workload(workload)
    graph = run_profile(w.model, w.batch, w.loss_fn, device=device, repeats=repeats, name=w.name,
                        progress=not json_out)
    graph.save(str(output))
    summary = {"graph": str(output), "name": graph.name, "ops": len(graph.ops), "tensors": len(graph.tensors),
               "saved_activations": len(graph.saved_activations), "fingerprint": graph.fingerprint,
               "model_fingerprint": graph.model_fingerprint, "fixed_bytes": graph.fixed.resident_bytes,
               "measured_peak_bytes": graph.measured.peak_bytes, "measured_step_s": graph.measured.step_time_s}
    if json_out:
        _emit_json(summary)
        return
    out.print(f"wrote [bold]{output}[/bold]: {summary['ops']} ops, {summary['saved_activations']} saved "
              f"activations, fixed memory {format_bytes(summary['fixed_bytes'])}")


# ---- simulate -----------------------------------------------------------------------------------
@app.command()
@_guard
def simulate(
    graph_file: Annotated[Path, typer.Argument(help="graph.json")],
    plan_file: Annotated[Path | None, typer.Argument(help="plan.json (default: keep everything)")] = None,
    timeline: Annotated[bool, typer.Option(help="include the per-op memory timeline in --json")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Replay one training step of a graph under a plan and print the predicted peak and time."""
    from memplan.planner.simulator import simulate as run_sim

    graph = Graph.load(str(graph_file))
    plan = Plan.load(str(plan_file)) if plan_file else None
    report = run_sim(graph, plan)
    if json_out:
        d = report.model_dump() if timeline else _report_dict(report)
        _emit_json(d)
        return
    _print_report(report, title=f"{graph.name} under {'keep everything' if plan is None else plan_file}")


def _print_report(report: Any, title: str, budget: int | None = None) -> None:
    t = Table(title=title, show_header=False)
    if budget is not None:
        t.add_row("budget", format_bytes(budget))
    t.add_row("peak", f"{format_bytes(report.peak_bytes)}  (at {report.peak_note})")
    t.add_row("step time", f"{report.time_s * 1e3:.2f} ms")
    t.add_row("  recompute", f"{report.recompute_time_s * 1e3:.2f} ms")
    t.add_row("  exposed transfers", f"{report.exposed_transfer_s * 1e3:.2f} ms")
    t.add_row("fixed memory", format_bytes(report.fixed_bytes))
    t.add_row("host memory (offload)", format_bytes(report.host_peak_bytes))
    out.print(t)


# ---- schema -------------------------------------------------------------------------------------
@app.command()
@_guard
def schema(which: Annotated[str, typer.Argument(help="graph or plan")]) -> None:
    """Print the JSON Schema of the graph or plan file format."""
    if which == "graph":
        _emit_json(Graph.model_json_schema())
    elif which == "plan":
        _emit_json(Plan.model_json_schema())
    else:
        raise MemplanError(f"unknown schema {which!r}; choose 'graph' or 'plan'")


# ---- solve --------------------------------------------------------------------------------------
@app.command()
@_guard
def solve(
    graph_file: Annotated[Path, typer.Argument(help="graph.json")],
    budget: Annotated[str, typer.Option("--budget", "-b", help="e.g. 6GiB, 512MB, 123456 or 50% (of keep-all activation memory)")],
    solver: Annotated[str, typer.Option("--solver", "-s", help="auto, dp, ilp, greedy, ... (memplan solvers)")] = "auto",
    output: Annotated[Path, typer.Option("-o", "--output", help="plan file to write")] = Path("plan.json"),
    time_limit: Annotated[float, typer.Option("--time-limit", help="seconds")] = 60.0,
    offload: Annotated[bool, typer.Option("--offload/--no-offload", help="allow offloading to host memory")] = False,
    host_budget: Annotated[str | None, typer.Option(help="pinned host memory cap for offload, e.g. 8GiB")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Find the fastest plan whose simulated peak fits the budget, and write it."""
    from memplan.solvers import keep_all_report
    from memplan.solvers import solve as run_solve

    graph = Graph.load(str(graph_file))
    b = _budget(budget, graph)
    host = parse_budget(host_budget) if host_budget else None
    result = run_solve(graph, b, solver, time_limit_s=time_limit, offload=offload, host_budget_bytes=host)
    result.plan.save(str(output))
    base = keep_all_report(graph)
    summary = {
        "plan": str(output), "solver": result.plan.solver.name, "status": result.status,
        "budget_bytes": b, "peak_bytes": result.report.peak_bytes, "time_s": result.report.time_s,
        "keep_all_peak_bytes": base.peak_bytes, "keep_all_time_s": base.time_s,
        "overhead": result.report.time_s / base.time_s - 1.0 if base.time_s else 0.0,
        "solve_time_s": result.solve_time_s, "gap": result.gap,
        "recompute": result.plan.count("recompute"), "offload": result.plan.count("offload"),
        "keep": result.plan.count("keep"),
    }
    if json_out:
        _emit_json(summary)
        return
    _print_report(result.report, title=f"{graph.name}: {summary['solver']} ({summary['status']}), "
                                       f"solved in {summary['solve_time_s']:.2f} s", budget=b)
    out.print(f"keep-all: {format_bytes(base.peak_bytes)}, {base.time_s * 1e3:.2f} ms -> overhead "
              f"{summary['overhead'] * 100:.1f}%; {summary['recompute']} recomputed, {summary['offload']} "
              f"offloaded, {summary['keep']} kept; wrote [bold]{output}[/bold]")


# ---- frontier -----------------------------------------------------------------------------------
@app.command()
@_guard
def frontier(
    graph_file: Annotated[Path, typer.Argument(help="graph.json")],
    budgets: Annotated[str, typer.Option(help="comma-separated budgets")] = "30%,40%,50%,60%,70%,80%,90%,100%",
    solver: Annotated[str, typer.Option("--solver", "-s")] = "auto",
    time_limit: Annotated[float, typer.Option("--time-limit", help="seconds per budget")] = 30.0,
    json_out: JsonOpt = False,
) -> None:
    """Predicted step-time overhead at each budget: memory against time."""
    from memplan.solvers import solve_frontier

    graph = Graph.load(str(graph_file))
    pairs = [(text.strip(), _budget(text, graph)) for text in budgets.split(",") if text.strip()]
    points = solve_frontier(graph, [b for _, b in pairs], solver, time_limit_s=time_limit)
    rows = [{"budget": label, "budget_bytes": b, "overhead": ov} for (label, _), (b, ov) in zip(pairs, points, strict=True)]
    if json_out:
        _emit_json({"graph": graph.name, "solver": solver, "points": rows})
        return
    t = Table(title=f"{graph.name}: frontier ({solver})")
    t.add_column("budget")
    t.add_column("bytes", justify="right")
    t.add_column("overhead", justify="right")
    for r in rows:
        t.add_row(r["budget"], format_bytes(r["budget_bytes"]),
                  "infeasible" if r["overhead"] is None else f"{r['overhead'] * 100:.1f}%")
    out.print(t)


# ---- solvers ------------------------------------------------------------------------------------
@app.command(name="solvers")
@_guard
def list_solvers(json_out: JsonOpt = False) -> None:
    """List the registered solvers."""
    from memplan.solvers import solvers as registry

    reg = registry()
    rows = [{"name": s.name, "description": s.description, "graphs": s.graphs, "exact": s.exact,
             "offload": s.offload, "max_saved_activations": s.max_ops} for s in reg.values()]
    if json_out:
        _emit_json(rows)
        return
    t = Table(title="solvers")
    for c in ("name", "exact", "offload", "description"):
        t.add_column(c)
    for r in rows:
        t.add_row(r["name"], str(r["exact"]), str(r["offload"]), r["description"])
    out.print(t)


# ---- plan: profile + solve in one go (the main job until `run` lands) --------------------------
@app.command(name="plan")
@_guard
def plan_workload(
    workload: Annotated[str, typer.Argument(help="built-in (mlp, resnet, gpt2, unet, bert) or path/to/file.py:function")],
    budget: Annotated[str, typer.Option("--budget", "-b")] = "50%",
    solver: Annotated[str, typer.Option("--solver", "-s")] = "auto",
    output: Annotated[Path, typer.Option("-o", "--output", help="plan file to write")] = Path("plan.json"),
    graph_output: Annotated[Path, typer.Option("--graph", help="graph file to write")] = Path("graph.json"),
    time_limit: Annotated[float, typer.Option("--time-limit")] = 60.0,
    offload: Annotated[bool, typer.Option("--offload/--no-offload")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Profile WORKLOAD, solve under BUDGET and write the graph and the plan."""
    from memplan.planner.profiler import profile as run_profile
    from memplan.planner.workloads import load_workload
    from memplan.solvers import keep_all_report
    from memplan.solvers import solve as run_solve

    w = load_workload(workload)
    graph = run_profile(w.model, w.batch, w.loss_fn, name=w.name, progress=not json_out)
    graph.save(str(graph_output))
    b = _budget(budget, graph)
    result = run_solve(graph, b, solver, time_limit_s=time_limit, offload=offload)
    result.plan.save(str(output))
    base = keep_all_report(graph)
    summary = {"workload": w.name, "graph": str(graph_output), "plan": str(output), "solver": result.plan.solver.name,
               "status": result.status, "budget_bytes": b, "keep_all_peak_bytes": base.peak_bytes,
               "measured_keep_all_peak_bytes": graph.measured.peak_bytes,
               "predicted_peak_bytes": result.report.peak_bytes, "keep_all_step_s": base.time_s,
               "predicted_step_s": result.report.time_s, "solve_time_s": result.solve_time_s}
    if json_out:
        _emit_json(summary)
        return
    _print_report(result.report, title=f"{w.name}: {summary['solver']} ({summary['status']})", budget=b)
    measured = graph.measured.peak_bytes
    out.print(f"keep-all predicted {format_bytes(base.peak_bytes)}"
              + (f" (measured {format_bytes(measured)})" if measured else "")
              + f", {base.time_s * 1e3:.1f} ms; plan: {format_bytes(result.report.peak_bytes)}, "
              f"{result.report.time_s * 1e3:.1f} ms; wrote {graph_output} and {output}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
