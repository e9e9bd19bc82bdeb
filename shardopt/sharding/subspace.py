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
    must pass the same indices (the reductions are bucketed across matrices)."""
    idx = sorted(blocks)
    width, omega = {}, {}
    for i in idx:
        rows, cols = ops.plans[i].a_shape
        width[i] = min(ranks[i] + oversample, rows, cols)
        omega[i] = seeded_normal((cols, width[i]), seed, *keys[i], device=blocks[i].device)
    y = ops.assemble({i: blocks[i] @ omega[i] for i in idx})
    y = {i: orthonormal(y[i]) for i in idx}
    for _ in range(power_iters):
        z = ops.allreduce({i: blocks[i].T @ ops.my_rows(i, y[i]) for i in idx})
        z = {i: orthonormal(z[i]) for i in idx}
        y = ops.assemble({i: blocks[i] @ z[i] for i in idx})
        y = {i: orthonormal(y[i]) for i in idx}
    b = ops.allreduce({i: ops.my_rows(i, y[i]).T @ blocks[i] for i in idx})
    out = {}
    for i in idx:
        ub = torch.linalg.svd(b[i].double(), full_matrices=False).U
        out[i] = (y[i].double() @ ub[:, : ranks[i]]).float()
    return out

