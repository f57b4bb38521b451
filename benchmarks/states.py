"""Model states off the device: optimizer state streamed through the host, planned with the activations.

1. **At LLM size, planned and predicted**: the 7B Llama shape (benchmarks/llama7b.py, fp32, AdamW) fake-profiled
   for ``h100-80gb`` (analytic times), solved with ``offload=True`` at device budgets below its fixed memory
   with a host budget; per budget the units streamed, the host bytes, the predicted step in parts and the
   solve time (keeping everything: the step no 80 GB GPU holds).
2. **Trained on a CPU, under the CUDA emulation**: a Llama of the 1.1B's width (2048, MLP 5632) cut to two
   layers and a short sequence, fake-profiled (nothing of the step allocated), planned at a budget below its
   parameters and optimizer state alone, trained: measured peak (the allocator's count, rounded as CUDA
   rounds it) against the prediction, training bitwise against plain training on an unlimited device, and
   step times (on a CPU the copies are synchronous; the time figures are this machine's, not a GPU's).
3. **The peers, where they run**: torchao's ``CPUOffloadOptimizer`` is tried on this machine and its answer
   recorded; FSDP2's ``CPUOffloadPolicy`` on one gloo rank (``pin_memory=False``) trains the same Llama beside
   memplan's host-stepped and streamed plans: peak, step time, bitwise equality with plain training. On a CPU
   FSDP2's host is its device; what it keeps off a GPU, torchao's and DeepSpeed ZeRO-Offload's rows are
   benchmarks/gpu.py's (``--only peers``).

    python benchmarks/states.py [--quick] [--time-limit 60] [--update-doc]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _doc import publish  # benchmarks/_doc.py (the scripts run from this folder)

from memplan.executor import apply
from memplan.planner.core.graph import Graph
from memplan.planner.core.units import format_bytes
from memplan.planner.probe.device import emulate_cuda
from memplan.planner.probe.measure import measure_step
from memplan.planner.probe.profiler import profile
from memplan.solvers import keep_all_report, solve

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("MEMPLAN_BENCH_CACHE", HERE / ".cache"))


def llm_rows(time_limit: float, quick: bool) -> list[str]:
    path = CACHE / "states_llama7b_h100.json"
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "memplan.api.cli", "profile", str(HERE / "llama7b.py") + ":build",
                        "--device-spec", "h100-80gb", "-o", str(path)], check=True, capture_output=True)
    g = Graph.from_json(path.read_text())
    keep = keep_all_report(g)
    rows = [f"Llama 7B shape (width 4096, 32 layers, MLP 11008, sequence 1024, batch 1, fp32, AdamW), "
            f"`h100-80gb`: keeping everything {format_bytes(keep.peak_bytes)} (fixed "
            f"{format_bytes(g.fixed.resident_bytes)}, of it optimizer state {format_bytes(g.fixed.optimizer_state_bytes)}), "
            f"{keep.time_s * 1e3:.0f} ms predicted; {len(g.state_units)} state units.", "",
            "| device budget | host budget | placement searched | fusion | units streamed | units on the host | state moved | "
            "host memory | predicted step | forward + backward | recompute | exposed copies | optimizer | "
            "host steps (compute waited) | solve |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    cases = [(60, "auto", None)] if quick else [(50, "auto", None), (60, "auto", None), (70, "auto", None)]
    cases += [(60, "stream", None), (60, "host", None), (60, "auto", "backward")]
    if not quick:
        cases += [(50, "auto", "backward")]
    for gib, how, fuse in cases:
        t0 = time.perf_counter()
        r = solve(g, gib * 2**30, offload=True, states=how, fuse=fuse, host_budget_bytes=400 * 2**30,
                  time_limit_s=time_limit)
        took = time.perf_counter() - t0
        rep = r.report
        streamed, hosted = r.plan.streamed(), r.plan.hosted()
        moved = sum(g.state_units[u].state_bytes for u in [*streamed, *hosted])
        rows.append(f"| {gib} GiB | 400 GiB | {how} | {fuse or 'none'} | {len(streamed)} / {len(g.state_units)} | {len(hosted)} | "
                    f"{format_bytes(moved)} | {format_bytes(rep.host_peak_bytes)} | {rep.time_s * 1e3:.0f} ms | "
                    f"{(rep.forward_time_s + rep.backward_time_s) * 1e3:.0f} ms | {rep.recompute_time_s * 1e3:.0f} ms | "
                    f"{rep.exposed_transfer_s * 1e3:.0f} ms | {rep.optimizer_time_s * 1e3:.0f} ms | "
                    f"{rep.host_optimizer_time_s * 1e3:.0f} ms ({rep.host_wait_s * 1e3:.0f} ms) | {took:.1f} s |")
    rate = g.host_optimizer_bytes_per_s
    rows += ["", f"The host's optimizer rate is this machine's ({g.meta.get('host_optimizer_source', 'measured')}: "
                 f"{rate / 1e9:.2f} GB/s of parameters{', ' + platform.processor() if platform.processor() else ''}, "
                 f"{os.cpu_count()} cores): a GPU server's host steps several times faster."
             if rate else "The graph records no host optimizer rate."]
    return rows


def small_llama(quick: bool):
    """The Llama of the 1.1B's width (2048, MLP 5632, 32 heads, 4 kv heads) cut to two layers and sequence 64,
    random init (seed 0): ``(model, token batch, loss_fn)``; vocabulary 8000 with ``quick``, else 32000."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=2, num_attention_heads=32,
                         num_key_value_heads=4, vocab_size=8000 if quick else 32000, max_position_embeddings=64,
                         use_cache=False)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (1, 64))

    def loss_fn(m, batch):
        return m(input_ids=batch, labels=batch).loss

    return model, ids, loss_fn


def train(model, ids, loss_fn, wrap=None, steps: int = 3, shard=None):
    """``steps`` AdamW steps of a copy of ``model`` (``shard(model)`` before the optimizer is made, where
    given: FSDP2's sharding swaps the parameters; ``wrap(model, optimizer)`` after it: a plan applied; it
    returns a cleanup or None), then one step whose peak is read
    (:func:`measure_step`'s reading; it also times one more step). Returns the parameters (DTensors as
    their full tensors), the :class:`StepMeasurement` and the median of the timed steps but the first."""
    m = copy.deepcopy(model)
    if shard is not None:
        shard(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=True)
    cleanup = wrap(m, opt) if wrap is not None else None
    times = []
    for i in range(steps):
        torch.manual_seed(i)
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(m, ids).backward()
        opt.step()
        times.append(time.perf_counter() - t)
    reading = measure_step(m, ids, loss_fn, opt, steps=1, warmup=0)
    if cleanup is not None:
        cleanup()
    params = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for p in m.parameters()]
    return params, reading, statistics.median(times[1:] or times)


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def emulated_rows(quick: bool) -> list[str]:
    model, ids, loss_fn = small_llama(quick)
    rows = []
    with emulate_cuda():
        t0 = time.perf_counter()
        g = profile(copy.deepcopy(model), ids, loss_fn, device="cuda", fake=True, progress=False)
        profile_s = time.perf_counter() - t0
        states = g.fixed.params_bytes + g.fixed.optimizer_state_bytes
        budget = int(states * 0.93)
        r = solve(g, budget, offload=True, time_limit_s=30)

        def planned(m, opt):
            return apply(m, r.plan, graph=g, optimizer=opt).remove

        plain_p, plain, plain_s = train(model, ids, loss_fn)
        plan_p, planned_m, plan_s = train(model, ids, loss_fn, planned)
    plain_peak, plan_peak = plain.peak_bytes, planned_m.peak_bytes
    rows += [f"Llama of the 1.1B's width, 2 layers, vocabulary {model.config.vocab_size}, sequence 64, batch 1 "
             f"(fp32, AdamW; {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters), under the CUDA "
             f"emulation: fake profile {profile_s:.0f} s; parameters and optimizer state {format_bytes(states)}, "
             f"budget 93% of that, {format_bytes(budget)}.", "",
             "| | peak | predicted peak | step (this CPU) | predicted step | bitwise vs plain |",
             "|---|---|---|---|---|---|",
             f"| plain training (unlimited device) | {format_bytes(plain_peak)} | "
             f"{format_bytes(keep_all_report(g).peak_bytes)} | {plain_s * 1e3:.0f} ms | "
             f"{keep_all_report(g).time_s * 1e3:.0f} ms | - |",
             f"| memplan, of {len(g.state_units)} units {len(r.plan.streamed())} streamed, {len(r.plan.hosted())} on "
             f"the host | "
             f"{format_bytes(plan_peak)} ({(plan_peak / r.report.peak_bytes - 1) * 100:+.3f}%) | "
             f"{format_bytes(r.report.peak_bytes)} | {plan_s * 1e3:.0f} ms | {r.report.time_s * 1e3:.0f} ms | "
             f"{'yes' if same(plain_p, plan_p) else 'NO'} |"]
    return rows


def torchao_line() -> str:
    try:
        import torchao
        from torchao.optim import CPUOffloadOptimizer
    except ImportError:
        return "torchao: not installed here (`pip install torchao`); its rows wait for a GPU (benchmarks/gpu.py)."
    m = torch.nn.Linear(64, 64)
    try:
        CPUOffloadOptimizer(m.parameters(), torch.optim.AdamW, fused=True)
        return f"torchao {torchao.__version__} `CPUOffloadOptimizer`: constructs on this CPU (not measured)."
    except Exception as e:  # noqa: BLE001 - recorded as the peer's answer
        return (f"torchao {torchao.__version__} `CPUOffloadOptimizer` on this CPU: `{type(e).__name__}: {e}` "
                f"(0.18.0 is the newest on PyPI as of 2026-11); its rows wait for a GPU (benchmarks/gpu.py, "
                f"`--only peers`).")


@contextlib.contextmanager
def one_gloo_rank():
    """A process group of one rank on this CPU (gloo, a file store), destroyed after the block."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{d}/store")
        try:
            yield
        finally:
            dist.destroy_process_group()


def fsdp2(pin_memory: bool):
    """``shard`` for :func:`train`: FSDP2's ``fully_shard`` on every decoder layer and the root with
    ``CPUOffloadPolicy(pin_memory=...)`` (sharded parameters, gradients and optimizer state on the host; each
    layer's parameters gathered to the device for its forward and backward, the optimizer run on the host)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    def shard(m):
        policy = CPUOffloadPolicy(pin_memory=pin_memory)
        for layer in m.model.layers:
            fully_shard(layer, offload_policy=policy)
        fully_shard(m, offload_policy=policy)

    return shard


def peer_rows(quick: bool) -> list[str]:
    """The peers on the same model and counting (emulated_rows's Llama), where they run on this CPU: torchao's
    answer; FSDP2's ``CPUOffloadPolicy`` on one gloo rank beside memplan's host-stepped and streamed plans at
    one budget, each trained from the same weights: peak as :func:`measure_step` counts it, step time,
    bitwise equality with plain training."""
    rows = [torchao_line(), ""]
    model, ids, loss_fn = small_llama(quick)
    plain_p, plain, plain_s = train(model, ids, loss_fn)
    table = ["| | at step start | peak | predicted peak | host memory (predicted) | step (this CPU) | "
             "predicted step | bitwise vs plain |", "|---|---|---|---|---|---|---|---|",
             f"| plain training, CPU counting | {format_bytes(plain.baseline_bytes)} | {format_bytes(plain.peak_bytes)} "
             f"| - | - | {plain_s * 1e3:.0f} ms | - | - |"]
    notes = []
    with one_gloo_rank():
        try:
            train(model, ids, loss_fn, steps=1, shard=fsdp2(pin_memory=True))
        except Exception as e:  # noqa: BLE001 - recorded as the peer's answer
            notes.append(f"FSDP2 `CPUOffloadPolicy()` (pinned host memory, its default) on this CPU: "
                         f"`{type(e).__name__}: {str(e).splitlines()[0]}`; with `pin_memory=False` it runs (its row above).")
        try:
            p, got, s = train(model, ids, loss_fn, shard=fsdp2(pin_memory=False))
            table.append(f"| FSDP2 `CPUOffloadPolicy(pin_memory=False)`, one gloo rank, CPU counting | "
                         f"{format_bytes(got.baseline_bytes)} | {format_bytes(got.peak_bytes)} | - | - | "
                         f"{s * 1e3:.0f} ms | - | {'yes' if same(plain_p, p) else 'NO'} |")
        except Exception as e:  # noqa: BLE001 - recorded as the peer's answer
            notes.append(f"FSDP2 `CPUOffloadPolicy(pin_memory=False)` on one gloo rank: "
                         f"`{type(e).__name__}: {str(e).splitlines()[0]}`.")
    with emulate_cuda():
        g = profile(copy.deepcopy(model), ids, loss_fn, device="cuda", fake=True, progress=False)
        states = g.fixed.params_bytes + g.fixed.optimizer_state_bytes
        budget = int(states * 0.93)
        _, em_plain, _ = train(model, ids, loss_fn, steps=1)
        table.append(f"| plain training, emulated CUDA counting | {format_bytes(em_plain.baseline_bytes)} | "
                     f"{format_bytes(em_plain.peak_bytes)} | {format_bytes(keep_all_report(g).peak_bytes)} | - | "
                     f"- | {keep_all_report(g).time_s * 1e3:.0f} ms | - |")
        for how in ("host", "stream"):
            try:
                r = solve(g, budget, offload=True, states=how, time_limit_s=30)
            except Exception as e:  # noqa: BLE001 - a plan that cannot be made is a row too
                table.append(f"| memplan, `states={how!r}` | `{type(e).__name__}: {str(e)[:200]}` |||||||")
                continue
            moved = r.plan.hosted() if how == "host" else r.plan.streamed()

            def planned(m, opt, plan=r.plan):
                return apply(m, plan, graph=g, optimizer=opt).remove

            p, got, s = train(model, ids, loss_fn, planned)
            verb = "stepped on the host" if how == "host" else "state streamed"
            table.append(f"| memplan, {len(moved)} of {len(g.state_units)} units {verb}, emulated CUDA counting | "
                         f"{format_bytes(got.baseline_bytes)} | {format_bytes(got.peak_bytes)} "
                         f"({(got.peak_bytes / r.report.peak_bytes - 1) * 100:+.3f}%) | "
                         f"{format_bytes(r.report.peak_bytes)} | {format_bytes(r.report.host_peak_bytes)} | "
                         f"{s * 1e3:.0f} ms | {r.report.time_s * 1e3:.0f} ms | {'yes' if same(plain_p, p) else 'NO'} |")
    rows += [f"Side by side on the same Llama (vocabulary {model.config.vocab_size}), each trained 3 steps from "
             f"the same weights, then one step measured (`measure_step`) and one more timed; memplan's plans at "
             f"93% of parameters and optimizer state ({format_bytes(budget)}). *CPU counting*: every storage on "
             f"this CPU, as the allocator reports it: FSDP2's offload target is this same memory, so its sharded "
             f"parameters, gradients and AdamW state are counted (a GPU's reading of what it keeps off the device "
             f"waits for benchmarks/gpu.py). *Emulated CUDA counting*: CUDA's rounding, and memory memplan "
             f"places in its host pools left out, as a GPU's `max_memory_allocated` would leave it out.", "",
             *table, *([""] + notes if notes else []),
             "", "Step times are this 2-core CPU's, shared with other jobs (its copies are synchronous; a plain "
                 "step read 1.2 s alone and 7.7 s under load): the peaks and the bitwise column do not depend on "
                 "load; the step-time comparison waits for a GPU."]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--update-doc", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    lines = [f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
             f"{torch.__version__}; `python benchmarks/states.py{' --quick' if args.quick else ''}`.", ""]
    lines += llm_rows(args.time_limit, args.quick) + [""] + emulated_rows(args.quick) + [""] + peer_rows(args.quick)
    publish("\n".join(lines), args.update_doc, "states", "Model states off the device: optimizer state streamed")


if __name__ == "__main__":
    main()
