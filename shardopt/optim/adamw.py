"""Element-wise AdamW for vectors and whatever the routing sends there.

Element-wise math needs no layout: it runs on each rank's local elements (a parameter, its DTensor shard,
or a DeepSpeed flat partition) and is exact under any sharding.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..sharding.fragment import local_flat

__all__ = ["adamw_step", "adamw_group_step", "adamw_gates_on_device"]


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
    found_inf: torch.Tensor | None = None,
) -> None:
    """One AdamW step on local tensors (fp32 state; params updated in their own dtype).

    ``eps_mode="torch"``: ``p -= lr * m_hat / (sqrt(v_hat) + eps)`` as ``torch.optim.AdamW``.
    ``eps_mode="outside"``: ``p -= lr * sqrt(1-b2^k)/(1-b1^k) * m / (sqrt(v) + eps)``, the form of SCALE's
    released code (eps added before the bias correction of ``sqrt(v)``; docs/algorithms/scale.md).

    ``found_inf`` (``[1.]``: skip, ``[0.]``: step, on the device): the skip decided there, which only the fused
    kernel takes (``adamw_gates_on_device`` says where it runs).
    """
    if not params:
        return
    b1, b2 = betas
    if _fused_applies(params, grads, exp_avgs, exp_avg_sqs):
        _fused_adamw(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            step,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            eps_mode=eps_mode,
            found_inf=found_inf,
        )
        return
    if found_inf is not None:
        raise RuntimeError(
            "shardopt: a step gated on the device reached the unfused AdamW path, which cannot skip "
            "on the device (adamw_gates_on_device should have sent it to the host check)"
        )
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


def _fused_applies(*tensor_lists: list[torch.Tensor]) -> bool:
    """torch's fused AdamW kernel (one pass per tensor, ~5x the foreach path on CPU) needs every tensor
    in fp32 on one CPU or CUDA device; anything else (bf16 params with fp32 state, mixed devices) takes the
    foreach path."""
    if not hasattr(torch, "_fused_adamw_"):
        return False
    device = tensor_lists[0][0].device
    if device.type == "cpu":
        same = lambda t: t.is_cpu  # noqa: E731  (a device compare builds an object per tensor)
    elif device.type == "cuda":
        same = lambda t: t.is_cuda and t.get_device() == device.index  # noqa: E731
    else:
        return False
    f32, strided = torch.float32, torch.strided
    return all(t.dtype is f32 and t.layout is strided and same(t) for tensors in tensor_lists for t in tensors)


def _fused_adamw(
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
    eps_mode: str,
    found_inf: torch.Tensor | None = None,
) -> None:
    """The same step through ``torch._fused_adamw_``. The kernel divides sqrt(v) by sqrt(1 - b2^k) before
    adding eps, so ``eps_mode="outside"`` (eps added before that correction) is the torch form with eps
    scaled by 1 / sqrt(1 - b2^k)."""
    if eps_mode == "outside":
        eps = eps / math.sqrt(1 - betas[1] ** step)
    elif eps_mode != "torch":
        raise ValueError(f"eps_mode must be 'torch' or 'outside', got {eps_mode!r}")
    # the count on the device by a fill kernel: torch.tensor(step, device=...) would be a copy from pageable host
    # memory, which waits for the device on CUDA (issue 29: one sync per step in every rule's AdamW part)
    steps = [torch.full((), float(step), dtype=torch.float32, device=params[0].device)] * len(params)
    torch._fused_adamw_(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        lr=lr,
        beta1=betas[0],
        beta2=betas[1],
        weight_decay=weight_decay,
        eps=eps,
        amsgrad=False,
        maximize=False,
        found_inf=found_inf,
    )


def adamw_gates_on_device(group: dict) -> bool:
    """Whether AdamW on ``group`` can skip a step on the device: every stepped tensor and its gradient take the
    fused kernel (fp32 on one device; state is made fp32), which leaves them and their state as they were when
    told ``found_inf``."""
    tensors = [(local_flat(p), local_flat(p.grad)) for p in group["params"] if p.grad is not None]
    return not tensors or _fused_applies([w for w, _ in tensors], [g for _, g in tensors])


def adamw_group_step(opt: Any, group: dict) -> None:
    """AdamW on every tensor of ``group`` (of ``opt``, a ``ShardedOptimizer``) that has a gradient (others get no
    state and keep their step count, as in ``torch.optim.AdamW``); one fused call per distinct step count."""
    by_step: dict[int, tuple[list, list, list, list]] = {}
    stepped = [p for p in group["params"] if p.grad is not None]
    states = [opt.state[p] for p in stepped]
    for p, st in zip(stepped, states):
        if "exp_avg" not in st:
            st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        if not isinstance(st.get("step"), torch.Tensor):  # new, or a number from an older state dict
            st["step"] = torch.tensor(float(st.get("step", 0)), dtype=torch.float32)
    counts = [st["step"] for st in states]
    found_inf = opt._step_found_inf
    if counts:  # _step_count(p, only_with_grad=True) of every tensor with a gradient: one kernel, one read
        # the tensor-list overload: the scalar one converts the scalar once per tensor on a CPU
        torch._foreach_add_(counts, [counts[0].new_ones(())] * len(counts))
        if found_inf is not None:  # taken back if the device skips this step (nonfinite.settle_device_skip)
            opt._pending_skip.counts += counts
        counts = [int(c) for c in torch.stack(counts).tolist()]
    for p, st, count in zip(stepped, states, counts):
        params, grads, ms, vs = by_step.setdefault(count, ([], [], [], []))
        if hasattr(p, "to_local"):
            params.append(local_flat(p))
            grads.append(local_flat(p.grad))
            ms.append(local_flat(st["exp_avg"]))
            vs.append(local_flat(st["exp_avg_sq"]))
        else:  # plain tensors, contiguous for the step (contiguous_steps; state is created contiguous):
            # element-wise kernels take them as they are; a view only where a loaded state is shaped otherwise
            m, v = st["exp_avg"], st["exp_avg_sq"]
            params.append(p)
            grads.append(p.grad)
            ms.append(m if m.shape == p.shape else m.view(p.shape))
            vs.append(v if v.shape == p.shape else v.view(p.shape))
    for step, (params, grads, ms, vs) in by_step.items():
        adamw_step(
            params,
            grads,
            ms,
            vs,
            step,
            lr=group["lr"],
            betas=tuple(group["betas"]),
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            eps_mode=group["eps_mode"],
            found_inf=found_inf,
        )
