"""The matrices of a step as items: a matrix's fragment, its stepped tensor, local gradient and state, and the
update that writes a rule's result back into the rank's piece of it (one matrix, or many with foreach kernels).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..sharding.fragment import Fragment
from ..sharding.layout import MatrixLayout
from ..sharding.primitives import scale_into
from .nonfinite import gated

__all__ = ["MatrixItem", "apply_items"]


class MatrixItem:
    """One matrix of a step: its fragment, the stepped tensor, fp32 local gradient and per-matrix state."""

    __slots__ = ("frag", "tensor", "grad", "state", "has_grad", "work")

    def __init__(self, frag: Fragment, tensor: torch.Tensor, grad: torch.Tensor, state: dict, has_grad: bool):
        self.frag = frag
        self.tensor = tensor
        self.grad = grad
        self.state = state
        self.has_grad = has_grad
        self.work: dict[str, Any] = {}

    @property
    def layout(self) -> MatrixLayout:
        return self.frag.layout

    def param(self) -> torch.Tensor:
        """This matrix's local elements of the stepped tensor (a writable view)."""
        return self.frag.local(self.tensor)

    def apply(self, update: torch.Tensor, lr: float | torch.Tensor, weight_decay: float = 0.0) -> None:
        """``W <- W * (1 - lr * wd) - lr * update`` on the local piece (skipped when the grad is missing)."""
        if not self.has_grad or self.frag.numel == 0:
            return
        w = self.param()
        if weight_decay:
            w.mul_(1 - lr * weight_decay)
        if isinstance(lr, torch.Tensor):
            if w.dtype == update.dtype:
                w.addcmul_(update, lr.to(w.dtype), value=-1)  # one pass, no scaled copy
            else:
                w.sub_((update * lr).to(w.dtype))
        else:
            w.add_(update.to(w.dtype), alpha=-lr)

    def apply_scaled(
        self,
        x: torch.Tensor,
        lr: float,
        weight_decay: float = 0.0,
        row_scale: torch.Tensor | None = None,
        col_scale: torch.Tensor | None = None,
    ) -> None:
        """``W <- W (1 - lr wd) - lr diag(row_scale) x diag(col_scale)`` without materializing the update: one
        fused multiply-add per block (a read of ``x`` and a read-write of ``W``) for fp32 parameters."""
        if not self.has_grad or self.frag.numel == 0:
            return
        w = self.param()
        if w.dtype != torch.float32 or (row_scale is not None and col_scale is not None):
            self.apply(scale_into(self.layout, torch.empty_like(x), x, row_scale, col_scale), lr, weight_decay)
            return
        if weight_decay:
            w.mul_(1 - lr * weight_decay)
        for (b, xb), (_, wb) in zip(self.layout.views(x), self.layout.views(w)):
            if row_scale is not None:
                wb.addcmul_(xb, row_scale[b.row : b.row + b.height, None], value=-lr)
            elif col_scale is not None:
                wb.addcmul_(xb, col_scale[None, b.col : b.col + b.width], value=-lr)
            else:
                wb.add_(xb, alpha=-lr)


def apply_items(
    items: Sequence[MatrixItem],
    updates: Sequence[torch.Tensor],
    lr: float | Sequence[float],
    weight_decay: float = 0.0,
    gate: torch.Tensor | None = None,
) -> None:
    """``MatrixItem.apply`` for many matrices at once: ``W <- W (1 - lr wd) - lr U`` with ``torch._foreach_*``
    kernels, one call per distinct ``lr`` (a float, or one per item: e.g. a shape-dependent lr) instead of one
    per matrix. Items without a gradient or without local elements are skipped, as ``apply`` does. An update is
    the item's 1-D local piece, or, for a plain tensor that is the whole matrix, may have the tensor's shape
    (then it is added to the tensor itself). ``gate`` (a step's skip decided on the device,
    ``nonfinite.gate_step``): the decay factor is 1 where it is 0; the updates are the caller's to zero."""
    lrs = [lr] * len(items) if isinstance(lr, (int, float)) else list(lr)
    by_lr: dict[float, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for it, u, r in zip(items, updates, lrs):
        if it.has_grad and it.frag.numel:
            views, ups = by_lr.setdefault(float(r), ([], []))
            t = it.tensor
            if u.dim() > 1 and u.shape == t.shape and it.frag.offset == 0 and not hasattr(t, "to_local"):
                w = t  # a tensor that is this whole matrix, updated by a same-shaped update: no flat view of it
            else:
                w = it.param()
                u = u.reshape(-1) if u.dim() > 1 else u
            views.append(w)
            ups.append(u if u.dtype == w.dtype else u.to(w.dtype))
    for r, (views, ups) in by_lr.items():
        if weight_decay:  # on a CPU a 0-d fp32 factor: as w.mul_(float) also for bf16 weights, and faster there
            factor: float | torch.Tensor = 1 - r * weight_decay
            if gate is not None:
                factor = gated(gate, factor, 1.0)
            torch._foreach_mul_(
                views, torch.tensor(factor) if views[0].device.type == "cpu" and gate is None else factor
            )
        torch._foreach_add_(views, ups, alpha=-r)
