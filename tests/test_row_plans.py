"""Static row-block plans (shardopt.sharding.blocks): what the distributed strategy moves, checked without
processes: on flat ZeRO ranges only rows cut by a boundary move, never a whole matrix; pieces -> blocks ->
pieces is the identity for every layout kind."""

from __future__ import annotations

import pytest
import torch

from shardopt.sharding.blocks import RowPlan
from shardopt.sharding.layout import ColPiece, FlatPiece, MatrixLayout


def flat_layout(m: int, n: int, cuts: list[int], rank: int = 0) -> MatrixLayout:
    bounds = [0, *cuts, m * n]
    return MatrixLayout((m, n), [FlatPiece(a, b) for a, b in zip(bounds, bounds[1:])], rank, group=object())


@pytest.mark.parametrize("m,n,cuts", [(64, 48, [700, 1500, 2300]), (9, 50, [49, 51, 300]), (40, 7, [1, 2, 279])])
def test_flat_ranges_move_only_boundary_rows(m: int, n: int, cuts: list[int]) -> None:
    lay = flat_layout(m, n, cuts)
    plan = RowPlan.aligned(lay, transpose=False)
    world = lay.world
    for d in range(world):
        received = sum(plan.moved(s, d) for s in range(world) if s != d)
        assert received <= 2 * n, (d, received)  # at most the two rows cut at this rank's ends
        assert received < m * n
    assert sum(plan.sent) <= 2 * (world - 1) * n
    assert plan.starts[0] == 0 and plan.starts[-1] == m and list(plan.starts) == sorted(plan.starts)


def test_across_the_grain_is_an_even_all_to_all() -> None:
    lay = flat_layout(12, 30, [90, 180, 270])
    plan = RowPlan.aligned(lay, transpose=True)  # rows of A = columns of G: split in even chunks
    assert plan.starts == (0, 8, 16, 24, 30)
    for d in range(4):
        assert sum(plan.moved(s, d) for s in range(4) if s != d) < 12 * 30 // 2


def _pieces(layouts: list[MatrixLayout], full: torch.Tensor) -> list[torch.Tensor]:
    """Each rank's 1-D piece of ``full`` in its layout."""
    pieces = []
    for lay in layouts:
        piece = torch.empty(lay.local_numel)
        for b, view in lay.views(piece):
            view.copy_(full[b.row : b.row + b.height, b.col : b.col + b.width])
        pieces.append(piece)
    return pieces


def _layouts(kind: str, m: int, n: int, world: int) -> list[MatrixLayout]:
    """Every rank's layout of an ``m x n`` matrix over 3 ranks: flat ranges (one rank's is a single element),
    column pieces, or uneven row chunks."""
    if kind == "flat":
        bounds = [0, 13, 14, m * n]
        return [
            MatrixLayout((m, n), [FlatPiece(a, b) for a, b in zip(bounds, bounds[1:])], r, object())
            for r in range(world)
        ]
    if kind == "cols":
        return [
            MatrixLayout((m, n), [ColPiece(0, 4), ColPiece(4, 8), ColPiece(8, 10)], r, object()) for r in range(world)
        ]
    return [MatrixLayout.row_chunks((m, n), world, r, object()) for r in range(world)]


def _roundtrip(layouts: list[MatrixLayout], transpose: bool, owner: int | None) -> None:
    """Fill every rank's block from all pieces, then cut every piece back out of the blocks."""
    m, n = layouts[0].shape
    full = torch.arange(m * n, dtype=torch.float32).view(m, n)
    pieces = _pieces(layouts, full)
    plans = [
        RowPlan.owner(lay, transpose, owner) if owner is not None else RowPlan.aligned(lay, transpose)
        for lay in layouts
    ]
    a = full.T if transpose else full
    blocks = []
    for d, plan in enumerate(plans):
        a0, a1 = plan.rows()
        block = torch.zeros(a1 - a0, a.shape[1])
        for s in range(len(plans)):
            parts = plans[s].pack_piece(pieces[s], d)
            if parts:
                plan.unpack_into_block(block, s, torch.cat(parts))
        assert torch.equal(block, a[a0:a1])
        blocks.append(block)
    for d, plan in enumerate(plans):
        piece = torch.full_like(pieces[d], -1.0)
        for s in range(len(plans)):
            parts = plans[s].pack_block(blocks[s], d)
            if parts:
                plan.unpack_into_piece(piece, s, torch.cat(parts))
        assert torch.equal(piece, pieces[d])


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("owner", [None, 2])
@pytest.mark.parametrize("kind", ["flat", "cols", "rows_uneven"])
def test_pieces_to_blocks_and_back_is_exact(kind: str, owner: int | None, transpose: bool) -> None:
    _roundtrip(_layouts(kind, 7, 10, 3), transpose, owner)


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("strategy", ["auto", "gather", "distributed"])
def test_zero_partitions_split_into_here_elsewhere_and_shared(rank: int, strategy: str) -> None:
    """On a ZeRO flat partition a matrix one rank holds whole is computed there (``here``, its block a view of
    the piece) and skipped by the other (``elsewhere``, no block); only the matrix cut by the boundary is
    shared, and every rank sees the same shared set."""
    from shardopt.sharding.blocks import to_blocks
    from shardopt.sharding.matrix_ops import MatrixOps, OpCost

    group = object()  # never used for communication: no plan here moves anything across ranks but the shared one
    layouts = [
        MatrixLayout((4, 6), [FlatPiece(0, 24), FlatPiece(0, 0)], rank, group),  # rank 0 holds it whole
        MatrixLayout((4, 6), [FlatPiece(0, 10), FlatPiece(10, 24)], rank, group),  # cut by the boundary
        MatrixLayout((6, 4), [FlatPiece(0, 0), FlatPiece(0, 24)], rank, group),
    ]  # rank 1 holds it whole
    cost = lambda a: OpCost(row_flops=1.0, small_flops=1.0, reduced=1.0, state=1.0)  # noqa: E731
    plans = {
        r: MatrixOps(
            [MatrixLayout(lay.shape, lay.pieces, r, group) for lay in layouts],
            ["a", "b", "c"],
            [False, True, False],
            strategy,
            cost,
        )
        for r in (0, 1)
    }
    ops = plans[rank]
    assert ops.here == [rank == 0, False, rank == 1]
    assert ops.elsewhere == [rank == 1, False, rank == 0]
    shared = [i for i in range(3) if not ops.here[i] and not ops.elsewhere[i]]
    assert shared == [i for i in range(3) if not plans[1 - rank].here[i] and not plans[1 - rank].elsewhere[i]]
    assert not ops.all_here and ops.subset([i for i in range(3) if ops.here[i]]).all_here
    whole = [i for i in range(3) if ops.here[i]]
    pieces = [torch.randn(lay.local_numel) for lay in layouts]
    sub = ops.subset(whole + [i for i in range(3) if ops.elsewhere[i]])
    blocks = to_blocks(
        sub.plans, [pieces[i] for i in whole + [i for i in range(3) if ops.elsewhere[i]]], ["gather"] * len(sub)
    )
    held = blocks[0]
    assert held.data_ptr() == pieces[whole[0]].data_ptr()  # a view: no copy of the gradient
    assert torch.equal(held, pieces[whole[0]].view(layouts[whole[0]].shape))
    assert blocks[1].shape[0] == 0


@pytest.mark.parametrize("kind", ["flat", "rows_uneven"])
def test_an_owner_of_g_transposed_assembles_g_and_returns_slices_of_it(kind: str) -> None:
    """A = G^T on an owner with flat pieces: the owner's block is the transposed view of G assembled whole
    (one contiguous copy per piece), each rank's piece goes back as one slice of G, and a rank whose piece
    the owner computes entirely takes it as it arrives (``piece_source``)."""
    m, n, world, owner = 7, 10, 3, 2
    layouts = _layouts(kind, m, n, world)
    full = torch.arange(m * n, dtype=torch.float32).view(m, n)
    pieces = _pieces(layouts, full)
    plans = [RowPlan.owner(lay, True, owner) for lay in layouts]
    assert plans[owner]._assembles_g(owner) and not plans[0]._assembles_g(0)
    block = torch.zeros(m, n).T  # what to_blocks allocates on the owner
    for s in range(world):
        parts = plans[s].pack_piece(pieces[s], owner)
        if parts:
            plans[owner].unpack_into_block(block, s, torch.cat(parts))
    assert torch.equal(block, full.T) and block.mT.is_contiguous()
    for d in range(world):
        parts = plans[owner].pack_block(block, d)
        got = torch.cat(parts) if parts else torch.empty(0)
        assert torch.equal(got, pieces[d])
        if d != owner and pieces[d].numel():
            assert plans[d].piece_source == owner
    assert plans[owner].piece_source is None
