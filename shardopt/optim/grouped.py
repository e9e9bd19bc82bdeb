"""A param group's matrices as one grouped step (``shardopt.sharding.grouped``), for the step drivers.

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

from typing import Callable

import torch

from ..sharding.fragment import Fragment, local_flat
from ..sharding.grouped import BlockGroups

__all__ = ["GroupedStep", "grouped_step"]


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


class _Plan:
    """The static part: stepped tensors, their fragments, and the block groups of those fragments."""

    def __init__(self, opt, params: list[torch.Tensor], frags: list[list[Fragment]], device: torch.device):
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


def _plan(opt, group: dict) -> _Plan:
    cache = opt.__dict__.setdefault("_grouped_plans", {})
    params = list(group["params"])
    key = tuple(map(id, params))
    frags = [opt.fragments(p) for p in params]
    plan = cache.get(key)
    if plan is None or any(a is not b for a, b in zip(plan.params, params)) or \
            any(a is not b for a, b in zip(plan.frags, frags)):
        device = local_flat(params[0]).device if params else torch.device("cpu")
        plan = cache[key] = _Plan(opt, params, frags, device)
    return plan


class GroupedStep:
    """One step of a param group's matrices, grouped by block shape.

    ``blocks``: the ``BlockGroups``; ``grads``: per group a ``(B, h, w)`` fp32 stack of the local gradients (or of
    ``source(p, grad)``; zeros for a tensor without a gradient); ``states``: per matrix its state dict;
    ``has_grad``: per matrix; ``layouts``: per matrix.
    """

    def __init__(self, opt, group: dict, source: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None):
        plan = _plan(opt, group)
        self.plan = plan
        self.blocks = plan.blocks
        params = plan.params
        grads = [p.grad for p in params]
        self.tensor_has_grad = [g is not None for g in grads]
        if source is not None:
            grads = [None if g is None else source(p, g) for p, g in zip(params, grads)]
        self.locals = [_local(p) for p in params]
        self.grads = self.blocks.stack([None if g is None else _local(g) for g in grads])
        self.all_have_grad = all(self.tensor_has_grad)
        self._opt = opt

    @property
    def has_grad(self) -> list[bool]:
        """Per matrix: whether its stepped tensor has a gradient."""
        return [self.tensor_has_grad[t] for t in self.plan.owners]

    @property
    def states(self) -> list[dict]:
        """Per matrix: its state dict (``ShardedOptimizer.matrix_state``)."""
        if "_states" not in self.__dict__:
            self.__dict__["_states"] = [self._opt.matrix_state(p, f) for p, f in self.plan.pairs]
        return self.__dict__["_states"]

    @property
    def layouts(self) -> list:
        return self.plan.layouts

    @property
    def frags(self) -> list[Fragment]:
        return [f for _, f in self.plan.pairs]

    def _targets(self, g, update: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The parameter views of group ``g``'s blocks that get an update (matrices with a gradient), and
        the matching rows of ``update``."""
        views = self.blocks.block_views(self.locals, g)
        if self.all_have_grad:
            return views, update
        keep = [self.tensor_has_grad[self.blocks.owners[i]] for i in g.items]
        idx = [k for k, ok in enumerate(keep) if ok]
        if len(idx) == len(keep):
            return views, update
        if not idx:
            return [], update[:0]
        return [views[k] for k in idx], update[torch.tensor(idx, dtype=torch.int64, device=update.device)]

    def apply(self, updates: list[torch.Tensor], lr: float | torch.Tensor, weight_decay: float = 0.0) -> None:
        """``W <- W (1 - lr wd) - lr U`` on every block (``MatrixItem.apply``); ``lr`` a float or one value per
        matrix (a vector over the matrices)."""
        for g, u in zip(self.blocks.groups, updates):
            if not g.items:
                continue
            lr_b = lr[g.item_tensor] if isinstance(lr, torch.Tensor) else None
            views, u = self._targets(g, u)
            if not views:
                continue
            if lr_b is not None and u.shape[0] != lr_b.shape[0]:
                keep = [k for k, i in enumerate(g.items) if self.tensor_has_grad[self.blocks.owners[i]]]
                lr_b = lr_b[torch.tensor(keep, dtype=torch.int64, device=lr_b.device)]
            if isinstance(lr, torch.Tensor):
                if weight_decay:
                    torch._foreach_mul_(views, list((1 - lr_b * weight_decay).unbind(0)))
                u = u * lr_b[:, None, None]
                torch._foreach_sub_(views, self._cast(u, views))
            else:
                if weight_decay:
                    torch._foreach_mul_(views, 1 - lr * weight_decay)
                torch._foreach_add_(views, self._cast(u, views), alpha=-lr)

    def apply_scaled(self, xs: list[torch.Tensor], lr: float, weight_decay: float = 0.0,
                     row_scale: torch.Tensor | None = None, col_scale: torch.Tensor | None = None) -> None:
        """``W <- W (1 - lr wd) - lr diag(row_scale) X diag(col_scale)`` (``MatrixItem.apply_scaled``): one fused
        multiply-add per block for fp32 parameters, without materializing the update."""
        blocks = self.blocks
        for g, x in zip(blocks.groups, xs):
            if not g.items:
                continue
            views, x = self._targets(g, x)
            if not views:
                continue
            fp32 = all(v.dtype == torch.float32 for v in views)
            if not fp32 or (row_scale is not None and col_scale is not None):
                u = x
                if row_scale is not None:
                    u = u * self._lines(g, row_scale, 0, x.shape[0])
                if col_scale is not None:
                    u = u * self._lines(g, col_scale, 1, x.shape[0])
                if weight_decay:
                    torch._foreach_mul_(views, 1 - lr * weight_decay)
                torch._foreach_add_(views, self._cast(u, views), alpha=-lr)
                continue
            if weight_decay:
                torch._foreach_mul_(views, 1 - lr * weight_decay)
            if row_scale is not None:
                torch._foreach_addcmul_(views, list(x.unbind(0)), list(self._lines(g, row_scale, 0, x.shape[0]).unbind(0)),
                                        value=-lr)
            elif col_scale is not None:
                torch._foreach_addcmul_(views, list(x.unbind(0)), list(self._lines(g, col_scale, 1, x.shape[0]).unbind(0)),
                                        value=-lr)
            else:
                torch._foreach_add_(views, list(x.unbind(0)), alpha=-lr)

    def _lines(self, g, vector: torch.Tensor, axis: int, count: int) -> torch.Tensor:
        """``vector``'s values on group ``g``'s blocks, broadcastable against a ``(B, h, w)`` stack."""
        index = g.row_index if axis == 0 else g.col_index
        if count != index.shape[0]:  # blocks without a gradient were left out
            keep = [k for k, i in enumerate(g.items) if self.tensor_has_grad[self.blocks.owners[i]]]
            index = index[torch.tensor(keep, dtype=torch.int64, device=index.device)]
        v = vector[index]
        return v.unsqueeze(2) if axis == 0 else v.unsqueeze(1)

    @staticmethod
    def _cast(u: torch.Tensor, views: list[torch.Tensor]) -> list[torch.Tensor]:
        if all(v.dtype == u.dtype for v in views):
            return list(u.unbind(0))
        return [ub.to(v.dtype) for ub, v in zip(u.unbind(0), views)]


def grouped_step(opt, group: dict, source: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> GroupedStep:
    """The matrices of ``group`` for one step, grouped (see the module docstring)."""
    return GroupedStep(opt, group, source)
