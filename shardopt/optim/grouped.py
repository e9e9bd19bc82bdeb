"""A param group's matrices as one grouped step (``shardopt.sharding.block_groups``), for the step drivers.

``grouped_step(opt, group)`` lists the same matrices as ``ShardedOptimizer._matrix_items``, in the same order,
but hands a driver their gradients as ``(B, h, w)`` stacks per block shape, their state dicts, and an
``apply`` that updates every block of the group with ``torch._foreach_*`` kernels, so a step issues a number of
ops that depends on the number of block shapes, not of matrices. The static part (fragments, block groups,
index tensors, split indices) is built once per param group and layout and cached on the optimizer.

What takes which path: every engine's pieces are blocks (whole matrices, FSDP2 row or column shards, ZeRO
flat pieces with partial head and tail rows), and every block is grouped by its shape; there is no
per-matrix remainder path. Only CPU blocks of at least ``CPU_BLOCK_LIMIT`` elements loop over the blocks of
their group for weighted sums (the per-block kernel is faster there and the loop's overhead negligible).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from ..sharding.block_groups import BlockGroups, blocks_of
from ..sharding.fragment import Fragment, local_flat
from ..sharding.fragment import local_tensor as _local
from ..sharding.row_passes import row_normalized_update, scaled_update
from .nonfinite import gated, zero_nonfinite

if TYPE_CHECKING:
    from ..sharding.block_groups import Group
    from .base import ShardedOptimizer

__all__ = ["GroupedStep", "grouped_step"]


class _Plan:
    """The static part: stepped tensors, their fragments, and the block groups of those fragments."""

    def __init__(
        self, opt: ShardedOptimizer, params: list[torch.Tensor], frags: list[list[Fragment]], device: torch.device
    ):
        self.params = params
        self.frags = frags
        pairs, owners, offsets, whole = [], [], [], []
        for t, (p, fs) in enumerate(zip(params, frags)):
            single = len(fs) == 1 and fs[0].offset == 0 and fs[0].numel == local_flat(p).numel()
            for f in fs:
                pairs.append((p, f))
                owners.append(t)
                offsets.append(f.offset)
                whole.append(single)
        self.pairs = pairs
        self.owners = owners
        self.layouts = [f.layout for _, f in pairs]
        self.blocks = BlockGroups([f.layout for _, f in pairs], device, owners=owners, offsets=offsets, whole=whole)
        self.state_made_for: object = None  # the optimizer state object whose matrix entries were last made
        #: no DTensor among the tensors: their local elements are the tensors (and their gradients) themselves
        self.plain = not any(hasattr(p, "to_local") for p in params)
        #: every tensor is one whole matrix of its own shape (one process, DDP): a matrix is its tensor
        self.whole_matrices = self.plain and all(
            len(fs) == 1 and tuple(p.shape) == fs[0].layout.shape and fs[0].layout.local_numel == p.numel()
            for p, fs in zip(params, frags)
        )


def _plan(opt: ShardedOptimizer, group: dict) -> _Plan:
    """The cached static part for ``group``'s tensors. ``use_layouts`` (an engine attaching other fragments)
    drops the cache (``ShardedOptimizer._forget_plans``), so a hit needs only the same tensors."""
    cache = opt.__dict__.setdefault("_grouped_plans", {})
    params = list(group["params"])
    key = tuple(map(id, params))
    plan = cache.get(key)
    if plan is None or any(a is not b for a, b in zip(plan.params, params)):
        frags = [opt.fragments(p) for p in params]
        device = local_flat(params[0]).device if params else torch.device("cpu")
        if len(cache) >= 64:  # engines that hand new tensors each step must not grow it without bound
            cache.clear()
        plan = cache[key] = _Plan(opt, params, frags, device)
    return plan


class GroupedStep:
    """One step of a param group's matrices, grouped by block shape.

    ``blocks``: the ``BlockGroups``; ``grads``: per group a ``(B, h, w)`` fp32 stack of the local gradients (or of
    ``source(p, grad)``; zeros for a tensor without a gradient); ``states``: per matrix its state dict;
    ``has_grad``: per matrix; ``layouts``: per matrix.
    """

    _states: list[dict] | None = None

    def __init__(
        self,
        opt: ShardedOptimizer,
        group: dict,
        source: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ):
        plan = _plan(opt, group)
        self.plan = plan
        self.blocks = plan.blocks
        params = plan.params
        grads = [p.grad for p in params]
        self.tensor_has_grad = [g is not None for g in grads]
        if source is not None:
            grads = [None if g is None else source(p, g) for p, g in zip(params, grads)]
        if plan.plain:
            self.locals = params
            self.grads = self.blocks.stack(grads)
        else:
            self.locals = [_local(p) for p in params]
            self.grads = self.blocks.stack([None if g is None else _local(g) for g in grads])
        self.all_have_grad = all(self.tensor_has_grad)
        self._opt = opt
        # every matrix's state dict exists after a step, also where its rule keeps nothing (as _matrix_items
        # made them): state_dict() and engines' consolidation list every stepped tensor. Made once per state
        # object (load_state_dict replaces it); a rule that reads them asks for ``states``.
        if plan.state_made_for is not opt.state:
            _ = self.states  # the property makes them
            plan.state_made_for = opt.state

    @property
    def states(self) -> list[dict]:
        """Per matrix its state dict (created where missing)."""
        if self._states is None:
            self._states = [self._opt.matrix_state(p, f) for p, f in self.plan.pairs]
        return self._states

    @property
    def has_grad(self) -> list[bool]:
        """Per matrix: whether its stepped tensor has a gradient."""
        return [self.tensor_has_grad[t] for t in self.plan.owners]

    @property
    def layouts(self) -> list:
        return self.plan.layouts

    @property
    def frags(self) -> list[Fragment]:
        return [f for _, f in self.plan.pairs]

    def _keep(self, g: Group) -> list[int] | None:
        """Positions of group ``g``'s blocks whose matrices get an update (None: all of them)."""
        if self.all_have_grad:
            return None
        keep = [k for k, i in enumerate(g.items) if self.tensor_has_grad[self.blocks.owners[i]]]
        return None if len(keep) == len(g.items) else keep

    @staticmethod
    def _pick(x: Any, keep: list[int] | None, device: torch.device) -> Any:
        """Rows ``keep`` of a stack (or entries of a block list, or of a per-block vector)."""
        if keep is None:
            return x
        if isinstance(x, list):
            return [x[k] for k in keep]
        return x[torch.tensor(keep, dtype=torch.int64, device=device)]

    def apply(
        self, updates: list, lr: float | torch.Tensor, weight_decay: float = 0.0, lr_in_updates: bool = False
    ) -> None:
        """``W <- W (1 - lr wd) - lr U`` on every block (``MatrixItem.apply``); ``lr`` a float or one value per
        matrix (a vector over the matrices). ``lr_in_updates``: ``U`` already carries each matrix's ``lr`` (folded
        into a scale that made it), so only the decay uses ``lr`` and no scaled copy of ``U`` is written."""
        dev = self.blocks.device
        for g, u in zip(self.blocks.groups, updates):
            keep = self._keep(g)
            if keep is not None and not keep:
                continue
            views = self._pick(self.blocks.block_views(self.locals, g, persistent="param"), keep, dev)
            u = self._pick(u, keep, dev)
            if isinstance(lr, torch.Tensor):
                lr_b = self._pick(lr[g.item_tensor], keep, dev)
                if weight_decay:
                    torch._foreach_mul_(views, list((1 - lr_b * weight_decay).unbind(0)))
                if lr_in_updates:
                    scaled = blocks_of(u)
                elif isinstance(u, list):
                    scaled = [ub * lb for ub, lb in zip(u, lr_b.unbind(0))]
                else:
                    scaled = list((u * lr_b[:, None, None]).unbind(0))
                torch._foreach_sub_(views, self._cast(scaled, views))
            else:
                if weight_decay:
                    torch._foreach_mul_(views, self._decay(lr, weight_decay))
                torch._foreach_add_(views, self._cast(blocks_of(u), views), alpha=-lr)

    def apply_scaled(
        self,
        xs: list,
        lr: float,
        weight_decay: float = 0.0,
        row_scale: torch.Tensor | None = None,
        col_scale: torch.Tensor | None = None,
    ) -> None:
        """``W <- W (1 - lr wd) - lr diag(row_scale) X diag(col_scale)`` (``MatrixItem.apply_scaled``): one fused
        multiply-add per block for fp32 parameters, without materializing the update."""
        dev = self.blocks.device
        if self._scales_whole_fp32(row_scale, col_scale):
            self._apply_scaled_whole(xs, lr, weight_decay, row_scale, col_scale)
            return
        # every group's blocks into one list per kernel: a step issues each foreach kernel once, not per shape
        all_views: list[torch.Tensor] = []
        fused: list[torch.Tensor] = []
        fused_x: list[torch.Tensor] = []
        fused_s: list[torch.Tensor] = []
        plain: list[torch.Tensor] = []
        plain_u: list[torch.Tensor] = []
        for g, x in zip(self.blocks.groups, xs):
            keep = self._keep(g)
            if keep is not None and not keep:
                continue
            views = self._pick(self.blocks.block_views(self.locals, g, persistent="param"), keep, dev)
            x = blocks_of(self._pick(x, keep, dev))
            r = None if row_scale is None else blocks_of(self._pick(row_scale[g.row_index].unsqueeze(2), keep, dev))
            c = None if col_scale is None else blocks_of(self._pick(col_scale[g.col_index].unsqueeze(1), keep, dev))
            all_views += views
            if any(v.dtype != torch.float32 for v in views) or (r is not None and c is not None):
                u: list[torch.Tensor] | tuple[torch.Tensor, ...] = x
                if r is not None:
                    u = torch._foreach_mul(u, r)
                if c is not None:
                    u = torch._foreach_mul(u, c)
                plain += views
                plain_u += self._cast(u, views)
            elif r is not None or c is not None:
                fused += views
                fused_x += x
                fused_s += r if r is not None else c  # type: ignore[arg-type]  # one of them is set here
            else:
                plain += views
                plain_u += x
        if weight_decay and all_views:
            torch._foreach_mul_(all_views, self._decay(lr, weight_decay))
        if fused:
            torch._foreach_addcmul_(fused, fused_x, fused_s, value=-lr)
        if plain:
            torch._foreach_add_(plain, plain_u, alpha=-lr)

    def apply_row_blocked(
        self, xs: list, row_scale: torch.Tensor, col_scale: torch.Tensor, decay: float | torch.Tensor | None
    ) -> bool:
        """``W <- W decay - diag(row_scale) X diag(col_scale)`` on a CPU, a few rows of each block at a time
        (``row_passes.scaled_update``: no update materialized, one pass); ``row_scale`` carries the lr, ``decay``
        is a factor, one per matrix, or None. False (nothing done) unless every matrix has a gradient and every
        parameter is fp32 on a CPU: the caller then takes ``apply``."""
        if not self.all_have_grad or self.blocks.device.type != "cpu":
            return False
        views = [self.blocks.block_views(self.locals, g, persistent="param") for g in self.blocks.groups]
        if any(v.dtype != torch.float32 for vs in views for v in vs):
            return False
        scaled_update(self.blocks, views, xs, row_scale, col_scale, decay)
        return True

    def apply_row_normalized(
        self, xs: list, row_scale: Callable[[torch.Tensor, slice], torch.Tensor], lr: float, weight_decay: float
    ) -> bool:
        """``W <- W (1 - lr wd) - lr diag(row_scale(rowsumsq(X), rows)) X`` with the row statistic and the update
        in one read of each row block (``row_passes.row_normalized_update``), where every row is whole on this
        rank, on a CPU, every matrix with a gradient and fp32. False (nothing done) otherwise."""
        from ..sharding.row_passes import rows_complete

        if not self.all_have_grad or not rows_complete(self.blocks):
            return False
        views = [self.blocks.block_views(self.locals, g, persistent="param") for g in self.blocks.groups]
        if any(v.dtype != torch.float32 for vs in views for v in vs):
            return False
        decay = self._decay(lr, weight_decay) if weight_decay else None
        row_normalized_update(self.blocks, views, xs, row_scale, lr, decay)
        return True

    def _scales_whole_fp32(self, row_scale: torch.Tensor | None, col_scale: torch.Tensor | None) -> bool:
        """Whether ``apply_scaled`` can take each matrix's scale as a slice of the concatenated vector: every
        matrix a whole fp32 tensor with a gradient, one scale vector."""
        return (
            self.plan.whole_matrices
            and self.all_have_grad
            and (row_scale is None) != (col_scale is None)
            and all(p.dtype is torch.float32 for p in self.plan.params)
        )

    def _apply_scaled_whole(
        self, xs: list, lr: float, weight_decay: float, row_scale: torch.Tensor | None, col_scale: torch.Tensor | None
    ) -> None:
        """``apply_scaled`` for whole fp32 matrices: the scale of matrix ``i`` is its slice of the concatenated
        vector (``BlockGroups.segments``), so the update is one fused multiply-add kernel over every matrix."""
        blocks = self.blocks
        if col_scale is not None:
            parts = blocks.segments(col_scale, 1)
        else:
            assert row_scale is not None  # _scales_whole_fp32: exactly one of them
            parts = blocks.segments(row_scale, 0, column=True)
        params = self.plan.params
        views, x_all, scales = [], [], []
        for g, x in zip(blocks.groups, xs):
            views += [params[o] for o in g.owners]
            x_all += blocks_of(x)
            scales += [parts[i] for i in g.items]
        if not views:  # no matrix of this group on this rank (e.g. ZeroRedundancyOptimizer's share)
            return
        if weight_decay:
            torch._foreach_mul_(views, self._decay(lr, weight_decay))
        torch._foreach_addcmul_(views, x_all, scales, value=-lr)

    def _decay(self, lr: float, weight_decay: float) -> float | torch.Tensor:
        """The weight-decay factor ``1 - lr wd``; 1 on the device where the step's skip is decided there."""
        factor = 1 - lr * weight_decay
        gate = self._opt._step_gate
        return factor if gate is None else gated(gate, factor, 1.0)

    def sanitize(self) -> None:
        """The gradients' non-finite elements read as 0, for a step whose skip is decided on the device: a skipped
        step multiplies its update by 0, which an inf or NaN would survive. Stacks made for this step are cleaned
        in place, views of the gradients (a group of one block) as copies, so the user's gradients stay as they
        were. A pass over the gradients; it replaces the host's read of the flag (``nonfinite.gate_step``)."""

        def clean(x: torch.Tensor) -> torch.Tensor:
            return zero_nonfinite(x, in_place=x._base is None)  # in place: a stack made by stack() for this step

        self.grads = [[clean(b) for b in x] if isinstance(x, list) else clean(x) for x in self.grads]

    @staticmethod
    def _cast(u: Sequence[torch.Tensor], views: list[torch.Tensor]) -> list[torch.Tensor]:
        if all(v.dtype == ub.dtype for v, ub in zip(views, u)):
            return list(u)
        return [ub.to(v.dtype) for ub, v in zip(u, views)]


def grouped_step(
    opt: ShardedOptimizer, group: dict, source: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
) -> GroupedStep:
    """The matrices of ``group`` for one step, grouped (see the module docstring)."""
    return GroupedStep(opt, group, source)
