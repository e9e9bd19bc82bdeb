"""Muon (momentum + Newton-Schulz orthogonalization), the baseline the matrix-optimizer papers compare with.

Same update as ``torch.optim.Muon``: ``B = lerp(B, G, 1 - mu)``, Nesterov ``U = lerp(G, B, mu)``,
``O = NS5(U)``, ``W = W (1 - lr wd) - lr_adj O`` with ``lr_adj = lr sqrt(max(1, m/n))`` ("original") or
``0.2 lr sqrt(max(m, n))`` ("match_rms_adamw"). On sharded parameters the momentum is element-wise local
and Newton-Schulz runs on ``MatrixOps`` like every whole-matrix optimizer (``matrix_ops.strategy``): under
``gather`` (Muon's default) an owner rank per matrix, balanced by the cost model, orthogonalizes it whole; under
``distributed`` the rows of the tall orientation stay spread and each of the ``ns_steps`` iterations all-reduces
only the small ``k x k`` Gram matrix (one collective per step for all matrices of a bucket); ``auto`` picks per
matrix by the cost model. ``ns_dtype="bfloat16"`` reproduces torch's bf16 iteration; the default (``"auto"``)
follows ``matrix_ops.precision`` (``sharding.precision``): fp32 on the CPU, which keeps sharded runs equal to the
single-process run to fp32 rounding, bf16 on CUDA, TF32 products where asked.

A step costs a number of kernels that depends on the number of matrix shapes, not of matrices: the momentum is
two foreach lerps, same-shape matrices (a tall one transposed, joining its wide twin) run one batched
iteration, row blocks of one shape under ``distributed`` too, and the update is one foreach decay plus one
foreach add per adjusted lr.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Literal

import pydantic
import torch
from typing_extensions import Unpack

from ..sharding.fragment import local_tensor as _local
from ..sharding.matfun import MUON_COEFFICIENTS, muon_gram_products, newton_schulz, newton_schulz_iteration
from ..sharding.matrix_ops import MatrixOps, OpCost
from ..sharding.precision import matmul_in
from ..sharding.stacking import group_indices, same_shape
from .base import ShardedOptimizer
from .config import CommonOptions, MatrixOpsConfig, WholeMatrixConfig
from .items import MatrixItem
from .nonfinite import gated, skippable_lerp_, zero_nonfinite
from .transposed import logical_2d

__all__ = ["Muon", "MuonConfig", "adjusted_lr"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def adjusted_lr(lr: float, rule: str | None, shape: tuple[int, int]) -> float:
    m, n = shape
    if rule in (None, "original"):
        return lr * math.sqrt(max(1.0, m / n))
    if rule == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(m, n))
    raise ValueError(f"adjust_lr_fn must be 'original' or 'match_rms_adamw', got {rule!r}")


class MuonConfig(WholeMatrixConfig):
    """torch.optim.Muon's defaults: lr 1e-3, momentum 0.95 (Nesterov), wd 0.1, 5 quintic NS steps. Whole
    matrices are gathered to an owner by default (``matrix_ops.strategy = "gather"``), as Muon always did."""

    treatment = "muon"
    low_precision_routes = True  # matrix_ops.precision: the quintic iteration in bf16 or TF32

    lr: float = pydantic.Field(1e-3, ge=0, description="matrix learning rate (before adjust_lr_fn)")
    momentum: float = pydantic.Field(0.95, ge=0, lt=1, description="momentum buffer coefficient")
    nesterov: bool = pydantic.Field(True, description="Nesterov: orthogonalize lerp(G, B, momentum), not the buffer B")
    weight_decay: float = pydantic.Field(0.1, ge=0, description="decoupled weight decay of the matrices")
    ns_steps: int = pydantic.Field(5, ge=1, lt=100, description="quintic Newton-Schulz steps")
    eps: float = pydantic.Field(1e-7, gt=0, description="added to the Frobenius norm before Newton-Schulz")
    adjust_lr_fn: Literal["original", "match_rms_adamw"] | None = pydantic.Field(
        None, description="torch.optim.Muon's lr adjustment by shape (None: 'original')"
    )
    ns_dtype: Literal["auto", "float32", "bfloat16", "float64"] = pydantic.Field(
        "auto",
        description="auto: from matrix_ops.precision (fp32 on the CPU, bf16 on CUDA, TF32 where asked); "
        "float32: exact across sharding; bfloat16: bitwise torch.optim.Muon",
    )
    matrix_ops: MatrixOpsConfig = pydantic.Field(
        default_factory=lambda: MatrixOpsConfig(strategy="gather"),
        description="how whole-matrix work meets sharding (default strategy here: gather)",
    )

    @pydantic.field_validator("matrix_ops", mode="before")
    @classmethod
    def _gather_unless_said(cls, v: Any) -> Any:
        """Muon's strategy stays ``gather`` when ``matrix_ops`` sets other keys only (e.g. ``precision``)."""
        if isinstance(v, dict) and "strategy" not in v:
            return {**v, "strategy": "gather"}
        return v

    @pydantic.model_validator(mode="after")
    def _one_precision(self) -> "MuonConfig":
        """``ns_dtype`` and ``matrix_ops.precision`` must not ask for different iterations."""
        lowp = {"bf16": "bfloat16", "tf32": None}.get(self.matrix_ops.precision, "")
        if self.ns_dtype != "auto" and lowp != "" and self.ns_dtype != lowp:
            raise ValueError(
                f"ns_dtype={self.ns_dtype!r} and matrix_ops.precision={self.matrix_ops.precision!r} ask "
                "for different iterations; set one of them (ns_dtype='auto' follows the precision)"
            )
        return self


_D = MuonConfig.defaults()


class Muon(ShardedOptimizer):
    """Muon for 2-D matrices (``treatment="muon"``; keys ``lr``, ``momentum``, ``nesterov``, ``weight_decay``,
    ``ns_steps``, ``eps``, ``adjust_lr_fn``, ``ns_dtype``); other params use AdamW (``adam_lr``, default lr).
    ``matrix_ops={"strategy": "gather" | "distributed" | "auto"}`` picks how Newton-Schulz meets sharding."""

    Config = MuonConfig
    matrix_treatments = ("muon",)
    state_kinds = {**ShardedOptimizer.state_kinds, "momentum_buffer": "elements"}

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = _D.lr,
        momentum: float = _D.momentum,
        nesterov: bool = _D.nesterov,
        weight_decay: float = _D.weight_decay,
        ns_steps: int = _D.ns_steps,
        eps: float = _D.eps,
        adjust_lr_fn: str | None = _D.adjust_lr_fn,
        ns_dtype: str = _D.ns_dtype,
        **options: Unpack[CommonOptions],
    ):
        self._init_from_config(
            params,
            self.Config.from_arguments(
                type(self).__name__,
                dict(
                    lr=lr,
                    momentum=momentum,
                    nesterov=nesterov,
                    weight_decay=weight_decay,
                    ns_steps=ns_steps,
                    eps=eps,
                    adjust_lr_fn=adjust_lr_fn,
                    ns_dtype=ns_dtype,
                ),
                options,
            ),
        )

    def elementwise_state_copies(self, group: dict) -> int:
        return 2 if group.get("treatment", "adamw") == "adamw" else 1

    def skips_on_device(self, group: dict) -> bool:
        """Muon gates every write (``_step_muon``): the momentum's EMA skipped by its kernel
        (``nonfinite.skippable_lerp_``), the Nesterov blend made from gradients whose non-finite elements read as
        0, the update times 0 and the decay factor 1."""
        return group.get("treatment") == "muon" or super().skips_on_device(group)

    def _step_muon(self, group: dict) -> None:
        updates = self._momentum(group)
        items = self._matrix_items(group, lambda p, grad: updates[id(p)])
        self._run_whole_matrix(group, items, lambda its, ops: self._orthogonalize(its, ops, group))
        self._apply(items, group)

    def _apply(self, items: list[MatrixItem], group: dict) -> None:
        """``W <- W (1 - lr wd) - lr_adj O`` (decay at the unadjusted lr, as torch.optim.Muon) with foreach
        kernels: one decay for all matrices, one update per distinct adjusted lr (``base.apply_items``, whose
        decay would use the adjusted lr). Matrices without a gradient or local elements are skipped."""
        lr, wd = group["lr"], group["weight_decay"]
        gate = self._step_gate  # None, or 0-d 1./0.: the step's skip decided on the device
        views: list[torch.Tensor] = []
        by_lr: dict[float, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for it in items:
            if it.has_grad and it.frag.numel:
                w = it.param()
                u = it.work["update"] if gate is None else it.work["update"] * gate
                views.append(w)
                shape = logical_2d(it.layout.shape, group)  # in x out storage: the lr of its out x in matrix
                ws, us = by_lr.setdefault(adjusted_lr(lr, group["adjust_lr_fn"], shape), ([], []))
                ws.append(w)
                us.append(u if u.dtype == w.dtype else u.to(w.dtype))
        if wd:  # a 0-d fp32 factor (one per device) rounds as p.mul_(float) does, also for bf16 parameters
            by_device: dict[torch.device, list[torch.Tensor]] = {}
            for w in views:
                by_device.setdefault(w.device, []).append(w)
            for device, ws in by_device.items():
                factor = torch.full((), 1 - lr * wd, device=device)
                torch._foreach_mul_(ws, factor if gate is None else gated(gate, factor, 1.0))
        for r, (ws, us) in by_lr.items():
            torch._foreach_add_(ws, us, alpha=-r)

    def _momentum(self, group: dict) -> dict[int, torch.Tensor]:
        """``B = lerp(B, G, 1 - mu)`` and the update ``lerp(G, B, mu)`` (Nesterov) or ``B`` for every parameter
        with a gradient, as two foreach kernels on the local elements; keyed by ``id(p)``."""
        mu = group["momentum"]
        params, bufs, grads = [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            st = self.state[p]
            if "momentum_buffer" not in st:
                st["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            buf = _local(st["momentum_buffer"])
            g = _local(p.grad)
            params.append(p)
            bufs.append(buf)
            grads.append(g if g.dtype == buf.dtype else g.to(buf.dtype))
        if not params:
            return {}
        if self._step_found_inf is None:
            torch._foreach_lerp_(bufs, grads, 1 - mu)
        else:  # the skip decided on the device: nothing written, and a finite blend for a 0-weighted update
            skippable_lerp_(bufs, grads, 1 - mu, self._step_found_inf)
            if group["nesterov"]:
                grads = [zero_nonfinite(g) for g in grads]
        out = torch._foreach_lerp(grads, bufs, mu) if group["nesterov"] else bufs
        return {id(p): u for p, u in zip(params, out)}

    # ------------------------------------------------------------------ whole-matrix work
    whole_matrix_work = True

    def whole_matrix_transpose(self, group: dict, shape: tuple[int, int]) -> bool:
        """``A`` is the tall orientation (rows = the long side), so the distributed iteration reduces only the
        small ``k x k`` Gram. Under ``gather`` the orientation does not matter (the owner holds the whole
        matrix): ``A = G``, which moves no transposed copy."""
        m, n = shape
        return self.matrix_strategy != "gather" and m < n

    def whole_matrix_cost(self, group: dict, a_shape: tuple[int, int], parts: int = 1) -> OpCost:
        """Per step ``x x^T`` and ``(b G + c G^2) x`` on ``k x l`` (``4 k^2 l``, split with the rows of ``A``) and
        ``G^2`` (``2 k^3``, repeated by every computing rank); or, where ``parts`` ranks compute row blocks of
        fewer than ``k`` rows, ``x x^T``, ``G x`` and ``G (G x)`` (``6 k^2 l``, split, nothing repeated:
        ``muon_gram_products``). Split, each step all-reduces the ``k x k`` Gram as a triangle."""
        rows, cols = a_shape
        k, long = min(rows, cols), max(rows, cols)
        steps = group["ns_steps"]
        reduced = steps * k * (k + 1) // 2 + 1
        if muon_gram_products(a_shape, parts):
            return OpCost(row_flops=steps * 6.0 * k * k * long, reduced=reduced, rounds=steps + 1)
        return OpCost(
            row_flops=steps * 4.0 * k * k * long, small_matmul=steps * 2.0 * k**3, reduced=reduced, rounds=steps + 1
        )

    def _iteration_dtype(self, group: dict) -> tuple[torch.dtype, Any]:
        """The iteration's dtype and products: ``ns_dtype`` when set, else ``matrix_ops.precision`` resolved for
        Muon on this device (``sharding.precision``: bf16 as ``torch.optim.Muon``, TF32 products, or fp32)."""
        if group["ns_dtype"] != "auto":
            return _DTYPES[group["ns_dtype"]], None
        precision = self.iteration_precision(group)
        if precision == "bf16":
            return torch.bfloat16, None
        return torch.float32, (matmul_in(precision) if precision == "tf32" else None)

    def _orthogonalize(self, items: list[MatrixItem], ops: MatrixOps, group: dict) -> None:
        """``it.work["update"] = NS(it.grad)`` (the grad slot holds the Nesterov momentum) for one bucket."""
        dtype, mm = self._iteration_dtype(group)
        steps, eps = group["ns_steps"], group["eps"]
        if ops.all_here:
            _orthogonalize_local(items, steps, eps, dtype, mm)
            ops.account()
            return
        blocks = [b[0] for b in ops.to_blocks([[it.grad] for it in items])]
        active = [i for i in range(len(items)) if ops.active(i)]
        # whole matrices (single process, or this rank owns them): one batched iteration per wide shape (a
        # tall matrix runs on its transpose, as newton_schulz does, so it shares the batch of its wide twin)
        tall = {i for i in active if blocks[i].size(0) > blocks[i].size(1)}
        wide = {i: blocks[i].T if i in tall else blocks[i] for i in active if not ops.split(i)}
        out = {}
        for idx in same_shape(wide):
            y = newton_schulz(torch.stack([wide[i] for i in idx]), steps, MUON_COEFFICIENTS, eps, dtype, mm)
            # each piece returns in its parameter's orientation: transposed once per stack where needed, so
            # that from_blocks takes views instead of copying every matrix
            flip = [(i in tall) != ops.plans[i].transpose for i in idx]
            yt = y.mT.contiguous() if any(flip) else y
            for j, i in enumerate(idx):
                piece = yt[j] if flip[j] else y[j]
                out[i] = piece.T if ops.plans[i].transpose else piece
        spread = {i: blocks[i] for i in active if ops.split(i)}
        if spread:
            out.update(_newton_schulz_rows(spread, ops, steps, eps, dtype, mm))
        for it, piece in zip(items, ops.from_blocks([out.get(i) for i in range(len(items))])):
            it.work["update"] = piece
        ops.account()


def _orthogonalize_local(items: list[MatrixItem], steps: int, eps: float, dtype: torch.dtype, mm: Any = None) -> None:
    """``_orthogonalize`` for matrices held whole (``MatrixOps.here``: each local gradient is the row-major matrix):
    the gradients stacked by shape, tall stacks transposed and joined to the wide stack of the same shape, one
    batched iteration per wide shape, results back as flat row-major pieces (no per-matrix copies)."""
    by: dict[tuple[int, ...], list[int]] = {}
    for i, it in enumerate(items):
        by.setdefault(tuple(it.layout.shape), []).append(i)
    wide: dict[tuple[int, int], list[tuple[list[int], bool, torch.Tensor]]] = {}
    for (m, n), idx in by.items():
        g = torch.stack([items[i].grad for i in idx]).view(len(idx), m, n)
        wide.setdefault((min(m, n), max(m, n)), []).append((idx, m > n, g.mT if m > n else g))
    for parts in wide.values():
        x = torch.cat([g for _, _, g in parts]) if len(parts) > 1 else parts[0][2].contiguous()
        y = newton_schulz(x, steps, MUON_COEFFICIENTS, eps, dtype, mm)
        pos = 0
        for idx, tall, _ in parts:
            block = y[pos : pos + len(idx)]
            pos += len(idx)
            flat = (block.mT.contiguous() if tall else block).reshape(len(idx), -1)
            for i, piece in zip(idx, flat.unbind(0)):
                items[i].work["update"] = piece


def _newton_schulz_rows(
    blocks: dict[int, torch.Tensor], ops: MatrixOps, steps: int, eps: float, dtype: torch.dtype, mm: Any = None
) -> dict[int, torch.Tensor]:
    """Newton-Schulz on matrices whose tall orientation ``A`` is spread over ranks by rows: ``blocks[i]`` is
    this rank's row block of ``A_i``, i.e. a column block of the wide ``A_i^T`` that the iteration runs on.
    Every round completes all matrices' partial sums with one all-reduce per process group (in fp32, whatever
    ``dtype``): first the Frobenius norms (sums of squares), then each step's ``k x k`` Gram matrices. Blocks of
    one shape on this rank run as one batched iteration; the reductions stay one entry per matrix, so every
    rank reduces the same entries in the same order however its blocks group."""
    runs: dict[tuple[int, ...], Any] = {}
    form = {i: muon_gram_products(ops.plans[i].a_shape, ops.parts(i)) for i in blocks}
    for idx in same_shape(blocks):
        for sub in group_indices(idx, form.__getitem__):
            x = torch.stack([blocks[i] for i in sub]).to(dtype).mT
            runs[tuple(sub)] = newton_schulz_iteration(x, steps, MUON_COEFFICIENTS, eps, form[sub[0]], mm)
    parts = {idx: next(run) for idx, run in runs.items()}
    norms = ops.allreduce({i: p[j].float().square().reshape(1) for idx, p in parts.items() for j, i in enumerate(idx)})
    complete = {idx: torch.stack([norms[i] for i in idx]).sqrt().reshape(-1, 1, 1).to(dtype) for idx in runs}
    out: dict[int, torch.Tensor] = {}
    while runs:
        parts = {}
        for key, run in list(runs.items()):
            try:
                parts[key] = run.send(complete[key])
            except StopIteration as stop:
                out.update((i, stop.value[j].T.float()) for j, i in enumerate(key))
                del runs[key]
        grams = ops.allreduce({i: p[j].float() for idx, p in parts.items() for j, i in enumerate(idx)}, symmetric=True)
        complete = {idx: torch.stack([grams[i] for i in idx]).to(dtype) for idx in parts}
    return out
