"""Gather-to-owner: whole-matrix operations (Newton-Schulz, SVD, eigh) on sharded matrices.

Each sharded matrix gets an owner rank in its process group from a cost model (longest-processing-time
first: matrices sorted by estimated cost, each given to the least-loaded rank; ties broken by name and
rank, so every rank computes the same plan from static metadata). One ``all_to_all`` per process group
brings every piece of every matrix to its owner, the owner runs the operation on whole matrices, and one
more ``all_to_all`` returns each rank its piece of the results: two collectives per group per call,
whatever the number of matrices. Matrices held whole by every rank (single process, DDP) are computed
locally.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from .comm import collective_counter
from .layout import MatrixLayout

__all__ = ["owner_plan", "run_on_owners", "CostFn", "newton_schulz_cost"]

CostFn = Callable[[tuple[int, int]], float]


def newton_schulz_cost(shape: tuple[int, int], steps: int = 5) -> float:
    """FLOPs of quintic Newton-Schulz on an m x n matrix plus the bytes it moves (gather + scatter)."""
    m, n = shape
    small, large = min(m, n), max(m, n)
    return steps * (4.0 * small * small * large + 2.0 * small ** 3) + 8.0 * m * n


def owner_plan(layouts: Sequence[MatrixLayout], names: Sequence[str], cost: CostFn) -> list[int]:
    """Owner (group rank) of each matrix; -1 for matrices computed locally (no group)."""
    owners = [-1] * len(layouts)
    by_group: dict[int, list[int]] = {}
    for i, lay in enumerate(layouts):
        if lay.group is not None:
            by_group.setdefault(id(lay.group), []).append(i)
    for idx in by_group.values():
        world = layouts[idx[0]].world
        load = [0.0] * world
        for i in sorted(idx, key=lambda i: (-cost(layouts[i].shape), names[i])):
            lay = layouts[i]
            holders = [r for r in range(world) if _piece_numel(lay, r) > 0]
            # a matrix one rank already holds whole stays there (nothing to move); else least-loaded rank
            r = holders[0] if len(holders) == 1 else min(range(world), key=lambda r: (load[r], r))
            owners[i] = r
            load[r] += cost(layouts[i].shape)
    return owners


def _piece_numel(lay: MatrixLayout, rank: int) -> int:
    return lay._piece_numel(lay.pieces[rank])


def _all_to_all(send: list[list[torch.Tensor]], recv_sizes: list[int], group: Any, dtype, device) -> list[torch.Tensor]:
    import torch.distributed as dist

    inp = torch.cat([torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device) for parts in send])
    in_sizes = [sum(p.numel() for p in parts) for parts in send]
    out = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
    collective_counter.record(inp)
    dist.all_to_all_single(out, inp.contiguous(), recv_sizes, in_sizes, group=group)
    return list(out.split(recv_sizes))


def run_on_owners(
    layouts: Sequence[MatrixLayout],
    names: Sequence[str],
    locals_: Sequence[torch.Tensor],
    op: Callable[[list[torch.Tensor]], list[torch.Tensor]],
    cost: CostFn,
) -> list[torch.Tensor]:
    """Apply ``op`` (a batch of whole fp32 matrices -> same-shape results) and return this rank's pieces.

    ``locals_[i]`` is this rank's 1-D piece of matrix ``i`` (layout order). Every rank must call it with
    the same matrices in the same order.
    """
    owners = owner_plan(layouts, names, cost)
    results: list[torch.Tensor | None] = [None] * len(layouts)
    local_idx = [i for i, o in enumerate(owners) if o < 0]
    if local_idx:
        outs = op([locals_[i].reshape(layouts[i].shape) for i in local_idx])
        for i, out in zip(local_idx, outs):
            results[i] = out.reshape(-1)
    groups: dict[int, list[int]] = {}
    for i, o in enumerate(owners):
        if o >= 0:
            groups.setdefault(id(layouts[i].group), []).append(i)
    for idx in groups.values():
        lay0 = layouts[idx[0]]
        group, world, me = lay0.group, lay0.world, lay0.rank
        dtype, device = locals_[idx[0]].dtype, locals_[idx[0]].device
        # 1. every piece to its owner
        send = [[locals_[i] for i in idx if owners[i] == r] for r in range(world)]
        mine = [i for i in idx if owners[i] == me]
        recv_sizes = [sum(_piece_numel(layouts[i], s) for i in mine) for s in range(world)]
        received = _all_to_all(send, recv_sizes, group, dtype, device)
        fulls = []
        for i in mine:
            fulls.append(torch.zeros(layouts[i].shape, dtype=dtype, device=device))
        for s, buf in enumerate(received):
            offset = 0
            for i, full in zip(mine, fulls):
                k = _piece_numel(layouts[i], s)
                lay_s = MatrixLayout(layouts[i].shape, layouts[i].pieces, s)
                for b, view in lay_s.views(buf[offset: offset + k]):
                    full[b.row: b.row + b.height, b.col: b.col + b.width] = view
                offset += k
        outs = op(fulls) if fulls else []
        # 2. each rank its piece of the results
        back = []
        for r in range(world):
            parts = []
            for i, out in zip(mine, outs):
                lay_r = MatrixLayout(layouts[i].shape, layouts[i].pieces, r)
                piece = torch.empty(_piece_numel(layouts[i], r), dtype=dtype, device=device)
                for b, view in lay_r.views(piece):
                    view.copy_(out[b.row: b.row + b.height, b.col: b.col + b.width])
                parts.append(piece)
            back.append(parts)
        from_owner = [[i for i in idx if owners[i] == s] for s in range(world)]
        recv_sizes = [sum(_piece_numel(layouts[i], me) for i in from_owner[s]) for s in range(world)]
        received = _all_to_all(back, recv_sizes, group, dtype, device)
        for s, buf in enumerate(received):
            offset = 0
            for i in from_owner[s]:
                k = _piece_numel(layouts[i], me)
                results[i] = buf[offset: offset + k]
                offset += k
    return results  # type: ignore[return-value]
