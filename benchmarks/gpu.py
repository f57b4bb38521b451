"""The GPU acceptance run, in one command: memplan on a CUDA GPU as a user runs it.

    python benchmarks/gpu.py --out gpu-results            # about 6 minutes on one H100
    python benchmarks/gpu.py --only fp32,does-not-fit     # a subset of the steps below
    python benchmarks/gpu.py --smoke --out /tmp/smoke     # tiny sizes under the CUDA emulation (CPU, CI)

Steps, most valuable first, each under its own time limit, each result written as soon as it exists
(``results.json`` in ``--out``, and ``section.md``: the markdown for docs/benchmarks.md's CUDA section):

1. the ``gpu``-marked tests (``pytest -m gpu``);
2. GPT-2 base (12 layers, width 768, sequence 1024, batch 8, fp32, AdamW foreach): profiled on the GPU;
   keep everything; memplan's plans at 30 / 50 / 70% of activation memory; an offload plan at 25%; the 50%
   plan with backward and with forward fusion; per-block ``torch.utils.checkpoint`` and per-block selective
   checkpointing (matmuls and attention saved), and memplan's plan at each of their measured peaks (at
   per-block checkpoint's also with offload allowed). Every
   variant built, measured and freed alone on the device (``max_memory_allocated`` counts everything the
   process holds), its measured peak and median step time (``--rounds`` steps, synchronised), beside
   the simulator's prediction and the budget;
3. the same model under bf16 autocast: keep everything and the 50% plan;
4. a batch keep-everything cannot hold: ``memplan run gpt2 --set batch_size=48 --fake --budget 60GiB``.

The GPU machine reaches no package registry and has its own torch: carry what it lacks as wheels.
``benchmarks/gpu_wheels.sh`` (on a machine with the registry) downloads them into ``.whl/`` at the versions
this virtualenv has (ortools, pulp, highspy, pydantic with pydantic-core, annotated-types and
typing-inspection, fastapi with opentelemetry-api, which fastapi 0.16x imports, starlette, uvicorn,
immutabledict, protobuf, typing_extensions; about 50 MB); ``benchmarks/gpu_run.sh`` (on the GPU machine,
``.whl/`` carried) installs them and memplan under ``/tmp``, runs this script and then the test suite with
CUDA visible, each under a time limit, and packs the results into ``$OUT/results.tgz``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

# benchmarks/executor.py's side-by-side machinery, loaded by path (its name is the executor package's)
_spec = importlib.util.spec_from_file_location("executor_bench", Path(__file__).resolve().parent / "executor.py")
_bench = importlib.util.module_from_spec(_spec)
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.modules["executor_bench"] = _bench  # (its dataclasses look their module up)
_spec.loader.exec_module(_bench)
Variant, blocks, make, settle = _bench.Variant, _bench.blocks, _bench.make, _bench.settle
timed_rounds, wrap_blocks = _bench.timed_rounds, _bench.wrap_blocks
from memplan.executor import apply  # noqa: E402
from memplan.planner.core.errors import Infeasible  # noqa: E402
from memplan.planner.core.plan import Action  # noqa: E402
from memplan.planner.core.simulator import simulate  # noqa: E402
from memplan.planner.probe.device import default_device_type, device_of, emulate_cuda  # noqa: E402
from memplan.planner.probe.profiler import profile  # noqa: E402
from memplan.planner.workloads import default_optimizer, load_workload  # noqa: E402
from memplan.solvers import activation_bytes, smallest_known_peak, solve  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FULL = dict(size="base", seq_len=1024, batch_size=8)
STEPS = ("tests", "fp32", "bf16", "does-not-fit")
SMOKE = dict(n_layer=2, n_embd=64, n_head=2, vocab_size=128, seq_len=64, batch_size=2)


class Results:
    """``results.json`` and ``section.md`` in ``out``, rewritten after every step."""

    def __init__(self, out: Path, device: str):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.data: dict[str, Any] = {"device": device, "torch": torch.__version__, "steps": {}}
        self.lines: list[str] = []

    def put(self, step: str, value: Any) -> None:
        self.data["steps"][step] = value
        (self.out / "results.json").write_text(json.dumps(self.data, indent=1, default=str))

    def md(self, *lines: str) -> None:
        self.lines += lines
        (self.out / "section.md").write_text("\n".join(self.lines) + "\n")


@contextlib.contextmanager
def step(results: Results, name: str, limit_s: float) -> Iterator[None]:
    """One step: its failure is recorded (with the traceback) and the run goes on; its time is recorded."""
    t0 = time.perf_counter()
    print(f"== {name} (limit {limit_s:.0f} s)", flush=True)
    try:
        yield
    except Exception as e:  # noqa: BLE001 - an acceptance run reports every step, failed or not
        results.put(f"{name}:error", "".join(traceback.format_exception(e))[-4000:])
        results.md(f"* **{name} failed**: `{type(e).__name__}: {str(e)[:300]}`")
        print(f"{name} failed: {e}", flush=True)
    results.put(f"{name}:seconds", time.perf_counter() - t0)


def gpu_tests(results: Results, limit_s: float) -> None:
    # a module that cannot be imported there (a package the GPU machine lacks) must not stop the gpu tests
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-rfEs",
           "--continue-on-collection-errors", "tests"]
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit_s)
        tail, rc = (p.stdout + p.stderr)[-3000:], p.returncode
    except subprocess.TimeoutExpired as e:
        tail, rc = f"timed out after {limit_s:.0f} s: {(e.stdout or b'')[-2000:]!r}", 124
    results.put("gpu_tests", {"returncode": rc, "tail": tail})
    last = tail.strip().splitlines()[-1] if tail.strip() else ""
    results.md(f"* gpu-marked tests: exit {rc}, `{last}`")


def _row(v: Variant, keep: Variant) -> dict[str, Any]:
    return {"label": v.label, "budget_bytes": v.budget_bytes, "predicted_peak_bytes": v.predicted_peak_bytes,
            "measured_peak_bytes": v.peak_bytes, "predicted_step_s": v.predicted_step_s,
            "step_s": v.step_s, "step_times_s": v.times_s,
            "measured_overhead": v.step_s / keep.step_s - 1.0,
            "offloaded": v.plan.count(Action.OFFLOAD) if v.plan else None,
            "recomputed": v.plan.count(Action.RECOMPUTE) if v.plan else None,
            "resident_before_bytes": getattr(v, "resident_before_bytes", None),
            "alloc_retries": getattr(v, "alloc_retries", None)}


def _table(rows: list[dict[str, Any]], keep_predicted_s: float) -> list[str]:
    out = ["| run | budget | predicted peak | measured peak | measured / predicted | overhead predicted | "
           "measured (median, min-max) |", "|---|---|---|---|---|---|---|"]
    base = rows[0]["step_s"]

    def gb(b: int | None) -> str:
        return "-" if b is None else f"{b / 1e9:.3f} GB"

    for r in rows:
        ratio = (f"{r['measured_peak_bytes'] / r['predicted_peak_bytes'] - 1:+.2%}"
                 if r["predicted_peak_bytes"] else "-")
        pred = f"{r['predicted_step_s'] / keep_predicted_s - 1:+.1%}" if r["predicted_step_s"] else "-"
        lo, hi = min(r["step_times_s"]) / base - 1, max(r["step_times_s"]) / base - 1
        out.append(f"| {r['label']} | {gb(r['budget_bytes'])} | {gb(r['predicted_peak_bytes'])} | "
                   f"{gb(r['measured_peak_bytes'])} | {ratio} | {pred} | "
                   f"{r['measured_overhead']:+.1%} ({lo:+.1%}..{hi:+.1%}) |")
    return out


def _plan(graph: Any, budget: int, *, offload: bool = False, limit_s: float = 10.0):
    try:
        return solve(graph, budget, "auto", time_limit_s=limit_s, offload=offload).plan
    except Infeasible:
        return None


def _free(device: Any) -> None:
    """Drop what earlier variants left (garbage, the caching allocator's reserved blocks): the next one is
    measured on a device that holds only the batch."""
    gc.collect()
    device.synchronize()
    if not device.emulated:
        torch.cuda.empty_cache()


def _retries(device: Any) -> int:
    """The caching allocator's retries (a failed cudaMalloc, cache freed, tried again): each is a device
    synchronisation and slows the step that meets it, so a step time with retries is not the plan's."""
    return 0 if device.emulated else int(torch.cuda.memory_stats(device.torch_device).get("num_alloc_retries", 0))


def _measured_alone(build: Callable[[], Variant], batch: Any, loss_fn: Callable, rounds: int,
                    device: Any) -> Variant:
    """Build one variant on a device that holds nothing else but the batch, measure its peak (one step
    after a warm-up) and time ``rounds`` steps, then free it: each variant's peak is its own, as a user's
    one training process would measure it (``max_memory_allocated`` counts everything the process holds,
    and eleven models with their optimizer states side by side are 22 GB), and no variant's step time
    pays for another's reserved memory."""
    _free(device)
    others = device.memory_allocated() if device.has_allocator_counters else None
    v = build()
    settle(v, batch, loss_fn, warmup=1)
    before = _retries(device)
    timed_rounds([v], batch, loss_fn, rounds)
    v.resident_before_bytes, v.alloc_retries = others, _retries(device) - before
    if v.executor is not None:
        v.executor.remove()
    v.model = v.optimizer = v.executor = None
    return v


def gpt2_side_by_side(results: Results, sizes: dict[str, int], rounds: int, autocast: bool,
                      log: Callable[[str], None]) -> None:
    """Step 2 (``autocast`` False) or 3 (bf16 autocast: keep everything and the 50% plan)."""
    w = load_workload("gpt2", **sizes)
    loss_fn = w.loss_fn
    if autocast:
        def loss_fn(model: Any, batch: Any, _inner: Callable = w.loss_fn) -> torch.Tensor:
            with torch.autocast(device_of(model).torch_device.type, dtype=torch.bfloat16):
                return _inner(model, batch)
    device = device_of("cuda")
    _free(device)
    t0 = time.perf_counter()
    # fp32 also measures what fused optimizer steps add (Graph.fused_extra_s): the fused rows' prediction
    graph = profile(w.model, w.batch, loss_fn, name="gpt2", device="cuda", progress=False, measure=False,
                    fuse=None if autocast else ("backward", "forward"))
    log(f"profiled in {time.perf_counter() - t0:.1f} s")
    batch = {k: v.to(device.torch_device) for k, v in w.batch.items()}
    base = w.model.to("cpu")  # each variant copies it to the device; the original holds no device memory
    for p in base.parameters():
        p.grad = None
    del w
    fixed, act = graph.fixed.resident_bytes, activation_bytes(graph)

    def plain(label: str, wrap: Callable[[nn.Module], None] | None = None) -> Callable[[], Variant]:
        def build() -> Variant:
            v = make(label, base)
            v.model.to(device.torch_device)
            v.optimizer = default_optimizer(v.model)
            if wrap is not None:
                wrap(v.model)
            return v
        return build

    def planned(label: str, plan: Any, fuse: str | None = None) -> Callable[[], Variant]:
        def build() -> Variant:
            v = plain(label)()
            v.plan, v.budget_bytes = plan, plan.budget_bytes
            v.executor = apply(v.model, plan, graph=graph, optimizer=v.optimizer, fuse=fuse)
            r = simulate(graph, plan, timeline=False, fuse=fuse)
            v.predicted_peak_bytes, v.predicted_step_s = r.peak_bytes, r.time_s
            return v
        return build

    builds: list[Callable[[], Variant]] = [plain("keep everything")]
    missing: list[str] = []  # the rows no plan fits (said under the table, never dropped silently)
    fractions = (0.5,) if autocast else (0.3, 0.5, 0.7)
    for frac in fractions:
        plan = _plan(graph, fixed + int(act * frac))
        if plan is not None:
            builds.append(planned(f"memplan at {frac:.0%}", plan))
        else:
            missing.append(f"memplan at {frac:.0%}: no plan fits {fixed + int(act * frac)} B")
    if not autocast:
        # 25% of activation memory, or the least peak an offload plan reaches when that is higher (the
        # smoke's tiny model), so that the offload path always runs
        budget = max(fixed + int(act * 0.25), smallest_known_peak(graph, offload=True))
        plan = _plan(graph, budget, offload=True)
        label = f"memplan at {(budget - fixed) / act:.0%}, offload allowed"
        if plan is not None:
            builds.append(planned(label, plan))
        else:
            missing.append(f"{label}: no plan fits {budget} B")
        half = _plan(graph, fixed + int(act * 0.5))
        if half is not None:
            builds += [planned(f"memplan at 50%, fused {f}", half, f) for f in ("backward", "forward")]
        builds += [plain("checkpoint every block", lambda m: wrap_blocks(blocks("gpt2", m), selective=False)),
                   plain("selective checkpoint (matmuls, attention saved)",
                         lambda m: wrap_blocks(blocks("gpt2", m), selective=True))]
    variants = []
    for build in builds:
        variants.append(_measured_alone(build, batch, loss_fn, rounds, device))
        log(f"{variants[-1].label}: peak {variants[-1].peak_bytes / 1e9:.3f} GB, "
            f"{variants[-1].step_s * 1e3:.1f} ms")
    if not autocast:
        ckpt = variants[-2]
        for other, offload in ((ckpt, False), (variants[-1], False), (ckpt, True)):
            # (the last: issue #20 asks for offload mixed with recompute to beat both at checkpoint's peak)
            plan = _plan(graph, other.peak_bytes, offload=offload)
            label = f"memplan at {other.label}'s measured peak{', offload allowed' if offload else ''}"
            if plan is not None:
                variants.append(_measured_alone(planned(label, plan), batch, loss_fn, rounds, device))
            else:
                missing.append(f"{label}: no plan fits {other.peak_bytes} B")
    keep = variants[0]
    keep.predicted_peak_bytes = None
    rows = [_row(v, keep) for v in variants]
    keep_predicted = simulate(graph, None, timeline=False)
    rows[0]["predicted_peak_bytes"], rows[0]["predicted_step_s"] = keep_predicted.peak_bytes, keep_predicted.time_s
    name = "gpt2_bf16" if autocast else "gpt2"
    results.put(name, {"sizes": sizes, "fixed_bytes": fixed, "activation_bytes": act,
                       "untracked_bytes": graph.fixed.other_bytes, "rows": rows, "missing": missing})
    title = "GPT-2 base, bf16 autocast" if autocast else "GPT-2 base, fp32"
    results.md("", f"#### {title} ({', '.join(f'{k}={v}' for k, v in sizes.items())}; each run alone on the "
                   f"device, {rounds} timed steps)", "",
               *_table(rows, keep_predicted.time_s), *([""] + [f"* {m}" for m in missing] if missing else []))


def does_not_fit(results: Results, smoke: bool, limit_s: float) -> None:
    """Step 4: the CLI, as a user runs it, on a batch keep-everything cannot hold."""
    sets = ["--set", "n_layer=2", "--set", "n_embd=64", "--set", "n_head=2", "--set", "seq_len=64",
            "--set", "vocab_size=128", "--set", "batch_size=8"] if smoke else ["--set", "size=base", "--set", "seq_len=1024", "--set",
                                                    "batch_size=48"]
    budget = "50%" if smoke else "60GiB"
    cmd = [sys.executable, "-m", "memplan.api.cli", "run", "gpt2", *sets, "--fake", "--budget", budget,
           "--steps", "3", "--json"]
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit_s)
        report = json.loads(p.stdout) if p.returncode == 0 else {"returncode": p.returncode,
                                                                 "stderr": p.stderr[-3000:]}
    except (subprocess.TimeoutExpired, json.JSONDecodeError) as e:
        report = {"error": str(e)[:2000]}
    results.put("does_not_fit", report)
    if "measured_peak_bytes" in report:
        results.md("", f"`memplan run gpt2 {' '.join(sets)} --fake --budget {budget}`: predicted peak "
                       f"{report['predicted_peak_bytes'] / 1e9:.3f} GB, measured "
                       f"{report['measured_peak_bytes'] / 1e9:.3f} GB, step {report['measured_step_s']:.3f} s "
                       f"(predicted {report['predicted_step_s']:.3f} s); keep-everything would need "
                       f"{report['keep_all_predicted_peak_bytes'] / 1e9:.2f} GB (predicted, never allocated)")
    else:
        results.md("", f"* does-not-fit run failed: `{json.dumps(report)[:400]}`")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("gpu-results"))
    ap.add_argument("--rounds", type=int, default=7, help="timed steps of each variant")
    ap.add_argument("--only", default="", help=f"a comma-separated subset of the steps: {','.join(STEPS)}")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes under the CUDA emulation (a CPU)")
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        # op times taken fresh in this run, not read from a cache filled on a busier machine (a smoke run
        # here read a 512x64 addmm at 64 ms from one, 0.3 ms timed anew): the CLI subprocess's too
        os.environ["MEMPLAN_CACHE_DIR"] = stack.enter_context(tempfile.TemporaryDirectory())
        if args.smoke:
            os.environ["MEMPLAN_EMULATE_CUDA"] = "1"  # the CLI subprocess too
            stack.enter_context(emulate_cuda())
        elif default_device_type() != "cuda":
            sys.exit("benchmarks/gpu.py needs a CUDA GPU (or --smoke for the CPU emulation)")
        device = device_of("cuda")
        results = Results(args.out, device.name())
        results.md(f"### CUDA: {device.name()} (torch {torch.__version__})", "")
        sizes = SMOKE if args.smoke else FULL
        rounds = 2 if args.smoke else args.rounds

        def log(msg: str) -> None:
            print(f"   {msg}", flush=True)

        only = set(args.only.split(",")) if args.only else set(STEPS)
        if unknown := only - set(STEPS):
            sys.exit(f"--only: unknown step(s) {', '.join(sorted(unknown))}; the steps are {', '.join(STEPS)}")
        if not args.smoke and "tests" in only:
            with step(results, "gpu-marked tests", 150):
                gpu_tests(results, 150)
        if "fp32" in only:
            with step(results, "gpt2 fp32", 240):
                gpt2_side_by_side(results, sizes, rounds, autocast=False, log=log)
            _free(device)  # (also after a failed step: the next must find the device empty)
        if "bf16" in only:
            with step(results, "gpt2 bf16", 90):
                gpt2_side_by_side(results, sizes, rounds, autocast=True, log=log)
            _free(device)
        if "does-not-fit" in only:
            with step(results, "a batch that does not fit", 200):
                does_not_fit(results, args.smoke, 200 if not args.smoke else 300)
        spread = {k: v for k, v in results.data["steps"].items() if k.endswith(":seconds")}
        print(json.dumps(spread, indent=1))
        print(f"results in {args.out}/results.json and {args.out}/section.md", flush=True)


if __name__ == "__main__":
    main()
