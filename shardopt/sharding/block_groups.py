"""Grouped execution of a step's matrix pieces: kernels per block *shape*, not per matrix.

A rank's piece of a matrix is at most three ``Block``s (``MatrixLayout.blocks``): whole matrices (single
process, DDP), whole-row blocks (FSDP2 ``Shard(0)``), column blocks (``Shard(1)``), and for ZeRO flat
partitions whole matrices plus, at the partition's two ends, a partial head row, a run of full rows and a
partial tail row. ``BlockGroups`` puts the blocks of all matrices of a step that have the same ``(height,
width)`` into one group and runs every statistic of the group as one batched kernel on a ``(B, h, w)`` stack:

* per-matrix row and column vectors live concatenated (``rows``: all matrices' rows, ``cols``: all columns);
  a block's rows and columns are index tensors into them, so row sums, column sums (weighted or squared),
  scaling by row/column vectors and the gathering of weights are one op per group, and the partial sums are
  scattered into the concatenated vectors with one ``index_add_`` per group;
* per-matrix scalars (a squared norm, a limiter factor) are vectors over the matrices; ``item_of_row`` and
  ``item_of_col`` spread them over lines;
* the split indices of every matrix (``MatrixLayout.axis_plan``) are concatenated per process group, so a
  ``Round`` gets one entry per process group and axis instead of one per matrix: the same collectives, in the
  same order, with the same bytes.

Every transformer depth has the same few shapes, so the number of groups does not grow with the number of
layers; ZeRO's partial rows add a few small groups per partition boundary. Large blocks on a CPU take the
per-block kernels of ``primitives`` inside their group (the Python overhead is negligible there, and those
kernels are cache-friendlier than batched strided reductions).
"""

from __future__ import annotations

from typing import Any, Sequence, cast

import torch

from .comm import Round
from .layout import MatrixLayout
from .primitives import col_sumsq, scale_block, stack_col_sumsq

__all__ = ["BlockGroups", "Group", "blocks_of"]

#: blocks with at least this many elements use the per-block kernels on a CPU
CPU_BLOCK_LIMIT = 1 << 16
#: a group of blocks in one flat source (ZeRO) with at most this many elements in all is stacked by one
#: ``index_select`` with a static element index (8 bytes an element, so only for small blocks) instead of
#: one view per block
INDEX_ELEMENTS = 1 << 20


class Group:
    """The blocks of one ``(height, width)`` shape: which matrix, where in its local piece, which lines."""

    __slots__ = (
        "h",
        "w",
        "items",
        "starts",
        "whole",
        "row_index",
        "col_index",
        "row_flat",
        "col_flat",
        "big",
        "item_tensor",
        "owners",
        "all_whole",
        "one_source",
        "elements",
        "kept_views",
        "row_starts",
        "col_starts",
    )

    # set by ``BlockGroups`` once every block of the group is known
    row_index: torch.Tensor  # (B, h): each block's rows in the concatenated row vector
    col_index: torch.Tensor  # (B, w)
    row_flat: torch.Tensor
    col_flat: torch.Tensor
    item_tensor: torch.Tensor
    all_whole: bool
    row_starts: list[int]  # each block's first row in the concatenated row vector (host ints: row_index[:, 0])
    col_starts: list[int]

    def __init__(self, h: int, w: int):
        self.h, self.w = h, w
        self.items: list[int] = []
        self.starts: list[int] = []  # offset of the block in its source tensor's local 1-D elements
        self.whole: list[bool] = []  # the block is its source tensor's whole local piece
        self.owners: list[int] = []  # the source tensor of each block
        self.big = h * w >= CPU_BLOCK_LIMIT
        self.one_source = False  # every block in the same source tensor (a ZeRO flat partition)
        self.elements: torch.Tensor | None = None  # that source's elements of the blocks, in stack order
        #: per role ("param", "state"): the views of a persistent source, with the source they were made from
        self.kept_views: dict[str, tuple[tuple, list[torch.Tensor]]] = {}


class BlockGroups:
    """Static grouping of the blocks of ``layouts`` (one per matrix, in step order), built once per plan.

    Data is passed per *source tensor* (a stepped tensor's local elements): matrix ``i`` lives in source
    ``owners[i]`` from element ``offsets[i]``; ``whole[i]`` says it is all of that source (then a block that
    is all of the matrix is the source itself, viewed 2-D). Defaults: one source per matrix, whole.
    """

    def __init__(
        self,
        layouts: Sequence[MatrixLayout],
        device: torch.device | str = "cpu",
        owners: Sequence[int] | None = None,
        offsets: Sequence[int] | None = None,
        whole: Sequence[bool] | None = None,
    ):
        self.layouts = list(layouts)
        self.owners = list(owners) if owners is not None else list(range(len(self.layouts)))
        offsets = list(offsets) if offsets is not None else [0] * len(self.layouts)
        whole = list(whole) if whole is not None else [True] * len(self.layouts)
        self.device = torch.device(device)
        ms = [lay.shape[0] for lay in self.layouts]
        ns = [lay.shape[1] for lay in self.layouts]
        self.ms, self.ns = ms, ns
        self.n_items = len(self.layouts)
        self.n_rows, self.n_cols = sum(ms), sum(ns)
        row_base, col_base, r, c = [], [], 0, 0
        for m, n in zip(ms, ns):
            row_base.append(r)
            col_base.append(c)
            r += m
            c += n
        self.row_base, self.col_base = row_base, col_base
        groups: dict[tuple[int, int], Group] = {}
        for i, lay in enumerate(self.layouts):
            blocks = lay.blocks
            for b in blocks:
                g = groups.get((b.height, b.width))
                if g is None:
                    g = groups[(b.height, b.width)] = Group(b.height, b.width)
                g.items.append(i)
                g.owners.append(self.owners[i])
                g.starts.append(offsets[i] + b.offset)
                g.whole.append(whole[i] and len(blocks) == 1 and b.height * b.width == lay.local_numel)
        dev = self.device
        for (h, w), g in groups.items():
            rows, cols = [], []
            for i, start in zip(g.items, g.starts):
                b = next(b for b in self.layouts[i].blocks if offsets[i] + b.offset == start)
                rows.append(row_base[i] + b.row)
                cols.append(col_base[i] + b.col)
            g.row_starts, g.col_starts = rows, cols
            g.row_index = (torch.tensor(rows, dtype=torch.int64)[:, None] + torch.arange(h)).to(dev)
            g.col_index = (torch.tensor(cols, dtype=torch.int64)[:, None] + torch.arange(w)).to(dev)
            g.row_flat = g.row_index.reshape(-1)
            g.item_tensor = torch.tensor(g.items, dtype=torch.int64).to(dev)
            g.all_whole = all(g.whole)
            g.col_flat = g.col_index.reshape(-1)
            g.one_source = len(set(g.owners)) == 1 and not g.all_whole
            if g.one_source and len(g.items) * h * w <= INDEX_ELEMENTS:
                starts = torch.tensor(g.starts, dtype=torch.int64)[:, None]
                g.elements = (starts + torch.arange(h * w)).reshape(-1).to(dev)
        self.groups = list(groups.values())
        idx = torch.arange(self.n_items)
        self.item_of_row = torch.repeat_interleave(idx, torch.tensor(ms, dtype=torch.int64)).to(dev)
        self.item_of_col = torch.repeat_interleave(idx, torch.tensor(ns, dtype=torch.int64)).to(dev)
        #: each matrix's number of rows and of columns: the segments of the concatenated line vectors
        self._line_counts = (torch.tensor(ms, dtype=torch.int64).to(dev), torch.tensor(ns, dtype=torch.int64).to(dev))
        #: length of each row (n of its matrix) and of each column (m), as fp32 line vectors
        #: m of each matrix, fp32
        self.item_rows = torch.tensor(ms, dtype=torch.float32).to(dev)
        self.row_length = torch.tensor(ns, dtype=torch.float32).to(dev)[self.item_of_row]
        self.col_length = torch.tensor(ms, dtype=torch.float32).to(dev)[self.item_of_col]
        self._reduction_plan()

    # ------------------------------------------------------------------ communication plan
    def _reduction_plan(self) -> None:
        """Per process group and axis: the concatenated split indices; per axis: the owner mask that counts
        each line once in a global sum; per process group: the matrices whose sums are all-reduced."""
        dev = self.device
        self.split: dict[int, dict[int, tuple[Any, torch.Tensor]]] = {0: {}, 1: {}}
        self.owned: dict[int, torch.Tensor | None] = {}
        self.sum_items: dict[int, tuple[Any, torch.Tensor]] = {}
        self.replicated_sums = all(lay.group is None for lay in self.layouts)
        for axis, bases, sizes in ((0, self.row_base, self.ms), (1, self.col_base, self.ns)):
            parts: dict[int, tuple[Any, list[torch.Tensor]]] = {}
            owned = torch.ones(sum(sizes), dtype=torch.bool)
            any_owned = False
            for i, lay in enumerate(self.layouts):
                plan = lay.axis_plan(axis)
                if plan.split is not None:
                    split = torch.arange(sizes[i]) if isinstance(plan.split, slice) else plan.split.cpu()
                    parts.setdefault(id(lay.group), (lay.group, []))[1].append(split + bases[i])
                if not plan.replicated:
                    any_owned = True
                    mask = torch.zeros(sizes[i], dtype=torch.bool)
                    mask[plan.owned] = True
                    owned[bases[i] : bases[i] + sizes[i]] = mask
            self.split[axis] = {k: (grp, torch.cat(ix).to(dev)) for k, (grp, ix) in parts.items()}
            self.owned[axis] = owned.to(dev) if any_owned else None
            # which matrices register an owner-counted sum on this axis (not replicated after reduction)
        summed: dict[int, tuple[Any, list[int]]] = {}
        for i, lay in enumerate(self.layouts):
            if lay.group is not None:
                summed.setdefault(id(lay.group), (lay.group, []))[1].append(i)
        self.sum_items = {k: (grp, torch.tensor(ix, dtype=torch.int64).to(dev)) for k, (grp, ix) in summed.items()}
        self.axis_sum_items: dict[int, dict[int, tuple[Any, torch.Tensor]]] = {}
        for axis in (0, 1):
            found: dict[int, tuple[Any, list[int]]] = {}
            for i, lay in enumerate(self.layouts):
                if not lay.axis_plan(axis).replicated:
                    found.setdefault(id(lay.group), (lay.group, []))[1].append(i)
            self.axis_sum_items[axis] = {
                k: (grp, torch.tensor(ix, dtype=torch.int64).to(dev)) for k, (grp, ix) in found.items()
            }

    def add_axis(self, rnd: Round, vector: torch.Tensor, axis: int) -> None:
        """Register the split indices of all matrices' partial line sums (``vector``: concatenated rows or
        columns) in ``rnd``: one entry per process group."""
        for grp, index in self.split[axis].values():
            rnd._bucket(grp).append((vector, index))

    def add_sums(self, rnd: Round, scalars: torch.Tensor) -> None:
        """Register per-matrix partial scalars (a vector over the matrices) of every sharded matrix."""
        for grp, index in self.sum_items.values():
            rnd._bucket(grp).append((scalars, index))

    def axis_sums(self, values: torch.Tensor, axis: int, rnd: Round) -> torch.Tensor:
        """Per-matrix global ``sum`` of a completed line vector (``primitives.axis_sum`` for all matrices):
        each line counted by its owner; the sums of matrices whose axis is not replicated join ``rnd``."""
        owned = self.owned[axis]
        if owned is not None:
            values = torch.where(owned, values, torch.zeros_like(values))
        out = self.item_sums(values, axis)
        for grp, index in self.axis_sum_items[axis].values():
            rnd._bucket(grp).append((out, index))
        return out

    # ------------------------------------------------------------------ per-matrix slices of line vectors
    def line_buffer(self, key: str, axis: int) -> torch.Tensor:
        """A vector over every matrix's rows (axis 0) or columns (axis 1), kept between steps under ``key``, whose
        per-matrix slices ``segments`` makes once. A step writes a concatenated statistic into it to hand its
        slices to foreach kernels: on a CPU, splitting a vector into many matrices' slices costs as much as a
        kernel over them. Its contents are the caller's for the length of a step only."""
        buffers = self.__dict__.setdefault("_line_buffers", {})
        entry = buffers.get(key)
        if entry is None or entry[1] != axis:
            buf = torch.zeros(self.n_rows if axis == 0 else self.n_cols, device=self.device)
            entry = buffers[key] = [buf, axis, list(buf.split(self.ms if axis == 0 else self.ns)), None]
        return entry[0]

    def segments(self, vector: torch.Tensor, axis: int, column: bool = False) -> list[torch.Tensor]:
        """Per matrix, its slice of ``vector`` (its rows for axis 0, its columns for axis 1): made once for a
        ``line_buffer``, split otherwise. ``column``: each slice as an ``m x 1`` column (a row scale that
        broadcasts over the matrix's columns)."""
        for entry in self.__dict__.get("_line_buffers", {}).values():
            if entry[0] is vector and entry[1] == axis:
                if not column:
                    return entry[2]
                if entry[3] is None:
                    entry[3] = [v.unsqueeze(1) for v in entry[2]]
                return entry[3]
        return list((vector.unsqueeze(1) if column else vector).split(self.ms if axis == 0 else self.ns))

    def item_sums(self, values: torch.Tensor, axis: int) -> torch.Tensor:
        """Per-matrix sums of a line vector (rows for axis 0, columns for axis 1): a segmented sum, whose order is
        fixed, so a CUDA step is reproducible bit for bit (an ``index_add_`` adds with atomics there, in whatever
        order the threads come). ``unsafe``: the counts are ours and right, and checking them reads the device."""
        return torch.segment_reduce(values, "sum", lengths=self._line_counts[axis], unsafe=True)

    # ------------------------------------------------------------------ data
    # A group's data is a ``(B, h, w)`` stack, or, for blocks of ``CPU_BLOCK_LIMIT`` elements or more on a CPU,
    # the list of the blocks' 2-D views (no copy of the gradients: at such sizes a kernel per block costs
    # nothing next to its data, and a stack would add a pass over them).
    def stack(self, tensors: Sequence[torch.Tensor | None], dtype: torch.dtype | None = torch.float32) -> list:
        """Per group: a ``(B, h, w)`` tensor (or, for large CPU blocks, a list of 2-D views) from the sources'
        local elements (``tensors[t]``: source ``t``, contiguous, any shape; ``None``: zeros)."""
        out: list[torch.Tensor | list[torch.Tensor]] = []
        for g in self.groups:
            if g.elements is not None and not self.listed(g):
                src = tensors[g.owners[0]]
                if src is not None:  # one gather for the whole group, no view per block
                    x = src.reshape(-1).index_select(0, g.elements).view(len(g.items), g.h, g.w)
                    out.append(x if dtype is None or x.dtype == dtype else x.to(dtype))
                    continue
            blocks = self.block_views(tensors, g, fill=True)
            if self.listed(g):
                out.append([b if dtype is None or b.dtype == dtype else b.to(dtype) for b in blocks])
                continue
            x = blocks[0].unsqueeze(0) if len(blocks) == 1 else torch.stack(blocks)
            out.append(x if dtype is None or x.dtype == dtype else x.to(dtype))
        return out

    def listed(self, g: Group) -> bool:
        """Whether group ``g``'s data is a list of blocks (large blocks on a CPU) rather than a stack."""
        return g.big and self.device.type == "cpu"

    def block_views(
        self, tensors: Sequence[torch.Tensor | None], g: Group, fill: bool = False, persistent: str | None = None
    ) -> list[torch.Tensor]:
        """The 2-D views of group ``g``'s blocks in ``tensors`` (the sources' local elements); blocks of a
        ``None`` source are zeros with ``fill``, else left out. ``persistent`` names sources that live across
        steps (``"param"``, ``"state"``): a flat source's views are kept for that role and reused while it is
        the same tensor at the same address; a new source replaces them, so at most the last one is kept."""
        h, w = g.h, g.w
        if g.all_whole:  # whole sources of this shape (single process, FSDP2 row shards): the tensors themselves
            picked = [tensors[o] for o in g.owners]
            if all(t is not None and t.shape == (h, w) for t in picked):
                return cast("list[torch.Tensor]", picked)  # none is None (checked)
        if persistent and g.one_source:
            src = tensors[g.owners[0]]
            if src is not None:
                key = (id(src), src.data_ptr(), src.dtype)
                kept = g.kept_views.get(persistent)
                if kept is None or kept[0] != key:
                    flat = src.reshape(-1)
                    kept = g.kept_views[persistent] = (key, [flat[s : s + h * w].view(h, w) for s in g.starts])
                return list(kept[1])
        out = []
        for t, start, whole in zip(map(tensors.__getitem__, g.owners), g.starts, g.whole):
            if t is None:
                if not fill:
                    continue
                out.append(torch.zeros(h, w, device=self.device))
            elif whole:
                out.append(t if t.shape == (h, w) else t.view(h, w))
            else:
                out.append(t.reshape(-1)[start : start + h * w].view(h, w))
        return out

    @staticmethod
    def square(stacks: Sequence) -> list:
        """``X * X`` of every group (a new tensor or list)."""
        return [[b * b for b in x] if isinstance(x, list) else x * x for x in stacks]

    def row_sums(self, stacks: Sequence, col_weight: torch.Tensor | None = None, square: bool = False) -> torch.Tensor:
        """Partial row sums of all matrices, concatenated (``primitives.row_sums`` for every matrix)."""
        out = torch.zeros(self.n_rows, device=self.device)
        for g, x in zip(self.groups, stacks):
            if isinstance(x, list):
                if square:
                    part = torch.stack([torch.linalg.vector_norm(b, dim=1).square() for b in x])
                elif col_weight is None:
                    part = torch.stack([b.sum(1) for b in x])
                else:
                    part = torch.stack([b @ wb for b, wb in zip(x, col_weight[g.col_index])])
            elif square:
                part = torch.linalg.vector_norm(x, dim=2).square()
            elif col_weight is None:
                part = x.sum(2)
            else:
                part = torch.bmm(x, col_weight[g.col_index].unsqueeze(2)).squeeze(2)
            out.index_add_(0, g.row_flat, part.reshape(-1))
        return out

    def col_sums(self, stacks: Sequence, row_weight: torch.Tensor | None = None, square: bool = False) -> torch.Tensor:
        """Partial column sums of all matrices, concatenated (``primitives.col_sums`` for every matrix)."""
        out = torch.zeros(self.n_cols, device=self.device)
        for g, x in zip(self.groups, stacks):
            if isinstance(x, list):
                if square:
                    part = torch.stack([col_sumsq(b) for b in x])
                elif row_weight is None:
                    part = torch.stack([b.sum(0) for b in x])
                else:
                    part = torch.stack([wb @ b for b, wb in zip(x, row_weight[g.row_index])])
            elif square:
                part = stack_col_sumsq(x)
            elif row_weight is None:
                part = x.sum(1)
            else:
                part = torch.bmm(row_weight[g.row_index].unsqueeze(1), x).squeeze(1)
            out.index_add_(0, g.col_flat, part.reshape(-1))
        return out

    def scale(
        self,
        stacks: Sequence,
        row_scale: torch.Tensor | None = None,
        col_scale: torch.Tensor | None = None,
        out: Sequence | None = None,
    ) -> list:
        """``diag(row_scale) X diag(col_scale)`` of every block (``primitives.scale_into``): into ``out`` (data
        shaped like ``stacks``, e.g. a temporary that is no longer needed), else new tensors."""
        result = []
        for k, (g, x) in enumerate(zip(self.groups, stacks)):
            r = None if row_scale is None else row_scale[g.row_index]
            c = None if col_scale is None else col_scale[g.col_index]
            if isinstance(x, list):
                dst = out[k] if out is not None else [torch.empty_like(b) for b in x]
                for j, (b, d) in enumerate(zip(x, dst)):
                    scale_block(b, d, None if r is None else r[j][:, None], None if c is None else c[j][None, :])
                result.append(dst)
            else:
                dst = out[k] if out is not None else torch.empty_like(x)
                scale_block(x, dst, None if r is None else r.unsqueeze(2), None if c is None else c.unsqueeze(1))
                result.append(dst)
        return result


def blocks_of(x: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
    """A group's data as a list of 2-D blocks (views)."""
    return x if isinstance(x, list) else list(x.unbind(0))
