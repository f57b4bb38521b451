"""A 7-billion-parameter decoder (transformers' Llama: Llama-2-7B's shape, width 4096, 32 layers, MLP 11008,
fp32, random init) built on the meta device, for planning what does not fit:

    memplan plan benchmarks/llama7b.py:build --device-spec h100-80gb --budget 60GiB --offload --host-budget 400GiB

In fp32 with AdamW its model states alone are 16 bytes a parameter (~100 GiB): no activation plan fits an
80 GB GPU; streaming optimizer state through the host does (planner/core/states.py).
"""

from __future__ import annotations

import torch


def build(n_layer: int = 32, seq_len: int = 1024, batch_size: int = 1, vocab_size: int = 32000,
          width: int = 4096, mlp: int = 11008, heads: int = 32):
    """``(model on the meta device, token batch, loss_fn)``: next-token cross-entropy (``labels=``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=width, intermediate_size=mlp, num_hidden_layers=n_layer,
                         num_attention_heads=heads, num_key_value_heads=heads, vocab_size=vocab_size,
                         max_position_embeddings=seq_len, use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids = torch.randint(0, vocab_size, (batch_size, seq_len))

    def loss_fn(model, batch):
        return model(input_ids=batch, labels=batch).loss

    return model, ids, loss_fn
