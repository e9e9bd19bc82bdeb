"""The non-finite gradient check before a step: every rank learns whether any rank has a non-finite gradient,
and the step is skipped (or raises) on all of them alike, so no rank runs collectives the others skip.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..sharding.comm import world_group_allreduce_max
from ..sharding.fragment import local_flat, local_tensor

__all__ = [
    "nonfinite_grads",
    "fused_check_applies",
    "FUSED_CHECK_ELEMENTS",
    "gate_step",
    "end_gate",
    "settle_device_skip",
    "gated",
    "keep_unless_gated",
    "zero_nonfinite",
    "skippable_lerp_",
]

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


def _local_grads(opt: Any) -> tuple[list[torch.Tensor], int]:
    """Every non-empty local gradient of ``opt``'s step, and their element count."""
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
    return grads, total


def _max_abs_flag(grads: list[torch.Tensor]) -> torch.Tensor:
    """``[1.]`` where an element of ``grads`` is inf/NaN, else ``[0.]``, on their device, read by no one: one
    multi-tensor max-abs and a reduction of its results."""
    norms = torch._foreach_norm(grads, float("inf"))
    return (~torch.isfinite(torch.stack([n.float() for n in norms]))).any().float().reshape(1)


def _empty_flag(opt: Any) -> torch.Tensor:
    """``[0.]`` on the parameters' device (NCCL cannot reduce a CPU tensor), for a rank without gradients."""
    devices = [local_flat(p).device for g in opt.param_groups for p in g["params"]]
    return torch.zeros(1, device=devices[0] if devices else "cpu")


def nonfinite_grads(opt: Any) -> bool:
    """Whether any rank has a non-finite gradient in ``opt``'s step (a ``ShardedOptimizer``; one 1-element all-reduce
    when distributed).

    A healthy step costs one cheap reduction per gradient and a single host sync: on GPUs a fused max-abs
    over all gradients; on CPUs (where that kernel is slow) l2 norms (one foreach call), which are non-finite
    whenever an element is, and are confirmed element-wise only then (a finite overflow is not a skip)."""
    grads, total = _local_grads(opt)
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
            bad = not bool(
                torch.isfinite(
                    torch.stack([n.float() for n in norms]) if len({n.dtype for n in norms}) > 1 else torch.stack(norms)
                ).all()
            ) and not all(bool(torch.isfinite(g).all()) for g in grads)
            flag = torch.tensor([float(bad)])
        else:
            flag = _max_abs_flag(grads)
    else:
        flag = _empty_flag(opt)
    world_group_allreduce_max(flag)
    if flag.item() == 0:
        return False
    named = [(p, local_tensor(p.grad)) for g in opt.param_groups for p in g["params"] if p.grad is not None]
    bad_local = [opt.param_names.get(id(p), "?") for p, g in named if g.numel() and not torch.isfinite(g).all()]
    if opt.on_nonfinite == "raise":
        raise FloatingPointError(
            f"non-finite gradients in this step (on this rank: {bad_local or 'none, on another rank'}); "
            "set on_nonfinite='skip' to skip such steps"
        )
    opt._skipped_steps += 1
    warnings.warn(
        f"shardopt: skipped step with non-finite gradients ({opt._skipped_steps} so far; "
        f"on this rank: {bad_local or 'none, on another rank'})",
        RuntimeWarning,
        stacklevel=4,
    )
    return True


# ---------------------------------------------------------------------------------------------- on the device
# A GPU step that reads the flag above waits for the backward pass to finish before it issues a single kernel,
# and its few hundred launches then run with the GPU idle between them (issue 29: 2-4 ms per step at 350M).
# Where every rule of a step gates its own writes (``ShardedOptimizer.skips_on_device``), the skip is decided
# on the device instead: the step runs with ``opt._step_gate`` (0-d, 1. or 0.) and ``opt._step_found_inf``
# (``[0.]`` or ``[1.]``), and a skipped step writes nothing (lr 0, betas 1, non-finite gradient elements read as
# 0; momentum EMAs and fused AdamW through kernels told ``found_inf``, ``skippable_lerp_``; statistics of the
# low-rank rules put back by a select, ``keep_unless_gated``). Every rule but ASGO does, on the steps that switch or
# refresh no basis (those read the device anyway). The host learns of the skip one step later, from a copy made without
# waiting: ``settle_device_skip`` then takes back the host step counts the skipped step advanced and counts and
# warns about it, before anything reads them (the next step, ``state_dict``, ``skipped_steps``).


class _PendingSkip:
    """A step's flag on its way to the host, and the host counters that step advanced."""

    __slots__ = ("host", "event", "counts")

    def __init__(self, host: torch.Tensor, event: Any) -> None:
        self.host = host
        self.event = event
        self.counts: list[torch.Tensor] = []


def gate_step(opt: Any) -> None:
    """Compute the step's flag (all ranks agree: one all-reduce, as the host check) without reading it, and set the
    gate the rules' writes multiply by."""
    grads, _ = _local_grads(opt)
    flag = _max_abs_flag(grads) if grads else _empty_flag(opt)
    world_group_allreduce_max(flag)
    if flag.is_cuda:
        host = torch.empty(1, pin_memory=True)
        host.copy_(flag, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    else:
        host, event = flag.clone(), None
    opt._step_found_inf = flag
    opt._step_gate = 1 - flag[0]
    opt._pending_skip = _PendingSkip(host, event)


def gated(gate: torch.Tensor, value: float | torch.Tensor, skipped: float | torch.Tensor) -> torch.Tensor:
    """``value`` where the step runs, ``skipped`` where the device skips it (a 0-d tensor beside ``gate``)."""
    return torch.where(gate > 0, value, skipped)


def keep_unless_gated(gate: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> None:
    """``new`` back to ``old`` in place where the device skips the step: a select, so a new value that overflowed
    (inf or NaN from finite gradients) cannot leak through as a product by 0 would let it."""
    torch.where(gate > 0, new, old, out=new)


def zero_nonfinite(x: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """``x`` with its inf/NaN elements as 0, so that a gate of 0 cancels it."""
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0, out=x if in_place else None)


def skippable_lerp_(
    targets: list[torch.Tensor], sources: list[torch.Tensor], weight: float, found_inf: torch.Tensor
) -> None:
    """``t = lerp(t, s, weight)`` for every pair, nothing written where ``found_inf`` is ``[1.]``, with no
    cleaning of ``sources`` (which may hold inf/NaN on such a step) and no per-tensor kernel.

    torch's fused SGD kernel skips on ``found_inf`` by itself, and with weight decay -1 and lr ``-weight`` it
    computes ``t - lr (s + wd t) = t + weight (s - t)``: lerp's own formula for a weight below 0.5, rounded the
    same way, so a step that runs equals ``torch._foreach_lerp_`` bit for bit (``tests/test_device_skip.py``, and
    on CUDA ``tests/test_cuda.py``). A larger weight takes lerp with its weight gated on cleaned sources."""
    if not targets:
        return
    # FSDP2: the shards; contiguous sources, as the fused kernel reads them (a CPU one ignores their strides)
    targets, sources = [local_tensor(t) for t in targets], [local_tensor(x).contiguous() for x in sources]
    if 0 <= weight < 0.5:
        torch._fused_sgd_(
            targets,
            sources,
            [],
            weight_decay=-1.0,
            momentum=0.0,
            lr=-weight,
            dampening=0.0,
            nesterov=False,
            maximize=False,
            is_first_step=False,
            found_inf=found_inf,
        )
        return
    gate = 1 - found_inf[0]
    torch._foreach_lerp_(targets, [zero_nonfinite(x) for x in sources], [gated(gate, weight, 0.0)] * len(targets))


def end_gate(opt: Any) -> None:
    """The gate belongs to one step: nothing outside it sees it."""
    opt._step_gate = None
    opt._step_found_inf = None


def settle_device_skip(opt: Any) -> None:
    """Bring the host up to date with the last device-decided step: if it was skipped, its host step counts go back
    and it is counted and reported as the host check does. Waits only for the flag's copy, long done."""
    pending = opt.__dict__.pop("_pending_skip", None)
    if pending is None:
        return
    if pending.event is not None and not pending.event.query():  # done long ago as a rule: no wait
        pending.event.synchronize()
    if float(pending.host[0]) == 0.0:
        return
    if pending.counts:
        torch._foreach_sub_(pending.counts, [pending.counts[0].new_ones(())] * len(pending.counts))
    opt._skipped_steps += 1
    if opt.on_nonfinite == "skip":
        warnings.warn(
            f"shardopt: skipped step with non-finite gradients ({opt._skipped_steps} so far; decided on "
            "the device, reported at the next step)",
            RuntimeWarning,
            stacklevel=4,
        )
