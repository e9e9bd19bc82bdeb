"""Layout discovery for real parameters: DTensor placements (FSDP2, ``distribute_tensor``) or a whole matrix.

Nothing is declared by hand: a DTensor parameter's mesh and placements say which rows or columns each rank
holds; any other tensor is whole on this process (single process, DDP, DeepSpeed stage 0).
"""
from __future__ import annotations

import torch

from ..sharding.layout import MatrixLayout

__all__ = ["layout_of", "matrix_shape"]


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The row-major 2-D view a parameter is described by: matrices as they are, a vector of k elements as
    ``(k, 1)``, higher ranks as ``(shape[0], rest)``. Row pieces of this view are element ranges of the tensor."""
    shape = tuple(int(s) for s in shape)
    if len(shape) == 2:
        return shape  # type: ignore[return-value]
    if len(shape) == 0:
        return (1, 1)
    rest = 1
    for s in shape[1:]:
        rest *= s
    return (shape[0], rest)


def layout_of(p: torch.Tensor) -> MatrixLayout:
    """The ``MatrixLayout`` of a (possibly DTensor) parameter on this rank, viewed as ``matrix_shape``."""
    shape = matrix_shape(tuple(p.shape))
    placements = getattr(p, "placements", None)
    if placements is None:
        return MatrixLayout.whole(shape)
    mesh = p.device_mesh
    shard_dims = [(i, pl) for i, pl in enumerate(placements) if pl.is_shard()]
    if not shard_dims:
        return MatrixLayout.whole(shape)
    if len(shard_dims) > 1:
        raise NotImplementedError(
            f"parameter of shape {shape} is sharded over {len(shard_dims)} mesh dimensions {placements}; "
            "shardopt supports one sharded mesh dimension (FSDP2 or HSDP: Replicate x Shard)"
        )
    mesh_dim, placement = shard_dims[0]
    group = mesh.get_group(mesh_dim)
    world = mesh.size(mesh_dim)
    rank = mesh.get_local_rank(mesh_dim)
    if placement.dim == 0:
        layout = MatrixLayout.row_chunks(shape, world, rank, group)
    elif placement.dim in (1, -1) and p.dim() == 2:
        layout = MatrixLayout.col_chunks(shape, world, rank, group)
    else:
        raise NotImplementedError(f"shard dim {placement.dim} of a parameter of shape {tuple(p.shape)} is not "
                                  "supported; shard dim 0 (any rank) or dim 1 of a matrix")
    local = p.to_local()
    if local.numel() != layout.local_numel:
        raise RuntimeError(
            f"DTensor local shard has {local.numel()} elements but torch.chunk layout predicts "
            f"{layout.local_numel} for shape {shape} on rank {rank}/{world}; padded local shards are not supported"
        )
    return layout
