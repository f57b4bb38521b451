"""The ``memplan`` command line (typer + rich). The only place, with the REST service, that prints.

Every command takes ``--json`` for machine-readable output on stdout. Errors the user can fix (a bad
file, an infeasible budget, an unknown workload) exit with status 2 and one line naming the problem;
anything else exits 1 with one line (set ``MEMPLAN_DEBUG=1`` for the traceback).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import Progress, TextColumn
from rich.table import Table

from memplan.planner.core.errors import Infeasible, MemplanError, PlanMismatch
from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Plan
from memplan.planner.core.units import check_budget, format_bytes, parse_budget

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="memplan: plan what to keep, recompute or offload so a training step fits a memory budget.")
out = Console()
err = Console(stderr=True)

EXIT_USER = 2
EXIT_INTERNAL = 1

JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable JSON on stdout")]
SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", metavar="KEY=VALUE", help="a workload option, repeatable: --set n_layer=2 --set size=base "
                                       "(built-ins take their config's field names; see planner/workloads.py)")]

# the built-ins of memplan.planner.workloads.BUILTINS (named here: importing it would import torch for --help)
WORKLOAD_HELP = "built-in (mlp, resnet, gpt2, unet, bert, rnn) or path/to/file.py:function"


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


def _working(what: str, *, quiet: bool) -> contextlib.AbstractContextManager[Any]:
    """A spinner on stderr while a long call runs (none under --json or off a terminal)."""
    return contextlib.nullcontext() if quiet or not err.is_terminal else err.status(what, spinner="dots")


def _workload_options(pairs: list[str] | None) -> dict[str, Any]:
    """``["n_layer=2", "hidden_sizes=32,64", "layer_type=basic"]`` -> keyword arguments: JSON scalars
    (ints, floats, true/false) as such, comma-separated lists as tuples, anything else as a string."""

    def value(text: str) -> Any:
        try:
            v = json.loads(text)
        except ValueError:
            return text
        return v if isinstance(v, (int, float, bool, str)) else text

    options: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip().isidentifier():
            raise MemplanError(f"--set {pair!r}: expected KEY=VALUE, for example --set n_layer=2")
        text = text.strip()
        options[key.strip()] = tuple(value(p.strip()) for p in text.split(",") if p.strip()) if "," in text \
            else value(text)
    return options

FakeOpt = Annotated[bool, typer.Option(
    "--fake", help="trace the step under fake tensors: no activation, gradient or optimizer state is "
                   "allocated; each op is timed alone on this device (cached) instead")]
SpecOpt = Annotated[str | None, typer.Option(
    "--device-spec", metavar="NAME|FILE", help="plan for another device: time the ops analytically from its "
                                               "spec (implies --fake): a100-80gb, h100-80gb, l4, rtx-4090 or a "
                                               "JSON file")]

NprocOpt = Annotated[int, typer.Option("--nproc", max=64, help="ranks: with --fake, each rank's memory "
                                                                     "for N ranks, traced in this process under "
                                                                     "PyTorch's fake process group")]
EngineOpt = Annotated[str, typer.Option(help="with --nproc > 1: ddp (DistributedDataParallel) or fsdp (FSDP2 "
                                             "fully_shard per block)")]


def _profile_workload(w: Any, *, fake: bool, device_spec: str | None, device: str | None = None,
                      repeats: int = 3, json_out: bool = False) -> Graph:
    """The graph of workload ``w``: a real profile, or a fake one (``--fake``, ``--device-spec``)."""
    from memplan.planner.core.devicespec import load_device_spec
    from memplan.planner.probe.profiler import profile as run_profile

    spec = load_device_spec(device_spec) if device_spec else None
    return run_profile(w.model, w.batch, w.loss_fn, device=device, repeats=repeats, name=w.name,
                       progress=not json_out, fake=fake, device_spec=spec)


def _budget(text: str, graph: Graph) -> int:
    from memplan.api.jobs import resolve_budget

    value = resolve_budget(text, graph)
    assert value is not None  # a budget string always gives bytes
    return value


def _budget_list(text: str) -> list[str]:
    """``--budgets 50%,6GiB``: the budgets, each checked (no graph needed); an empty list is refused."""
    budgets = [b.strip() for b in text.split(",") if b.strip()]
    if not budgets:
        raise MemplanError(f"--budgets {text!r}: no budget in it; give e.g. --budgets 50%,70%,6GiB")
    for b in budgets:
        check_budget(b)
    return budgets


def _writable(*paths: Path | None) -> None:
    """Refuse, before any long work, an output that cannot be written: a folder, or a file whose folder
    cannot be created or written (missing folders are created now)."""
    for path in paths:
        if path is None:
            continue
        if path.is_dir():
            raise MemplanError(f"cannot write {path}: it is a folder")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise MemplanError(f"cannot write {path}: cannot create folder {path.parent}: {e.strerror}") from None
        if not os.access(path.parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise MemplanError(f"cannot write {path}: permission denied")


@contextlib.contextmanager
def _writing(path: Path) -> Any:
    """Create ``path``'s folder, and turn a failed write (full disk, a folder removed meanwhile) into one
    line."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield
    except OSError as e:
        raise MemplanError(f"cannot write {path}: {e.strerror or e}") from None


# ---- profile ------------------------------------------------------------------------------------
@app.command()
@_guard
def profile(
    workload: Annotated[str, typer.Argument(help=WORKLOAD_HELP)],
    output: Annotated[Path, typer.Option("-o", "--output", help="graph file to write")] = Path("graph.json"),
    device: Annotated[str | None, typer.Option(help="cpu or cuda (default: cuda when available)")] = None,
    repeats: Annotated[int, typer.Option(min=1, max=100, help="timed repeats (median)")] = 3,
    options: SetOpt = None,
    fake: FakeOpt = False,
    device_spec: SpecOpt = None,
    nproc: NprocOpt = 1,
    engine: EngineOpt = "ddp",
    json_out: JsonOpt = False,
) -> None:
    """Profile a training step of WORKLOAD (real, or under fake tensors) and write its graph. With --fake
    --nproc N, print each rank's traced keep-everything peak under --engine instead (no graph written)."""
    from memplan.planner.workloads import load_workload

    _needs_fake("profile", nproc, fake)
    if nproc > 1:
        _ranks_fake(workload, nproc=nproc, engine=engine, budget=None, solver="auto", time_limit=0.0,
                    options=options, json_out=json_out)
        return
    _writable(output)
    w = load_workload(workload, **_workload_options(options))
    graph = _profile_workload(w, fake=fake, device_spec=device_spec, device=device, repeats=repeats,
                              json_out=json_out)
    with _writing(output):
        graph.save(str(output))
    summary = {"graph": str(output), "name": graph.name, "ops": len(graph.ops), "tensors": len(graph.tensors),
               "saved_activations": len(graph.saved_activations), "fingerprint": graph.fingerprint,
               "model_fingerprint": graph.model_fingerprint, "fixed_bytes": graph.fixed.resident_bytes,
               "measured_peak_bytes": graph.measured.peak_bytes, "measured_step_s": graph.measured.step_time_s,
               "fake": bool(graph.meta.get("fake")), "profile_peak_bytes": graph.meta.get("profile_peak_bytes"),
               "op_timing": graph.meta.get("op_timing")}
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
    from memplan.planner.core.simulator import simulate as run_sim

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
    checkpoint: Annotated[list[str] | None, typer.Option(
        "--checkpoint", help="--solver manual: recompute what this module (a path prefix such as "
                             "transformer.h.3) saves; repeat for more")] = None,
    keep_tensor: Annotated[list[int] | None, typer.Option(
        "--keep-tensor", help="--solver manual: keep this saved activation (a tensor id), recompute the "
                              "others; repeat for more")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Find the fastest plan whose simulated peak fits the budget, and write it."""
    from memplan.solvers import keep_all_report
    from memplan.solvers import solve as run_solve

    _writable(output)
    graph = Graph.load(str(graph_file))
    b = _budget(budget, graph)
    host = parse_budget(host_budget) if host_budget else None
    manual = {k: v for k, v in (("checkpoint", checkpoint), ("tensors", keep_tensor)) if v}
    if manual and solver != "manual":
        raise MemplanError("--checkpoint and --keep-tensor write a plan by hand: use them with --solver manual")
    with _working(f"solving with {solver} (up to {time_limit:g} s)", quiet=json_out):
        result = run_solve(graph, b, solver, time_limit_s=time_limit, offload=offload, host_budget_bytes=host,
                           **manual)
    with _writing(output):
        result.plan.save(str(output))
    base = keep_all_report(graph)
    summary = {
        "plan": str(output), "solver": result.plan.solver.name, "status": result.status,
        "budget_bytes": b, "peak_bytes": result.report.peak_bytes, "time_s": result.report.time_s,
        "keep_all_peak_bytes": base.peak_bytes, "keep_all_time_s": base.time_s,
        "overhead": result.report.time_s / base.time_s - 1.0 if base.time_s else 0.0,
        "solve_time_s": result.solve_time_s, "gap": result.gap, "lower_bound_s": result.lower_bound_s,
        "recompute": result.plan.count("recompute"), "offload": result.plan.count("offload"),
        "keep": result.plan.count("keep"), "recompute_each": result.plan.count("recompute_each"),
    }
    if json_out:
        _emit_json(summary)
        return
    _print_report(result.report, title=f"{graph.name}: {summary['solver']} ({summary['status']}), "
                                       f"solved in {summary['solve_time_s']:.2f} s", budget=b)
    out.print(f"keep-all: {format_bytes(base.peak_bytes)}, {base.time_s * 1e3:.2f} ms -> overhead "
              f"{summary['overhead'] * 100:.1f}%; {summary['recompute']} recomputed, "
              + (f"{summary['recompute_each']} recomputed per use, " if summary["recompute_each"] else "")
              + f"{summary['offload']} "
              f"offloaded, {summary['keep']} kept; wrote [bold]{output}[/bold]")
    if result.lower_bound_s is not None and result.gap is not None:  # a proven bound on the step time
        out.print(f"proven lower bound {result.lower_bound_s * 1e3:.2f} ms: gap {result.gap * 100:.2f}%")


# ---- frontier -----------------------------------------------------------------------------------
@app.command()
@_guard
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
    """Predicted step-time overhead at each budget: memory against time."""
    from memplan.solvers import keep_all_report, solve_frontier

    texts = _budget_list(budgets)
    _writable(plot)
    if graph_file.is_file() and not str(graph_file).endswith(".py"):
        graph = Graph.load(str(graph_file))
    else:  # a workload: profiled here (--fake and --device-spec as for memplan plan)
        from memplan.planner.workloads import load_workload

        w = load_workload(str(graph_file), **_workload_options(options))
        graph = _profile_workload(w, fake=fake, device_spec=device_spec, json_out=json_out)
    pairs = [(text, _budget(text, graph)) for text in texts]
    names = [n.strip() for n in solver.split(",") if n.strip()] or ["auto"]
    series: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    # One solve per (solver, budget): a bar on stderr (hidden under --json; rich draws none off a terminal).
    with Progress(*Progress.get_default_columns(), TextColumn("{task.fields[what]}"), console=err,
                  transient=True, disable=json_out) as progress:
        task = progress.add_task("frontier", total=len(names) * len(pairs), what="")
        for name in names:
            for label, b in pairs:
                progress.update(task, what=f"{name} at {label}")
                (_, ov), = solve_frontier(graph, [b], name, time_limit_s=time_limit)
                series[name].append({"budget": label, "budget_bytes": b, "overhead": ov})
                progress.advance(task)
    if plot is not None:
        from memplan.api.plots import frontier_png

        with _writing(plot):
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
        _emit_json(doc)
        return
    t = Table(title=f"{graph.name}: frontier ({solver})")
    t.add_column("budget")
    t.add_column("bytes", justify="right")
    for n in names:
        t.add_column("overhead" if len(names) == 1 else n, justify="right")
    for i, r in enumerate(rows):
        t.add_row(r["budget"], format_bytes(r["budget_bytes"]),
                  *("infeasible" if series[n][i]["overhead"] is None else f"{series[n][i]['overhead'] * 100:.1f}%"
                    for n in names))
    out.print(t)
    if plot is not None:
        out.print(f"wrote [bold]{plot}[/bold]")


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


# ---- plan: profile + solve in one go ----------------------------------------------------------
@app.command(name="plan")
@_guard
def plan_workload(
    workload: Annotated[str, typer.Argument(help=WORKLOAD_HELP)],
    budget: Annotated[str, typer.Option("--budget", "-b")] = "50%",
    solver: Annotated[str, typer.Option("--solver", "-s")] = "auto",
    output: Annotated[Path, typer.Option("-o", "--output", help="plan file to write")] = Path("plan.json"),
    graph_output: Annotated[Path, typer.Option("--graph", help="graph file to write")] = Path("graph.json"),
    time_limit: Annotated[float, typer.Option("--time-limit")] = 60.0,
    offload: Annotated[bool, typer.Option("--offload/--no-offload")] = False,
    options: SetOpt = None,
    fake: FakeOpt = False,
    device_spec: SpecOpt = None,
    nproc: NprocOpt = 1,
    engine: EngineOpt = "ddp",
    json_out: JsonOpt = False,
) -> None:
    """Profile WORKLOAD, solve under BUDGET and write the graph and the plan. With --fake --nproc N, print
    each rank's plan, predicted and traced peak under --engine instead (nothing written)."""
    from memplan.planner.workloads import load_workload
    from memplan.solvers import keep_all_report
    from memplan.solvers import solve as run_solve

    _needs_fake("plan", nproc, fake)
    if nproc > 1:
        _ranks_fake(workload, nproc=nproc, engine=engine, budget=budget, solver=solver, time_limit=time_limit,
                    options=options, json_out=json_out)
        return
    check_budget(budget)  # before profiling: a typo is not found a minute later
    _writable(output, graph_output)
    w = load_workload(workload, **_workload_options(options))
    graph = _profile_workload(w, fake=fake, device_spec=device_spec, json_out=json_out)
    with _writing(graph_output):
        graph.save(str(graph_output))
    b = _budget(budget, graph)
    result = run_solve(graph, b, solver, time_limit_s=time_limit, offload=offload)
    with _writing(output):
        result.plan.save(str(output))
    base = keep_all_report(graph)
    summary = {"workload": w.name, "device": graph.meta.get("device_spec") or graph.device, "graph": str(graph_output), "plan": str(output), "solver": result.plan.solver.name,
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


# ---- maxbatch: the largest batch (or sequence) whose best plan fits ---------------------------------
def _fraction(text: str) -> float:
    """``"20%"`` or ``"0.2"`` -> 0.2."""
    t = text.strip()
    try:
        value = float(t[:-1]) / 100.0 if t.endswith("%") else float(t)
    except ValueError:
        raise MemplanError(f"cannot read overhead {text!r}: expected e.g. '20%' or 0.2") from None
    if not (value >= 0 and value < float("inf")):
        raise MemplanError(f"overhead {text!r} must be a non-negative finite number")
    return value


@app.command(name="maxbatch")
@_guard
def maxbatch(
    workload: Annotated[str, typer.Argument(help="built-in, path/to/file.py:function, or a graph .json with a "
                                                 "shape family")],
    budget: Annotated[str, typer.Option("--budget", "-b", help="device memory, e.g. 24GiB or 512MB")],
    max_overhead: Annotated[str | None, typer.Option("--max-overhead", help="e.g. 20%: step time at most "
                                                     "1.2x keeping everything (default: any)")] = None,
    dim: Annotated[str, typer.Option("--dim", help="batch or seq")] = "batch",
    max_value: Annotated[int | None, typer.Option("--max", min=1, help="search no higher (e.g. the model's "
                                                  "maximum sequence length)")] = None,
    solver: Annotated[str, typer.Option("--solver", "-s")] = "auto",
    time_limit: Annotated[float, typer.Option("--time-limit", help="solver seconds per candidate")] = 10.0,
    offload: Annotated[bool, typer.Option("--offload/--no-offload")] = False,
    output: Annotated[Path, typer.Option("-o", "--output", help="plan file to write (for the answer)")] = Path("plan.json"),
    graph_output: Annotated[Path, typer.Option("--graph", help="graph file to write (the answer's shape)")] = Path("graph.json"),
    family_output: Annotated[Path | None, typer.Option("--save-family", help="also write the profiled shape "
                                                       "family (a graph file maxbatch and POST /v1/maxbatch read)")] = None,
    options: SetOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """The largest batch size (or --dim seq) whose best plan fits BUDGET within --max-overhead, and the plan.

    Answered from one profile: WORKLOAD's step is profiled at its batch and at 3/4 and 1/2 of it along
    DIM, the sizes are fitted as polynomials of DIM (a shape family), and each candidate is that family
    evaluated and solved; no candidate is trained."""
    from memplan.solvers.maxbatch import MAX_VALUE, max_dim

    if budget.strip().endswith("%"):
        raise MemplanError(f"maxbatch takes a budget in bytes (e.g. 24GiB), not {budget!r}: a percentage is of "
                           f"one shape's activation memory")
    b = parse_budget(budget)
    overhead = _fraction(max_overhead) if max_overhead is not None else None
    if workload.endswith(".json"):
        graph = Graph.load(workload)
        name = graph.name
    else:
        from memplan.api.integrations.common import dim_family
        from memplan.planner.probe.family import profile_family
        from memplan.planner.workloads import load_workload

        w = load_workload(workload, **_workload_options(options))
        graph = profile_family(w.model, dim_family(w.batch, dim), w.loss_fn, name=w.name,
                               progress=not json_out)
        name = w.name
        if family_output is not None:
            graph.save(str(family_output))
    with _working(f"searching {dim}", quiet=json_out):
        answer = max_dim(graph, b, dim=dim, max_overhead=overhead, method=solver, time_limit_s=time_limit,
                         offload=offload, max_value=max_value or MAX_VALUE)
    answer.result.plan.save(str(output))
    answer.graph.save(str(graph_output))
    report = answer.result.report
    summary = {"workload": name, "dim": dim, "value": answer.value, "budget_bytes": b,
               "max_overhead": overhead, "predicted_peak_bytes": report.peak_bytes,
               "predicted_step_s": report.time_s, "overhead": answer.overhead,
               "solver": answer.result.plan.solver.name, "plan": str(output), "graph": str(graph_output),
               "next": {"value": answer.next.value, "reason": answer.next.reason,
                        "min_feasible_bytes": answer.next.min_feasible_bytes, "overhead": answer.next.overhead},
               "candidates": len(answer.probes)}
    if json_out:
        _emit_json(summary)
        return
    nxt = answer.next
    why = nxt.reason + (f" (needs at least {format_bytes(nxt.min_feasible_bytes)})" if nxt.min_feasible_bytes
                        else "")
    out.print(f"{name}: largest {dim} {answer.value} under {format_bytes(b)}"
              + (f" within {overhead:.0%} overhead" if overhead is not None else "")
              + f": {summary['solver']} plan, predicted peak {format_bytes(report.peak_bytes)}, "
              f"{report.time_s * 1e3:.1f} ms ({answer.overhead:+.1%}); {dim} {nxt.value}: {why}; "
              f"wrote {graph_output} and {output}")


# ---- run: profile, solve, train under the plan, predicted against measured ------------------------
@app.command(name="run")
@_guard
def run_workload(
    workload: Annotated[str, typer.Argument(help=WORKLOAD_HELP)],
    budget: Annotated[str, typer.Option("--budget", "-b", help="e.g. 6GiB, 512MB or 50% (ignored with --plan)")] = "50%",
    solver: Annotated[str, typer.Option("--solver", "-s", help="auto, dp, ilp, greedy, ... (memplan solvers)")] = "auto",
    offload: Annotated[bool, typer.Option("--offload/--no-offload", help="allow offloading to host memory")] = False,
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
    if nproc > 1 and fake:  # every rank's plan in this process, nothing trained
        _ranks_fake(workload, nproc=nproc, engine=engine, budget=budget, solver=solver, time_limit=time_limit,
                    options=options, json_out=json_out)
        return
    if nproc > 1:
        _run_distributed(workload, nproc=nproc, engine=engine, budget=budget, solver=solver, fuse=fuse,
                         steps=steps, time_limit=time_limit, options=options, json_out=json_out,
                         unsupported={"--offload": offload, "--plan": plan_file is not None,
                                      "--graph": graph_file is not None, "--save-plan": save_plan is not None,
                                      "--save-graph": save_graph is not None, "-o/--output": output is not None,
                                      "--device": device is not None})
        return
    from memplan.executor.session import run_plan
    from memplan.planner.core.errors import PlanError
    from memplan.planner.workloads import load_workload
    from memplan.solvers import solve as run_solve

    if fuse not in (None, "backward", "forward"):
        raise MemplanError(f"--fuse {fuse!r}: choose backward or forward")
    if graph_file is not None and plan_file is None:
        raise MemplanError("--graph is the graph of a --plan: give --plan too (without --plan, run profiles)")
    if plan_file is None:
        check_budget(budget)  # before profiling: a typo is not found a minute later
    _writable(save_plan, save_graph, output)
    w = load_workload(workload, **_workload_options(options))
    if plan_file is not None:
        graph_file = graph_file or plan_file.with_name("graph.json")
        if not graph_file.is_file():
            raise PlanError(f"--plan {plan_file} needs the graph it was made for: --graph graph.json "
                            f"({graph_file} does not exist)")
        graph = Graph.load(str(graph_file))
        plan = Plan.load(str(plan_file))
        plan.check_against(graph)
    else:
        graph = _profile_workload(w, fake=fake, device_spec=None, device=device, json_out=json_out)
        b = _budget(budget, graph)
        with _working(f"solving with {solver} (up to {time_limit:g} s)", quiet=json_out):
            plan = run_solve(graph, b, solver, time_limit_s=time_limit, offload=offload).plan
    if save_graph is not None:
        with _writing(save_graph):
            graph.save(str(save_graph))
    if save_plan is not None:
        with _writing(save_plan):
            plan.save(str(save_plan))
    with _working(f"training {warmup + 1 + steps} steps under the plan"
                  + (" and as many keeping everything" if keep_all else ""), quiet=json_out):
        report = run_plan(w.model, w.batch, w.loss_fn, None, plan, graph, steps=steps, warmup=warmup, fuse=fuse,
                          keep_all=keep_all, name=w.name)
    doc = report.as_dict()
    if output is not None:
        with _writing(output):
            output.write_text(json.dumps(doc, indent=1) + "\n")
    if json_out:
        _emit_json({k: v for k, v in doc.items() if k != "timeline"} | ({"report": str(output)} if output else {}))
        return
    _print_run(report)
    written = [str(p) for p in (output, save_plan, save_graph) if p is not None]
    if written:
        out.print(f"wrote [bold]{', '.join(written)}[/bold]")


def _free_loopback_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ranks_fake(workload: str, *, nproc: int, engine: str, budget: str | None, solver: str, time_limit: float,
                options: list[str] | None, json_out: bool) -> None:
    """``--fake --nproc N``: every rank's traced and predicted peak in this process (nothing trained):
    :func:`memplan.api.distributed.plan_ranks_fake`."""
    from memplan.api.distributed import format_rows, plan_ranks_fake
    from memplan.planner.probe.distributed import ENGINES

    if engine not in ENGINES:
        raise MemplanError(f"--engine {engine!r}: choose {' or '.join(ENGINES)}")
    with _working(f"tracing {nproc} {engine} ranks under the fake process group", quiet=json_out):
        rows = plan_ranks_fake(workload, world_size=nproc, engine=engine, budget=budget, solver=solver,
                               time_limit_s=time_limit, workload_options=_workload_options(options))
    if json_out:
        _emit_json({"workload": workload, "engine": engine, "world_size": nproc, "fake": True, "ranks": rows})
    else:
        out.print(format_rows(rows))


def _needs_fake(command: str, nproc: int, fake: bool) -> None:
    if nproc < 1:
        raise MemplanError(f"--nproc {nproc}: need at least 1 rank")
    if nproc > 1 and not fake:
        raise MemplanError(f"memplan {command} --nproc {nproc} needs --fake (each rank traced in this process); "
                           f"memplan run --nproc {nproc} trains on {nproc} processes")


def _dist_worker(rank: int, world: int, port: int, kwargs: dict[str, Any], result_path: str) -> None:
    """One rank of ``memplan run --nproc``: torchrun's environment, then :func:`run_distributed`. Rank 0
    writes the rows (or the one-line error) to ``result_path``; every rank's MemplanError is reported."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    import torch.distributed as dist

    from memplan.api.distributed import run_distributed

    try:
        rows = run_distributed(**kwargs)
    except MemplanError as e:
        Path(f"{result_path}.{rank}").write_text(json.dumps({"error": f"rank {rank}: {e}"}))
        # exit non-zero at once: the parent then stops the other ranks, which may be waiting for this one
        # in a collective (rank 0 solves while the others wait for its plan)
        os._exit(3)
    if dist.is_initialized():
        dist.destroy_process_group()
    if rank == 0:
        Path(f"{result_path}.{rank}").write_text(json.dumps({"rows": rows}))


def _run_distributed(workload: str, *, nproc: int, engine: str, budget: str, solver: str, fuse: str | None,
                     steps: int, time_limit: float, options: list[str] | None, json_out: bool,
                     unsupported: dict[str, bool]) -> None:
    """``memplan run --nproc N``: N processes on this machine, one rank each (what ``torchrun
    --nproc-per-node N -m memplan.api.distributed`` does, without torchrun)."""
    import logging
    import tempfile

    import torch.multiprocessing as mp

    # stopping the other ranks after one failed is expected here; the failure itself is reported below
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)

    from memplan.api.distributed import format_rows
    from memplan.planner.probe.distributed import ENGINES

    given = [flag for flag, on in unsupported.items() if on]
    if given:
        raise MemplanError(f"memplan run --nproc {nproc} does not take {', '.join(given)} yet: distributed runs "
                           f"profile, solve (recompute plans) and train on every rank themselves")
    if engine not in ENGINES:
        raise MemplanError(f"--engine {engine!r}: choose {' or '.join(ENGINES)}")
    kwargs = {"workload": workload, "budget": budget, "engine": engine, "steps": steps, "solver": solver,
              "fuse": fuse, "time_limit_s": time_limit, "workload_options": _workload_options(options)}
    with tempfile.TemporaryDirectory(prefix="memplan-run-") as tmp:
        result = os.path.join(tmp, "result")
        with _working(f"training on {nproc} processes ({engine})", quiet=json_out):
            try:
                mp.start_processes(_dist_worker, args=(nproc, _free_loopback_port(), kwargs, result),
                                   nprocs=nproc, start_method="spawn")
                failed = None
            except mp.ProcessRaisedException as e:  # not a MemplanError: a bug, but say which rank
                failed = str(e).strip().splitlines()[-1]
            except mp.ProcessExitedException as e:
                failed = f"a rank exited with code {e.exit_code}"
        answers = [json.loads(Path(tmp, name).read_text()) for name in sorted(os.listdir(tmp))]
    errors = [a["error"] for a in answers if "error" in a]
    if errors:
        raise MemplanError(errors[0])
    if failed is not None or not answers:
        raise MemplanError(f"distributed run failed: {failed or 'rank 0 wrote no result'}")
    rows = answers[0]["rows"]
    if json_out:
        _emit_json({"workload": workload, "engine": engine, "world_size": nproc, "ranks": rows})
        return
    out.print(format_rows(rows))


def _print_run(r: Any) -> None:
    def pct(predicted: float, measured: float | None) -> str:
        return f"{(predicted / measured - 1) * 100:+.1f}%" if measured else "-"

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.1f} ms"

    t = Table(title=f"{r.workload} on {r.device}: {r.solver} plan ({r.status}), {r.decisions['recompute']} "
                    f"recomputed, {r.decisions['offload']} offloaded"
                    + (f", fused {r.fuse}" if r.fuse else "") + f"; median of {r.steps} steps")
    for c in ("", "predicted", "measured", "predicted vs measured"):
        t.add_column(c, justify="left" if not c else "right")
    t.add_row("peak under the plan", format_bytes(r.predicted_peak_bytes), format_bytes(r.measured_peak_bytes),
              pct(r.predicted_peak_bytes, r.measured_peak_bytes))
    t.add_row("step time under the plan", ms(r.predicted_step_s), ms(r.measured_step_s),
              pct(r.predicted_step_s, r.measured_step_s))
    kp = r.keep_all_measured_peak_bytes
    t.add_row("peak keeping everything", format_bytes(r.keep_all_predicted_peak_bytes),
              format_bytes(kp) if kp is not None else "-", pct(r.keep_all_predicted_peak_bytes, kp))
    t.add_row("step time keeping everything", ms(r.keep_all_predicted_step_s), ms(r.keep_all_measured_step_s),
              pct(r.keep_all_predicted_step_s, r.keep_all_measured_step_s))
    mo = r.measured_overhead
    t.add_row("step overhead vs keep-all", f"{r.predicted_overhead * 100:+.1f}%",
              f"{mo * 100:+.1f}%" if mo is not None else "-",
              f"{(r.predicted_overhead - mo) * 100:+.1f} points" if mo is not None else "-")
    out.print(t)
    if r.budget_bytes is not None:
        within = r.within_budget()
        out.print(f"budget {format_bytes(r.budget_bytes)}: measured peak is "
                  f"{r.measured_peak_bytes / r.budget_bytes * 100:.1f}% of it "
                  + ("[green](within budget + 5%)[/green]" if within else "[red](over budget + 5%)[/red]"))
    if r.profile_peak_bytes is not None:
        out.print(f"profiling peak {format_bytes(r.profile_peak_bytes)} (allocator); keeping everything would "
                  f"need {format_bytes(r.keep_all_predicted_peak_bytes)} (predicted"
                  + (")" if kp else ", never allocated)"))
    if kp and r.keep_all_measured_step_s:
        out.print(f"measured: {(1 - r.measured_peak_bytes / kp) * 100:.1f}% less peak memory than keeping "
                  f"everything, at {(r.measured_step_s / r.keep_all_measured_step_s - 1) * 100:+.1f}% step time")


# ---- show: a plan, readable, and its memory timeline ---------------------------------------------
@app.command()
@_guard
def show(
    plan_file: Annotated[Path, typer.Argument(help="plan.json")],
    graph_file: Annotated[Path, typer.Option("--graph", "-g", help="the graph.json the plan was made for")],
    run_file: Annotated[Path | None, typer.Option("--run", help="a run report with a measured peak / timeline")] = None,
    output: Annotated[Path, typer.Option("-o", "--output", help="PNG of the memory timeline to write")] = Path("timeline.png"),
    top: Annotated[int, typer.Option(min=0, help="largest non-kept activations to list")] = 10,
    json_out: JsonOpt = False,
) -> None:
    """Summarise a plan (what it keeps, recomputes, offloads; predicted peak and time) and plot its
    memory timeline, against the measured one when a run report is given."""
    from memplan.api.plots import load_run_report, timeline_png
    from memplan.planner.core.simulator import simulate as run_sim
    from memplan.solvers import keep_all_report

    _writable(output)
    graph = Graph.load(str(graph_file))
    plan = Plan.load(str(plan_file))
    report = run_sim(graph, plan)  # checks the plan against the graph (fingerprint, tensor ids)
    base = keep_all_report(graph)
    measured = load_run_report(run_file) if run_file else None
    if measured and measured.graph_fingerprint and measured.graph_fingerprint != graph.fingerprint:
        raise PlanMismatch(f"run report {run_file} is of graph {measured.graph_fingerprint}, not of "
                           f"{graph_file} ({graph.fingerprint}); give the run of this graph")
    with _writing(output):
        timeline_png(output, report.timeline, budget_bytes=plan.budget_bytes, measured=measured,
                     title=f"{graph.name}: {plan.solver.name} plan ({plan.solver.status})")
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
        "largest_moved": [{"tensor": d.tensor, "action": d.action.value, "bytes": tensors[d.tensor].bytes,
                           "producer": graph.ops[tensors[d.tensor].producer].name,
                           "module": graph.ops[tensors[d.tensor].producer].module} for d in moved[:top]],
    }
    if measured and measured.peak_bytes:
        summary["peak_error"] = report.peak_bytes / measured.peak_bytes - 1.0
    if measured and measured.step_time_s:
        summary["step_error"] = report.time_s / measured.step_time_s - 1.0
    if json_out:
        _emit_json(summary)
        return
    _print_report(report, title=f"{graph.name}: {plan.solver.name} plan ({plan.solver.status}, solved in "
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
    out.print(f"wrote [bold]{output}[/bold]")


# ---- serve: the REST service -------------------------------------------------------------------
@app.command()
@_guard
def serve(
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535)] = 8000,
    cache: Annotated[str | None, typer.Option(help="SQLite plan cache file (':memory:' for none kept); "
                                                   "default ~/.cache/memplan/plans.sqlite")] = None,
    workers: Annotated[int, typer.Option(min=1, max=256, help="solves that run at once (worker processes)")] = 2,
    token: Annotated[str | None, typer.Option(
        envvar="MEMPLAN_TOKEN", show_envvar=True,
        help="require 'Authorization: Bearer TOKEN' on every route but /healthz (for a shared server)")] = None,
    allowed_hosts: Annotated[str | None, typer.Option(
        "--allowed-hosts", envvar="MEMPLAN_ALLOWED_HOSTS", show_envvar=True,
        help="comma-separated Host header values to answer ('*': any); default: the loopback names when "
             "--host is a loopback address (against DNS rebinding), any otherwise")] = None,
) -> None:
    """Serve the REST API (OpenAPI docs at /docs). Other limits: MEMPLAN_* variables (see api/settings.py)."""
    import uvicorn

    from memplan.api.app import create_app
    from memplan.api.cache import PlanCache
    from memplan.api.settings import Settings, default_cache_path, is_loopback

    settings = Settings.from_env(cache_path=cache or default_cache_path(), workers=workers,
                                 **({"token": token} if token is not None else {}))
    settings = replace(settings, allowed_hosts=allowed_hosts if allowed_hosts is not None
                       else ",".join(settings.hosts_for(host)))
    PlanCache(settings.cache_path, max_bytes=settings.cache_max_bytes).close()  # heal it, or one line now
    if not is_loopback(host) and not settings.token:
        err.print(f"[yellow]warning:[/yellow] serving on {host} without --token: anyone who can reach this "
                  f"address can use the server", highlight=False)
    err.print(f"memplan serving on http://{host}:{port} (docs at /docs), plan cache {settings.cache_path}, "
              f"{settings.workers} {settings.pool} workers" + (", token required" if settings.token else ""),
              highlight=False)
    uvicorn.run(create_app(settings), host=host, port=port, log_level="warning")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
