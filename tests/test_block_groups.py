"""Grouped steps (``shardopt.sharding.block_groups``): the block-shape groups compute what the per-matrix
primitives compute, for whole matrices, ZeRO flat ranges that start and end mid-row, and column shards,
with stacked groups and with the per-block lists of large CPU blocks."""

from __future__ import annotations

import pytest
import torch

import shardopt.sharding.block_groups as grouped
from shardopt.sharding import col_sums, row_sums, scale_into
from shardopt.sharding.block_groups import BlockGroups, blocks_of
from shardopt.sharding.layout import ColPiece, FlatPiece, MatrixLayout


def _layouts():
    shapes = [(5, 7), (5, 7), (3, 4), (6, 7), (5, 7), (4, 9)]
    pieces = [
        [FlatPiece(0, 35)],  # whole
        [FlatPiece(3, 33), FlatPiece(33, 35), FlatPiece(0, 3)],  # mid-row start and end
        [FlatPiece(0, 0), FlatPiece(0, 12)],  # empty on rank 0
        [FlatPiece(7, 28), FlatPiece(0, 7), FlatPiece(28, 42)],  # whole rows
        [FlatPiece(2, 5), FlatPiece(0, 2), FlatPiece(5, 35)],  # inside one row
        [ColPiece(2, 6), ColPiece(0, 2), ColPiece(6, 9)],  # column shard
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
    for kw_g, kw_p in [
        ({}, lambda i: {}),
        ({"square": True}, lambda i: {"square": True}),
        ({"col_weight": colw}, lambda i: {"col_weight": cw[i]}),
    ]:
        got = bg.row_sums(data, **kw_g).split(bg.ms)
        for i, (lay, a) in enumerate(zip(layouts, pieces)):
            torch.testing.assert_close(got[i], row_sums(lay, a, **kw_p(i)), rtol=1e-6, atol=1e-6)
    for kw_g, kw_p in [
        ({}, lambda i: {}),
        ({"square": True}, lambda i: {"square": True}),
        ({"row_weight": roww}, lambda i: {"row_weight": rw[i]}),
    ]:
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


def _flat_partition(rank: int):
    """Three matrices concatenated into one flat buffer cut in two at element 50 (a ZeRO-2 partition):
    rank 0 holds the first whole and the second's head, rank 1 the second's tail and the third whole."""
    shapes, offsets, total, cut = [(5, 7), (4, 9), (5, 7)], [0, 35, 71], 106, 50
    layouts = []
    for (m, n), off in zip(shapes, offsets):
        pieces = [
            FlatPiece(max(0, lo - off), max(0, min(m * n, hi - off)) if hi > off else 0)
            for lo, hi in ((0, cut), (cut, total))
        ]
        pieces = [p if p.hi > p.lo else FlatPiece(0, 0) for p in pieces]
        layouts.append(MatrixLayout((m, n), pieces, rank=rank))
    mine = [0, 50] if rank == 0 else [50, 106]
    local = [lay.local_numel for lay in layouts]
    starts, pos = [], 0
    for k in local:
        starts.append(pos)
        pos += k
    assert pos == mine[1] - mine[0]
    return layouts, starts, pos


@pytest.mark.parametrize("rank", [0, 1])
def test_flat_partition_stack_and_kept_views_match_block_views(rank):
    """A ZeRO flat partition is one source: its small blocks stack with one index_select, and the views of a
    persistent source are kept until the source changes (another tensor, or the same one moved)."""
    layouts, starts, size = _flat_partition(rank)
    bg = BlockGroups(layouts, owners=[0] * len(layouts), offsets=starts, whole=[False] * len(layouts))
    src = torch.randn(size)
    stacked = bg.stack([src])
    for g, x in zip(bg.groups, stacked):
        assert g.one_source and g.elements is not None
        torch.testing.assert_close(x, torch.stack(bg.block_views([src], g)), rtol=0, atol=0)
    for g in bg.groups:
        views = bg.block_views([src], g, persistent="param")
        again = bg.block_views([src], g, persistent="param")
        assert all(a is b for a, b in zip(views, again))  # kept, not remade
        assert all(v.data_ptr() == w.data_ptr() for v, w in zip(views, bg.block_views([src], g)))
        other = src.clone()
        moved = bg.block_views([other], g, persistent="param")
        assert all(m.data_ptr() != v.data_ptr() for m, v in zip(moved, views))
        for v in moved:
            v.add_(1.0)  # views write into their source
        assert torch.equal(torch.stack(bg.block_views([other], g)), torch.stack(bg.block_views([src], g)) + 1)


def test_apply_scaled_with_no_matrix_on_this_rank():
    """A param group can hold no matrix on a rank (ZeRO-3 sub-groups, ZeroRedundancyOptimizer's shares): the
    step of its whole-matrix path must do nothing rather than call a foreach kernel on empty lists."""
    import shardopt

    model = torch.nn.Linear(4, 4, bias=False)
    opt = shardopt.create_optimizer(model, "dasgo")
    opt.param_groups[0]["params"] = []  # as an engine leaves a group whose matrices live on other ranks
    opt.step()


def test_line_buffer_segments_are_made_once_and_write_through():
    """A line buffer's per-matrix slices are made once (a split per step costs a kernel's time on a CPU) and
    are views of it; any other vector is split as it is."""
    layouts = _layouts()
    bg = BlockGroups(layouts)
    for axis, sizes in ((0, bg.ms), (1, bg.ns)):
        buf = bg.line_buffer("x", axis)
        assert buf.shape == (sum(sizes),)
        assert bg.line_buffer("x", axis) is buf
        first = bg.segments(buf, axis)
        assert bg.segments(buf, axis) is first
        assert [s.numel() for s in first] == sizes
        buf.copy_(torch.arange(buf.numel(), dtype=torch.float32))
        assert torch.equal(torch.cat(first), buf)  # views, not copies
        cols = bg.segments(buf, axis, column=True)
        assert bg.segments(buf, axis, column=True) is cols
        assert all(c.shape == (n, 1) and c.data_ptr() == f.data_ptr() for c, f, n in zip(cols, first, sizes))
        other = buf.clone()
        split = bg.segments(other, axis)
        assert split is not first and torch.equal(torch.cat(split), other)
        assert [c.shape for c in bg.segments(other, axis, column=True)] == [(n, 1) for n in sizes]
    assert bg.line_buffer("x", 1).shape == (bg.n_cols,)  # a key asked on another axis gets its own buffer


def test_apply_items_takes_whole_tensor_shaped_updates():
    """``apply_items`` adds an update shaped like a plain whole-matrix tensor to the tensor itself, and a 1-D or
    otherwise shaped one to the matrix's flat piece: both give ``W - lr U``."""
    import shardopt
    from shardopt.optim.items import apply_items

    model = torch.nn.Sequential(torch.nn.Linear(4, 3, bias=False), torch.nn.Linear(3, 5, bias=False))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = shardopt.create_optimizer(model, "sumo")
    group = next(g for g in opt.param_groups if g["treatment"] == "sumo")
    items = opt._matrix_items(group)
    before = [it.tensor.detach().clone() for it in items]
    updates = [torch.randn(it.layout.shape) for it in items]
    shaped = [updates[0], updates[1].reshape(-1)]  # one tensor-shaped, one flat
    with torch.no_grad():  # as inside optimizer.step()
        apply_items(items, shaped, 0.5)
    for it, w0, u in zip(items, before, updates):
        torch.testing.assert_close(it.tensor.detach(), w0 - 0.5 * u, rtol=0, atol=1e-6)


def test_masked_reciprocal_and_rsqrt_select_only_positive_lanes():
    """Zero, negative, NaN and infinite statistics give 0, never NaN or inf; positive ones are the plain
    quotient and root (the unselected lanes may compute inf or NaN, which ``where`` drops)."""
    from shardopt.sharding import masked_reciprocal, masked_rsqrt

    x = torch.tensor([0.0, -1.0, 4.0, float("nan"), 1e-30, float("inf"), 2.5])
    num = torch.full_like(x, 3.0)
    expect = {
        "reciprocal": torch.tensor([0.0, 0.0, 0.25, 0.0, 1e30, 0.0, 0.4]),
        "reciprocal x2": torch.tensor([0.0, 0.0, 0.5, 0.0, 2e30, 0.0, 0.8]),
        "reciprocal by tensor": torch.tensor([0.0, 0.0, 0.75, 0.0, 3e30, 0.0, 1.2]),
        "rsqrt": torch.where(x > 0, torch.rsqrt(x), 0.0),
    }
    got = {
        "reciprocal": masked_reciprocal(x),
        "reciprocal x2": masked_reciprocal(x, 2.0),
        "reciprocal by tensor": masked_reciprocal(x, num),
        "rsqrt": masked_rsqrt(x),
    }
    for key, value in got.items():
        assert torch.isfinite(value).all(), key
        torch.testing.assert_close(value, expect[key], rtol=1e-7, atol=0, msg=key)
    out = torch.full_like(x, 7.0)
    assert masked_rsqrt(x, 2.0, out=out) is out
    torch.testing.assert_close(out, 2.0 * expect["rsqrt"], rtol=1e-7, atol=0)
