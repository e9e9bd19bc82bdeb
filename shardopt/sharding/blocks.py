"""Row blocks: move each matrix's pieces so that every rank holds whole rows of it (or of its transpose).

Whole-matrix algorithms are written once against an oriented matrix ``A`` (``G`` or ``G^T``) whose rows are
spread over the ranks of the group: rank ``p`` holds rows ``[starts[p], starts[p+1])`` of ``A`` as a dense
2-D block. Sums over the rows of ``A`` (Gram matrices ``A^T A``, projections ``Q^T A``, column energies) are
then partial sums reduced over the group, and everything else is row-local. A ``RowPlan`` says which rows
each rank gets; the plans come in three kinds:

* ``aligned`` (distributed strategy): rows stay where the engine put them as far as possible. For ``A = G``
  on row-like layouts (FSDP2 ``Shard(0)``, ZeRO flat ranges) every row goes to the rank that holds most of
  it, so only rows cut by a partition boundary move (O(P n) elements, never the matrix); the same for
  ``A = G^T`` on column layouts (``Shard(1)``). Across the grain (``A = G^T`` on rows, ``A = G`` on columns)
  the rows of ``A`` are split in even chunks: an all-to-all moving about 1/P of the matrix per rank.
* ``owner`` (gather strategy): one rank holds every row, the others none.
* ``local``: the matrix is not sharded (single process, DDP); nothing moves.

``to_blocks`` moves the pieces of every matrix of a process group with one ``all_to_all_single`` (skipped
when the static plans move nothing); ``from_blocks`` returns block-shaped results to the engine's pieces the
same way. Elements a rank keeps are copied locally and never cross the network.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Sequence

import torch

from .comm import collective_counter
from .layout import Block, ColPiece, MatrixLayout, _blocks_of

__all__ = ["RowPlan", "to_blocks", "from_blocks"]


def _even_starts(rows: int, world: int) -> tuple[int, ...]:
    c = -(-rows // world) if rows else 0
    return tuple(min(p * c, rows) for p in range(world)) + (rows,)


@dataclass(frozen=True, eq=False)
class RowPlan:
    """Which rows of ``A`` (``G`` or ``G^T`` of ``layout``) each group rank holds."""

    layout: MatrixLayout
    transpose: bool
    starts: tuple[int, ...]  # world + 1 boundaries, non-decreasing

    # ------------------------------------------------------------------ constructors
    @classmethod
    def aligned(cls, layout: MatrixLayout, transpose: bool) -> "RowPlan":
        """Rows of ``A`` where the engine already keeps them (distributed strategy)."""
        rows = layout.shape[1] if transpose else layout.shape[0]
        if layout.world == 1:
            return cls(layout, transpose, (0, rows))
        along = isinstance(layout.pieces[0], ColPiece) == transpose
        if along:
            holder = cls._majority_holder(layout, transpose)
            if all(a <= b for a, b in zip(holder, holder[1:])):
                starts = [0] * (layout.world + 1)
                for p in range(layout.world):
                    starts[p + 1] = starts[p] + sum(1 for h in holder if h == p)
                return cls(layout, transpose, tuple(starts))
        return cls(layout, transpose, _even_starts(rows, layout.world))

    @classmethod
    def owner(cls, layout: MatrixLayout, transpose: bool, owner: int) -> "RowPlan":
        """Every row on ``owner`` (gather strategy)."""
        rows = layout.shape[1] if transpose else layout.shape[0]
        return cls(layout, transpose, tuple(0 if p <= owner else rows for p in range(layout.world + 1)))

    @staticmethod
    def _majority_holder(layout: MatrixLayout, transpose: bool) -> list[int]:
        size = layout.shape[1] if transpose else layout.shape[0]
        counts = torch.zeros(layout.world, size, dtype=torch.int64)
        for p, piece in enumerate(layout.pieces):
            for b in _blocks_of(piece, *layout.shape):
                if transpose:
                    counts[p, b.col: b.col + b.width] += b.height
                else:
                    counts[p, b.row: b.row + b.height] += b.width
        return counts.argmax(0).tolist() if size else []  # ties: lowest rank (argmax returns the first)

    # ------------------------------------------------------------------ geometry
    @property
    def a_shape(self) -> tuple[int, int]:
        m, n = self.layout.shape
        return (n, m) if self.transpose else (m, n)

    def rows(self, rank: int | None = None) -> tuple[int, int]:
        r = self.layout.rank if rank is None else rank
        return self.starts[r], self.starts[r + 1]

    @property
    def whole(self) -> bool:
        """Whether this rank holds every row of ``A``."""
        a0, a1 = self.rows()
        return a0 == 0 and a1 == self.a_shape[0]

    def _rect(self, rank: int) -> tuple[int, int, int, int]:
        """The rows x columns of ``G`` that ``rank``'s block covers."""
        a0, a1 = self.rows(rank)
        m, n = self.layout.shape
        return (0, m, a0, a1) if self.transpose else (a0, a1, 0, n)

    def _cuts(self, blocks: Sequence[Block], rank: int):
        """(block, rows, cols) intersections of ``blocks`` with ``rank``'s rectangle, in block order."""
        r0, r1, c0, c1 = self._rect(rank)
        for b in blocks:
            i0, i1 = max(b.row, r0), min(b.row + b.height, r1)
            j0, j1 = max(b.col, c0), min(b.col + b.width, c1)
            if i0 < i1 and j0 < j1:
                yield b, (i0, i1), (j0, j1)

    @cached_property
    def _piece_blocks(self) -> list[tuple[Block, ...]]:
        return [_blocks_of(piece, *self.layout.shape) for piece in self.layout.pieces]

    def moved(self, src: int, dst: int) -> int:
        """Elements ``src`` sends to ``dst`` when filling the blocks (static; the same on every rank)."""
        return sum((i1 - i0) * (j1 - j0) for _, (i0, i1), (j0, j1) in self._cuts(self._piece_blocks[src], dst))

    @cached_property
    def sent(self) -> tuple[int, ...]:
        """Elements each rank sends to other ranks to fill the blocks."""
        w = self.layout.world
        return tuple(sum(self.moved(s, d) for d in range(w) if d != s) for s in range(w))

    # ------------------------------------------------------------------ packing
    def pack_piece(self, piece: torch.Tensor, dst: int) -> list[torch.Tensor]:
        """This rank's elements that ``dst``'s block needs, flattened in plan order."""
        out = []
        for b, (i0, i1), (j0, j1) in self._cuts(self._piece_blocks[self.layout.rank], dst):
            view = piece[b.offset: b.offset + b.height * b.width].view(b.height, b.width)
            out.append(view[i0 - b.row: i1 - b.row, j0 - b.col: j1 - b.col].reshape(-1))
        return out

    def unpack_into_block(self, block: torch.Tensor, src: int, flat: torch.Tensor) -> None:
        """Write the elements received from ``src`` (``pack_piece`` order) into this rank's block."""
        a0 = self.rows()[0]
        pos = 0
        for _, (i0, i1), (j0, j1) in self._cuts(self._piece_blocks[src], self.layout.rank):
            h, w = i1 - i0, j1 - j0
            chunk = flat[pos: pos + h * w].view(h, w)
            pos += h * w
            if self.transpose:
                block[j0 - a0: j1 - a0, i0:i1] = chunk.T
            else:
                block[i0 - a0: i1 - a0, j0:j1] = chunk

    def pack_block(self, block: torch.Tensor, dst: int) -> list[torch.Tensor]:
        """The parts of this rank's block that belong to ``dst``'s piece, in ``dst``'s block order."""
        a0 = self.rows()[0]
        out = []
        for _, (i0, i1), (j0, j1) in self._cuts(self._piece_blocks[dst], self.layout.rank):
            part = block[j0 - a0: j1 - a0, i0:i1].T if self.transpose else block[i0 - a0: i1 - a0, j0:j1]
            out.append(part.reshape(-1))
        return out

    def unpack_into_piece(self, piece: torch.Tensor, src: int, flat: torch.Tensor) -> None:
        """Write the elements received from ``src`` (``pack_block`` order) into this rank's piece."""
        pos = 0
        for b, (i0, i1), (j0, j1) in self._cuts(self._piece_blocks[self.layout.rank], src):
            h, w = i1 - i0, j1 - j0
            view = piece[b.offset: b.offset + b.height * b.width].view(b.height, b.width)
            view[i0 - b.row: i1 - b.row, j0 - b.col: j1 - b.col] = flat[pos: pos + h * w].view(h, w)
            pos += h * w


def _exchange(plans: Sequence[RowPlan], send_parts: list[list[list[torch.Tensor]]], recv_counts: list[list[int]],
              dtype: torch.dtype, device: torch.device, tags: Sequence[str]) -> list[list[torch.Tensor]]:
    """One ``all_to_all_single`` for the entries of one group: ``send_parts[e][dst]`` -> ``out[e][src]``."""
    import torch.distributed as dist

    lay = plans[0].layout
    world, me = lay.world, lay.rank
    chunks, in_sizes = [], []
    for d in range(world):
        parts = [p for e in range(len(plans)) for p in send_parts[e][d]] if d != me else []
        chunks.extend(parts)
        in_sizes.append(sum(p.numel() for p in parts))
    out_sizes = [sum(recv_counts[e][s] for e in range(len(plans))) if s != me else 0 for s in range(world)]
    inp = torch.cat(chunks) if chunks else torch.empty(0, dtype=dtype, device=device)
    out = torch.empty(sum(out_sizes), dtype=dtype, device=device)
    by_tag: dict[str, int] = {}
    for e, tag in enumerate(tags):
        sent = sum(p.numel() for d in range(world) if d != me for p in send_parts[e][d])
        by_tag[tag] = by_tag.get(tag, 0) + sent * inp.element_size()
    collective_counter.record(inp, "gather" if "gather" in by_tag else tags[0], by_tag)
    dist.all_to_all_single(out, inp.contiguous(), out_sizes, in_sizes, group=lay.group)
    result: list[list[torch.Tensor]] = [[torch.empty(0, dtype=dtype, device=device)] * world for _ in plans]
    pos = 0
    for s in range(world):
        if s == me:
            continue
        for e in range(len(plans)):
            k = recv_counts[e][s]
            result[e][s] = out[pos: pos + k]
            pos += k
    return result


def _groups(plans: Sequence[RowPlan]) -> dict[int, list[int]]:
    by: dict[int, list[int]] = {}
    for e, plan in enumerate(plans):
        if plan.layout.group is not None:
            by.setdefault(id(plan.layout.group), []).append(e)
    return by


def _exchange_groups(plans: Sequence[RowPlan], send: Callable[[int, int], list[torch.Tensor]],
                     count: Callable[[RowPlan, int], int], receive: Callable[[int, int, torch.Tensor], None],
                     tags: Sequence[str], dtype: torch.dtype, device: torch.device) -> None:
    """One ``all_to_all`` per process group for every entry that moves: ``send(e, dst)`` packs, ``count(plan,
    src)`` says how much arrives from ``src``, ``receive(e, src, flat)`` unpacks. Groups whose static plans
    move nothing issue no collective on any rank."""
    for idx in _groups(plans).values():
        sub = [plans[e] for e in idx]
        if not any(any(p.sent) for p in sub):
            continue
        world, me = sub[0].layout.world, sub[0].layout.rank
        parts = [[send(e, d) for d in range(world)] for e in idx]
        counts = [[count(p, s) for s in range(world)] for p in sub]
        got = _exchange(sub, parts, counts, dtype, device, [tags[e] for e in idx])
        for e, row in zip(idx, got):
            for s in range(world):
                if s != me and row[s].numel():
                    receive(e, s, row[s])


def to_blocks(plans: Sequence[RowPlan], pieces: Sequence[torch.Tensor], tags: Sequence[str]) -> list[torch.Tensor]:
    """Each entry's block of ``A`` on this rank (fp32, shape ``(rows held, A's columns)``; ``(0, cols)`` if none).

    ``pieces[e]`` is this rank's 1-D piece of entry ``e`` in its engine layout. Every rank of a group must
    call it with the same entries in the same order (the plans are static, so they agree).
    """
    blocks: list[torch.Tensor] = []
    for plan, piece in zip(plans, pieces):
        a0, a1 = plan.rows()
        if plan.layout.group is None:
            full = piece.view(plan.layout.shape)
            blocks.append(full.T if plan.transpose else full)
            continue
        block = torch.zeros(a1 - a0, plan.a_shape[1], dtype=piece.dtype, device=piece.device)
        parts = plan.pack_piece(piece, plan.layout.rank)
        if parts:
            plan.unpack_into_block(block, plan.layout.rank, torch.cat(parts))
        blocks.append(block)
    if pieces:
        _exchange_groups(plans, lambda e, d: plans[e].pack_piece(pieces[e], d),
                         lambda p, s: p.moved(s, p.layout.rank),
                         lambda e, s, flat: plans[e].unpack_into_block(blocks[e], s, flat),
                         tags, pieces[0].dtype, pieces[0].device)
    return blocks


def from_blocks(plans: Sequence[RowPlan], blocks: Sequence[torch.Tensor | None], tags: Sequence[str],
                device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Inverse of ``to_blocks``: this rank's 1-D piece of each entry from the block-shaped results.

    ``blocks[e]`` may be ``None`` on a rank that holds no row of entry ``e``; ``device`` is where the pieces
    live (the parameters' device)."""
    blocks = [b if b is not None else torch.zeros(0, p.a_shape[1], device=device) for p, b in zip(plans, blocks)]
    pieces: list[torch.Tensor] = []
    for plan, block in zip(plans, blocks):
        if plan.layout.group is None:
            pieces.append((block.T if plan.transpose else block).reshape(-1))
            continue
        piece = torch.zeros(plan.layout.local_numel, dtype=block.dtype, device=block.device)
        parts = plan.pack_block(block, plan.layout.rank)
        if parts:
            plan.unpack_into_piece(piece, plan.layout.rank, torch.cat(parts))
        pieces.append(piece)
    if pieces:
        _exchange_groups(plans, lambda e, d: plans[e].pack_block(blocks[e], d),
                         lambda p, s: p.moved(p.layout.rank, s),
                         lambda e, s, flat: plans[e].unpack_into_piece(pieces[e], s, flat),
                         tags, pieces[0].dtype, pieces[0].device)
    return pieces
