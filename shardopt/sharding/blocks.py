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

import bisect
import itertools
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Sequence, cast

import torch

from . import staging
from .comm import collective_counter
from .layout import Block, ColFlatPiece, ColPiece, FlatPiece, MatrixLayout, RectPiece

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
        """Rows of ``A`` where the engine already keeps them (distributed strategy). Built once per layout and
        orientation (the strategy choice and the plan share it)."""
        cache = layout.__dict__.setdefault("_aligned_row_plans", {})
        plan = cache.get(transpose)
        if plan is None:
            plan = cache[transpose] = cls(layout, transpose, cls._aligned_starts(layout, transpose))
        return plan

    @classmethod
    def _aligned_starts(cls, layout: MatrixLayout, transpose: bool) -> tuple[int, ...]:
        rows = layout.shape[1] if transpose else layout.shape[0]
        if layout.world == 1:
            return (0, rows)
        # rows of A held by few ranks each (row or rectangular pieces of G; column pieces of G^T): rows stay with
        # the rank that holds most of them; across the grain they are cut evenly
        along = (
            isinstance(layout.pieces[0], RectPiece)
            or isinstance(layout.pieces[0], (ColPiece, ColFlatPiece)) == transpose
        )
        if along:
            runs = cls._majority_runs(layout, transpose)
            if all(a[2] <= b[2] for a, b in zip(runs, runs[1:])):  # holders non-decreasing along the rows
                count = [0] * layout.world
                for lo, hi, p in runs:
                    count[p] += hi - lo
                return (0, *itertools.accumulate(count))
        return _even_starts(rows, layout.world)

    @classmethod
    def owner(cls, layout: MatrixLayout, transpose: bool, owner: int) -> "RowPlan":
        """Every row on ``owner`` (gather strategy)."""
        rows = layout.shape[1] if transpose else layout.shape[0]
        return cls(layout, transpose, (0,) * (owner + 1) + (rows,) * (layout.world - owner))

    @classmethod
    def team(cls, layout: MatrixLayout, transpose: bool, members: Sequence[int]) -> "RowPlan":
        """The rows of ``A`` in even chunks (``torch.chunk``) over ``members`` (ascending group ranks; a team),
        none elsewhere."""
        rows = layout.shape[1] if transpose else layout.shape[0]
        g = len(members)
        c = -(-rows // g) if rows else 0
        count = [0] * layout.world
        for j, r in enumerate(members):
            count[r] = min((j + 1) * c, rows) - min(j * c, rows)
        return cls(layout, transpose, (0, *itertools.accumulate(count)))

    @staticmethod
    def _majority_runs(layout: MatrixLayout, transpose: bool) -> list[tuple[int, int, int]]:
        """``(lo, hi, rank)`` runs covering the rows of ``A``: ``rank`` holds the most elements of each row in
        ``[lo, hi)`` (ties: the lowest rank; a row nobody holds: rank 0). A sweep over the pieces' blocks, so
        O(blocks log blocks), never world x rows."""
        size = layout.shape[1] if transpose else layout.shape[0]
        if not size:
            return []
        spans = _element_spans(layout, transpose)
        if spans is not None:
            tiled = _tiled_majority_runs(*spans, size)
            if tiled is not None:
                return tiled
        deltas: dict[int, list[tuple[int, int]]] = {}
        for p, blocks in enumerate(layout.all_blocks):
            for b in blocks:
                lo, hi, w = (b.col, b.col + b.width, b.height) if transpose else (b.row, b.row + b.height, b.width)
                lo, hi = max(lo, 0), min(hi, size)
                if lo < hi:
                    deltas.setdefault(lo, []).append((p, w))
                    deltas.setdefault(hi, []).append((p, -w))
        points = sorted(deltas.keys() | {0, size})
        active: dict[int, int] = {}
        runs: list[tuple[int, int, int]] = []
        for lo, hi in zip(points, points[1:]):
            for p, w in deltas.get(lo, ()):
                v = active.get(p, 0) + w
                if v:
                    active[p] = v
                else:
                    del active[p]
            if not active:
                best = 0
            elif len(active) == 1:
                best = next(iter(active))
            else:
                top = max(active.values())
                best = min(p for p, v in active.items() if v == top)
            if runs and runs[-1][2] == best:
                runs[-1] = (runs[-1][0], hi, best)
            else:
                runs.append((lo, hi, best))
        return runs

    @staticmethod
    def _majority_holder(layout: MatrixLayout, transpose: bool) -> list[int]:
        """The rank holding most of each row of ``A`` (ties: the lowest rank), one entry per row."""
        out: list[int] = []
        for lo, hi, p in RowPlan._majority_runs(layout, transpose):
            out.extend([p] * (hi - lo))
        return out

    # ------------------------------------------------------------------ geometry
    @cached_property
    def a_shape(self) -> tuple[int, int]:
        m, n = self.layout.shape
        return (n, m) if self.transpose else (m, n)

    def rows(self, rank: int | None = None) -> tuple[int, int]:
        r = self.layout.rank if rank is None else rank
        return self.starts[r], self.starts[r + 1]

    @cached_property
    def held(self) -> str:
        """``"all"``: this rank's piece is the whole matrix and its block all of ``A`` (not sharded, or one
        ZeRO partition holds it and its owner is this rank), so the block is a view of the piece; ``"none"``:
        this rank neither holds nor computes any of it; ``"some"`` otherwise. Nothing of the first two moves."""
        lay = self.layout
        a0, a1 = self.rows()
        size = lay.shape[0] * lay.shape[1]
        if lay.group is None or (lay.local_numel == size and (a0, a1) == (0, self.a_shape[0])):
            return "all"
        if lay.local_numel == 0 and a0 == a1:
            return "none"
        return "some"

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

    def _cuts(self, src: int, rank: int) -> tuple:
        """(block, rows, cols) intersections of ``src``'s piece blocks with ``rank``'s rectangle, in block
        order. Static: the pairs with this rank on one side (what packing uses every step) are made once and
        kept; others (plan statistics over all pairs) are not, so memory stays O(world)."""
        mine = self.layout.rank in (src, rank)
        cache = self.__dict__.setdefault("_cut_cache", {})
        found = cache.get((src, rank)) if mine else None
        if found is None:
            r0, r1, c0, c1 = self._rect(rank)
            out = []
            for b in self._piece_blocks[src]:
                i0, i1 = max(b.row, r0), min(b.row + b.height, r1)
                j0, j1 = max(b.col, c0), min(b.col + b.width, c1)
                if i0 < i1 and j0 < j1:
                    out.append((b, (i0, i1), (j0, j1)))
            found = tuple(out)
            if mine:
                cache[(src, rank)] = found
        return found

    @property
    def _piece_blocks(self) -> tuple[tuple[Block, ...], ...]:
        return self.layout.all_blocks

    def moved(self, src: int, dst: int) -> int:
        """Elements ``src`` sends to ``dst`` when filling the blocks (static; the same on every rank)."""
        return sum((i1 - i0) * (j1 - j0) for _, (i0, i1), (j0, j1) in self._cuts(src, dst))

    def _along(self, b: Block) -> tuple[int, int, int]:
        """A block as ``(first row of A, last row + 1, elements per row of A)``."""
        return (b.col, b.col + b.width, b.height) if self.transpose else (b.row, b.row + b.height, b.width)

    def _monotone(self) -> bool:
        s = self.starts
        return all(a <= b for a, b in zip(s, s[1:]))

    @cached_property
    def sent(self) -> tuple[int, ...]:
        """Elements each rank sends to other ranks to fill the blocks: its piece within the rows of ``A`` that
        some rank holds, less what lands in its own block. O(blocks), not O(world^2)."""
        w = self.layout.world
        if not self._monotone():
            return tuple(sum(self.moved(s, d) for d in range(w) if d != s) for s in range(w))
        lo, hi = self.starts[0], self.starts[-1]
        spans = _element_spans(self.layout, self.transpose)
        if spans is not None:  # along the grain: a piece's elements in rows [a, b) of A are one overlap
            ivals, k = spans
            starts = [x * k for x in self.starts]
            lo, hi = lo * k, hi * k
            return tuple(
                max(min(b, hi) - max(a, lo), 0) - max(min(b, a1) - max(a, a0), 0)
                for (a, b), a0, a1 in zip(ivals, starts, starts[1:])
            )
        out = []
        for s, blocks in enumerate(self._piece_blocks):
            a0, a1 = self.starts[s], self.starts[s + 1]
            n = 0
            for b in blocks:
                r0, r1, per = self._along(b)
                n += per * (max(min(r1, hi) - max(r0, lo), 0) - max(min(r1, a1) - max(r0, a0), 0))
            out.append(n)
        return tuple(out)

    def destinations(self, src: int) -> list[int]:
        """Ranks other than ``src`` that ``src``'s piece sends to (``moved(src, d) > 0``), in rank order."""
        w = self.layout.world
        if not self._monotone():
            return [d for d in range(w) if d != src and self.moved(src, d)]
        found = set()
        for b in self._piece_blocks[src]:
            r0, r1, _ = self._along(b)
            # ranks whose rows [starts[d], starts[d+1]) meet [r0, r1): a contiguous run of non-empty ones
            d = bisect.bisect_right(self.starts, r0) - 1
            d = max(d, 0)
            while d < w and self.starts[d] < r1:
                if self.starts[d + 1] > max(r0, self.starts[d]) and d != src:
                    found.add(d)
                d += 1
        return sorted(found)

    @cached_property
    def _received(self) -> dict[int, int]:
        """``{src: moved(src, this rank)}`` for every other rank that sends this rank anything."""
        me = self.layout.rank
        a0, a1 = self.rows(me)
        out: dict[int, int] = {}
        if a0 >= a1:
            return out
        spans = _element_spans(self.layout, self.transpose)
        if spans is not None:
            ivals, k = spans
            a0, a1 = a0 * k, a1 * k
            for s, (x, y) in enumerate(ivals):
                n = min(y, a1) - max(x, a0)
                if n > 0 and s != me:
                    out[s] = n
            return out
        for s, blocks in enumerate(self._piece_blocks):
            if s == me:
                continue
            k = 0
            for b in blocks:
                r0, r1, per = self._along(b)
                k += per * max(min(r1, a1) - max(r0, a0), 0)
            if k:
                out[s] = k
        return out

    @cached_property
    def _sends(self) -> dict[int, int]:
        """``{dst: moved(this rank, dst)}`` for every other rank this rank sends anything."""
        me = self.layout.rank
        return {d: self.moved(me, d) for d in self.destinations(me)}

    # ------------------------------------------------------------------ packing
    @cached_property
    def _flat(self) -> tuple[list[tuple[int, int]], int] | None:
        """``(intervals by rank, k)`` where every piece is one interval of ``A``'s row-major elements and ``A``
        is ``G`` itself (flat pieces: FSDP2 ``Shard(0)``, ZeRO partitions): then what moves between two ranks
        is one slice of each side's storage, in the order the block-wise cuts would give, and a contiguous
        block is filled by one copy per source instead of one per cut."""
        return None if self.transpose else _element_spans(self.layout, False)

    def _assembles_g(self, rank: int) -> bool:
        """Whether ``rank`` holds every row of ``A = G^T`` while the pieces are intervals of ``G``'s row-major
        elements (an owner under FSDP2 ``Shard(0)`` or ZeRO): then its block is the transposed view of ``G``
        assembled whole, every piece lands there with one contiguous copy, and results go back as slices of it,
        instead of a transposing copy per piece each way (about 6x slower on a CPU). Static."""
        cache = self.__dict__.setdefault("_assembles_cache", {})
        found = cache.get(rank)
        if found is None:
            found = cache[rank] = (
                self.transpose
                and self.a_shape[0] > 0
                and self.rows(rank) == (0, self.a_shape[0])
                and _element_spans(self.layout, False) is not None
            )
        return found

    def _g_span(self, src: int) -> tuple[int, int]:
        """``[lo, hi)``: ``src``'s piece as elements of ``G``'s row-major flattening (``_assembles_g`` only)."""
        spans = _element_spans(self.layout, False)
        assert spans is not None  # _assembles_g holds only when there are spans
        lo, hi = spans[0][src]
        return lo, hi

    def _overlap(self, src: int, dst: int) -> tuple[int, int]:
        """``[x, y)``: the elements of ``A`` that ``src``'s interval and ``dst``'s rows share (``_flat`` only);
        static, so kept for the pairs this rank packs and unpacks every step."""
        cache = self.__dict__.setdefault("_overlap_cache", {})
        found = cache.get((src, dst))
        if found is None:
            assert self._flat is not None  # callers check _flat first
            ivals, k = self._flat
            a, b = ivals[src]
            d0, d1 = self.rows(dst)
            found = cache[(src, dst)] = (max(a, d0 * k), min(b, d1 * k))
        return found

    @cached_property
    def block_covered(self) -> bool:
        """Whether the pieces fill every element of this rank's block (so it needs no zero fill first)."""
        a0, a1 = self.rows()
        if a1 <= a0:
            return True
        me = self.layout.rank
        return self.moved(me, me) + sum(self._received.values()) == (a1 - a0) * self.a_shape[1]

    @cached_property
    def piece_source(self) -> int | None:
        """The one other rank that computes every element of this rank's piece and sends it whole, in the
        piece's order (a gather owner, with pieces that are intervals of ``G``): ``from_blocks`` then returns
        the piece as a view of what arrives instead of copying it into a new one. None otherwise. Static."""
        me = self.layout.rank
        if self.held != "some" or self.moved(me, me) or len(self._sends) != 1:
            return None
        ((src, k),) = self._sends.items()
        if k != self.layout.local_numel or not (self._flat is not None or self._assembles_g(src)):
            return None
        return src

    @cached_property
    def piece_covered(self) -> bool:
        """Whether the blocks of the rows some rank holds fill every element of this rank's piece."""
        me = self.layout.rank
        return self.moved(me, me) + sum(self._sends.values()) == self.layout.local_numel

    def pack_piece(self, piece: torch.Tensor, dst: int) -> list[torch.Tensor]:
        """This rank's elements that ``dst``'s block needs, flattened in plan order."""
        me = self.layout.rank
        if self._flat is not None:
            x, y = self._overlap(me, dst)
            lo = self._flat[0][me][0]
            return [piece[x - lo : y - lo]] if y > x else []
        if self._assembles_g(dst):  # dst's block is all of G: the whole piece, in G's order
            lo, hi = self._g_span(me)
            return [piece[: hi - lo]] if hi > lo else []
        out = []
        for b, (i0, i1), (j0, j1) in self._cuts(me, dst):
            view = piece[b.offset : b.offset + b.height * b.width].view(b.height, b.width)
            out.append(view[i0 - b.row : i1 - b.row, j0 - b.col : j1 - b.col].reshape(-1))
        return out

    def unpack_into_block(self, block: torch.Tensor, src: int, flat: torch.Tensor) -> None:
        """Write the elements received from ``src`` (``pack_piece`` order) into this rank's block."""
        a0 = self.rows()[0]
        if self._flat is not None and block.is_contiguous():
            x, y = self._overlap(src, self.layout.rank)
            base = a0 * self._flat[1]
            block.view(-1)[x - base : y - base].copy_(flat)
            return
        if self._assembles_g(self.layout.rank) and block.mT.is_contiguous():
            lo, hi = self._g_span(src)
            block.mT.view(-1)[lo:hi].copy_(flat)
            return
        pos = 0
        for _, (i0, i1), (j0, j1) in self._cuts(src, self.layout.rank):
            h, w = i1 - i0, j1 - j0
            chunk = flat[pos : pos + h * w].view(h, w)
            pos += h * w
            if self.transpose:
                block[j0 - a0 : j1 - a0, i0:i1] = chunk.T
            else:
                block[i0 - a0 : i1 - a0, j0:j1] = chunk

    def pack_block(self, block: torch.Tensor, dst: int) -> list[torch.Tensor]:
        """The parts of this rank's block that belong to ``dst``'s piece, in ``dst``'s block order."""
        a0 = self.rows()[0]
        if self._flat is not None and block.is_contiguous():
            x, y = self._overlap(dst, self.layout.rank)
            base = a0 * self._flat[1]
            return [block.view(-1)[x - base : y - base]] if y > x else []
        if self._assembles_g(self.layout.rank) and block.mT.is_contiguous():
            lo, hi = self._g_span(dst)
            return [block.mT.view(-1)[lo:hi]] if hi > lo else []
        out = []
        for _, (i0, i1), (j0, j1) in self._cuts(dst, self.layout.rank):
            part = block[j0 - a0 : j1 - a0, i0:i1].T if self.transpose else block[i0 - a0 : i1 - a0, j0:j1]
            out.append(part.reshape(-1))
        return out

    def unpack_into_piece(self, piece: torch.Tensor, src: int, flat: torch.Tensor) -> None:
        """Write the elements received from ``src`` (``pack_block`` order) into this rank's piece."""
        me = self.layout.rank
        if self._flat is not None:
            x, y = self._overlap(me, src)
            lo = self._flat[0][me][0]
            piece[x - lo : y - lo].copy_(flat)
            return
        if self._assembles_g(src):  # src sent the whole piece, as a slice of G
            piece[: flat.numel()].copy_(flat)
            return
        pos = 0
        for b, (i0, i1), (j0, j1) in self._cuts(me, src):
            h, w = i1 - i0, j1 - j0
            view = piece[b.offset : b.offset + b.height * b.width].view(b.height, b.width)
            view[i0 - b.row : i1 - b.row, j0 - b.col : j1 - b.col] = flat[pos : pos + h * w].view(h, w)
            pos += h * w


def _element_spans(layout: MatrixLayout, transpose: bool) -> tuple[list[tuple[int, int]], int] | None:
    """Along the grain (flat pieces of ``A = G``, column pieces of ``A = G^T``) every piece is one interval
    ``[lo, hi)`` of ``A``'s elements in row-major order, ``k`` per row of ``A``: ``(intervals by rank, k)``, so
    rows held and elements moved are overlaps of intervals, with no blocks. None across the grain, for mixed or
    out-of-range pieces and empty rows (the block-based paths handle them)."""
    cache = layout.__dict__.setdefault("_element_spans", {})
    if transpose in cache:
        return cache[transpose]
    m, n = layout.shape
    out = None
    cols = [p for p in layout.pieces if isinstance(p, ColPiece)]
    flats = [p for p in layout.pieces if isinstance(p, FlatPiece)]
    if transpose and len(cols) == len(layout.pieces) and m > 0:
        if all(0 <= p.c0 and p.c1 <= n for p in cols):
            out = ([(p.c0 * m, max(p.c1, p.c0) * m) for p in cols], m)
    elif not transpose and len(flats) == len(layout.pieces) and n > 0:
        if all(0 <= p.lo and p.hi <= m * n for p in flats):
            out = ([(p.lo, max(p.hi, p.lo)) for p in flats], n)
    cache[transpose] = out
    return out


def _tiled_majority_runs(ivals: list[tuple[int, int]], k: int, size: int) -> list[tuple[int, int, int]] | None:
    """``RowPlan._majority_runs`` when the non-empty intervals follow each other in rank order without
    overlapping (every engine's partitions): one pass, each row decided among the consecutive ranks that
    share it. None when the intervals are not so ordered."""
    runs: list[tuple[int, int, int]] = []
    done = 0  # rows before this one are in ``runs``

    def emit(a: int, b: int, p: int) -> None:
        nonlocal done
        if a > done:
            emit(done, a, 0)  # rows nobody holds
        if runs and runs[-1][2] == p:
            runs[-1] = (runs[-1][0], b, p)
        else:
            runs.append((a, b, p))
        done = b

    pend = None  # [row, best rank, its elements]: a row shared by consecutive ranks, still open
    prev_hi = 0
    for p, (lo, hi) in enumerate(ivals):
        if hi <= lo:
            continue
        if lo < prev_hi:
            return None
        prev_hi = hi
        r0, c0 = divmod(lo, k)
        r1, c1 = divmod(hi, k)
        # (row, its elements) for a row shared with other ranks, (None, (first, last + 1)) for whole rows
        parts: Sequence[tuple[int | None, Any]] = (
            [(r0, c1 - c0)]
            if r0 == r1
            else ([(r0, k - c0)] if c0 else []) + [(None, (r0 + (c0 > 0), r1))] + ([(r1, c1)] if c1 else [])
        )
        for row, w in parts:
            if row is None:  # whole rows of this rank alone
                a, b = w
                if a < b:
                    if pend is not None:
                        emit(pend[0], pend[0] + 1, pend[1])
                        pend = None
                    emit(a, b, p)
            elif pend is not None and pend[0] == row:
                if w > pend[2]:
                    pend[1], pend[2] = p, w
            else:
                if pend is not None:
                    emit(pend[0], pend[0] + 1, pend[1])
                pend = [row, p, w]
    if pend is not None:
        emit(pend[0], pend[0] + 1, pend[1])
    if done < size:
        emit(done, size, 0)
    return runs


def _exchange(
    plans: Sequence[RowPlan],
    send_parts: list[dict[int, list[torch.Tensor]]],
    recv_counts: list[dict[int, int]],
    dtype: torch.dtype,
    device: torch.device,
    tags: Sequence[str],
) -> list[dict[int, torch.Tensor]]:
    """One ``all_to_all_single`` for the entries of one group: ``send_parts[e][dst]`` -> ``out[e][src]``.

    Only the ranks an entry exchanges with appear in its maps (never this rank), so the work is proportional
    to the pieces that move, not to the world size; the buffers are laid out by rank, then entry."""
    lay = plans[0].layout
    world, me = lay.world, lay.rank
    by_dst: dict[int, list[torch.Tensor]] = {}
    by_tag: dict[str, int] = {}
    for e, parts in enumerate(send_parts):
        sent = 0
        for d, ps in parts.items():
            if d != me and ps:
                by_dst.setdefault(d, []).extend(ps)
                sent += sum(p.numel() for p in ps)
        by_tag[tags[e]] = by_tag.get(tags[e], 0) + sent
    chunks: list[torch.Tensor] = []
    in_sizes = [0] * world
    for d in sorted(by_dst):
        chunks.extend(by_dst[d])
        in_sizes[d] = sum(p.numel() for p in by_dst[d])
    arrivals = sorted((s, e, k) for e, counts in enumerate(recv_counts) for s, k in counts.items() if s != me and k)
    out_sizes = [0] * world
    for s, _, k in arrivals:
        out_sizes[s] += k
    inp = torch.cat(chunks) if chunks else torch.empty(0, dtype=dtype, device=device)
    out = torch.empty(sum(out_sizes), dtype=dtype, device=device)
    by_tag = {tag: n * inp.element_size() for tag, n in by_tag.items()}
    collective_counter.record(inp, "gather" if "gather" in by_tag else tags[0], by_tag)
    staging.all_to_all_single(out, inp.contiguous(), out_sizes, in_sizes, lay.group)  # CPU pieces on NCCL
    result: list[dict[int, torch.Tensor]] = [{} for _ in plans]
    pos = 0
    for s, e, k in arrivals:
        result[e][s] = out[pos : pos + k]
        pos += k
    return result


def _groups(plans: Sequence[RowPlan]) -> dict[int, list[int]]:
    by: dict[int, list[int]] = {}
    for e, plan in enumerate(plans):
        if plan.layout.group is not None:
            by.setdefault(id(plan.layout.group), []).append(e)
    return by


def _exchange_groups(
    plans: Sequence[RowPlan],
    send: Callable[[int, int], list[torch.Tensor]],
    sends_to: Callable[[RowPlan], dict[int, int]],
    receives_from: Callable[[RowPlan], dict[int, int]],
    receive: Callable[[int, int, torch.Tensor], None],
    tags: Sequence[str],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """One ``all_to_all`` per process group for every entry that moves: ``send(e, dst)`` packs for each rank
    of ``sends_to(plan)``, ``receives_from(plan)`` says how much arrives from which rank, ``receive(e, src,
    flat)`` unpacks. Groups whose static plans move nothing issue no collective on any rank."""
    for idx in _groups(plans).values():
        sub = [plans[e] for e in idx]
        if not any(any(p.sent) for p in sub):
            continue
        parts = [{d: send(e, d) for d in sends_to(p)} for e, p in zip(idx, sub)]
        counts = [receives_from(p) for p in sub]
        got = _exchange(sub, parts, counts, dtype, device, [tags[e] for e in idx])
        for e, row in zip(idx, got):
            for s in sorted(row):
                if row[s].numel():
                    receive(e, s, row[s])


def to_blocks(plans: Sequence[RowPlan], pieces: Sequence[torch.Tensor], tags: Sequence[str]) -> list[torch.Tensor]:
    """Each entry's block of ``A`` on this rank (fp32, shape ``(rows held, A's columns)``; ``(0, cols)`` if none).

    ``pieces[e]`` is this rank's 1-D piece of entry ``e`` in its engine layout. Every rank of a group must
    call it with the same entries in the same order (the plans are static, so they agree).
    """
    blocks: list[torch.Tensor] = []
    for plan, piece in zip(plans, pieces):
        a0, a1 = plan.rows()
        held = plan.held
        if held == "all":  # the piece is the whole matrix and this rank computes it: a view, no copy
            full = piece.view(plan.layout.shape)
            blocks.append(full.T if plan.transpose else full)
            continue
        if held == "none":
            blocks.append(piece.new_zeros(0, plan.a_shape[1]))
            continue
        alloc = torch.empty if plan.block_covered else torch.zeros
        if plan._assembles_g(plan.layout.rank):  # G whole, seen as A = G^T
            block = alloc(plan.layout.shape, dtype=piece.dtype, device=piece.device).T
        else:
            block = alloc(a1 - a0, plan.a_shape[1], dtype=piece.dtype, device=piece.device)
        parts = plan.pack_piece(piece, plan.layout.rank)
        if parts:
            plan.unpack_into_block(block, plan.layout.rank, parts[0] if len(parts) == 1 else torch.cat(parts))
        blocks.append(block)
    if pieces:
        _exchange_groups(
            plans,
            lambda e, d: plans[e].pack_piece(pieces[e], d),
            lambda p: p._sends,
            lambda p: p._received,
            lambda e, s, flat: plans[e].unpack_into_block(blocks[e], s, flat),
            tags,
            pieces[0].dtype,
            pieces[0].device,
        )
    return blocks


def from_blocks(
    plans: Sequence[RowPlan],
    blocks: Sequence[torch.Tensor | None],
    tags: Sequence[str],
    device: torch.device | str = "cpu",
) -> list[torch.Tensor]:
    """Inverse of ``to_blocks``: this rank's 1-D piece of each entry from the block-shaped results.

    ``blocks[e]`` may be ``None`` on a rank that holds no row of entry ``e``; ``device`` is where the pieces
    live (the parameters' device)."""
    dense = [b if b is not None else torch.zeros(0, p.a_shape[1], device=device) for p, b in zip(plans, blocks)]
    # an owner of A = G^T sends slices of G: one transposing copy of the whole result here (none where the
    # algorithm already wrote it in G's layout) instead of one per piece
    dense = [
        b.mT.contiguous().mT if p.held == "some" and p._assembles_g(p.layout.rank) else b for p, b in zip(plans, dense)
    ]
    pieces: list[torch.Tensor | None] = []
    for plan, block in zip(plans, dense):
        held = plan.held
        if held == "all":
            pieces.append((block.T if plan.transpose else block).reshape(-1))
            continue
        if held == "none":
            pieces.append(block.new_zeros(0))
            continue
        if plan.piece_source is not None:
            pieces.append(None)  # what arrives from the one rank that computes it
            continue
        alloc = torch.empty if plan.piece_covered else torch.zeros
        piece = alloc(plan.layout.local_numel, dtype=block.dtype, device=block.device)
        parts = plan.pack_block(block, plan.layout.rank)
        if parts:
            plan.unpack_into_piece(piece, plan.layout.rank, parts[0] if len(parts) == 1 else torch.cat(parts))
        pieces.append(piece)

    def receive(e: int, src: int, flat: torch.Tensor) -> None:
        piece = pieces[e]
        if piece is None:
            pieces[e] = flat
        else:
            plans[e].unpack_into_piece(piece, src, flat)

    if pieces:
        _exchange_groups(
            plans,
            lambda e, d: plans[e].pack_block(dense[e], d),
            lambda p: p._received,
            lambda p: p._sends,
            receive,
            tags,
            dense[0].dtype,
            dense[0].device,
        )
    if any(p is None for p in pieces):
        raise RuntimeError("from_blocks: the rank computing a piece sent nothing (plans differ across ranks)")
    return cast("list[torch.Tensor]", pieces)  # every None was filled (checked above)
