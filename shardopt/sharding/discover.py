"""Layout discovery for real parameters: DTensor placements (FSDP2, ``distribute_tensor``) or a whole matrix.

Nothing is declared by hand: a DTensor parameter's mesh and placements say which rows or columns each rank
holds; any other tensor is whole on this process (single process, DDP, DeepSpeed stage 0).
"""
from __future__ import annotations

import torch

from .layout import MatrixLayout

__all__ = ["layout_of", "matrix_shape", "global_shape"]


def _megatron_tp(p: torch.Tensor):
    """(group, world, rank, partition_dim) for a Megatron tensor-parallel parameter, else None."""
    if not getattr(p, "tensor_model_parallel", False):
        return None
    from megatron.core import parallel_state as ps

    if getattr(p, "partition_stride", 1) != 1:
        raise NotImplementedError("Megatron parameters with partition_stride != 1 are not supported")
    return (ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_rank(), int(p.partition_dim))


def global_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The logical (unsharded) shape: DTensors report it; Megatron TP shards are scaled back up."""
    shape = list(p.shape)
    tp = _megatron_tp(p)
    if tp is not None:
        shape[tp[3]] *= tp[1]
    return tuple(shape)


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
    tp = _megatron_tp(p)
    if tp is not None:  # Megatron: column-parallel (dim 0) or row-parallel (dim 1) split of the TP group
        group, world, rank, dim = tp
        shape = matrix_shape(global_shape(p))
        if dim == 0:
            return MatrixLayout.row_chunks(shape, world, rank, group)
        if dim == 1 and p.dim() == 2:
            return MatrixLayout.col_chunks(shape, world, rank, group)
        raise NotImplementedError(f"Megatron partition_dim {dim} of a parameter of shape {tuple(p.shape)}")
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
