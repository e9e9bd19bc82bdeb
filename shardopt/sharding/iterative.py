"""Small factorizations as batched matrix products, for devices whose eigensolvers run one matrix at a time.

On a GPU, ``torch.linalg.eigh`` of a stack of ``k x k`` matrices is a loop of cuSOLVER calls with host
synchronizations inside: 7.9 ms per 768 x 768 matrix on an H100, in float32 and float64 alike
(``benchmarks/results/factorizations_cuda.md``), which made ASGO's step 110-140x AdamW's and SUMO's 30-38x
(issue 29). The same results come from the coupled Newton-Schulz iteration, a few dozen batched products for all
matrices of a shape at once.

Both routines here run it in **float64**. A float32 iteration is not as good as the float64 eigendecomposition:
the damped statistic ``V + eps I`` of ASGO, held in float32, cannot represent eigenvalues near ``eps`` when
``eps < eps32 |V|`` (a low-rank statistic: 4e-2 relative error at condition 1.2e6), and nothing computed from the
float32 copy can recover them. Datacenter GPUs multiply float64 at their float32 (non-tensor-core) rate (H100,
A100), so float64 costs nothing there; on GPUs with slow float64, ``root="eigh"`` keeps the old route.

Each routine fixes its step count in advance from a lower bound on the spectrum (no data-dependent loop), then
checks its result: ``|I - Z Y|_F``, the iteration's own residual, must be below ``RESIDUAL_TOL``, i.e. every
eigendirection converged to float32 rounding. The caller recomputes the matrices that fail by the exact
eigendecomposition, so a result is always the float64 one to float32 rounding; deciding which failed is the one
host read these routines cost.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
from typing import TYPE_CHECKING, Iterator

import torch

if TYPE_CHECKING:
    from .teams import RowExchange

__all__ = [
    "RESIDUAL_TOL",
    "MAX_STEPS",
    "steps_to_converge",
    "scaled_schedule",
    "coupled_iteration",
    "coupled_iteration_rows",
    "split_exchange",
    "inverse_newton",
    "inverse_sqrt_checked_rows",
    "coupled_inverse_sqrt_rows",
    "inverse_sqrt_checked",
    "polar_from_gram_checked",
    "cholesky_qr2_checked",
    "orthonormal_columns",
    "iterative_device",
    "forced",
    "fallback_counts",
    "count_fallbacks",
    "routed_counts",
]

#: the iteration's residual ``|I - Z Y|_F`` a result must reach: each eigendirection's scale within 1e-7
#: relative, float32 rounding of the result
RESIDUAL_TOL = 1e-7
#: no more steps than this: a spectrum that needs more goes to the eigendecomposition directly
MAX_STEPS = 64


@functools.lru_cache(maxsize=256)
def steps_to_converge(y0: float, tol: float = 1e-10) -> int:
    """Steps of the coupled iteration after which an eigenvalue ``y0`` of ``A / s`` (the smallest, ``0 < y0 <= 1``)
    has converged: the scalar map ``w <- w ((3 - w) / 2)^2`` (``w = z y``) taken until ``|1 - w| <= tol``; the
    larger eigenvalues converge sooner. ``MAX_STEPS + 1`` where it takes longer than ``MAX_STEPS``."""
    w, steps = min(max(y0, 0.0), 1.0), 0
    while abs(1.0 - w) > tol:
        if steps > MAX_STEPS or w <= 0.0:
            return MAX_STEPS + 1
        w *= ((3.0 - w) / 2.0) ** 2
        steps += 1
    return steps


@functools.lru_cache(maxsize=256)
def scaled_schedule(y0: float, tol: float = 1e-10) -> tuple[float, ...] | None:
    """Per-step scales ``alpha_j`` of the *scaled* coupled iteration (``T = 1.5 alpha I - 0.5 alpha^3 Z Y``) that
    takes every eigenvalue ``w`` of ``A / s`` in ``[y0, 1]`` to within ``tol`` of 1; ``None`` for the bounds the
    plain iteration refuses (``steps_to_converge`` over ``MAX_STEPS``: spectra wider than float64 resolves go to
    the eigendecomposition directly, as before).

    In singular-value terms (``sigma = sqrt(w)``) a step is Newton-Schulz's ``f(x) = (3x - x^3) / 2`` applied to
    ``alpha sigma``. The plain step (``alpha = 1``) grows a small ``sigma`` 1.5x; scaling the interval
    ``[l, u]`` by ``alpha = sqrt(3 / (1 + r + r^2)) / u`` (``r = l / u``), where ``f`` takes both ends to the same
    value, grows it up to ``1.5 sqrt(3) = 2.6x`` and keeps every value in ``(0, 1]`` (Chen and Chow, "A stable
    scaling of Newton-Schulz for improving the sign function computation of a Hermitian matrix", 2014). The
    interval is tracked exactly in scalar arithmetic, and as it closes in on 1, ``alpha`` falls to 1: the last
    steps are the plain ones, with their cubic finish. 14 steps from ``y0 = 1e-8`` where the plain iteration
    takes 28 (``steps_to_converge``); the factor 0.999 keeps ``alpha sigma`` clear of ``f``'s zero at ``sqrt(3)``
    under rounding. With any scales ``Z`` and ``Y`` stay polynomials in ``A`` (``Y = (A / s) Z``), so the
    iteration still converges to ``(A / s)^{-1/2}`` and the residual check still decides."""
    if not y0 > 0.0 or steps_to_converge(y0, tol) > MAX_STEPS:
        return None
    scales: list[float]
    lo, hi, scales = math.sqrt(min(y0, 1.0)), 1.0, []
    while 1.0 - lo * lo > tol or hi * hi - 1.0 > tol:
        if len(scales) >= MAX_STEPS:
            return None
        r = lo / hi
        alpha = max(1.0, 0.999 * math.sqrt(3.0 / (1.0 + r + r * r)))
        x_lo, x_hi = alpha * r, alpha
        f_lo, f_hi = (3.0 * x_lo - x_lo**3) / 2.0, (3.0 * x_hi - x_hi**3) / 2.0
        scales.append(alpha / hi)
        # f rises to 1 at x = 1 and falls after it: the image of [x_lo, x_hi] is [min(f_lo, f_hi), 1 or max]
        lo, hi = min(f_lo, f_hi), 1.0 if x_lo <= 1.0 <= x_hi else max(f_lo, f_hi)
    return tuple(scales)


def coupled_iteration(
    a: torch.Tensor,
    s: torch.Tensor,
    steps: int,
    residual: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``steps`` of the coupled Newton-Schulz iteration on ``a / s`` (symmetric PSD, any leading dimensions; ``s``:
    one scale per matrix, shape ``a.shape[:-2]``): ``Y0 = a/s, Z0 = I``, ``T = (3I - Z Y)/2``, ``Y <- Y T``,
    ``Z <- T Z``. Returns ``Z``, which tends to ``(a/s)^{-1/2}`` where every eigenvalue of ``a / s`` lies in
    (0, 1], and with ``residual`` each matrix's ``|I - Z Y|_F``. The one implementation behind SWAN's whitening,
    ASGO's roots and SUMO's polar factors (``matfun.coupled_inverse_sqrt`` and the checked routes here).

    ``T`` is one fused product ``1.5 I - 0.5 Z Y`` (the same numbers: the halving is exact), and the first
    step, where ``Z = I``, skips its products with the identity. The checked roots take the scaled iteration in
    its inverse Newton form instead (``inverse_newton``)."""
    k = a.size(-1)
    eye = torch.eye(k, dtype=a.dtype, device=a.device)
    y = a / s[..., None, None]
    if a.dim() > 3:  # one batch dimension for baddbmm
        y = y.reshape(-1, k, k)
    addmm = torch.addmm if y.dim() == 2 else torch.baddbmm
    half3 = (1.5 * eye).expand_as(y)
    z = eye.expand_as(y)
    if steps >= 1:
        t = half3 - 0.5 * y  # Z0 = I: Z Y = Y, T Z = T
        y, z = y @ t, t
        for _ in range(steps - 1):
            t = addmm(half3, z, y, alpha=-0.5)
            y, z = y @ t, t @ z
    res = None
    if residual:
        res = torch.linalg.matrix_norm(addmm(eye.expand_as(y), z, y, alpha=-1.0)).reshape(a.shape[:-2])
    return z.reshape(a.shape), res


def split_exchange(steps: int, residual: bool, form: str = "coupled") -> tuple[int, int]:
    """What a split root exchanges: (``k x k`` buffers all-gathered, collective rounds), for ``steps`` steps.
    ``form="coupled"``: ``coupled_iteration_rows``, with ``residual`` (its scalar all-reduce) or without (the last
    step's ``Y`` never gathered). ``form="newton"``: ``inverse_newton`` on a team, one ``M`` per step but the
    last, the result ``Z`` and the residual's all-reduce."""
    if form == "newton":
        return (steps, steps + 1) if steps >= 1 else (0, 1)
    if steps < 1:
        return 0, 1 if residual else 0
    if residual:
        return 3 * steps - 2, 2 * steps
    return 3 * steps - 3, 2 * steps - 1 if steps > 1 else 0


def inverse_newton(
    a: torch.Tensor, s: torch.Tensor, scales: tuple[float, ...], rows: RowExchange | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The checked roots' iteration: ``(a / s)^{-1/2}`` of a ``(B, k, k)`` stack (float64, symmetric PSD; ``s``:
    one scale each, every eigenvalue of ``a / s`` in ``(0, 1]``) by the scaled iteration of ``scales``
    (``scaled_schedule``), and each matrix's residual ``|I - M|_F``.

    The coupled iteration in its inverse Newton form (Guo and Higham 2006): ``M = Z Y = Z (a/s) Z`` instead of
    ``Y``, ``T = 1.5 alpha I - 0.5 alpha^3 M``, ``Z <- Z T``, ``M <- T M T``. The same polynomials in ``a`` as
    ``coupled_iteration`` (they commute), three products a step, and two things it buys: ``T`` is an element-wise
    function of ``M`` (no product), and the residual is ``|I - M|`` itself. So on a team (``rows``: a
    ``teams.RowExchange``) a member computes its row blocks of ``T M T`` and ``Z T`` from the whole ``M`` and
    all-gathers only ``M`` each step (``Z``'s rows stay with it until the end): one ``k x k`` all-gather a step
    where the ``Y``/``Z`` form needs three. Without ``rows`` the member is everything, and the sums are the same
    row blocks of the same products (``split_exchange(form="newton")`` counts the exchange)."""
    k = a.size(-1)
    lo, hi = rows.bounds(k) if rows is not None else (0, k)
    eye = torch.eye(k, dtype=a.dtype, device=a.device)
    m = a / s[..., None, None]
    m_rows, z = m[:, lo:hi], eye[lo:hi].expand(a.size(0), -1, -1)
    for j, c in enumerate(scales):
        t = torch.add(1.5 * c * eye, m, alpha=-0.5 * c**3)
        z = t[:, lo:hi] if j == 0 else z @ t  # Z0 = I
        m_rows = (t[:, lo:hi] @ m) @ t
        if j < len(scales) - 1:  # the last M is needed for the residual only, which its rows give
            m = m_rows if rows is None else rows.gather([m_rows])[0]
    part = eye[lo:hi] - m_rows
    res2 = (part * part).sum((-2, -1))
    if rows is None:
        return z, res2.sqrt()
    return rows.gather([z.contiguous()])[0], rows.sum(res2).sqrt()


def coupled_iteration_rows(
    a: torch.Tensor,
    s: torch.Tensor,
    steps: int,
    rows: RowExchange,
    residual: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``coupled_iteration`` of a ``(B, k, k)`` stack with its products split by row blocks over a team (issue
    53): ``rows`` (``teams.RowExchange``) gives this member's block ``[lo, hi)`` and all-gathers the members'
    blocks into whole matrices (``rows.gather``) or sums a per-matrix scalar (``rows.sum``). Every element is
    the dot product the whole iteration computes (rows of ``Z Y``, ``Y T``, ``T Z``), so the result is the same
    to rounding of the products' blocking; ``a`` and ``s`` are identical on every member, and every member ends
    with the whole ``Z``. Per step a member runs ``1/g`` of the three products and two all-gathers (``T``, then
    ``Y`` and ``Z`` in one; the first step's ``Z = I`` skips them, as ``coupled_iteration``); ``split_exchange``
    counts them."""
    k = a.size(-1)
    lo, hi = rows.bounds(k)
    eye = torch.eye(k, dtype=a.dtype, device=a.device)
    y = a / s[..., None, None]
    half3 = (1.5 * eye).expand_as(y)
    z = eye.expand_as(y)
    if steps >= 1:
        t = half3 - 0.5 * y
        if steps > 1 or residual:
            y = rows.gather([y[:, lo:hi] @ t])[0]
        z = t
        for j in range(steps - 1):
            t = rows.gather([torch.baddbmm(half3[:, lo:hi], z[:, lo:hi], y, alpha=-0.5)])[0]
            last = j == steps - 2 and not residual
            if last:  # the last step's Y is not needed
                z = rows.gather([t[:, lo:hi] @ z])[0]
            else:
                y, z = rows.gather([y[:, lo:hi] @ t, t[:, lo:hi] @ z])
    res = None
    if residual:
        part = torch.baddbmm(eye[lo:hi].expand(y.size(0), -1, -1), z[:, lo:hi], y, alpha=-1.0)
        res = rows.sum((part * part).sum((-2, -1))).sqrt()
    return z, res


def coupled_inverse_sqrt_rows(a: torch.Tensor, steps: int, floor: float, rows: RowExchange) -> torch.Tensor:
    """``matfun.coupled_inverse_sqrt`` (SWAN's whitening root) of a ``(B, k, k)`` stack with its products split
    over a team (``coupled_iteration_rows``): the same scale, steps and result on every member."""
    s = torch.linalg.matrix_norm(a).clamp(min=floor)
    rows.steps = steps
    z, _ = coupled_iteration_rows(a, s, steps, rows)
    return z / s.sqrt()[..., None, None]


def inverse_sqrt_checked_rows(a: torch.Tensor, floor: float, rows: RowExchange) -> tuple[torch.Tensor, torch.Tensor]:
    """``inverse_sqrt_checked`` with the iteration's products split over a team (``coupled_iteration_rows``):
    the same step count (from the same whole ``a`` on every member), the same residual test."""
    s = torch.linalg.matrix_norm(a)
    top = float(s.max()) if s.numel() else 0.0
    scales = scaled_schedule(floor / top) if top > 0 and floor > 0 else None
    if scales is None:
        return torch.zeros_like(a), torch.zeros(a.shape[0], dtype=torch.bool, device=a.device)
    rows.steps = len(scales)
    z, residual = inverse_newton(a, s, scales, rows)
    z = z / s.sqrt()[:, None, None]
    return (z + z.mT) * 0.5, torch.isfinite(residual) & (residual <= RESIDUAL_TOL)


def inverse_sqrt_checked(a: torch.Tensor, floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``a^{-1/2}`` of a ``(B, k, k)`` float64 stack of symmetric positive definite matrices whose smallest
    eigenvalue is at least ``floor`` (ASGO's damping ``eps``), and a mask of the matrices where it holds to float32
    rounding (the rest need the eigendecomposition). The result is symmetrized, so sharing it as a triangle
    changes nothing. One host read: the largest scale, which sets the step count."""
    s = torch.linalg.matrix_norm(a)  # >= lambda_max: every eigenvalue of a / s in (0, 1]
    top = float(s.max()) if s.numel() else 0.0
    scales = scaled_schedule(floor / top) if top > 0 and floor > 0 else None
    if scales is None:
        return torch.zeros_like(a), torch.zeros(a.shape[0], dtype=torch.bool, device=a.device)
    z, residual = inverse_newton(a, s, scales)
    z = z / s.sqrt()[:, None, None]
    return (z + z.mT) * 0.5, torch.isfinite(residual) & (residual <= RESIDUAL_TOL)


def polar_from_gram_checked(
    g: torch.Tensor, tol: float, kept: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The polar factor ``U V^T`` of a ``(B, m, n)`` float64 stack where no singular value falls below ``kept``
    (default ``2 tol``) times the largest, and a mask of the matrices where that holds and the result is exact to
    float32 rounding.

    The factor is ``(a a^T)^{-1/2} a`` on the wide orientation ``a`` (``k x l``, ``k <= l``). A Cholesky test
    decides, with no host read, that every direction is kept with a margin: ``S - kept^2 |S|_F I`` positive
    definite (``S = a a^T``) means ``sigma_min^2 > kept^2 |S|_F >= kept^2 sigma_1^2``, so a cutoff ``tol <= kept / 2``
    drops nothing and the eigenvalues of ``S / |S|_F`` lie in ``(kept^2, 1]``: a step count known in advance. A
    larger ``kept`` also bounds what rounding of the Gram matrix does to the weakest direction (the caller's
    accuracy floor, ``matfun.polar_factor``). Matrices that fail the test (rank-deficient, a direction near the
    cutoff or the floor, zero) are left to the caller's exact route."""
    wide = g.size(-2) <= g.size(-1)
    a = g if wide else g.mT
    gram = a @ a.mT
    s = torch.linalg.matrix_norm(gram)
    k = gram.size(-1)
    eye = torch.eye(k, dtype=gram.dtype, device=gram.device)
    margin = (2.0 * tol if kept is None else kept) ** 2
    _, info = torch.linalg.cholesky_ex(gram - (margin * s)[:, None, None] * eye)
    steps = steps_to_converge(margin)
    z, residual = coupled_iteration(
        gram, s.clamp(min=torch.finfo(gram.dtype).tiny), min(steps, MAX_STEPS), residual=True
    )
    assert residual is not None  # residual=True
    out = (z / s.sqrt()[:, None, None]) @ a
    ok = (info == 0) & torch.isfinite(residual) & (residual <= RESIDUAL_TOL) & (steps <= MAX_STEPS)
    return (out if wide else out.mT), ok


#: Cholesky-QR2's orthogonality residual ``|Q^T Q - I|_F`` a basis must reach (float64 arithmetic; a condition
#: number up to about 1e7 gives 1e-14, and float32 rounding of the result is 1e-7)
ORTHOGONALITY_TOL = 1e-10


def cholesky_qr2_checked(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Orthonormal columns spanning each ``(..., m, n)`` float64 matrix (``m >= n``) by Cholesky-QR2: twice
    ``R = chol(Q^T Q)``, ``Q <- Q R^{-1}``: two ``n x n`` Grams, two small Cholesky factors and two triangular
    solves, batched matrix products all, where a GPU's Householder QR runs one matrix at a time. With a
    mask of the matrices where it holds: both factors exist and ``|Q^T Q - I|_F <= ORTHOGONALITY_TOL`` (a
    condition number past about ``eps64^-1/2``, such as a rank-deficient sketch, fails and is the caller's to
    recompute by QR). ``Q`` equals Householder QR's up to the sign of each column (here ``R`` has a positive
    diagonal); the callers' bases are invariant to it."""
    q, ok = x, torch.ones(x.shape[:-2], dtype=torch.bool, device=x.device)
    for _ in range(2):
        r, info = torch.linalg.cholesky_ex(q.mT @ q, upper=True)
        ok &= info == 0
        q = torch.linalg.solve_triangular(r, q, upper=True, left=False)
    eye = torch.eye(x.shape[-1], dtype=x.dtype, device=x.device)
    residual = torch.linalg.matrix_norm(q.mT @ q - eye)
    return q, ok & torch.isfinite(residual) & (residual <= ORTHOGONALITY_TOL)


def orthonormal_columns(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning each float64 ``(..., m, n)`` matrix (``m >= n``), float64: on the iterative
    route (``iterative_device``) Cholesky-QR2 with Householder QR for the matrices it cannot settle (one host
    read: whether any), else Householder QR."""
    if x.dim() < 2 or not x.numel() or x.shape[-2] < x.shape[-1] or not iterative_device(x.device):
        return torch.linalg.qr(x).Q
    q, ok = cholesky_qr2_checked(x)
    bad = ~ok
    if count_fallbacks("orthonormal", bad):
        if q.dim() == 2:
            return _positive_qr(x)
        q[bad] = _positive_qr(x[bad])
    return q


def _positive_qr(x: torch.Tensor) -> torch.Tensor:
    """Householder QR's ``Q`` with each column's sign chosen so that ``R`` has a non-negative diagonal: the
    factor Cholesky-QR2 gives, so a matrix that falls back on one rank and not on another (a sketch at the
    check's edge, computed in another summation order) gets the same columns, not columns of opposite sign (which
    would move what is built on them, e.g. Alice's complement)."""
    q, r = torch.linalg.qr(x)
    sign = torch.where(torch.diagonal(r, dim1=-2, dim2=-1) < 0, -1.0, 1.0).to(q.dtype)
    return q * sign.unsqueeze(-2)


_FALLBACKS: collections.Counter = collections.Counter()
_ROUTED: collections.Counter = collections.Counter()


def count_fallbacks(route: str, bad: torch.Tensor) -> int:
    """Counts the matrices a mask ``bad`` says ``route`` left to its factorization (and all it saw), and returns
    their number (the one host read of a checked route: whether any failed)."""
    _ROUTED[route] += bad.numel()
    n = int(bad.sum())
    if n:
        _FALLBACKS[route] += n
    return n


def fallback_counts(reset: bool = False) -> dict[str, int]:
    """Matrices the iterative routes left to a factorization in this process, by route (``"inverse_sqrt"``,
    ``"polar"``, ``"orthonormal"``): what ``benchmarks.throughput`` reports beside tokens/s. ``reset`` clears
    this count and ``routed_counts``."""
    out = dict(_FALLBACKS)
    if reset:
        _FALLBACKS.clear()
        _ROUTED.clear()
    return out


def routed_counts() -> dict[str, int]:
    """Matrices each iterative route saw since the last reset (``fallback_counts``): the fallbacks' denominator."""
    return dict(_ROUTED)


_FORCED: bool | None = None


def iterative_device(device: torch.device) -> bool:
    """Whether the iterative routes are the default on ``device``: where eigh runs one matrix at a time with
    host syncs (CUDA). On a CPU, LAPACK's eigendecomposition of a small matrix is cheaper than the iteration's
    dozens of products, and stays the route (``forced`` overrides this, for tests of the GPU route on a CPU)."""
    return device.type == "cuda" if _FORCED is None else _FORCED


@contextlib.contextmanager
def forced(value: bool = True) -> Iterator[None]:
    """Within the block, take the iterative routes (``True``) or never (``False``) whatever the device."""
    global _FORCED
    old, _FORCED = _FORCED, value
    try:
        yield
    finally:
        _FORCED = old
