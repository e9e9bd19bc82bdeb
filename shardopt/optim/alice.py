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
all of them also take stacked matrices of one shape). ``Alice._alice_bucket`` drives them on ``MatrixOps``:
every product with ``A`` sums over its rows or is row-local, so under the distributed strategy the per-step
traffic is the ``r x cols`` projection, a ``cols`` vector and a scalar; a switch adds ``cols x r`` reductions
and the assembled ``rows x r`` sketch. Randomness is keyed by (seed, name, switch count), so every rank and
every world size draws the same.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Unpack

import pydantic
import torch

from ..sharding.draws import seeded_permutation
from ..sharding.orientation import mm_like
from ..sharding.matrix_ops import MatrixOps, OpCost
from ..sharding.primitives import col_sumsq
from ..sharding.subspace import orthonormal, range_basis
from .base import ShardedOptimizer
from .config import CommonOptions, WholeMatrixConfig, check_betas
from .racs import norm_growth_eta
from .sumo import effective_rank

__all__ = ["Alice", "Alice0", "subspace_sketch", "ritz_vectors", "switched_basis", "reproject_tracking",
           "residual_energy", "update_moments", "compensation_scale", "low_rank_step", "AliceConfig",
           "Alice0Config"]


def subspace_sketch(a_rows: torch.Tensor, at_u: torch.Tensor, u_rows: torch.Tensor, U: torch.Tensor,
                    Q_tilde: torch.Tensor | None, b3: float) -> torch.Tensor:
    """Rows of ``H = Q U = b3 U (Q_tilde (U^T U)) + (1 - b3) A (A^T U)`` for the rows ``a_rows`` of ``A``
    (``u_rows`` the same rows of ``U``; ``at_u = A^T U`` reduced over all rows)."""
    h = (1 - b3) * (a_rows @ at_u)
    if Q_tilde is not None and b3:
        h = h + b3 * (u_rows @ (Q_tilde @ (U.mT @ U)))
    return h


def ritz_vectors(u_tilde: torch.Tensor, at_ut: torch.Tensor, U: torch.Tensor, Q_tilde: torch.Tensor | None,
                 b3: float) -> torch.Tensor:
    """Rayleigh-Ritz: the eigenvectors of ``Ut^T Q Ut = (1 - b3) (A^T Ut)^T (A^T Ut) + b3 C Q_tilde C^T`` (``C =
    Ut^T U``) mapped back by ``Ut``, by descending Ritz value (float64 eigh, fp32 result)."""
    vr = (1 - b3) * (at_ut.mT @ at_ut).double()
    if Q_tilde is not None and b3:
        c = (u_tilde.mT @ U).double()
        vr = vr + b3 * (c @ Q_tilde.double() @ c.mT)
    lam, vec = torch.linalg.eigh(0.5 * (vr + vr.mT))
    return (u_tilde.double() @ vec.flip(-1)).float()


def switched_basis(u1: torch.Tensor, lead: int, pick: torch.Tensor | None) -> torch.Tensor:
    """Alg. 2: keep the leading ``lead`` columns of ``u1`` and append the columns ``pick`` of the orthogonal
    complement of all of ``u1`` (complete QR); ``pick=None`` keeps ``u1``."""
    if pick is None:
        return u1
    r = u1.shape[1]
    complement = torch.linalg.qr(u1.double(), mode="complete").Q[:, r:].float()
    return torch.cat([u1[:, :lead], complement[:, pick.to(complement.device)]], dim=1)


def reproject_tracking(Q_tilde: torch.Tensor, U_new: torch.Tensor, U: torch.Tensor) -> None:
    """``Q_tilde <- (U_new^T U) Q_tilde (U^T U_new)`` in place: the tracked statistic in the new basis."""
    c = U_new.mT @ U
    Q_tilde.copy_(c @ Q_tilde @ c.mT)


def residual_energy(a_energy: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """``colsum(R * R)`` of ``R = A - U sigma`` from ``colsum(A * A)`` and ``sigma = U^T A``: with orthonormal
    ``U``, ``|R e_j|^2 = |a_j|^2 - |sigma_j|^2`` (clamped at 0 against rounding)."""
    return (a_energy - col_sumsq(sigma)).clamp_(min=0)


def update_moments(M: torch.Tensor, V: torch.Tensor, p: torch.Tensor, Q_tilde: torch.Tensor | None,
                   sigma: torch.Tensor, energy: torch.Tensor, betas: tuple[float, float, float]) -> None:
    """In place: ``Q_tilde = b3 Q_tilde + (1 - b3) sigma sigma^T`` (when tracked), ``M = b1 M + (1 - b1) sigma``,
    ``V = b2 V + (1 - b2) sigma * sigma``, ``p = b1 p + (1 - b1) energy`` (the paper decays p with b1)."""
    b1, b2, b3 = betas
    if Q_tilde is not None:
        Q_tilde.addmm_(sigma, sigma.T, beta=b3, alpha=1 - b3)
    M.lerp_(sigma, 1 - b1)
    V.mul_(b2).addcmul_(sigma, sigma, value=1 - b2)
    p.lerp_(energy, 1 - b1)


def compensation_scale(p: torch.Tensor, energy: torch.Tensor, rows: int, r: int,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``C = R diag(c)`` with ``c_j = sqrt(rows - r) / sqrt(p_j + eps)`` (0 where ``p_j = 0``; ``c = 0`` when
    ``r = rows``), and ``|C|`` from the residual column energies, so ``C`` is never formed."""
    if r < rows:
        c = torch.where(p > 0, (p + eps).rsqrt(), torch.zeros_like(p)) * math.sqrt(rows - r)
    else:
        c = torch.zeros_like(p)
    return c, (c * c * energy).sum().sqrt()


def low_rank_step(a_rows: torch.Tensor, u_rows: torch.Tensor, sigma: torch.Tensor, M: torch.Tensor,
                  V: torch.Tensor, col: torch.Tensor, alpha: float, eps: float) -> torch.Tensor:
    """Rows of ``alpha U w + A diag(col) - U (sigma diag(col))`` with ``w = M / (sqrt(V) + eps)``: with
    ``col = alpha alpha_c eta c`` this is ``alpha (U w + alpha_c eta C)``, one product with ``A``."""
    low = torch.addcdiv(sigma * col.neg(), M, V.sqrt().add_(eps), value=alpha)
    return mm_like(a_rows, u_rows, low).addcmul_(a_rows, col)


class AliceConfig(WholeMatrixConfig):
    """docs/algorithms/alice.md, the paper's Tables 7-11 (60M-350M): lr 0.02, alpha 0.3, alpha_c 0.4, betas (0.9, 0.9, 0.999),
    K 200, r 128, l 40, gamma 1.01. The main results train the LM head with the low-rank rule too."""

    treatment = "alice"

    lr: float = pydantic.Field(0.02, ge=0)
    alpha: float = pydantic.Field(0.3, ge=0, description="scale of the low-rank update")
    alpha_c: float = pydantic.Field(0.4, ge=0, description="scale of the compensation outside the subspace")
    betas: tuple[float, float, float] = pydantic.Field(
        (0.9, 0.9, 0.999), description="b1 momentum, b2 second moment, b3 tracking (0 when tracking is off)")
    rank: int = pydantic.Field(128, ge=1, description="r: subspace rank (clamped to min(m, n) with a warning)")
    leading: int = pydantic.Field(40, ge=0, validate_default=True,  # checked against rank when defaulted too
                                  description="l <= r: leading directions kept at a switch")
    refresh_interval: int = pydantic.Field(200, ge=1, description="K: steps between subspace switches")
    gamma: float = pydantic.Field(1.01, ge=1, description="norm-growth limiter")
    eps: float = pydantic.Field(1e-8, ge=0)
    reproject: bool = pydantic.Field(True, description="rotate the tracking state into the new basis at a switch")
    seed: int = pydantic.Field(0, description="seed of the range finder's draws")
    oversample: int = pydantic.Field(10, ge=0, description="randomized range finder oversampling")
    power_iters: int = pydantic.Field(2, ge=0, le=20, description="randomized range finder power iterations")
    tracking: bool = pydantic.Field(True, description="keep the tracking state (False: Alice-0)")

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
    state_kinds = {**ShardedOptimizer.state_kinds, "U": "matrix", "Q_tilde": "matrix", "M": "matrix",
                   "V": "matrix", "p": "matrix", "phi": "matrix", "switches": "matrix"}
    state_key_renames = {"basis": "U", "tracking": "Q_tilde", "exp_avg_low": "M", "exp_avg_sq_low": "V",
                         "col_energy": "p"}

    def __init__(self, params: Iterable[Any], lr: float = _D.lr, alpha: float = _D.alpha, alpha_c: float = _D.alpha_c,
                 betas: tuple[float, float, float] = _D.betas, rank: int = _D.rank, leading: int = _D.leading,
                 refresh_interval: int = _D.refresh_interval, gamma: float = _D.gamma, eps: float = _D.eps,
                 reproject: bool = _D.reproject, seed: int = _D.seed, oversample: int = _D.oversample,
                 power_iters: int = _D.power_iters, weight_decay: float = _D.weight_decay,
                 **options: Unpack[CommonOptions]):
        """``tracking`` (an option; default: the class's, Alice True, Alice0 False) keeps the tracking state."""
        self._init_from_config(params, self.Config.from_arguments(type(self).__name__, dict(
            lr=lr, alpha=alpha, alpha_c=alpha_c, betas=betas, rank=rank, leading=leading,
            refresh_interval=refresh_interval, gamma=gamma, eps=eps, reproject=reproject, seed=seed,
            oversample=oversample, power_iters=power_iters, weight_decay=weight_decay), options))

    whole_matrix_work = True

    def whole_matrix_transpose(self, group: dict, shape: tuple[int, int]) -> bool:
        m, n = shape
        return m > n

    def whole_matrix_cost(self, group: dict, a_shape: tuple[int, int]) -> OpCost:
        rows, cols = a_shape
        r = min(group["rank"], rows, cols)
        return OpCost(row_flops=8.0 * rows * cols * r, small_flops=4.0 * cols * r * r,
                      reduced=r * cols + cols + 1,
                      state=rows * r + 2 * r * cols + cols + (r * r if group["tracking"] else 0))

    def matrix_state_spec(self, group: dict, a_shape: tuple[int, int]) -> dict:
        rows, cols = a_shape
        r = min(group["rank"], rows, cols)
        spec = {"U": ((rows, r), 0), "M": ((r, cols), 1), "V": ((r, cols), 1),
                "p": ((cols,), 0), "phi": ((), None), "switches": ((), None)}
        if group["tracking"]:
            spec["Q_tilde"] = ((r, r), 1)
        return spec

    def _step_alice(self, group: dict) -> None:
        steps = {id(p): self._step_count(p) for p in group["params"]}
        items = self._matrix_items(group)
        self._run_whole_matrix(group, items, lambda its, ops: self._alice_bucket(group, its, ops, steps))

    def _alice_bucket(self, group: dict, items: list, ops: MatrixOps, steps: dict) -> None:
        rank = group["rank"]
        blocks = [b[0] for b in ops.to_blocks([[it.grad] for it in items])]
        ranks, lead = {}, {}
        for i, it in enumerate(items):
            rows, cols = ops.plans[i].a_shape
            r = ranks[i] = effective_rank(rank, (rows, cols), it.frag.name, "Alice")
            # the complement must hold the r - l sampled columns; at r = rows there is none (C = 0)
            lead[i] = r if r == rows else max(min(group["leading"], r), 2 * r - rows)
            st = it.state
            if "U" not in st:
                st["U"] = it.grad.new_zeros(rows, r)
                if group["tracking"]:
                    st["Q_tilde"] = it.grad.new_zeros(r, r)
                st["M"] = it.grad.new_zeros(r, cols)
                st["V"] = it.grad.new_zeros(r, cols)
                st["p"] = it.grad.new_zeros(cols)
                st["phi"] = it.grad.new_zeros(())
                st["switches"] = it.grad.new_zeros(())
        active = [i for i in range(len(items)) if ops.active(i)]
        t_of = {i: steps[id(items[i].tensor)] for i in active}
        switch = [i for i in active if t_of[i] == 1 or t_of[i] % group["refresh_interval"] == 0]
        self._switch(ops, items, blocks, switch, ranks, lead, group)

        # sigma = U^T A and colsum(A * A) in one reduction; R = A - U sigma is never formed (residual_energy)
        sigma, energy = {}, {}
        parts = ops.allreduce({i: torch.cat([(ops.my_rows(i, items[i].state["U"]).T @ blocks[i]).reshape(-1),
                                             col_sumsq(blocks[i])]) for i in active})
        for i in active:
            r, cols = ranks[i], blocks[i].shape[1]
            sigma[i] = parts[i][: r * cols].view(r, cols)
            energy[i] = residual_energy(parts[i][r * cols:], sigma[i])
        updates = {}
        for i in active:
            it, st = items[i], items[i].state
            rows = ops.plans[i].a_shape[0]
            if it.has_grad:
                update_moments(st["M"], st["V"], st["p"], st.get("Q_tilde") if group["tracking"] else None,
                               sigma[i], energy[i], group["betas"])
            c, norm = compensation_scale(st["p"], energy[i], rows, ranks[i], group["eps"])
            eta = norm_growth_eta(norm, st["phi"], group["gamma"])
            if it.has_grad:
                st["phi"].copy_(eta * norm)
            col = c * (group["alpha"] * group["alpha_c"] * eta)
            updates[i] = low_rank_step(blocks[i], ops.my_rows(i, st["U"]), sigma[i], st["M"], st["V"], col,
                                       group["alpha"], group["eps"])
        pieces = ops.from_blocks([updates.get(i) for i in range(len(items))])
        ops.account()
        for it, piece in zip(items, pieces):
            it.apply(piece, group["lr"], group["weight_decay"])

    def _switch(self, ops: MatrixOps, items: list, blocks: list, switch: list[int], ranks: dict, lead: dict,
                group: dict) -> None:
        """New bases for the matrices in ``switch`` (Alg. 2 on the Rayleigh-Ritz subspace step of Alg. 10)."""
        b3 = group["betas"][2]
        first = [i for i in switch if int(items[i].state["switches"]) == 0]
        later = [i for i in switch if i not in first]
        ritz = range_basis(ops, {i: blocks[i] for i in first}, ranks, group["seed"],
                           {i: (items[i].frag.name, "init") for i in first}, group["oversample"],
                           group["power_iters"])
        u_old = {i: items[i].state["U"] for i in later}
        qt = {i: items[i].state["Q_tilde"] if group["tracking"] else None for i in later}
        atu = ops.allreduce({i: blocks[i].T @ ops.my_rows(i, u_old[i]) for i in later})
        h_rows = {i: subspace_sketch(blocks[i], atu[i], ops.my_rows(i, u_old[i]), u_old[i], qt[i], b3)
                  for i in later}
        u_tilde = {i: orthonormal(h) for i, h in ops.assemble(h_rows).items()}
        atut = ops.allreduce({i: blocks[i].T @ ops.my_rows(i, u_tilde[i]) for i in later})
        for i in later:
            ritz[i] = ritz_vectors(u_tilde[i], atut[i], u_old[i], qt[i], b3)
        for i in switch:
            st = items[i].state
            r, l = ranks[i], lead[i]
            rows = ritz[i].shape[0]
            pick = seeded_permutation(rows - r, group["seed"], items[i].frag.name, int(st["switches"]))[: r - l] \
                if l < r else None
            new = switched_basis(ritz[i], l, pick)
            if group["tracking"] and group["reproject"] and int(st["switches"]) > 0:
                reproject_tracking(st["Q_tilde"], new, st["U"])
            st["U"].copy_(new)
            st["switches"] += 1


class Alice0(Alice):
    """Alice-0 (``treatment="alice0"``): Alice without the tracking state (b3 = 0), the paper's choice when
    memory matters."""

    Config = Alice0Config
    matrix_treatments = ("alice0",)

    def _step_alice0(self, group: dict) -> None:
        self._step_alice(group)
