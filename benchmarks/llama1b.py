"""A 1.1-billion-parameter decoder (transformers' Llama: TinyLlama's shape, random init) built on the meta
device, for planning without the memory it needs:

    memplan plan benchmarks/llama1b.py:build --fake --device-spec h100-80gb --budget 60GiB
    memplan plan benchmarks/llama1b.py:build --set batch_size=2 --device-spec l4 --budget 22GiB

Nothing of its 1.1 B parameters is allocated: ``memplan --fake`` traces it under fake tensors.
"""

from __future__ import annotations

import torch


def build(n_layer: int = 22, seq_len: int = 2048, batch_size: int = 1, vocab_size: int = 32000):
    """``(model on the meta device, token batch, loss_fn)``: next-token cross-entropy (``labels=``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=n_layer,
                         num_attention_heads=32, num_key_value_heads=4, vocab_size=vocab_size,
                         max_position_embeddings=seq_len, use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids = torch.randint(0, vocab_size, (batch_size, seq_len))

    def loss_fn(model, batch):
        return model(input_ids=batch, labels=batch).loss

    return model, ids, loss_fn
