"""SWAN as a multi-normalized gradient: row normalization, then whitening (arXiv:2502.06742 section 3.4,
docs/algorithms/swan.md).

For m <= n, with k = n (else on the transpose: the lines are columns and k = m)::

    repeat L:  X = sqrt(k) X / rownorm(X)          (optionally centered first; ``line_scale``)
               X = sqrt(k) (X X^T)^{-1/2} X         (whitening = sqrt(k) * polar factor U V^T; ``whiten``)
    W = W - lr * lr_scale * X

Sharded: the line norms are partial sums completed by one bucketed all-reduce; whitening needs only the
small Gram matrix of each matrix (``MatrixOps``: reduced from row blocks, or computed by an owner rank), then
the coupled Newton-Schulz iteration on it (converges to the polar factor; 12 steps by default, fp32), or an
exact float64 eigendecomposition (``whitening="svd"``).
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Literal, Unpack

import pydantic
import torch

from ..sharding import Round, col_sums, masked_rsqrt, row_sums, scale_into
from ..sharding.matfun import by_shape, gram_inverse_sqrt
from ..sharding.matrix_ops import OpCost
from .base import ShardedOptimizer
from .config import CommonOptions, WholeMatrixConfig

__all__ = ["SWAN", "line_scale", "whiten", "SWANConfig"]


def line_scale(norm2: torch.Tensor, k: int) -> torch.Tensor:
    """``sqrt(k) / |line|`` per line from the completed squared line norms (0 for a zero line)."""
    return masked_rsqrt(norm2, math.sqrt(k))


def whiten(a_rows: torch.Tensor, root: torch.Tensor, k: int) -> torch.Tensor:
    """Rows of ``sqrt(k) A (A^T A)^{-1/2}`` given ``root = (A^T A)^{-1/2}`` of the whole ``A``."""
    return (a_rows @ root) * math.sqrt(k)


def _subtract_line_means(layout, x: torch.Tensor, means: torch.Tensor, axis: int) -> None:
    for b, view in layout.views(x):
        if axis == 0:
            view.sub_(means[b.row: b.row + b.height, None])
        else:
            view.sub_(means[None, b.col: b.col + b.width])


class SWANConfig(WholeMatrixConfig):
    """docs/algorithms/swan.md: SWAN-dagger lr 0.02 x 0.05, one normalize+whiten sweep, no centering."""

    treatment = "swan"

    lr: float = pydantic.Field(0.02, ge=0, description="global lr (AdamW's too unless adam_lr)")
    lr_scale: float = pydantic.Field(0.05, ge=0, description="the matrix lr is lr * lr_scale")
    iterations: int = pydantic.Field(1, ge=1, description="normalize + whiten sweeps")
    center: bool = pydantic.Field(False, description="subtract the row means first")
    whitening: Literal["newton_schulz", "svd"] = "newton_schulz"
    ns_steps: int = pydantic.Field(12, ge=1, lt=100, description="coupled Newton-Schulz steps (converges)")


_D = SWANConfig.defaults()


class SWAN(ShardedOptimizer):
    """SWAN (``treatment="swan"``; keys ``lr`` 0.02, ``lr_scale`` 0.05, ``iterations`` 1, ``center`` False,
    ``whitening`` "newton_schulz" | "svd", ``ns_steps`` 12, ``weight_decay`` 0); others use AdamW at ``lr``."""

    Config = SWANConfig
    matrix_treatments = ("swan",)

    def __init__(self, params: Iterable[Any], lr: float = _D.lr, lr_scale: float = _D.lr_scale,
                 iterations: int = _D.iterations, center: bool = _D.center, whitening: str = _D.whitening,
                 ns_steps: int = _D.ns_steps, weight_decay: float = _D.weight_decay,
                 **options: Unpack[CommonOptions]):
        self._init_from_config(params, self.Config.from_arguments(type(self).__name__, dict(
            lr=lr, lr_scale=lr_scale, iterations=iterations, center=center, whitening=whitening,
            ns_steps=ns_steps, weight_decay=weight_decay), options))

    def _step_swan(self, group: dict) -> None:
        items = self._matrix_items(group)
        rnd = Round()
        for it in items:
            m, n = it.layout.shape
            it.work["axis"] = 0 if m <= n else 1
            it.work["k"] = max(m, n)
            it.work["x"] = it.grad.clone()
        for _ in range(group["iterations"]):
            if group["center"]:
                for it in items:
                    sums = (row_sums if it.work["axis"] == 0 else col_sums)(it.layout, it.work["x"])
                    rnd.add_axis(it.layout, sums, it.work["axis"])
                    it.work["sums"] = sums
                rnd.run()
                for it in items:
                    _subtract_line_means(it.layout, it.work["x"], it.work["sums"] / it.work["k"], it.work["axis"])
            for it in items:
                sq = it.work["x"] * it.work["x"]
                it.work["norm2"] = (row_sums if it.work["axis"] == 0 else col_sums)(it.layout, sq)
                rnd.add_axis(it.layout, it.work["norm2"], it.work["axis"])
            rnd.run()
            for it in items:
                inv = line_scale(it.work["norm2"], it.work["k"])
                scale_into(it.layout, it.work["x"], it.work["x"], inv if it.work["axis"] == 0 else None,
                           inv if it.work["axis"] == 1 else None)
            self._whiten(items, group)
        lr = group["lr"] * group["lr_scale"]
        for it in items:
            it.apply(it.work["x"], lr, group["weight_decay"])

    whole_matrix_work = True

    def whole_matrix_transpose(self, group: dict, shape: tuple[int, int]) -> bool:
        m, n = shape
        return m <= n

    def whole_matrix_cost(self, group: dict, a_shape: tuple[int, int]) -> OpCost:
        rows, k = a_shape
        return OpCost(row_flops=4.0 * rows * k * k, small_flops=4.0 * group["ns_steps"] * k ** 3, reduced=k * k)

    def _whiten(self, items: list, group: dict) -> None:
        """``x <- sqrt(k) x (x^T x)^{-1/2}`` on the orientation whose Gram is small: a sum over the long
        dimension's rows, reduced over row blocks (distributed) or computed by an owner (gather)."""
        self._run_whole_matrix(group, items, lambda its, ops: self._whiten_bucket(its, ops, group))

    def _whiten_bucket(self, items: list, ops, group: dict) -> None:
        blocks = [b[0] for b in ops.to_blocks([[it.work["x"]] for it in items])]
        active = [i for i in range(len(items)) if ops.active(i)]
        grams = ops.allreduce({i: blocks[i].T @ blocks[i] for i in active})
        # Centered lines of a square matrix sum to zero, so its Gram is singular by construction and the coupled
        # iteration would amplify the null direction by 1.5 per step (to inf/NaN): those take the exact
        # pseudo-inverse root, which maps it to zero. Decided by shape, the same on every rank.
        exact = {i for i in grams if group["center"] and len(set(items[i].layout.shape)) == 1}
        roots = by_shape(lambda g: gram_inverse_sqrt(g, group["whitening"], group["ns_steps"]),
                         {i: g for i, g in grams.items() if i not in exact})
        roots.update(by_shape(lambda g: gram_inverse_sqrt(g, "svd"), {i: grams[i] for i in exact}))
        out = {i: whiten(blocks[i], roots[i], max(items[i].layout.shape)) for i in active}
        for it, piece in zip(items, ops.from_blocks([out.get(i) for i in range(len(items))])):
            it.work["x"] = piece
        ops.account()
