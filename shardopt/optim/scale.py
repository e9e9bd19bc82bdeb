"""SCALE: column-normalized SGD with momentum on the LM head only (arXiv:2506.16659 v3; docs/algorithms/scale.md).

Per matrix ``G`` (PyTorch ``(out, in)``), "column-wise" in the paper is one statistic per *output unit*,
i.e. per row here (``norm_dim=1``: reduce over ``in``); the token embedding ``(V, d)`` reduces over the
vocabulary (``norm_dim=0``). With momentum ``beta > 0`` (the LM head group) the EMA ``M`` is normalized
instead of ``G``::

    M = beta * M + (1 - beta) * G          (only when beta > 0; zero init, no bias correction)
    s = max(sqrt(mean(X * X, norm_dim)), eps)       (RMS, as the released code; norm="l2": no mean)
    W = W * (1 - lr * wd) - lr * X / s

The state key ``momentum_buffer`` holds ``M`` (torch.optim's name for it, as in SGD and Muon).

Sharded: the per-row/per-column sums of squares are partial sums over local elements, completed by one
bucketed all-reduce of the split indices only (none for FSDP2 row shards with ``norm_dim=1``); ``inverse_rms``
is the math on the completed sums.
"""

from __future__ import annotations

from typing import Any, Iterable, Literal

import pydantic
import torch
from typing_extensions import Unpack

from ..sharding import Round
from .base import ShardedOptimizer
from .config import CommonOptions, OptimizerConfig
from .grouped import grouped_step
from .nonfinite import skippable_lerp_

__all__ = ["SCALE", "inverse_rms", "SCALEConfig"]


def inverse_rms(
    sumsq: torch.Tensor, count: int | torch.Tensor, eps: float, norm: str = "rms", out: torch.Tensor | None = None
) -> torch.Tensor:
    """``1 / s`` with ``s = max(sqrt(sumsq / count), eps)`` per line (``norm="l2"``: no division by the line
    length ``count``, a number or one per line), from each line's completed sum of squares (into ``out``)."""
    if norm == "rms":
        sumsq = sumsq / count
    return torch.reciprocal(sumsq.sqrt().clamp_min(eps), out=out)


class SCALEConfig(OptimizerConfig):
    """docs/algorithms/scale.md: matrix lr 1e-3, LM-head momentum 0.9, RMS clamp 1e-8, AdamW 1e-3 for vectors.

    ``momentum`` is the LM head's beta (the paper's placement; JSON and ``create_optimizer``). The constructor
    keeps torch's meaning for its ``momentum`` keyword, the beta of every ``scale`` group that sets none
    (hidden matrices; every matrix of an unnamed list): the field ``matrix_momentum``, 0 by default, which the
    constructor also gives the embedding unless ``embedding_momentum`` is passed.
    """

    treatment = "scale"
    config_only = ("momentum",)
    constructor_names = {"momentum": "matrix_momentum"}

    lr: float = pydantic.Field(1e-3, ge=0, description="matrix learning rate")
    momentum: float = pydantic.Field(0.9, ge=0, lt=1, description="EMA beta of the LM-head momentum")
    matrix_momentum: float = pydantic.Field(
        0.0, ge=0, lt=1, description="EMA beta of the other matrices (the paper: none); the constructor's momentum"
    )
    embedding_momentum: float = pydantic.Field(0.0, ge=0, lt=1, description="Tab. 8 'mmt-(first+last)' variant")
    norm_dim: Literal[0, 1] = pydantic.Field(1, description="1: one statistic per row (output unit), 0: per column")
    eps: float = pydantic.Field(1e-8, gt=0, description="clamp on the RMS")
    norm: Literal["rms", "l2"] = pydantic.Field(
        "rms", description="line norm: rms (as the released code) or l2 (no division by the line length)"
    )
    adam_lr: float | None = pydantic.Field(1e-3, ge=0, description="AdamW lr for vectors (the released code)")

    def group_defaults(self) -> dict[str, Any]:
        return dict(
            lr=self.lr,
            momentum=self.matrix_momentum,
            norm_dim=self.norm_dim,
            eps=self.eps,
            norm=self.norm,
            weight_decay=self.weight_decay,
        )

    def roles(self) -> dict[str, dict]:
        """The embedding is normalized per column (over the vocabulary); momentum on the LM head only; a weight
        stored in x out (``matrix_transposed``) per column of the stored weight, i.e. per output unit."""
        return {
            "matrix": {"treatment": "scale", "norm_dim": self.norm_dim, "momentum": self.matrix_momentum},
            # stored in x out (GPT-2's Conv1D): per output unit is the other axis of the stored weight
            "matrix_transposed": {
                "treatment": "scale",
                "norm_dim": 1 - self.norm_dim,
                "momentum": self.matrix_momentum,
            },
            "embedding": {"treatment": "scale", "norm_dim": 0, "momentum": self.embedding_momentum},
            "lm_head": {"treatment": "scale", "norm_dim": self.norm_dim, "momentum": self.momentum},
            "router": {"treatment": "adamw"},
            "vector": {"treatment": "adamw"},
        }


_D = SCALEConfig.defaults()


class SCALE(ShardedOptimizer):
    """SCALE optimizer. Matrix groups use ``treatment="scale"`` with keys ``lr``, ``norm_dim`` (1: per row,
    0: per column), ``momentum`` (EMA beta; 0 = none), ``eps``, ``norm`` ("rms" | "l2"), ``weight_decay``.
    Other groups use ``treatment="adamw"`` (``adam_lr``, ``adam_betas``, ``adam_eps``, ``adam_weight_decay``).

    Defaults (docs/algorithms/scale.md): lr 1e-3, LM-head beta 0.9, eps 1e-8 (a clamp on the RMS), wd 0, AdamW for
    vectors at 1e-3 with eps outside the bias correction as in the released code.
    """

    Config = SCALEConfig
    matrix_treatments = ("scale",)
    state_kinds = {**ShardedOptimizer.state_kinds, "momentum_buffer": "elements"}
    adamw_defaults = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, eps_mode="outside")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = _D.lr,
        momentum: float = _D.matrix_momentum,
        norm_dim: int = _D.norm_dim,
        eps: float = _D.eps,
        norm: str = _D.norm,
        weight_decay: float = _D.weight_decay,
        **options: Unpack[CommonOptions],
    ):
        options.setdefault("embedding_momentum", momentum)  # type: ignore[typeddict-item]  # SCALE's own key; torch's sense: the embedding sets no beta of its own
        self._init_from_config(
            params,
            self.Config.from_arguments(
                type(self).__name__,
                dict(lr=lr, momentum=momentum, norm_dim=norm_dim, eps=eps, norm=norm, weight_decay=weight_decay),
                options,
            ),
        )

    def elementwise_state_copies(self, group: dict) -> int:
        if group.get("treatment", "adamw") == "adamw":
            return 2
        return 1 if group["momentum"] else 0

    def skips_on_device(self, group: dict) -> bool:
        """SCALE gates every write (``_step_scale``): where the device skips the step, the momentum's EMA is
        skipped by its kernel (``nonfinite.skippable_lerp_``) and the update has a scale of 0 and a decay factor
        of 1, on gradients whose non-finite elements read as 0."""
        return group.get("treatment") == "scale" or super().skips_on_device(group)

    def _step_scale(self, group: dict) -> None:
        beta = group["momentum"]
        gate = self._step_gate  # None, or 0-d 1./0.: the step's skip decided on the device (nonfinite.gate_step)

        def source(p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
            if not beta:
                return grad
            st = self.state[p]
            if "momentum_buffer" not in st:
                st["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            buf = st["momentum_buffer"]
            if gate is None:
                buf.lerp_(grad.to(buf.dtype), 1 - beta)
            else:  # nothing written on a skipped step, one kernel
                assert self._step_found_inf is not None  # set with the gate
                skippable_lerp_([buf], [grad.to(buf.dtype)], 1 - beta, self._step_found_inf)
            return buf

        step = grouped_step(self, group, source)
        if gate is not None:
            step.sanitize()
        blocks = step.blocks
        axis = 0 if group["norm_dim"] == 1 else 1  # stats per row when reducing over dim 1
        if axis == 0:  # on a CPU with whole rows: each row block's RMS and update in one read (row_passes)

            def row_scale(sumsq: torch.Tensor, rows: slice) -> torch.Tensor:
                inv = inverse_rms(sumsq, blocks.row_length[rows], group["eps"], group["norm"])
                return inv if gate is None else inv.mul_(gate)  # a skipped step adds 0 x (finite) gradient

            if step.apply_row_normalized(step.grads, row_scale, group["lr"], group["weight_decay"]):
                return
        rnd = Round()
        stats = blocks.row_sums(step.grads, square=True) if axis == 0 else blocks.col_sums(step.grads, square=True)
        blocks.add_axis(rnd, stats, axis)
        rnd.run()
        # each row's count is its matrix's n (per-row stats), each column's its m
        inv = inverse_rms(
            stats,
            blocks.row_length if axis == 0 else blocks.col_length,
            group["eps"],
            group["norm"],
            out=blocks.line_buffer("inverse_rms", axis),
        )  # its per-matrix slices made once
        if gate is not None:
            inv.mul_(gate)  # a skipped step adds 0 x (finite) gradient
        step.apply_scaled(
            step.grads,
            group["lr"],
            group["weight_decay"],
            row_scale=inv if axis == 0 else None,
            col_scale=inv if axis == 1 else None,
        )
