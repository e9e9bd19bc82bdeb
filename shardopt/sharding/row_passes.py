"""Cache-blocked passes over a step's matrices on a CPU: a line statistic's row and column halves in one read.

A CPU step is bound by memory traffic (ZeRO-Offload steps whole fp32 partitions there), and each eager op is a
pass over the partition. The fixed points of SinkGD and RACS alternate a row half (``r = P w``, a per-row scale
from it) and a column half (``c = P^T u``) over the squares ``P = G * G``: done as separate ops they read ``P``
twice a sweep and keep a partition-sized ``P``. Where every row of the rank's pieces is complete (no row index is
split across ranks: one process, DDP, FSDP2 row shards), a row's sum is final when its block is read, so
``row_block_pass`` takes each block a few rows at a time (``CHUNK_ELEMENTS``: cache-sized), squares them into a
cache-resident buffer, and runs the row sums, the row scale and the column sums on it while it is in cache: one
read of ``G`` a sweep, no partition-sized temporary. ``scaled_update`` writes ``W (1 - lr wd) - diag(r) G diag(c)``
the same way (one read of ``G`` and ``W``, one write of ``W``).

The sums are the same sums in another order (a column sum adds its row blocks' partial sums): results equal the
unblocked kernels to fp32 rounding. The collectives are the callers' and unchanged: with no split row index a row
round registers nothing. Small blocks (``CPU_BLOCK_LIMIT``) come stacked ``(B, h, w)`` and are fused per stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from .primitives import stack_col_sumsq

if TYPE_CHECKING:
    from .block_groups import BlockGroups

__all__ = [
    "CHUNK_ELEMENTS",
    "rows_complete",
    "row_block_pass",
    "scaled_update",
    "row_normalized_update",
    "lerp_col_energies",
]

#: elements of one row block (8 MiB of fp32): its squares are read again from the last-level cache, not memory. At
#: 350M, one thread, 2M elements gave the same 0.6x of the unblocked SinkGD/RACS step as 512K (L2-sized); with 2
#: threads on a loaded machine 512K blocks ran 3x slower than the unblocked kernels (four times the parallel
#: regions, each waiting for a descheduled thread), 2M blocks as fast as them
CHUNK_ELEMENTS = 1 << 21


def rows_complete(blocks: BlockGroups) -> bool:
    """Whether the fused passes apply: a CPU step whose every row is whole on this rank (no split row index)."""
    return blocks.device.type == "cpu" and not blocks.split[0]


def row_block_pass(
    blocks: BlockGroups,
    stacks: Sequence,
    weights: Sequence[torch.Tensor | None],
    row_scale: Callable[[torch.Tensor, Any], torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
    """One read of every block's squares ``P = X * X``: per column weight ``w`` (a concatenated column vector; None
    is ones) the row sums ``P w`` (complete: ``rows_complete``); with ``row_scale`` also ``u = row_scale(P w0,
    rows)`` (``rows`` a slice or an index tensor into the concatenated rows) and the partial column sums
    ``P^T u``. Returns ``(row sums per weight, u, column sums)``, concatenated over the matrices."""
    dev = blocks.device
    sums = [torch.zeros(blocks.n_rows, device=dev) for _ in weights]
    u_all = torch.zeros(blocks.n_rows, device=dev) if row_scale is not None else None
    cols = torch.zeros(blocks.n_cols, device=dev) if row_scale is not None else None
    for g, x in zip(blocks.groups, stacks):
        if not isinstance(x, list):  # small blocks, stacked: one fused sequence per stack
            a = x * x
            parts = [a.sum(2) if w is None else torch.bmm(a, w[g.col_index].unsqueeze(2)).squeeze(2) for w in weights]
            for s, part in zip(sums, parts):
                s.index_copy_(0, g.row_flat, part.reshape(-1))  # every row in one block: a copy, not a sum
            if row_scale is not None:
                assert u_all is not None and cols is not None
                u = row_scale(parts[0], g.row_index)
                u_all.index_copy_(0, g.row_flat, u.reshape(-1))
                cols.index_add_(0, g.col_flat, torch.bmm(u.unsqueeze(1), a).reshape(-1))
            continue
        row0, col0 = g.row_starts, g.col_starts
        step = max(1, CHUNK_ELEMENTS // g.w)
        buf = torch.empty(min(step, g.h), g.w, device=dev)
        for b, r0, c0 in zip(x, row0, col0):
            ws = [None if w is None else w[c0 : c0 + g.w] for w in weights]
            for lo in range(0, g.h, step):
                hi = min(lo + step, g.h)
                a = torch.mul(b[lo:hi], b[lo:hi], out=buf[: hi - lo])
                for s, w in zip(sums, ws):
                    if w is None:
                        torch.sum(a, 1, out=s[r0 + lo : r0 + hi])
                    else:
                        torch.mv(a, w, out=s[r0 + lo : r0 + hi])
                if row_scale is not None:
                    assert u_all is not None and cols is not None
                    rows = slice(r0 + lo, r0 + hi)
                    u = u_all[rows]
                    u.copy_(row_scale(sums[0][rows], rows))
                    cols[c0 : c0 + g.w].addmv_(a.T, u)
    return sums, u_all, cols


def scaled_update(
    blocks: BlockGroups,
    views: Sequence[Sequence[torch.Tensor]],
    stacks: Sequence,
    row_scale: torch.Tensor,
    col_scale: torch.Tensor,
    decay: torch.Tensor | float | None,
) -> None:
    """``W <- W * decay - diag(row_scale) X diag(col_scale)`` on every block (``views[k]``: group ``k``'s fp32
    parameter blocks, ``stacks[k]`` its data; ``decay`` a number, a 0-d tensor, or one factor per matrix, None for
    none), a few rows at a time: the update is never materialized."""
    dev = blocks.device
    for g, vs, x in zip(blocks.groups, views, stacks):
        row0, col0 = g.row_starts, g.col_starts
        xs = x if isinstance(x, list) else x.unbind(0)
        step = max(1, CHUNK_ELEMENTS // g.w)
        buf = torch.empty(min(step, g.h), g.w, device=dev)
        for i, v, b, r0, c0 in zip(g.items, vs, xs, row0, col0):
            c = col_scale[c0 : c0 + g.w]
            factor = decay[i] if isinstance(decay, torch.Tensor) and decay.dim() else decay
            for lo in range(0, g.h, step):
                hi = min(lo + step, g.h)
                t = torch.mul(b[lo:hi], c, out=buf[: hi - lo])
                if factor is not None:
                    v[lo:hi].mul_(factor)
                v[lo:hi].addcmul_(t, row_scale[r0 + lo : r0 + hi, None], value=-1.0)


def row_normalized_update(
    blocks: BlockGroups,
    views: Sequence[Sequence[torch.Tensor]],
    stacks: Sequence,
    row_scale: Callable[[torch.Tensor, slice], torch.Tensor],
    lr: float,
    decay: torch.Tensor | float | None,
) -> None:
    """``W <- W * decay - lr diag(row_scale(sum_j X_ij^2, rows)) X`` on every block, a few rows at a time: each
    row's sum of squares is final when its rows are read (``rows_complete``), so the statistic and the update
    share one read of ``X`` (SCALE's per-row RMS: one pass instead of a statistics pass and an update pass)."""
    for g, vs, x in zip(blocks.groups, views, stacks):
        row0 = g.row_starts
        xs = x if isinstance(x, list) else x.unbind(0)
        step = max(1, CHUNK_ELEMENTS // g.w)
        for v, b, r0 in zip(vs, xs, row0):
            for lo in range(0, g.h, step):
                hi = min(lo + step, g.h)
                chunk = b[lo:hi]
                scale = row_scale(torch.linalg.vector_norm(chunk, dim=1).square_(), slice(r0 + lo, r0 + hi))
                if decay is not None:
                    v[lo:hi].mul_(decay)
                v[lo:hi].addcmul_(chunk, scale[:, None], value=-lr)


def lerp_col_energies(
    blocks: BlockGroups, moments: Sequence[Sequence[torch.Tensor]], stacks: Sequence, weight: float
) -> torch.Tensor:
    """``M <- M + weight (X - M)`` on every block (``moments[k]``: group ``k``'s blocks of the EMA) and the partial
    column sums of ``X * X``, concatenated, in one read of ``X`` per row block (DASGO's momentum and column
    energies: one pass where they were two). Column sums need no whole rows: any layout's blocks."""
    dev = blocks.device
    cols = torch.zeros(blocks.n_cols, device=dev)
    for g, ms, x in zip(blocks.groups, moments, stacks):
        if not isinstance(x, list):  # small blocks, stacked
            torch._foreach_lerp_(list(ms), list(x.unbind(0)), weight)
            cols.index_add_(0, g.col_flat, stack_col_sumsq(x).reshape(-1))
            continue
        step = max(1, CHUNK_ELEMENTS // g.w)
        buf = torch.empty(min(step, g.h), g.w, device=dev)
        ones = torch.ones(min(step, g.h), device=dev)
        for m, b, c0 in zip(ms, x, g.col_starts):
            for lo in range(0, g.h, step):
                hi = min(lo + step, g.h)
                m[lo:hi].lerp_(b[lo:hi], weight)
                a = torch.mul(b[lo:hi], b[lo:hi], out=buf[: hi - lo])
                cols[c0 : c0 + g.w].addmv_(a.T, ones[: hi - lo])
    return cols
