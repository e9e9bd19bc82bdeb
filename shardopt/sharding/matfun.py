"""Matrix functions: quintic Newton-Schulz (Muon), the exact polar factor, inverse square roots of small
symmetric matrices (eigh or the coupled Newton-Schulz iteration), and a per-shape batching helper.

Each iteration is written once. ``newton_schulz_iteration`` is the quintic loop as a generator that yields its
partial sums (the Frobenius norm, then each step's Gram matrix) and takes them back completed: a whole matrix
completes them itself (``newton_schulz``), a matrix whose columns are spread over ranks has them all-reduced
by its driver (``shardopt.optim.muon``). The coupled inverse-root iteration is written once,
``iterative.coupled_iteration``: behind SWAN's whitening and ASGO's Newton-Schulz root
(``coupled_inverse_sqrt``) and the checked roots and polar factors of the GPU path.
"""

from __future__ import annotations

import math
from typing import Callable, Generator

import torch

from .iterative import (
    count_fallbacks,
    coupled_iteration,
    inverse_sqrt_checked,
    iterative_device,
    polar_from_gram_checked,
)
from .stacking import same_shape

__all__ = [
    "MUON_COEFFICIENTS",
    "newton_schulz",
    "newton_schulz_iteration",
    "muon_gram_products",
    "complete_locally",
    "polar_factor",
    "GRAM_RTOL",
    "by_shape",
    "gram_inverse_sqrt",
    "inverse_root",
    "coupled_inverse_sqrt",
    "polar_kept",
]

#: quintic coefficients of Muon (KellerJordan/Muon; torch.optim.Muon defaults)
MUON_COEFFICIENTS = (3.4445, -4.7750, 2.0315)

#: a generator that yields partial sums and receives them completed, returning its result
Iteration = Generator[torch.Tensor, torch.Tensor, torch.Tensor]


def newton_schulz_iteration(
    x: torch.Tensor,
    steps: int,
    coefficients: tuple[float, float, float] = MUON_COEFFICIENTS,
    eps: float = 1e-7,
    gram_products: bool = False,
    mm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> Iteration:
    """Quintic Newton-Schulz on the wide orientation ``x`` (``k x l``, ``k <= l``), or on a block of its
    columns when they are spread over ranks; batched over leading dimensions (``(..., k, l)``: one kernel per
    product for many same-shape matrices).

    Yields this block's Frobenius norm (per matrix: shape ``(..., 1, 1)`` when batched) and receives the whole
    matrix's, then for each step yields the partial Gram ``x x^T`` (``k x k``, a sum over columns) and
    receives the complete one; everything else is column-local. Returns the block of ``U V^T`` (singular
    values near 1) in ``x``'s dtype.

    ``gram_products``: each step as ``a x + b (G x) + c G (G x)`` (``6 k^2 l`` on a block of ``l`` columns)
    instead of ``a x + (b G + c G^2) x`` (``4 k^2 l + 2 k^3``): the same polynomial, with no ``k x k`` product
    that every rank computing a block of the matrix would repeat; cheaper where a block has fewer than ``k``
    columns (``muon_gram_products``).

    ``mm``: the products as ``mm(a, b)`` (``precision.matmul_in``: TF32 operands), the same polynomial; default the
    fused ``addmm`` forms in ``x``'s dtype.
    """
    a, b, c = coefficients
    if x.dim() == 2:
        norm = yield x.norm()
        addmm: Callable[..., torch.Tensor] = torch.addmm
    else:
        norm = yield torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
        addmm = torch.baddbmm
        if x.dim() > 3:
            raise ValueError(f"newton_schulz_iteration takes one batch dimension, got shape {tuple(x.shape)}")
    x = x / norm.clamp(min=eps)
    for _ in range(steps):
        gram = yield (x @ x.mT if mm is None else mm(x, x.mT))
        if mm is not None:
            if gram_products:
                y = mm(gram, x)
                x = a * x + b * y + c * mm(gram, y)
            else:
                x = a * x + mm(b * gram + c * mm(gram, gram), x)
        elif gram_products:
            y = gram @ x
            x = addmm(y, gram, y, beta=b, alpha=c).add_(x, alpha=a)
        else:
            x = addmm(x, addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


def muon_gram_products(a_shape: tuple[int, int], parts: int) -> bool:
    """Whether a Newton-Schulz whose tall ``A`` (``a_shape``) is cut into ``parts`` row blocks runs each step as
    products with the Gram matrix (``newton_schulz_iteration(gram_products=True)``): where a block has fewer
    rows than ``k`` columns, ``2 k^2`` per row is less than the ``2 k^3`` of ``G^2`` that every block's rank
    would repeat. Static, so every rank of the matrix decides alike."""
    rows, k = max(a_shape), min(a_shape)
    return parts > 1 and -(-rows // parts) < k


def complete_locally(iteration: Iteration) -> torch.Tensor:
    """Run an iteration whose partial sums are already complete (the whole matrix is here)."""
    value = next(iteration)
    while True:
        try:
            value = iteration.send(value)
        except StopIteration as stop:
            return stop.value


def newton_schulz(
    g: torch.Tensor,
    steps: int = 5,
    coefficients: tuple[float, float, float] = MUON_COEFFICIENTS,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.float32,
    mm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Approximate orthogonalization ``U V^T`` of ``g`` (singular values land near 1), run in ``dtype`` on the
    wide orientation, returned in fp32; ``g`` may be a ``(B, m, n)`` stack of same-shape matrices (one batched
    iteration for all). ``dtype=torch.bfloat16`` reproduces ``torch.optim.Muon``."""
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    x = complete_locally(newton_schulz_iteration(x, steps, coefficients, eps, mm=mm))
    if tall:
        x = x.mT
    return x.float()


def coupled_inverse_sqrt(a: torch.Tensor, steps: int, floor: float) -> torch.Tensor:
    """``a^{-1/2}`` of symmetric PSD fp32 matrices (batched) by the coupled Newton-Schulz iteration
    (docs/algorithms/alice.md, docs/algorithms/asgo.md): ``Y0 = a/s, Z0 = I``, ``T = (3I - Z Y)/2``,
    ``Y <- Y T``, ``Z <- T Z``, result ``Z / sqrt(s)`` with ``s = max(|a|_F, floor)``. It converges to the
    inverse root, or with few steps stops short in the smallest eigendirections (a damped root).

    ``T`` is one fused product ``1.5 I - 0.5 Z Y`` (the same numbers: the halving is exact), and the first
    step, where ``Z = I``, skips its products with the identity (``iterative.coupled_iteration``)."""
    s = torch.linalg.matrix_norm(a).clamp(min=floor)
    z, _ = coupled_iteration(a, s, steps)
    return z / s.sqrt()[..., None, None]


def polar_factor(g: torch.Tensor, rtol: float | None = None) -> torch.Tensor:
    """Exact ``U V^T`` of the reduced SVD, computed in float64 (batched over leading dimensions). Singular
    directions below ``rtol * sigma_1`` (default ``max(m, n) * eps(float64)``) map to zero, so a rank-deficient
    or zero input gives a partial isometry, never arbitrary null-space vectors (which could differ between ranks).

    With a cutoff of at least ``GRAM_RTOL`` the factor comes from the eigendecomposition of the small float64
    Gram matrix (``k x k``, ``k = min(m, n)``): ``O = (V diag(1/sigma) V^T) g``. Every kept direction has
    ``sigma_i >= rtol sigma_1``, and float64 rounding of the Gram eigenvalues (``~k eps64 sigma_1^2``) moves it
    by at most ``k eps64 / (2 rtol^2)`` relative: 1e-7 to 2e-6 for SUMO's cutoffs on LLaMA shapes
    (``max(m, n) eps32``), float32 level; on a CPU it is 3-4x faster than the SVD of a ``128 x 512`` moment.

    Tighter cutoffs take the Gram route only for the matrices whose computed spectrum settles every
    decision (``_gram_unsettled``): each Gram singular value is either far below the cutoff (surely dropped) or
    large enough that its float64 rounding moves the result by at most float32 rounding; the others (and
    cutoffs too tight to tell a dropped direction from rounding, such as the default) take the SVD. Small
    matrices (SUMO's ``r x n`` moments at small widths) thus pay one eigendecomposition, about half an SVD.
    """
    tol = max(g.shape[-2:]) * torch.finfo(torch.float64).eps if rtol is None else rtol
    settles = tol >= GRAM_RTOL or (g.numel() and tol >= 2 * _gram_floor(g.shape))
    if settles and g.numel() and g.dim() == 3 and iterative_device(g.device):
        return _polar_iterative(g.double(), tol).float()
    if tol >= GRAM_RTOL and g.numel():
        return _polar_from_gram(g.double(), tol).float()
    if g.numel() and tol >= 2 * _gram_floor(g.shape):
        return _polar_from_gram(g.double(), tol, checked=True).float()
    return _polar_from_svd(g.double(), tol).float()


GRAM_RTOL = 1e-5


def _polar_iterative(g: torch.Tensor, tol: float) -> torch.Tensor:
    """The Gram route of ``polar_factor`` as batched products (``iterative.polar_from_gram_checked``, float64 in
    and out) where a device runs eigendecompositions one by one; the matrices it cannot settle (a direction near
    or below the cutoff, rank-deficient, zero) take the eigendecomposition. One host read: whether any did.

    Below ``GRAM_RTOL`` (SUMO's cutoff on a narrow moment, ``max(m, n) eps32``) the iteration keeps a matrix only
    where every direction is surely kept in ``_gram_unsettled``'s sense (at least ``2 tol`` and the Gram matrix's
    float32 accuracy floor), so its result is the checked Gram route's to float32 rounding; the rest take that
    route, with its SVD check."""
    checked = tol < GRAM_RTOL
    out, ok = polar_from_gram_checked(g, tol, polar_kept(g.shape, tol))
    bad = ~ok
    if count_fallbacks("polar", bad):
        out[bad] = _polar_from_gram(g[bad], tol, checked=checked)
    return out


def polar_kept(shape: tuple[int, ...], tol: float) -> float:
    """The relative singular value every direction must exceed for the iterative polar route (``_polar_iterative``)
    at cutoff ``tol`` on a ``shape`` moment: ``2 tol``, and below ``GRAM_RTOL`` also the float64 Gram's float32
    accuracy floor (``_gram_unsettled``'s surely-kept size). Its square sets the iteration's step count."""
    if tol >= GRAM_RTOL:
        return 2 * tol
    return max(2 * tol, _gram_floor(shape) / math.sqrt(2 * torch.finfo(torch.float32).eps))


def _polar_from_gram(g: torch.Tensor, tol: float, checked: bool = False) -> torch.Tensor:
    """The Gram route of ``polar_factor`` (float64 in and out); ``checked``: matrices whose spectrum the Gram
    matrix does not resolve at ``tol`` (``_gram_unsettled``) are recomputed by the SVD."""
    wide = g.size(-2) <= g.size(-1)
    a = g if wide else g.mT
    lam, vecs = torch.linalg.eigh(a @ a.mT)
    sigma = lam.clamp(min=0).sqrt()
    top = sigma.amax(-1, keepdim=True)
    inv = torch.where(sigma > top * tol, sigma.reciprocal(), 0.0)
    out = ((vecs * inv.unsqueeze(-2)) @ vecs.mT) @ a  # k x k first: two k^2 n products in all
    out = out if wide else out.mT
    if checked:
        bad = _gram_unsettled(sigma, top, tol, g.shape)
        if bool(bad.any()):
            if out.dim() == 2:
                return _polar_from_svd(g, tol)
            out[bad] = _polar_from_svd(g[bad], tol)  # out is a new tensor (or a view of one)
    return out


def by_shape(fn: Callable[[torch.Tensor], torch.Tensor], mats: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Apply a batched kernel once per distinct shape (one eigh/SVD call for all same-shape matrices instead
    of one per matrix: what keeps many small factorizations from being latency-bound on a GPU)."""
    out: dict[int, torch.Tensor] = {}
    for idx in same_shape(mats):
        res = fn(torch.stack([mats[i] for i in idx]))
        for j, i in enumerate(idx):
            out[i] = res[j]
    return out


def gram_inverse_sqrt(
    gram: torch.Tensor,
    method: str = "newton_schulz",
    steps: int = 12,
    eps: float = 1e-12,
    rtol: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """``(A^T A)^{-1/2}`` from the Gram matrix alone, so that ``A @ result`` whitens ``A`` (its polar factor).

    ``newton_schulz``: the coupled iteration of docs/algorithms/swan.md, ``Y0 = S/|S|_F, Z0 = I``,
    ``T = (3I - Z Y)/2, Y <- Y T, Z <- T Z``, in fp32; unlike Muon's quintic it converges (singular values of
    the result -> 1). ``svd``: exact, a float64 eigendecomposition with a pseudo-inverse cutoff (the polar
    factor ``U V^T``; zero singular directions map to zero). Only a ``k x k`` matrix is needed, so sharded
    matrices need just their reduced Gram (shardopt.sharding.matrix_ops). ``rtol``: ``svd``'s relative eigenvalue
    cutoff (``inverse_root``), raised for Grams of bf16/fp16 gradients; None keeps the fp32 one.
    """
    if method == "svd":
        return inverse_root(gram, 0.0, rtol=rtol)
    return coupled_inverse_sqrt(gram.float(), steps, eps)


def inverse_root(
    v: torch.Tensor, eps: float, method: str = "auto", ns_steps: int = 50, rtol: float | torch.Tensor | None = None
) -> torch.Tensor:
    """``(V + eps I)^{-1/2}`` of symmetric PSD ``k x k`` matrices (batched over leading dims), in fp32.

    ``auto`` (default): ``eigh`` results, computed where a device runs eigendecompositions one by one (CUDA)
    as batched float64 Newton-Schulz products with a residual check (``iterative.inverse_sqrt_checked``; the
    matrices that fail it take ``eigh``), elsewhere by ``eigh``; ``eps == 0`` always takes ``eigh``.
    ``eigh`` (exact): float64 eigendecomposition of the symmetrized matrix, eigenvalues clamped at 0;
    with ``eps == 0`` a pseudo-inverse root that ignores eigenvalues below ``k * 1.2e-7 * lambda_max``
    (docs/algorithms/asgo.md). ``newton_schulz``: the coupled iteration of docs/algorithms/asgo.md
    (``Y0 = A/s, Z0 = I``, ``T = (3I - ZY)/2``), in fp32, for comparison with the paper's damping study.

    The iteration converges, or with few ``ns_steps`` stops short in the smallest eigendirections (a damped
    root: every eigenvalue of ``Z A Z`` stays in (0, 1]); but in fp32 it is unstable on ill-conditioned
    ``A`` (rounding grows by about ``sqrt(cond A)`` per step: a rank-1 gradient with a small ``eps`` turns it
    into inf/NaN within 50 steps). A matrix whose result is not finite or whose residual
    ``|Z A Z - I|_F`` exceeds ``1.5 sqrt(k)`` (the bound of a converged or damped root) gets the ``eigh``
    root instead; so does ``eps == 0``, which the iteration cannot pseudo-invert (it would amplify null
    directions by ``1.5^ns_steps``).
    ``rtol``: the pseudo-inverse's relative cutoff instead of ``k * 1.2e-7`` (a float, or one per matrix of the
    batch): raised for statistics of bf16/fp16 gradients (``precision.noise_eig_rtol``).
    """
    k = v.shape[-1]
    vd = v.double()
    a = torch.add(vd, vd.mT).mul_(0.5).add_(torch.eye(k, dtype=torch.float64, device=v.device), alpha=eps)
    if method == "newton_schulz" and eps > 0:
        return _stable_or_eigh(coupled_inverse_sqrt(a.float(), ns_steps, 1e-30), a)
    if method not in ("auto", "eigh", "newton_schulz"):
        raise ValueError(f"root method must be 'auto', 'eigh' or 'newton_schulz', got {method!r}")
    if method == "auto" and eps > 0 and a.dim() == 3 and a.numel() and iterative_device(a.device):
        root, ok = inverse_sqrt_checked(a, eps)
        bad = ~ok
        if count_fallbacks("inverse_sqrt", bad):
            root[bad] = _eigh_inverse_root(a[bad], pseudo_inverse=False).double()
        return root.float()
    return _eigh_inverse_root(a, pseudo_inverse=eps == 0, rtol=rtol)


def _stable_or_eigh(root: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``root`` where it is a converged or damped inverse square root of ``a`` (float64), else the eigh root."""
    k = a.shape[-1]
    eye = torch.eye(k, dtype=torch.float64, device=a.device)
    z = root.double()
    residual = torch.linalg.matrix_norm(z @ a @ z - eye)
    bad = ~torch.isfinite(residual) | (residual > 1.5 * k**0.5)
    if not bool(bad.any()):
        return root
    out = root.clone()
    out[bad] = _eigh_inverse_root(a[bad], pseudo_inverse=False)
    return out


def _eigh_inverse_root(a: torch.Tensor, pseudo_inverse: bool, rtol: float | torch.Tensor | None = None) -> torch.Tensor:
    """``a^{-1/2}`` of symmetric float64 ``a`` (damping already added), in fp32; ``pseudo_inverse`` drops
    eigenvalues below ``k * 1.2e-7 * lambda_max`` (or ``rtol * lambda_max``: one per matrix if a tensor)."""
    k = a.shape[-1]
    lam, vec = torch.linalg.eigh(a)
    lam = lam.clamp(min=0)
    if not pseudo_inverse:
        cutoff = 0.0
    elif rtol is None:
        cutoff = k * 1.2e-7 * lam.amax(-1, keepdim=True)
    else:
        rel = rtol.to(lam).unsqueeze(-1) if isinstance(rtol, torch.Tensor) else rtol
        cutoff = rel * lam.amax(-1, keepdim=True)
    inv = torch.where(lam > cutoff, lam.clamp(min=1e-300).rsqrt_(), 0.0)
    return ((vec * inv.unsqueeze(-2)) @ vec.mT).float()


def _polar_from_svd(g: torch.Tensor, tol: float) -> torch.Tensor:
    """The SVD route of ``polar_factor`` (float64 in and out): ``U diag(sigma_i > tol sigma_1) V^T``."""
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    if not s.numel():
        return u @ vh
    keep = (s > s.amax(-1, keepdim=True) * tol).to(u.dtype)
    return (u * keep.unsqueeze(-2)) @ vh


def _gram_floor(shape: tuple[int, ...]) -> float:
    """Relative size ``f`` (to ``sigma_1``) below which a singular value computed from the float64 Gram matrix of
    a float32 ``k x l`` input may be rounding: forming ``a a^T`` (exact products, sums of ``l`` terms) and its
    eigendecomposition (backward error ``~k eps64 |a a^T|``) move the eigenvalues by ``~f^2 sigma_1^2`` with
    ``f^2 = (k + l) eps64``. The error model of the unchecked Gram route (``~k eps64 sigma_1^2``, see
    ``polar_factor``) plus the forming of the Gram matrix; the worst case, ``k (k + l) eps64``, is far from
    typical and would send well-resolved spectra to the SVD."""
    return math.sqrt((shape[-2] + shape[-1]) * torch.finfo(torch.float64).eps)


def _gram_unsettled(sigma: torch.Tensor, top: torch.Tensor, tol: float, shape: tuple[int, ...]) -> torch.Tensor:
    """Per matrix: whether the Gram singular values ``sigma`` (largest ``top``; from eigenvalues perturbed by at
    most ``f^2 sigma_1^2``, ``f = _gram_floor``) leave the polar factor at cutoff ``tol`` unsettled to float32
    rounding.

    A value below ``tol / 2`` is surely dropped (its true size is below ``sqrt(tol^2 / 4 + f^2) < tol`` when
    ``tol >= 2 f``); a value of at least ``2 tol`` (true size above ``sqrt(4 tol^2 - f^2) > tol``) and at least
    ``t = f / sqrt(2 eps32)`` is surely kept, and the Gram rounding moves its direction of the factor by at most
    ``f^2 / (2 t^2) = eps32`` relative. A value in between (near the cutoff, or too small for the Gram matrix
    to resolve it to float32 accuracy) is unsettled. A zero matrix is settled (every direction dropped)."""
    kept = max(2 * tol, _gram_floor(shape) / math.sqrt(2 * torch.finfo(torch.float32).eps))
    return ((sigma >= top * (tol / 2)) & (sigma < top * kept)).any(-1)
