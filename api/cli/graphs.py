"""Commands on graphs: ``profile`` a workload into one, ``simulate`` a plan on one, the file formats'
``schema``; and :func:`profile_workload`, the profile the planning commands share."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from memplan.api.cli.base import app, emit_json, err, guard, out
from memplan.api.cli.files import writable, writing
from memplan.api.cli.options import (
    WORKLOAD_HELP,
    EngineOpt,
    FakeOpt,
    FuseOpt,
    JsonOpt,
    NprocOpt,
    OwnCheckpointingOpt,
    SetOpt,
    SpecOpt,
    fuse_mode,
    needs_fake,
    workload_options,
)
from memplan.api.cli.ranks import ranks_fake
from memplan.api.cli.tables import print_report, report_dict
from memplan.planner.core.errors import MemplanError
from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Plan
from memplan.planner.core.units import format_bytes


def model_checkpointing(model: Any, choice: str) -> None:
    """``--own-checkpointing``: for a model that checkpoints itself (planner/probe/checkpointing.py), ``off``
    switches that off for good (the workload's model is this process's: ``run`` trains it so, under the
    plan) and says so in one line; ``keep`` leaves it (the profile warns)."""
    from memplan.planner.probe.checkpointing import switch_off

    if choice not in ("off", "keep"):
        raise MemplanError(f"--own-checkpointing {choice!r}: choose off or keep")
    if choice == "off":
        found = switch_off(model)
        if found is not None:
            err.print(f"warning: {found.line()}; switched off: memplan plans every activation itself "
                      f"(--own-checkpointing keep plans over the model's checkpointed step)",
                      markup=False, highlight=False, soft_wrap=True)


def profile_workload(w: Any, *, fake: bool, device_spec: str | None, device: str | None = None,
                      repeats: int = 3, json_out: bool = False, fuse: str | None = None,
                      own_checkpointing: str = "off") -> Graph:
    """The graph of workload ``w``: a real profile, or a fake one (``--fake``, ``--device-spec``); a real one
    also measures what fusing the optimizer into ``fuse`` costs (``Graph.fused_extra_s``).
    ``own_checkpointing``: :func:`model_checkpointing`'s choice, taken before the profile."""
    from memplan.planner.core.devicespec import load_device_spec
    from memplan.planner.probe.profiler import profile as run_profile

    model_checkpointing(w.model, own_checkpointing)
    spec = load_device_spec(device_spec) if device_spec else None
    return run_profile(w.model, w.batch, w.loss_fn, device=device, repeats=repeats, name=w.name,
                       progress=not json_out, fake=fake, device_spec=spec, fuse=fuse)


# ---- profile ------------------------------------------------------------------------------------
@app.command()
@guard
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
    fuse: FuseOpt = None,
    own_checkpointing: OwnCheckpointingOpt = "off",
    json_out: JsonOpt = False,
) -> None:
    """Profile a training step of WORKLOAD (real, or under fake tensors) and write its graph. With --fake
    --nproc N, print each rank's traced keep-everything peak under --engine instead (no graph written).
    --fuse backward (or forward): also time steps with the optimizer fused there, so that plans for such a
    loop (solve --fuse) predict its cost."""
    from memplan.planner.workloads import load_workload

    fuse = fuse_mode(fuse)
    needs_fake("profile", nproc, fake)
    if nproc > 1:
        ranks_fake(workload, nproc=nproc, engine=engine, budget=None, solver="auto", time_limit=0.0,
                    options=options, json_out=json_out)
        return
    writable(output)
    w = load_workload(workload, **workload_options(options))
    graph = profile_workload(w, fake=fake, device_spec=device_spec, device=device, repeats=repeats,
                              json_out=json_out, fuse=fuse, own_checkpointing=own_checkpointing)
    with writing(output):
        graph.save(str(output))
    summary = {"graph": str(output), "name": graph.name, "ops": len(graph.ops), "tensors": len(graph.tensors),
               "saved_activations": len(graph.saved_activations), "fingerprint": graph.fingerprint,
               "model_fingerprint": graph.model_fingerprint, "fixed_bytes": graph.fixed.resident_bytes,
               "measured_peak_bytes": graph.measured.peak_bytes, "measured_step_s": graph.measured.step_time_s,
               "fake": bool(graph.meta.get("fake")), "profile_peak_bytes": graph.meta.get("profile_peak_bytes"),
               "op_timing": graph.meta.get("op_timing")}
    if json_out:
        emit_json(summary)
        return
    out.print(f"wrote [bold]{output}[/bold]: {summary['ops']} ops, {summary['saved_activations']} saved "
              f"activations, fixed memory {format_bytes(summary['fixed_bytes'])}", soft_wrap=True)


# ---- simulate -----------------------------------------------------------------------------------
@app.command()
@guard
def simulate(
    graph_file: Annotated[Path, typer.Argument(help="graph.json")],
    plan_file: Annotated[Path | None, typer.Argument(help="plan.json (default: keep everything)")] = None,
    timeline: Annotated[bool, typer.Option(help="include the per-op memory timeline in --json")] = False,
    fuse: Annotated[str | None, typer.Option(
        "--fuse", help="backward, forward or none: the step with the optimizer fused there (default: what the "
                       "plan was solved for)")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Replay one training step of a graph under a plan and print the predicted peak and time."""
    from memplan.planner.core.simulator import simulate as run_sim

    mode = fuse_mode(fuse, none=True)
    graph = Graph.load(str(graph_file))
    plan = Plan.load(str(plan_file)) if plan_file else None
    if fuse is None and plan is not None:  # a plan solved for a fused step is that step's
        recorded = plan.solver.settings.get("fuse")
        mode = recorded if recorded in ("backward", "forward") else None
    report = run_sim(graph, plan, fuse=mode)
    if json_out:
        d = report.model_dump() if timeline else report_dict(report)
        emit_json({**d, "fuse": mode})
        return
    print_report(report, title=f"{graph.name} under {'keep everything' if plan is None else plan_file}"
                               + (f", optimizer fused into {mode}" if mode else ""))


# ---- schema -------------------------------------------------------------------------------------
@app.command()
@guard
def schema(which: Annotated[str, typer.Argument(help="graph or plan")]) -> None:
    """Print the JSON Schema of the graph or plan file format."""
    if which == "graph":
        emit_json(Graph.model_json_schema())
    elif which == "plan":
        emit_json(Plan.model_json_schema())
    else:
        raise MemplanError(f"unknown schema {which!r}; choose 'graph' or 'plan'")
