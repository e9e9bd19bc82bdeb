"""SUMO: low-rank moment, orthogonalized by an exact SVD (arXiv:2505.24749 v1 Alg. 1; docs/algorithms/sumo.md).

Per matrix, on ``A = G`` when ``m >= n`` (left projection, ``Q`` is ``m x r``) or ``A = G^T`` otherwise; the
state keys are the symbols ``Q``, ``M`` (and ``prev_onorm`` = ``|O_prev|``)::

    every K steps (from step 0): Q_new = top-r left basis of A (randomized range finder, seeded)
                                 M = (Q_new^T Q) M; Q = Q_new     (moment carried into the new basis; ``carry_moment``)
    M = mu M + Q^T A;  O = U V^T of M (exact SVD, null directions dropped)
    norm-growth limiter: |O| <= gamma |O_prev| (``limit_growth``);  W = W (1 - lr wd) - lr alpha c(m, n) Q O

The functions named above are the math, on plain tensors. ``SUMO._sumo_bucket`` drives them on ``MatrixOps``:
``Q^T A`` is a sum over the rows of ``A`` (one bucketed all-reduce of ``r x n`` under the distributed strategy),
the polar factor of the small ``r x n`` moment (``matfun.polar_factor``: float64, exact to float32 rounding)
runs on identical inputs on every rank, and ``Q O`` is row-local. ``Q`` (rows x r) and ``M`` (r x cols) are
small per-matrix state. The step is batched: matrices of equal shapes are stacked for each product, polar
factor and limiter (``_limit_growth_stacked``), the state is written with ``torch._foreach_*`` kernels, and the
parameters are updated by ``apply_items``; a step's kernel launches grow with the number of shapes, not of
matrices (except the per-matrix state writes, one foreach call each).
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any, Iterable, Literal, cast

import pydantic
import torch
from typing_extensions import Unpack

from ..sharding.iterative import steps_to_converge
from ..sharding.matfun import polar_factor, polar_kept
from ..sharding.matrix_ops import OpCost
from ..sharding.orientation import stored_transposed
from ..sharding.precision import LOW_PRECISION, arrival_dtype, noise_rtol
from ..sharding.stacking import group_indices, stack_stored, unstack_into
from ..sharding.state_split import ROWS
from ..sharding.subspace import range_basis, refresh_reduced
from .base import ShardedOptimizer
from .config import CommonOptions, WholeMatrixConfig
from .items import apply_items
from .nonfinite import gated, keep_unless_gated, zero_nonfinite

__all__ = ["SUMO", "step_scale", "carry_moment", "limit_growth", "SUMOConfig", "warn_clamped_ranks"]

StepScale = Literal["none", "sqrt_max", "moonlight", "muon"]


def step_scale(rule: str, shape: tuple[int, int]) -> float:
    """c(m, n) of docs/algorithms/sumo.md."""
    m, n = shape
    return {
        "none": 1.0,
        "sqrt_max": math.sqrt(max(m, n)),
        "moonlight": 0.2 * math.sqrt(max(m, n)),
        "muon": math.sqrt(max(1.0, m / n)),
    }[rule]


def carry_moment(Q_new: torch.Tensor, Q: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
    """The moment expressed in the new basis: ``(Q_new^T Q) M``, with both bases whole. ``SUMO._refresh`` computes
    the same product from rows (``Q_new^T Q`` summed over the ranks' rows of ``Q``, which rest with them)."""
    return (Q_new.mT @ Q) @ M


def limit_growth(O: torch.Tensor, prev_norm: torch.Tensor, gamma: float | None) -> torch.Tensor:
    """``O`` scaled down to norm ``gamma |O_prev|`` when it grew more than that (``gamma=None`` or a zero
    previous norm: unchanged)."""
    onorm = O.norm()
    if gamma is not None and prev_norm > 0 and onorm > gamma * prev_norm:
        O = O * (gamma * prev_norm / onorm)
    return O


def effective_rank(rank: int, shape: tuple[int, int], name: str, who: str) -> int:
    """``min(rank, m, n)``: a configured rank above a matrix's smaller side projects at full rank (the build's
    one warning, ``warn_clamped_ranks``, lists such matrices)."""
    return min(rank, *shape)


def warn_clamped_ranks(opt: ShardedOptimizer, who: str, stacklevel: int = 2) -> None:
    """At an optimizer's first step, one warning for every matrix whose smaller side is below its group's
    ``rank`` (each projects at full rank, ``effective_rank``): how many, the largest rank any of them uses and
    the first few names, rather than one line per matrix (a small model at the default rank 128 has many).
    From the logical shapes as built, so the same on every engine."""
    if opt.__dict__.get("_ranks_checked"):
        return
    opt._ranks_checked = True  # type: ignore[attr-defined]
    clamped: list[tuple[str, tuple[int, ...], int]] = []
    ranks: set[int] = set()
    for g, names, shapes in zip(opt._groups(), opt.group_param_names, opt.group_param_shapes):
        if g.get("treatment") not in opt.matrix_treatments:
            continue
        for name, shape in zip(names, shapes):
            side = min(shape[-2:]) if len(shape) >= 2 else None
            if side is not None and side < g["rank"]:
                clamped.append((name, shape, side))
                ranks.add(g["rank"])
    if not clamped:
        return
    shown = ", ".join(f"{n!r} ({'x'.join(map(str, s))})" for n, s, _ in clamped[:3])
    more = f" and {len(clamped) - 3} more" if len(clamped) > 3 else ""
    warnings.warn(
        f"{who}: rank {'/'.join(map(str, sorted(ranks)))} exceeds min(m, n) of {len(clamped)} "
        f"matri{'x' if len(clamped) == 1 else 'ces'}, which project at full rank (the largest rank used: "
        f"{max(r for _, _, r in clamped)}): {shown}{more}; lower rank to silence this",
        RuntimeWarning,
        stacklevel=stacklevel,
    )


class SUMOConfig(WholeMatrixConfig):
    """docs/algorithms/sumo.md defaults: GaLore's C4 recipe (lr 0.01, alpha 0.25, K 200), mu 0.9, gamma 1.1."""

    treatment = "sumo"

    lr: float = pydantic.Field(0.01, ge=0, description="matrix learning rate (AdamW's too unless adam_lr)")
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
    signal_rank: bool = pydantic.Field(
        False,
        description="a refresh leaves out (zero columns until the next refresh) the directions whose singular values "
        "are at the gradient precision's rounding, instead of completing them from seeded draws",
    )


_D = SUMOConfig.defaults()


class SUMO(ShardedOptimizer):
    """SUMO (``treatment="sumo"``). Keys: ``lr`` (0.01), ``rank`` (128), ``alpha`` (0.25), ``momentum`` (0.9),
    ``refresh_interval`` K (200), ``gamma`` (limiter 1.1; None = off), ``step_scale`` ("sqrt_max"), ``side``
    ("auto": left if m >= n | "left" | "right"), ``oversample`` (10), ``power_iters`` (2), ``seed`` (0),
    ``weight_decay`` (0). State per matrix: ``Q`` (basis), ``M`` (moment), ``prev_onorm`` (``|O_prev|``),
    ``refreshes`` (docs/algorithms/sumo.md)."""

    Config = SUMOConfig
    matrix_treatments = ("sumo",)
    state_kinds = {
        **ShardedOptimizer.state_kinds,
        "Q": "matrix",
        "M": "matrix",
        "prev_onorm": "matrix",
        "refreshes": "matrix",
    }
    state_key_renames = {"basis": "Q", "moment": "M"}
    #: the truncated SVD of the range finder's small sketch ``Y^T G`` (its orthonormalizations are Cholesky-QR2)
    refresh_factorizations = {"svd": 1}

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = _D.lr,
        rank: int = _D.rank,
        alpha: float = _D.alpha,
        momentum: float = _D.momentum,
        refresh_interval: int = _D.refresh_interval,
        gamma: float | None = _D.gamma,
        step_scale: str = _D.step_scale,
        side: str = _D.side,
        oversample: int = _D.oversample,
        power_iters: int = _D.power_iters,
        seed: int = _D.seed,
        signal_rank: bool = _D.signal_rank,
        weight_decay: float = _D.weight_decay,
        **options: Unpack[CommonOptions],
    ):
        self._init_from_config(
            params,
            self.Config.from_arguments(
                type(self).__name__,
                dict(
                    lr=lr,
                    rank=rank,
                    alpha=alpha,
                    momentum=momentum,
                    refresh_interval=refresh_interval,
                    gamma=gamma,
                    step_scale=step_scale,
                    side=side,
                    oversample=oversample,
                    power_iters=power_iters,
                    seed=seed,
                    signal_rank=signal_rank,
                    weight_decay=weight_decay,
                ),
                options,
            ),
        )

    whole_matrix_work = True

    def whole_matrix_transpose(self, group: dict, shape: tuple[int, int]) -> bool:
        m, n = shape
        return (m < n) if group["side"] == "auto" else group["side"] == "right"

    def whole_matrix_cost(self, group: dict, a_shape: tuple[int, int], parts: int = 1) -> OpCost:
        """Per step: the projections (``4 rows cols r``) and the moment's polar factor from its ``r x r`` Gram
        (products: Gram and O, ``4 cols r^2 + 2 r^3``), by a float64 eigendecomposition, or on the iterative
        routes by the checked coupled Newton-Schulz iteration (``6 r^3`` a step, its step count fixed by the
        cutoff). A refresh, spread over its interval: the range finder's products with ``A`` (``2 (1 + p)``
        of ``2 rows cols w``), its orthonormalizations (QR, or Cholesky-QR2's products) and the SVD of the
        ``w x cols`` sketch; its reductions and ``Q_new^T Q`` (``refresh_reduced``)."""
        rows, cols = a_shape
        r = min(group["rank"], rows, cols)
        w = min(r + group["oversample"], rows, cols)
        every = group["refresh_interval"]
        orthonormalizations = 1 + 2 * group["power_iters"]
        sketch_svd = 4.0 * cols * w * w + 22.0 * w**3
        refresh_rows = 2.0 * (1 + group["power_iters"]) * 2.0 * rows * cols * w
        products = 4.0 * cols * r * r + 2.0 * r**3
        if self.iterative_routes(group):
            steps = steps_to_converge(min(1.0, polar_kept((r, cols), max(r, cols) * _EPS32) ** 2))
            qr2 = orthonormalizations * (2 * 2.0 * rows * w * w + 2 * rows * w * w)  # two Grams, two solves
            small = dict(
                small_matmul=products + 6.0 * r**3 * steps + qr2 / every,
                small_flops=sketch_svd / every,
                small_calls=1.0 / every,
            )
        else:
            small = dict(
                small_matmul=products,
                small_flops=8.0 * r**3 + (orthonormalizations * 4.0 * rows * w * w + sketch_svd) / every,
                small_calls=1.0 + (orthonormalizations + 1.0) / every,
            )
        return OpCost(
            row_flops=4.0 * rows * cols * r + refresh_rows / every,
            **small,
            reduced=r * cols,
            state=(rows + cols) * r,
            row_state=rows * r,
            refresh_reduced=refresh_reduced(group, rows, cols, r) + r * r,
            refresh_every=every,
        )

    def matrix_state_spec(self, group: dict, a_shape: tuple[int, int]) -> dict:
        return _state_spec(group["rank"], *a_shape)

    def skips_on_device(self, group: dict) -> bool:
        """SUMO gates every write of a step that refreshes no basis (``_sumo_bucket``): the projections' inf/NaN
        read as 0, the new moments and limiter norms put back to the old ones (selects,
        ``nonfinite.keep_unless_gated``), the update times the gate and a decay factor of 1. A refresh step keeps
        the host's check."""
        if group.get("treatment") != "sumo":
            return super().skips_on_device(group)
        period = group["refresh_interval"]  # the upcoming count c (the host's + 1) refreshes where (c - 1) % K == 0
        return all(int(self.state[p].get("step", 0)) % period != 0 for p in group["params"])

    def _step_sumo(self, group: dict) -> None:
        warn_clamped_ranks(self, type(self).__name__)
        steps = self._step_counts(group["params"])  # taken back if the device skips this step
        items = self._matrix_items(group)
        self._run_whole_matrix(group, items, lambda its, ops: self._sumo_bucket(group, its, ops, steps))

    def _sumo_bucket(self, group: dict, items: list, ops: Any, steps: dict) -> None:
        """One bucket's step, batched: matrices whose blocks and moments have the same shapes (and orientation)
        are stacked and computed with one batched product per group, the polar factors and the limiter with
        one batched call per moment shape; state writes are ``torch._foreach_*`` calls and the parameter update
        is ``apply_items``. Each matrix gets the numbers of the per-matrix formulas above (to fp32 rounding of
        batched products); the collectives are those of the per-matrix code (one bucketed all-reduce per
        phase, whatever the grouping). When every matrix is ``local`` (one process, DDP) the blocks are the
        gradients themselves, so a group's stack is read from them and its updates are returned as views of
        one tensor, with no per-matrix block mapping."""
        n = len(items)
        plans = ops.plans
        gate = self._step_gate  # None, or 0-d 1./0.: the step's skip decided on the device (skips_on_device)
        local = ops.all_here  # every matrix held whole by this rank (one process, DDP, a ZeRO rank's own)
        # this rank's blocks of the matrices (none when every matrix is local)
        blocks: list[torch.Tensor] = [] if local else [b[0] for b in ops.to_blocks([[it.grad] for it in items])]
        states = [it.state for it in items]
        for i, (it, st) in enumerate(zip(items, states)):
            if "Q" not in st:  # normally created from matrix_state_spec by _run_whole_matrix
                rows, cols = plans[i].a_shape
                r = effective_rank(group["rank"], (rows, cols), it.frag.name, "SUMO")
                a0, a1 = ops.rows(i) if not local and ops.split(i) else (0, rows)
                st["Q"] = it.grad.new_zeros(a1 - a0, r)
                st["M"] = it.grad.new_zeros(r, cols)
                st["prev_onorm"] = it.grad.new_zeros(())
                st["refreshes"] = it.grad.new_zeros(())
        period = group["refresh_interval"]
        due = [i for i, it in enumerate(items) if (steps[id(it.tensor)] - 1) % period == 0]
        if due:
            self._refresh(
                group,
                items,
                ops,
                blocks if not local else [_whole_block(p, it.grad) for p, it in zip(plans, items)],
                due,
            )
        arrival = [arrival_dtype(self, it.frag.name, it.tensor) for it in items]  # the same on every rank
        if local:
            active = list(range(n))
            groups = group_indices(
                active, lambda i: (plans[i].transpose, items[i].layout.shape, states[i]["M"].shape, arrival[i])
            )
        else:
            active = [i for i in range(n) if ops.active(i)]
            groups = group_indices(
                active,
                lambda i: (
                    blocks[i].shape,
                    blocks[i].stride(),
                    states[i]["M"].shape,
                    items[i].layout.shape,
                    arrival[i],
                ),
            )
        # per group: this rank's rows of the bases, Q^T A in one batched product
        stacked_q, projections = [], []
        parts: dict[int, torch.Tensor] = {}
        for idx in groups:
            if local:
                a = torch.stack([items[i].grad for i in idx]).view(len(idx), *items[idx[0]].layout.shape)
                a = a.mT if plans[idx[0]].transpose else a
                q = torch.stack([states[i]["Q"] for i in idx])
            else:
                a = stack_stored([blocks[i] for i in idx])
                q = torch.stack([states[i]["Q"] for i in idx])  # this rank's rows where they are split (ROWS)
            stacked_q.append(q)
            # Q^T A is all the step reads of A: where the device decides the skip, its inf/NaN read as 0
            projections.append(q.mT @ a if gate is None else zero_nonfinite(q.mT @ a, in_place=True))
            if not local:
                parts.update((i, projections[-1][j]) for j, i in enumerate(idx) if ops.split(i))
        summed = ops.allreduce(parts)  # partial sums of distributed matrices; the others are complete
        if summed:
            for g, idx in enumerate(groups):
                if any(i in summed for i in idx):
                    projections[g] = torch.stack([summed.get(i, projections[g][j]) for j, i in enumerate(idx)])
        # per moment shape (groups merged): M = mu M + Q^T A, polar factor, limiter
        # (and arrival precision: a moment built from bf16/fp16 gradients drops the directions rounding can make)
        by_moment: dict[tuple, list[int]] = {}
        for g, idx in enumerate(groups):
            by_moment.setdefault((tuple(states[idx[0]]["M"].shape), arrival[idx[0]]), []).append(g)
        polar: list[torch.Tensor] = [None] * len(groups)  # type: ignore[list-item]
        mu = group["momentum"]
        for (_, dtype), gs in by_moment.items():
            idx = [i for g in gs for i in groups[g]]
            moments = [states[i]["M"] for i in idx]
            mom = torch.stack(moments)
            proj = projections[gs[0]] if len(gs) == 1 else torch.cat([projections[g] for g in gs])
            stepped = [j for j, i in enumerate(idx) if items[i].has_grad]
            whole = len(stepped) == len(idx)
            before = None if gate is None else mom.clone()
            if whole:
                mom.mul_(mu).add_(proj)
            elif stepped:  # a rank without this step's gradient keeps its moment
                mom[stepped] = mom[stepped].mul_(mu).add_(proj[stepped])
            if gate is not None:  # a skipped step: back to the old moments (a select: the new may overflow)
                assert before is not None  # cloned above where there is a gate
                keep_unless_gated(gate, mom, before)
            fp32_rtol = max(mom.shape[-2:]) * _EPS32
            if group.get("signal_rank") and dtype in LOW_PRECISION:  # the basis holds signal only: the floor it kept
                rtol = max(fp32_rtol, torch.finfo(dtype).eps)
            else:
                rtol = noise_rtol(dtype, mom.shape, fp32_rtol)
            o = polar_factor(mom, rtol=rtol)
            prevs = [states[i]["prev_onorm"] for i in idx]
            prev = torch.stack(prevs)
            o, norms = _limit_growth_stacked(o, prev, group["gamma"])
            if gate is not None:  # and to the old limiter norms
                norms = gated(gate, norms, prev)
            if stepped:  # the new moments, and |O| of the (limited) factor for the next step's limiter
                if whole:
                    unstack_into(mom, moments)
                    unstack_into(norms, prevs)
                else:
                    targets = [moments[j] for j in stepped] + [prevs[j] for j in stepped]
                    torch._foreach_copy_(targets, [mom[j] for j in stepped] + [norms[j] for j in stepped])
            pos = 0
            for g in gs:
                polar[g] = o[pos : pos + len(groups[g])]
                pos += len(groups[g])
        # alpha c(m, n) Q O, stored like G where the block is a transposed view (as mm_like)
        updates: list[torch.Tensor | None] = [None] * n
        for idx, q, o in zip(groups, stacked_q, polar):
            first = idx[0]
            like_g = plans[first].transpose if local else stored_transposed(blocks[first])
            u = o.mT @ q.mT if like_g else q @ o
            factor = group["alpha"] * step_scale(group["step_scale"], items[first].layout.shape)
            u.mul_(factor if gate is None else factor * gate)
            if local:  # the G-shaped update of each matrix (apply_items takes it so for a whole tensor)
                updates_g = u.unbind(0)
            else:
                updates_g = (u.mT if like_g else u).unbind(0)
            for i, ui in zip(idx, updates_g):
                updates[i] = ui
        done = cast(list[torch.Tensor], updates)  # the loop above filled every index
        pieces = done if local else ops.from_blocks(done)
        ops.account()
        apply_items(items, pieces, group["lr"], group["weight_decay"], gate=gate)

    def _refresh(self, group: dict, items: list, ops: Any, blocks: list, due: list[int]) -> None:
        """New bases for the matrices ``due`` (every rank passes the same ones): the range finder on the
        active ones, the moment carried into the new basis, one batched product per shape."""
        states = [it.state for it in items]
        ranks = {i: effective_rank(group["rank"], ops.plans[i].a_shape, items[i].frag.name, "SUMO") for i in due}
        refresh = [i for i in due if ops.active(i)]
        floors, kept = signal_floors(self, group, items, ops, refresh), cast(dict[int, torch.Tensor], {})
        new = range_basis(
            ops,
            {i: blocks[i] for i in refresh},
            ranks,
            group["seed"],
            {i: (items[i].frag.name, int(states[i]["refreshes"])) for i in refresh},
            group["oversample"],
            group["power_iters"],
            floors,
            kept,
        )
        if not refresh:
            return
        for i, flags in kept.items():  # signal_rank: the directions bf16/fp16 rounding made are left out
            new[i] = new[i] * flags
        # carry_moment on rows: Q_new^T Q is a sum over the rows of A, so where they are split each rank adds
        # its rows' part of it (its rows of Q rest with it, ROWS) and one bucketed all-reduce of r x r completes it
        mine = {i: ops.my_rows(i, new[i]) if ops.split(i) else new[i] for i in refresh}
        overlap = ops.allreduce({i: mine[i].mT @ states[i]["Q"] for i in refresh})
        for idx in group_indices(refresh, lambda i: (states[i]["Q"].shape, states[i]["M"].shape)):
            qs, ms = [states[i]["Q"] for i in idx], [states[i]["M"] for i in idx]
            carried = torch.stack([overlap[i] for i in idx]) @ torch.stack(ms)
            unstack_into(carried, ms)
            torch._foreach_copy_(qs, [mine[i] for i in idx])
        torch._foreach_add_([states[i]["refreshes"] for i in refresh], 1)


_EPS32 = torch.finfo(torch.float32).eps


def signal_floors(opt: Any, group: dict, items: list, ops: Any, idx: list[int]) -> dict[int, float]:
    """``{i: relative singular-value floor}`` of the matrices ``idx`` when ``group["signal_rank"]``: ``eps(dtype)``
    for a gradient that arrives in bf16/fp16 (its rounding moves the singular values by about ``eps(dtype) / 10``
    of the largest in docs/exactness.md's harness, a rank-8 gradient's smallest signal was 1.6e-2), 0 for fp32
    (the fp32 floor, ``subspace.fp32_floor``, applies anyway). A gradient of lower rank than the subspace (a
    batch smaller than ``r``) leaves the other directions of a new basis at that level; completed from seeded
    draws, the orthogonalized (SUMO) or Adam-normalized (Alice) step gives the gradient's rounding along them unit
    weight, which the summation order and the precision steer (issue 63)."""
    if not group.get("signal_rank"):
        return {}
    out = {}
    for i in idx:
        dtype = arrival_dtype(opt, items[i].frag.name, items[i].tensor)  # the same on every rank
        out[i] = torch.finfo(dtype).eps if dtype in LOW_PRECISION else 0.0
    return out


@functools.lru_cache(maxsize=None)
def _state_spec(rank: int, rows: int, cols: int) -> dict:
    """SUMO's per-matrix state on ``A`` (rows x cols); cached: the step asks for it per matrix (treat as read-only)."""
    r = min(rank, rows, cols)
    return {"Q": ((rows, r), ROWS), "M": ((r, cols), 1), "prev_onorm": ((), None), "refreshes": ((), None)}


def _limit_growth_stacked(
    O: torch.Tensor, prev_norm: torch.Tensor, gamma: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``limit_growth`` of a stack ``O`` (``B x k x l``; scaled in place) with one previous norm each (``B``),
    and the norms of the result. No host read: every matrix is scaled (by exactly 1.0 where it is not limited,
    which leaves it bit for bit) and the norm is recomputed only where it was, all selected on the device."""
    onorm = torch.linalg.vector_norm(O, dim=(-2, -1))
    if gamma is None:
        return O, onorm
    bound = gamma * prev_norm
    limited = (prev_norm > 0) & (onorm > bound)
    O.mul_(torch.where(limited, bound / onorm, 1.0)[:, None, None])
    return O, torch.where(limited, torch.linalg.vector_norm(O, dim=(-2, -1)), onorm)


def _whole_block(plan: Any, grad: torch.Tensor) -> torch.Tensor:
    """The block of a ``local`` matrix: its whole gradient as ``A`` (a view, transposed for ``A = G^T``)."""
    full = grad.view(plan.layout.shape)
    return full.T if plan.transpose else full
