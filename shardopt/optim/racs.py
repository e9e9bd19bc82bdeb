"""RACS: row and column scaled SGD (arXiv:2502.07752, Alg. 1; specs/racs_alice.md section 1.1).

Per matrix ``G`` with ``P = G * G``::

    q = 1
    repeat 5:  s_hat = P^T q / |q|^2;   q = P s_hat / |s_hat|^2      (fresh start every step)
    s = beta s + (1 - beta) s_hat;  q_ema = beta q_ema + (1 - beta) q     (no bias correction)
    Gt = G / sqrt(q_ema_i s_j)                                            (zero lines -> 0, never NaN)
    eta = 1 if phi == 0 else gamma / max(|Gt| / phi, gamma);  phi = eta |Gt|
    W = W - lr * eta * alpha * Gt

Sharded: each half-iteration is one bucketed all-reduce of the split indices plus, where the other axis is
not replicated, the owner-counted squared norm of the previous vector; the limiter norm is global.
"""
from __future__ import annotations

from typing import Any, Iterable, Unpack

import pydantic
import torch

from ..sharding import Round, axis_sum, col_sums, local_sum, masked_reciprocal, masked_rsqrt, row_sums, scale_into
from .base import ShardedOptimizer
from .config import CommonOptions, OptimizerConfig

__all__ = ["RACS", "RACSConfig"]


class RACSConfig(OptimizerConfig):
    """specs/racs_alice.md: lambda 0.02, beta 0.9, alpha 0.05, gamma 1.01, 5 fixed-point steps."""

    treatment = "racs"

    lr: float = pydantic.Field(0.02, ge=0, description="lambda (AdamW's lr too unless adam_lr)")
    beta: float = pydantic.Field(0.9, ge=0, lt=1, description="EMA beta of the row and column scales")
    alpha: float = pydantic.Field(0.05, ge=0, description="step scale")
    gamma: float = pydantic.Field(1.01, ge=1, description="norm-growth limiter")
    iterations: int = pydantic.Field(5, ge=1, description="fixed-point steps for the scales")


_D = RACSConfig.defaults()


class RACS(ShardedOptimizer):
    """RACS optimizer. Matrix groups use ``treatment="racs"`` with keys ``lr`` (lambda, 0.02), ``beta`` (0.9),
    ``alpha`` (0.05), ``gamma`` (norm-growth limiter, 1.01), ``iterations`` (5), ``weight_decay`` (0).
    State per matrix: ``row_scale`` (q, m), ``col_scale`` (s, n), ``phi``. Other params use AdamW at the
    group's base lr unless ``adam_lr`` is given (card section 6 item 11).
    """

    Config = RACSConfig
    matrix_treatments = ("racs",)
    state_kinds = {**ShardedOptimizer.state_kinds, "row_scale": "rows", "col_scale": "cols", "phi": "scalar",
                   "step": "tensor"}

    def __init__(self, params: Iterable[Any], lr: float = _D.lr, beta: float = _D.beta, alpha: float = _D.alpha,
                 gamma: float = _D.gamma, iterations: int = _D.iterations, weight_decay: float = _D.weight_decay,
                 **options: Unpack[CommonOptions]):
        self._init_from_config(params, self.Config.from_arguments(type(self).__name__, dict(
            lr=lr, beta=beta, alpha=alpha, gamma=gamma, iterations=iterations, weight_decay=weight_decay), options))

    def vector_state(self, group: dict, shape: tuple[int, int]) -> int:
        return shape[0] + shape[1] + 1 if group.get("treatment", "adamw") != "adamw" else 0

    def _step_racs(self, group: dict) -> None:
        items = self._matrix_items(group)
        rnd = Round()
        for it in items:
            m, n = it.layout.shape
            it.work["P"] = it.grad * it.grad
            it.work["q"] = it.grad.new_ones(m)
            it.work["q_norm2"] = it.grad.new_tensor(float(m))
        for i in range(group["iterations"]):
            for it in items:
                it.work["s"] = col_sums(it.layout, it.work["P"], it.work["q"])
                rnd.add_axis(it.layout, it.work["s"], 1)
                if i > 0:
                    it.work["q_norm2"] = axis_sum(it.layout, it.work["q"] * it.work["q"], 0, rnd)
            rnd.run()
            for it in items:
                it.work["s"] *= masked_reciprocal(it.work["q_norm2"])
                it.work["q"] = row_sums(it.layout, it.work["P"], it.work["s"])
                rnd.add_axis(it.layout, it.work["q"], 0)
                it.work["s_norm2"] = axis_sum(it.layout, it.work["s"] * it.work["s"], 1, rnd)
            rnd.run()
            for it in items:
                it.work["q"] *= masked_reciprocal(it.work["s_norm2"])
        beta = group["beta"]
        for it in items:
            m, n = it.layout.shape
            st = it.state
            if "row_scale" not in st:
                st["row_scale"] = it.grad.new_zeros(m)
                st["col_scale"] = it.grad.new_zeros(n)
                st["phi"] = it.grad.new_zeros(())
            if it.has_grad:
                st["row_scale"].mul_(beta).add_(it.work["q"], alpha=1 - beta)
                st["col_scale"].mul_(beta).add_(it.work["s"], alpha=1 - beta)
            r_inv, c_inv = masked_rsqrt(st["row_scale"]), masked_rsqrt(st["col_scale"])
            # |Gt|^2 = sum_ij P_ij / (q_i s_j): a weighted row sum of P, no squared copy of Gt
            it.work["norm2"] = local_sum(row_sums(it.layout, it.work["P"], c_inv * c_inv) * (r_inv * r_inv))
            it.work["gt"] = scale_into(it.layout, it.work["P"], it.grad, r_inv, c_inv)
            rnd.add_sum(it.layout, it.work["norm2"])
        rnd.run()
        gamma = group["gamma"]
        for it in items:
            st = it.state
            norm = it.work["norm2"].sqrt()
            phi = st["phi"]
            ratio = norm / torch.where(phi > 0, phi, torch.ones_like(phi))
            eta = torch.where(phi > 0, gamma / torch.clamp(ratio, min=gamma), torch.ones_like(phi))
            if it.has_grad:
                st["phi"] = eta * norm
            it.apply(it.work["gt"], group["lr"] * group["alpha"] * eta, group["weight_decay"])
