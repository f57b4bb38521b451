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
   recorded; FSDP2's ``CPUOffloadPolicy`` and DeepSpeed ZeRO-Offload need a GPU (benchmarks/gpu.py's rows).

    python benchmarks/states.py [--quick] [--time-limit 60] [--update-doc]
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import subprocess
import sys
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
            "| device budget | host budget | placement searched | units streamed | units on the host | state moved | "
            "host memory | predicted step | forward + backward | recompute | exposed copies | optimizer | "
            "host steps (compute waited) | solve |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    cases = [(60, "auto")] if quick else [(50, "auto"), (60, "auto"), (70, "auto")]
    cases += [(60, "stream"), (60, "host")]
    for gib, how in cases:
        t0 = time.perf_counter()
        r = solve(g, gib * 2**30, offload=True, states=how, host_budget_bytes=400 * 2**30, time_limit_s=time_limit)
        took = time.perf_counter() - t0
        rep = r.report
        streamed, hosted = r.plan.streamed(), r.plan.hosted()
        moved = sum(g.state_units[u].state_bytes for u in [*streamed, *hosted])
        rows.append(f"| {gib} GiB | 400 GiB | {how} | {len(streamed)} / {len(g.state_units)} | {len(hosted)} | "
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


def emulated_rows(quick: bool) -> list[str]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=2, num_attention_heads=32,
                         num_key_value_heads=4, vocab_size=8000 if quick else 32000, max_position_embeddings=64,
                         use_cache=False)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (1, 64))

    def loss_fn(m, batch):
        return m(input_ids=batch, labels=batch).loss

    rows = []
    with emulate_cuda():
        t0 = time.perf_counter()
        g = profile(copy.deepcopy(model), ids, loss_fn, device="cuda", fake=True, progress=False)
        profile_s = time.perf_counter() - t0
        states = g.fixed.params_bytes + g.fixed.optimizer_state_bytes
        budget = int(states * 0.93)
        r = solve(g, budget, offload=True, time_limit_s=30)

        def train(plan):
            m = copy.deepcopy(model)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=True)
            ex = apply(m, plan, graph=g, optimizer=opt) if plan is not None else None
            times = []
            for i in range(3):
                torch.manual_seed(i)
                t = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                loss_fn(m, ids).backward()
                opt.step()
                times.append(time.perf_counter() - t)
            peak = measure_step(m, ids, loss_fn, opt, steps=1, warmup=0).peak_bytes
            if ex is not None:
                ex.remove()
            return [p.detach() for p in m.parameters()], peak, statistics.median(times[1:])

        plain_p, plain_peak, plain_s = train(None)
        plan_p, plan_peak, plan_s = train(r.plan)
    same = all(torch.equal(a, b) for a, b in zip(plain_p, plan_p, strict=True))
    rows += [f"Llama of the 1.1B's width, 2 layers, vocabulary {config.vocab_size}, sequence 64, batch 1 (fp32, "
             f"AdamW; {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters), under the CUDA emulation: "
             f"fake profile {profile_s:.0f} s; parameters and optimizer state {format_bytes(states)}, budget 93% of "
             f"that, {format_bytes(budget)}.", "",
             "| | peak | predicted peak | step (this CPU) | predicted step | bitwise vs plain |",
             "|---|---|---|---|---|---|",
             f"| plain training (unlimited device) | {format_bytes(plain_peak)} | "
             f"{format_bytes(keep_all_report(g).peak_bytes)} | {plain_s * 1e3:.0f} ms | "
             f"{keep_all_report(g).time_s * 1e3:.0f} ms | - |",
             f"| memplan, {len(r.plan.streamed())} of {len(g.state_units)} units' state streamed | "
             f"{format_bytes(plan_peak)} ({(plan_peak / r.report.peak_bytes - 1) * 100:+.3f}%) | "
             f"{format_bytes(r.report.peak_bytes)} | {plan_s * 1e3:.0f} ms | {r.report.time_s * 1e3:.0f} ms | "
             f"{'yes' if same else 'NO'} |"]
    return rows


def peer_rows() -> list[str]:
    try:
        from torchao.optim import CPUOffloadOptimizer
    except ImportError:
        return ["torchao: not installed here (`pip install torchao`)."]
    m = torch.nn.Linear(64, 64)
    try:
        CPUOffloadOptimizer(m.parameters(), torch.optim.AdamW, fused=True)
        return ["torchao `CPUOffloadOptimizer`: constructs on this CPU (not measured)."]
    except Exception as e:  # noqa: BLE001 - recorded as the peer's answer
        return [f"torchao `CPUOffloadOptimizer` on this CPU: {type(e).__name__}: {e} (its side-by-side rows wait for "
                f"a GPU, as FSDP2's `CPUOffloadPolicy` and DeepSpeed ZeRO-Offload do)."]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--update-doc", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    lines = [f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
             f"{torch.__version__}; `python benchmarks/states.py{' --quick' if args.quick else ''}`.", ""]
    lines += llm_rows(args.time_limit, args.quick) + [""] + emulated_rows(args.quick) + [""] + peer_rows()
    publish("\n".join(lines), args.update_doc, "states", "Model states off the device: optimizer state streamed")


if __name__ == "__main__":
    main()
