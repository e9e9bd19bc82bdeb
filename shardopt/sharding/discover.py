"""Layout discovery for real parameters: DTensor placements (FSDP2, tensor parallel, ``distribute_tensor``) or a
whole matrix.

Nothing is declared by hand: a DTensor parameter's mesh and placements say which block of the matrix each rank
holds; any other tensor is whole on this process (single process, DDP, DeepSpeed stage 0). On one sharded mesh
dimension (FSDP2, HSDP's shard dimension, tensor parallel alone) the blocks are ``torch.chunk`` rows or columns
over that dimension's group. On several (FSDP2 x TP, HSDP x TP: ``Shard`` / ``_StridedShard`` on more than one
dimension) the group is those dimensions flattened (``DeviceMesh._flatten``, row-major over them, as torchtitan
does), and each rank's block is what DTensor itself computes for its coordinate; ``Replicate`` dimensions hold
replicas, which reduce separately and identically (as HSDP's replicas), never double-counting.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence, cast

import torch

from . import staging
from .batched import box_fragments, split_flat
from .fragment import Fragment
from .layout import ColPiece, FlatPiece, MatrixLayout, RectPiece

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement

__all__ = [
    "layout_of",
    "matrix_shape",
    "global_shape",
    "shard_mesh",
    "complete_partial_grads",
    "align_grads",
    "check_grad_placements",
    "GradientPlacementError",
    "batched_fragments",
]


def _megatron_tp(p: torch.Tensor) -> tuple[Any, int, int, int] | None:
    """(group, world, rank, partition_dim) for a Megatron tensor-parallel parameter, else None."""
    if not getattr(p, "tensor_model_parallel", False):
        return None
    from megatron.core import parallel_state as ps

    if getattr(p, "partition_stride", 1) != 1:
        raise NotImplementedError("Megatron parameters with partition_stride != 1 are not supported")
    return (
        ps.get_tensor_model_parallel_group(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_rank(),
        int(p.partition_dim),  # type: ignore[attr-defined]  # Megatron's attribute on its TP parameters
    )


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
        return shape
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
    dt = cast("DTensor", p)  # only DTensors have placements
    mesh = dt.device_mesh
    shard_dims = [(i, pl) for i, pl in enumerate(placements) if _shards(pl)]
    if not shard_dims:
        return MatrixLayout.whole(shape)
    if len(shard_dims) > 1 or not pl_is_plain_shard(shard_dims[0][1]):
        return _mesh_layout(dt, shape, [i for i, _ in shard_dims])
    mesh_dim, placement = shard_dims[0]
    group = mesh.get_group(mesh_dim)
    world = mesh.size(mesh_dim)
    rank = mesh.get_local_rank(mesh_dim)
    if placement.dim == 0:
        layout = MatrixLayout.row_chunks(shape, world, rank, group)
    elif placement.dim in (1, -1) and p.dim() == 2:
        layout = MatrixLayout.col_chunks(shape, world, rank, group)
    else:
        raise NotImplementedError(
            f"shard dim {placement.dim} of a parameter of shape {tuple(p.shape)} is not "
            "supported; shard dim 0 (any rank) or dim 1 of a matrix"
        )
    local = dt.to_local()
    if local.numel() != layout.local_numel:
        raise RuntimeError(
            f"DTensor local shard has {local.numel()} elements but torch.chunk layout predicts "
            f"{layout.local_numel} for shape {shape} on rank {rank}/{world}; padded local shards are not supported"
        )
    return layout


def batched_fragments(
    p: torch.Tensor, name: str, resolver: Callable[[torch.Tensor], MatrixLayout] | None = None
) -> list[Fragment]:
    """One fragment per matrix of a batched ``(E, m, n)`` parameter (``sharding.batched``). A DTensor's pieces come
    from DTensor's own offsets for every coordinate of its sharded mesh dimensions (any ``Shard`` dims: experts,
    rows, columns, several at once); any other tensor's from ``resolver`` (default ``layout_of``: the whole tensor)."""
    shape = global_shape(p)
    placements = getattr(p, "placements", None)
    dims = [i for i, pl in enumerate(placements) if _shards(pl)] if placements is not None else []
    if not dims:
        layout = (resolver or layout_of)(p)
        return split_flat(Fragment(name, layout, 0, shape))
    dt = cast("DTensor", p)  # only DTensors have placements
    group, rank, boxes = _shard_boxes(dt, dims, repr(name))
    frags = box_fragments(name, shape, boxes, rank, group)
    if tuple(dt.to_local().shape) != tuple(boxes[rank][1]):
        raise RuntimeError(
            f"{name!r}: DTensor local shard has shape {tuple(dt.to_local().shape)} but its placements "
            f"{tuple(dt.placements)} give {boxes[rank][1]}; padded local shards are not supported"
        )
    return frags


class GradientPlacementError(RuntimeError):
    """A DTensor gradient that cannot be brought to its parameter's placements (another mesh or shape)."""


def _placements_str(t: DTensor) -> str:
    return "(" + ", ".join(str(pl) for pl in t.placements) + ")"


def check_grad_placements(params: Iterable[torch.Tensor], names: Mapping[int, str] | None = None) -> None:
    """Raise ``GradientPlacementError`` (the same on every rank: meshes, shapes and placements are static) for a
    DTensor gradient that ``align_grads`` cannot redistribute to its parameter's placements, before any collective."""
    from torch.distributed.tensor import DTensor

    for p in params:
        g = p.grad
        if g is None or not isinstance(g, DTensor) or not isinstance(p, DTensor):
            continue
        name = (names or {}).get(id(p), f"a parameter of shape {tuple(p.shape)}")
        if g.device_mesh != p.device_mesh or tuple(g.shape) != tuple(p.shape):
            raise GradientPlacementError(
                f"the gradient of {name!r} is a DTensor of shape {tuple(g.shape)} with placements "
                f"{_placements_str(g)} on mesh {g.device_mesh}, but the parameter has shape {tuple(p.shape)} and "
                f"placements {_placements_str(p)} on mesh {p.device_mesh}; shardopt reads a gradient's elements "
                "where the parameter's are, so the two must share mesh and shape: check the parallelize plan of "
                "this parameter's module"
            )


def align_grads(params: Sequence[torch.Tensor], names: Mapping[int, str] | None = None) -> None:
    """Every DTensor gradient brought to its parameter's placements before the optimizer reads its local values.

    Autograd may leave a gradient laid out otherwise than its parameter: partial sums (``Partial``: a
    sequence-parallel norm's weight, whose ranks each saw part of the sequence; a row-wise parallel embedding's
    weight) or whole on every rank (``Replicate``: the embedding of torchtitan's plan, whose weight is
    ``Shard(0)``). Reading such a local tensor as the rank's piece would read the wrong elements. Partial sums
    are completed first, one all-reduce per mesh dimension and dtype for all of them (``complete_partial_grads``);
    then a gradient whose placements still differ is redistributed to the parameter's (``Replicate`` to ``Shard``
    is a local slice). The schedule depends only on static placements, so every rank issues the same collectives;
    a gradient that cannot match its parameter raises ``GradientPlacementError`` on every rank first."""
    from torch.distributed.tensor import DTensor

    check_grad_placements(params, names)
    complete_partial_grads(params)
    for p in params:
        g = p.grad
        if g is None or not isinstance(g, DTensor) or not isinstance(p, DTensor):
            continue
        if tuple(g.placements) != tuple(p.placements):
            g = p.grad = g.redistribute(p.device_mesh, p.placements)
        if g.to_local().shape != p.to_local().shape:
            name = (names or {}).get(id(p), f"a parameter of shape {tuple(p.shape)}")
            raise GradientPlacementError(
                f"the gradient of {name!r} has local shape {tuple(g.to_local().shape)} with placements "
                f"{_placements_str(g)}, the parameter local shape {tuple(p.to_local().shape)} with "
                f"{_placements_str(p)}"
            )


def complete_partial_grads(params: Iterable[torch.Tensor]) -> None:
    """Gradients that DTensor leaves as partial sums made complete in place (``Partial`` -> ``Replicate`` on those
    mesh dimensions) before the optimizer reads their local values: one all-reduce per mesh dimension and dtype
    for all of them (the same on every rank: placements are static)."""
    from torch.distributed.tensor import DTensor, Replicate

    buckets: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        if g is None or not isinstance(g, DTensor):
            continue
        partial = tuple(i for i, pl in enumerate(g.placements) if pl.is_partial())
        if partial:
            for i in partial:
                op = getattr(g.placements[i], "reduce_op", "sum")
                if op not in ("sum", "avg"):
                    raise NotImplementedError(
                        f"a gradient with placement {g.placements[i]} (reduce op {op!r}) on "
                        f"mesh {g.device_mesh}; shardopt completes Partial(sum) and Partial(avg)"
                    )
            buckets.setdefault((id(g.device_mesh), partial, g.dtype), []).append(p)
    for (_, dims, _), ps in buckets.items():
        grads = [cast(DTensor, p.grad) for p in ps]  # the DTensor gradients bucketed above
        mesh = grads[0].device_mesh
        locals_ = [g.to_local() for g in grads]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        for i in dims:
            staging.all_reduce(flat, mesh.get_group(i))  # FSDP2 CPU offload on NCCL: through the device
            if getattr(grads[0].placements[i], "reduce_op", "sum") == "avg":
                flat /= mesh.size(i)
        pos = 0
        for p, g, t in zip(ps, grads, locals_):
            done = flat[pos : pos + t.numel()].view_as(t).clone()
            pos += t.numel()
            placements = [Replicate() if pl.is_partial() else pl for pl in g.placements]
            p.grad = DTensor.from_local(
                done, g.device_mesh, placements, run_check=False, shape=g.shape, stride=g.stride()
            )


def shard_mesh(p: torch.Tensor) -> tuple[DeviceMesh, int]:
    """``(mesh, mesh dim)`` whose group ``layout_of`` reduces a DTensor parameter's matrix over: its one sharded
    dimension, or the flattened mesh of several (FSDP2 x TP); where its small state's DTensors live."""
    dt = cast("DTensor", p)  # callers pass DTensor parameters
    dims = [i for i, pl in enumerate(dt.placements) if _shards(pl)]
    if len(dims) == 1 and pl_is_plain_shard(dt.placements[dims[0]]):
        return dt.device_mesh, dims[0]
    names = dt.device_mesh.mesh_dim_names
    assert names is not None, f"shard_mesh: {tuple(dt.placements)} over a mesh without dimension names"
    sub = dt.device_mesh[tuple(names[i] for i in dims)] if len(dims) > 1 else dt.device_mesh[names[dims[0]]]
    return (sub._flatten() if len(dims) > 1 else sub), 0


def _shards(pl: Placement) -> bool:
    """Whether a placement cuts the tensor: ``Shard`` and ``_StridedShard`` (which in torch 2.13 is not a
    ``Shard`` and answers ``is_shard()`` with False)."""
    return pl.is_shard() or type(pl).__name__ == "_StridedShard"


def pl_is_plain_shard(pl: Placement) -> bool:
    return pl.is_shard() and type(pl).__name__ == "Shard"


def _shard_boxes(p: DTensor, dims: list[int], what: str) -> tuple[Any, int, list[tuple[tuple, tuple]]]:
    """``(group, rank, boxes)`` of a DTensor sharded over the mesh dimensions ``dims``: the group is those dimensions
    (flattened, row-major, when several: FSDP2 x TP, HSDP x TP, ep x FSDP), and ``boxes[r]`` is ``(global offset,
    local shape)`` of the block group rank ``r`` holds, from DTensor's own offsets for its coordinate."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    mesh = p.device_mesh
    if len(dims) == 1:
        group, rank = mesh.get_group(dims[0]), mesh.get_local_rank(dims[0])
    elif mesh.mesh_dim_names is None:
        raise NotImplementedError(
            f"{what} of shape {tuple(p.shape)} is sharded over mesh dimensions {dims} {tuple(p.placements)} of a mesh "
            "without dimension names; name them (init_device_mesh(..., mesh_dim_names=...)) so that shardopt can "
            "reduce over the sharded dimensions together"
        )
    else:
        flat, _ = shard_mesh(p)
        group, rank = flat.get_group(), flat.get_local_rank()
    boxes = []
    for coords in itertools.product(*(range(mesh.size(i)) for i in dims)):  # row-major: the flattened order
        coordinate = [0] * mesh.ndim
        for i, c in zip(dims, coords):
            coordinate[i] = c
        extent, origin = _compute_local_shape_and_global_offset(tuple(p.shape), mesh.shape, coordinate, p.placements)
        boxes.append((tuple(origin), tuple(extent)))
    return group, rank, boxes


def _mesh_layout(p: DTensor, shape: tuple[int, int], dims: list[int]) -> MatrixLayout:
    """A DTensor sharded over the mesh dimensions ``dims`` (FSDP2 x TP, HSDP x TP, a strided shard): every rank's
    block of the ``shape`` view (``_shard_boxes``)."""
    placements = p.placements
    group, rank, boxes = _shard_boxes(p, dims, "a parameter")
    pieces = [_piece(tuple(p.shape), shape, extent, origin, placements) for origin, extent in boxes]
    layout = MatrixLayout(shape, pieces, rank, group)
    if p.to_local().numel() != layout.local_numel:
        raise RuntimeError(
            f"DTensor local shard has {p.to_local().numel()} elements but its placements "
            f"{tuple(placements)} give {layout.local_numel} for shape {tuple(p.shape)}"
        )
    return layout


def _piece(
    tensor_shape: tuple[int, ...],
    shape: tuple[int, int],
    local: tuple[int, ...],
    offset: tuple[int, ...],
    placements: Sequence[Placement],
) -> FlatPiece | ColPiece | RectPiece:
    """The piece of the ``shape`` (row-major 2-D) view that a block ``local`` at ``offset`` of the tensor is."""
    m, n = shape
    rows = (offset[0], offset[0] + local[0]) if local[0] else (0, 0)
    if len(tensor_shape) != 2:
        rest = 1
        for s, full in zip(local[1:], tensor_shape[1:]):
            if s != full:
                raise NotImplementedError(
                    f"a {len(tensor_shape)}-D parameter of shape {tensor_shape} sharded along a dimension other than "
                    f"the first ({tuple(placements)}) is not supported; shard it along dim 0"
                )
            rest *= s
        return FlatPiece(rows[0] * n, rows[1] * n)
    if local[1] == n:
        return FlatPiece(rows[0] * n, rows[1] * n)
    cols = (offset[1], offset[1] + local[1]) if local[1] else (0, 0)
    if local[0] == m:
        return ColPiece(*cols)
    return RectPiece(rows[0], rows[1], cols[0], cols[1])
