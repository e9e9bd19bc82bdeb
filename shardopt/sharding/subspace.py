"""Top-r bases of sharded matrices from row blocks: the randomized range finder (Halko et al.) written on
``MatrixOps``, so the same code runs on one process, on an owner rank, or distributed over row blocks.

With ``A``'s rows spread over ranks, ``A @ X`` is row-local, ``A^T Y`` is a partial sum (one bucketed
all-reduce of ``cols x l``), and the tall ``rows x l`` sketches are assembled whole (an all-reduce of
disjoint row blocks) so every rank orthonormalizes the same matrix with an exact QR. The Gaussian test
matrix comes from ``seeded_normal``: the same draw on every rank and at every world size.
"""
from __future__ import annotations

import torch

from .draws import seeded_normal
from .matrix_ops import MatrixOps

__all__ = ["range_basis", "orthonormal"]


def orthonormal(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``x`` (reduced QR in float64, returned in fp32)."""
    return torch.linalg.qr(x.double()).Q.float()


def range_basis(ops: MatrixOps, blocks: dict[int, torch.Tensor], ranks: dict[int, int], seed: int,
                keys: dict[int, tuple], oversample: int = 10, power_iters: int = 2) -> dict[int, torch.Tensor]:
    """``{i: rows x r}`` orthonormal basis of the top-``r`` left singular subspace of each ``A_i`` (whole, on
    every rank that computes ``i``). ``blocks[i]``: this rank's rows of ``A_i``; every participating rank
    must pass the same indices (the reductions are bucketed across matrices).

    Matrices whose blocks, row ranges and sketch widths agree are stacked: each product, QR and SVD is one
    batched call per such group (the same numbers as one call per matrix, to fp32 rounding of the products);
    the reductions are one bucketed call per phase, as for a single matrix."""
    idx = sorted(blocks)
    width, omega = {}, {}
    for i in idx:
        rows, cols = ops.plans[i].a_shape
        width[i] = min(ranks[i] + oversample, rows, cols)
        omega[i] = seeded_normal((cols, width[i]), seed, *keys[i], device=blocks[i].device)
    groups: dict[tuple, list[int]] = {}
    for i in idx:
        groups.setdefault((tuple(blocks[i].shape), ops.plans[i].a_shape, ops.rows(i), width[i], ranks[i]),
                          []).append(i)
    members = list(groups.values())
    a = [torch.stack([blocks[i] for i in g]) for g in members]
    # rows of this rank within each group's whole tall matrices (a block of them under the distributed strategy)
    mine = [slice(*ops.rows(g[0])) for g in members]

    def reduced(reduce, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """One ``reduce`` (assemble or all-reduce) over every group's stacked partial results."""
        done = reduce({i: p[j] for g, p in zip(members, parts) for j, i in enumerate(g)})
        return [p if not any(ops.split(i) for i in g) else torch.stack([done[i] for i in g])
                for g, p in zip(members, parts)]

    y = reduced(ops.assemble, [ag @ torch.stack([omega[i] for i in g]) for g, ag in zip(members, a)])
    y = [orthonormal(yg) for yg in y]
    for _ in range(power_iters):
        z = reduced(ops.allreduce, [ag.mT @ yg[:, s] for ag, yg, s in zip(a, y, mine)])
        z = [orthonormal(zg) for zg in z]
        y = reduced(ops.assemble, [ag @ zg for ag, zg in zip(a, z)])
        y = [orthonormal(yg) for yg in y]
    b = reduced(ops.allreduce, [yg[:, s].mT @ ag for ag, yg, s in zip(a, y, mine)])
    out = {}
    for g, yg, bg in zip(members, y, b):
        ub = torch.linalg.svd(bg.double(), full_matrices=False).U
        basis = (yg.double() @ ub[..., : ranks[g[0]]]).float()
        out.update(zip(g, basis.unbind(0)))
    return out
