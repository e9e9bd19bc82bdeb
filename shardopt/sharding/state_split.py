"""Where whole-matrix optimizers' small state rests between steps: each rank keeps only its share.

A matrix's small state (a basis with one row per row of ``A``, ``r x cols`` moments, ``k x k`` statistics)
is declared by its optimizer as ``{key: (logical shape, split dim)}``. The split dimension is cut in
proportion to the rows of ``A`` each rank computes on (its ``RowPlan``):

* distributed strategy: the rows the engine gave the rank, so per-rank state follows the per-rank share of
  the parameters (a basis's rows are exactly the rank's rows of ``A``);
* gather strategy: the owner's plan holds every row, so the owner keeps all of the state and the other
  ranks nothing;
* not sharded (single process, DDP): the whole tensor.

0-d entries (counters, limiter norms) are kept on every rank (``split dim`` None). For a step,
``gather_full`` assembles the whole tensors of one bucket of distributed matrices on every rank of their
group (one ``all_gather`` per process group), the algorithm runs on them unchanged, and ``keep_share`` cuts
this rank's share back out, so the transient is one bucket, never the model.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from .blocks import RowPlan
from .comm import collective_counter

__all__ = ["StateSpec", "share", "share_shape", "share_numel", "gather_full", "keep_share", "StateShapeError",
           "as_sharded_tensor", "local_share"]

#: ``{key: (logical shape, split dim or None)}`` of one matrix's small state
StateSpec = dict[str, tuple[tuple[int, ...], "int | None"]]


class StateShapeError(RuntimeError):
    """A state tensor does not have the shape this rank's share should have (a per-rank state dict loaded at
    another world size, engine or strategy)."""


def share(plan: RowPlan, length: int, rank: int | None = None) -> tuple[int, int]:
    """``[lo, hi)`` of a dimension of ``length`` that ``rank`` (default: this rank) keeps."""
    rows = plan.a_shape[0]
    a0, a1 = plan.rows(rank)
    if rows == 0:  # a degenerate 0 x n matrix: rank 0 keeps its (empty-row) state
        return (0, length) if (plan.layout.rank if rank is None else rank) == 0 else (0, 0)
    return a0 * length // rows, a1 * length // rows


def share_shape(plan: RowPlan, shape: tuple[int, ...], dim: int | None, rank: int | None = None) -> tuple[int, ...]:
    """Shape of ``rank``'s share of a state tensor of logical ``shape`` split along ``dim``."""
    if dim is None:
        return tuple(shape)
    lo, hi = share(plan, shape[dim], rank)
    return tuple(hi - lo if d == dim else s for d, s in enumerate(shape))


def share_numel(plan: RowPlan, spec: StateSpec, rank: int | None = None) -> int:
    """Elements of one matrix's small state that ``rank`` keeps."""
    return sum(math.prod(share_shape(plan, shape, dim, rank)) for shape, dim in spec.values())


def keep_share(plan: RowPlan, full: torch.Tensor, dim: int | None) -> torch.Tensor:
    """This rank's share of a whole state tensor (the tensor itself when the share is all of it)."""
    if dim is None:
        return full
    lo, hi = share(plan, full.shape[dim])
    if lo == 0 and hi == full.shape[dim]:
        return full
    return full.narrow(dim, lo, hi - lo).clone()


def gather_full(entries: Sequence[tuple[RowPlan, torch.Tensor, tuple[int, ...], int, str]]) -> list[torch.Tensor]:
    """Whole tensors from every rank's share: ``entries[e] = (plan, local share, logical shape, dim, name)``.

    One ``all_gather`` per process group for all entries (shares padded to the largest rank's total). Every
    rank of a group must pass the same entries in the same order; a share of the wrong shape raises
    ``StateShapeError`` naming the matrix before any collective runs."""
    import torch.distributed as dist

    for plan, local, shape, dim, name in entries:
        want = share_shape(plan, shape, dim)
        if tuple(local.shape) != want:
            raise StateShapeError(
                f"optimizer state of {name!r} has shape {tuple(local.shape)} on this rank, but its share of the "
                f"{tuple(shape)} state is {want}: per-rank state dicts of whole-matrix optimizers load only at the "
                "same world size, engine and matrix_ops strategy; reshard with torch.distributed.checkpoint "
                "(get_state_dict / set_state_dict) or shardopt.checkpoint.save / load")
    out: list[torch.Tensor | None] = [None] * len(entries)
    by_group: dict[int, list[int]] = {}
    for e, (plan, *_rest) in enumerate(entries):
        by_group.setdefault(id(plan.layout.group), []).append(e)
    for idx in by_group.values():
        plan0 = entries[idx[0]][0]
        world = plan0.layout.world
        sizes = [[math.prod(share_shape(entries[e][0], entries[e][2], entries[e][3], r)) for e in idx]
                 for r in range(world)]
        width = max(sum(s) for s in sizes)
        local = entries[idx[0]][1]
        send = torch.zeros(width, dtype=local.dtype, device=local.device)
        pos = 0
        for e in idx:
            t = entries[e][1].reshape(-1)
            send[pos: pos + t.numel()] = t
            pos += t.numel()
        recv = [torch.empty_like(send) for _ in range(world)]
        collective_counter.record(send, "state")
        dist.all_gather(recv, send, group=plan0.layout.group)
        offsets = [0] * world
        for k, e in enumerate(idx):
            plan, _, shape, dim, _ = entries[e]
            full = torch.empty(shape, dtype=local.dtype, device=local.device)
            for r in range(world):
                part_shape = share_shape(plan, shape, dim, r)
                numel = sizes[r][k]
                if numel:
                    lo, hi = share(plan, shape[dim], r)
                    full.narrow(dim, lo, hi - lo).copy_(recv[r][offsets[r]: offsets[r] + numel].view(part_shape))
                offsets[r] += numel
            out[e] = full
    return out  # type: ignore[return-value]


def as_sharded_tensor(plan: RowPlan, local: torch.Tensor, shape: tuple[int, ...], dim: int) -> Any:
    """This rank's share as a ``ShardedTensor`` whose global metadata (every rank's share, from the static
    plan, no communication) lets ``torch.distributed.checkpoint`` write each share once and reshard on load."""
    import torch.distributed as dist
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    group = plan.layout.group
    shards, mine = [], []
    for r in range(plan.layout.world):
        lo, hi = share(plan, shape[dim], r)
        if hi <= lo or math.prod(shape) == 0:
            continue
        offsets = [lo if d == dim else 0 for d in range(len(shape))]
        sizes = list(share_shape(plan, shape, dim, r))
        device = local.device if r == plan.layout.rank else torch.device(local.device.type)
        md = ShardMetadata(offsets, sizes, f"rank:{dist.get_global_rank(group, r)}/{device}")
        shards.append(md)
        if r == plan.layout.rank:
            mine.append(Shard(local, md))
    props = TensorProperties(dtype=local.dtype, layout=torch.strided, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    meta = ShardedTensorMetadata(shards, torch.Size(shape), props)
    return ShardedTensor._init_from_local_shards_and_global_metadata(mine, meta, process_group=group)


def local_share(value: Any) -> Any:
    """A ``ShardedTensor`` (as loaded by DCP) -> this rank's share as a plain tensor (None where this rank
    keeps none of it); anything else unchanged."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if not isinstance(value, ShardedTensor):
        return value
    shards = value.local_shards()
    return shards[0].tensor if shards else None
