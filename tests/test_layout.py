"""The sharded-matrix primitives are exact for any partition: all ranks simulated in one process."""

from __future__ import annotations

import random

import pytest
import torch

from shardopt.sharding import ColPiece, FlatPiece, MatrixLayout, col_sums, row_sums


def random_flat_pieces(m: int, n: int, world: int, rng: random.Random) -> list[FlatPiece]:
    cuts = sorted(rng.randint(0, m * n) for _ in range(world - 1))
    bounds = [0, *cuts, m * n]
    return [FlatPiece(bounds[r], bounds[r + 1]) for r in range(world)]


def partitions(m: int, n: int, world: int, rng: random.Random):
    yield "flat", random_flat_pieces(m, n, world, rng)
    yield "rows", MatrixLayout.row_chunks((m, n), world, 0).pieces
    yield "cols", MatrixLayout.col_chunks((m, n), world, 0).pieces
    # ZeRO-like equal partitions of a padded buffer in which the matrix starts mid-partition
    start, pad = rng.randint(0, 7), rng.randint(0, 5)
    total = start + m * n + pad
    part = -(-total // world)
    yield (
        "zero",
        [
            FlatPiece(
                min(max(start, r * part), start + m * n) - start,
                max(min(start + m * n, (r + 1) * part), min(max(start, r * part), start + m * n)) - start,
            )
            for r in range(world)
        ],
    )


def simulate(layouts: list[MatrixLayout], full: torch.Tensor, axis: int, weight: torch.Tensor | None):
    """Sum partials only over split indices, as Round does; a non-split index keeps its only toucher's value."""
    parts = []
    for lay in layouts:
        local = local_piece(lay, full)
        parts.append(row_sums(lay, local, weight) if axis == 0 else col_sums(lay, local, weight))
    plan = layouts[0].axis_plan(axis)
    results = []
    for r in range(len(layouts)):
        out = parts[r].clone()
        if plan.split is not None:
            total = sum(parts)
            out[plan.split] = total[plan.split]
        results.append(out)
    return results


def local_piece(lay: MatrixLayout, full: torch.Tensor) -> torch.Tensor:
    local = torch.empty(lay.local_numel, dtype=full.dtype)
    for b, view in lay.views(local):
        view.copy_(full[b.row : b.row + b.height, b.col : b.col + b.width])
    return local


@pytest.mark.parametrize("seed", range(20))
def test_partial_sums_are_exact_on_every_partition(seed: int) -> None:
    rng = random.Random(seed)
    m, n, world = rng.randint(1, 9), rng.randint(1, 9), rng.randint(1, 5)
    full = torch.randn(m, n, dtype=torch.float64)
    for kind, pieces in partitions(m, n, world, rng):
        layouts = [MatrixLayout((m, n), pieces, r, group=object()) for r in range(world)]
        assert sum(l.local_numel for l in layouts) == m * n
        wr, wc = torch.rand(m, dtype=torch.float64), torch.rand(n, dtype=torch.float64)
        rows = simulate(layouts, full, 0, wc)
        cols = simulate(layouts, full, 1, wr)
        for r, lay in enumerate(layouts):
            mine_rows = {b.row + i for b in lay.blocks for i in range(b.height)}
            mine_cols = {b.col + j for b in lay.blocks for j in range(b.width)}
            for i in mine_rows:
                torch.testing.assert_close(rows[r][i], (full[i] * wc).sum(), msg=f"{kind} row {i}")
            for j in mine_cols:
                torch.testing.assert_close(cols[r][j], (full[:, j] * wr).sum(), msg=f"{kind} col {j}")
        # owner masks count each index exactly once across ranks
        for axis in (0, 1):
            size = (m, n)[axis]
            counts = torch.zeros(size)
            for lay in layouts:
                owned = lay.axis_plan(axis).owned
                counts += torch.ones(size) if isinstance(owned, slice) else owned.float()
            if not layouts[0].axis_plan(axis).replicated:
                assert torch.equal(counts, torch.ones(size)), (kind, axis)


def test_flat_piece_blocks_head_full_tail() -> None:
    lay = MatrixLayout((5, 7), [FlatPiece(0, 32), FlatPiece(32, 35)], rank=0, group=object())
    assert [tuple(b) for b in lay.blocks] == [(0, 0, 4, 7, 0), (4, 0, 1, 4, 28)]
    other = MatrixLayout((5, 7), [FlatPiece(0, 32), FlatPiece(32, 35)], rank=1, group=object())
    assert [tuple(b) for b in other.blocks] == [(4, 4, 1, 3, 0)]
    plan = lay.axis_plan(0)
    assert plan.split.tolist() == [4]  # only the cut row crosses the network
    assert lay.axis_plan(1).split == slice(None)


def test_row_shards_need_no_row_reduction_and_empty_shards_are_fine() -> None:
    lays = [MatrixLayout.row_chunks((4, 3), 3, r, group=object()) for r in range(3)]
    assert [l.local_numel for l in lays] == [6, 6, 0]
    assert lays[0].axis_plan(0).split is None
    assert lays[2].blocks == ()


def test_column_pieces() -> None:
    lay = MatrixLayout((3, 8), [ColPiece(0, 4), ColPiece(4, 8)], rank=1, group=object())
    assert [tuple(b) for b in lay.blocks] == [(0, 4, 3, 4, 0)]
    assert lay.axis_plan(1).split is None and lay.axis_plan(0).split == slice(None)


def test_pieces_must_cover_the_matrix() -> None:
    with pytest.raises(ValueError, match="cover"):
        MatrixLayout((2, 3), [FlatPiece(0, 4)])


def grid_pieces(m: int, n: int, row_cuts: list[int], col_cuts: list[int]) -> list:
    """Rectangles of a grid (FSDP2 rows x tensor-parallel columns), rank = row block x columns + column block."""
    from shardopt.sharding import RectPiece

    rb, cb = [0, *row_cuts, m], [0, *col_cuts, n]
    return [RectPiece(rb[i], rb[i + 1], cb[j], cb[j + 1]) for i in range(len(rb) - 1) for j in range(len(cb) - 1)]


@pytest.mark.parametrize("seed", range(10))
def test_rectangular_pieces_of_two_mesh_dimensions(seed: int) -> None:
    """Blocks of a grid (DTensors sharded over two mesh dimensions, uneven and empty ones included): partial
    sums over rows and columns are exact, every index is owned once, and row plans move pieces to blocks and
    back exactly."""
    from shardopt.sharding.blocks import RowPlan

    rng = random.Random(seed)
    m, n = rng.randint(1, 9), rng.randint(2, 9)
    pieces = grid_pieces(
        m,
        n,
        sorted(rng.randint(0, m) for _ in range(rng.randint(0, 2))),
        sorted(rng.randint(0, n) for _ in range(rng.randint(1, 2))),
    )
    world = len(pieces)
    layouts = [MatrixLayout((m, n), pieces, r, group=object()) for r in range(world)]
    full = torch.randn(m, n, dtype=torch.float64)
    wr, wc = torch.rand(m, dtype=torch.float64), torch.rand(n, dtype=torch.float64)
    rows, cols = simulate(layouts, full, 0, wc), simulate(layouts, full, 1, wr)
    for r, lay in enumerate(layouts):
        for b in lay.blocks:
            for i in range(b.row, b.row + b.height):
                torch.testing.assert_close(rows[r][i], (full[i] * wc).sum())
            for j in range(b.col, b.col + b.width):
                torch.testing.assert_close(cols[r][j], (full[:, j] * wr).sum())
    for transpose in (False, True):
        plans = [RowPlan.aligned(lay, transpose) for lay in layouts]
        a = full.T if transpose else full
        local = [local_piece(lay, full) for lay in layouts]
        for d, plan in enumerate(plans):
            a0, a1 = plan.rows()
            block = torch.zeros(a1 - a0, a.shape[1], dtype=full.dtype)
            for s in range(world):
                parts = plans[s].pack_piece(local[s], d)
                if parts:
                    plan.unpack_into_block(block, s, torch.cat(parts))
            assert torch.equal(block, a[a0:a1])


def test_rectangular_pieces_in_checkpoint_indexes() -> None:
    from shardopt.checkpoint.files import _piece, piece_spec
    from shardopt.sharding import RectPiece

    piece = RectPiece(2, 5, 1, 4)
    assert piece_spec(piece) == ["rect", 2, 5, 1, 4] and _piece(*piece_spec(piece)) == piece
    assert _piece("flat", 0, 6) == FlatPiece(0, 6) and _piece("cols", 1, 3) == ColPiece(1, 3)
