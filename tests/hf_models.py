"""The tiny Hugging Face LLaMA the single-process front-door tests build (2 layers, untied head)."""

from __future__ import annotations

import torch
from torch import nn


def tiny_hf_llama() -> nn.Module:
    """``transformers.LlamaForCausalLM`` with vocab 64, hidden 16, 2 layers, seeded (callers skip without
    transformers)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=8,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(cfg)
