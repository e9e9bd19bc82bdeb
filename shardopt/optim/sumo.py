"""SUMO: low-rank moment, orthogonalized by an exact SVD (arXiv:2505.24749 v1 Alg. 1; docs/algorithms/sumo.md).

Per matrix, on ``A = G`` when ``m >= n`` (left projection, ``Q`` is ``m x r``) or ``A = G^T`` otherwise; the
state keys are the symbols ``Q``, ``M`` (and ``prev_onorm`` = ``|O_prev|``)::

    every K steps (from step 0): Q_new = top-r left basis of A (randomized range finder, seeded)
                                 M = (Q_new^T Q) M; Q = Q_new     (moment carried into the new basis; ``carry_moment``)
    M = mu M + Q^T A;  O = U V^T of M (exact SVD, null directions dropped)
    norm-growth limiter: |O| <= gamma |O_prev| (``limit_growth``);  W = W (1 - lr wd) - lr alpha c(m, n) Q O

The functions named above are the math, on plain tensors. ``SUMO._sumo_bucket`` drives them on ``MatrixOps``:
``Q^T A`` is a sum over the rows of ``A`` (one bucketed all-reduce of ``r x n`` under the distributed strategy),
the SVD of the small ``r x n`` moment runs on identical inputs on every rank, and ``Q O`` is row-local. ``Q``
(rows x r) and ``M`` (r x cols) are small per-matrix state.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Iterable, Literal, Unpack

import pydantic
import torch

from ..sharding.matfun import by_shape, polar_factor
from ..sharding.orientation import mm_like
from ..sharding.matrix_ops import OpCost
from ..sharding.subspace import range_basis
from .base import ShardedOptimizer
from .config import CommonOptions, WholeMatrixConfig

__all__ = ["SUMO", "step_scale", "carry_moment", "limit_growth", "SUMOConfig"]

StepScale = Literal["none", "sqrt_max", "moonlight", "muon"]


def step_scale(rule: str, shape: tuple[int, int]) -> float:
    """c(m, n) of docs/algorithms/sumo.md."""
    m, n = shape
    return {"none": 1.0, "sqrt_max": math.sqrt(max(m, n)), "moonlight": 0.2 * math.sqrt(max(m, n)),
            "muon": math.sqrt(max(1.0, m / n))}[rule]


def carry_moment(Q_new: torch.Tensor, Q: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
    """The moment expressed in the new basis: ``(Q_new^T Q) M``."""
    return (Q_new.mT @ Q) @ M


def limit_growth(O: torch.Tensor, prev_norm: torch.Tensor, gamma: float | None) -> torch.Tensor:
    """``O`` scaled down to norm ``gamma |O_prev|`` when it grew more than that (``gamma=None`` or a zero
    previous norm: unchanged)."""
    onorm = O.norm()
    if gamma is not None and prev_norm > 0 and onorm > gamma * prev_norm:
        O = O * (gamma * prev_norm / onorm)
    return O


def effective_rank(rank: int, shape: tuple[int, int], name: str, who: str) -> int:
    """``min(rank, m, n)``, warning once when the configured rank does not fit the matrix."""
    r = min(rank, *shape)
    if r < rank:
        warnings.warn(f"{who}: rank {rank} exceeds min{tuple(shape)} of {name!r}; using rank {r} "
                      "(full-rank projection)", RuntimeWarning, stacklevel=4)
    return r


class SUMOConfig(WholeMatrixConfig):
    """docs/algorithms/sumo.md defaults: GaLore's C4 recipe (lr 0.01, alpha 0.25, K 200), mu 0.9, gamma 1.1."""

    treatment = "sumo"

    lr: float = pydantic.Field(0.01, ge=0)
    rank: int = pydantic.Field(128, ge=1, description="r: subspace rank (clamped to min(m, n) with a warning)")
    alpha: float = pydantic.Field(0.25, ge=0, description="scale of the orthogonalized subspace update")
    momentum: float = pydantic.Field(0.9, ge=0, lt=1, description="mu: momentum in the subspace")
    refresh_interval: int = pydantic.Field(200, ge=1, description="K: steps between subspace refreshes")
    gamma: float | None = pydantic.Field(1.1, ge=1, description="norm-growth limiter; null disables it")
    step_scale: StepScale = pydantic.Field("sqrt_max", description="c(m, n), docs/algorithms/sumo.md")
    side: Literal["auto", "left", "right"] = pydantic.Field("auto", description="auto: left if m >= n")
    oversample: int = pydantic.Field(10, ge=0, description="randomized range finder oversampling")
    power_iters: int = pydantic.Field(2, ge=0, le=20, description="randomized range finder power iterations")
    seed: int = pydantic.Field(0, description="seed of the range finder's draws")


_D = SUMOConfig.defaults()


class SUMO(ShardedOptimizer):
    """SUMO (``treatment="sumo"``). Keys: ``lr`` (0.01), ``rank`` (128), ``alpha`` (0.25), ``momentum`` (0.9),
    ``refresh_interval`` K (200), ``gamma`` (limiter 1.1; None = off), ``step_scale`` ("sqrt_max"), ``side``
    ("auto": left if m >= n | "left" | "right"), ``oversample`` (10), ``power_iters`` (2), ``seed`` (0),
    ``weight_decay`` (0). State per matrix: ``Q`` (basis), ``M`` (moment), ``prev_onorm`` (``|O_prev|``),
    ``refreshes`` (docs/algorithms/sumo.md)."""

    Config = SUMOConfig
    matrix_treatments = ("sumo",)
    state_kinds = {**ShardedOptimizer.state_kinds, "Q": "matrix", "M": "matrix", "prev_onorm": "matrix",
                   "refreshes": "matrix"}
    state_key_renames = {"basis": "Q", "moment": "M"}

    def __init__(self, params: Iterable[Any], lr: float = _D.lr, rank: int = _D.rank, alpha: float = _D.alpha,
                 momentum: float = _D.momentum, refresh_interval: int = _D.refresh_interval,
                 gamma: float | None = _D.gamma, step_scale: str = _D.step_scale, side: str = _D.side,
                 oversample: int = _D.oversample, power_iters: int = _D.power_iters, seed: int = _D.seed,
                 weight_decay: float = _D.weight_decay, **options: Unpack[CommonOptions]):
        self._init_from_config(params, self.Config.from_arguments(type(self).__name__, dict(
            lr=lr, rank=rank, alpha=alpha, momentum=momentum, refresh_interval=refresh_interval, gamma=gamma,
            step_scale=step_scale, side=side, oversample=oversample, power_iters=power_iters, seed=seed,
            weight_decay=weight_decay), options))

    whole_matrix_work = True

    def whole_matrix_transpose(self, group: dict, shape: tuple[int, int]) -> bool:
        m, n = shape
        return (m < n) if group["side"] == "auto" else group["side"] == "right"

    def whole_matrix_cost(self, group: dict, a_shape: tuple[int, int]) -> OpCost:
        rows, cols = a_shape
        r = min(group["rank"], rows, cols)
        return OpCost(row_flops=4.0 * rows * cols * r, small_flops=4.0 * cols * r * r + 8.0 * r ** 3,
                      reduced=r * cols, state=(rows + cols) * r)

    def matrix_state_spec(self, group: dict, a_shape: tuple[int, int]) -> dict:
        rows, cols = a_shape
        r = min(group["rank"], rows, cols)
        return {"Q": ((rows, r), 0), "M": ((r, cols), 1), "prev_onorm": ((), None),
                "refreshes": ((), None)}

    def _step_sumo(self, group: dict) -> None:
        steps = {id(p): self._step_count(p) for p in group["params"]}
        items = self._matrix_items(group)
        self._run_whole_matrix(group, items, lambda its, ops: self._sumo_bucket(group, its, ops, steps))

    def _sumo_bucket(self, group: dict, items: list, ops, steps: dict) -> None:
        rank = group["rank"]
        blocks = [b[0] for b in ops.to_blocks([[it.grad] for it in items])]
        ranks = {}
        for i, it in enumerate(items):
            rows, cols = ops.plans[i].a_shape
            ranks[i] = effective_rank(rank, (rows, cols), it.frag.name, "SUMO")
            if "Q" not in it.state:
                it.state["Q"] = it.grad.new_zeros(rows, ranks[i])
                it.state["M"] = it.grad.new_zeros(ranks[i], cols)
                it.state["prev_onorm"] = it.grad.new_zeros(())
                it.state["refreshes"] = it.grad.new_zeros(())
        active = [i for i in range(len(items)) if ops.active(i)]
        refresh = [i for i in active if (steps[id(items[i].tensor)] - 1) % group["refresh_interval"] == 0]
        new = range_basis(ops, {i: blocks[i] for i in refresh}, ranks, group["seed"],
                          {i: (items[i].frag.name, int(items[i].state["refreshes"])) for i in refresh},
                          group["oversample"], group["power_iters"])
        for i in refresh:
            st = items[i].state
            st["M"].copy_(carry_moment(new[i], st["Q"], st["M"]))
            st["Q"].copy_(new[i])
            st["refreshes"] += 1
        proj = ops.allreduce({i: ops.my_rows(i, items[i].state["Q"]).T @ blocks[i] for i in active})
        for i in active:
            if items[i].has_grad:
                items[i].state["M"].mul_(group["momentum"]).add_(proj[i])
        polar = by_shape(lambda mom: polar_factor(mom, rtol=max(mom.shape[-2:]) * torch.finfo(torch.float32).eps),
                         {i: items[i].state["M"] for i in active})
        updates: dict[int, torch.Tensor] = {}
        for i in active:
            it, st = items[i], items[i].state
            o = limit_growth(polar[i], st["prev_onorm"], group["gamma"])
            if it.has_grad:
                st["prev_onorm"].copy_(o.norm())
            scale = group["alpha"] * step_scale(group["step_scale"], it.layout.shape)
            updates[i] = mm_like(blocks[i], ops.my_rows(i, st["Q"]), o).mul_(scale)
        pieces = ops.from_blocks([updates.get(i) for i in range(len(items))])
        ops.account()
        for it, piece in zip(items, pieces):
            it.apply(piece, group["lr"], group["weight_decay"])

