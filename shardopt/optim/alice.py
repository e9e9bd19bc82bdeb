"""Alice and Alice-0: low-rank Adam in a tracked, switched subspace plus compensation (arXiv:2502.07752
Alg. 2-4 and 10; docs/algorithms/alice.md).

Per matrix, on ``A = G`` when ``m <= n`` (rows projected) or ``A = G^T`` otherwise (``U`` is ``rows x r``); the
state keys are the symbols: ``U``, ``Q_tilde``, ``M``, ``V``, ``p``, ``phi``::

    at steps 1, K, 2K, ...:  switch the basis
        step 1: U' = top-r basis of A (seeded randomized range finder; the paper's U_0 = 0 is degenerate)
        later:  H = b3 U (Q_tilde (U^T U)) + (1 - b3) A (A^T U)       (``subspace_sketch``)
                Ut = qr(H);  U' = Ritz vectors of Ut^T Q Ut, Q = b3 U Q_tilde U^T + (1 - b3) A A^T never formed,
                sorted by Ritz value                                  (``ritz_vectors``)
        U = [top-l of U', r - l columns drawn (seeded) from the complete-QR complement of U']  (``switched_basis``)
        Q_tilde re-projected into the new basis (reproject=True; False keeps the paper's literal mixing)
    sigma = U^T A;  Q_tilde = b3 Q_tilde + (1 - b3) sigma sigma^T   (Alice only; Alice-0 has b3 = 0, no Q_tilde)
    M = b1 M + (1 - b1) sigma;  V = b2 V + (1 - b2) sigma*sigma    (``update_moments``)
    R = A - U sigma;  p = b1 p + (1 - b1) colsum(R*R)               (``residual_energy``: R is never formed)
    C = sqrt(rows - r) R / sqrt(p + eps) (``compensation_scale``), limited by gamma (``norm_growth_eta``)
    W = W (1 - lr wd) - lr alpha (U w + alpha_c C),  w = M / (sqrt(V) + eps)      (``low_rank_step``)

The functions named above are the math, on plain tensors (a block of rows of ``A`` and the reduced statistics;
all of them also take stacked matrices of one shape, and the per-step ones lists of such stacks, whose element-wise
work then runs as foreach kernels). ``Alice._alice_bucket`` drives them on ``MatrixOps``, matrices of one block
shape stacked (``_BucketPlan``), so a step issues a number of torch calls that depends on the shapes, not the matrices:
every product with ``A`` sums over its rows or is row-local, so under the distributed strategy the per-step
traffic is the ``r x cols`` projection, a ``cols`` vector and a scalar; a switch adds ``cols x r`` reductions
and the assembled ``rows x r`` sketch. Randomness is keyed by (seed, name, switch count), so every rank and
every world size draws the same.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, cast

import pydantic
import torch
from typing_extensions import Unpack

from ..sharding.draws import seeded_permutation
from ..sharding.matrix_ops import MatrixOps, OpCost
from ..sharding.orientation import mm_like
from ..sharding.precision import LOW_PRECISION, arrival_dtype
from ..sharding.stacking import group_indices, stack, stack_stored
from ..sharding.state_split import ROWS
from ..sharding.subspace import (
    complete_basis,
    determined_floor,
    fill_draw,
    fp32_floor,
    pin_signs,
    range_basis,
    restart_columns,
    signal_directions,
    signal_range,
)
from .base import ShardedOptimizer
from .config import CommonOptions, WholeMatrixConfig, check_betas
from .items import apply_items
from .nonfinite import gated, keep_unless_gated, zero_nonfinite
from .racs import norm_growth_eta
from .sumo import effective_rank, signal_floors, warn_clamped_ranks

__all__ = [
    "Alice",
    "Alice0",
    "subspace_sketch",
    "ritz_vectors",
    "switched_basis",
    "reproject_tracking",
    "residual_energy",
    "update_moments",
    "compensation_scale",
    "low_rank_step",
    "AliceConfig",
    "Alice0Config",
]


def subspace_sketch(
    a_rows: torch.Tensor,
    at_u: torch.Tensor,
    u_rows: torch.Tensor,
    U: torch.Tensor,
    Q_tilde: torch.Tensor | None,
    b3: float,
    start: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows of ``H = Q X = b3 U (Q_tilde (U^T X)) + (1 - b3) A (A^T X)`` for the rows ``a_rows`` of ``A``
    (``u_rows`` the same rows of ``U``; ``at_u = A^T X`` reduced over all rows); the iteration's start ``X`` is
    ``U``, or ``start`` (``U`` with its left-out columns drawn afresh: ``signal_rank``)."""
    h = (1 - b3) * (a_rows @ at_u)
    if Q_tilde is not None and b3:
        h = h + b3 * (u_rows @ (Q_tilde @ (U.mT @ (U if start is None else start))))
    return h


def ritz_vectors(
    u_tilde: torch.Tensor,
    at_ut: torch.Tensor,
    U: torch.Tensor,
    Q_tilde: torch.Tensor | None,
    b3: float,
    floor: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Rayleigh-Ritz: the eigenvectors of ``Ut^T Q Ut = (1 - b3) (A^T Ut)^T (A^T Ut) + b3 C Q_tilde C^T`` (``C =
    Ut^T U``) mapped back by ``Ut``, by descending Ritz value (float64 eigh, fp32 result). Ritz values at fp32
    rounding level (``signal_directions`` of their square roots: a rank-deficient ``A``) leave their vectors to
    summation order; they come back as zero columns (``Alice._switch`` completes them with seeded directions,
    ``subspace.complete_basis``). ``floor``: a higher relative cutoff of the square roots (``signal_rank``: one
    per matrix of the stack, ``(B, 1)``)."""
    vr = (1 - b3) * (at_ut.mT @ at_ut).double()
    if Q_tilde is not None and b3:
        c = (u_tilde.mT @ U).double()
        vr = vr + b3 * (c @ Q_tilde.double() @ c.mT)
    lam, vec = torch.linalg.eigh(0.5 * (vr + vr.mT))
    lam, vec = lam.flip(-1), vec.flip(-1)
    shape = (u_tilde.shape[-2], at_ut.shape[-2])
    keep = signal_directions(lam.clamp(min=0).sqrt(), shape, None if floor is None else floor)
    return (u_tilde.double() @ (vec * keep.unsqueeze(-2))).float()


def switched_basis(u1: torch.Tensor, lead: int, pick: torch.Tensor | None) -> torch.Tensor:
    """Alg. 2: keep the leading ``lead`` columns of ``u1`` and append the columns ``pick`` of the orthogonal
    complement of all of ``u1`` (complete QR); ``pick=None`` keeps ``u1``. Batched: ``u1`` ``(..., rows, r)`` and
    ``pick`` ``(..., r - lead)``, one complete QR for the whole stack (the same numbers as one per matrix)."""
    if pick is None:
        return u1
    r = u1.shape[-1]
    complement = torch.linalg.qr(u1.double(), mode="complete").Q[..., r:].float()
    index = pick.to(complement.device).unsqueeze(-2).expand(*complement.shape[:-1], pick.shape[-1])
    return torch.cat([u1[..., :lead], complement.gather(-1, index)], dim=-1)


def reproject_tracking(Q_tilde: torch.Tensor, U_new: torch.Tensor, U: torch.Tensor) -> None:
    """``Q_tilde <- (U_new^T U) Q_tilde (U^T U_new)`` in place: the tracked statistic in the new basis."""
    c = U_new.mT @ U
    Q_tilde.copy_(c @ Q_tilde @ c.mT)


def residual_energy(a_energy: torch.Tensor, sigma: torch.Tensor, floor: float | torch.Tensor = 0.0) -> torch.Tensor:
    """``colsum(R * R)`` of ``R = A - U sigma`` from ``colsum(A * A)`` and ``sigma = U^T A``: with orthonormal
    ``U``, ``|R e_j|^2 = |a_j|^2 - |sigma_j|^2``, set to 0 where it is at most ``floor |a_j|^2`` (the rounding
    of that difference: a column ``U`` captures whole leaves a residual of rounding noise, which the
    compensation's ``1 / sqrt(p)`` would otherwise amplify). Tensors (one matrix or a stack) or lists of them."""
    if isinstance(sigma, torch.Tensor):
        out = a_energy - sigma.square().sum(-2)
        return out.masked_fill_(out <= floor * a_energy, 0.0)
    out = torch._foreach_sub(a_energy, [s.sum(-2) for s in torch._foreach_mul(sigma, sigma)])
    for o, e in zip(out, a_energy):
        o.masked_fill_(o <= floor * e, 0.0)
    return out


def drop_noise_directions(sigma: torch.Tensor, a_energy: torch.Tensor, floor: float | torch.Tensor) -> torch.Tensor:
    """``sigma = U^T A`` (``(..., r, cols)``) with the entries at fp32 rounding level set to 0:
    ``|sigma_ij| <= floor |a_j|``, the rounding bound of the product of a unit basis vector with column ``j``
    (a rank-deficient ``A`` leaves whole directions at that level, a padded or frozen column leaves entries).
    Adam's element-wise normalization ``M / sqrt(V)`` would give such an entry a unit-size step from noise,
    which depends on summation order (issue 28); in place."""
    bound = (floor * floor) * a_energy.unsqueeze(-2)
    return sigma.masked_fill_(sigma.square() <= bound, 0.0)


def update_moments(
    M: Any, V: Any, p: Any, Q_tilde: Any, sigma: Any, energy: Any, betas: tuple[float, float, float]
) -> None:
    """In place: ``Q_tilde = b3 Q_tilde + (1 - b3) sigma sigma^T`` (when tracked), ``M = b1 M + (1 - b1) sigma``,
    ``V = b2 V + (1 - b2) sigma * sigma``, ``p = b1 p + (1 - b1) energy`` (the paper decays p with b1). Each
    argument is a tensor (one matrix, or a stack of matrices of one shape) or a list of such tensors: one
    foreach kernel per statistic then updates all of them."""
    b1, b2, b3 = betas
    if isinstance(M, torch.Tensor):
        M, V, p, sigma, energy = [M], [V], [p], [sigma], [energy]
        Q_tilde = None if Q_tilde is None else [Q_tilde]
    if Q_tilde is not None:
        for q, s in zip(Q_tilde, sigma):
            (q.addmm_ if q.dim() == 2 else q.baddbmm_)(s, s.mT, beta=b3, alpha=1 - b3)
    torch._foreach_lerp_(M, sigma, 1 - b1)
    torch._foreach_mul_(V, b2)
    torch._foreach_addcmul_(V, sigma, sigma, value=1 - b2)
    torch._foreach_lerp_(p, energy, 1 - b1)


def compensation_scale(
    p: torch.Tensor, energy: torch.Tensor, rows: int, r: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``C = R diag(c)`` with ``c_j = sqrt(rows - r) / sqrt(p_j + eps)`` (0 where ``p_j = 0``; ``c = 0`` when
    ``r = rows``), and ``|C|`` from the residual column energies, so ``C`` is never formed. ``c_j = 0`` also where
    this step's residual energy ``energy_j`` is 0 (``residual_energy``: at rounding level, a column the basis
    captures whole): ``R e_j`` is then rounding that ``1 / sqrt(p_j)`` of earlier steps' residuals would amplify
    into a step that depends on summation order (3.8e-5 after one switch onto a rank-2 gradient, issue 63)."""
    if r < rows:
        c = torch.where((p > 0) & (energy > 0), (p + eps).rsqrt(), torch.zeros_like(p)) * math.sqrt(rows - r)
    else:
        c = torch.zeros_like(p)
    return c, (c * c * energy).sum(-1).sqrt()


def low_rank_step(a_rows: Any, u_rows: Any, sigma: Any, M: Any, V: Any, col: Any, alpha: float, eps: float) -> Any:
    """Rows of ``alpha U w + A diag(col) - U (sigma diag(col))`` with ``w = M / (sqrt(V) + eps)``: with
    ``col = alpha alpha_c eta c`` this is ``alpha (U w + alpha_c eta C)``, one product with ``A``; ``col=None``
    is ``col = 0`` (no compensation: ``r = rows``). Tensors (one matrix or a stack of one shape) or lists of
    them: then the element-wise work is one foreach kernel for all, and the result a list."""
    single = isinstance(M, torch.Tensor)
    if single:
        a_rows, u_rows, sigma, M, V, col = [a_rows], [u_rows], [sigma], [M], [V], [col]
    d = torch._foreach_sqrt(V)
    torch._foreach_add_(d, eps)
    low = torch._foreach_div(torch._foreach_mul(M, alpha), d)  # alpha w
    out = []
    for a, u, s, w, c in zip(a_rows, u_rows, sigma, low, col):
        if c is None:
            out.append(_mm_like(a, u, w))
            continue
        c = c.unsqueeze(-2)
        out.append(_mm_like(a, u, w.addcmul_(s, c, value=-1)).addcmul_(a, c))
    return out[0] if single else out


def _mm_like(like: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``orientation.mm_like`` also for stacks of blocks: ``x @ y`` stored in ``like``'s orientation."""
    if like.dim() == 2:
        return mm_like(like, x, y)
    return torch.bmm(y.mT, x.mT).mT if not like.is_contiguous() and like.mT.is_contiguous() else torch.bmm(x, y)


class AliceConfig(WholeMatrixConfig):
    """docs/algorithms/alice.md, the paper's Tables 7-11 (60M-350M): lr 0.02, alpha 0.3, alpha_c 0.4,
    betas (0.9, 0.9, 0.999), K 200, r 128, l 40, gamma 1.01. The main results train the LM head with the low-rank
    rule too."""

    treatment = "alice"

    lr: float = pydantic.Field(0.02, ge=0, description="matrix learning rate (AdamW's too unless adam_lr)")
    alpha: float = pydantic.Field(0.3, ge=0, description="scale of the low-rank update")
    alpha_c: float = pydantic.Field(0.4, ge=0, description="scale of the compensation outside the subspace")
    betas: tuple[float, float, float] = pydantic.Field(
        (0.9, 0.9, 0.999), description="b1 momentum, b2 second moment, b3 tracking (0 when tracking is off)"
    )
    rank: int = pydantic.Field(128, ge=1, description="r: subspace rank (clamped to min(m, n) with a warning)")
    leading: int = pydantic.Field(
        40,
        ge=0,
        validate_default=True,  # checked against rank when defaulted too
        description="l <= r: leading directions kept at a switch",
    )
    refresh_interval: int = pydantic.Field(200, ge=1, description="K: steps between subspace switches")
    gamma: float = pydantic.Field(1.01, ge=1, description="norm-growth limiter")
    eps: float = pydantic.Field(
        1e-8,
        ge=0,
        description="added to sqrt(V) in the low-rank Adam step and to the column energy in the compensation",
    )
    reproject: bool = pydantic.Field(True, description="rotate the tracking state into the new basis at a switch")
    seed: int = pydantic.Field(0, description="seed of the range finder's draws")
    oversample: int = pydantic.Field(10, ge=0, description="randomized range finder oversampling")
    power_iters: int = pydantic.Field(2, ge=0, le=20, description="randomized range finder power iterations")
    tracking: bool = pydantic.Field(True, description="keep the tracking state (False: Alice-0)")
    signal_rank: bool = pydantic.Field(
        False,
        description="a switch leaves out (zero columns until the next switch) the leading directions whose singular "
        "values are at the gradient precision's rounding, instead of completing them from seeded draws",
    )

    @pydantic.field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float, float]) -> tuple[float, float, float]:
        return check_betas("betas", v)

    @pydantic.field_validator("leading")
    @classmethod
    def _leading_within_rank(cls, v: int, info: pydantic.ValidationInfo) -> int:
        if "rank" in info.data and v > info.data["rank"]:
            raise ValueError(f"{v} must be <= rank = {info.data['rank']}")
        return v

    def group_defaults(self) -> dict[str, Any]:
        b1, b2, b3 = self.betas
        return {**super().group_defaults(), "betas": (b1, b2, b3 if self.tracking else 0.0)}

    def roles(self) -> dict[str, dict]:
        return {**super().roles(), "lm_head": {"treatment": self.treatment}}


class Alice0Config(AliceConfig):
    """Alice-0: Alice without the tracking state (b3 = 0), the paper's choice when memory matters."""

    treatment = "alice0"

    tracking: bool = pydantic.Field(False, description="keep the tracking state (True: Alice)")


_D = AliceConfig.defaults()


class Alice(ShardedOptimizer):
    """Alice (``treatment="alice"``). Keys: ``lr`` (0.02), ``alpha`` (0.3), ``alpha_c`` (0.4), ``betas``
    (b1 0.9, b2 0.9, b3 0.999), ``rank`` (128), ``leading`` l (40), ``refresh_interval`` K (200), ``gamma``
    (1.01), ``eps`` (1e-8), ``reproject`` (True), ``seed`` (0), ``weight_decay`` (0). State per matrix: ``U``,
    ``Q_tilde``, ``M``, ``V``, ``p``, ``phi``, ``switches`` (docs/algorithms/alice.md). ``Alice0`` is the same
    with ``tracking=False`` (b3 = 0, no ``Q_tilde`` state)."""

    Config = AliceConfig
    matrix_treatments = ("alice",)
    state_kinds = {
        **ShardedOptimizer.state_kinds,
        "U": "matrix",
        "Q_tilde": "matrix",
        "M": "matrix",
        "V": "matrix",
        "p": "matrix",
        "phi": "matrix",
        "switches": "matrix",
    }
    state_key_renames = {
        "basis": "U",
        "tracking": "Q_tilde",
        "exp_avg_low": "M",
        "exp_avg_sq_low": "V",
        "col_energy": "p",
    }
    #: a switch: the SVD of the sketch ``H`` (its determined directions; the first switch: of the range finder's
    #: ``Y^T G``), the Rayleigh-Ritz ``eigh`` (``r x r``) and Alg. 2's complete QR for the complement
    refresh_factorizations = {"svd": 1, "eigh": 1, "qr": 1}

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = _D.lr,
        alpha: float = _D.alpha,
        alpha_c: float = _D.alpha_c,
        betas: tuple[float, float, float] = _D.betas,
        rank: int = _D.rank,
        leading: int = _D.leading,
        refresh_interval: int = _D.refresh_interval,
        gamma: float = _D.gamma,
        eps: float = _D.eps,
        reproject: bool = _D.reproject,
        seed: int = _D.seed,
        oversample: int = _D.oversample,
        power_iters: int = _D.power_iters,
        signal_rank: bool = _D.signal_rank,
        weight_decay: float = _D.weight_decay,
        **options: Unpack[CommonOptions],
    ):
        """``tracking`` (an option; default: the class's, Alice True, Alice0 False) keeps the tracking state."""
        self._init_from_config(
            params,
            self.Config.from_arguments(
                type(self).__name__,
                dict(
                    lr=lr,
                    alpha=alpha,
                    alpha_c=alpha_c,
                    betas=betas,
                    rank=rank,
                    leading=leading,
                    refresh_interval=refresh_interval,
                    gamma=gamma,
                    eps=eps,
                    reproject=reproject,
                    seed=seed,
                    oversample=oversample,
                    power_iters=power_iters,
                    signal_rank=signal_rank,
                    weight_decay=weight_decay,
                ),
                options,
            ),
        )

    whole_matrix_work = True
    _IDENTITY_CACHES: tuple[str, ...] = (*ShardedOptimizer._IDENTITY_CACHES, "_alice_plans")

    def _forget_plans(self) -> None:
        super()._forget_plans()
        self.__dict__.get("_alice_plans", {}).clear()

    def whole_matrix_transpose(self, group: dict, shape: tuple[int, int]) -> bool:
        m, n = shape
        return m > n

    def whole_matrix_cost(self, group: dict, a_shape: tuple[int, int], parts: int = 1) -> OpCost:
        rows, cols = a_shape
        r = min(group["rank"], rows, cols)
        # a switch, spread over its interval: the sketch's SVD (rows x r), the Rayleigh-Ritz eigh (r x r) and
        # Alg. 2's complete QR (rows x rows from rows x r): three solver calls
        switch = 4.0 * rows * r * r + 22.0 * r**3 + 10.0 * r**3 + 4.0 * rows * rows * r
        every = group["refresh_interval"]
        # per step, products of small matrices (``sigma sigma^T`` for the tracking, the moments): no factorization
        return OpCost(
            row_flops=8.0 * rows * cols * r,
            small_matmul=4.0 * cols * r * r,
            small_flops=switch / every,
            small_calls=3.0 / every,
            reduced=r * cols + cols + 1,
            state=rows * r + 2 * r * cols + cols + (r * r if group["tracking"] else 0),
            row_state=rows * r,
            # a switch after the first: U assembled, A^T U, the sketch assembled, A^T U~ (rows or cols x r)
            refresh_reduced=2 * (rows + cols) * r,
            refresh_every=group["refresh_interval"],
        )

    def matrix_state_spec(self, group: dict, a_shape: tuple[int, int]) -> dict:
        rows, cols = a_shape
        r = min(group["rank"], rows, cols)
        spec = {
            "U": ((rows, r), ROWS),
            "M": ((r, cols), 1),
            "V": ((r, cols), 1),
            "p": ((cols,), 0),
            "phi": ((), None),
            "switches": ((), None),
        }
        if group["tracking"]:
            spec["Q_tilde"] = ((r, r), 1)
        return spec

    def skips_on_device(self, group: dict) -> bool:
        """Alice gates every write of a step that switches no basis (``_alice_bucket``): on gradients whose
        non-finite elements read as 0, a skipped step's new statistics are put back to the old ones (a select,
        ``nonfinite.keep_unless_gated``), ``alpha`` and the limiter's ``eta`` are 0 and the decay factor is 1. A step
        that switches a basis reads the device anyway (its factorizations), so it keeps the host's check."""
        if group.get("treatment") not in self.matrix_treatments:
            return super().skips_on_device(group)
        interval = group["refresh_interval"]
        for p in group["params"]:
            upcoming = int(self.state[p].get("step", 0)) + 1  # the host's count, as _alice_bucket's schedule
            if upcoming == 1 or upcoming % interval == 0:
                return False
        return True

    def _step_alice(self, group: dict) -> None:
        warn_clamped_ranks(self, type(self).__name__)
        steps = self._step_counts(group["params"])  # taken back if the device skips this step
        items = self._matrix_items(group)
        self._run_whole_matrix(group, items, lambda its, ops: self._alice_bucket(group, its, ops, steps))

    def _bucket_plan(self, group: dict, items: list, ops: MatrixOps) -> "_BucketPlan":
        """The static part of a bucket's step (cached: it depends on the row plans, strategies, which matrices
        have a gradient and the rank only)."""
        cache = self.__dict__.setdefault("_alice_plans", {})
        key = (tuple(ops.plans), tuple(ops.kinds), tuple([it.has_grad for it in items]), group["rank"])
        plan = cache.get(key)
        if plan is None:
            if len(cache) >= 64:  # engines that hand new layouts must not grow it without bound
                cache.clear()
            plan = cache[key] = _BucketPlan(group["rank"], items, ops)
        return plan

    def _alice_bucket(self, group: dict, items: list, ops: MatrixOps, steps: dict) -> None:
        """One step of a bucket. Matrices whose blocks share a shape (and rank, strategy, gradient presence) run
        as ``(B, rows, cols)`` stacks (``_BucketPlan``): one batched product per stack, the statistics of all
        stacks updated by foreach kernels, their per-matrix state read as stacks and written back by one foreach
        copy, the updates applied by ``apply_items``. Collectives are those of the per-matrix form: ``to_blocks``
        / ``from_blocks`` of the sharded matrices in their order, one ``allreduce`` of the same partial sums."""
        plan = self._bucket_plan(group, items, ops)
        gate = self._step_gate  # None, or 0-d 1./0.: the step's skip decided on the device (skips_on_device)
        blocks: dict[int, torch.Tensor] = {}
        if plan.remote:  # sharded matrices: their rows of A move to the ranks that compute them
            sub = ops.subset(plan.remote)
            blocks.update(zip(plan.remote, (b[0] for b in sub.to_blocks([[items[i].grad] for i in plan.remote]))))
        interval = group["refresh_interval"]
        switch = [
            i for i in plan.active if steps[id(items[i].tensor)] == 1 or steps[id(items[i].tensor)] % interval == 0
        ]
        if switch:
            for i in switch:
                if i not in blocks:
                    blocks[i] = plan.local_block(i, items[i].grad)
            lead = {}
            for i in switch:
                r, rows = plan.ranks[i], ops.plans[i].a_shape[0]
                # the complement must hold the r - l sampled columns; at r = rows there is none (C = 0)
                lead[i] = r if r == rows else max(min(group["leading"], r), 2 * r - rows)
            self._switch(ops, items, blocks, switch, dict(enumerate(plan.ranks)), lead, group)

        # sigma = U^T A and colsum(A * A), summed over the ranks of distributed matrices in one reduction;
        # R = A - U sigma is never formed (residual_energy)
        a_stacks: list[torch.Tensor] = []
        u_stacks: list[torch.Tensor] = []
        sigmas: list[torch.Tensor] = []
        a_energy: list[torch.Tensor] = []
        parts: dict[int, torch.Tensor] = {}
        for s in plan.stacks:
            if s.local:  # the gradients themselves, viewed as A = G (the first n_plain) or A = G^T
                n, b = s.n_plain, len(s.idx)
                g = [stack([items[i].grad for i in s.idx[:n]]).view(n, s.rows, s.cols)] if n else []
                if n < b:
                    g.append(stack([items[i].grad for i in s.idx[n:]]).view(b - n, s.cols, s.rows).mT)
                a = g[0] if len(g) == 1 else torch.cat(g)
            else:
                a = stack_stored([blocks[i] for i in s.idx])
            if gate is not None:  # a skipped step multiplies its update by 0, which an inf or NaN would survive
                made = a._base is None or (not s.local and len(s.idx) > 1)  # a stack made for this step
                a = zero_nonfinite(a, in_place=made)
            u = stack([items[i].state["U"] for i in s.idx])  # this rank's rows where they are split (ROWS)
            sigma, energy = torch.bmm(u.mT, a), a.square().sum(-2)
            if s.distributed:
                part = torch.cat([sigma.flatten(1), energy], 1)
                parts.update(zip(s.idx, part.unbind(0)))
            a_stacks.append(a)
            u_stacks.append(u)
            sigmas.append(sigma)
            a_energy.append(energy)
        if parts:
            parts = ops.allreduce(parts)
            for k, s in enumerate(plan.stacks):
                if s.distributed:
                    part = torch.stack([parts[i] for i in s.idx])
                    sigmas[k] = part[:, : s.r * s.cols].view(-1, s.r, s.cols)
                    a_energy[k] = part[:, s.r * s.cols :]

        updates = self._stack_updates(group, plan, items, a_stacks, u_stacks, sigmas, a_energy) if plan.stacks else []
        pieces: list[torch.Tensor | None] = [None] * len(items)
        remote_updates: dict[int, torch.Tensor] = {}
        for s, upd in zip(plan.stacks, updates):
            if s.local:  # G's flat elements (a stack of A = G^T alone was computed in G's order: views)
                n, b = s.n_plain, len(s.idx)
                flat = ([upd[:n].reshape(n, -1)] if n else []) + ([upd[n:].mT.reshape(b - n, -1)] if n < b else [])
                for i, piece in zip(s.idx, (p for f in flat for p in f.unbind(0))):
                    pieces[i] = piece
            else:
                remote_updates.update(zip(s.idx, upd.unbind(0)))
        if plan.remote:
            for i, piece in zip(plan.remote, sub.from_blocks([remote_updates.get(i) for i in plan.remote])):
                pieces[i] = piece
        ops.account()
        done = cast(list[torch.Tensor], pieces)  # every item has its piece by now
        apply_items(items, done, group["lr"], group["weight_decay"], gate=gate)

    def _noise_floor(self, s: "_Stack", items: list) -> float | torch.Tensor:
        """The relative level at which a stack's ``sigma`` entries and residual energies are rounding:
        ``fp32_floor``, raised to ``eps(dtype)`` (the rounding bound ``u |a_j|`` of a unit vector times a
        column rounded at ``u``, a factor-2 margin) for a matrix whose gradient arrived in bf16/fp16
        (``sharding.precision``); a float when the stack's matrices agree, else one per matrix."""
        fp32 = fp32_floor((s.rows, s.cols))
        floors = [
            max(fp32, torch.finfo(d).eps) if d in LOW_PRECISION else fp32
            for d in (arrival_dtype(self, items[i].frag.name, items[i].tensor) for i in s.idx)
        ]
        if all(f == floors[0] for f in floors):
            return floors[0]
        return torch.tensor(floors, dtype=torch.float32, device=items[s.idx[0]].tensor.device)

    def _stack_updates(
        self,
        group: dict,
        plan: "_BucketPlan",
        items: list,
        a_stacks: list,
        u_stacks: list,
        sigmas: list,
        a_energy: list,
    ) -> list[torch.Tensor]:
        """Statistics, compensation, limiter and the update of every stack (``plan.stacks``, not empty), with
        the new statistics written back into each matrix's state."""
        tracking = group["tracking"]
        b1, b2, b3 = group["betas"]
        alpha, eps = group["alpha"], group["eps"]
        gate = self._step_gate  # None, or 0-d 1./0. (skips_on_device)
        keys = ("M", "V", "p") + (("Q_tilde",) if tracking else ())
        states = [[items[i].state for i in s.idx] for s in plan.stacks]
        cur = [{key: s.gather(key, [st[key] for st in sts]) for key in keys} for s, sts in zip(plan.stacks, states)]
        moved = [k for k, s in enumerate(plan.stacks) if s.has_grad]
        before = None if gate is None else {k: {key: cur[k][key].clone() for key in keys} for k in moved}
        floors = [self._noise_floor(s, items) for s in plan.stacks]
        for sigma, energy, floor in zip(sigmas, a_energy, floors):
            drop_noise_directions(sigma, energy, floor if isinstance(floor, float) else floor[:, None, None])
        energies = [
            residual_energy(e, s, f if isinstance(f, float) else f[:, None])
            for e, s, f in zip(a_energy, sigmas, floors)
        ]
        if moved:
            update_moments(
                [cur[k]["M"] for k in moved],
                [cur[k]["V"] for k in moved],
                [cur[k]["p"] for k in moved],
                [cur[k]["Q_tilde"] for k in moved] if tracking else None,
                [sigmas[k] for k in moved],
                [energies[k] for k in moved],
                (b1, b2, b3),
            )
            if gate is not None:  # a skipped step: back to the old statistics (a select: the new may overflow)
                assert before is not None  # cloned above where there is a gate
                for k in moved:
                    for key in keys:
                        keep_unless_gated(gate, cur[k][key], before[k][key])
        # the compensation where r < rows, with one limiter for all of them; at r = rows C = 0, so |C| = 0,
        # eta = 1 and phi <- 0
        comp = [k for k, s in enumerate(plan.stacks) if s.r < s.rows]
        cols: list[torch.Tensor | None] = [None] * len(plan.stacks)
        dst, src = [], []
        if comp:
            scale, norms = zip(
                *(
                    compensation_scale(cur[k]["p"], energies[k], plan.stacks[k].rows, plan.stacks[k].r, eps)
                    for k in comp
                )
            )
            norm = torch.cat(norms)
            phi_old = torch.stack([st["phi"] for k in comp for st in states[k]])
            eta = norm_growth_eta(norm, phi_old, group["gamma"])
            new_phi = eta * norm
            if gate is not None:  # a skipped step keeps phi and adds no compensation (selects: |C| may overflow)
                new_phi, eta = gated(gate, new_phi, phi_old), gated(gate, eta, 0.0)
            sizes = [len(plan.stacks[k].idx) for k in comp]
            for k, c, e in zip(comp, scale, eta.split(sizes)):
                cols[k] = c * (e * (alpha * group["alpha_c"])).unsqueeze(-1)
            for k, phi in zip(comp, new_phi.split(sizes)):
                if plan.stacks[k].has_grad:
                    dst += [st["phi"] for st in states[k]]
                    src += phi.unbind(0)
        if moved:  # the new statistics back into each matrix's state
            for k in moved:
                for key in keys:
                    dst += [st[key] for st in states[k]]
                    src += plan.stacks[k].rows_of(key, cur[k][key])
            torch._foreach_copy_(dst, src)
            full = [st["phi"] for k in moved if k not in comp for st in states[k]]
            if full:
                torch._foreach_zero_(full)

        return low_rank_step(
            a_stacks,
            u_stacks,
            sigmas,
            [c["M"] for c in cur],
            [c["V"] for c in cur],
            cols,
            alpha if gate is None else alpha * gate,
            eps,
        )

    def _switch(
        self, ops: MatrixOps, items: list, blocks: Any, switch: list[int], ranks: dict, lead: dict, group: dict
    ) -> None:
        """New bases for the matrices in ``switch`` (Alg. 2 on the Rayleigh-Ritz subspace step of Alg. 10)."""
        b3 = group["betas"][2]
        first = [i for i in switch if int(items[i].state["switches"]) == 0]
        later = [i for i in switch if i not in first]
        # signal_rank: the directions each matrix's gradient precision determines (0/1 per column of U)
        floors = signal_floors(self, group, items, ops, switch)
        signal: dict[int, torch.Tensor] = {}
        ritz = range_basis(
            ops,
            {i: blocks[i] for i in first},
            ranks,
            group["seed"],
            {i: (items[i].frag.name, "init") for i in first},
            group["oversample"],
            group["power_iters"],
            {i: floors[i] for i in first if i in floors},
            signal,
        )
        # the whole old bases: each rank holds its rows of a split one (ROWS), assembled only at a switch
        u_old = ops.assemble({i: items[i].state["U"] for i in later})
        # the iteration starts from U with its left-out (zero) columns drawn afresh, so the subspace can grow back
        start = {
            i: restart_columns(u_old[i], group["seed"], int(items[i].state["switches"])) for i in later if i in floors
        }
        qt = {i: items[i].state["Q_tilde"] if group["tracking"] else None for i in later}
        x = {i: start.get(i, u_old[i]) for i in later}
        atu = ops.allreduce({i: blocks[i].T @ ops.my_rows(i, x[i]) for i in later})
        h_rows = {
            i: subspace_sketch(blocks[i], atu[i], ops.my_rows(i, u_old[i]), u_old[i], qt[i], b3, start.get(i))
            for i in later
        }
        sketches = ops.assemble(h_rows)
        # one batched SVD per shape; directions that rounding leaves undetermined (below determined_floor: the
        # complement drawn below depends on the whole span) are left out and completed from a seeded draw
        u_tilde: dict[int, torch.Tensor] = {}
        for idx in group_indices(later, lambda i: (tuple(sketches[i].shape), ops.plans[i].a_shape)):
            shape = ops.plans[idx[0]].a_shape
            basis = signal_range(torch.stack([sketches[i] for i in idx]), shape, determined_floor(shape))
            u_tilde.update(zip(idx, basis.unbind(0)))
        atut = ops.allreduce({i: blocks[i].T @ ops.my_rows(i, u_tilde[i]) for i in later})
        by_shapes: dict[tuple, list[int]] = {}  # one batched eigh per shape
        for i in later:
            by_shapes.setdefault((tuple(u_tilde[i].shape), tuple(atut[i].shape)), []).append(i)
        for idx in by_shapes.values():
            stack = [torch.stack([x[i] for i in idx]) for x in (u_tilde, atut, u_old)]
            q = torch.stack([cast(torch.Tensor, qt[i]) for i in idx]) if group["tracking"] else None
            floor = None
            if any(i in floors for i in idx):  # signal_rank: each matrix's precision's floor (0: the fp32 one)
                fp32 = fp32_floor((u_tilde[idx[0]].shape[-2], atut[idx[0]].shape[-2]))
                floor = torch.tensor([[max(fp32, floors.get(i, 0.0))] for i in idx], dtype=torch.float64)
                floor = floor.to(stack[0].device)
            vectors = ritz_vectors(stack[0], stack[1], stack[2], q, b3, floor)
            keep = (vectors.square().sum(-2) > 0).to(torch.float64)  # the noise ones come back as zero columns
            signal.update((i, k.float()) for i, k in zip(idx, keep.unbind(0)) if i in floors)
            rows, r = vectors.shape[-2:]
            draws = torch.stack(
                [fill_draw(rows, r, group["seed"], int(items[i].state["switches"]), vectors.device) for i in idx]
            )
            ritz.update(zip(idx, complete_basis(vectors, keep, draws).unbind(0)))
        new_bases: dict[int, torch.Tensor] = {}  # one complete QR per shape
        for idx in group_indices(switch, lambda i: (tuple(ritz[i].shape), lead[i])):
            rows, r = ritz[idx[0]].shape
            l = lead[idx[0]]
            picks = (
                torch.stack(
                    [
                        seeded_permutation(
                            rows - r, group["seed"], items[i].frag.name, int(items[i].state["switches"])
                        )[: r - l]
                        for i in idx
                    ]
                )
                if l < r
                else None
            )
            # each vector's sign pinned: M and V are not rotated at a switch (the paper's rule), so the sign that
            # rounding gives a Ritz or range-finder vector would flip that row of the step (docs/algorithms/alice.md)
            basis = pin_signs(switched_basis(torch.stack([ritz[i] for i in idx]), l, picks))
            new_bases.update(zip(idx, basis.unbind(0)))
        for i, flags in signal.items():  # signal_rank: the leading columns below the floor left out (zero) until
            flags = flags.clone()  # the next switch; the sampled complement is kept
            flags[lead[i] :] = 1.0
            new_bases[i] = new_bases[i] * flags
        for i in switch:
            st = items[i].state
            new = new_bases[i]
            if group["tracking"] and group["reproject"] and int(st["switches"]) > 0:
                reproject_tracking(st["Q_tilde"], new, u_old[i])
            st["U"].copy_(ops.my_rows(i, new) if ops.split(i) else new)
            st["switches"] += 1


#: on a CPU a matrix with at least this many elements is a stack of its own: its gradient and basis are read as
#: views, not copied into a stack (there a kernel per matrix costs nothing next to its data; on a GPU the copy
#: is cheap and the launches are not: Alice at 60M took 20 ms per step on an H100 computed alone, 6 ms stacked)
SOLO_ELEMENTS = 1 << 16


class _Stack:
    """Matrices of a bucket computed together as one ``(B, rows, cols)`` stack: same oriented shape, block
    shape, rank, strategy and gradient presence (``local``: held whole by this rank, ``MatrixOps.here``, the
    block is the gradient viewed as ``G`` or ``G^T``, both kinds in one stack; else blocks come from
    ``MatrixOps.to_blocks``)."""

    __slots__ = ("idx", "local", "n_plain", "rows", "cols", "r", "has_grad", "distributed", "kept")

    #: a stack of state with at most this many elements keeps its buffer and the views of its rows between
    #: steps: the write-back of small matrices, where making the views costs more than copying, reuses them
    KEEP_ELEMENTS = 1 << 16

    def __init__(
        self, idx: list[int], local: bool, n_plain: int, rows: int, cols: int, r: int, has_grad: bool, distributed: bool
    ):
        self.idx, self.local, self.n_plain = idx, local, n_plain  # local: the first n_plain have A = G, others G^T
        self.rows, self.cols, self.r, self.has_grad, self.distributed = rows, cols, r, has_grad, distributed
        self.kept: dict[str, tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}

    def gather(self, key: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        """``torch.stack(tensors)`` (into the kept buffer of ``key`` when there is one)."""
        kept = self.kept.get(key)
        if kept is not None:
            buf = kept[0]
            t = tensors[0]
            if buf.device == t.device and buf.dtype == t.dtype and buf.shape[1:] == t.shape:
                return torch.stack(tensors, out=buf)
        stacked = torch.stack(tensors)
        if stacked.numel() <= self.KEEP_ELEMENTS:
            self.kept[key] = (stacked, stacked.unbind(0))
        return stacked

    def rows_of(self, key: str, stacked: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``stacked.unbind(0)`` (the kept views when ``stacked`` is the kept buffer of ``key``)."""
        kept = self.kept.get(key)
        return kept[1] if kept is not None and kept[0] is stacked else stacked.unbind(0)


class _BucketPlan:
    """Static facts of one bucket's step: every matrix's rank, which ones this rank computes, which ones
    need ``to_blocks`` (sharded), and the stacks of active matrices."""

    def __init__(self, rank: int, items: list, ops: MatrixOps):
        self.ranks = [effective_rank(rank, plan.a_shape, it.frag.name, "Alice") for it, plan in zip(items, ops.plans)]
        self.active = [i for i in range(len(items)) if ops.active(i)]
        self.remote = [i for i in range(len(items)) if not ops.here[i]]
        self._plans = ops.plans
        groups: dict[tuple, list[int]] = {}
        for i in self.active:
            plan, kind = ops.plans[i], "here" if ops.here[i] else ops.kinds[i]
            a0, a1 = plan.rows()
            big = i if (items[i].grad.is_cpu and plan.a_shape[0] * plan.a_shape[1] >= SOLO_ELEMENTS) else None
            groups.setdefault((plan.a_shape, a1 - a0, self.ranks[i], items[i].has_grad, kind, big), []).append(i)
        self.stacks = []
        for ((rows, cols), _, r, has_grad, kind, _big), idx in groups.items():
            local = kind == "here"
            idx = sorted(idx, key=lambda i: local and ops.plans[i].transpose)  # A = G first, then A = G^T
            n_plain = sum(1 for i in idx if not (local and ops.plans[i].transpose))
            self.stacks.append(_Stack(idx, local, n_plain, rows, cols, r, has_grad, kind in ("distributed", "team")))

    def local_block(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        """``MatrixOps.to_blocks`` of an unsharded matrix: its gradient viewed as ``A``."""
        plan = self._plans[i]
        g = grad.view(plan.layout.shape)
        return g.T if plan.transpose else g


class Alice0(Alice):
    """Alice-0 (``treatment="alice0"``): Alice without the tracking state (b3 = 0), the paper's choice when
    memory matters."""

    Config = Alice0Config
    matrix_treatments = ("alice0",)

    def _step_alice0(self, group: dict) -> None:
        self._step_alice(group)
