"""Owner plans for the gather strategy of ``shardopt.sharding.matrix_ops``.

Each sharded matrix gets an owner rank in its process group from a cost model (longest-processing-time
first: matrices sorted by estimated cost, each given to the least-loaded rank; ties broken by name and
rank, so every rank computes the same plan from static metadata). ``MatrixOps`` then brings every piece of
every matrix to its owner with one ``all_to_all`` per process group and returns the results with one more.
Matrices held whole by every rank (single process, DDP) get no owner: they are computed locally.
"""

from __future__ import annotations

import heapq
from typing import Callable, Sequence

from .layout import MatrixLayout

__all__ = ["owner_plan", "sole_holder", "CostFn", "newton_schulz_cost"]

CostFn = Callable[[tuple[int, int]], float]


def newton_schulz_cost(shape: tuple[int, int], steps: int = 5) -> float:
    """FLOPs of quintic Newton-Schulz on an m x n matrix plus the bytes it moves (gather + scatter)."""
    m, n = shape
    small, large = min(m, n), max(m, n)
    return steps * (4.0 * small * small * large + 2.0 * small**3) + 8.0 * m * n


def owner_plan(layouts: Sequence[MatrixLayout], names: Sequence[str], cost: CostFn | Sequence[float]) -> list[int]:
    """Owner (group rank) of each matrix; -1 for matrices computed locally (no group).

    ``cost`` is a function of the matrix shape or one number per matrix. Longest-processing-time first with
    a heap of rank loads (ties to the lowest rank), so a plan over thousands of ranks builds in milliseconds."""
    costs = [float(c) for c in cost] if not callable(cost) else [cost(lay.shape) for lay in layouts]
    owners = [-1] * len(layouts)
    by_group: dict[int, list[int]] = {}
    for i, lay in enumerate(layouts):
        if lay.group is not None:
            by_group.setdefault(id(lay.group), []).append(i)
    for idx in by_group.values():
        world = layouts[idx[0]].world
        load = [0.0] * world
        heap = [(0.0, r) for r in range(world)]
        for i in sorted(idx, key=lambda i: (-costs[i], names[i])):
            lay = layouts[i]
            holder = sole_holder(lay)
            if holder is not None:  # a matrix one rank already holds whole stays there (nothing to move)
                r = holder
            else:
                while heap[0][0] != load[heap[0][1]]:  # drop entries made stale by a sole-holder placement
                    heapq.heapreplace(heap, (load[heap[0][1]], heap[0][1]))
                r = heap[0][1]
            owners[i] = r
            load[r] += costs[i]
            if holder is None:
                heapq.heapreplace(heap, (load[r], r))
    return owners


def sole_holder(lay: MatrixLayout) -> int | None:
    """The one rank that holds elements of the matrix, if exactly one does."""
    if lay.holders != 1:
        return None
    return next((r for r, p in enumerate(lay.pieces) if lay._piece_numel(p) > 0), None)
