"""The fake trace against the real step on the model families transformers ships, beyond the test matrix
(tests/test_fake_families.py, which runs 22 of them in CI): each family built tiny and random on the CPU
(width 32, 2 layers, batch 4, sequence 32; the loss from ``labels=``), profiled real and fake; the two
graphs compared in every field but the times (tests/conftest.py ``assert_same_structure``), then a plan
solved on the fake graph that recomputes something trains one step under the executor, against plain
training: the loss and every gradient bitwise. Written to docs/benchmarks.md with ``--update-doc``.

    python benchmarks/families.py [--only t5,whisper] [--update-doc]      # about 3 minutes on this 2-core machine
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers as T

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from _doc import publish  # noqa: E402  benchmarks/_doc.py (the scripts run from this folder)
from conftest import assert_same_structure  # noqa: E402
from fidelity import machine  # noqa: E402
from test_fake_families import _budget_with_recompute, _loss, _step  # noqa: E402

from memplan.planner.core.simulator import simulate  # noqa: E402
from memplan.planner.probe.optime import OpTimer  # noqa: E402
from memplan.planner.probe.profiler import profile  # noqa: E402

W, L, H, V, S, B = 32, 2, 4, 128, 32, 4  # width, layers, heads, vocabulary, sequence, batch


def ids(lo: int = 0) -> torch.Tensor:
    return torch.randint(lo, V, (B, S))


def lm(cfg: str, cls: str, **kw):
    """A model whose loss is the tokens' own (causal or masked language modelling)."""
    def build():
        x = ids(3)
        return getattr(T, cls)(getattr(T, cfg)(**kw)), {"input_ids": x, "labels": x}
    return build


def s2s(cfg: str, cls: str, **kw):
    """An encoder-decoder: labels half the input's length."""
    def build():
        x = ids(3)
        return getattr(T, cls)(getattr(T, cfg)(**kw)), {"input_ids": x, "attention_mask": torch.ones_like(x),
                                                         "labels": x[:, : S // 2].clone()}
    return build


def img(cfg: str, cls: str, size: int = 32, **kw):
    """An image classifier."""
    def build():
        return getattr(T, cls)(getattr(T, cfg)(**kw)), {"pixel_values": torch.randn(B, 3, size, size),
                                                         "labels": torch.tensor([1, 4, 0, 2])}
    return build


def clip():
    """Two towers, the contrastive loss."""
    tc = T.CLIPTextConfig(hidden_size=W, intermediate_size=2*W, num_hidden_layers=L, num_attention_heads=H, vocab_size=V, max_position_embeddings=S)
    vc = T.CLIPVisionConfig(hidden_size=W, intermediate_size=2*W, num_hidden_layers=L, num_attention_heads=H, image_size=32, patch_size=8)
    m = T.CLIPModel(T.CLIPConfig(text_config=tc.to_dict(), vision_config=vc.to_dict(), projection_dim=16))
    return m, {"input_ids": ids(), "pixel_values": torch.randn(B, 3, 32, 32), "return_loss": True}


def whisper():
    c = T.WhisperConfig(d_model=W, encoder_layers=L, decoder_layers=L, encoder_attention_heads=H, decoder_attention_heads=H, encoder_ffn_dim=2*W, decoder_ffn_dim=2*W, vocab_size=V, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, num_mel_bins=16, max_source_positions=32, max_target_positions=S, use_cache=False)
    x = ids(3)[:, :8]
    return T.WhisperForConditionalGeneration(c), {"input_features": torch.randn(B, 16, 64), "labels": x}


dec = dict(hidden_size=W, intermediate_size=2*W, num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=H//2, vocab_size=V, max_position_embeddings=4*S, use_cache=False)
FAM = {
 "t5": s2s("T5Config", "T5ForConditionalGeneration", d_model=W, d_kv=W//H, d_ff=2*W, num_layers=L, num_heads=H, vocab_size=V, decoder_start_token_id=0, use_cache=False),
 "mbart": s2s("MBartConfig", "MBartForConditionalGeneration", d_model=W, encoder_layers=L, decoder_layers=L, encoder_attention_heads=H, decoder_attention_heads=H, encoder_ffn_dim=2*W, decoder_ffn_dim=2*W, vocab_size=V, max_position_embeddings=4*S, use_cache=False),
 "pegasus": s2s("PegasusConfig", "PegasusForConditionalGeneration", d_model=W, encoder_layers=L, decoder_layers=L, encoder_attention_heads=H, decoder_attention_heads=H, encoder_ffn_dim=2*W, decoder_ffn_dim=2*W, vocab_size=V, max_position_embeddings=4*S, use_cache=False),
 "bloom": lm("BloomConfig", "BloomForCausalLM", hidden_size=W, n_layer=L, n_head=H, vocab_size=V, use_cache=False),
 "gptj": lm("GPTJConfig", "GPTJForCausalLM", n_embd=W, n_layer=L, n_head=H, rotary_dim=4, vocab_size=V, n_positions=4*S, use_cache=False),
 "gpt_bigcode": lm("GPTBigCodeConfig", "GPTBigCodeForCausalLM", n_embd=W, n_layer=L, n_head=H, vocab_size=V, n_positions=4*S, use_cache=False),
 "codegen": lm("CodeGenConfig", "CodeGenForCausalLM", n_embd=W, n_layer=L, n_head=H, rotary_dim=4, vocab_size=V, n_positions=4*S, use_cache=False),
 "starcoder2": lm("Starcoder2Config", "Starcoder2ForCausalLM", **dec),
 "phi": lm("PhiConfig", "PhiForCausalLM", **dec),
 "stablelm": lm("StableLmConfig", "StableLmForCausalLM", **dec),
 "olmo": lm("OlmoConfig", "OlmoForCausalLM", **dec),
 "olmo2": lm("Olmo2Config", "Olmo2ForCausalLM", **dec),
 "cohere": lm("CohereConfig", "CohereForCausalLM", **dec),
 "granite": lm("GraniteConfig", "GraniteForCausalLM", **dec),
 "gemma3": lm("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=W//H, **dec),
 "mamba": lm("MambaConfig", "MambaForCausalLM", hidden_size=W, num_hidden_layers=L, vocab_size=V, state_size=4, use_cache=False),
 "mamba2": lm("Mamba2Config", "Mamba2ForCausalLM", hidden_size=W, num_hidden_layers=L, vocab_size=V, state_size=4, num_heads=4, head_dim=16, n_groups=1, use_cache=False),
 "rwkv": lm("RwkvConfig", "RwkvForCausalLM", hidden_size=W, num_hidden_layers=L, vocab_size=V, attention_hidden_size=W, intermediate_size=2*W, context_length=S, use_cache=False),
 "xlnet": lm("XLNetConfig", "XLNetLMHeadModel", d_model=W, n_layer=L, n_head=H, d_inner=2*W, vocab_size=V, use_mems_train=False),
 "albert": lm("AlbertConfig", "AlbertForMaskedLM", hidden_size=W, embedding_size=16, num_hidden_layers=L, num_attention_heads=H, intermediate_size=2*W, vocab_size=V),
 "distilbert": lm("DistilBertConfig", "DistilBertForMaskedLM", dim=W, n_layers=L, n_heads=H, hidden_dim=2*W, vocab_size=V),
 "electra": lm("ElectraConfig", "ElectraForMaskedLM", hidden_size=W, embedding_size=16, num_hidden_layers=L, num_attention_heads=H, intermediate_size=2*W, vocab_size=V),
 "deberta_v2": lm("DebertaV2Config", "DebertaV2ForMaskedLM", hidden_size=W, num_hidden_layers=L, num_attention_heads=H, intermediate_size=2*W, vocab_size=V, relative_attention=True, pos_att_type=["c2p", "p2c"], max_relative_positions=16),
 "mobilebert": lm("MobileBertConfig", "MobileBertForMaskedLM", hidden_size=W, embedding_size=16, num_hidden_layers=L, num_attention_heads=H, intermediate_size=2*W, intra_bottleneck_size=16, true_hidden_size=16, vocab_size=V),
 "funnel": lm("FunnelConfig", "FunnelForMaskedLM", d_model=W, n_head=H, d_head=8, d_inner=2*W, block_sizes=[1, 1], vocab_size=V),
 "big_bird": lm("BigBirdConfig", "BigBirdForMaskedLM", hidden_size=W, num_hidden_layers=L, num_attention_heads=H, intermediate_size=2*W, vocab_size=V, attention_type="original_full", max_position_embeddings=4*S),
 "convnext": img("ConvNextConfig", "ConvNextForImageClassification", num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=5),
 "convnextv2": img("ConvNextV2Config", "ConvNextV2ForImageClassification", num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=5),
 "segformer": img("SegformerConfig", "SegformerForImageClassification", num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16], num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2], num_labels=5),
 "deit": img("DeiTConfig", "DeiTForImageClassification", hidden_size=W, num_hidden_layers=L, num_attention_heads=H, intermediate_size=2*W, image_size=32, patch_size=8, num_labels=5),
 "beit": img("BeitConfig", "BeitForImageClassification", hidden_size=W, num_hidden_layers=L, num_attention_heads=H, intermediate_size=2*W, image_size=32, patch_size=8, num_labels=5, use_relative_position_bias=True),
 "dinov2": img("Dinov2Config", "Dinov2ForImageClassification", hidden_size=W, num_hidden_layers=L, num_attention_heads=H, image_size=32, patch_size=8, num_labels=5),
 "mobilevit": img("MobileViTConfig", "MobileViTForImageClassification", image_size=32, hidden_sizes=[16, 16, 16], neck_hidden_sizes=[8, 8, 16, 16, 16, 16, 32], num_labels=5),
 "efficientnet": img("EfficientNetConfig", "EfficientNetForImageClassification", image_size=32, width_coefficient=0.25, depth_coefficient=0.2, num_labels=5, hidden_dim=320),
 "regnet": img("RegNetConfig", "RegNetForImageClassification", embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], groups_width=8, num_labels=5),
 "clip": clip, "whisper": whisper,
}


def _same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def check(name: str, timer: OpTimer) -> tuple[str, ...]:
    """(family, ops, structure, replays, bitwise, seconds) for one family; a failure as its one line."""
    start = time.perf_counter()
    try:
        torch.manual_seed(0)
        model, batch = FAM[name]()
        fake = profile(model, batch, _loss, device="cpu", progress=False, fake=True, timer=timer, name=name)
        real = profile(copy.deepcopy(model), batch, _loss, device="cpu", progress=False, measure=False,
                       repeats=1, warmup=1, name=name)
        try:
            assert_same_structure(real, fake)
        except AssertionError:
            return (name, str(len(fake.ops)), "**differs**", "", "", f"{time.perf_counter() - start:.0f} s")
        plan = _budget_with_recompute(fake)
        want_loss, want_grads, _ = _step(copy.deepcopy(model), batch)
        loss, grads, ex = _step(copy.deepcopy(model), batch, plan, fake)
        bitwise = torch.equal(loss, want_loss) and all(map(_same, grads, want_grads))
        return (name, str(len(fake.ops)), "same", f"{ex.last_step.replays} of {simulate(fake, plan).recomputed_ops}",
                "yes" if bitwise else "**no**", f"{time.perf_counter() - start:.0f} s")
    except Exception as e:  # noqa: BLE001 - reported as the family's row
        return (name, "", f"**{type(e).__name__}**: {str(e)[:160]}", "", "", f"{time.perf_counter() - start:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated families (default: all)")
    ap.add_argument("--update-doc", action="store_true")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or list(FAM)
    torch.set_num_threads(1)  # bitwise comparisons do not depend on how a reduction was split
    timer = OpTimer(torch.device("cpu"), cache_dir=tempfile.mkdtemp(), min_runs=1, target_s=0.0)
    rows = []
    for name in names:
        rows.append(check(name, timer))
        print(" | ".join(rows[-1]), flush=True)
    ok = sum(r[2] == "same" and r[4] == "yes" for r in rows)
    text = "\n".join([
        f"Machine: {machine()}; transformers {T.__version__}. `python benchmarks/families.py --update-doc`.", "",
        "Families beyond the test matrix, built tiny and random (width 32, 2 layers, batch 4, sequence 32): the "
        "fake graph against the real one in every field but the times, and a plan solved on the fake graph "
        "that recomputes something, trained one step against plain training (loss and gradients bitwise). "
        f"**{ok} of {len(rows)}** trace as the real step and train bitwise.", "",
        "| family | ops | fake graph vs real | replays run (of planned) | bitwise | seconds |",
        "|---|---:|---|---:|---|---:|",
        *("| " + " | ".join(r) + " |" for r in rows)])
    publish(text, args.update_doc, "families", "Fake traces of transformers' families: beyond the test matrix")


if __name__ == "__main__":
    main()
