"""Grouped steps (``shardopt.sharding.grouped``): the block-shape groups compute what the per-matrix
primitives compute, for whole matrices, ZeRO flat ranges that start and end mid-row, and column shards,
with stacked groups and with the per-block lists of large CPU blocks."""
from __future__ import annotations

import pytest
import torch

import shardopt.sharding.grouped as grouped
from shardopt.sharding import col_sums, row_sums, scale_into
from shardopt.sharding.grouped import BlockGroups, blocks_of
from shardopt.sharding.layout import ColPiece, FlatPiece, MatrixLayout


def _layouts():
    shapes = [(5, 7), (5, 7), (3, 4), (6, 7), (5, 7), (4, 9)]
    pieces = [
        [FlatPiece(0, 35)],                     # whole
        [FlatPiece(3, 33), FlatPiece(33, 35), FlatPiece(0, 3)],  # mid-row start and end
        [FlatPiece(0, 0), FlatPiece(0, 12)],    # empty on rank 0
        [FlatPiece(7, 28), FlatPiece(0, 7), FlatPiece(28, 42)],  # whole rows
        [FlatPiece(2, 5), FlatPiece(0, 2), FlatPiece(5, 35)],    # inside one row
        [ColPiece(2, 6), ColPiece(0, 2), ColPiece(6, 9)],        # column shard
    ]
    return [MatrixLayout(s, p, rank=0) for s, p in zip(shapes, pieces)]


@pytest.mark.parametrize("limit", [1 << 16, 1])
def test_groups_match_primitives(monkeypatch, limit):
    monkeypatch.setattr(grouped, "CPU_BLOCK_LIMIT", limit)
    torch.manual_seed(0)
    layouts = _layouts()
    pieces = [torch.randn(lay.local_numel) for lay in layouts]
    bg = BlockGroups(layouts)
    data = bg.stack(pieces)
    assert all(isinstance(x, list) for x in data) == (limit == 1)
    colw = torch.rand(bg.n_cols)
    roww = torch.rand(bg.n_rows)
    cw = colw.split(bg.ns)
    rw = roww.split(bg.ms)
    for kw_g, kw_p in [({}, lambda i: {}), ({"square": True}, lambda i: {"square": True}),
                       ({"col_weight": colw}, lambda i: {"col_weight": cw[i]})]:
        got = bg.row_sums(data, **kw_g).split(bg.ms)
        for i, (lay, a) in enumerate(zip(layouts, pieces)):
            torch.testing.assert_close(got[i], row_sums(lay, a, **kw_p(i)), rtol=1e-6, atol=1e-6)
    for kw_g, kw_p in [({}, lambda i: {}), ({"square": True}, lambda i: {"square": True}),
                       ({"row_weight": roww}, lambda i: {"row_weight": rw[i]})]:
        got = bg.col_sums(data, **kw_g).split(bg.ns)
        for i, (lay, a) in enumerate(zip(layouts, pieces)):
            torch.testing.assert_close(got[i], col_sums(lay, a, **kw_p(i)), rtol=1e-6, atol=1e-6)
    scaled = bg.scale(data, roww, colw)
    out = [torch.zeros_like(a) for a in pieces]
    for g, x in zip(bg.groups, scaled):
        for view, blk in zip(bg.block_views(out, g), blocks_of(x)):
            view.copy_(blk)
    for i, (lay, a) in enumerate(zip(layouts, pieces)):
        torch.testing.assert_close(out[i], scale_into(lay, torch.empty_like(a), a, rw[i], cw[i]))
    torch.testing.assert_close(bg.item_sums(roww, 0), torch.stack([r.sum() for r in rw]))
