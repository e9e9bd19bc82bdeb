"""SCALE: column-normalized SGD with momentum on the LM head only (arXiv:2506.16659 v3; docs/algorithms/scale.md).

Per matrix ``G`` (PyTorch ``(out, in)``), "column-wise" in the paper is one statistic per *output unit*,
i.e. per row here (``norm_dim=1``: reduce over ``in``); the token embedding ``(V, d)`` reduces over the
vocabulary (``norm_dim=0``). With momentum ``beta > 0`` (the LM head group) the EMA ``M`` is normalized
instead of ``G``::

    M = beta * M + (1 - beta) * G          (only when beta > 0; zero init, no bias correction)
    s = max(sqrt(mean(X * X, norm_dim)), eps)       (RMS, as the released code; norm="l2": no mean)
    W = W * (1 - lr * wd) - lr * X / s

The state key ``momentum_buffer`` holds ``M`` (torch.optim's name for it, as in SGD and Muon).

Sharded: the per-row/per-column sums of squares are partial sums over local elements, completed by one
bucketed all-reduce of the split indices only (none for FSDP2 row shards with ``norm_dim=1``); ``inverse_rms``
is the math on the completed sums.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from ..sharding import Round
from .base import ShardedOptimizer, check_lr
from .grouped import grouped_step

__all__ = ["SCALE", "inverse_rms"]


def inverse_rms(sumsq: torch.Tensor, count: int | torch.Tensor, eps: float, norm: str = "rms") -> torch.Tensor:
    """``1 / s`` with ``s = max(sqrt(sumsq / count), eps)`` per line (``norm="l2"``: no division by the line
    length ``count``, a number or one per line), from each line's completed sum of squares."""
    if norm == "rms":
        sumsq = sumsq / count
    return 1.0 / sumsq.sqrt().clamp_min(eps)


class SCALE(ShardedOptimizer):
    """SCALE optimizer. Matrix groups use ``treatment="scale"`` with keys ``lr``, ``norm_dim`` (1: per row,
    0: per column), ``momentum`` (EMA beta; 0 = none), ``eps``, ``norm`` ("rms" | "l2"), ``weight_decay``.
    Other groups use ``treatment="adamw"`` (``adam_lr``, ``adam_betas``, ``adam_eps``, ``adam_weight_decay``).

    Defaults (docs/algorithms/scale.md): lr 1e-3, LM-head beta 0.9, eps 1e-8 (a clamp on the RMS), wd 0, AdamW for
    vectors at 1e-3 with eps outside the bias correction as in the released code.
    """

    matrix_treatments = ("scale",)
    state_kinds = {**ShardedOptimizer.state_kinds, "momentum_buffer": "elements"}
    adamw_defaults = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, eps_mode="outside")
    #: named parameters route as create_optimizer: the embedding normalized per column, momentum on the LM head
    role_table = {**ShardedOptimizer.role_table, "embedding": {"norm_dim": 0}, "lm_head": {"momentum": 0.9}}

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.0,
        norm_dim: int = 1,
        eps: float = 1e-8,
        norm: str = "rms",
        weight_decay: float = 0.0,
        adam_lr: float | None = 1e-3,
        adam_betas: tuple[float, float] = (0.9, 0.999),
        adam_eps: float = 1e-8,
        adam_weight_decay: float = 0.0,
        on_nonfinite: str = "skip",
        debug_plan: bool | None = None,
    ):
        check_lr(lr)
        if lr < 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if norm not in ("rms", "l2"):
            raise ValueError(f"norm must be 'rms' or 'l2', got {norm!r}")
        if norm_dim not in (0, 1):
            raise ValueError(f"norm_dim must be 0 or 1, got {norm_dim}")
        defaults = dict(lr=lr, momentum=momentum, norm_dim=norm_dim, eps=eps, norm=norm, weight_decay=weight_decay)
        super().__init__(params, defaults, adam_lr=adam_lr, betas=tuple(adam_betas), eps=adam_eps,
                         weight_decay=adam_weight_decay, on_nonfinite=on_nonfinite, debug_plan=debug_plan)

    def elementwise_state_copies(self, group: dict) -> int:
        if group.get("treatment", "adamw") == "adamw":
            return 2
        return 1 if group["momentum"] else 0

    def _step_scale(self, group: dict) -> None:
        beta = group["momentum"]

        def source(p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
            if not beta:
                return grad
            st = self.state[p]
            if "momentum_buffer" not in st:
                st["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32,
                                                         memory_format=torch.contiguous_format)
            buf = st["momentum_buffer"]
            buf.lerp_(grad.to(buf.dtype), 1 - beta)
            return buf

        step = grouped_step(self, group, source)
        blocks = step.blocks
        axis = 0 if group["norm_dim"] == 1 else 1  # stats per row when reducing over dim 1
        rnd = Round()
        stats = blocks.row_sums(step.grads, square=True) if axis == 0 else blocks.col_sums(step.grads, square=True)
        blocks.add_axis(rnd, stats, axis)
        rnd.run()
        # each row's count is its matrix's n (per-row stats), each column's its m
        inv = inverse_rms(stats, blocks.row_length if axis == 0 else blocks.col_length, group["eps"], group["norm"])
        step.apply_scaled(step.grads, group["lr"], group["weight_decay"],
                          row_scale=inv if axis == 0 else None, col_scale=inv if axis == 1 else None)
