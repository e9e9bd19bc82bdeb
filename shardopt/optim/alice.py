"""Alice and Alice-0: low-rank Adam in a tracked, switched subspace plus compensation (arXiv:2502.07752
Alg. 2-4 and 10; specs/racs_alice.md sections 1.3 and 6).

Per matrix, on ``A = G`` when ``m <= n`` (rows projected) or ``A = G^T`` otherwise (``U`` is ``rows x r``)::

    at steps 1, K, 2K, ...:  switch the basis
        step 1: U' = top-r basis of A (seeded randomized range finder; the paper's U_0 = 0 is degenerate)
        later:  H = b3 U (Qt (U^T U)) + (1 - b3) A (A^T U);  U~ = qr(H);  Ritz vectors of
                U~^T Q U~ (Q = b3 U Qt U^T + (1 - b3) A A^T, never formed), sorted by Ritz value
        U = [top-l of U', r - l columns drawn (seeded) from the complete-QR complement of U']
        Qt re-projected into the new basis (reproject=True; False keeps the paper's literal mixing)
    s = U^T A;  Qt = b3 Qt + (1 - b3) s s^T   (Alice only; Alice-0 has b3 = 0 and no Qt)
    M = b1 M + (1 - b1) s;  V = b2 V + (1 - b2) s*s;  w = M / (sqrt(V) + eps)
    R = A - U s;  p = b1 p + (1 - b1) colsum(R*R)  (from colsum(A*A) and s: R is never formed);  C = sqrt(rows - r) R / sqrt(p)  (limited by gamma)
    W = W (1 - lr wd) - lr alpha (U w + alpha_c C)

Written on ``MatrixOps``: every product with ``A`` sums over its rows or is row-local, so under the
distributed strategy the per-step traffic is the ``r x cols`` projection, a ``cols`` vector and a scalar;
a switch adds ``cols x r`` reductions and the assembled ``rows x r`` sketch. ``U``, ``Qt``, ``M``, ``V``,
``p`` are small per-matrix state; randomness is keyed by (seed, name, switch count), so every rank and
every world size draws the same.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Unpack

import pydantic
import torch

from ..sharding.linalg import mm_like, seeded_permutation
from ..sharding.matrix_ops import MatrixOps, OpCost
from ..sharding.primitives import col_sumsq
from ..sharding.subspace import orthonormal, range_basis
from .base import ShardedOptimizer
from .config import CommonOptions, WholeMatrixConfig, check_betas
from .sumo import effective_rank

__all__ = ["Alice", "Alice0", "AliceConfig", "Alice0Config"]


class AliceConfig(WholeMatrixConfig):
    """specs/racs_alice.md Table 7-11 (60M-350M): lr 0.02, alpha 0.3, alpha_c 0.4, betas (0.9, 0.9, 0.999),
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
    (1.01), ``eps`` (1e-8), ``reproject`` (True), ``seed`` (0), ``weight_decay`` (0). ``Alice0`` is the same
    with ``tracking=False`` (b3 = 0, no ``tracking`` state)."""

    Config = AliceConfig
    matrix_treatments = ("alice",)
    state_kinds = {**ShardedOptimizer.state_kinds, "basis": "matrix", "tracking": "matrix", "exp_avg_low": "matrix",
                   "exp_avg_sq_low": "matrix", "col_energy": "matrix", "phi": "matrix", "switches": "matrix"}

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
        spec = {"basis": ((rows, r), 0), "exp_avg_low": ((r, cols), 1), "exp_avg_sq_low": ((r, cols), 1),
                "col_energy": ((cols,), 0), "phi": ((), None), "switches": ((), None)}
        if group["tracking"]:
            spec["tracking"] = ((r, r), 1)
        return spec

    def _step_alice(self, group: dict) -> None:
        steps = {id(p): self._step_count(p) for p in group["params"]}
        items = self._matrix_items(group)
        self._run_whole_matrix(group, items, lambda its, ops: self._alice_bucket(group, its, ops, steps))

    def _alice_bucket(self, group: dict, items: list, ops: MatrixOps, steps: dict) -> None:
        rank = group["rank"]
        blocks = [b[0] for b in ops.to_blocks([[it.grad] for it in items])]
        b1, b2, b3 = group["betas"]
        ranks, lead = {}, {}
        for i, it in enumerate(items):
            rows, cols = ops.plans[i].a_shape
            r = ranks[i] = effective_rank(rank, (rows, cols), it.frag.name, "Alice")
            # the complement must hold the r - l sampled columns; at r = rows there is none (C = 0)
            lead[i] = r if r == rows else max(min(group["leading"], r), 2 * r - rows)
            st = it.state
            if "basis" not in st:
                st["basis"] = it.grad.new_zeros(rows, r)
                if group["tracking"]:
                    st["tracking"] = it.grad.new_zeros(r, r)
                st["exp_avg_low"] = it.grad.new_zeros(r, cols)
                st["exp_avg_sq_low"] = it.grad.new_zeros(r, cols)
                st["col_energy"] = it.grad.new_zeros(cols)
                st["phi"] = it.grad.new_zeros(())
                st["switches"] = it.grad.new_zeros(())
        active = [i for i in range(len(items)) if ops.active(i)]
        t_of = {i: steps[id(items[i].tensor)] for i in active}
        switch = [i for i in active if t_of[i] == 1 or t_of[i] % group["refresh_interval"] == 0]
        self._switch(ops, items, blocks, switch, ranks, lead, group)

        # s = U^T A and the column energies of A in one reduction; R = A - U s is never formed. U has orthonormal
        # columns (QR / Ritz vectors), so |R e_j|^2 = |a_j|^2 - |s_j|^2 (the U^T U - I term is float32 rounding),
        # and U w + a_c C = U (w - a_c s diag(c)) + a_c A diag(c): one product with A instead of two
        sigma, energy = {}, {}
        parts = ops.allreduce({i: torch.cat([(ops.my_rows(i, items[i].state["basis"]).T @ blocks[i]).reshape(-1),
                                             col_sumsq(blocks[i])]) for i in active})
        for i in active:
            r, cols = ranks[i], blocks[i].shape[1]
            sigma[i] = parts[i][: r * cols].view(r, cols)
            energy[i] = (parts[i][r * cols:] - col_sumsq(sigma[i])).clamp_(min=0)
        updates = {}
        for i in active:
            it, st = items[i], items[i].state
            rows = ops.plans[i].a_shape[0]
            if it.has_grad:
                if group["tracking"]:
                    st["tracking"].addmm_(sigma[i], sigma[i].T, beta=b3, alpha=1 - b3)
                st["exp_avg_low"].lerp_(sigma[i], 1 - b1)
                st["exp_avg_sq_low"].mul_(b2).addcmul_(sigma[i], sigma[i], value=1 - b2)
                st["col_energy"].lerp_(energy[i], 1 - b1)
            # C = R diag(c) with c_j = sqrt(rows - r) / sqrt(p_j); |C|_F^2 = sum_j c_j^2 |R e_j|^2 comes from the
            # reduced column energies, so C is never formed and needs no reduction of its own
            p = st["col_energy"]
            if ranks[i] < rows:
                c = torch.where(p > 0, (p + group["eps"]).rsqrt(), torch.zeros_like(p)) * math.sqrt(rows - ranks[i])
            else:
                c = torch.zeros_like(p)
            norm = (c * c * energy[i]).sum().sqrt()
            phi = st["phi"]
            eta = group["gamma"] / torch.clamp(norm / phi, min=group["gamma"]) if phi > 0 else torch.ones_like(phi)
            if it.has_grad:
                st["phi"].copy_(eta * norm)
            col = c * (group["alpha"] * group["alpha_c"] * eta)
            # alpha w - s diag(col), w = M / (sqrt(V) + eps): three passes over the r x cols state
            low = torch.addcdiv(sigma[i] * col.neg(), st["exp_avg_low"], st["exp_avg_sq_low"].sqrt().add_(group["eps"]),
                                value=group["alpha"])
            updates[i] = mm_like(blocks[i], ops.my_rows(i, st["basis"]), low).addcmul_(blocks[i], col)
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
        u_old = {i: items[i].state["basis"] for i in later}
        qt = {i: items[i].state["tracking"] if group["tracking"] else None for i in later}
        atu = ops.allreduce({i: blocks[i].T @ ops.my_rows(i, u_old[i]) for i in later})
        h_rows = {}
        for i in later:
            h = (1 - b3) * (blocks[i] @ atu[i])
            if qt[i] is not None and b3:
                h = h + b3 * (ops.my_rows(i, u_old[i]) @ (qt[i] @ (u_old[i].T @ u_old[i])))
            h_rows[i] = h
        u_tilde = {i: orthonormal(h) for i, h in ops.assemble(h_rows).items()}
        atut = ops.allreduce({i: blocks[i].T @ ops.my_rows(i, u_tilde[i]) for i in later})
        for i in later:
            vr = (1 - b3) * (atut[i].T @ atut[i]).double()
            if qt[i] is not None and b3:
                c = (u_tilde[i].T @ u_old[i]).double()
                vr = vr + b3 * (c @ qt[i].double() @ c.T)
            lam, vec = torch.linalg.eigh(0.5 * (vr + vr.T))
            ritz[i] = (u_tilde[i].double() @ vec.flip(1)).float()  # descending Ritz values
        for i in switch:
            st = items[i].state
            r, l = ranks[i], lead[i]
            u1 = ritz[i]
            rows = u1.shape[0]
            if l < r:
                complement = torch.linalg.qr(u1.double(), mode="complete").Q[:, r:].float()
                pick = seeded_permutation(rows - r, group["seed"], items[i].frag.name, int(st["switches"]))[: r - l]
                new = torch.cat([u1[:, :l], complement[:, pick.to(complement.device)]], dim=1)
            else:
                new = u1
            if group["tracking"] and group["reproject"] and int(st["switches"]) > 0:
                c = new.T @ st["basis"]
                st["tracking"].copy_(c @ st["tracking"] @ c.T)
            st["basis"].copy_(new)
            st["switches"] += 1


class Alice0(Alice):
    """Alice-0 (``treatment="alice0"``): Alice without the tracking state (b3 = 0), the paper's choice when
    memory matters."""

    Config = Alice0Config
    matrix_treatments = ("alice0",)

    def _step_alice0(self, group: dict) -> None:
        self._step_alice(group)
