"""A matrix's piece inside one tensor that an optimizer steps.

Engines hand the optimizer either real parameters (one matrix each, possibly a DTensor shard) or flat
partitions that concatenate many matrices (DeepSpeed ZeRO). A ``Fragment`` names one matrix, its global
layout, and where its local elements sit inside the stepped tensor, so algorithms never ask which engine
they run under.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import MatrixLayout

__all__ = ["Fragment", "local_flat", "local_tensor"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or the tensor itself (any strides)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def local_flat(t: torch.Tensor) -> torch.Tensor:
    """This rank's elements of ``t`` as a 1-D view (a DTensor's local shard, or the tensor itself)."""
    local = local_tensor(t)
    if not local.is_contiguous():
        raise RuntimeError(
            f"shardopt needs a flat view of this tensor's local elements, but it is a non-contiguous "
            f"view (shape {tuple(local.shape)}, strides {local.stride()}); optimizer.step() handles "
            "such parameters, elsewhere pass t.contiguous()"
        )
    return local.view(-1)


@dataclass(frozen=True, eq=False)
class Fragment:
    """Matrix ``name`` with global ``layout``; its local piece is ``[offset, offset + numel)`` of the stepped
    tensor's local elements (``numel`` equals ``layout.local_numel``; 0 when this rank holds none of it)."""

    name: str
    layout: MatrixLayout
    offset: int = 0
    shape: tuple[int, ...] | None = None  # the parameter's logical shape (default: the layout's 2-D view)
    #: for one matrix of a batched parameter (fused MoE experts, ``sharding.batched``): its index in the batch
    index: int | None = None
    #: the parameter this fragment is part of, when it is one matrix of a batched one (default: ``name``)
    param_name: str | None = None

    @property
    def param(self) -> str:
        """The name of the parameter this matrix belongs to (routing and param groups know parameters)."""
        return self.param_name if self.param_name is not None else self.name

    @property
    def logical_shape(self) -> tuple[int, ...]:
        return tuple(self.shape) if self.shape is not None else self.layout.shape

    @property
    def numel(self) -> int:
        return self.layout.local_numel

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This fragment's elements of ``t`` (a tensor shaped like the stepped tensor) as a 1-D view."""
        flat = local_flat(t)
        if self.offset == 0 and self.numel == flat.numel():
            return flat  # the whole tensor: no second view (a step asks for every matrix's piece)
        return flat[self.offset : self.offset + self.numel]
