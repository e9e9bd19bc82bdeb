"""Element-wise AdamW for vectors and whatever the routing sends there.

Element-wise math needs no layout: it runs on each rank's local elements (a parameter, its DTensor shard,
or a DeepSpeed flat partition) and is exact under any sharding.
"""
from __future__ import annotations

import math

import torch

__all__ = ["adamw_step"]


def adamw_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    step: int,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    eps_mode: str = "torch",
) -> None:
    """One AdamW step on local tensors (fp32 state; params updated in their own dtype).

    ``eps_mode="torch"``: ``p -= lr * m_hat / (sqrt(v_hat) + eps)`` as ``torch.optim.AdamW``.
    ``eps_mode="outside"``: ``p -= lr * sqrt(1-b2^k)/(1-b1^k) * m / (sqrt(v) + eps)``, the form of SCALE's
    released code (eps added before the bias correction of ``sqrt(v)``; specs/scale.md section 2).
    """
    if not params:
        return
    b1, b2 = betas
    g32 = [g.float() for g in grads]
    torch._foreach_lerp_(exp_avgs, g32, 1 - b1)
    torch._foreach_mul_(exp_avg_sqs, b2)
    torch._foreach_addcmul_(exp_avg_sqs, g32, g32, 1 - b2)
    bc1 = 1 - b1**step
    bc2 = 1 - b2**step
    denom = torch._foreach_sqrt(exp_avg_sqs)
    if eps_mode == "torch":
        torch._foreach_div_(denom, math.sqrt(bc2))
        torch._foreach_add_(denom, eps)
        step_size = lr / bc1
    elif eps_mode == "outside":
        torch._foreach_add_(denom, eps)
        step_size = lr * math.sqrt(bc2) / bc1
    else:
        raise ValueError(f"eps_mode must be 'torch' or 'outside', got {eps_mode!r}")
    updates = torch._foreach_div(exp_avgs, denom)
    if weight_decay:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    for p, u in zip(params, updates):
        p.add_(u.to(p.dtype), alpha=-step_size)
