"""LLaMA models with the trainer's preset shapes, and synthetic gradients for step-only benchmarks.

The optimizer step does not care where gradients come from, so step-time and memory benchmarks build the
real module (its routing roles: embedding, LM head, matrices, norm gains) and fill ``.grad`` with random
values instead of running a forward pass.
"""

from __future__ import annotations

import torch

from shardopt.train.model import Llama, count_str, model_config

__all__ = ["GALORE_VOCAB", "build_llama", "build_moe", "MOE_PRESETS", "random_grads", "describe"]

#: LLaMA tokenizer size used by the GaLore benchmark table the 60M/130M presets come from
GALORE_VOCAB = 32000


def build_llama(
    preset: str,
    vocab_size: int = GALORE_VOCAB,
    device: str | torch.device = "cpu",
    num_layers: int | None = None,
    seed: int = 0,
) -> Llama:
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
    return (
        f"{count_str(model.num_parameters())} params: hidden {c.hidden_size}, MLP {c.intermediate_size}, "
        f"{c.num_layers} layers, vocab {c.vocab_size}"
    )


#: mixture-of-experts shapes for the plan benchmarks: the 1B LLaMA's attention and widths with every MLP replaced by
#: ``experts`` fused experts (transformers 5's layout), ``top_k`` of them active per token
MOE_PRESETS = {"moe-8x1b": dict(hidden=2048, ffn=5632, layers=16, heads=16, experts=8, top_k=2)}


class _Experts(torch.nn.Module):
    """Fused experts as transformers 5 stores them (``MixtralExperts``): shapes only, for plans."""

    def __init__(self, experts: int, hidden: int, ffn: int):
        super().__init__()
        self.num_experts, self.is_transposed = experts, False
        self.gate_up_proj = torch.nn.Parameter(torch.empty(experts, 2 * ffn, hidden))
        self.down_proj = torch.nn.Parameter(torch.empty(experts, hidden, ffn))


class _MoeBlock(torch.nn.Module):
    def __init__(self, hidden: int, ffn: int, experts: int):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            torch.nn.Linear(hidden, hidden, bias=False) for _ in range(4)
        )
        self.input_norm, self.post_norm = torch.nn.RMSNorm(hidden), torch.nn.RMSNorm(hidden)
        self.mlp = torch.nn.Module()
        self.mlp.gate = torch.nn.Linear(hidden, experts, bias=False)
        self.mlp.experts = _Experts(experts, hidden, ffn)


class MoeModel(torch.nn.Module):
    """Embedding, MoE blocks, final norm and an untied LM head; ``active_params`` counts what a token runs through
    (``top_k`` experts), the parameters that forward+backward FLOPs scale with."""

    def __init__(self, hidden: int, ffn: int, layers: int, heads: int, experts: int, top_k: int, vocab: int):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, hidden)
        self.layers = torch.nn.ModuleList(_MoeBlock(hidden, ffn, experts) for _ in range(layers))
        self.norm = torch.nn.RMSNorm(hidden)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)
        total = sum(p.numel() for p in self.parameters())
        self.active_params = total - layers * (experts - top_k) * 3 * hidden * ffn


def build_moe(preset: str, vocab_size: int = GALORE_VOCAB, device: str | torch.device = "cpu") -> MoeModel:
    """The ``MOE_PRESETS`` shape ``preset`` on ``device`` (``"meta"`` for plans)."""
    with torch.device(device):
        return MoeModel(**MOE_PRESETS[preset], vocab=vocab_size)
