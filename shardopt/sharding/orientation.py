"""Orientation helpers for blocks of ``A = G`` or ``A = G^T`` (``shardopt.sharding.blocks``): products are
stored in the orientation of the block they pair with, so results map back to ``G``'s flat layout as views."""

from __future__ import annotations

import torch

__all__ = ["stored_transposed", "mm_like"]


def stored_transposed(a: torch.Tensor) -> bool:
    """Whether ``a`` is the transposed view of a row-major matrix (a block of ``A = G^T``)."""
    return a.dim() == 2 and not a.is_contiguous() and a.mT.is_contiguous()


def mm_like(like: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x @ y`` stored in the same orientation as ``like``: for a block of ``G^T`` the product is written as
    ``(y^T x^T)^T``, so later element-wise work with ``like`` runs on contiguous memory and the result maps
    back to ``G``'s flat layout as a view (no transposing copy of a full-size matrix)."""
    return (y.mT @ x.mT).mT if stored_transposed(like) else x @ y
