"""The GPU acceptance run, in one command: memplan on a CUDA GPU as a user runs it.

    python benchmarks/gpu.py --out gpu-results            # about 6 minutes on one H100
    python benchmarks/gpu.py --only fp32,does-not-fit     # a subset of the steps below
    python benchmarks/gpu.py --smoke --out /tmp/smoke     # tiny sizes under the CUDA emulation (CPU, CI)
    python benchmarks/gpu.py --only peers --out gpu-peers # step 5 alone: about 4 minutes (--peers-limit)

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
4. a batch keep-everything cannot hold: ``memplan run gpt2 --set batch_size=48 --fake --budget 60GiB``;
5. only when ``--only`` names it (``peers``: a session of its own): model states off the device, issue #38's
   side by side. A Llama of TinyLlama's 1.1B shape, then (where ``--peers-limit`` leaves its share) of
   OpenLLaMA's 3B, fp32, AdamW, sequence 1024, batch 1, each run in its own process (a peer that cannot run
   is its one-line error): torchao's ``CPUOffloadOptimizer`` (offload_gradients), FSDP2's
   ``CPUOffloadPolicy`` on one NCCL rank, DeepSpeed ZeRO-Offload (stage 2, ``offload_optimizer`` cpu; where
   ``import deepspeed`` works), then memplan (fake profile on the GPU, ``solve(offload=True)``, ``apply``) at
   75% of the parameters and AdamW state and at the least peak a peer measured; per run the peak
   (``max_memory_allocated`` over 4 steps after a warm-up) and median step, and memplan's predictions.

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
from memplan.planner.core.units import format_bytes  # noqa: E402
from memplan.planner.probe.device import default_device_type, device_of, emulate_cuda  # noqa: E402
from memplan.planner.probe.profiler import profile  # noqa: E402
from memplan.planner.workloads import default_optimizer, load_workload  # noqa: E402
from memplan.solvers import activation_bytes, smallest_known_peak, solve  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FULL = dict(size="base", seq_len=1024, batch_size=8)
STEPS = ("tests", "fp32", "bf16", "does-not-fit")
BY_NAME = ("peers",)  # steps run only when --only names them (their device time is a session of its own)
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


# ---- step 5 (by name only, ``--only peers``): model states off the device, memplan against its peers -----

# transformers' LlamaConfig fields of the shapes the rows train (fp32, AdamW): TinyLlama's 1.1B, OpenLLaMA's 3B
PEER_SHAPES: dict[str, dict[str, int]] = {
    "1.1b": dict(hidden_size=2048, num_hidden_layers=22, intermediate_size=5632, num_attention_heads=32,
                 num_key_value_heads=4, vocab_size=32000),
    "3b": dict(hidden_size=3200, num_hidden_layers=26, intermediate_size=8640, num_attention_heads=32,
               num_key_value_heads=32, vocab_size=32000),
    "smoke": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=128),
}
PEERS = ("torchao", "fsdp2", "deepspeed")
PEER_STATES_FRACTION = 0.75  # memplan's first budget: this fraction of parameters + AdamW state
PEER_STEPS = 5  # each run: one warm-up step (it creates the optimizer state), the rest measured and timed
PEER_TIMEOUT_S = {"1.1b": 120.0, "3b": 200.0, "smoke": 120.0}  # one run's subprocess, start-up included
# what a shape's four runs are expected to take on an H100/H200 (a later shape runs only with that much left)
PEER_EXPECTED_S = {"1.1b": 200.0, "3b": 320.0, "smoke": 60.0}
PEER_MARK = "PEER-RESULT "  # the worker's last stdout line: this, then its JSON


def llama_param_count(shape: dict[str, int]) -> int:
    """Parameters of transformers' ``LlamaForCausalLM`` of ``shape`` (untied embeddings, no biases): what
    the budget below the model states is computed from before any model is built."""
    h, f, layers, vocab = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"], shape["vocab_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h  # q, o; k, v; gate, up, down; two RMSNorms
    return layers * per_layer + 2 * vocab * h + h  # embedding, lm_head, final norm


def model_states_bytes(shape: dict[str, int]) -> int:
    """fp32 parameters and AdamW's two moments: 12 bytes a parameter (gradients are not model state here)."""
    return 12 * llama_param_count(shape)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def parse_worker(stdout: str, stderr: str, returncode: int) -> dict[str, Any]:
    """A worker's result: the JSON after its last :data:`PEER_MARK` line, else one line saying why there is
    none (the exit status and the last line of its stderr: a CUDA OOM, a kill at the time limit)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(PEER_MARK):
            return json.loads(line[len(PEER_MARK):])
    last = next((ln.strip() for ln in reversed(stderr.splitlines()) if ln.strip()), "")
    return {"error": f"exit {returncode}: {last[:300]}" if last else f"exit {returncode}, no output"}


def peer_table(rows: list[dict[str, Any]]) -> list[str]:
    """The markdown of one shape's runs: each measured peak and median step beside memplan's predictions
    (a peer predicts nothing: '-'), or the run's one-line error."""
    out = ["| run | budget | measured peak | predicted peak | measured / predicted | step (median) | "
           "predicted step | measured / predicted |", "|---|---|---|---|---|---|---|---|"]

    def gb(b: float | None) -> str:
        return "-" if b is None else format_bytes(int(b))

    def ratio(m: float | None, p: float | None) -> str:
        return f"{m / p - 1:+.1%}" if m and p else "-"

    for r in rows:
        if "error" in r:
            out.append(f"| {r['label']} | {gb(r.get('budget_bytes'))} | `{r['error'][:200]}` | | | | | |")
            continue
        step_s, pred_s = r.get("step_s"), r.get("predicted_step_s")
        out.append(f"| {r['label']} | {gb(r.get('budget_bytes'))} | {gb(r['measured_peak_bytes'])} | "
                   f"{gb(r.get('predicted_peak_bytes'))} | "
                   f"{ratio(r['measured_peak_bytes'], r.get('predicted_peak_bytes'))} | "
                   f"{step_s:.2f} s | {'-' if pred_s is None else f'{pred_s:.2f} s'} | {ratio(step_s, pred_s)} |")
    return out


def peer_budgets(shape: dict[str, int], peer_rows: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """memplan's budgets, each with what it is: :data:`PEER_STATES_FRACTION` of the model states, and the
    least peak a peer measured (at it memplan should be faster than each peer: issue #38's "at equal
    measured peak")."""
    budgets = [(int(PEER_STATES_FRACTION * model_states_bytes(shape)), f"{PEER_STATES_FRACTION:.0%} of the model states")]
    measured = [r for r in peer_rows if r.get("measured_peak_bytes")]
    if measured:
        least = min(measured, key=lambda r: r["measured_peak_bytes"])
        budgets.append((least["measured_peak_bytes"], f"{least['peer']}'s measured peak"))
    return budgets


def _peer_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One run, in its own process (a peer's process group, CUDA context and allocator die with it): build
    the Llama of ``spec['shape']`` on the device, train ``spec['steps']`` steps under ``spec['peer']``
    (``memplan``: once for each of ``spec['budgets']``), and return what it measured. On a CPU (``smoke``)
    under the CUDA emulation with gloo; the peak is memplan's reading (:func:`peak_window`): on a GPU
    ``max_memory_allocated`` over the measured steps."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from memplan.planner.probe.measure import peak_window

    smoke, peer = spec["smoke"], spec["peer"]
    dev = torch.device("cpu" if smoke else "cuda")
    config = LlamaConfig(**PEER_SHAPES[spec["shape"]], max_position_embeddings=spec["seq_len"], use_cache=False)
    ids = torch.randint(0, config.vocab_size, (1, spec["seq_len"]), device=dev)

    def loss_fn(model: Any, batch: Any) -> torch.Tensor:
        return model(input_ids=batch, labels=batch).loss

    def build() -> nn.Module:
        torch.manual_seed(0)
        with dev:
            return LlamaForCausalLM(config)

    def measured(model: nn.Module, opt: Any, step_fn: Callable[[], None]) -> dict[str, Any]:
        step_fn()  # the warm-up: the optimizer's state is created
        # the warm-up's gradients freed before the window opens: on a CPU a free of a block from before the
        # window is not reported, and the next step's gradients would be counted twice
        model.zero_grad(set_to_none=True)
        times = []
        with peak_window(model, ids, opt) as reading:
            for _ in range(spec["steps"] - 1):
                t = time.perf_counter()
                step_fn()
                if not smoke:
                    torch.cuda.synchronize()  # the step's kernels and copies are done before the clock stops
                times.append(time.perf_counter() - t)
        return {"measured_peak_bytes": reading.peak_bytes, "step_s": float(sorted(times)[len(times) // 2]),
                "step_times_s": times}

    def plain_step(model: nn.Module, opt: Any) -> Callable[[], None]:
        def step_fn() -> None:
            opt.zero_grad(set_to_none=True)
            loss_fn(model, ids).backward()
            opt.step()
        return step_fn

    def process_group(backend: str) -> contextlib.AbstractContextManager:
        import torch.distributed as dist

        @contextlib.contextmanager
        def group() -> Iterator[None]:
            with tempfile.TemporaryDirectory() as d:
                dist.init_process_group(backend, rank=0, world_size=1, init_method=f"file://{d}/store")
                try:
                    yield
                finally:
                    dist.destroy_process_group()
        return group()

    if peer == "torchao":
        from torchao.optim import CPUOffloadOptimizer

        model = build()
        # its lowest-memory form: device gradients freed once copied to the host
        opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_gradients=True, fused=True,
                                  lr=1e-4)
        return {"label": "torchao CPUOffloadOptimizer (offload_gradients, fused AdamW)",
                **measured(model, opt, plain_step(model, opt))}
    if peer == "fsdp2":
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        with process_group("gloo" if smoke else "nccl"):
            model = build()
            policy = CPUOffloadPolicy(pin_memory=not smoke)  # pinned needs an accelerator
            for layer in model.model.layers:
                fully_shard(layer, offload_policy=policy)
            fully_shard(model, offload_policy=policy)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
            return {"label": "FSDP2 CPUOffloadPolicy, one rank (AdamW foreach on the host)",
                    **measured(model, opt, plain_step(model, opt))}
    if peer == "deepspeed":
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo" if smoke else "nccl")
        model = build()
        # torch's AdamW on the host (as memplan's and FSDP2's): DeepSpeedCPUAdam is a C++ build at first use
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        config = {"train_micro_batch_size_per_gpu": 1, "zero_force_ds_cpu_optimizer": False,
                  "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": not smoke}}}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)

        def ds_step() -> None:
            engine.backward(loss_fn(engine, ids))
            engine.step()
        return {"label": "DeepSpeed ZeRO-Offload (stage 2, offload_optimizer cpu, torch AdamW)",
                **measured(engine.module, opt, ds_step)}
    if peer != "memplan":
        raise ValueError(f"unknown peer {peer!r}; the peers are {', '.join(PEERS)} and memplan")
    t0 = time.perf_counter()
    with torch.device("meta"):
        meta = LlamaForCausalLM(config)
    graph = profile(meta, ids.cpu() if smoke else ids, loss_fn, device="cuda", fake=True, progress=False)
    runs = []
    for budget, why in spec["budgets"]:
        try:
            r = solve(graph, budget, offload=True, states="auto", time_limit_s=spec["solve_s"])
        except Infeasible as e:
            runs.append({"label": f"memplan at {why}", "budget_bytes": budget, "error": f"Infeasible: {str(e)[:200]}"})
            continue
        _free(device_of("cuda"))
        model = build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        ex = apply(model, r.plan, graph=graph, optimizer=opt)
        run = measured(model, opt, plain_step(model, opt))
        ex.remove()
        del model, opt, ex
        runs.append({"label": f"memplan at {why} ({len(r.plan.hosted())} units stepped on the host, "
                              f"{len(r.plan.streamed())} streamed, {r.plan.count(Action.RECOMPUTE)} recomputed)",
                     "budget_bytes": budget, "predicted_peak_bytes": r.report.peak_bytes,
                     "predicted_step_s": r.report.time_s, "host_peak_bytes": r.report.host_peak_bytes, **run})
    keep = simulate(graph, None, timeline=False)
    return {"runs": runs, "seconds": time.perf_counter() - t0, "keep_all_predicted_peak_bytes": keep.peak_bytes,
            "keep_all_predicted_step_s": keep.time_s}


def _run_worker(spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--peer-worker", json.dumps(spec)]
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    return parse_worker(p.stdout, p.stderr, p.returncode)


def peers_side_by_side(results: Results, smoke: bool, limit_s: float, log: Callable[[str], None]) -> None:
    """Step 5: per shape (the 1.1B, then the 3B where the time left allows it), each peer trained alone in
    its own process, then memplan at :func:`peer_budgets`; a peer that cannot run is its one-line error."""
    deadline = time.perf_counter() + limit_s
    seq_len = 32 if smoke else 1024
    out: dict[str, Any] = {}
    for i, name in enumerate(("smoke",) if smoke else ("1.1b", "3b")):
        shape = PEER_SHAPES[name]
        left = deadline - time.perf_counter()
        if i and left < PEER_EXPECTED_S[name]:  # the first shape always runs: it is the most valuable
            out[name] = {"skipped": f"{left:.0f} s left"}
            results.md("", f"* Llama {name}: skipped, {left:.0f} s left of the step's {limit_s:.0f} s")
            continue
        spec = {"shape": name, "seq_len": seq_len, "steps": PEER_STEPS, "smoke": smoke}
        rows = []
        for peer in PEERS:
            timeout = min(PEER_TIMEOUT_S[name], max(1.0, deadline - time.perf_counter()))
            row = {"label": peer, "peer": peer, **_run_worker({**spec, "peer": peer}, timeout)}
            rows.append(row)
            peak = row.get("measured_peak_bytes")
            log(f"{name} {peer}: " + (row["error"] if "error" in row else f"peak {format_bytes(peak)}, {row['step_s']:.2f} s"))
        budgets = peer_budgets(shape, rows)
        timeout = max(1.0, deadline - time.perf_counter())
        mp = _run_worker({**spec, "peer": "memplan", "budgets": budgets, "solve_s": 5 if smoke else 20}, timeout)
        rows += mp.get("runs") or [{"label": "memplan", "error": mp.get("error", "no runs")}]
        log(f"{name} memplan: {[r.get('error') or r['measured_peak_bytes'] for r in rows[len(PEERS):]]}")
        out[name] = {"shape": shape, "seq_len": seq_len, "params": llama_param_count(shape),
                     "model_states_bytes": model_states_bytes(shape), "rows": rows,
                     **{k: v for k, v in mp.items() if k != "runs"}}
        results.put("peers", out)
        results.md("", f"#### Model states off the device: Llama {name} (width {shape['hidden_size']}, "
                       f"{shape['num_hidden_layers']} layers; {_count(llama_param_count(shape))} parameters, "
                       f"fp32 parameters + AdamW state {format_bytes(model_states_bytes(shape))}), sequence "
                       f"{seq_len}, batch 1; each run alone in its own process, {PEER_STEPS - 1} measured steps "
                       f"after a warm-up", "", *peer_table(rows))
    results.put("peers", out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("gpu-results"))
    ap.add_argument("--rounds", type=int, default=7, help="timed steps of each variant")
    ap.add_argument("--only", default="", help=f"a comma-separated subset of the steps: {','.join(STEPS)}")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes under the CUDA emulation (a CPU)")
    ap.add_argument("--peers-limit", type=float, default=240.0,
                    help="seconds for the peers step (the 3B Llama runs only where its share is left)")
    ap.add_argument("--peer-worker", default=None, help=argparse.SUPPRESS)  # one peers run, in a subprocess
    args = ap.parse_args()
    if args.peer_worker is not None:
        spec = json.loads(args.peer_worker)
        with emulate_cuda() if spec["smoke"] else contextlib.nullcontext():
            try:
                result = _peer_worker(spec)
            except Exception as e:  # noqa: BLE001 - a peer that cannot run here is its one line
                result = {"error": f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"}
        print(PEER_MARK + json.dumps(result, default=str), flush=True)
        return
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
        if unknown := only - set(STEPS) - set(BY_NAME):
            sys.exit(f"--only: unknown step(s) {', '.join(sorted(unknown))}; the steps are "
                     f"{', '.join(STEPS + BY_NAME)}")
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
        if "peers" in only:
            with step(results, "model states: memplan and its peers", args.peers_limit):
                peers_side_by_side(results, args.smoke, args.peers_limit, log)
        spread = {k: v for k, v in results.data["steps"].items() if k.endswith(":seconds")}
        print(json.dumps(spread, indent=1))
        print(f"results in {args.out}/results.json and {args.out}/section.md", flush=True)


if __name__ == "__main__":
    main()
