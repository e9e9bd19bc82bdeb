"""Debug check that every rank is about to issue the same collectives.

A step's collectives are a pure function of the step plan: the groups, their treatments, and for every
matrix its name, shape and split indices. If ranks disagree (different models, routing or engine settings)
they would hang in mismatched collectives; this check turns that into an error naming the first difference.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

__all__ = ["step_plan", "check_same_plan"]


def _split_size(split: Any, size: int) -> int:
    if split is None:
        return 0
    if isinstance(split, slice):
        return size
    return int(split.numel())


def step_plan(opt: Any) -> list[str]:
    """One line per group and matrix, identical on every rank that will issue the same collectives."""
    lines = []
    for gi, group in enumerate(opt.param_groups):
        lines.append(f"group {gi}: treatment={group['treatment']} tensors={len(group['params'])}")
        if group["treatment"] == "adamw":
            continue
        for p in group["params"]:
            for frag in opt.fragments(p):
                lay = frag.layout
                m, n = lay.shape
                lines.append(
                    f"group {gi} matrix {frag.name!r}: shape=({m}, {n}) world={lay.world} "
                    f"row_split={_split_size(lay.axis_plan(0).split, m)} "
                    f"col_split={_split_size(lay.axis_plan(1).split, n)}"
                )
    return lines


def check_same_plan(opt: Any) -> None:
    """Raise ``RuntimeError`` naming the first line where this rank's plan differs from rank 0's."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    plan = step_plan(opt)
    digest = int.from_bytes(hashlib.sha256("\n".join(plan).encode()).digest()[:7], "little")
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    lo = torch.tensor([digest], dtype=torch.int64, device=device)
    hi = lo.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    if lo.item() == hi.item():
        return
    plans: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(plans, plan)
    ref = plans[0]
    for rank, other in enumerate(plans):
        for i in range(max(len(ref), len(other))):
            a = ref[i] if i < len(ref) else "<nothing>"
            b = other[i] if i < len(other) else "<nothing>"
            if a != b:
                raise RuntimeError(
                    f"shardopt step plans differ between ranks (this would hang): rank 0 has "
                    f"{a!r} where rank {rank} has {b!r}"
                )
    raise RuntimeError("shardopt step plans differ between ranks")
