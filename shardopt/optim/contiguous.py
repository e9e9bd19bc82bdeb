"""Stepping parameters that are non-contiguous views (a transposed weight, a strided slice).

Every rule works on a tensor's local elements as one flat, row-major view (``local_flat``), which a strided
tensor does not have. For the length of a step such a parameter's ``.data`` is swapped for a contiguous copy
(and a strided gradient for a contiguous one); afterwards the result is copied back into the original storage
and the original view and gradient are restored. The update is the one the contiguous tensor gets, bit for
bit, and the user's tensor keeps its strides, its storage and every alias of it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator

import torch

__all__ = ["contiguous_steps"]


def _plain(t: torch.Tensor) -> bool:
    """A tensor whose elements live here (not a DTensor, whose local shards are contiguous)."""
    return not hasattr(t, "to_local")


@contextmanager
def contiguous_steps(params: Iterable[torch.Tensor]) -> Iterator[None]:
    """Make every plain parameter and gradient in ``params`` contiguous for the duration of the block."""
    swapped: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
    seen: set[int] = set()
    # the common case, every tensor contiguous, in one pass without per-tensor calls into this module
    params = [
        p
        for p in params
        if not hasattr(p, "to_local") and (not p.is_contiguous() or (p.grad is not None and not p.grad.is_contiguous()))
    ]
    for p in params:
        if id(p) in seen or not _plain(p):
            continue
        seen.add(id(p))
        view = p.data if not p.is_contiguous() else None
        grad = p.grad if p.grad is not None and _plain(p.grad) and not p.grad.is_contiguous() else None
        if view is None and grad is None:
            continue
        if view is not None:
            p.data = view.contiguous()
        if grad is not None:
            p.grad = grad.contiguous()
        swapped.append((p, view, grad))
    try:
        yield
    finally:
        for p, view, grad in reversed(swapped):
            if view is not None:
                view.copy_(p.data)
                p.data = view
            if grad is not None:
                p.grad = grad
