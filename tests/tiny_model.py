"""The small language model shared by the single-process tests: embedding, one Linear, LayerNorm, LM head."""

from __future__ import annotations

from torch import nn


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.proj = nn.Linear(6, 7)
        self.norm = nn.LayerNorm(7)
        self.lm_head = nn.Linear(7, 11, bias=False)

    def forward(self, x):
        return self.lm_head(self.norm(self.proj(self.embed(x))))
