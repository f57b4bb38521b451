"""The fake trace is the real step on the model families transformers ships (issue #21): for a decoder of
each kind, encoder-decoders (text and audio), encoders, vision models (classification and segmentation), a
two-tower contrastive model and a state-space model, built tiny and random on the CPU with the loss
from ``labels=``, the graph traced under fake tensors is the real profile's (same ops in the same order,
bytes, saves, lifetimes), and the plan solved on it trains a step under the executor with recomputation
whose loss and gradients are bitwise those of plain training.

Before the fix, Llama and Mistral were refused at the first step under the plan: their position ids, made
by ``torch.arange`` under fake tensors, were fake, transformers' ``is_tracing`` then skipped the packed-
sequence check (``aten.select``...) and the fake step ran other ops than the real one.

Mixture-of-experts decoders (Mixtral, Qwen2-MoE) route with transformers' default ``grouped_mm`` experts:
every token's top-k pairs, sorted by expert, go through one grouped matrix product whose offsets are data
but whose shapes are not, so the step is static. Before the fix they were refused: ``aten._grouped_mm``'s
meta function carries CUDA's checks (bfloat16 only) and refused the float32 product the CPU kernel runs;
the call now runs the device's kernel on zeros for its outputs' metadata. The ``eager`` experts (a loop
over ``nonzero``'s experts, token counts by the data) are refused in one line naming the op and module.
ResNet's batch norm: a replay wrote the running statistics a second time (``native_batch_norm`` writes
them without saying so in its schema); the buffers are compared too.
"""

import copy

import pytest
import torch

from memplan.executor import apply
from memplan.planner.core.errors import Infeasible
from memplan.planner.core.simulator import simulate
from memplan.planner.probe.fake import FakeTraceError
from memplan.planner.probe.profiler import profile
from memplan.solvers import solve
from memplan.solvers.bounds import memory_lower_bound

transformers = pytest.importorskip("transformers")
# one torch thread: op times in thread CPU time, not wall time in which a parallel kernel (the MoE grouped
# product) waits out a worker thread descheduled on a loaded machine (6 s of one case's 8 in a loaded run)
pytestmark = pytest.mark.usefixtures("one_thread")

WIDTH, LAYERS, HEADS, VOCAB, SEQ, BATCH = 32, 2, 4, 128, 32, 4


def _decoder(config_cls, model_cls, **extra):
    """A tiny decoder; ``extra`` adds or overrides config fields (one layer where one shows every path)."""
    def build():
        config = getattr(transformers, config_cls)(**{
            "hidden_size": WIDTH, "intermediate_size": 2 * WIDTH, "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS, "num_key_value_heads": HEADS // 2, "vocab_size": VOCAB,
            "max_position_embeddings": 4 * SEQ, "use_cache": False, **extra})
        ids = torch.randint(0, VOCAB, (BATCH, SEQ))
        return getattr(transformers, model_cls)(config), {"input_ids": ids, "labels": ids}
    return build


def _gpt2():
    config = transformers.GPT2Config(n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB,
                                     n_positions=4 * SEQ, use_cache=False)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return transformers.GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids}


def _t5():
    config = transformers.T5Config(d_model=WIDTH, d_kv=WIDTH // HEADS, d_ff=2 * WIDTH, num_layers=LAYERS,
                                   num_heads=HEADS, vocab_size=VOCAB, decoder_start_token_id=0, use_cache=False)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return transformers.T5ForConditionalGeneration(config), {"input_ids": ids, "labels": ids[:, : SEQ // 2].clone()}


def _bart():
    config = transformers.BartConfig(d_model=WIDTH, encoder_layers=LAYERS, decoder_layers=LAYERS,
                                     encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
                                     encoder_ffn_dim=2 * WIDTH, decoder_ffn_dim=2 * WIDTH, vocab_size=VOCAB,
                                     max_position_embeddings=4 * SEQ, use_cache=False)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # a padded row: the mask is built and read
    return transformers.BartForConditionalGeneration(config), {"input_ids": ids, "attention_mask": mask,
                                                               "labels": ids[:, : SEQ // 2].clone()}


def _bert():
    config = transformers.BertConfig(hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                     intermediate_size=2 * WIDTH, vocab_size=VOCAB, max_position_embeddings=4 * SEQ)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return transformers.BertForMaskedLM(config), {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                                  "labels": ids}


def _vit():
    config = transformers.ViTConfig(hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                    intermediate_size=2 * WIDTH, image_size=16, patch_size=4, num_channels=3,
                                    num_labels=5)
    return (transformers.ViTForImageClassification(config),
            {"pixel_values": torch.randn(BATCH, 3, 16, 16), "labels": torch.tensor([1, 4, 0, 2])})


def _gpt_neox():
    config = transformers.GPTNeoXConfig(hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=1,
                                        num_attention_heads=HEADS, vocab_size=VOCAB, max_position_embeddings=4 * SEQ,
                                        use_cache=False)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return transformers.GPTNeoXForCausalLM(config), {"input_ids": ids, "labels": ids}


def _opt():
    config = transformers.OPTConfig(hidden_size=WIDTH, ffn_dim=2 * WIDTH, word_embed_proj_dim=WIDTH, num_hidden_layers=1,
                                    num_attention_heads=HEADS, vocab_size=VOCAB, max_position_embeddings=4 * SEQ,
                                    use_cache=False)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ))
    return transformers.OPTForCausalLM(config), {"input_ids": ids, "labels": ids}


def _falcon():
    config = transformers.FalconConfig(hidden_size=WIDTH, num_hidden_layers=1, num_attention_heads=HEADS,
                                       vocab_size=VOCAB, use_cache=False)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return transformers.FalconForCausalLM(config), {"input_ids": ids, "labels": ids}


def _roberta():
    config = transformers.RobertaConfig(hidden_size=WIDTH, num_hidden_layers=1, num_attention_heads=HEADS,
                                        intermediate_size=2 * WIDTH, vocab_size=VOCAB, max_position_embeddings=4 * SEQ)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ))
    ids[1, -3:] = config.pad_token_id  # a padded row: position ids are made from the ids, the mask is read
    return transformers.RobertaForMaskedLM(config), {"input_ids": ids, "attention_mask": (ids != 1).long(),
                                                     "labels": ids}


def _swin():
    config = transformers.SwinConfig(embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4, patch_size=4,
                                     image_size=32, num_labels=5)
    return (transformers.SwinForImageClassification(config),
            {"pixel_values": torch.randn(BATCH, 3, 32, 32), "labels": torch.tensor([1, 4, 0, 2])})


def _resnet():
    config = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                       layer_type="basic", num_labels=5)
    return (transformers.ResNetForImageClassification(config),
            {"pixel_values": torch.randn(BATCH, 3, 16, 16), "labels": torch.tensor([1, 4, 0, 2])})


def _longformer():
    config = transformers.LongformerConfig(hidden_size=WIDTH, num_hidden_layers=1, num_attention_heads=HEADS,
                                           intermediate_size=2 * WIDTH, vocab_size=VOCAB, attention_window=8,
                                           max_position_embeddings=4 * SEQ)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ))
    return transformers.LongformerForMaskedLM(config), {"input_ids": ids, "labels": ids}


def _wav2vec2(**extra):
    config = transformers.Wav2Vec2Config(hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                         intermediate_size=2 * WIDTH, conv_dim=(16, 16), conv_stride=(5, 2),
                                         conv_kernel=(10, 3), num_conv_pos_embeddings=8,
                                         num_conv_pos_embedding_groups=4, mask_time_prob=0.0, **extra)
    return (transformers.Wav2Vec2ForSequenceClassification(config),
            {"input_values": torch.randn(BATCH, 1600), "labels": torch.tensor([1, 0, 1, 0])})


def _clip():
    towers = {"hidden_size": WIDTH, "intermediate_size": 2 * WIDTH, "num_hidden_layers": 1, "num_attention_heads": HEADS}
    config = transformers.CLIPConfig(text_config={**towers, "vocab_size": VOCAB, "max_position_embeddings": SEQ},
                                     vision_config={**towers, "image_size": 32, "patch_size": 8}, projection_dim=16)
    return transformers.CLIPModel(config), {"input_ids": torch.randint(3, VOCAB, (BATCH, SEQ)),
                                            "pixel_values": torch.randn(BATCH, 3, 32, 32), "return_loss": True}


def _whisper():
    config = transformers.WhisperConfig(d_model=WIDTH, encoder_layers=1, decoder_layers=1, encoder_attention_heads=HEADS,
                                        decoder_attention_heads=HEADS, encoder_ffn_dim=2 * WIDTH,
                                        decoder_ffn_dim=2 * WIDTH, vocab_size=VOCAB, num_mel_bins=16,
                                        max_source_positions=SEQ, max_target_positions=SEQ, use_cache=False,
                                        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    return (transformers.WhisperForConditionalGeneration(config),
            {"input_features": torch.randn(BATCH, 16, 2 * SEQ), "labels": torch.randint(3, VOCAB, (BATCH, 8))})


def _mamba():
    config = transformers.MambaConfig(hidden_size=WIDTH, num_hidden_layers=1, vocab_size=VOCAB, state_size=4,
                                      use_cache=False)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return transformers.MambaForCausalLM(config), {"input_ids": ids, "labels": ids}


def _bloom():
    config = transformers.BloomConfig(hidden_size=WIDTH, n_layer=1, n_head=HEADS, vocab_size=VOCAB, use_cache=False)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return transformers.BloomForCausalLM(config), {"input_ids": ids, "labels": ids}


def _convnext():
    config = transformers.ConvNextConfig(num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2,
                                         num_labels=3, image_size=32)
    return (transformers.ConvNextForImageClassification(config),
            {"pixel_values": torch.randn(BATCH, 3, 32, 32), "labels": torch.tensor([0, 1, 2, 0])})


def _segformer():
    config = transformers.SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
                                          num_attention_heads=[1, 2], decoder_hidden_size=16, num_labels=3,
                                          patch_sizes=[7, 3], strides=[4, 2])
    return (transformers.SegformerForSemanticSegmentation(config),
            {"pixel_values": torch.randn(BATCH, 3, 32, 32), "labels": torch.randint(0, 3, (BATCH, 32, 32))})


_MOE = {"num_hidden_layers": 1, "num_experts_per_tok": 2}

FAMILIES = {
    "llama": _decoder("LlamaConfig", "LlamaForCausalLM"),
    "mistral": _decoder("MistralConfig", "MistralForCausalLM", sliding_window=SEQ // 2),
    "qwen2": _decoder("Qwen2Config", "Qwen2ForCausalLM"),
    "gemma": _decoder("GemmaConfig", "GemmaForCausalLM", head_dim=WIDTH // HEADS),
    "gpt2": _gpt2,
    "bart": _bart,
    "bert": _bert,
    "vit": _vit,
    "mixtral": _decoder("MixtralConfig", "MixtralForCausalLM", num_local_experts=4, **_MOE),
    "qwen2_moe": _decoder("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_experts=4, moe_intermediate_size=WIDTH,
                          shared_expert_intermediate_size=WIDTH, **_MOE),
    "phi3": _decoder("Phi3Config", "Phi3ForCausalLM", num_hidden_layers=1, pad_token_id=0),
    "qwen3": _decoder("Qwen3Config", "Qwen3ForCausalLM", num_hidden_layers=1, head_dim=WIDTH // HEADS),
    # two layers: a sliding-window one and a global one; attention and final logits soft-capped
    "gemma2": _decoder("Gemma2Config", "Gemma2ForCausalLM", head_dim=WIDTH // HEADS, sliding_window=SEQ // 2),
    "gpt_neox": _gpt_neox,
    "opt": _opt,
    "falcon": _falcon,
    "roberta": _roberta,
    "resnet": _resnet,
    # layer norm after a permute: its backward's kernel makes a contiguous gradient where the meta function
    # kept the permuted strides, and the fake graph copied it in a later reshape (fake.py KERNEL_LAYOUTS)
    "swin": _swin,
    # attention scores masked through a slice of one view of them, then another view read: autograd
    # rebuilds that stale view by replaying its views under fake tensors (fake.py ViewReplays)
    "longformer": _longformer,
    # audio: a convolutional feature encoder; LayerDrop off (on by default: refused, below)
    "wav2vec2": lambda: _wav2vec2(layerdrop=0.0),
    # multi-head latent attention writes its keys into slices of a fresh buffer (key_states[..., :n].copy_):
    # under fake tensors autograd replays those views, and the trace waited forever on a view's mutex
    "deepseek_v3": _decoder("DeepseekV3Config", "DeepseekV3ForCausalLM", num_hidden_layers=1, kv_lora_rank=16,
                            q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=WIDTH,
                            first_k_dense_replace=1, n_group=1, topk_group=1),
    # two towers and a contrastive loss between them
    "clip": _clip,
    # audio encoder-decoder: convolutions over mel frames, then a decoder with cross-attention
    "whisper": _whisper,
    # a state-space model: the selective scan's reference loop (mamba_ssm not installed), 500 ops in one layer
    "mamba": _mamba,
    # ALiBi position biases built from the attention mask
    "bloom": _bloom,
    "convnext": _convnext,
    # segmentation: per-pixel labels, the decoder's upsampling
    "segformer": _segformer,
}


def _loss(model, batch):
    return model(**batch).loss


def _budget_with_recompute(graph):
    """A plan that recomputes something: the lowest of a few fractions of activation memory it meets."""
    keep, low = simulate(graph, None).peak_bytes, memory_lower_bound(graph)
    for frac in (0.5, 0.8):
        try:
            plan = solve(graph, low + int((keep - low) * frac), "greedy", time_limit_s=2).plan
        except Infeasible:
            continue
        if simulate(graph, plan).recomputed_ops > 0:
            return plan
    raise AssertionError(f"no budget below keep-everything recomputes anything on {graph.name}")


def _step(model, batch, plan=None, graph=None):
    """One training step (seeded: dropout draws the same); its loss, and the gradients and the buffers after
    it (batch norm's running statistics)."""
    ex = apply(model, plan, graph=graph) if plan is not None else None
    try:
        torch.manual_seed(1)
        loss = _loss(model, batch)
        loss.backward()
    finally:
        if ex is not None:
            ex.remove()
    return loss.detach(), [p.grad for p in model.parameters()] + [b.clone() for b in model.buffers()], ex


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_fake_trace_is_the_real_step_and_its_plan_trains(family, quick_timer, same_structure):
    torch.manual_seed(0)
    model, batch = FAMILIES[family]()
    fake = profile(model, batch, _loss, device="cpu", progress=False, fake=True, timer=quick_timer, name=family)
    real = profile(copy.deepcopy(model), batch, _loss, device="cpu", progress=False, measure=False, repeats=1,
                   warmup=1, name=family)
    same_structure(real, fake)

    plan = _budget_with_recompute(fake)
    want_loss, want_grads, _ = _step(copy.deepcopy(model), batch)
    loss, grads, ex = _step(copy.deepcopy(model), batch, plan, fake)
    assert ex.last_step.replays == simulate(fake, plan).recomputed_ops > 0
    assert torch.equal(loss, want_loss)
    assert all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
               for a, b in zip(grads, want_grads, strict=True))  # None: a parameter the step does not use


def test_moe_experts_whose_token_counts_are_data_are_refused_in_one_line(quick_timer):
    """transformers' ``eager`` experts loop over the experts ``nonzero`` finds and index their tokens: the
    shapes are the routing's, which fake tensors do not have. The fake profile says so in one line naming
    the op and the expert module (the default ``grouped_mm`` experts trace: ``mixtral`` above)."""
    torch.manual_seed(0)
    model, batch = _decoder("MixtralConfig", "MixtralForCausalLM", num_local_experts=4,
                            experts_implementation="eager", **_MOE)()
    with pytest.raises(FakeTraceError, match=r"^aten\.nonzero\.default in model\.layers\.0\.mlp\.experts "
                                             r"cannot run under fake tensors \(its output's shape depends") as e:
        profile(model, batch, _loss, device="cpu", progress=False, fake=True, timer=quick_timer, name="mixtral")
    assert "\n" not in str(e.value)


def test_layerdrop_is_refused_in_one_line_naming_the_draw(quick_timer):
    """Wav2Vec2 skips each encoder layer when a draw falls below ``layerdrop`` (0.1 by default): its steps
    run different ops at random, so the fake profile refuses it, saying so (planner/probe/draws.py)."""
    torch.manual_seed(0)
    model, batch = _wav2vec2()
    with pytest.raises(FakeTraceError, match=r"^aten\._local_scalar_dense\.default in wav2vec2\.encoder cannot run "
                                             r"under fake tensors .*: wav2vec2\.encoder branches on a random draw; "
                                             r".*layerdrop=0\.0\)$") as e:
        profile(model, batch, _loss, device="cpu", progress=False, fake=True, timer=quick_timer, name="wav2vec2")
    assert "\n" not in str(e.value)
