"""Top-r bases of sharded matrices from row blocks: the randomized range finder (Halko et al.) written on
``MatrixOps``, so the same code runs on one process, on an owner rank, or distributed over row blocks.

With ``A``'s rows spread over ranks, ``A @ X`` is row-local, ``A^T Y`` is a partial sum (one bucketed
all-reduce of ``cols x l``), and the tall ``rows x l`` sketches are assembled whole (an all-reduce of
disjoint row blocks) so every rank orthonormalizes the same matrix with an exact QR. The Gaussian test
matrix comes from ``seeded_normal``: the same draw on every rank and at every world size.
"""

from __future__ import annotations

from typing import Callable

import torch

from .draws import seeded_normal
from .iterative import orthonormal_columns
from .matrix_ops import MatrixOps

__all__ = [
    "range_basis",
    "refresh_reduced",
    "orthonormal",
    "signal_range",
    "signal_directions",
    "fp32_floor",
    "determined_floor",
    "complete_basis",
    "fill_draw",
    "pin_signs",
    "restart_columns",
]


def pin_signs(basis: torch.Tensor) -> torch.Tensor:
    """``basis`` (``(..., rows, r)``) with each column's sign chosen so that its largest-magnitude entry is positive
    (the first such entry on a tie; a zero column is kept). ``eigh``, ``svd`` and QR return each vector with an
    arbitrary sign that follows rounding (the summation order of the data, the rank, the solver), which matters
    wherever state is kept in the basis's coordinates without being rotated into the new one (Alice's ``M`` and
    ``V`` at a switch, the paper's literal rule: docs/algorithms/alice.md). The one convention every strategy and
    rank applies to a basis it computes whole; flipping a sign is exact, so the pinned basis is the same numbers
    wherever its unpinned input is."""
    pivot = basis.gather(-2, basis.abs().argmax(-2, keepdim=True))
    return basis * torch.where(pivot < 0, -1.0, 1.0).to(basis.dtype)


def restart_columns(basis: torch.Tensor, seed: int, count: object) -> torch.Tensor:
    """``basis`` (``rows x r``, whole) with its zero columns (directions left out: ``signal_rank``) replaced by a
    seeded Gaussian draw keyed by the seed and ``count``, the same on every rank: where a subspace iteration
    starts from it, the left-out directions can come back. A basis without zero columns is returned as is."""
    rows, r = basis.shape[-2:]
    draw = seeded_normal((rows, r), seed, "restart", count, device=basis.device)
    return torch.where(basis.square().sum(-2, keepdim=True) > 0, basis, draw.to(basis.dtype))


def orthonormal(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``x`` (float64 arithmetic, returned in fp32): Householder QR, or on the
    iterative route (CUDA) Cholesky-QR2 (``iterative.orthonormal_columns``)."""
    return orthonormal_columns(x.double()).float()


def signal_range(x: torch.Tensor, shape: tuple[int, int], floor: float | None = None) -> torch.Tensor:
    """Orthonormal columns spanning the part of ``x`` (``(..., rows, k)``, computed from fp32 data of an ``m x n``
    matrix ``shape``) above fp32 rounding, in fp32: the left singular vectors whose singular values
    ``signal_directions`` keeps (above ``floor`` times the largest: by default ``fp32_floor``), the others as
    zero columns. Where ``x`` is rank-deficient a QR would fill the missing columns from rounding noise, which
    differs between a sharded run and a single process; callers that need the full width complete the zero
    columns from a seeded draw (``complete_basis``)."""
    svd = torch.linalg.svd(x.double(), full_matrices=False)
    return (svd.U * signal_directions(svd.S, shape, floor).unsqueeze(-2)).float()


def range_basis(
    ops: MatrixOps,
    blocks: dict[int, torch.Tensor],
    ranks: dict[int, int],
    seed: int,
    keys: dict[int, tuple],
    oversample: int = 10,
    power_iters: int = 2,
    floors: dict[int, float] | None = None,
    kept: dict[int, torch.Tensor] | None = None,
) -> dict[int, torch.Tensor]:
    """``{i: rows x r}`` orthonormal basis of the top-``r`` left singular subspace of each ``A_i`` (whole, on
    every rank that computes ``i``). ``blocks[i]``: this rank's rows of ``A_i``; every participating rank
    must pass the same indices (the reductions are bucketed across matrices). ``floors`` (``{i: relative
    cutoff}``): for those matrices, ``kept[i]`` is set to the ``r`` 0/1 flags of the basis's directions whose
    singular values are above ``floors[i]`` times the largest (``signal_rank``: the directions a gradient of
    that precision determines); the basis itself is completed as for the others.

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
        groups.setdefault((tuple(blocks[i].shape), ops.plans[i].a_shape, ops.rows(i), width[i], ranks[i]), []).append(i)
    members = list(groups.values())
    a = [torch.stack([blocks[i] for i in g]) for g in members]
    # rows of this rank within each group's whole tall matrices (a block of them under the distributed strategy)
    mine = [slice(*ops.rows(g[0])) for g in members]

    def reduced(
        reduce: Callable[[dict[int, torch.Tensor]], dict[int, torch.Tensor]], parts: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """One ``reduce`` (assemble or all-reduce) over every group's stacked partial results."""
        done = reduce({i: p[j] for g, p in zip(members, parts) for j, i in enumerate(g)})
        return [
            p if not any(ops.split(i) for i in g) else torch.stack([done[i] for i in g]) for g, p in zip(members, parts)
        ]

    y = reduced(ops.assemble, [ag @ torch.stack([omega[i] for i in g]) for g, ag in zip(members, a)])
    y = [orthonormal(yg) for yg in y]
    for _ in range(power_iters):
        z = reduced(ops.allreduce, [ag.mT @ yg[:, s] for ag, yg, s in zip(a, y, mine)])
        z = [orthonormal(zg) for zg in z]
        y = reduced(ops.assemble, [ag @ zg for ag, zg in zip(a, z)])
        y = [orthonormal(yg) for yg in y]
    b = reduced(ops.allreduce, [yg[:, s].mT @ ag for ag, yg, s in zip(a, y, mine)])
    out: dict[int, torch.Tensor] = {}
    for g, yg, bg in zip(members, y, b):
        r = ranks[g[0]]
        rows = ops.plans[g[0]].a_shape[0]
        svd = torch.linalg.svd(bg.double(), full_matrices=False)
        keep = signal_directions(svd.S, ops.plans[g[0]].a_shape)[..., :r]
        basis = yg.double() @ svd.U[..., :r]
        fill = torch.stack([fill_draw(rows, r, seed, keys[i][-1], basis.device) for i in g])
        out.update(zip(g, complete_basis(basis, keep, fill).unbind(0)))
        if floors and kept is not None:
            for j, i in enumerate(g):
                if i in floors:
                    shape = ops.plans[i].a_shape
                    kept[i] = signal_directions(svd.S[j], shape, max(fp32_floor(shape), floors[i]))[:r].float()
    return out


def refresh_reduced(group: dict, rows: int, cols: int, r: int) -> int:
    """fp32 elements ``range_basis`` all-reduces for one ``rows x cols`` matrix of ``group`` (its ``oversample``
    and ``power_iters``) whose rows are split: the sketch ``Y`` assembled (``rows x w``) once and after each
    power iteration, ``A^T Y`` (``cols x w``) at each, and ``Y^T A`` (``w x cols``) once."""
    w = min(r + group["oversample"], rows, cols)
    p = group["power_iters"]
    return (1 + p) * (rows + cols) * w


def fill_draw(rows: int, r: int, seed: int, count: object, device: torch.device | str) -> torch.Tensor:
    """The seeded draw ``complete_basis`` fills left-out directions from: keyed by the seed, the refresh count
    and the shape only (not the matrix's name), so a matrix's basis does not depend on how its optimizer names
    it, and a matrix with no signal at all (a zero gradient) gets the same basis wherever it is."""
    return seeded_normal((rows, r), seed, "complete", count, device=device)


def complete_basis(basis: torch.Tensor, keep: torch.Tensor, draw: torch.Tensor) -> torch.Tensor:
    """``basis`` (``(..., rows, r)``, orthonormal columns) with the columns that ``keep`` (``(..., r)``, 1.0 on a
    prefix: the directions ``signal_directions`` keeps) leaves out replaced by ``draw`` (a seeded ``rows x r``
    draw) made orthonormal to the kept ones and to each other; fp32 result. The subspace keeps its rank, as
    the left-out directions did, but they no longer depend on summation order: they are the same on every
    rank, at every world size, sharded or not. Batched, with no host synchronization (every matrix is
    completed, the kept columns selected back)."""
    b = basis.double() * keep.unsqueeze(-2)
    g = draw.double()
    for _ in range(2):  # twice is enough (Gram-Schmidt's "twice is enough")
        g = g - b @ (b.mT @ g)
    r = basis.shape[-1]
    # its first r - k columns span the left-out ones' share of the complement; with fewer than 2 r rows the
    # projected draw may be rank-deficient by construction (only its first r - k columns are used), so Householder
    q = orthonormal_columns(g) if g.shape[-2] >= 2 * r else torch.linalg.qr(g).Q
    k = keep.sum(-1, keepdim=True).long()
    src = (torch.arange(r, device=basis.device) - k).clamp(min=0)
    fill = q.gather(-1, src.unsqueeze(-2).expand(q.shape))
    return torch.where(keep.unsqueeze(-2) > 0, basis.double(), fill).float()


def signal_directions(
    sigma: torch.Tensor, shape: tuple[int, int], floor: float | torch.Tensor | None = None
) -> torch.Tensor:
    """Per singular value of a small matrix computed from fp32 data of an ``m x n`` matrix: 1.0 where it is
    above fp32 rounding (``sigma > max(m, n) eps32 sigma_1``), else 0.0. A rank-deficient gradient (a batch
    smaller than the subspace rank, frozen rows, padding) leaves directions whose singular values are
    rounding noise; their vectors depend on summation order, so a sharded run and a single process would
    pick different ones and, where an algorithm weighs every direction alike (an orthogonalization, Adam's
    normalization), drift apart (issue 28). Bases replace them by seeded directions (``complete_basis``).
    ``floor``: another relative cutoff (``determined_floor``; a tensor: one per matrix of a stack, ``(..., 1)``)."""
    return (sigma > sigma[..., :1] * (fp32_floor(shape) if floor is None else floor)).to(sigma.dtype)


def determined_floor(shape: tuple[int, int]) -> float:
    """Relative singular value below which a direction of a sketch computed from fp32 data of an ``m x n`` matrix
    is known to fewer than half of the digits that rounding leaves (``sqrt(fp32_floor)``, 2.8e-3 at 64 x 32).

    Rounding perturbs the sketch by about ``fp32_floor`` times its largest singular value ``s_1``, which turns
    the span of the directions down to ``s_k`` by about ``fp32_floor s_1 / s_k``. Such a direction is signal, not
    noise, but its vector is a different one in every summation order. Where an algorithm weighs directions
    alike, or builds on the span's complement (Alice's switch draws from it), a sketch direction at
    ``s_k = 1e-4 s_1`` moved a sharded run 3e-5 away from the single-process one after 3 steps (issue 28);
    below this floor the direction is left out and completed from a seeded draw like a noise one."""
    return fp32_floor(shape) ** 0.5


def fp32_floor(shape: tuple[int, int]) -> float:
    """Relative size below which a quantity computed from fp32 data of an ``m x n`` matrix is rounding: sums of
    up to ``max(m, n)`` products, each rounded at ``eps32`` (the worst-case bound, so that nothing above it is
    noise)."""
    return max(shape) * torch.finfo(torch.float32).eps
