"""Which piece of a logical m x n matrix each rank holds.

A matrix is always viewed in row-major (PyTorch ``(out, in)``) order. Every engine layout is one of two
piece kinds, given for every rank of the process group that shards the matrix:

* ``FlatPiece(lo, hi)``: elements ``[lo, hi)`` of the row-major flattening. This covers a whole matrix
  (``[0, m*n)`` on a group of one: single process, DDP), FSDP2 ``Shard(0)`` row blocks
  (``[r0*n, r1*n)``, possibly empty) and DeepSpeed ZeRO flat partitions, which may start and end mid-row
  and may be shorter than one row.
* ``ColPiece(c0, c1)``: columns ``[c0, c1)`` of every row (FSDP2 ``Shard(1)``), stored as a contiguous
  ``(m, c1 - c0)`` block.
* ``RectPiece(r0, r1, c0, c1)``: rows ``[r0, r1)`` x columns ``[c0, c1)``, stored as a contiguous block: a DTensor
  sharded over two mesh dimensions (FSDP2 x tensor parallel: ``Shard(0)`` x ``Shard(1)``).
* ``ColFlatPiece(c0, c1, lo, hi)``: elements ``[lo, hi)`` of the row-major flattening of the ``(m, c1 - c0)`` column
  block ``[c0, c1)``: a flat partition of a tensor-parallel column shard (Megatron's DistributedOptimizer cutting a
  ``RowParallelLinear`` weight's shard anywhere).

From the pieces of *all* ranks the layout derives, statically and identically on every rank, which row and
column indices are split between ranks. Only split indices of a statistic ever cross the network; that is
what keeps results exact (no shard is normalized as if it were the matrix) and traffic small.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterator, NamedTuple, Sequence

import torch

__all__ = [
    "FlatPiece",
    "ColPiece",
    "RectPiece",
    "ColFlatPiece",
    "Block",
    "MatrixLayout",
    "AxisPlan",
    "piece_numel",
    "put_piece",
    "take_piece",
]


@dataclass(frozen=True)
class FlatPiece:
    """Elements ``[lo, hi)`` of the row-major flattened matrix."""

    lo: int
    hi: int

    @property
    def numel(self) -> int:
        return max(self.hi - self.lo, 0)


@dataclass(frozen=True)
class ColPiece:
    """Columns ``[c0, c1)`` of every row, stored row-major as an ``(m, c1 - c0)`` block."""

    c0: int
    c1: int


@dataclass(frozen=True)
class RectPiece:
    """Rows ``[r0, r1)`` x columns ``[c0, c1)``, stored row-major as an ``(r1 - r0, c1 - c0)`` block."""

    r0: int
    r1: int
    c0: int
    c1: int

    @property
    def numel(self) -> int:
        return max(self.r1 - self.r0, 0) * max(self.c1 - self.c0, 0)


@dataclass(frozen=True)
class ColFlatPiece:
    """Elements ``[lo, hi)`` of the row-major flattening of columns ``[c0, c1)`` (an ``(m, c1 - c0)`` block)."""

    c0: int
    c1: int
    lo: int
    hi: int

    @property
    def numel(self) -> int:
        return max(self.hi - self.lo, 0)


Piece = FlatPiece | ColPiece | RectPiece | ColFlatPiece


class Block(NamedTuple):
    """A rectangle of the matrix held contiguously in local storage.

    Rows ``[row, row + height)`` x columns ``[col, col + width)``, starting at ``offset`` of the local 1-D
    piece with row stride ``width``. A flat piece is at most three blocks: a partial head row, full rows,
    a partial tail row.
    """

    row: int
    col: int
    height: int
    width: int
    offset: int


class AxisPlan(NamedTuple):
    """How one axis (0 = per-row statistics, 1 = per-column statistics) of a matrix is reduced.

    ``split``: indices whose partial sums live on more than one rank and must be all-reduced (``None``: no
    index is split; ``slice(None)``: all are). ``owned``: mask of the indices whose (final) value this rank
    counts in a global sum over the axis; every index is owned by exactly one rank. ``replicated``: after
    the reduction every rank holds every index, so global sums over the axis need no communication.
    """

    split: torch.Tensor | slice | None
    owned: torch.Tensor | slice
    replicated: bool


def piece_numel(p: Piece, m: int) -> int:
    """Elements of piece ``p`` of a matrix with ``m`` rows."""
    if isinstance(p, ColPiece):
        return max(p.c1 - p.c0, 0) * m
    return p.numel


def _blocks_of(piece: Piece, m: int, n: int) -> tuple[Block, ...]:
    if isinstance(piece, RectPiece):
        h, w = piece.r1 - piece.r0, piece.c1 - piece.c0
        return (Block(piece.r0, piece.c0, h, w, 0),) if h > 0 and w > 0 else ()
    if isinstance(piece, ColPiece):
        w = piece.c1 - piece.c0
        return (Block(0, piece.c0, m, w, 0),) if w > 0 and m > 0 else ()
    if isinstance(piece, ColFlatPiece):
        return tuple(
            b._replace(col=b.col + piece.c0)
            for b in _blocks_of(FlatPiece(piece.lo, piece.hi), m, max(piece.c1 - piece.c0, 0))
        )
    lo, hi = piece.lo, piece.hi
    if hi <= lo or n == 0:
        return ()
    r0, c0 = divmod(lo, n)
    r1, c1 = divmod(hi, n)
    if r0 == r1:  # inside a single row
        return (Block(r0, c0, 1, c1 - c0, 0),)
    blocks: list[Block] = []
    offset = 0
    if c0 > 0:
        blocks.append(Block(r0, c0, 1, n - c0, 0))
        offset = n - c0
        r0 += 1
    if r1 > r0:
        blocks.append(Block(r0, 0, r1 - r0, n, offset))
        offset += (r1 - r0) * n
    if c1 > 0:
        blocks.append(Block(r1, 0, 1, c1, offset))
    return tuple(blocks)


def put_piece(
    out: torch.Tensor, piece: Piece, data: torch.Tensor, shape: tuple[int, int], origin: tuple[int, int] = (0, 0)
) -> None:
    """Write ``piece`` of an ``shape`` matrix, held 1-D in ``data``, into the 2-D ``out``: the matrix seen from
    ``origin`` (its element ``origin`` is ``out[0, 0]``: a tensor-parallel shard of it, or the whole matrix)."""
    r0, c0 = origin
    for b in _blocks_of(piece, *shape):
        out[b.row - r0 : b.row - r0 + b.height, b.col - c0 : b.col - c0 + b.width] = data[
            b.offset : b.offset + b.height * b.width
        ].view(b.height, b.width)


def take_piece(
    src: torch.Tensor, piece: Piece, out: torch.Tensor, shape: tuple[int, int], origin: tuple[int, int] = (0, 0)
) -> None:
    """Read ``piece`` of an ``shape`` matrix from the 2-D ``src`` (the matrix seen from ``origin``) into 1-D ``out``."""
    r0, c0 = origin
    for b in _blocks_of(piece, *shape):
        out[b.offset : b.offset + b.height * b.width].view(b.height, b.width).copy_(
            src[b.row - r0 : b.row - r0 + b.height, b.col - c0 : b.col - c0 + b.width]
        )


class MatrixLayout:
    """The global partition of one logical ``(m, n)`` matrix over a process group.

    ``pieces[r]`` is what group rank ``r`` holds; ``rank`` is this process's index; ``group`` the process
    group (``None`` for a group of one). Everything derived here depends only on ``(shape, pieces)``, so
    every rank derives the same plan and issues the same collectives.
    """

    def __init__(self, shape: Sequence[int], pieces: Sequence[Piece], rank: int = 0, group: Any = None):
        m, n = (int(s) for s in shape)
        self.shape = (m, n)
        self.pieces = tuple(pieces)
        if not 0 <= rank < len(self.pieces):
            raise ValueError(f"rank {rank} outside the {len(self.pieces)} pieces of a {m}x{n} matrix")
        self.rank = rank
        self.group = group if len(self.pieces) > 1 else None
        total = sum(piece_numel(p, m) for p in self.pieces)
        if total != m * n:
            raise ValueError(f"pieces of a {m}x{n} matrix cover {total} elements, expected {m * n}")

    @classmethod
    def whole(cls, shape: Sequence[int]) -> "MatrixLayout":
        """The matrix held entirely by this process (single process, DDP replicas)."""
        m, n = shape
        return cls(shape, [FlatPiece(0, m * n)])

    @classmethod
    def row_chunks(cls, shape: Sequence[int], world: int, rank: int, group: Any = None) -> "MatrixLayout":
        """``torch.chunk`` row blocks, as FSDP2 ``Shard(0)``: ``ceil(m / world)`` rows, last ones short or empty."""
        m, n = shape
        c = -(-m // world) if m else 0
        pieces = [FlatPiece(min(r * c, m) * n, min((r + 1) * c, m) * n) for r in range(world)]
        return cls(shape, pieces, rank, group)

    @classmethod
    def col_chunks(cls, shape: Sequence[int], world: int, rank: int, group: Any = None) -> "MatrixLayout":
        """``torch.chunk`` column blocks, as FSDP2 ``Shard(1)``."""
        m, n = shape
        c = -(-n // world) if n else 0
        pieces = [ColPiece(min(r * c, n), min((r + 1) * c, n)) for r in range(world)]
        return cls(shape, pieces, rank, group)

    # ------------------------------------------------------------------ geometry
    def _piece_numel(self, p: Piece) -> int:
        return piece_numel(p, self.shape[0])

    @property
    def world(self) -> int:
        return len(self.pieces)

    @cached_property
    def local_numel(self) -> int:
        return self._piece_numel(self.pieces[self.rank])

    @cached_property
    def blocks(self) -> tuple[Block, ...]:
        return _blocks_of(self.pieces[self.rank], *self.shape)

    @cached_property
    def all_blocks(self) -> tuple[tuple[Block, ...], ...]:
        """The blocks of every rank's piece (static, computed once per layout)."""
        m, n = self.shape
        return tuple(_blocks_of(p, m, n) for p in self.pieces)

    def views(self, local: torch.Tensor) -> Iterator[tuple[Block, torch.Tensor]]:
        """Yield ``(block, 2-D view)`` for each block of this rank's 1-D local piece ``local``."""
        for b in self.blocks:
            yield b, local[b.offset : b.offset + b.height * b.width].view(b.height, b.width)

    @cached_property
    def holders(self) -> int:
        """Number of ranks holding at least one element."""
        m = self.shape[0]
        return sum(1 for p in self.pieces if piece_numel(p, m) > 0)

    # ------------------------------------------------------------------ reduction plan
    def _touch_counts(self, axis: int) -> torch.Tensor:
        """How many ranks' blocks cover each row (axis 0) or column (axis 1): a difference array filled in
        Python (one entry per block edge) and summed once, O(blocks + size)."""
        size = self.shape[axis]
        diff = [0] * (size + 1)
        for blocks in self.all_blocks:
            for b in blocks:
                start, length = (b.row, b.height) if axis == 0 else (b.col, b.width)
                diff[start] += 1
                diff[start + length] -= 1
        return torch.tensor(diff, dtype=torch.int64).cumsum(0)[:size]

    def _touched_by_me(self, axis: int) -> torch.Tensor:
        size = self.shape[axis]
        mask = torch.zeros(size, dtype=torch.bool)
        for b in self.blocks:
            if axis == 0:
                mask[b.row : b.row + b.height] = True
            else:
                mask[b.col : b.col + b.width] = True
        return mask

    def axis_plan(self, axis: int) -> AxisPlan:
        """The static reduction plan of per-row (axis 0) or per-column (axis 1) statistics."""
        cache = self.__dict__.setdefault("_axis_plans", {})
        if axis not in cache:
            cache[axis] = self._make_axis_plan(axis)
        return cache[axis]

    def _make_axis_plan(self, axis: int) -> AxisPlan:
        size = self.shape[axis]
        if self.world == 1:
            return AxisPlan(None, slice(None), True)
        counts = self._touch_counts(axis)
        split_mask = counts >= 2
        n_split = int(split_mask.sum())
        mine = self._touched_by_me(axis)
        if n_split == size:
            # Every index is reduced over the group: all ranks end up with the whole vector.
            owned = slice(None) if self.rank == 0 else torch.zeros(size, dtype=torch.bool)
            return AxisPlan(slice(None), owned, True)
        owned = (mine & ~split_mask) | (split_mask if self.rank == 0 else torch.zeros_like(split_mask))
        split = split_mask.nonzero().flatten() if n_split else None
        return AxisPlan(split, owned, False)
