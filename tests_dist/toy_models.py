"""Small models whose shapes stress sharding (shared by the distributed workers).

``ToyLM`` (about 1.1k parameters): a 5-row Linear and a 2-row matrix give uneven and empty FSDP2 row
shards at world sizes 3-4; the ``wide`` matrix has rows of 324 elements, longer than a whole ZeRO-1/2
partition at world size 4 (281 elements) and than a ZeRO-3 partition at world sizes 3-4; all ZeRO
boundaries fall mid-row. Every 2-D weight except ``l2`` has a column count divisible by 1..4 so FSDP2
``Shard(1)`` works where torch allows it (``l2`` keeps ``Shard(0)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

VOCAB, DIM, HIDDEN, SEQ = 13, 12, 5, 27
GLOBAL_BATCH = 12  # divisible by world sizes 1, 2, 3, 4


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.l1 = nn.Linear(dim, hidden)
        self.l2 = nn.Linear(hidden, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.l2(torch.tanh(self.l1(h)))


class ToyLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = DIM, hidden: int = HIDDEN, seq: int = SEQ, n_blocks: int = 1):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(dim)
        self.wide = nn.Linear(seq * dim, 2)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for blk in self.blocks:
            h = blk(h)
        h = self.norm(h)
        gate = torch.tanh(self.wide(h.flatten(1)))[:, :1, None]
        return self.lm_head(h) * (1 + 0.5 * gate)


def loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1] if tokens.shape[1] > SEQ else tokens)
    targets = torch.roll(tokens, -1, dims=1)
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def batch(step: int, global_batch: int = GLOBAL_BATCH) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (global_batch, SEQ), generator=g)


def make_model(seed: int = 0, n_blocks: int = 1) -> ToyLM:
    torch.manual_seed(seed)
    return ToyLM(n_blocks=n_blocks)


class AttentionBlock(nn.Module):
    """q/k/v/o and a SwiGLU MLP (LLaMA's matrix shapes, ``dim`` x ``dim`` and ``ffn`` x ``dim``)."""

    def __init__(self, dim: int, ffn: int):
        super().__init__()
        self.dim = dim
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(dim, ffn, bias=False), nn.Linear(dim, ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)
        self.norm = nn.LayerNorm(dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.norm(h)
        a = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2) / self.dim**0.5, -1) @ self.v(x)
        h = h + self.o(a)
        return h + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


class SmallLM(nn.Module):
    """A LLaMA-like model whose parameters, not per-row/column vectors, carry the optimizer state (the memory
    and time-model workers): embedding, ``blocks`` attention blocks, LM head."""

    def __init__(self, vocab: int, dim: int, ffn: int, blocks: int):
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(AttentionBlock(dim, ffn) for _ in range(blocks))
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for b in self.blocks:
            h = b(h)
        return self.lm_head(h)


@dataclass(frozen=True)
class LMSetup:
    """A ``SmallLM`` size with its synthetic next-token batches: ``model()``, ``batch(step)``, ``loss``."""

    vocab: int
    dim: int
    ffn: int
    blocks: int
    seq: int
    batch_size: int

    def model(self) -> SmallLM:
        return SmallLM(self.vocab, self.dim, self.ffn, self.blocks)

    def batch(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(step)
        return torch.randint(0, self.vocab, (self.batch_size, self.seq), generator=g)

    def loss(self, model, tokens: torch.Tensor) -> torch.Tensor:
        logits = model(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, self.vocab).float(), tokens[:, 1:].reshape(-1))
