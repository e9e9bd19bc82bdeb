"""SinkGD: SR-Sinkhorn multi-normalized gradient descent (arXiv:2502.06742; docs/algorithms/sinkgd.md).

Scaling-vector form of SR-Sinkhorn on ``A = G * G`` (rows first, columns last; ``L`` sweeps)::

    v = 1
    repeat L:  u = n / (A v);   v = m / (A^T u)        (zero lines get zero scales, never NaN)
    W = W * (1 - lr * scale * wd) - lr * scale * diag(sqrt(u)) G diag(sqrt(v))

Every column of the update has l2 norm sqrt(m); rows approach sqrt(n). ``sinkhorn_scale`` is the math of a
half-sweep on the completed sums (u or v). Sharded: each half-sweep is one
bucketed all-reduce of the split indices of ``A v`` or ``A^T u``; FSDP2 row shards need only the column
rounds (``L`` collectives per step for all matrices together), ZeRO flat slices add tiny boundary-row rounds.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from ..sharding import Round, col_sums, masked_reciprocal, row_sums
from .base import ShardedOptimizer, check_lr
from .grouped import grouped_step

__all__ = ["SinkGD", "sr_sinkhorn_scales", "sinkhorn_scale"]


def sinkhorn_scale(weighted_sums: torch.Tensor, length: int) -> torch.Tensor:
    """One half-sweep: ``u = n / (A v)`` (``length = n``, the row length) or ``v = m / (A^T u)`` (``length =
    m``) from the completed weighted line sums; a zero line gets a zero scale."""
    return masked_reciprocal(weighted_sums, float(length))


def sr_sinkhorn_scales(items: list, iterations: int) -> None:
    """Compute ``work['u']`` and ``work['v']`` (squared scales) for every matrix item, in lockstep rounds."""
    rnd = Round()
    for it in items:
        it.work["A"] = it.grad * it.grad
        it.work["v"] = None
    for _ in range(iterations):
        for it in items:
            it.work["r"] = row_sums(it.layout, it.work["A"], it.work["v"])
            rnd.add_axis(it.layout, it.work["r"], 0)
        rnd.run()
        for it in items:
            it.work["u"] = sinkhorn_scale(it.work["r"], it.layout.shape[1])
            it.work["c"] = col_sums(it.layout, it.work["A"], it.work["u"])
            rnd.add_axis(it.layout, it.work["c"], 1)
        rnd.run()
        for it in items:
            it.work["v"] = sinkhorn_scale(it.work["c"], it.layout.shape[0])


class SinkGD(ShardedOptimizer):
    """SinkGD optimizer. Matrix groups use ``treatment="sinkgd"`` with keys ``lr`` (global lr, 0.02),
    ``lr_scale`` (alpha, 0.05: peak matrix lr 1e-3), ``iterations`` (L = 5), ``weight_decay`` (0).
    Embedding, LM head and vectors use AdamW at the global lr, as in the paper (docs/algorithms/sinkgd.md).
    """

    matrix_treatments = ("sinkgd",)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.02,
        lr_scale: float = 0.05,
        iterations: int = 5,
        weight_decay: float = 0.0,
        adam_lr: float | None = None,
        adam_betas: tuple[float, float] = (0.9, 0.999),
        adam_eps: float = 1e-8,
        adam_weight_decay: float = 0.0,
        on_nonfinite: str = "skip",
        debug_plan: bool | None = None,
    ):
        check_lr(lr)
        if lr < 0 or lr_scale < 0:
            raise ValueError(f"lr and lr_scale must be >= 0, got lr={lr}, lr_scale={lr_scale}")
        if int(iterations) < 1:
            raise ValueError(f"iterations must be >= 1, got {iterations}")
        defaults = dict(lr=lr, lr_scale=lr_scale, iterations=int(iterations), weight_decay=weight_decay)
        super().__init__(params, defaults, adam_lr=adam_lr, betas=tuple(adam_betas), eps=adam_eps,
                         weight_decay=adam_weight_decay, on_nonfinite=on_nonfinite, debug_plan=debug_plan)

    def _step_sinkgd(self, group: dict) -> None:
        step = grouped_step(self, group)
        blocks = step.blocks
        if not blocks.n_items:
            return
        grads = step.grads
        a = blocks.square(grads)  # A = G * G, per block shape
        rnd = Round()
        v = None
        for _ in range(group["iterations"]):  # the half-sweeps of sr_sinkhorn_scales, for all matrices at once
            r = blocks.row_sums(a, v)
            blocks.add_axis(rnd, r, 0)
            rnd.run()
            u = masked_reciprocal(r, blocks.row_length)  # sinkhorn_scale with each row's length n
            c = blocks.col_sums(a, u)
            blocks.add_axis(rnd, c, 1)
            rnd.run()
            v = masked_reciprocal(c, blocks.col_length)
        lr = group["lr"] * group["lr_scale"]
        step.apply(blocks.scale(grads, u.sqrt(), v.sqrt(), out=a), lr, group["weight_decay"])  # A no longer needed
