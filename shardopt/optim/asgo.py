"""ASGO (one-sided Shampoo) and DASGO, its diagonal form (arXiv:2503.20762 Alg. 2 and 3; docs/algorithms/asgo.md).

ASGO per matrix, on the side of the smaller dimension (``k = min(m, n)``; ties precondition the inputs); the
state keys are the symbols ``V`` and ``P`` (``M`` is ``exp_avg``, element-wise like AdamW's)::

    M = b1 M + (1 - b1) G                          (EMA, no bias correction)
    V = b2 V + (1 - b2) G^T G   (right, k = n)   or  G G^T (left, k = m)   (from M with statistic="momentum")
    every tau steps:  P = (V + eps I)^{-1/2}       (float64 eigh, or its batched iteration on CUDA;
                                                    eps = 0: pseudo-inverse)
    W = W (1 - lr wd) - lr * (M P  or  P M)        (optionally grafted to RMS ``update_rms``: ``graft_to_rms``)

Written on ``MatrixOps`` with ``A = G`` (right) or ``A = G^T`` (left): the statistic is the Gram ``A^T A``, a
sum over the rows of ``A``, so under the distributed strategy each rank adds its rows' ``k x k`` partial Gram
and one bucketed all-reduce completes it; the root is computed identically on every rank from identical
inputs, and the update ``M_A P`` is row-local. Under the gather strategy an owner computes all of it.

DASGO: ``v = b2 v + (1 - b2) colsum(G * G)``; ``W -= lr M / sqrt(v + eps)`` per column (state key ``v``): only
the split columns' partial sums cross the network (the core primitives), no whole-matrix work.
"""

from __future__ import annotations

import functools
import math
import weakref
from typing import Any, Callable, Iterable, Literal

import pydantic
import torch
from typing_extensions import Unpack

from ..sharding import Round, collective_counter, masked_rsqrt
from ..sharding.fragment import local_tensor as _local
from ..sharding.iterative import count_fallbacks, inverse_sqrt_checked_rows, iterative_device, scaled_schedule
from ..sharding.matfun import inverse_root
from ..sharding.matrix_ops import OpCost
from ..sharding.precision import LOW_PRECISION, arrival_dtype, noise_eig_rtol
from ..sharding.row_passes import lerp_col_energies
from ..sharding.stacking import same_shape, stack
from .base import ShardedOptimizer
from .config import CommonOptions, OptimizerConfig, WholeMatrixConfig, check_betas
from .grouped import _plan, grouped_step
from .items import apply_items
from .nonfinite import _PendingSkip, gated, skippable_lerp_
from .transposed import line_sums, logical_2d, logical_axes

__all__ = ["ASGO", "DASGO", "asgo_left", "graft_to_rms", "ASGOConfig", "DASGOConfig", "ASGO_PRESETS"]


ASGO_PRESETS: dict[str, dict[str, Any]] = {
    # docs/algorithms/asgo.md: the paper's GPT-2 run: direct SVD/eigh, eps = 0 (pseudo-inverse), tau = 1
    "paper_gpt2": dict(lr=0.1, betas=(0.9, 0.95), eps=0.0, refresh_interval=1, root="eigh"),
    # the authors' released code: beta2 0.8, wd 0.1, coupled Newton-Schulz root, RMS-0.2 graft, tau = 1
    "released_code": dict(
        lr=0.01,
        betas=(0.9, 0.8),
        eps=1e-10,
        refresh_interval=1,
        root="newton_schulz",
        ns_steps=10,
        update_rms=0.2,
        weight_decay=0.1,
    ),
}


class ASGOConfig(WholeMatrixConfig):
    """docs/algorithms/asgo.md (Alg. 2): betas (0.9, 0.95) and eps 1e-6 (Table 4), tau 1, eigh root, smaller side.
    Embeddings, LM head and vectors on AdamW, as the released code."""

    treatment = "asgo"
    config_only = ("preset",)

    preset: Literal["paper_gpt2", "released_code"] | None = pydantic.Field(
        None, description="defaults of the paper's GPT-2 run or of the released code; explicit keys win"
    )
    lr: float = pydantic.Field(0.01, ge=0, description="matrix learning rate (AdamW's too unless adam_lr)")
    betas: tuple[float, float] = pydantic.Field((0.9, 0.95), description="momentum and statistic EMA betas")
    eps: float = pydantic.Field(1e-6, ge=0, description="damping inside the root: (V + eps I)^-1/2")
    refresh_interval: int = pydantic.Field(1, ge=1, description="tau: steps between root recomputations")
    side: Literal["auto", "left", "right"] = pydantic.Field(
        "auto", description="the preconditioned side (auto: the smaller dimension; ties precondition the inputs)"
    )
    root: Literal["auto", "eigh", "newton_schulz"] = pydantic.Field(
        "auto",
        description="auto: the eigh root, as batched float64 products with a residual check on CUDA "
        "(matfun.inverse_root); eigh: always the float64 eigendecomposition",
    )
    ns_steps: int = pydantic.Field(50, ge=1, le=200, description="coupled Newton-Schulz steps of the root")
    statistic: Literal["gradient", "momentum"] = pydantic.Field(
        "gradient", description="V from the gradient (Alg. 2) or the momentum (the Muon-equivalent eq. 4)"
    )
    update_rms: float | None = pydantic.Field(None, gt=0, description="graft the update to this RMS (code: 0.2)")

    @pydantic.model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("preset") in ASGO_PRESETS:
            data = {**ASGO_PRESETS[data["preset"]], **data}
        return data

    @pydantic.field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        return check_betas("betas", v)

    @pydantic.field_validator("refresh_interval")
    @classmethod
    def _pseudo_inverse_fresh(cls, v: int, info: pydantic.ValidationInfo) -> int:
        if info.data.get("eps") == 0 and v > 1:
            raise ValueError(
                "eps = 0 needs refresh_interval = 1 (a stale pseudo-inverse root amplifies new "
                "directions outside its range; docs/algorithms/asgo.md); set eps > 0"
            )
        return v


class DASGOConfig(OptimizerConfig):
    """docs/algorithms/asgo.md (DASGO, Alg. 3): Table 4's betas (0.9, 0.99), eps 1e-6."""

    treatment = "dasgo"

    lr: float = pydantic.Field(0.01, ge=0, description="matrix learning rate (AdamW's too unless adam_lr)")
    betas: tuple[float, float] = pydantic.Field((0.9, 0.99), description="momentum and column-energy EMA betas")
    eps: float = pydantic.Field(1e-6, gt=0, description="damping of the column scale: M / sqrt(v + eps)")

    @pydantic.field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        return check_betas("betas", v)


_D = ASGOConfig.defaults()
_DD = DASGOConfig.defaults()


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
    Frobenius norm; ``update`` may be a block of its rows, or a ``(B, rows, k)`` stack of blocks of matrices
    with ``m n`` elements each, ``norm2`` then ``(B, 1, 1)``)."""
    m, n = shape
    return update * (rms * math.sqrt(m * n) / norm2.sqrt().clamp(min=1e-12))


#: coupled Newton-Schulz steps the checked root of the iterative routes takes, as the model counts them: its
#: count follows ``eps`` over the statistic's norm (``iterative.scaled_schedule``: 14 at 1e-8, where the plain
#: iteration, ``steps_to_converge``, took 28)
ROOT_STEPS_MODELED = len(scaled_schedule(1e-8) or ())


@functools.lru_cache(maxsize=1024)
def _asgo_cost(
    a_shape: tuple[int, int],
    channels: int = 2,
    ns_steps: int | None = None,
    graft: bool = False,
    iterative: bool = False,
    every: int = 1,
) -> OpCost:
    """``channels``: the gradient and the momentum go to the row blocks (the momentum alone with
    ``statistic="momentum"``). The root, every ``every`` steps (tau): a float64 eigendecomposition (about
    ``10 k^3``, one solver call) and the root's own product; on the iterative routes (``iterative``) the checked float64
    root (``iterative.inverse_newton``: ``ROOT_STEPS_MODELED`` steps of ``6 k^3``, the first ``4 k^3``; the
    residual comes free); or (``ns_steps``)
    the fp32 iteration's ``3 ns_steps - 2`` products and its residual check.
    The Gram crosses the network as a triangle (the root symmetrizes the statistic anyway), the eigh root too
    (symmetric to rounding; the fp32 Newton-Schulz root is not, and goes whole); ``graft``: one more round,
    the update's norm."""
    rows, k = a_shape
    tri = k * (k + 1) // 2
    if ns_steps is None and iterative:  # a team inside one node may split its products (issue 53)
        small: dict[str, Any] = dict(
            small_matmul=2.0 * k**3 * (3 * ROOT_STEPS_MODELED - 1) / every,
            split_k=k,
            split_steps=ROOT_STEPS_MODELED,
            split_residual=True,
            split_itemsize=8,
            split_every=every,
            split_form="newton",
        )
    elif ns_steps is None:
        small = dict(small_flops=10.0 * k**3 / every, small_matmul=2.0 * k**3 / every, small_calls=1.0 / every)
    else:
        small = dict(small_matmul=2.0 * k**3 * (3 * ns_steps) / every)
    return OpCost(
        row_flops=4.0 * rows * k * k,
        reduced=tri,
        state=2.0 * k * k,
        shared=tri if ns_steps is None else k * k,
        channels=channels,
        rounds=2.0 if graft else 1.0,
        **small,
    )


#: blocks of ``A`` with at least this many elements are computed one by one, as views: there a kernel's launch
#: is negligible next to its work, and a stack would copy them
BATCH_NUMEL = 1 << 16


#: per grouped plan (``optim.grouped``): whether all its matrices are local and small (``ASGO._asgo_local``)
_LOCAL_AND_SMALL: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


class _MomentumMixin:
    #: set by ShardedOptimizer (the class this mixes into) for a device-decided skip
    _step_found_inf: torch.Tensor | None
    _pending_skip: _PendingSkip

    def _update_momentum(
        self, group: dict, beta1: float, counts: bool = True, lerp: bool = True
    ) -> dict[int, int] | None:
        """EMA momentum ``M = b1 M + (1 - b1) G`` on every stepped tensor (element-wise, any layout) and every
        tensor's step count advanced, with one foreach kernel each; returns each tensor's step count when
        ``counts`` (one read of all of them), else None. ``lerp=False``: the state and counts only (the caller
        runs the EMA fused with its own pass over ``G``)."""
        params = group["params"]
        state = self.state  # type: ignore[attr-defined]
        steps, ms, gs = [], [], []
        for p in params:  # one pass: state created where missing, the lists of the foreach kernels
            st = state[p]
            m = st.get("exp_avg")
            if m is None:
                m = st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            step = st.get("step")
            if not isinstance(step, torch.Tensor):  # new, or a number from an older state dict
                step = st["step"] = torch.tensor(float(st.get("step", 0)), dtype=torch.float32)
            steps.append(step)
            g = p.grad
            if g is not None:
                g = _local(g)
                ms.append(_local(m))
                gs.append(g if g.dtype == torch.float32 else g.float())
        if not steps:
            return {} if counts else None
        # matrix rules count every step (ShardedOptimizer._step_count); a list of one 0-d tensor, not the scalar
        # overload, which costs a scalar-to-tensor conversion per tensor on a CPU
        torch._foreach_add_(steps, [steps[0].new_ones(())] * len(steps))
        found_inf = self._step_found_inf  # None, or the device's skip flag
        if found_inf is not None:  # the counts go back if the device skips this step (nonfinite.settle_device_skip)
            self._pending_skip.counts += steps
            skippable_lerp_(ms, gs, 1 - beta1, found_inf)
        elif ms and lerp:
            torch._foreach_lerp_(ms, gs, 1 - beta1)
        if not counts:
            return None
        return {id(p): int(c) for p, c in zip(params, torch.stack(steps).tolist())}

    def elementwise_state_copies(self, group: dict) -> int:
        return 2 if group.get("treatment", "adamw") == "adamw" else 1

    def _momentum_piece(self, it: Any) -> torch.Tensor:
        return it.frag.local(self.state[it.tensor]["exp_avg"])  # type: ignore[attr-defined]


class ASGO(_MomentumMixin, ShardedOptimizer):
    """ASGO (``treatment="asgo"``). Keys: ``lr`` (0.01), ``betas`` (0.9, 0.95), ``eps`` (1e-6, inside the
    root), ``refresh_interval`` tau (1), ``side`` ("auto" | "left" | "right"), ``root`` ("auto": the eigh root,
    batched float64 products with a residual check on CUDA | "eigh" | "newton_schulz": the eigh root wherever the
    fp32 iteration is unstable; see ``matfun.inverse_root``), ``statistic`` ("gradient" (Alg. 2) | "momentum"
    (eq. 4)), ``update_rms`` (None, or the released code's 0.2 graft), ``weight_decay`` (0). State per matrix:
    ``exp_avg`` (M, m x n, like the parameter), ``V`` (EMA Gram) and ``P`` (its inverse root), k x k
    (docs/algorithms/asgo.md)."""

    Config = ASGOConfig
    matrix_treatments = ("asgo",)
    state_kinds = {**ShardedOptimizer.state_kinds, "V": "matrix", "P": "matrix"}
    state_key_renames = {"precond_stat": "V", "precond": "P"}

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = _D.lr,
        betas: tuple[float, float] = _D.betas,
        eps: float = _D.eps,
        refresh_interval: int = _D.refresh_interval,
        side: str = _D.side,
        root: str = _D.root,
        ns_steps: int = _D.ns_steps,
        statistic: str = _D.statistic,
        update_rms: float | None = _D.update_rms,
        weight_decay: float = _D.weight_decay,
        **options: Unpack[CommonOptions],
    ):
        self._init_from_config(
            params,
            self.Config.from_arguments(
                type(self).__name__,
                dict(
                    lr=lr,
                    betas=betas,
                    eps=eps,
                    refresh_interval=refresh_interval,
                    side=side,
                    root=root,
                    ns_steps=ns_steps,
                    statistic=statistic,
                    update_rms=update_rms,
                    weight_decay=weight_decay,
                ),
                options,
            ),
        )

    whole_matrix_work = True

    def whole_matrix_transpose(self, group: dict, shape: tuple[int, int]) -> bool:
        return asgo_left(shape, group["side"])

    def whole_matrix_cost(self, group: dict, a_shape: tuple[int, int], parts: int = 1) -> OpCost:
        return _asgo_cost(
            a_shape,
            1 if group["statistic"] == "momentum" else 2,
            group["ns_steps"] if group["root"] == "newton_schulz" else None,
            group["update_rms"] is not None,
            group["root"] == "auto" and group["eps"] > 0 and self.iterative_routes(group),
            group["refresh_interval"],
        )

    def matrix_state_spec(self, group: dict, a_shape: tuple[int, int]) -> dict:
        k = a_shape[1]
        return {"V": ((k, k), 1), "P": ((k, k), 1)}

    def _step_asgo(self, group: dict) -> None:
        b1, b2 = group["betas"]
        tau = group["refresh_interval"]
        steps = self._update_momentum(group, b1, counts=tau > 1)  # tau = 1: every step refreshes, no read
        if self._all_local_and_small(group):
            with self.whole_matrix_timing():  # nothing sharded: no MatrixOps, whole-matrix stacks as they are
                self._asgo_local(group, steps)
            return
        items = self._matrix_items(group)
        self._run_whole_matrix(group, items, lambda its, ops: self._asgo_bucket(group, its, ops, steps))

    def _all_local_and_small(self, group: dict) -> bool:
        """Whether every matrix of ``group`` is local (not sharded) and below ``BATCH_NUMEL`` elements
        (remembered per grouped plan, which an engine's ``use_layouts`` replaces)."""
        plan = _plan(self, group)
        small = _LOCAL_AND_SMALL.get(plan)
        if small is None:
            small = _LOCAL_AND_SMALL[plan] = bool(plan.layouts) and all(
                lay.group is None and lay.shape[0] * lay.shape[1] < BATCH_NUMEL for lay in plan.layouts
            )
        return small

    def _asgo_local(self, group: dict, steps: dict[int, int] | None) -> None:
        """The step of a group whose matrices are all local (single process, DDP, ZeRO-0): what
        ``_asgo_bucket`` computes under the ``local`` strategy (no collective either way), on the gradient
        stacks of ``grouped_step`` (one per matrix shape, each an orientation of ``A``), applied by
        ``GroupedStep.apply``; no per-matrix blocks, pieces or items."""
        step = grouped_step(self, group)
        blocks, states, plan = step.blocks, step.states, step.plan
        from_momentum = group["statistic"] == "momentum"
        moms = [_local(self.state[p]["exp_avg"]) for p in plan.params]
        has_grad = step.has_grad
        groups, stats, ms, lefts = [], [], [], []
        for g, grads in zip(blocks.groups, step.grads):
            views = blocks.block_views(moms, g, persistent="state")
            m = views[0].unsqueeze(0) if len(views) == 1 else torch.stack(views)
            x = torch.stack(grads) if isinstance(grads, list) else grads
            left = self.a_transpose(group, (g.h, g.w))
            k = g.h if left else g.w
            for i in g.items:
                if "V" not in states[i]:  # as _run_whole_matrix creates them (a local matrix's share is all of it)
                    states[i]["V"] = torch.zeros(k, k, dtype=torch.float32, device=x.device)
                    states[i]["P"] = torch.zeros(k, k, dtype=torch.float32, device=x.device)
            groups.append(list(g.items))
            ms.append(m.mT if left else m)
            stats.append(ms[-1] if from_momentum else (x.mT if left else x))
            lefts.append(left)
        owners = plan.owners
        refresh = self._refresh_rows(group, groups, steps, lambda i: plan.params[owners[i]])
        rtols = self._pinv_rtols(
            group,
            groups,
            stats,
            lambda i: (plan.pairs[i][1].name, plan.params[owners[i]]),  # the fragment's name, as _asgo_bucket's
        )
        products = self._asgo_groups(
            group,
            groups,
            stats,
            ms,
            states,
            has_grad,
            refresh,
            blocks.layouts,
            lambda parts, symmetric=False: parts,
            lambda i: False,
            rtols=rtols,
        )
        flops = sum(
            len(idx) * (c.row_flops + c.small_flops + c.small_matmul)
            for idx, c in ((idx, self.whole_matrix_cost(group, tuple(a.shape[1:]))) for idx, a in zip(groups, stats))
        )
        collective_counter.add_flops("local", flops)  # MatrixOps.account of the local strategy
        step.apply([u.mT if left else u for u, left in zip(products, lefts)], group["lr"], group["weight_decay"])

    def _refresh_rows(
        self, group: dict, groups: list[list[int]], steps: dict[int, int] | None, tensor_of: Callable[[int], Any]
    ) -> list[list[int]]:
        """Per group, the positions of the matrices whose root is recomputed this step (every ``tau`` steps)."""
        if steps is None:
            return [list(range(len(idx))) for idx in groups]
        tau = group["refresh_interval"]
        return [[j for j, i in enumerate(idx) if (steps[id(tensor_of(i))] - 1) % tau == 0] for idx in groups]

    def _asgo_bucket(self, group: dict, items: list, ops: Any, steps: dict[int, int] | None) -> None:
        """One bucket on ``MatrixOps``: the blocks of ``A`` grouped by shape (``_asgo_groups``), the updates
        returned to the engine's layout (``from_blocks``) and applied with foreach kernels."""
        rms = group["update_rms"]
        from_momentum = group["statistic"] == "momentum"
        moms = [self._momentum_piece(it) for it in items]
        blocks = ops.to_blocks([[m] if from_momentum else [it.grad, m] for it, m in zip(items, moms)])
        shapes: dict[tuple, list[int]] = {}  # a graft needs the matrices' sizes: same-size groups then
        for i in range(len(items)):
            if ops.active(i):
                a = blocks[i][0]
                key = (
                    tuple(a.shape),
                    a.dtype,
                    None if rms is None else math.prod(items[i].layout.shape),
                    i if a.numel() >= BATCH_NUMEL else None,
                )  # large blocks: one by one
                shapes.setdefault(key, []).append(i)
        groups = list(shapes.values())
        stats = [stack([blocks[i][0] for i in idx]) for idx in groups]
        ms = stats if from_momentum else [stack([blocks[i][-1] for i in idx]) for idx in groups]
        refresh = self._refresh_rows(group, groups, steps, lambda i: items[i].tensor)
        states = [it.state for it in items]
        rtols = self._pinv_rtols(group, groups, stats, lambda i: (items[i].frag.name, items[i].tensor))
        products = self._asgo_groups(
            group,
            groups,
            stats,
            ms,
            states,
            [it.has_grad for it in items],
            refresh,
            [it.layout for it in items],
            ops.allreduce,
            ops.split,
            ops.compute_once,
            rtols=rtols,
        )
        updates = {i: u for idx, p in zip(groups, products) for i, u in zip(idx, p.unbind(0))}
        pieces = ops.from_blocks([updates.get(i) for i in range(len(items))])
        ops.account()
        apply_items(items, pieces, group["lr"], group["weight_decay"])

    def _pinv_rtols(
        self,
        group: dict,
        groups: list[list[int]],
        stats: list[torch.Tensor],
        named: Callable[[int], tuple[str, torch.Tensor]],
    ) -> list[torch.Tensor] | None:
        """Per group, each matrix's pseudo-inverse cutoff (``eps = 0``) where a gradient arrived in bf16/fp16:
        ``precision.noise_eig_rtol`` of its ``k x k`` statistic; None (``matfun``'s fp32 cutoff, unchanged) where
        ``eps > 0`` or every gradient arrived in fp32. ``named(i)``: matrix ``i``'s name and tensor; ``stats[g]``:
        group ``g``'s ``(B, rows, k)`` blocks."""
        if group["eps"] != 0:
            return None
        dtypes = [[arrival_dtype(self, *named(i)) for i in idx] for idx in groups]
        if not any(d in LOW_PRECISION for ds in dtypes for d in ds):
            return None
        return [
            torch.tensor([noise_eig_rtol(d, a.shape[-1], a.shape[-1] * 1.2e-7) for d in ds], dtype=torch.float64)
            for ds, a in zip(dtypes, stats)
        ]

    def _asgo_groups(
        self,
        group: dict,
        groups: list[list[int]],
        stats: list[torch.Tensor],
        ms: list[torch.Tensor],
        states: list[dict],
        has_grad: list[bool],
        refresh: list[list[int]],
        layouts: list,
        allreduce: Callable[..., dict],
        distributed: Callable[[int], bool],
        compute_once: Callable[..., Any] | None = None,
        rtols: list[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """The updates ``M_A P`` of blocks of ``A`` grouped by shape: ``stats[g]`` and ``ms[g]`` are ``(B, rows,
        k)`` stacks of the statistic's and the momentum's blocks of the matrices ``groups[g]`` (indices into
        ``states``, ``has_grad``, ``layouts``). Per group one Gram kernel, one state EMA, one product; the roots
        are one ``inverse_root`` call per ``k``. A group of one matrix runs exactly the per-matrix products (on
        ``stats[g][0]``, the block as it is). ``allreduce`` completes partial sums of the matrices for which
        ``distributed(i)`` holds (one call for the Grams, one for a graft's norms); ``compute_once``
        (``MatrixOps.compute_once``) has each distributed matrix's root computed by one rank and shared."""
        b2 = group["betas"][1]
        rms = group["update_rms"]
        grams = [(a[0].T @ a[0]).unsqueeze(0) if len(idx) == 1 else a.mT @ a for idx, a in zip(groups, stats)]
        spread = {i: g[j] for idx, g in zip(groups, grams) for j, i in enumerate(idx) if distributed(i)}
        if spread:  # the partial Grams of distributed matrices, completed in one all-reduce per process group
            reduced = allreduce(spread, symmetric=True)
            grams = [
                torch.stack([reduced[i] for i in idx]) if any(i in reduced for i in idx) else g
                for idx, g in zip(groups, grams)
            ]
        vstacks = []
        for idx, g in zip(groups, grams):
            vs = [states[i]["V"] for i in idx]
            with_grad = [j for j, i in enumerate(idx) if has_grad[i]]
            if len(with_grad) == len(idx):
                v = stack(vs)  # one matrix: a view of its V, updated in place
                v.mul_(b2).add_(g, alpha=1 - b2)
                if len(vs) > 1:
                    torch._foreach_copy_(vs, list(v.unbind(0)))
            else:
                if with_grad:
                    torch._foreach_mul_([vs[j] for j in with_grad], b2)
                    torch._foreach_add_([vs[j] for j in with_grad], [g[j] for j in with_grad], alpha=1 - b2)
                v = stack(vs)
            vstacks.append(v)
        if compute_once is not None and any(distributed(idx[j]) for idx, rows in zip(groups, refresh) for j in rows):
            roots = self._roots_once(group, groups, vstacks, refresh, compute_once, rtols)
        else:
            roots = self._roots(group, vstacks, refresh, rtols)
        products = []
        for idx, m, root, rows in zip(groups, ms, roots, refresh):
            ps = [states[i]["P"] for i in idx]
            if len(rows) == len(idx):
                assert root is not None  # every matrix refreshed
                torch._foreach_copy_(ps, list(root.unbind(0)))
                p = root
            else:
                if rows:
                    assert root is not None
                    torch._foreach_copy_([ps[j] for j in rows], list(root.unbind(0)))
                p = stack(ps)
            products.append((m[0] @ ps[0]).unsqueeze(0) if len(idx) == 1 else m @ p)
        if rms is not None:  # graft_to_rms: the squared norms of the whole matrices, all in one all-reduce
            norms = allreduce(
                {
                    i: n.reshape(1)
                    for idx, u in zip(groups, products)
                    for i, n in zip(idx, [(u[0] * u[0]).sum()] if len(idx) == 1 else (u * u).sum((1, 2)).unbind(0))
                }
            )
            products = [
                graft_to_rms(u, torch.cat([norms[i] for i in idx])[:, None, None], rms, layouts[idx[0]].shape)
                for idx, u in zip(groups, products)
            ]
        return products

    def _roots_once(
        self,
        group: dict,
        groups: list[list[int]],
        vstacks: list[torch.Tensor],
        refresh: list[list[int]],
        compute_once: Callable[..., Any],
        rtols: list[torch.Tensor] | None = None,
    ) -> list[torch.Tensor | None]:
        """``_roots`` with each root computed on one rank (``compute_once``): a distributed matrix's by its
        factorization owner, shared by one all-reduce; the others' (owned, local) here, batched as before."""
        where = {idx[j]: (g, j) for g, (idx, rows) in enumerate(zip(groups, refresh)) for j in rows}

        def compute(mine: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
            rows = [[j for j in refresh[g] if groups[g][j] in mine] for g in range(len(groups))]
            roots = self._roots(group, vstacks, rows, rtols)
            return {
                groups[g][j]: r[t]
                for g, (rs, r) in enumerate(zip(rows, roots))
                if rs and r is not None  # a group with rows to refresh has its roots
                for t, j in enumerate(rs)
            }

        def split(mine: dict[int, torch.Tensor], rows: Any) -> dict[int, torch.Tensor]:  # a team splits its roots
            out: dict[int, torch.Tensor] = {}
            for idx in same_shape(mine):
                rtol = None if rtols is None else torch.stack([rtols[where[i][0]][where[i][1]] for i in idx])
                for i, r in zip(
                    idx, _inverse_root_rows(torch.stack([mine[i] for i in idx]), group, rows, rtol).unbind(0)
                ):
                    out[i] = r
            return out

        done = compute_once(
            {i: vstacks[g][j] for i, (g, j) in where.items()},
            compute,
            symmetric=group["root"] != "newton_schulz",
            split=split,
        )
        return [torch.stack([done[idx[j]] for j in rows]) if rows else None for idx, rows in zip(groups, refresh)]

    @staticmethod
    def _roots(
        group: dict, vstacks: list[torch.Tensor], refresh: list[list[int]], rtols: list[torch.Tensor] | None = None
    ) -> list[torch.Tensor | None]:
        """The inverse roots of rows ``refresh[g]`` of each ``vstacks[g]``: one ``inverse_root`` call for all
        stacks of the same ``k`` (its eigh runs per matrix, so grouping does not change a result); ``rtols``:
        per group, each matrix's pseudo-inverse cutoff (``_pinv_rtols``)."""
        by_k: dict[tuple, list[int]] = {}
        for g, (v, rows) in enumerate(zip(vstacks, refresh)):
            if rows:
                by_k.setdefault((v.shape[-1], v.dtype, v.device), []).append(g)
        out: list[torch.Tensor | None] = [None] * len(vstacks)
        for gs in by_k.values():
            parts = [vstacks[g] if len(refresh[g]) == len(vstacks[g]) else vstacks[g][refresh[g]] for g in gs]
            rtol = None if rtols is None else torch.cat([rtols[g][refresh[g]] for g in gs])
            res = inverse_root(
                parts[0] if len(parts) == 1 else torch.cat(parts),
                group["eps"],
                group["root"],
                group["ns_steps"],
                rtol=rtol,
            )
            for g, r in zip(gs, res.split([len(p) for p in parts])):
                out[g] = r
        return out


def _inverse_root_rows(v: torch.Tensor, group: dict, rows: Any, rtol: torch.Tensor | None = None) -> torch.Tensor:
    """``matfun.inverse_root`` of a ``(B, k, k)`` stack on a team whose members split its products (issue 53):
    on the iterative route the checked float64 iteration by row blocks (``iterative.inverse_sqrt_checked_rows``),
    the matrices it cannot settle by ``eigh`` on every member; other routes run whole on every member."""
    eps = group["eps"]
    if not (group["root"] == "auto" and eps > 0 and v.numel() and iterative_device(v.device)):
        return inverse_root(v, eps, group["root"], group["ns_steps"], rtol=rtol)
    k = v.shape[-1]
    vd = v.double()
    a = torch.add(vd, vd.mT).mul_(0.5).add_(torch.eye(k, dtype=torch.float64, device=v.device), alpha=eps)
    root, ok = inverse_sqrt_checked_rows(a, eps, rows)
    bad = ~ok
    if count_fallbacks("inverse_sqrt", bad):
        root[bad] = inverse_root(v[bad], eps, "eigh").double()
    return root.float()


class DASGO(_MomentumMixin, ShardedOptimizer):
    """DASGO (``treatment="dasgo"``). Keys: ``lr`` (0.01), ``betas`` (0.9, 0.99), ``eps`` (1e-6), ``weight_decay``
    (0). State per matrix: ``exp_avg`` (M, m x n) and ``v`` (EMA column energy, n)."""

    Config = DASGOConfig
    matrix_treatments = ("dasgo",)
    state_kinds = {**ShardedOptimizer.state_kinds, "v": "cols"}
    state_key_renames = {"col_stat": "v"}

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = _DD.lr,
        betas: tuple[float, float] = _DD.betas,
        eps: float = _DD.eps,
        weight_decay: float = _DD.weight_decay,
        **options: Unpack[CommonOptions],
    ):
        self._init_from_config(
            params,
            self.Config.from_arguments(
                type(self).__name__, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay), options
            ),
        )

    def vector_state(self, group: dict, shape: tuple[int, int]) -> int:
        return logical_2d(shape, group)[1] if group.get("treatment", "adamw") != "adamw" else 0

    def skips_on_device(self, group: dict) -> bool:
        """DASGO gates every write (``_step_dasgo``): the momentum's EMA skipped by its kernel
        (``nonfinite.skippable_lerp_``), ``v``'s decay 1 and its new energy 0, a column scale of 0 and a decay
        factor of 1."""
        return group.get("treatment") == "dasgo" or super().skips_on_device(group)

    def _one_pass_momentum(self, group: dict) -> bool:
        """Whether DASGO's EMA can run inside its column-energy pass: a CPU step of whole matrices (each stepped
        tensor one matrix, so the blocks cover every element the EMA writes), every gradient present and fp32."""
        plan = _plan(self, group)
        return (
            plan.whole_matrices
            and plan.blocks.device.type == "cpu"
            and all(p.grad is not None and p.grad.dtype == torch.float32 for p in plan.params)
        )

    def _step_dasgo(self, group: dict) -> None:
        b1, b2 = group["betas"]
        gate = self._step_gate  # None, or 0-d 1./0.: the step's skip decided on the device (nonfinite.gate_step)
        rows, cols = logical_axes(group)  # the logical columns are the stored rows of a weight stored in x out
        fused = cols == 1 and gate is None and self._step_found_inf is None and self._one_pass_momentum(group)
        self._update_momentum(group, b1, counts=False, lerp=not fused)
        step = grouped_step(self, group)
        blocks = step.blocks
        rnd = Round()
        moms = [_local(self.state[p]["exp_avg"]) for p in step.plan.params]
        momentum = [
            blocks.block_views(moms, g, persistent="state") for g in blocks.groups
        ]  # the momentum's blocks, not a copy
        if fused:  # the EMA and the column energies in one read of G (row_passes)
            sums = lerp_col_energies(blocks, momentum, step.grads, 1 - b1)
        else:
            sums = line_sums(blocks, cols, step.grads, square=True)
        blocks.add_axis(rnd, sums, cols)
        rnd.run()
        decay = b2
        if gate is not None:  # a skipped step adds no energy (its sums may be inf or NaN) and decays by 1
            sums, decay = gated(gate, sums, 0.0), gated(gate, b2, 1.0)
        mstates = step.states
        for st, lay in zip(mstates, step.layouts):
            if "v" not in st:  # per logical column (input unit)
                st["v"] = sums.new_zeros(lay.shape[cols])
        vs = [st["v"] for st in mstates]
        v = torch.cat(vs, out=blocks.line_buffer("v", cols)) if vs else sums
        if step.all_have_grad:  # the EMA on the concatenation, written back with one foreach copy
            if vs:
                v.mul_(decay).add_(sums, alpha=1 - b2)
                torch._foreach_copy_(vs, blocks.segments(v, cols))
        else:
            with_grad_items = [k for k, ok in enumerate(step.has_grad) if ok]
            if with_grad_items:
                parts = blocks.segments(sums, cols)
                torch._foreach_mul_([vs[k] for k in with_grad_items], decay)
                torch._foreach_add_([vs[k] for k in with_grad_items], [parts[k] for k in with_grad_items], alpha=1 - b2)
                v = torch.cat(vs)
        col_scale = masked_rsqrt(v + group["eps"], out=blocks.line_buffer("col_scale", cols))
        if gate is not None:
            col_scale.mul_(gate)  # a skipped step adds 0 x (finite) momentum
        scale = {"col_scale": col_scale} if cols == 1 else {"row_scale": col_scale}
        step.apply_scaled(momentum, group["lr"], group["weight_decay"], **scale)
