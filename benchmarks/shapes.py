"""Dynamic padding under one plan: GPT-2 (small preset, eager attention) profiled as a shape family over
the sequence length (128, 96, 64), planned at 50% of its activation memory for length 128, then trained
on batches padded to their longest sequence (random lengths) under that plan. For each step: the length,
the simulator's peak at that length (the family evaluated there), the measured peak (the CPU allocator,
as memplan measures it) and the plan's peak at 128; and whether the losses equal plain training's.

    .venv/bin/python benchmarks/shapes.py [--steps 8] [--write]   # --write: into docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from memplan.executor import apply
from memplan.executor.session import peak_step
from memplan.planner import simulate
from memplan.planner.core.shapes import at_shape
from memplan.planner.core.units import format_bytes, parse_budget
from memplan.planner.probe.family import profile_family
from memplan.planner.workloads import SIZES, training_step
from memplan.solvers import activation_bytes, keep_all_report, solve


def _model(seq: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    o = SIZES["gpt2"]["small"]
    torch.manual_seed(0)
    config = GPT2Config(n_layer=o["n_layer"], n_embd=o["n_embd"], n_head=o["n_head"], vocab_size=o["vocab_size"],
                        n_positions=seq, use_cache=False, bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "eager"
    return GPT2LMHeadModel(config), o["vocab_size"], o["batch_size"]


def _padded(lengths: list[int], vocab: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(1, vocab, (n,), generator=gen)
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _loss(model, batch):
    return model(**batch).loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    seq = 128
    model, vocab, bs = _model(seq)
    gen = torch.Generator().manual_seed(1)
    t0 = time.perf_counter()
    graph = profile_family(model, [({"seq": n}, _padded([n] + [n // 2] * (bs - 1), vocab, gen))
                                   for n in (seq, 96, 64)], _loss, progress=False)
    profile_s = time.perf_counter() - t0
    budget = parse_budget("50%", activation_bytes=activation_bytes(graph), fixed_bytes=graph.fixed.resident_bytes)
    result = solve(graph, budget)
    plan = result.plan
    largest = result.report.peak_bytes
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, foreach=True)
    rows = []
    bitwise = True
    with apply(model, plan, graph=graph, optimizer=opt) as ex:
        for step in range(args.steps):
            lengths = torch.randint(8, seq + 1, (bs,), generator=gen).tolist()
            batch = _padded(lengths, vocab, gen)
            rng = torch.get_rng_state()
            first = not opt.state
            peak, _, _, loss = peak_step(model, batch, _loss, opt, ex)
            torch.set_rng_state(rng)
            ref_loss = training_step(ref, batch, _loss, ref_opt)
            bitwise &= torch.equal(loss, ref_loss)
            here = simulate(at_shape(graph, {"seq": max(lengths)}), plan, check=False).peak_bytes
            keep = keep_all_report(at_shape(graph, {"seq": max(lengths)})).peak_bytes
            rows.append((step + 1, max(lengths), here, peak, keep, first))
    bitwise &= all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters(), strict=True))
    lines = [
        f"GPT-2 small preset (6 layers, 256 wide, batch {bs}, eager attention), 2-core CPU, torch "
        f"{torch.__version__}; the machine was shared with other jobs "
        f"(peaks are allocator bytes, unaffected). Shape family profiled at seq 128, 96, 64 in {profile_s:.0f} s; "
        f"{plan.solver.name} plan at 50% ({format_bytes(budget)}): {plan.count('recompute')} tensors recomputed, "
        f"predicted peak at seq 128 {format_bytes(largest)}. Training under it on batches padded to their "
        f"longest sequence (random lengths 8..128), bitwise equal to plain training: {bitwise}.",
        "",
        "| step | longest seq | predicted at that seq | measured | plan's peak at 128 | keep-all at that seq |",
        "|---|---|---|---|---|---|",
    ]
    for step, n, here, peak, keep, first in rows:
        note = " (no optimizer state yet)" if first else ""
        lines.append(f"| {step} | {n} | {format_bytes(here)} | {format_bytes(peak)}{note} | {format_bytes(largest)} "
                     f"| {format_bytes(keep)} |")
    text = "\n".join(lines)
    print(text)
    if args.write:
        from _doc import update_section

        update_section("shapes", "Shape families: dynamic padding under one plan", text)


if __name__ == "__main__":
    main()
