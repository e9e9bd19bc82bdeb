"""RACS: row and column scaled SGD (arXiv:2502.07752, Alg. 1; docs/algorithms/racs.md).

Per matrix ``G`` (m x n) with ``P = G * G``; ``q`` (m) and ``s`` (n) are the state, ``q_hat`` and ``s_hat`` this
step's fresh estimates::

    q_hat = 1
    repeat 5:  s_hat = P^T q_hat / |q_hat|^2;   q_hat = P s_hat / |s_hat|^2      (``rescale``)
    q = beta q + (1 - beta) q_hat;   s = beta s + (1 - beta) s_hat                 (``ema_scales``)
    Gt = G / sqrt(q_i s_j)                                        (zero lines -> 0, never NaN; ``inverse_sqrt_scales``)
    eta = 1 if phi == 0 else gamma / max(|Gt| / phi, gamma);  phi = eta |Gt|        (``norm_growth_eta``)
    W = W - lr * eta * alpha * Gt

The functions named above are the math, on plain tensors: completed vectors and scalars (a vector may be a
row of stacked vectors of several matrices). ``RACS._step_racs`` drives them: the weighted sums ``P^T q_hat``
and ``P s_hat`` are partial sums over each rank's piece (``col_sums``/``row_sums``), and each half-iteration
completes them for all RACS matrices with one bucketed all-reduce of the split indices, plus, where the other
axis is split too, the owner-counted squared norm of the previous vector; the limiter norm is global.
A weight stored in x out (``matrix_transposed``) is scaled as its logical out x in matrix: ``q`` is per output unit
(a stored column), ``s`` per input unit (``optim.transposed``).
"""

from __future__ import annotations

import functools
from typing import Any, Iterable

import pydantic
import torch
from typing_extensions import Unpack

from ..sharding import Round, masked_reciprocal, masked_rsqrt
from ..sharding.row_passes import row_block_pass, rows_complete
from .base import ShardedOptimizer
from .config import CommonOptions, OptimizerConfig
from .grouped import grouped_step
from .nonfinite import gated
from .transposed import item_lines, line_items, line_sums, logical_axes

__all__ = ["RACS", "rescale", "ema_scales", "inverse_sqrt_scales", "norm_growth_eta", "RACSConfig"]


def rescale(weighted_sum: torch.Tensor, norm2: torch.Tensor) -> torch.Tensor:
    """One half-step of the fixed point, in place: ``s_hat = (P^T q_hat) / |q_hat|^2`` (or ``q_hat = (P s_hat) /
    |s_hat|^2``) from the completed weighted sum and squared norm; a zero norm gives zeros."""
    weighted_sum *= masked_reciprocal(norm2)
    return weighted_sum


def ema_scales(q: torch.Tensor, s: torch.Tensor, q_hat: torch.Tensor, s_hat: torch.Tensor, beta: float) -> None:
    """``q = beta q + (1 - beta) q_hat``, ``s = beta s + (1 - beta) s_hat`` in place (no bias correction)."""
    q.mul_(beta).add_(q_hat, alpha=1 - beta)
    s.mul_(beta).add_(s_hat, alpha=1 - beta)


def inverse_sqrt_scales(q: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q^-1/2, s^-1/2)``, zero where the scale is zero: ``Gt = diag(q^-1/2) G diag(s^-1/2)``."""
    return masked_rsqrt(q), masked_rsqrt(s)


def norm_growth_eta(norm: torch.Tensor, phi: torch.Tensor, gamma: float) -> torch.Tensor:
    """The limiter's factor ``eta = gamma / max(norm / phi, gamma)``, 1 while ``phi == 0`` (the first step);
    the caller stores ``phi = eta norm``. Element-wise, so ``norm`` and ``phi`` may hold many matrices."""
    ratio = norm / torch.where(phi > 0, phi, torch.ones_like(phi))
    return torch.where(phi > 0, gamma / torch.clamp(ratio, min=gamma), torch.ones_like(phi))


def _limit_norm_growth(states: list, with_grad: list, norm2: torch.Tensor, gate: Any, gamma: float) -> torch.Tensor:
    """Each matrix's norm-growth factor eta from its update norm squared, with phi (the last limited norm) kept
    in the states of the matrices that had a gradient; a skipped step (``gate``) keeps phi and moves nothing."""
    phi = torch.stack([st["phi"] for st in states])
    norm = norm2.sqrt()
    eta = norm_growth_eta(norm, phi, gamma)
    new_phi = eta * norm
    if gate is not None:
        new_phi, eta = gated(gate, new_phi, phi), gated(gate, eta, 0.0)
    if with_grad:
        phis = new_phi.unbind(0)
        torch._foreach_copy_([states[k]["phi"] for k in with_grad], [phis[k] for k in with_grad])
    return eta


def _times_lines(factor: torch.Tensor, sums: torch.Tensor, lines: Any) -> torch.Tensor:
    """``sums * factor[lines]``: a row block's half-step of ``rescale`` (``factor``: per row, 1 / its norm)."""
    return sums * factor[lines]


class RACSConfig(OptimizerConfig):
    """docs/algorithms/racs.md: lambda 0.02, beta 0.9, alpha 0.05, gamma 1.01, 5 fixed-point steps."""

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
    State per matrix: ``q`` (row scale, m), ``s`` (column scale, n), ``phi`` (limiter norm). Other params use
    AdamW at the group's base lr unless ``adam_lr`` is given (docs/algorithms/racs.md).
    """

    Config = RACSConfig
    matrix_treatments = ("racs",)
    state_kinds = {**ShardedOptimizer.state_kinds, "q": "rows", "s": "cols", "phi": "scalar", "step": "tensor"}
    state_key_renames = {"row_scale": "q", "col_scale": "s"}

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = _D.lr,
        beta: float = _D.beta,
        alpha: float = _D.alpha,
        gamma: float = _D.gamma,
        iterations: int = _D.iterations,
        weight_decay: float = _D.weight_decay,
        **options: Unpack[CommonOptions],
    ):
        self._init_from_config(
            params,
            self.Config.from_arguments(
                type(self).__name__,
                dict(lr=lr, beta=beta, alpha=alpha, gamma=gamma, iterations=iterations, weight_decay=weight_decay),
                options,
            ),
        )

    def vector_state(self, group: dict, shape: tuple[int, int]) -> int:
        return shape[0] + shape[1] + 1 if group.get("treatment", "adamw") != "adamw" else 0

    def skips_on_device(self, group: dict) -> bool:
        """RACS gates every write (``_step_racs``): on gradients whose non-finite elements read as 0, a skipped
        step's fresh scales are 0 and their EMA decays by 1, ``phi`` keeps its value and ``eta`` (the step's
        lr factor, weight decay included) is 0."""
        return group.get("treatment") == "racs" or super().skips_on_device(group)

    def _step_racs(self, group: dict) -> None:
        gate = self._step_gate  # None, or 0-d 1./0.: the step's skip decided on the device (nonfinite.gate_step)
        step = grouped_step(self, group)
        blocks = step.blocks
        if not blocks.n_items:
            return
        if gate is not None:
            step.sanitize()
        grads = step.grads
        rows, cols = logical_axes(group)  # the stored axes of the logical rows and columns (swapped in x out)
        if rows == 0 and rows_complete(blocks):
            self._racs_row_blocks(group, step)
            return
        p2 = blocks.square(grads)  # P = G * G, per block shape
        rnd = Round()
        # every matrix's q_hat and s_hat concatenated (logical rows, logical columns); norms one per matrix
        q_hat = torch.ones(blocks.n_rows if rows == 0 else blocks.n_cols, device=blocks.device)
        q_norm2 = item_lines(blocks, rows)  # |1|^2 = m
        for i in range(group["iterations"]):
            s_hat = line_sums(blocks, cols, p2, q_hat)  # P^T q_hat (and |q_hat|^2 after the first round): completed
            blocks.add_axis(rnd, s_hat, cols)
            if i > 0:
                q_norm2 = blocks.axis_sums(q_hat * q_hat, rows, rnd)
            rnd.run()
            rescale(s_hat, q_norm2[line_items(blocks, cols)])
            q_hat = line_sums(blocks, rows, p2, s_hat)
            blocks.add_axis(rnd, q_hat, rows)
            s_norm2 = blocks.axis_sums(s_hat * s_hat, cols, rnd)
            rnd.run()
            rescale(q_hat, s_norm2[line_items(blocks, rows)])
        beta = decay = group["beta"]
        if gate is not None:  # a skipped step: q = 1 q + (1 - beta) 0, s likewise
            q_hat, s_hat, decay = gated(gate, q_hat, 0.0), gated(gate, s_hat, 0.0), gated(gate, beta, 1.0)
        states = step.states
        for st, shape in zip(states, (lay.shape for lay in step.layouts)):
            if "q" not in st:  # per logical row and column: a weight stored in x out keeps q per stored column
                st["q"] = q_hat.new_zeros(shape[rows])
                st["s"] = q_hat.new_zeros(shape[cols])
                st["phi"] = q_hat.new_zeros(())
        with_grad = [k for k, ok in enumerate(step.has_grad) if ok]
        if with_grad:
            q_parts, s_parts = blocks.segments(q_hat, rows), blocks.segments(s_hat, cols)
            qs, ss = [states[k]["q"] for k in with_grad], [states[k]["s"] for k in with_grad]
            torch._foreach_mul_(qs, decay)  # ema_scales for every matrix with a gradient
            torch._foreach_add_(qs, [q_parts[k] for k in with_grad], alpha=1 - beta)
            torch._foreach_mul_(ss, decay)
            torch._foreach_add_(ss, [s_parts[k] for k in with_grad], alpha=1 - beta)
        q_inv, s_inv = inverse_sqrt_scales(torch.cat([st["q"] for st in states]), torch.cat([st["s"] for st in states]))
        # |Gt|^2 = sum_ij P_ij / (q_i s_j): a weighted row sum of P, no squared copy of Gt
        norm2 = blocks.item_sums(line_sums(blocks, rows, p2, s_inv * s_inv) * (q_inv * q_inv), rows)
        blocks.add_sums(rnd, norm2)
        rnd.run()
        eta = _limit_norm_growth(states, with_grad, norm2, gate, group["gamma"])
        lr = group["lr"] * group["alpha"] * eta  # per matrix, folded into the row scale: the update is one pass
        q_lr = q_inv * lr[line_items(blocks, rows)]
        scales = (q_lr, s_inv) if rows == 0 else (s_inv, q_lr)
        update = blocks.scale(grads, scales[0], scales[1], out=p2)  # into P's memory
        step.apply(update, lr, group["weight_decay"], lr_in_updates=True)

    def _racs_row_blocks(self, group: dict, step: Any) -> None:
        """``_step_racs`` where every row is whole on this rank, on a CPU (``row_passes``): the row half of one
        fixed-point step and the column half of the next share one read of ``G`` (a row's ``q_hat`` is final when
        its rows are read), and the last row half shares its read with the limiter's weighted row sums, so the
        statistics read ``G`` ``iterations + 1`` times and the update once more, with no ``P`` kept. The rounds
        are the same, in the same order: a row round registers no split index, only ``|s_hat|^2`` where the
        columns are split."""
        blocks, grads, gate = step.blocks, step.grads, self._step_gate
        rnd = Round()
        s_hat = line_sums(blocks, 1, grads, square=True)  # P^T 1
        blocks.add_axis(rnd, s_hat, 1)
        rnd.run()
        rescale(s_hat, item_lines(blocks, 0)[blocks.item_of_col])  # |1|^2 = m
        for _ in range(1, group["iterations"]):
            s_norm2 = blocks.axis_sums(s_hat * s_hat, 1, rnd)
            rnd.run()
            per_row = functools.partial(_times_lines, masked_reciprocal(s_norm2)[blocks.item_of_row])
            _, q_hat, s_next = row_block_pass(blocks, grads, [s_hat], per_row)  # q_hat = P s_hat / |s_hat|^2
            assert q_hat is not None and s_next is not None
            blocks.add_axis(rnd, s_next, 1)
            q_norm2 = blocks.axis_sums(q_hat * q_hat, 0, rnd)
            rnd.run()
            s_hat = rescale(s_next, q_norm2[blocks.item_of_col])
        s_norm2 = blocks.axis_sums(s_hat * s_hat, 1, rnd)
        rnd.run()
        beta = decay = group["beta"]
        s_new = s_hat if gate is None else gated(gate, s_hat, 0.0)
        if gate is not None:  # a skipped step: q = 1 q + (1 - beta) 0, s likewise
            decay = gated(gate, beta, 1.0)
        states = step.states
        for st, shape in zip(states, (lay.shape for lay in step.layouts)):
            if "q" not in st:
                st["q"] = s_hat.new_zeros(shape[0])
                st["s"] = s_hat.new_zeros(shape[1])
                st["phi"] = s_hat.new_zeros(())
        with_grad = [k for k, ok in enumerate(step.has_grad) if ok]
        if with_grad:
            s_parts, ss = blocks.segments(s_new, 1), [states[k]["s"] for k in with_grad]
            torch._foreach_mul_(ss, decay)
            torch._foreach_add_(ss, [s_parts[k] for k in with_grad], alpha=1 - beta)
        s_inv = masked_rsqrt(torch.cat([st["s"] for st in states]))
        # the last row half (P s_hat) and the limiter's sum_j P_ij / s_j in one read
        (q_hat, weighted), _, _ = row_block_pass(blocks, grads, [s_hat, s_inv * s_inv])
        rescale(q_hat, s_norm2[blocks.item_of_row])
        if gate is not None:
            q_hat = gated(gate, q_hat, 0.0)
        if with_grad:
            q_parts, qs = blocks.segments(q_hat, 0), [states[k]["q"] for k in with_grad]
            torch._foreach_mul_(qs, decay)
            torch._foreach_add_(qs, [q_parts[k] for k in with_grad], alpha=1 - beta)
        q_inv = masked_rsqrt(torch.cat([st["q"] for st in states]))
        norm2 = blocks.item_sums(weighted * (q_inv * q_inv), 0)  # |Gt|^2 = sum_ij P_ij / (q_i s_j)
        blocks.add_sums(rnd, norm2)
        rnd.run()
        eta = _limit_norm_growth(states, with_grad, norm2, gate, group["gamma"])
        lr = group["lr"] * group["alpha"] * eta  # per matrix, folded into the row scale
        q_lr = q_inv * lr[blocks.item_of_row]
        wd = group["weight_decay"]
        if not step.apply_row_blocked(grads, q_lr, s_inv, (1 - lr * wd) if wd else None):
            step.apply(blocks.scale(grads, q_lr, s_inv), lr, wd, lr_in_updates=True)
