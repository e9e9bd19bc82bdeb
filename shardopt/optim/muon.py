"""Muon (momentum + Newton-Schulz orthogonalization), the baseline the matrix-optimizer papers compare with.

Same update as ``torch.optim.Muon``: ``B = lerp(B, G, 1 - mu)``, Nesterov ``U = lerp(G, B, mu)``,
``O = NS5(U)``, ``W = W (1 - lr wd) - lr_adj O`` with ``lr_adj = lr sqrt(max(1, m/n))`` ("original") or
``0.2 lr sqrt(max(m, n))`` ("match_rms_adamw"). On sharded parameters the momentum is element-wise local
and Newton-Schulz runs on whole matrices gathered to owner ranks (``shardopt.sharding.owner``).
``ns_dtype="bfloat16"`` reproduces torch's bf16 iteration; the default fp32 keeps sharded runs equal to the
single-process run to fp32 rounding.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Literal, Unpack

import pydantic
import torch

from ..sharding.linalg import MUON_COEFFICIENTS, newton_schulz
from ..sharding.owner import newton_schulz_cost, run_on_owners
from .base import ShardedOptimizer
from .config import CommonOptions, OptimizerConfig

__all__ = ["Muon", "MuonConfig", "adjusted_lr"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def adjusted_lr(lr: float, rule: str | None, shape: tuple[int, int]) -> float:
    m, n = shape
    if rule in (None, "original"):
        return lr * math.sqrt(max(1.0, m / n))
    if rule == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(m, n))
    raise ValueError(f"adjust_lr_fn must be 'original' or 'match_rms_adamw', got {rule!r}")


class MuonConfig(OptimizerConfig):
    """torch.optim.Muon's defaults: lr 1e-3, momentum 0.95 (Nesterov), wd 0.1, 5 quintic NS steps."""

    treatment = "muon"

    lr: float = pydantic.Field(1e-3, ge=0)
    momentum: float = pydantic.Field(0.95, ge=0, lt=1)
    nesterov: bool = True
    weight_decay: float = pydantic.Field(0.1, ge=0)
    ns_steps: int = pydantic.Field(5, ge=1, lt=100, description="quintic Newton-Schulz steps")
    eps: float = pydantic.Field(1e-7, gt=0)
    adjust_lr_fn: Literal["original", "match_rms_adamw"] | None = pydantic.Field(
        None, description="torch.optim.Muon's lr adjustment by shape (None: 'original')")
    ns_dtype: Literal["float32", "bfloat16", "float64"] = pydantic.Field(
        "float32", description="float32: exact across sharding; bfloat16: bitwise torch.optim.Muon")


_D = MuonConfig.defaults()


class Muon(ShardedOptimizer):
    """Muon for 2-D matrices (``treatment="muon"``; keys ``lr``, ``momentum``, ``nesterov``, ``weight_decay``,
    ``ns_steps``, ``eps``, ``adjust_lr_fn``, ``ns_dtype``); other params use AdamW (``adam_lr``, default lr)."""

    Config = MuonConfig
    matrix_treatments = ("muon",)
    state_kinds = {**ShardedOptimizer.state_kinds, "momentum_buffer": "elements"}

    def __init__(self, params: Iterable[Any], lr: float = _D.lr, momentum: float = _D.momentum,
                 nesterov: bool = _D.nesterov, weight_decay: float = _D.weight_decay, ns_steps: int = _D.ns_steps,
                 eps: float = _D.eps, adjust_lr_fn: str | None = _D.adjust_lr_fn, ns_dtype: str = _D.ns_dtype,
                 **options: Unpack[CommonOptions]):
        self._init_from_config(params, self.Config.from_arguments(type(self).__name__, dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, ns_steps=ns_steps, eps=eps,
            adjust_lr_fn=adjust_lr_fn, ns_dtype=ns_dtype), options))

    def elementwise_state_copies(self, group: dict) -> int:
        return 2 if group.get("treatment", "adamw") == "adamw" else 1

    def _step_muon(self, group: dict) -> None:
        mu = group["momentum"]

        def source(p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
            st = self.state[p]
            if "momentum_buffer" not in st:
                st["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            buf = st["momentum_buffer"]
            g = grad.to(buf.dtype)
            buf.lerp_(g, 1 - mu)
            return g.lerp(buf, mu) if group["nesterov"] else buf

        items = self._matrix_items(group, source)
        dtype = _DTYPES[group["ns_dtype"]]
        steps, eps = group["ns_steps"], group["eps"]

        def orthogonalize(mats: list[torch.Tensor]) -> list[torch.Tensor]:
            return [newton_schulz(x, steps, MUON_COEFFICIENTS, eps, dtype) for x in mats]

        updates = run_on_owners([it.layout for it in items], [it.frag.name for it in items],
                                [it.grad for it in items], orthogonalize,
                                lambda shape: newton_schulz_cost(shape, steps))
        for it, update in zip(items, updates):
            lr = group["lr"]
            if it.has_grad and it.frag.numel and group["weight_decay"]:
                it.param().mul_(1 - lr * group["weight_decay"])
            it.apply(update, adjusted_lr(lr, group["adjust_lr_fn"], it.layout.shape))
