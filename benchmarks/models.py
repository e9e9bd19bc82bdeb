"""LLaMA models with the trainer's preset shapes, and synthetic gradients for step-only benchmarks.

The optimizer step does not care where gradients come from, so step-time and memory benchmarks build the
real module (its routing roles: embedding, LM head, matrices, norm gains) and fill ``.grad`` with random
values instead of running a forward pass.
"""
from __future__ import annotations

import torch

from shardopt.train.model import Llama, count_str, model_config

__all__ = ["GALORE_VOCAB", "build_llama", "random_grads", "describe"]

#: LLaMA tokenizer size used by the GaLore benchmark table the 60M/130M presets come from
GALORE_VOCAB = 32000


def build_llama(preset: str, vocab_size: int = GALORE_VOCAB, device: str | torch.device = "cpu",
                num_layers: int | None = None, seed: int = 0) -> Llama:
    """The trainer's ``preset`` (tiny, 20m, 60m, 130m, ...) with ``vocab_size`` on ``device``."""
    torch.manual_seed(seed)
    with torch.device(device):
        return Llama(model_config(preset, vocab_size, num_layers=num_layers))


@torch.no_grad()
def random_grads(model: torch.nn.Module, seed: int = 0, scale: float = 1e-3) -> None:
    """Fill every parameter's ``.grad`` with N(0, scale^2) values (deterministic per seed)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for p in model.parameters():
        g = torch.randn(p.shape, generator=gen, dtype=torch.float32) * scale
        p.grad = g.to(device=p.device, dtype=p.dtype)


def describe(model: Llama) -> str:
    c = model.config
    return (f"{count_str(model.num_parameters())} params: hidden {c.hidden_size}, MLP {c.intermediate_size}, "
            f"{c.num_layers} layers, vocab {c.vocab_size}")
