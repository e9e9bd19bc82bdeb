"""Exact sharded-matrix primitives on one rank's piece of a logical ``(m, n)`` matrix.

Each function takes a ``MatrixLayout`` and 1-D local tensors holding this rank's elements in layout order
(see ``MatrixLayout.views``). Sums return *partial* results over local elements, indexed globally
(a length-``m`` or length-``n`` vector, zero where this rank holds nothing); register them in a ``Round`` to
complete the split indices. Nothing here calls ``torch.distributed`` directly.
"""

from __future__ import annotations

import torch

from .comm import Round, on_device
from .layout import MatrixLayout

__all__ = [
    "scale_block",
    "row_sums",
    "col_sums",
    "col_sumsq",
    "stack_col_sumsq",
    "local_sum",
    "axis_sum",
    "scale_into",
    "masked_rsqrt",
    "masked_reciprocal",
]


def row_sums(
    layout: MatrixLayout, a: torch.Tensor, col_weight: torch.Tensor | None = None, square: bool = False
) -> torch.Tensor:
    """Partial ``sum_j a_ij * w_j`` for every row ``i`` (``w = 1`` when ``col_weight`` is None); with
    ``square`` the sums of ``a_ij^2`` (one read, no squared copy)."""
    out = a.new_zeros(layout.shape[0])
    for b, blk in layout.views(a):
        if square:
            part = torch.linalg.vector_norm(blk, dim=1).square()
        else:
            part = blk.sum(1) if col_weight is None else blk @ col_weight[b.col : b.col + b.width]
        out[b.row : b.row + b.height] += part
    return out


def col_sums(
    layout: MatrixLayout, a: torch.Tensor, row_weight: torch.Tensor | None = None, square: bool = False
) -> torch.Tensor:
    """Partial ``sum_i w_i * a_ij`` for every column ``j`` (``w = 1`` when ``row_weight`` is None); with
    ``square`` the sums of ``a_ij^2``."""
    out = a.new_zeros(layout.shape[1])
    for b, blk in layout.views(a):
        if square:
            part = col_sumsq(blk)
        else:
            part = blk.sum(0) if row_weight is None else row_weight[b.row : b.row + b.height] @ blk
        out[b.col : b.col + b.width] += part
    return out


def col_sumsq(blk: torch.Tensor, chunk_elements: int = 1 << 21) -> torch.Tensor:
    """Column sums of squares of a block: for a transposed view, contiguous row norms of its storage;
    for a row-major block, the squares of a few rows at a time (``chunk_elements``: 8 MiB of fp32, read again from
    the last-level cache; one buffer, no full squared copy) summed by a matrix-vector product (a strided reduction
    over dim 0 is several times slower on CPUs). Blocks of 256 rows (1 MiB at width 1024) made the LM embedding's
    sums 125 small parallel ops, each waiting for a descheduled thread on a loaded 2-core machine."""
    if blk.dim() == 2 and not blk.is_contiguous() and blk.mT.is_contiguous():
        return torch.linalg.vector_norm(blk.mT, dim=1).square()
    out = blk.new_zeros(blk.shape[1])
    rows = min(max(1, chunk_elements // max(blk.shape[1], 1)), blk.shape[0])
    ones = blk.new_ones(rows)
    buf = blk.new_empty(rows, blk.shape[1])
    for r in range(0, blk.shape[0], rows):
        chunk = blk[r : r + rows]
        k = chunk.shape[0]
        out.addmv_(torch.mul(chunk, chunk, out=buf[:k]).T, ones[:k])
    return out


def stack_col_sumsq(x: torch.Tensor) -> torch.Tensor:
    """Column sums of squares of a ``(..., rows, cols)`` stack. On CUDA one reduction reads ``x`` once (the squared
    column norms; a squared copy and its sum move three times the bytes); on a CPU the strided reduction over rows
    ran 1.3-10x slower than squaring and summing (torch 2.13, stacks of 64 x 64 to 512 x 1376), so it keeps that."""
    if x.is_cuda:
        return torch.linalg.vector_norm(x, dim=-2).square_()
    return x.square().sum(-2)


def local_sum(a: torch.Tensor) -> torch.Tensor:
    """Partial sum of all local elements as a 0-d fp32 tensor (each element lives on exactly one rank)."""
    return a.sum(dtype=torch.float32) if a.numel() else a.new_zeros((), dtype=torch.float32)


def axis_sum(layout: MatrixLayout, values: torch.Tensor, axis: int, rnd: Round) -> torch.Tensor:
    """Global ``sum_i values_i`` of a completed per-row/per-column vector, each index counted once.

    If the axis is replicated after its reduction the sum is local; otherwise each rank sums the indices it
    owns and the scalar joins ``rnd`` (read the result after ``rnd.run()``).
    """
    plan = layout.axis_plan(axis)
    if plan.replicated:
        return values.sum()
    if isinstance(plan.owned, torch.Tensor):  # masked sum: no data-dependent indexing, no host sync
        total = torch.where(on_device(plan.owned, values.device), values, torch.zeros_like(values)).sum()
    else:
        total = values[plan.owned].sum()
    rnd.add_sum(layout, total)
    return total


def scale_block(
    x: torch.Tensor, out: torch.Tensor, row_scale: torch.Tensor | None, col_scale: torch.Tensor | None
) -> None:
    """``out = (x * row_scale) * col_scale`` with broadcastable line scales (either may be None; ``out`` may
    alias ``x``): the one kernel sequence behind ``scale_into`` and the grouped steps, so both round alike."""
    if row_scale is not None and col_scale is not None:
        torch.mul(x, row_scale, out=out)
        out.mul_(col_scale)
    elif row_scale is not None:
        torch.mul(x, row_scale, out=out)
    elif col_scale is not None:
        torch.mul(x, col_scale, out=out)
    elif out.data_ptr() != x.data_ptr():
        out.copy_(x)


def scale_into(
    layout: MatrixLayout,
    out: torch.Tensor,
    x: torch.Tensor,
    row_scale: torch.Tensor | None = None,
    col_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out = diag(row_scale) @ x @ diag(col_scale)`` on the local piece (``out`` may alias ``x``)."""
    for (b, xb), (_, ob) in zip(layout.views(x), layout.views(out)):
        scale_block(
            xb,
            ob,
            None if row_scale is None else row_scale[b.row : b.row + b.height, None],
            None if col_scale is None else col_scale[None, b.col : b.col + b.width],
        )
    return out


def masked_reciprocal(x: torch.Tensor, numerator: float | torch.Tensor = 1.0) -> torch.Tensor:
    """``numerator / x`` where ``x > 0``, else 0: zero statistics give zero updates, never NaN or inf
    (``numerator`` a number or a tensor shaped like ``x``)."""
    # the lanes where x <= 0 compute inf or NaN and are never selected: no masked copy of x, no zeros tensor
    inv = x.reciprocal() if isinstance(numerator, float) and numerator == 1.0 else numerator / x
    return torch.where(x > 0, inv, 0.0)


def masked_rsqrt(x: torch.Tensor, numerator: float = 1.0, out: torch.Tensor | None = None) -> torch.Tensor:
    """``numerator / sqrt(x)`` where ``x > 0``, else 0 (written into ``out`` when given)."""
    root = torch.rsqrt(x)  # NaN or inf where x <= 0, never selected
    if numerator != 1.0:
        root.mul_(numerator)
    return torch.where(x > 0, root, 0.0) if out is None else torch.where(x > 0, root, root.new_zeros(()), out=out)
