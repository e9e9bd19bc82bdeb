"""Grouping matrices for batched kernels: which ones share a stack, and the stack itself.

Every batched step (``torch.bmm``, batched ``torch.linalg``) first splits its matrices by what a kernel can
share and stacks each part; these are the two helpers every algorithm uses for it.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

__all__ = ["group_indices", "same_shape", "stack"]


def group_indices(idx: Iterable[int], key: Callable[[int], Any]) -> list[list[int]]:
    """``idx`` split by ``key(i)``, in first-seen order (each part computed as one stack)."""
    out: dict[Any, list[int]] = {}
    for i in idx:
        out.setdefault(key(i), []).append(i)
    return list(out.values())


def same_shape(mats: dict[int, torch.Tensor]) -> list[list[int]]:
    """The keys of ``mats`` grouped by shape, dtype and device: the tensors one stack can hold."""
    return group_indices(mats, lambda i: (tuple(mats[i].shape), mats[i].dtype, mats[i].device))


def stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(tensors)``; one tensor: a ``(1, ...)`` view of it (no copy; in-place ops reach it)."""
    return tensors[0].unsqueeze(0) if len(tensors) == 1 else torch.stack(tensors)
