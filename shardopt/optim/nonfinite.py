"""The non-finite gradient check before a step: every rank learns whether any rank has a non-finite gradient,
and the step is skipped (or raises) on all of them alike, so no rank runs collectives the others skip.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

from ..sharding.comm import world_group_allreduce_max
from ..sharding.fragment import local_flat, local_tensor

__all__ = ["nonfinite_grads", "fused_check_applies", "FUSED_CHECK_ELEMENTS"]

#: below this many gradient elements a CPU step is launch-bound and the non-finite check takes the fused AMP
#: kernel; above it, l2 norms (read-only: about 20% less time per element). GPUs take a multi-tensor max-abs.
FUSED_CHECK_ELEMENTS = 1 << 22


_FUSED_CHECK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fused_check_applies(grads: list[torch.Tensor], total: int) -> bool:
    """Whether the fused AMP check kernel takes ``grads`` (``total`` elements): on a CPU, small in total, float
    dtypes it supports (its CUDA version refuses bf16, and the GPU path is one multi-tensor kernel already)."""
    if not hasattr(torch, "_amp_foreach_non_finite_check_and_unscale_"):
        return False
    return total < FUSED_CHECK_ELEMENTS and all(g.is_cpu and g.dtype in _FUSED_CHECK_DTYPES for g in grads)


def nonfinite_grads(opt: Any) -> bool:
    """Whether any rank has a non-finite gradient in ``opt``'s step (a ``ShardedOptimizer``; one 1-element all-reduce
    when distributed).

    A healthy step costs one cheap reduction per gradient and a single host sync: on GPUs a fused max-abs
    over all gradients; on CPUs (where that kernel is slow) l2 norms (one foreach call), which are non-finite
    whenever an element is, and are confirmed element-wise only then (a finite overflow is not a skip)."""
    grads, total = [], 0
    for group in opt.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is not None:
                g = local_tensor(g)
                k = g.numel()
                if k:
                    grads.append(g)
                    total += k
    if grads:
        if fused_check_applies(grads, total):
            # one kernel for every gradient where the step is launch-bound: torch's AMP check, which also
            # multiplies by its scale (1.0 here: every element is left as it was)
            flag = torch.zeros(1)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, torch.ones(1))
        elif grads[0].device.type == "cpu":
            # one foreach kernel: an l2 norm is non-finite whenever an element is; confirmed element-wise
            # only then (a finite overflow of the norm is not a skip)
            norms = torch._foreach_norm(grads, 2.0)
            bad = not bool(torch.isfinite(torch.stack([n.float() for n in norms]) if len({n.dtype for n in norms}) > 1
                                          else torch.stack(norms)).all()) \
                and not all(bool(torch.isfinite(g).all()) for g in grads)
            flag = torch.tensor([float(bad)])
        else:
            norms = torch._foreach_norm(grads, float("inf"))
            flag = (~torch.isfinite(torch.stack([n.float() for n in norms]))).any().float().reshape(1)
    else:  # on the parameters' device: NCCL cannot reduce a CPU tensor
        devices = [local_flat(p).device for g in opt.param_groups for p in g["params"]]
        flag = torch.zeros(1, device=devices[0] if devices else "cpu")
    world_group_allreduce_max(flag)
    if flag.item() == 0:
        return False
    named = [(p, local_tensor(p.grad)) for g in opt.param_groups for p in g["params"] if p.grad is not None]
    bad_local = [opt.param_names.get(id(p), "?") for p, g in named if g.numel() and not torch.isfinite(g).all()]
    if opt.on_nonfinite == "raise":
        raise FloatingPointError(
            f"non-finite gradients in this step (on this rank: {bad_local or 'none, on another rank'}); "
            "set on_nonfinite='skip' to skip such steps")
    opt.skipped_steps += 1
    warnings.warn(f"shardopt: skipped step with non-finite gradients ({opt.skipped_steps} so far; "
                  f"on this rank: {bad_local or 'none, on another rank'})", RuntimeWarning, stacklevel=4)
    return True
