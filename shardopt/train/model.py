"""A LLaMA-style decoder for the reference trainer (plain modules, no parallelism inside).

RMSNorm (eps 1e-6), SiLU-gated MLP, rotary position embeddings, causal attention through
``torch.nn.functional.scaled_dot_product_attention``, no biases, untied LM head by default, and every
Linear/Embedding weight initialised N(0, 0.02) as in the GaLore-style benchmark harness.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, TypedDict

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LlamaConfig", "Llama", "PRESETS", "model_config"]


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 4096
    hidden_size: int = 128
    intermediate_size: int = 344
    num_heads: int = 4
    num_layers: int = 4
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError("the head dimension must be even for rotary embeddings")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Preset(TypedDict):
    """The LlamaConfig fields a preset sets (typed, so ``LlamaConfig(**preset)`` type-checks)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_layers: int
    max_seq_len: int


# name -> (hidden, intermediate, heads, layers, sequence length used for training)
PRESETS: dict[str, Preset] = {
    "tiny": Preset(hidden_size=128, intermediate_size=344, num_heads=4, num_layers=4, max_seq_len=128),
    "20m": Preset(hidden_size=256, intermediate_size=688, num_heads=4, num_layers=4, max_seq_len=256),
    "60m": Preset(hidden_size=512, intermediate_size=1376, num_heads=8, num_layers=8, max_seq_len=256),
    "130m": Preset(hidden_size=768, intermediate_size=2048, num_heads=12, num_layers=12, max_seq_len=256),
    "350m": Preset(hidden_size=1024, intermediate_size=2736, num_heads=16, num_layers=24, max_seq_len=256),
    "1b": Preset(hidden_size=2048, intermediate_size=5461, num_heads=32, num_layers=24, max_seq_len=256),
    "7b": Preset(hidden_size=4096, intermediate_size=11008, num_heads=32, num_layers=32, max_seq_len=256),
}


def model_config(preset: str, vocab_size: int, **overrides: Any) -> LlamaConfig:
    """The named preset with ``vocab_size`` and any non-None ``overrides`` applied."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {list(PRESETS)}")
    cfg = LlamaConfig(vocab_size=vocab_size, **PRESETS[preset])
    return replace(cfg, **{k: v for k, v in overrides.items() if v is not None})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight.to(x.dtype)


def rotary_tables(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (seq_len, head_dim // 2), computed in fp32 on every call (no buffers, so
    engines that cast or shard module state never touch them)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    t = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    return freqs.cos(), freqs.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of the last dim of x: (batch, heads, seq, head_dim)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.theta = cfg.rope_theta
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.o_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        cos, sin = rotary_tables(t, self.head_dim, self.theta, x.device)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, h))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Decoder-only LM. ``forward(tokens)`` returns logits; ``forward(tokens, labels)`` returns the mean
    cross-entropy over labels != -100."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.reset_parameters()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def reset_parameters(self) -> None:
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=self.config.init_std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        seen, n = set(), 0
        for name, p in self.named_parameters():
            if id(p) in seen or (exclude_embeddings and name.startswith(("embed_tokens", "lm_head"))):
                continue
            seen.add(id(p))
            n += p.numel()
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Approximate training FLOPs per token (6N plus attention)."""
        c = self.config
        return 6.0 * self.num_parameters() + 12.0 * c.num_layers * c.hidden_size * seq_len


def count_str(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.1f}K"
