"""ASGO (one-sided Shampoo) and DASGO, its diagonal form (arXiv:2503.20762 Alg. 2 and 3; docs/algorithms/asgo.md).

ASGO per matrix, on the side of the smaller dimension (``k = min(m, n)``; ties precondition the inputs); the
state keys are the symbols ``V`` and ``P`` (``M`` is ``exp_avg``, element-wise like AdamW's)::

    M = b1 M + (1 - b1) G                          (EMA, no bias correction)
    V = b2 V + (1 - b2) G^T G   (right, k = n)   or  G G^T (left, k = m)   (from M with statistic="momentum")
    every tau steps:  P = (V + eps I)^{-1/2}       (eigh in float64; eps = 0 is a pseudo-inverse root)
    W = W (1 - lr wd) - lr * (M P  or  P M)        (optionally grafted to RMS ``update_rms``: ``graft_to_rms``)

Written on ``MatrixOps`` with ``A = G`` (right) or ``A = G^T`` (left): the statistic is the Gram ``A^T A``, a
sum over the rows of ``A``, so under the distributed strategy each rank adds its rows' ``k x k`` partial Gram
and one bucketed all-reduce completes it; the root is computed identically on every rank from identical
inputs, and the update ``M_A P`` is row-local. Under the gather strategy an owner computes all of it.

DASGO: ``v = b2 v + (1 - b2) colsum(G * G)``; ``W -= lr M / sqrt(v + eps)`` per column (state key ``v``): only
the split columns' partial sums cross the network (the core primitives), no whole-matrix work.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from ..sharding import Round, masked_rsqrt
from ..sharding.linalg import by_shape, inverse_root
from ..sharding.matrix_ops import OpCost
from .base import ShardedOptimizer
from .grouped import _local, grouped_step

__all__ = ["ASGO", "DASGO", "asgo_left", "graft_to_rms"]


def asgo_left(shape: tuple[int, int], side: str) -> bool:
    """Whether the preconditioner multiplies from the left (``P M``, ``k = m``)."""
    if side == "left":
        return True
    if side == "right":
        return False
    if side != "auto":
        raise ValueError(f"side must be 'auto', 'left' or 'right', got {side!r}")
    m, n = shape
    return m < n


def graft_to_rms(update: torch.Tensor, norm2: torch.Tensor, rms: float, shape: tuple[int, int]) -> torch.Tensor:
    """``update`` rescaled to RMS ``rms`` over the whole ``m x n`` matrix (``norm2``: its reduced squared
    Frobenius norm; ``update`` may be a block of its rows)."""
    m, n = shape
    return update * (rms * math.sqrt(m * n) / norm2.sqrt().clamp(min=1e-12))


def _asgo_cost(a_shape: tuple[int, int]) -> OpCost:
    rows, k = a_shape
    return OpCost(row_flops=4.0 * rows * k * k, small_flops=10.0 * k ** 3, reduced=k * k, state=2.0 * k * k)


class _MomentumMixin:
    def _update_momentum(self, group: dict, beta1: float) -> dict[int, int]:
        """EMA momentum ``M = b1 M + (1 - b1) G`` on every stepped tensor (element-wise, any layout); returns
        each tensor's step count."""
        steps = {}
        for p in group["params"]:
            st = self.state[p]  # type: ignore[attr-defined]
            if "exp_avg" not in st:
                st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            steps[id(p)] = self._step_count(p)  # type: ignore[attr-defined]
            if p.grad is not None:
                st["exp_avg"].lerp_(p.grad.to(torch.float32), 1 - beta1)
        return steps

    def elementwise_state_copies(self, group: dict) -> int:
        return 2 if group.get("treatment", "adamw") == "adamw" else 1

    def _momentum_piece(self, it) -> torch.Tensor:
        return it.frag.local(self.state[it.tensor]["exp_avg"])  # type: ignore[attr-defined]


class ASGO(_MomentumMixin, ShardedOptimizer):
    """ASGO (``treatment="asgo"``). Keys: ``lr`` (0.01), ``betas`` (0.9, 0.95), ``eps`` (1e-6, inside the
    root), ``refresh_interval`` tau (1), ``side`` ("auto" | "left" | "right"), ``root`` ("eigh" |
    "newton_schulz": the eigh root wherever the fp32 iteration is unstable, see ``linalg.inverse_root``), ``statistic`` ("gradient" (Alg. 2) | "momentum" (eq. 4)), ``update_rms`` (None, or the
    released code's 0.2 graft), ``weight_decay`` (0). State per matrix: ``exp_avg`` (M, m x n, like the
    parameter), ``V`` (EMA Gram) and ``P`` (its inverse root), k x k (docs/algorithms/asgo.md)."""

    matrix_treatments = ("asgo",)
    state_kinds = {**ShardedOptimizer.state_kinds, "V": "matrix", "P": "matrix"}
    state_key_renames = {"precond_stat": "V", "precond": "P"}

    def __init__(self, params: Iterable[Any], lr: float = 0.01, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-6, refresh_interval: int = 1, side: str = "auto", root: str = "eigh",
                 ns_steps: int = 50, statistic: str = "gradient", update_rms: float | None = None,
                 weight_decay: float = 0.0, adam_lr: float | None = None,
                 adam_betas: tuple[float, float] = (0.9, 0.999), adam_eps: float = 1e-8,
                 adam_weight_decay: float = 0.0, on_nonfinite: str = "skip", debug_plan: bool | None = None,
                 matrix_ops: dict | None = None):
        if eps == 0 and refresh_interval > 1:
            raise ValueError("eps = 0 with refresh_interval > 1 amplifies directions outside the stale "
                             "preconditioner's range (docs/algorithms/asgo.md); use eps > 0 or tau = 1")
        if statistic not in ("gradient", "momentum"):
            raise ValueError(f"statistic must be 'gradient' or 'momentum', got {statistic!r}")
        asgo_left((1, 1), side)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, refresh_interval=int(refresh_interval), side=side,
                        root=root, ns_steps=int(ns_steps), statistic=statistic, update_rms=update_rms,
                        weight_decay=weight_decay)
        super().__init__(params, defaults, adam_lr=adam_lr, betas=tuple(adam_betas), eps=adam_eps,
                         weight_decay=adam_weight_decay, on_nonfinite=on_nonfinite, debug_plan=debug_plan,
                         matrix_ops=matrix_ops)

    whole_matrix_work = True

    def whole_matrix_transpose(self, group: dict, shape: tuple[int, int]) -> bool:
        return asgo_left(shape, group["side"])

    def whole_matrix_cost(self, group: dict, a_shape: tuple[int, int]) -> OpCost:
        return _asgo_cost(a_shape)

    def matrix_state_spec(self, group: dict, a_shape: tuple[int, int]) -> dict:
        k = a_shape[1]
        return {"V": ((k, k), 1), "P": ((k, k), 1)}

    def _step_asgo(self, group: dict) -> None:
        b1, b2 = group["betas"]
        steps = self._update_momentum(group, b1)
        items = self._matrix_items(group)
        self._run_whole_matrix(group, items, lambda its, ops: self._asgo_bucket(group, its, ops, steps))

    def _asgo_bucket(self, group: dict, items: list, ops, steps: dict) -> None:
        b1, b2 = group["betas"]
        left = [self.whole_matrix_transpose(group, it.layout.shape) for it in items]
        from_momentum = group["statistic"] == "momentum"
        channels = [[self._momentum_piece(it)] if from_momentum else [it.grad, self._momentum_piece(it)]
                    for it in items]
        blocks = ops.to_blocks(channels)
        for it, is_left in zip(items, left):
            k = it.layout.shape[0] if is_left else it.layout.shape[1]
            if "V" not in it.state:
                it.state["V"] = it.grad.new_zeros(k, k)
                it.state["P"] = it.grad.new_zeros(k, k)
        active = [i for i in range(len(items)) if ops.active(i)]
        grams = ops.allreduce({i: blocks[i][0].T @ blocks[i][0] for i in active})
        refresh = {}
        for i in active:
            it = items[i]
            if it.has_grad:
                it.state["V"].mul_(b2).add_(grams[i], alpha=1 - b2)
            if (steps[id(it.tensor)] - 1) % group["refresh_interval"] == 0:
                refresh[i] = it.state["V"]
        roots = by_shape(lambda v: inverse_root(v, group["eps"], group["root"], group["ns_steps"]), refresh)
        updates: dict[int, torch.Tensor] = {}
        for i in active:
            if i in roots:
                items[i].state["P"].copy_(roots[i])
            updates[i] = blocks[i][-1] @ items[i].state["P"]
        if group["update_rms"] is not None:
            norms = ops.allreduce({i: (updates[i] * updates[i]).sum().reshape(1) for i in active})
            for i in active:
                updates[i] = graft_to_rms(updates[i], norms[i], group["update_rms"], items[i].layout.shape)
        pieces = ops.from_blocks([updates.get(i) for i in range(len(items))])
        ops.account()
        for it, piece in zip(items, pieces):
            it.apply(piece, group["lr"], group["weight_decay"])


class DASGO(_MomentumMixin, ShardedOptimizer):
    """DASGO (``treatment="dasgo"``). Keys: ``lr`` (0.01), ``betas`` (0.9, 0.99), ``eps`` (1e-6), ``weight_decay``
    (0). State per matrix: ``exp_avg`` (M, m x n) and ``v`` (EMA column energy, n)."""

    matrix_treatments = ("dasgo",)
    state_kinds = {**ShardedOptimizer.state_kinds, "v": "cols"}
    state_key_renames = {"col_stat": "v"}

    def __init__(self, params: Iterable[Any], lr: float = 0.01, betas: tuple[float, float] = (0.9, 0.99),
                 eps: float = 1e-6, weight_decay: float = 0.0, adam_lr: float | None = None,
                 adam_betas: tuple[float, float] = (0.9, 0.999), adam_eps: float = 1e-8,
                 adam_weight_decay: float = 0.0, on_nonfinite: str = "skip", debug_plan: bool | None = None,
                 matrix_ops: dict | None = None):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, adam_lr=adam_lr, betas=tuple(adam_betas), eps=adam_eps,
                         weight_decay=adam_weight_decay, on_nonfinite=on_nonfinite, debug_plan=debug_plan,
                         matrix_ops=matrix_ops)

    def vector_state(self, group: dict, shape: tuple[int, int]) -> int:
        return shape[1] if group.get("treatment", "adamw") != "adamw" else 0

    def _step_dasgo(self, group: dict) -> None:
        b1, b2 = group["betas"]
        params = group["params"]
        states = [self.state[p] for p in params]
        for p, st in zip(params, states):  # _update_momentum with foreach kernels
            if "exp_avg" not in st:
                st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            if not isinstance(st.get("step"), torch.Tensor):
                st["step"] = torch.tensor(float(st.get("step", 0)), dtype=torch.float32)
        if states:
            torch._foreach_add_([st["step"] for st in states], 1.0)
        with_grad = [(_local(st["exp_avg"]), _local(p.grad)) for p, st in zip(params, states) if p.grad is not None]
        if with_grad:
            torch._foreach_lerp_([m for m, _ in with_grad], [g if g.dtype == torch.float32 else g.float()
                                                              for _, g in with_grad], 1 - b1)
        step = grouped_step(self, group)
        blocks = step.blocks
        rnd = Round()
        sums = blocks.col_sums(step.grads, square=True)
        blocks.add_axis(rnd, sums, 1)
        rnd.run()
        mstates = step.states
        for st, lay in zip(mstates, step.layouts):
            if "v" not in st:
                st["v"] = sums.new_zeros(lay.shape[1])
        vs = [st["v"] for st in mstates]
        v = torch.cat(vs) if vs else sums
        if step.all_have_grad:  # the EMA on the concatenation, written back with one foreach copy
            if vs:
                v.mul_(b2).add_(sums, alpha=1 - b2)
                torch._foreach_copy_(vs, list(v.split(blocks.ns)))
        else:
            with_grad_items = [k for k, ok in enumerate(step.has_grad) if ok]
            if with_grad_items:
                parts = sums.split(blocks.ns)
                torch._foreach_mul_([vs[k] for k in with_grad_items], b2)
                torch._foreach_add_([vs[k] for k in with_grad_items], [parts[k] for k in with_grad_items], alpha=1 - b2)
                v = torch.cat(vs)
        momentum = blocks.stack([_local(self.state[p]["exp_avg"]) for p in params])
        step.apply_scaled(momentum, group["lr"], group["weight_decay"], col_scale=masked_rsqrt(v + group["eps"]))
