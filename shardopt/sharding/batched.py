"""Batched matrix parameters: a 3-D ``(E, m, n)`` tensor that is ``E`` separate ``m x n`` matrices.

Mixture-of-experts models store their experts fused: transformers 5 (``MixtralExperts``, ``Qwen3MoeExperts``,
...) applies expert ``e`` as ``F.linear(x, W[e])`` and torchtitan's ``GroupedExperts`` runs grouped GEMMs over the
same layout. Each slice ``W[e]`` is a matrix of its own: every rule gives it exactly what it gives a separate
``m x n`` weight. Here a batched parameter becomes one ``Fragment`` per slice, named ``<param>[e]``, whose layout
says which piece of *that* matrix each rank holds, so statistics reduce only over the ranks that hold pieces of the
same expert and everything downstream (rules, owners, state, checkpoints) sees ordinary matrices.

Slice ``e`` occupies elements ``[e m n, (e + 1) m n)`` of the parameter's row-major flattening, so two kinds of
engine layout map onto slices without any engine knowledge:

* element ranges of the flattened parameter (whole tensors, DeepSpeed ZeRO flat partitions, FSDP2 ``Shard(0)``
  rows of its ``(E, m n)`` view): ``split_flat`` intersects them with each slice's range;
* N-D boxes (a DTensor sharded along any dimensions: experts over an ``ep`` mesh dimension, ``Shard(1)`` /
  ``Shard(2)`` inside the experts, both): ``box_fragments`` cuts each rank's box into per-slice rectangles.
"""

from __future__ import annotations

from typing import Any, Sequence

from .fragment import Fragment
from .layout import ColPiece, FlatPiece, MatrixLayout, RectPiece

__all__ = ["matrix_name", "split_flat", "box_fragments", "BATCHED_NDIM"]

#: the number of dimensions of a batched matrix parameter (the batch, then the rows and columns of each matrix)
BATCHED_NDIM = 3


def matrix_name(param: str, index: int) -> str:
    """The name of slice ``index`` of batched parameter ``param``: keys its state, seeded draws and checkpoints."""
    return f"{param}[{index}]"


def split_flat(frag: Fragment) -> list[Fragment]:
    """One fragment per slice of a batched parameter's fragment ``frag`` whose layout is element ranges
    (``FlatPiece``) of the parameter's row-major flattening (whole, ZeRO flat partitions, rows of dim 0)."""
    shape = frag.logical_shape
    if len(shape) != BATCHED_NDIM:
        raise ValueError(f"{frag.name!r}: a batched matrix parameter is 3-D (experts, rows, columns), got {shape}")
    count, m, n = (int(s) for s in shape)
    lay = frag.layout
    flats = [p for p in lay.pieces if isinstance(p, FlatPiece)]
    if len(flats) != len(lay.pieces):
        raise NotImplementedError(
            f"{frag.name!r} of shape {shape}: its layout cuts the parameter other than into element ranges "
            f"({lay.pieces[lay.rank]}); shardopt splits such a batched parameter into matrices from DTensor "
            "placements or flat partitions only"
        )
    size = m * n
    mine = flats[lay.rank]
    out = []
    for e in range(count):
        base = e * size
        pieces = [FlatPiece(min(max(p.lo - base, 0), size), min(max(p.hi - base, 0), size)) for p in flats]
        here = pieces[lay.rank]
        offset = frag.offset + max(mine.lo, base) - mine.lo if here.numel else 0
        out.append(
            Fragment(
                matrix_name(frag.name, e),
                MatrixLayout((m, n), pieces, lay.rank, lay.group),
                offset,
                (m, n),
                index=e,
                param_name=frag.name,
            )
        )
    return out


def _slice_piece(
    origin: Sequence[int], extent: Sequence[int], e: int, m: int, n: int
) -> FlatPiece | ColPiece | RectPiece:
    """The piece of slice ``e`` inside a box at ``origin`` of size ``extent`` (empty when the box misses it)."""
    if not all(extent) or not origin[0] <= e < origin[0] + extent[0]:
        return FlatPiece(0, 0)
    r0, r1, c0, c1 = origin[1], origin[1] + extent[1], origin[2], origin[2] + extent[2]
    if c0 == 0 and c1 == n:
        return FlatPiece(r0 * n, r1 * n)
    if r0 == 0 and r1 == m:
        return ColPiece(c0, c1)
    return RectPiece(r0, r1, c0, c1)


def box_fragments(
    name: str, shape: Sequence[int], boxes: Sequence[tuple[Sequence[int], Sequence[int]]], rank: int, group: Any = None
) -> list[Fragment]:
    """One fragment per slice of batched parameter ``name`` (global ``shape``) when rank ``r`` of ``group`` holds
    the contiguous box ``boxes[r] = (origin, extent)`` of it (a DTensor's local shard and its global offset)."""
    count, m, n = (int(s) for s in shape)
    origin, extent = boxes[rank]
    per_slice = int(extent[1]) * int(extent[2])
    out = []
    for e in range(count):
        pieces = [_slice_piece(o, x, e, m, n) for o, x in boxes]
        held = all(extent) and origin[0] <= e < origin[0] + extent[0]
        offset = (e - origin[0]) * per_slice if held else 0
        out.append(
            Fragment(
                matrix_name(name, e),
                MatrixLayout((m, n), pieces, rank, group),
                offset,
                (m, n),
                index=e,
                param_name=name,
            )
        )
    return out
