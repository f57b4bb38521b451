"""Fake profiling against real profiling (issue #10), written to docs/benchmarks.md with ``--update-doc``.

1. Per built-in: the real profile and the fake one (op times alone on this CPU, a fresh op-time cache each
   repeat, so the fake profile's time includes timing every distinct op once), interleaved ``--repeats``
   times (which goes first alternates), each repeat between two runs of MEASURED_STEPS plain eager steps
   timed with the device's clock: the fake graph's keep-everything simulated step time against that
   measured step (issue 21's target: within 15% in every repeat) and against the real graph's;
   structure equal (every field but times), bytes equal, and per op name the forward + backward seconds
   of each graph (where they differ). Then (unless ``--skip-plans``) the plans solved from each graph at
   50% run in turn (``--repeats`` times, interleaved): the fake plan's measured peak against its
   prediction, and its measured step time against the real plan's.

On a machine shared with other jobs two things make wall-clock figures unreadable, and the benchmark
removes both: torch runs one thread (two threads on two busy cores spin at their barriers: a step took
15 times longer and varied 4x run to run), and every clock the profiles and the executor read is this
process's CPU time (``time.perf_counter`` is replaced by ``time.process_time`` for the run), so the time
other jobs hold the cores is charged to neither side. With one thread CPU time is the step's compute and
memory time.
2. The 1.1B Llama of benchmarks/llama1b.py (meta device, sequence 2048) profiled with ``--fake
   --device-spec``, in a child process: wall time (imports included) and the child's peak RSS.
3. ``memplan run --fake`` on an MLP whose keep-everything peak is more than twice the budget: the
   allocator's peak while profiling and while training under the plan.

    python benchmarks/fake.py [--repeats 3] [--skip-1b] [--skip-plans] [--models mlp,gpt2,densenet] [--update-doc]

``densenet`` is benchmark-local (:func:`densenet`, issue 37); ``--without-kernel-scratch`` runs the fake
profile as it was before the kernels' own scratch was shadowed (planner/probe/hostheap.py), for the
before/after figures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _doc import update_section  # benchmarks/_doc.py (the scripts run from this folder)
from fidelity import machine

from memplan.executor.session import run_plan
from memplan.planner.core.errors import Infeasible
from memplan.planner.core.simulator import simulate
from memplan.planner.core.units import format_bytes, parse_budget
from memplan.planner.probe.device import device_of
from memplan.planner.probe.hostheap import process_faults
from memplan.planner.probe.measure import time_steps
from memplan.planner.probe.optime import OpTimer
from memplan.planner.probe.profiler import profile
from memplan.planner.workloads import Workload, default_optimizer, load_workload, training_step
from memplan.solvers import activation_bytes, solve

ROOT = Path(__file__).resolve().parent.parent
BUILTINS = ["mlp", "resnet", "gpt2", "unet", "bert", "rnn"]
TIMES = {"time_s", "backward_time_s", "time_source"}
MEASURED_STEPS = 8  # plain steps timed before and after each repeat's profiles
WALL_CLOCK = time.perf_counter  # kept before main() makes time.perf_counter read CPU time


def structure(g) -> dict:
    d = g.model_dump(exclude={"meta", "measured", "optimizer_time_s"})
    d["fixed"].pop("optimizer_step_bytes")
    for f in d["fused_backward"]:  # its share of the optimizer step's transient, which differs by design
        f.pop("step_bytes")
    d["ops"] = [{k: v for k, v in op.items() if k not in TIMES} for op in d["ops"]]
    return d


def sizes(g) -> tuple:
    return ([t.bytes for t in g.tensors], g.fixed.resident_bytes,
            [(o.workspace_bytes, o.backward_workspace_bytes, o.backward_grad_alloc_bytes,
              o.backward_grad_free_bytes) for o in g.ops])


def op_seconds(g) -> dict[str, float]:
    """Forward + backward seconds per op name, and the optimizer step's, of graph ``g``."""
    out: dict[str, float] = {}
    for op in g.ops:
        out[op.name] = out.get(op.name, 0.0) + op.time_s + op.backward_time_s
    out["optimizer step"] = g.optimizer_time_s
    return out


def measured_step_s(w, optimizer, faults: list[float] | None = None) -> float:
    """The plain eager step (no mode, no hooks), the median of MEASURED_STEPS steps timed with the device's
    clock (one thread: this thread's CPU time). ``faults`` receives the steps' page faults per step (the
    kernel's count: what the fake profile's fresh-page charge predicts)."""
    before = process_faults()
    times = time_steps(w.model, w.batch, w.loss_fn, optimizer, steps=MEASURED_STEPS, device=torch.device("cpu"),
                       clock=device_of(torch.device("cpu")).clock())
    if faults is not None:
        faults.append((process_faults() - before) / MEASURED_STEPS)
    return times.step_s


class DenseBlock(torch.nn.Module):
    """A DenseNet block (Huang et al., 2017): each layer (BatchNorm2d, ReLU, 3x3 Conv2d adding ``growth``
    channels) reads the concatenation of every earlier output, so activations cross the whole block (a
    DAG) and the inputs of the late convolutions outgrow glibc's 32 MiB mmap threshold (issue 37)."""

    def __init__(self, layers: int = 8, growth: int = 32, in_channels: int = 3):
        super().__init__()
        self.layers = torch.nn.ModuleList()
        c = in_channels
        for _ in range(layers):
            self.layers.append(torch.nn.Sequential(torch.nn.BatchNorm2d(c), torch.nn.ReLU(),
                                                   torch.nn.Conv2d(c, growth, 3, padding=1)))
            c += growth

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.layers:
            features.append(layer(torch.cat(features, 1)))
        return torch.cat(features, 1)


def densenet() -> Workload:
    """Issue 37's DenseNet-style step: 8 layers, growth 32, batch 16 of 3x64x64, a mean-square loss."""
    torch.manual_seed(0)
    return Workload("densenet", DenseBlock(), torch.randn(16, 3, 64, 64),
                    lambda model, x: model(x).pow(2).mean())


LOCAL = {"densenet": densenet}  # benchmark-local workloads, beside the built-ins


def builtin_row(name: str, repeats: int, plans: bool = True) -> dict:
    w = LOCAL[name]() if name in LOCAL else load_workload(name)
    errors, fake_s, real_s, per_op, keep_real, keep_fake = [], [], [], [], [], []
    steps, vs_step, eager, fresh, real_vs_step, drift, faults = [], [], [], [], [], [], []
    real = fake = None
    optimizer = default_optimizer(w.model)
    training_step(w.model, w.batch, w.loss_fn, optimizer)  # the optimizer's state, as in steady training

    def run_real():
        start = time.perf_counter()
        graph = profile(w.model, w.batch, w.loss_fn, device="cpu", progress=False, measure=False, name=name)
        real_s.append(time.perf_counter() - start)
        return graph

    def run_fake():
        with tempfile.TemporaryDirectory() as cache:
            start = time.perf_counter()
            graph = profile(w.model, w.batch, w.loss_fn, device="cpu", progress=False, fake=True, name=name,
                            timer=OpTimer(torch.device("cpu"), cache_dir=cache))
            fake_s.append(time.perf_counter() - start)
        return graph

    for i in range(repeats):  # interleaved, and which goes first alternates: the machine's load hits both
        before = measured_step_s(w, optimizer, faults)
        if i % 2 == 0:
            real, fake = run_real(), run_fake()
        else:
            fake, real = run_fake(), run_real()
        after = measured_step_s(w, optimizer, faults)
        steps.append((before + after) / 2)  # around the profiles: the same load
        drift.append(after / before - 1)  # the machine's own drift over the repeat: the same step, minutes apart
        keep_real.append(simulate(real, None).time_s)
        keep_fake.append(simulate(fake, None).time_s)
        real_vs_step.append(keep_real[-1] / steps[-1] - 1)  # the control: the real profile's step, same reference
        errors.append(keep_fake[-1] / keep_real[-1] - 1)
        vs_step.append(keep_fake[-1] / steps[-1] - 1)
        eager.append((fake.meta["op_timing"]["eager_forward_s"], fake.meta["op_timing"]["eager_backward_s"]))
        fresh.append(fake.meta.get("fresh_pages", {}))
        r, f = op_seconds(real), op_seconds(fake)
        per_op.append({k: (r[k], f.get(k, 0.0), sum(1 for op in real.ops if op.name == k)) for k in r})
    ops = {k: (statistics.median(p[k][0] for p in per_op), statistics.median(p[k][1] for p in per_op),
               per_op[0][k][2]) for k in per_op[0]}
    row = {"model": name, "ops": len(real.ops), "structure_equal": structure(real) == structure(fake),
           "bytes_equal": sizes(real) == sizes(fake),
           "keep_all_time_error": statistics.median(errors), "error_spread": (min(errors), max(errors)),
           "keep_all_real_s": statistics.median(keep_real), "keep_all_fake_s": statistics.median(keep_fake),
           "measured_step_s": statistics.median(steps), "step_spread_s": (min(steps), max(steps)),
           "vs_step": statistics.median(vs_step), "vs_step_spread": (min(vs_step), max(vs_step)),
           "vs_step_all": vs_step, "real_vs_step_all": real_vs_step, "step_drift_all": drift,
           "eager_overhead_s": eager[-1],
           "fresh_pages": [f.get("pages_per_step", 0.0) for f in fresh],
           "fresh_s": [f.get("seconds_per_step", 0.0) for f in fresh],
           "measured_faults": faults,
           "ops_by_name": ops, "fake_time_sources": sorted({op.time_source for op in fake.ops}),
           "real_profile_s": statistics.median(real_s), "fake_profile_s": statistics.median(fake_s),
           "distinct_ops": fake.meta["op_timing"]["distinct"]}
    if not plans:
        return row
    for pct in ("50%", "60%", "70%", "80%"):  # 50%, or the first above the loss head's floor
        budget_f = parse_budget(pct, activation_bytes=activation_bytes(fake), fixed_bytes=fake.fixed.resident_bytes)
        budget_r = parse_budget(pct, activation_bytes=activation_bytes(real), fixed_bytes=real.fixed.resident_bytes)
        try:
            plan_f = solve(fake, budget_f, "auto", time_limit_s=30).plan
            plan_r = solve(real, budget_r, "auto", time_limit_s=30).plan
            break
        except Infeasible:
            continue
    runs_f, runs_r = [], []
    for i in range(repeats):
        f_then_r = [(runs_f, plan_f, fake), (runs_r, plan_r, real)]
        for runs, plan, graph in (f_then_r if i % 2 == 0 else f_then_r[::-1]):
            runs.append(run_plan(w.model, w.batch, w.loss_fn, None, plan, graph, steps=5, keep_all=False))
    ratios = [f.measured_step_s / r.measured_step_s - 1 for f, r in zip(runs_f, runs_r, strict=True)]
    return {**row, "budget": pct,
            "plan_predicted_peak": runs_f[0].predicted_peak_bytes,
            "same_plan": [d.model_dump() for d in plan_f.decisions] == [d.model_dump() for d in plan_r.decisions],
            "plan_measured_peaks": sorted({r.measured_peak_bytes for r in runs_f}),
            "step_vs_real_plan": statistics.median(ratios), "step_spread": (min(ratios), max(ratios))}


LLAMA = """
import resource, sys, time, torch
sys.path.insert(0, {bench!r})
from llama1b import build
from memplan.planner.core.devicespec import load_device_spec
from memplan.planner.probe.profiler import profile
from memplan.planner.core.simulator import simulate
from memplan.solvers import solve
start = time.perf_counter()
model, batch, loss_fn = build(batch_size={batch})
graph = profile(model, batch, loss_fn, progress=False, device_spec=load_device_spec({spec!r}), name="llama-1.1b")
profile_s = time.perf_counter() - start
keep = simulate(graph, None)
result = solve(graph, {budget}, "auto", time_limit_s=60)
print({{"params": sum(p.numel() for p in model.parameters()), "ops": len(graph.ops), "profile_s": profile_s,
       "keep_all_peak": keep.peak_bytes, "keep_all_s": keep.time_s, "plan_peak": result.report.peak_bytes,
       "plan_s": result.report.time_s, "solver": result.plan.solver.name, "status": result.status}})
"""


def llama_row(spec: str, batch: int, budget: int) -> dict:
    code = LLAMA.format(bench=str(Path(__file__).resolve().parent), spec=spec, batch=batch, budget=budget)
    start = WALL_CLOCK()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    wall = WALL_CLOCK() - start
    row = eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 - our own child's dict literal
    row.update(spec=spec, batch=batch, budget=budget, wall_s=wall,
               rss_bytes=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
    return row


def over_budget_row() -> dict:
    with tempfile.TemporaryDirectory() as cache:
        cmd = [str(Path(sys.executable).parent / "memplan"), "run", "mlp", "--fake", "--budget", "14MiB",
               "--steps", "3", "--json", "--set", "depth=24", "--set", "width=64", "--set", "batch_size=4096"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                             env={**os.environ, "MEMPLAN_CACHE_DIR": cache})
    return json.loads(out.stdout)


def _faults(row: dict) -> str:
    """The measured steps' page faults per step (median), or "-" for a row from before they were counted."""
    faults = row.get("measured_faults")
    return f"{statistics.median(faults):,.0f}" if faults else "-"


def render(rows: list[dict], llama: list[dict], over: dict | None, repeats: int) -> str:
    lines = [f"Machine: {machine()}; shared with other jobs while it ran (the load: see the notes below). "
             f"torch pinned to 1 thread and every clock read as this process's CPU time (see the script's "
             f"docstring: on the busy machine two threads and the wall clock made single steps vary 4x); medians "
             f"of {repeats} interleaved repeats, spread in brackets. `python benchmarks/fake.py --update-doc`.", "",
             "Each built-in at its default size. **Time**: the fake profile's keep-everything step (op times "
             "alone on this CPU with a fresh op-time cache each repeat, plus the eager per-call charge) against "
             f"the *measured* plain eager step (the median of {MEASURED_STEPS} steps timed just before and "
             f"{MEASURED_STEPS} just after the repeat's profiles, averaged; target: within 15% in every repeat), "
             "and against the real profile's keep-everything step (its op times calibrated to its own plain "
             "step). Every repeat's ratio is listed. Two controls show the machine's own noise, per repeat: the "
             "*real* profile's keep-everything step against the same measured step (what a profile of the step "
             "itself misses by), and the drift of the measured step over the repeat (the steps after the profiles "
             "over those before). *Fresh pages*: what the fake profile charged for the step's "
             "page faults (planner/probe/hostheap.py), pages per step and their time, medians over the repeats, "
             "against the page faults the measured steps took per step (the kernel's count, median).", "",
             "| model | ops | measured step [min, max] | fake keep-all | fake vs measured step (each repeat) | "
             "control: real profile vs measured step | control: step drift over the repeat | "
             "fake vs real profile | eager charge fwd / bwd per call | fresh pages: fake (time) / measured | "
             "real / fake profile |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lo, hi = r["error_spread"]
        slo, shi = r["step_spread_s"]
        each = ", ".join(f"{v * 100:+.0f}%" for v in r["vs_step_all"])
        control = ", ".join(f"{v * 100:+.0f}%" for v in r.get("real_vs_step_all", [])) or "-"
        drift = ", ".join(f"{v * 100:+.0f}%" for v in r.get("step_drift_all", [])) or "-"
        ef, eb = r["eager_overhead_s"]
        lines.append(f"| {r['model']} | {r['ops']} | {r['measured_step_s'] * 1e3:.0f} ms [{slo * 1e3:.0f}, "
                     f"{shi * 1e3:.0f}] | {r['keep_all_fake_s'] * 1e3:.0f} ms | {r['vs_step'] * 100:+.1f}% ({each}) | "
                     f"{control} | {drift} | "
                     f"{r['keep_all_time_error'] * 100:+.1f}% [{lo * 100:+.0f}, {hi * 100:+.0f}] | "
                     f"{ef * 1e6:.1f} / {eb * 1e6:.1f} us | {statistics.median(r.get('fresh_pages') or [0]):,.0f} "
                     f"({statistics.median(r.get('fresh_s') or [0]) * 1e3:.1f} ms) / "
                     f"{_faults(r)} | "
                     f"{r['real_profile_s']:.1f} / {r['fake_profile_s']:.1f} "
                     f"CPU s ({r['distinct_ops']} distinct calls) |")
    planned = [r for r in rows if "plan_predicted_peak" in r]
    if planned:
        lines += ["", "**Structure, bytes and plans** (issue #10): *structure*: every field but the times equal; "
                  "*bytes*: every tensor, fixed, workspace and gradient figure equal. The plans solved from each "
                  "graph at 50% (or the first of 60%, 70%, 80% above the loss head's floor, in brackets) run: the "
                  "fake plan's measured peak against its prediction (target: equal), and its measured step time "
                  "against the real plan's (target: within 10%; 5 timed steps per run). *same plan*: the two solves "
                  "made the same decisions (then the step ratio is the machine's noise alone).", "",
                  "| model | structure | bytes | fake plan: predicted peak | measured | same plan | step vs real plan |",
                  "|---|---|---|---:|---:|---|---:|"]
    for r in planned:
        slo, shi = r["step_spread"]
        measured = ", ".join(format_bytes(b) for b in r["plan_measured_peaks"])
        lines.append(f"| {r['model']} ({r['budget']}) | {'equal' if r['structure_equal'] else 'differs'} | "
                     f"{'equal' if r['bytes_equal'] else 'differ'} | {format_bytes(r['plan_predicted_peak'])} | "
                     f"{measured} | {'yes' if r.get('same_plan') else 'no'} | "
                     f"{r['step_vs_real_plan'] * 100:+.1f}% [{slo * 100:+.0f}, {shi * 100:+.0f}] |")
    lines += ["", "Where the fake and the real profile differ: per built-in, the op names whose forward + backward "
              "seconds differ most between the graphs (medians over the repeats, summed over the op's calls), "
              "and the optimizer step:", "", "| model | op | calls | real | fake | fake - real |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        ops = sorted(r["ops_by_name"].items(), key=lambda kv: -abs(kv[1][1] - kv[1][0]))
        for op, (real_s, fake_s, calls) in ops[:4]:
            lines.append(f"| {r['model']} | `{op}` | {calls} | {real_s * 1e3:.2f} ms | {fake_s * 1e3:.2f} ms | "
                         f"{(fake_s - real_s) * 1e3:+.2f} ms |")
    if llama:
        lines += ["", "The 1.1B Llama of `benchmarks/llama1b.py` (TinyLlama's shape, random init on the meta device, "
                  "sequence 2048, AdamW) profiled with `--fake --device-spec`, then solved; wall time and peak RSS "
                  "of the whole child process (Python and transformers imports included):", "",
                  "| spec | batch | params | ops | profile | wall (all) | peak RSS | keep-all predicted | budget | plan | "
                  "overhead |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in llama:
            lines.append(f"| {r['spec']} | {r['batch']} | {r['params'] / 1e9:.2f} B | {r['ops']} | {r['profile_s']:.1f} s | "
                         f"{r['wall_s']:.1f} s | {format_bytes(r['rss_bytes'])} | {format_bytes(r['keep_all_peak'])} | "
                         f"{format_bytes(r['budget'])} | {format_bytes(r['plan_peak'])} ({r['solver']}) | "
                         f"{(r['plan_s'] / r['keep_all_s'] - 1) * 100:+.1f}% |")
    if over:
        lines += ["", "`memplan run mlp --fake --budget 14MiB --set depth=24 --set width=64 --set batch_size=4096` "
                  "(keep-everything needs more than twice the budget): the allocator's peak while profiling and "
                  "while training under the plan, never above the budget:", "",
                  "| budget | profile_peak_bytes | measured_peak_bytes | predicted peak | keep-all predicted (never "
                  "allocated) |", "|---:|---:|---:|---:|---:|",
                  f"| {format_bytes(over['budget_bytes'])} | {format_bytes(over['profile_peak_bytes'])} | "
                  f"{format_bytes(over['measured_peak_bytes'])} | {format_bytes(over['predicted_peak_bytes'])} | "
                  f"{format_bytes(over['keep_all_predicted_peak_bytes'])} |"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default=",".join(BUILTINS))
    ap.add_argument("--skip-1b", action="store_true")
    ap.add_argument("--skip-plans", action="store_true", help="times only: no plans solved and run, no over-budget run")
    ap.add_argument("--update-doc", action="store_true")
    ap.add_argument("--results", type=Path, default=Path(tempfile.gettempdir()) / "memplan-fake-bench.json",
                    help="rows kept as they come (and read back by --render-only)")
    ap.add_argument("--render-only", action="store_true", help="write the table from --results, run nothing")
    ap.add_argument("--without-kernel-scratch", action="store_true",
                    help="the fake profile as before issue 37: kernels' own scratch not shadowed (its faults uncharged)")
    args = ap.parse_args()
    if args.without_kernel_scratch:
        import memplan.planner.probe.profiler as profiler_module
        profiler_module.kernel_scratch = lambda calls, device: {}
    # see the docstring: one thread, and CPU time for every clock the profiles and the executor read
    torch.set_num_threads(1)
    time.perf_counter = time.process_time
    if args.render_only:
        done = json.loads(args.results.read_text())
    else:
        done = {"llama": [], "over": None, "rows": []}
        steps = [] if args.skip_1b else [("llama", lambda: llama_row("h100-80gb", 1, 60 * 2**30)),
                                         ("llama", lambda: llama_row("l4", 2, 22 * 2**30))]
        if not args.skip_plans:
            steps.append(("over", over_budget_row))
        steps += [("rows", lambda n=n: builtin_row(n, args.repeats, plans=not args.skip_plans))
                  for n in args.models.split(",")]
        for key, step in steps:
            value = step()
            if key == "over":
                done["over"] = value
            else:
                done[key].append(value)
            args.results.write_text(json.dumps(done, default=list))
            print(key, value, flush=True)
    rows, llama, over = done["rows"], done["llama"], done["over"]
    text = render(rows, llama, over, args.repeats)
    print(text)
    if args.update_doc:
        update_section("fake", "Fake profiling against real profiling", text)


if __name__ == "__main__":
    main()
