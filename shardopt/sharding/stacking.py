"""Grouping matrices for batched kernels: which ones share a stack, and the stack itself.

Every batched step (``torch.bmm``, batched ``torch.linalg``) first splits its matrices by what a kernel can
share and stacks each part, and writes the results back into each matrix's own tensor; these are the helpers
every algorithm uses for it.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from .orientation import stored_transposed

__all__ = ["group_indices", "same_shape", "stack", "stack_stored", "unstack_into"]


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


def stack_stored(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``stack(tensors)`` in the memory order the matrices have: where every one is the transposed view of a
    row-major matrix (a block of ``A = G^T`` assembled as ``G``), their rows are stacked as stored and the stack
    is viewed transposed. Same values as ``torch.stack``; a plain copy instead of a transposing one (on a CPU
    about 8x slower per element), and the products that read the stack see the layout the single-process step
    reads (its ``G`` stacks viewed as ``A = G^T``)."""
    if len(tensors) > 1 and all(stored_transposed(t) for t in tensors):
        return torch.stack([t.mT for t in tensors]).mT
    return stack(tensors)


def unstack_into(stacked: torch.Tensor, outs: list[torch.Tensor]) -> None:
    """``outs[i].copy_(stacked[i])`` for every row of a stack. On a CPU one ``unbind_copy`` (no Python view per
    row); elsewhere one foreach copy, a single kernel: there ``unbind_copy`` issues a device-to-device memcpy
    per row (340 per SUMO step at 350M on an H200, each a host call)."""
    if stacked.device.type == "cpu":
        torch.unbind_copy(stacked, 0, out=outs)
    else:
        torch._foreach_copy_(outs, list(stacked.unbind(0)))
