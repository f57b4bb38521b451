"""``maxbatch``: the largest batch (or sequence) whose best plan fits a budget, from one profile."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from memplan.api.cli.base import app, emit_json, guard, out, working
from memplan.api.cli.options import (
    FakeOpt,
    HostBudgetOpt,
    JsonOpt,
    SetOpt,
    SpecOpt,
    StatesOnOpt,
    StatesOpt,
    fuse_mode,
    state_choice,
    workload_options,
)
from memplan.planner.core.errors import MemplanError
from memplan.planner.core.graph import Graph
from memplan.planner.core.units import format_bytes, parse_budget


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
@guard
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
    host_budget: HostBudgetOpt = None,
    states: StatesOpt = None,
    states_on: StatesOnOpt = "auto",
    fuse: Annotated[str | None, typer.Option(help="backward or forward: the training loop steps the optimizer "
                                                  "there; size the batch for that step")] = None,
    output: Annotated[Path, typer.Option("-o", "--output", help="plan file to write (for the answer)")] = Path("plan.json"),
    graph_output: Annotated[Path, typer.Option("--graph", help="graph file to write (the answer's shape)")] = Path("graph.json"),
    family_output: Annotated[Path | None, typer.Option("--save-family", help="also write the profiled shape "
                                                       "family (a graph file maxbatch and POST /v1/maxbatch read)")] = None,
    options: SetOpt = None,
    fake: FakeOpt = False,
    device_spec: SpecOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """The largest batch size (or --dim seq) whose best plan fits BUDGET within --max-overhead, and the plan.

    Answered from one profile: WORKLOAD's step is profiled at its batch and at 3/4 and 1/2 of it along
    DIM, the sizes are fitted as polynomials of DIM (a shape family), and each candidate is that family
    evaluated and solved; no candidate is trained. With --fake (or --device-spec) the three profiles are
    fake: a batch the device cannot hold, or a model on the meta device, is sized without allocating it."""
    from memplan.solvers.maxbatch import MAX_VALUE, max_dim

    if budget.strip().endswith("%"):
        raise MemplanError(f"maxbatch takes a budget in bytes (e.g. 24GiB), not {budget!r}: a percentage is of "
                           f"one shape's activation memory")
    b = parse_budget(budget)
    host = parse_budget(host_budget) if host_budget else None
    fuse = fuse_mode(fuse)  # before profiling: a typo is not found minutes later
    overhead = _fraction(max_overhead) if max_overhead is not None else None
    if workload.endswith(".json"):
        graph = Graph.load(workload)
        name = graph.name
    else:
        from memplan.api.integrations.common import dim_family
        from memplan.planner.core.devicespec import load_device_spec
        from memplan.planner.probe.family import profile_family
        from memplan.planner.workloads import load_workload

        w = load_workload(workload, **workload_options(options))
        spec = load_device_spec(device_spec) if device_spec else None
        graph = profile_family(w.model, dim_family(w.batch, dim), w.loss_fn, name=w.name,
                               progress=not json_out, fake=fake, device_spec=spec)
        name = w.name
        if family_output is not None:
            graph.save(str(family_output))
    with working(f"searching {dim}", quiet=json_out):
        answer = max_dim(graph, b, dim=dim, max_overhead=overhead, method=solver, time_limit_s=time_limit,
                         offload=offload, max_value=max_value or MAX_VALUE, fuse=fuse, host_budget_bytes=host,
                         states=state_choice(states, states_on))
    answer.result.plan.save(str(output))
    answer.graph.save(str(graph_output))
    report = answer.result.report
    summary = {"workload": name, "dim": dim, "value": answer.value, "budget_bytes": b,
               "max_overhead": overhead, "fuse": fuse, "predicted_peak_bytes": report.peak_bytes,
               "predicted_step_s": report.time_s, "overhead": answer.overhead,
               "solver": answer.result.plan.solver.name, "plan": str(output), "graph": str(graph_output),
               "next": {"value": answer.next.value, "reason": answer.next.reason,
                        "min_feasible_bytes": answer.next.min_feasible_bytes, "overhead": answer.next.overhead},
               "candidates": len(answer.probes)}
    if json_out:
        emit_json(summary)
        return
    nxt = answer.next
    why = nxt.reason + (f" (needs at least {format_bytes(nxt.min_feasible_bytes)}, {nxt.min_feasible_bytes} B)"
                        if nxt.min_feasible_bytes else "")
    out.print(f"{name}: largest {dim} {answer.value} under {format_bytes(b)}"
              + (f" within {overhead:.0%} overhead" if overhead is not None else "")
              + f": {summary['solver']} plan, predicted peak {format_bytes(report.peak_bytes)}, "
              f"{report.time_s * 1e3:.1f} ms ({answer.overhead:+.1%}); {dim} {nxt.value}: {why}; "
              f"wrote {graph_output} and {output}", soft_wrap=True)
