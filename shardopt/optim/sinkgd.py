"""SinkGD: SR-Sinkhorn multi-normalized gradient descent (arXiv:2502.06742; docs/algorithms/sinkgd.md).

Scaling-vector form of SR-Sinkhorn on ``A = G * G`` (rows first, columns last; ``L`` sweeps)::

    v = 1
    repeat L:  u = n / (A v);   v = m / (A^T u)        (zero lines get zero scales, never NaN)
    W = W * (1 - lr * scale * wd) - lr * scale * diag(sqrt(u)) G diag(sqrt(v))

Every column of the update has l2 norm sqrt(m); rows approach sqrt(n). ``sinkhorn_scale`` is the math of a
half-sweep on the completed sums (u or v). Sharded: each half-sweep is one
bucketed all-reduce of the split indices of ``A v`` or ``A^T u``; FSDP2 row shards need only the column
rounds (``L`` collectives per step for all matrices together), ZeRO flat slices add tiny boundary-row rounds.
A weight stored in x out (``matrix_transposed``) is balanced as its logical out x in matrix: rows first means its
stored columns first (``optim.transposed``).
"""

from __future__ import annotations

from typing import Any, Iterable

import pydantic
import torch
from typing_extensions import Unpack

from ..sharding import Round, col_sums, masked_reciprocal, row_sums
from ..sharding.row_passes import row_block_pass, rows_complete
from .base import ShardedOptimizer
from .config import CommonOptions, OptimizerConfig
from .grouped import grouped_step
from .transposed import line_length, line_sums, logical_axes

__all__ = ["SinkGD", "sr_sinkhorn_scales", "sinkhorn_scale", "SinkGDConfig"]


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


class SinkGDConfig(OptimizerConfig):
    """docs/algorithms/sinkgd.md: global lr 0.02, matrix lr scale 0.05, L = 5; AdamW at the global lr."""

    treatment = "sinkgd"

    lr: float = pydantic.Field(0.02, ge=0, description="global lr (AdamW's too unless adam_lr)")
    lr_scale: float = pydantic.Field(0.05, ge=0, description="alpha: the matrix lr is lr * lr_scale")
    iterations: int = pydantic.Field(5, ge=1, description="L: SR-Sinkhorn sweeps")


_D = SinkGDConfig.defaults()


class SinkGD(ShardedOptimizer):
    """SinkGD optimizer. Matrix groups use ``treatment="sinkgd"`` with keys ``lr`` (global lr, 0.02),
    ``lr_scale`` (alpha, 0.05: peak matrix lr 1e-3), ``iterations`` (L = 5), ``weight_decay`` (0).
    Embedding, LM head and vectors use AdamW at the global lr, as in the paper (docs/algorithms/sinkgd.md).
    """

    Config = SinkGDConfig
    matrix_treatments = ("sinkgd",)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = _D.lr,
        lr_scale: float = _D.lr_scale,
        iterations: int = _D.iterations,
        weight_decay: float = _D.weight_decay,
        **options: Unpack[CommonOptions],
    ):
        self._init_from_config(
            params,
            self.Config.from_arguments(
                type(self).__name__,
                dict(lr=lr, lr_scale=lr_scale, iterations=iterations, weight_decay=weight_decay),
                options,
            ),
        )

    def skips_on_device(self, group: dict) -> bool:
        """SinkGD keeps no state: a skipped step is a row scale of 0 and a decay factor of 1 (``_step_sinkgd``), on
        gradients whose non-finite elements read as 0."""
        return group.get("treatment") == "sinkgd" or super().skips_on_device(group)

    def _step_sinkgd(self, group: dict) -> None:
        gate = self._step_gate  # None, or 0-d 1./0.: the step's skip decided on the device (nonfinite.gate_step)
        step = grouped_step(self, group)
        blocks = step.blocks
        if not blocks.n_items:
            return
        if gate is not None:
            step.sanitize()
        grads = step.grads
        rows, cols = logical_axes(group)  # the stored axes of the logical rows and columns (swapped in x out)
        if rows == 0 and rows_complete(blocks):
            self._sinkgd_row_blocks(group, step)
            return
        a = blocks.square(grads)  # A = G * G, per block shape
        rows, cols = logical_axes(group)  # the stored axes of the logical rows and columns (swapped in x out)
        rnd = Round()
        v = None
        for _ in range(group["iterations"]):  # the half-sweeps of sr_sinkhorn_scales, for all matrices at once
            r = line_sums(blocks, rows, a, v)
            blocks.add_axis(rnd, r, rows)
            rnd.run()
            u = masked_reciprocal(r, line_length(blocks, rows))  # sinkhorn_scale with each row's length n
            c = line_sums(blocks, cols, a, u)
            blocks.add_axis(rnd, c, cols)
            rnd.run()
            v = masked_reciprocal(c, line_length(blocks, cols))
        lr = group["lr"] * group["lr_scale"]
        assert v is not None  # set by the first half-sweep (iterations >= 1)
        row = u.sqrt() if gate is None else u.sqrt().mul_(gate)  # a skipped step adds 0 x (finite) gradient
        scales = (row, v.sqrt()) if rows == 0 else (v.sqrt(), row)
        step.apply(blocks.scale(grads, scales[0], scales[1], out=a), lr, group["weight_decay"])  # A no longer needed

    def _sinkgd_row_blocks(self, group: dict, step: Any) -> None:
        """``_step_sinkgd`` where every row is whole on this rank, on a CPU (``row_passes``): each sweep is one
        read of ``G`` (the row sums, ``u`` and the column sums of a few rows at a time, in cache), the update one
        more; the same collectives (the row rounds have no split index: they register nothing)."""
        blocks, grads, gate = step.blocks, step.grads, self._step_gate
        n_of_row, m_of_col = blocks.row_length, blocks.col_length
        rnd = Round()
        v: torch.Tensor | None = None
        u: torch.Tensor | None = None
        for _ in range(group["iterations"]):
            _, u, c = row_block_pass(blocks, grads, [v], lambda r, rows: masked_reciprocal(r, n_of_row[rows]))
            assert c is not None
            blocks.add_axis(rnd, c, 1)
            rnd.run()
            v = masked_reciprocal(c, m_of_col)
        assert u is not None and v is not None  # iterations >= 1
        lr = group["lr"] * group["lr_scale"]
        row, col = u.sqrt_(), v.sqrt_()
        if gate is not None:
            row.mul_(gate)  # a skipped step adds 0 x (finite) gradient
        decay = step._decay(lr, group["weight_decay"]) if group["weight_decay"] else None
        if not step.apply_row_blocked(grads, row * lr, col, decay):  # else a parameter without fp32 or gradient
            step.apply(blocks.scale(grads, row, col), lr, group["weight_decay"])
