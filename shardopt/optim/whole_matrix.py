"""Whole-matrix work of a param group, bucket by bucket (``MatrixOps.buckets``): each bucket's small state of
split matrices is gathered whole for the step and cut back to this rank's share after it, so a rank holds whole
state only for one bucket at a time.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..sharding.matrix_ops import MatrixOps
from ..sharding.state_split import StateSpec, gather_full, keep_share, rows_aligned, share_shape
from .items import MatrixItem

__all__ = ["run_buckets"]


def run_buckets(
    opt: Any, group: dict, items: list[MatrixItem], body: Callable[[list[MatrixItem], MatrixOps], None]
) -> None:
    """Run ``body(items, ops)`` for ``opt`` (a ``ShardedOptimizer``) bucket by bucket: the small state of each
    bucket's distributed matrices is gathered whole for the step (one all-gather per group, on every step, the
    first included: the state is created from ``matrix_state_spec`` as zeros before it) and cut back to this
    rank's share after it; ``ROWS`` state is not: the body reads and writes this rank's rows of it in place."""
    plan = opt.matrix_plan(opt._group_index(group))
    if plan is None or not items:
        return
    positions = plan.positions
    order = [positions[it.frag.name] for it in items]
    ops = plan if order == list(range(len(plan))) else plan.subset(order)
    for idx in ops.buckets(opt.matrix_bucket_elements):
        sub, its = ops.subset(idx), [items[i] for i in idx]
        by_shape: dict[tuple[int, int], StateSpec] = {}
        specs = [
            by_shape[p.a_shape]
            if p.a_shape in by_shape
            else by_shape.setdefault(p.a_shape, opt.matrix_state_spec(group, p.a_shape))
            for p in sub.plans
        ]
        entries, where = [], []
        for i, (it, spec) in enumerate(zip(its, specs)):
            for key, (shape, dim) in spec.items():  # state starts as zeros, created here from its spec
                if key not in it.state:
                    it.state[key] = torch.zeros(
                        share_shape(sub.placements[i], shape, dim), dtype=torch.float32, device=it.grad.device
                    )
            if not (sub.split(i) and sub.active(i)):
                continue  # owner / local: the computing rank already holds all of it; a team's others none
            for key in sorted(spec):
                shape, dim = spec[key]
                if dim is not None and not rows_aligned(dim):  # ROWS state already is this rank's rows
                    entries.append((sub.placements[i], it.state[key], shape, dim, it.frag.name))
                    where.append((it, key))
        for (it, key), full in zip(where, gather_full(entries)):
            it.state[key] = full
        if sub.all_here:
            body(its, sub)
        else:  # matrices this rank holds whole (ZeRO) take the stacked paths, those held elsewhere are skipped
            for part in sub.here_and_shared():
                if part:
                    body([its[j] for j in part], sub.subset(part))
        for i, (it, spec) in enumerate(zip(its, specs)):
            if not (sub.split(i) and sub.active(i)):
                continue  # the state already is this rank's share (all of it, or none)
            for key, (_shape, dim) in spec.items():
                if dim is not None and not rows_aligned(dim) and key in it.state:
                    it.state[key] = keep_share(sub.placements[i], it.state[key], dim)
