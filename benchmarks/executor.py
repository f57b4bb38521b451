"""The executor measured against the simulator, against PyTorch's checkpointing, and with fused steps.

For each model: profile it, solve at 30/50/70% of its activation memory, and train under each plan
(``memplan.executor.apply``), measuring the peak as planner/probe/measure.py does (one step after warm-up,
``executor/session.py:peak_step``) and the step time (median of timed steps). Side by side, on copies of
the same model: keeping everything; ``torch.utils.checkpoint`` (non-reentrant) on every block; PyTorch's
selective activation checkpointing (``create_selective_checkpoint_contexts``, matmuls and convolutions
saved, the rest recomputed) on every block; memplan's plan at each of those two methods' measured peak;
and the executor with a keep-everything plan unfused and with backward / forward fused AdamW (foreach).

Every variant of a model is built first (its own copy of the model and optimizer) and then timed
interleaved, one step of each in turn for ``--rounds`` rounds, so that load on a shared machine falls on
all of them alike. Prints markdown; ``--update-doc`` writes it into docs/benchmarks.md between the
``executor:begin`` / ``executor:end`` markers.

    python benchmarks/executor.py [--models mlp,resnet,gpt2,bert] [--rounds 7] [--update-doc]
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _doc import update_section  # benchmarks/_doc.py (the scripts run from this folder)
from fidelity import machine  # noqa: E402  (benchmarks/ is not a package)

from memplan.executor import apply  # noqa: E402
from memplan.executor.session import peak_step  # noqa: E402
from memplan.planner.core.errors import Infeasible  # noqa: E402
from memplan.planner.core.plan import Plan  # noqa: E402
from memplan.planner.core.simulator import simulate  # noqa: E402
from memplan.planner.core.units import format_bytes  # noqa: E402
from memplan.planner.probe.device import device_of  # noqa: E402
from memplan.planner.probe.profiler import profile  # noqa: E402
from memplan.planner.workloads import default_optimizer, load_workload, training_step  # noqa: E402
from memplan.solvers import activation_bytes, smallest_known_peak, solve  # noqa: E402

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
FRACTIONS = (0.3, 0.5, 0.7)
aten = torch.ops.aten
# what selective checkpointing keeps: the expensive ops' outputs; everything else is recomputed
# (attention under each backend SDPA picks: the CPU's, and on CUDA flash, memory-efficient and cuDNN; a
# backend left out is recomputed, and selective checkpointing then measures as more than it is)
SAVED_BY_SAC = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
                aten.convolution.default} | {
    getattr(aten, name).default for name in (
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    if hasattr(aten, name)}


class _Pair(nn.Sequential):
    """Linear + ReLU of the mlp workload as one block."""


def blocks(name: str, model: nn.Module) -> list[nn.Module]:
    """The repeated blocks each checkpointing baseline wraps (the mlp is regrouped in place into
    Linear+ReLU pairs; same parameters, so the same step)."""
    if name == "mlp":
        layers = list(model)
        model._modules.clear()
        pairs = []
        for i in range(0, len(layers), 2):
            pairs.append(_Pair(layers[i], layers[i + 1]))
            model.add_module(str(i // 2), pairs[-1])
        return pairs
    if name == "resnet":
        return [layer for stage in model.resnet.encoder.stages for layer in stage.layers]
    if name == "gpt2":
        return list(model.transformer.h)
    if name == "bert":
        return list(model.bert.encoder.layer)
    if name == "unet":
        return [*model.down, model.bottom, *model.merge]
    raise ValueError(f"no block list for {name}")


def _sac_policy(_ctx: Any, op: Any, *_args: Any, **_kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_BY_SAC else CheckpointPolicy.PREFER_RECOMPUTE


def wrap_blocks(mods: list[nn.Module], *, selective: bool) -> None:
    """Run each block's forward under non-reentrant ``torch.utils.checkpoint`` (with a selective policy)."""
    for m in mods:
        fwd = m.forward
        kw: dict[str, Any] = {"use_reentrant": False}
        if selective:
            kw["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _sac_policy)

        def wrapped(*args: Any, _fwd: Callable[..., Any] = fwd, _kw: dict[str, Any] = kw, **kwargs: Any) -> Any:
            return checkpoint(_fwd, *args, **_kw, **kwargs)

        m.forward = wrapped  # type: ignore[method-assign]


@dataclass
class Variant:
    label: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    executor: Any = None
    plan: Plan | None = None
    predicted_peak_bytes: int | None = None
    predicted_step_s: float | None = None
    budget_bytes: int | None = None
    peak_bytes: int = 0
    times_s: list[float] = field(default_factory=list)
    cpu_times_s: list[float] = field(default_factory=list)

    @property
    def step_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def cpu_step_s(self) -> float:
        return statistics.median(self.cpu_times_s)


def make(label: str, base: nn.Module, **kw: Any) -> Variant:
    model = copy.deepcopy(base)
    return Variant(label, model, default_optimizer(model), **kw)


def with_plan(label: str, base: nn.Module, graph: Any, plan: Plan, fuse: str | None = None) -> Variant:
    v = make(label, base, plan=plan, budget_bytes=plan.budget_bytes)
    v.executor = apply(v.model, plan, graph=graph, optimizer=v.optimizer, fuse=fuse)
    r = simulate(graph, plan, timeline=False)
    v.predicted_peak_bytes, v.predicted_step_s = r.peak_bytes, r.time_s
    return v


def settle(v: Variant, batch: Any, loss_fn: Any, warmup: int) -> None:
    for _ in range(warmup):
        training_step(v.model, batch, loss_fn, v.optimizer)
    v.peak_bytes = peak_step(v.model, batch, loss_fn, v.optimizer, v.executor)[0]


def timed_rounds(variants: list[Variant], batch: Any, loss_fn: Any, rounds: int) -> None:
    for _ in range(rounds):
        for v in variants:  # one step of each in turn: load on the machine falls on all alike
            layer = device_of(v.model)  # a GPU's kernels are asynchronous: each step timed from an idle
            layer.synchronize()         # device to the end of its own kernels, not its launches
            c0, t0 = time.process_time(), time.perf_counter()
            training_step(v.model, batch, loss_fn, v.optimizer)
            layer.synchronize()
            v.times_s.append(time.perf_counter() - t0)
            v.cpu_times_s.append(time.process_time() - c0)  # the process's CPU time: others' time slices excluded


def solve_at(graph: Any, budget_bytes: int, time_limit_s: float) -> Plan | None:
    try:
        return solve(graph, budget_bytes, "auto", time_limit_s=time_limit_s).plan
    except Infeasible:
        return None


def bench(name: str, rounds: int, warmup: int, time_limit_s: float, log: Callable[[str], None]) -> dict:
    w = load_workload(name)
    t0 = time.perf_counter()
    graph = profile(w.model, w.batch, w.loss_fn, name=name, progress=False, measure=False)
    log(f"{name}: profiled in {time.perf_counter() - t0:.1f} s")
    base = w.model
    fixed, act = graph.fixed.resident_bytes, activation_bytes(graph)
    keep_all = make("keep everything", base)
    ckpt = make("checkpoint every block", base)
    wrap_blocks(blocks(name, ckpt.model), selective=False)
    sac = make("selective checkpoint (matmuls saved)", base)
    wrap_blocks(blocks(name, sac.model), selective=True)
    # the baselines' measured peaks give memplan's budgets for the side-by-side
    for v in (keep_all, ckpt, sac):
        settle(v, w.batch, w.loss_fn, warmup)
    variants = [keep_all, ckpt, sac]
    plans: list[Variant] = []
    infeasible: list[tuple[str, int]] = []
    for frac in FRACTIONS:
        plan = solve_at(graph, fixed + int(act * frac), time_limit_s)
        if plan is None:
            log(f"{name}: {frac:.0%} infeasible")
            infeasible.append((f"{frac:.0%}", fixed + int(act * frac)))
            continue
        plans.append(with_plan(f"{frac:.0%}", base, graph, plan))
    matched: dict[str, Variant | None] = {}
    for other in (ckpt, sac):
        plan = solve_at(graph, other.peak_bytes, time_limit_s)
        matched[other.label] = with_plan(f"memplan at {other.label}'s peak", base, graph, plan) if plan else None
    empty = Plan(graph_fingerprint=graph.fingerprint, model_fingerprint=graph.model_fingerprint)
    fused = [with_plan(f"executor, keep everything{', fused ' + f if f else ', unfused'}", base, graph, empty, f)
             for f in (None, "backward", "forward")]
    extra = plans + [v for v in matched.values() if v] + fused
    for v in extra:
        settle(v, w.batch, w.loss_fn, warmup)
    variants += extra
    log(f"{name}: {len(variants)} variants built; timing {rounds} interleaved rounds")
    timed_rounds(variants, w.batch, w.loss_fn, rounds)
    for v in variants:
        if v.executor is not None:
            v.executor.remove()
    return {"name": name, "graph": graph, "keep_all": keep_all, "ckpt": ckpt, "sac": sac, "plans": plans,
            "matched": matched, "fused": fused, "fixed": fixed, "activation": act, "infeasible": infeasible,
            "min_bytes": smallest_known_peak(graph)}


def ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.0f} ms"


def spread(v: Variant) -> str:
    """Median step and the range of the timed steps."""
    return f"{ms(v.step_s)} ({min(v.times_s) * 1e3:.0f}–{max(v.times_s) * 1e3:.0f})"


def cpu_spread(v: Variant) -> str:
    """Median CPU time of a step and its range."""
    return f"{ms(v.cpu_step_s)} ({min(v.cpu_times_s) * 1e3:.0f}–{max(v.cpu_times_s) * 1e3:.0f})"


def tables(results: list[dict], rounds: int) -> str:
    out = ["#### Predicted against measured, under plans at 30/50/70% of activation memory and at the "
           "baselines' peaks", "",
           "Overheads are against keeping everything: predicted = the simulator's step under the plan over its "
           "keep-everything step; measured = the plan's median step over plain training's (interleaved), in "
           "wall time and in the process's CPU time. *measured / predicted* compares the two steps with "
           "plain training as the unit, (1 + measured overhead) / (1 + predicted overhead) - 1 on CPU time: "
           "the graph's absolute times carry the load the machine had while it was profiled, a ratio does not. "
           "*executor charged*: the part of the prediction that is the executor's own dispatch (watched forward "
           "ops x watch_op_dispatch_s + replayed ops x replay_op_dispatch_s).", "",
           "| model | budget | solver | predicted peak | measured peak | error | measured ≤ budget + 5% "
           "| predicted step | measured step, wall (range) | CPU (range) | predicted overhead "
           "| measured overhead, wall | CPU | measured / predicted | watched / replayed ops | executor charged |",
           "|---|--:|---|--:|--:|--:|:-:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in results:
        keep_pred = simulate(r["graph"], None, timeline=False).time_s
        k = r["keep_all"]
        for v in r["plans"] + [v for v in r["matched"].values() if v]:
            rep = simulate(r["graph"], v.plan, timeline=False)
            err = v.predicted_peak_bytes / v.peak_bytes - 1
            ok = "yes" if v.peak_bytes <= v.budget_bytes * 1.05 else "**no**"
            label = v.label.removeprefix("memplan at ")
            pred_ovh = v.predicted_step_s / keep_pred - 1
            cpu_ovh = v.cpu_step_s / k.cpu_step_s - 1
            charged = rep.watch_time_s + rep.recomputed_ops * r["graph"].replay_op_dispatch_s
            out.append(f"| {r['name']} | {label} ({format_bytes(v.budget_bytes)}) | {v.plan.solver.name} "
                       f"| {format_bytes(v.predicted_peak_bytes)} | {format_bytes(v.peak_bytes)} | {err:+.2%} | {ok} "
                       f"| {ms(v.predicted_step_s)} | {spread(v)} | {cpu_spread(v)} | {pred_ovh:+.0%} "
                       f"| {v.step_s / k.step_s - 1:+.0%} | {cpu_ovh:+.0%} | {(1 + cpu_ovh) / (1 + pred_ovh) - 1:+.1%} "
                       f"| {rep.watched_ops} / {rep.recomputed_ops} | {charged / keep_pred:.1%} of the step |")
        for label, b in r["infeasible"]:
            out.append(f"| {r['name']} | {label} ({format_bytes(b)}) | infeasible: the smallest peak memplan "
                       f"reaches is {format_bytes(r['min_bytes'])} | | | | | | | | | | | | | |")
    out += ["", "#### Side by side at about the same measured memory", "",
            "Each PyTorch checkpointing baseline wraps every block (mlp: Linear+ReLU pairs; resnet: residual "
            "layers; gpt2, bert: transformer layers); memplan's plan is solved with that baseline's *measured* "
            "peak as its budget.", "",
            "| model | method | measured peak | step time, wall (range) | CPU (range) | vs keep everything (CPU) |",
            "|---|---|--:|--:|--:|--:|"]
    for r in results:
        k = r["keep_all"]
        rows = [k, r["ckpt"], r["matched"][r["ckpt"].label], r["sac"], r["matched"][r["sac"].label]]
        labels = [k.label, r["ckpt"].label, f"memplan at {format_bytes(r['ckpt'].peak_bytes)}", r["sac"].label,
                  f"memplan at {format_bytes(r['sac'].peak_bytes)}"]
        for label, v in zip(labels, rows, strict=True):
            if v is None:
                out.append(f"| {r['name']} | {label} | infeasible | - | - | - |")
                continue
            out.append(f"| {r['name']} | {label} | {format_bytes(v.peak_bytes)} | {spread(v)} | {cpu_spread(v)} "
                       f"| {v.peak_bytes / k.peak_bytes - 1:+.0%} memory, {v.cpu_step_s / k.cpu_step_s - 1:+.0%} "
                       f"time |")
    out += ["", "#### Fused optimizer steps (AdamW, foreach), keep-everything plan", "",
            "| model | variant | measured peak | step time, wall (range) | CPU (range) | vs plain training (CPU) |",
            "|---|---|--:|--:|--:|--:|"]
    for r in results:
        k = r["keep_all"]
        out.append(f"| {r['name']} | plain training (no executor) | {format_bytes(k.peak_bytes)} | {spread(k)} "
                   f"| {cpu_spread(k)} | - |")
        for v in r["fused"]:
            rel = (f"{v.peak_bytes / k.peak_bytes - 1:+.1%} memory, {v.cpu_step_s / k.cpu_step_s - 1:+.1%} time")
            out.append(f"| {r['name']} | {v.label.removeprefix('executor, keep everything, ')} under the executor "
                       f"| {format_bytes(v.peak_bytes)} | {spread(v)} | {cpu_spread(v)} | {rel} |")
    return "\n".join(out)


def update_doc(text: str) -> None:
    update_section("executor", "The executor: measured against predicted", text, DOC)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="mlp,resnet,gpt2,bert", help="comma-separated built-ins")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved timed rounds (median)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--time-limit", type=float, default=10.0, help="solver seconds per plan")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU time is the step's cost)")
    ap.add_argument("--update-doc", action="store_true", help=f"write the tables into {DOC}")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    start = time.perf_counter()
    results = [bench(n.strip(), args.rounds, args.warmup, args.time_limit, log) for n in args.models.split(",")]
    gpu = ("CUDA" if torch.cuda.is_available() else
           "No GPU was available in this session: CPU figures only; the CUDA figures (and how much offload "
           "transfer time is hidden) are to be added when one is lent.")
    text = (f"Machine: {machine()}. {gpu} Each model's variants were timed interleaved (one step of each in turn, "
            f"{args.rounds} rounds, median), so their ratios are comparable. Peaks are from the allocator and "
            f"do not depend on load. Models: the built-ins at their default size. "
            f"Run time {time.perf_counter() - start:.0f} s.\n\n{tables(results, args.rounds)}")
    print(text)
    if args.update_doc:
        update_doc(text)


if __name__ == "__main__":
    main()
