"""Collectives on CPU-resident pieces (ZeRO-Offload, FSDP2's CPU offload) whatever the process group's backend.

With optimizer offload DeepSpeed hands the optimizer fp32 partitions in CPU memory, while its data-parallel group
is usually NCCL, which moves only device tensors: a row statistic, a Gram or a whole-matrix gather built from
those partitions would be refused by ``dist.all_reduce``. Design: **stage through the device**. A buffer whose
group's backend does not take its device's tensors is copied to the accelerator's current device, the collective
runs there, and the result is copied back into the buffer on the CPU; a backend that takes CPU tensors (gloo, MPI,
oneCCL, or a ``"cpu:gloo,cuda:nccl"`` group) gets the buffer as it is. Chosen over a gloo group mirroring each
data-parallel group because

* no group is created: ``new_group`` is itself collective, and ZeRO's groups (expert data-parallel groups, MiCS
  and hpZ partition groups) are made by DeepSpeed at times shardopt does not see;
* every rank still issues the same collectives in the same order: the decision depends on the buffer's device and
  the group's backend, which every rank of a group shares;
* the staged buffers are small against the step: the bucketed row/column statistics (one vector per matrix), the
  small reduced matrices, and the pieces of whole-matrix gathers, each one host-to-device and one device-to-host
  copy, over PCIe that is faster than gloo over TCP for the same bytes.

``staging_device`` is the decision alone (unit-tested without a GPU); ``all_reduce``, ``all_gather`` and
``all_to_all_single`` are ``torch.distributed``'s with the staging around them.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "CPU_BACKENDS",
    "takes_device",
    "staging_device",
    "accelerator_device",
    "all_reduce",
    "all_gather",
    "all_to_all_single",
]

#: backends that reduce and exchange CPU tensors ("fake": torch's test backend, which takes anything)
CPU_BACKENDS = frozenset({"gloo", "mpi", "ccl", "ucc", "fake"})

_backends: dict[int, tuple[Any, str]] = {}


def takes_device(backend: str, device_type: str) -> bool:
    """Whether a group whose ``dist.get_backend`` is ``backend`` moves ``device_type`` tensors: a per-device
    backend string (``"cpu:gloo,cuda:nccl"``) says so per device; a single backend takes CPU tensors when it is one
    of ``CPU_BACKENDS``, and device tensors unless it is CPU-only (gloo takes CUDA tensors too, MPI and UCC too)."""
    backend = backend.lower()
    if ":" in backend:
        return device_type in {pair.split(":", 1)[0].strip() for pair in backend.split(",")}
    if device_type == "cpu":
        return backend in CPU_BACKENDS
    return True


def accelerator_device() -> torch.device | None:
    """The accelerator this process drives (``torch.accelerator``'s current device), or None on a CPU-only host."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        kind = acc.current_accelerator()
        return torch.device(kind.type, acc.current_device_index())
    if torch.cuda.is_available():  # pragma: no cover - torch without torch.accelerator
        return torch.device("cuda", torch.cuda.current_device())
    return None


def staging_device(device: torch.device, backend: str, accelerator: torch.device | None) -> torch.device | None:
    """Where a buffer on ``device`` must be for a collective over a ``backend`` group: None where it can stay,
    else ``accelerator``. A CPU buffer for a device-only group (NCCL, HCCL) without an accelerator cannot be moved
    anywhere the backend takes it: ``RuntimeError`` naming the setting that put the buffer there."""
    if takes_device(backend, device.type):
        return None
    if device.type == "cpu" and accelerator is not None and takes_device(backend, accelerator.type):
        return accelerator
    raise RuntimeError(
        f"a shardopt collective over a {backend!r} process group got a {device.type} tensor, which that backend "
        f"does not move, and there is no device to stage it through ({accelerator}); with optimizer offload "
        "(zero_optimization.offload_optimizer.device 'cpu', FSDP2's CPUOffloadPolicy) run each rank with its "
        "accelerator set (torch.cuda.set_device(local_rank)), or use a gloo process group"
    )


def _backend(group: Any) -> str:
    import torch.distributed as dist

    key = id(group)
    hit = _backends.get(key)
    if hit is None or hit[0] is not group:
        hit = (group, str(dist.get_backend(group)))
        _backends[key] = hit
    return hit[1]


_HOST_ONLY: list[bool] = []


def _host_only() -> bool:
    """No accelerator in this process (asked once): a CPU buffer has nowhere to be staged, so the group's backend
    moves it or refuses it itself, and no backend needs to be looked up."""
    if not _HOST_ONLY:
        _HOST_ONLY.append(accelerator_device() is None)
    return _HOST_ONLY[0]


def _target(t: torch.Tensor, group: Any) -> torch.device | None:
    if t.device.type == "cpu" and _host_only():
        return None
    backend = _backend(group)
    if takes_device(backend, t.device.type):  # the common case, decided without asking for the accelerator
        return None
    return staging_device(t.device, backend, accelerator_device())


def all_reduce(buf: torch.Tensor, group: Any = None, op: Any = None) -> None:
    """``dist.all_reduce(buf, op, group)`` (default SUM), staged through the device where the backend needs it."""
    import torch.distributed as dist

    op = dist.ReduceOp.SUM if op is None else op
    dev = _target(buf, group)
    if dev is None:
        dist.all_reduce(buf, op=op, group=group)
        return
    staged = buf.to(dev)
    dist.all_reduce(staged, op=op, group=group)
    buf.copy_(staged)


def all_gather(recv: list[torch.Tensor], send: torch.Tensor, group: Any = None) -> None:
    """``dist.all_gather(recv, send, group)``, staged through the device where the backend needs it."""
    import torch.distributed as dist

    dev = _target(send, group)
    if dev is None:
        dist.all_gather(recv, send, group=group)
        return
    staged = [torch.empty(r.shape, dtype=r.dtype, device=dev) for r in recv]
    dist.all_gather(staged, send.to(dev), group=group)
    for r, s in zip(recv, staged):
        r.copy_(s)


def all_to_all_single(
    out: torch.Tensor,
    inp: torch.Tensor,
    out_sizes: list[int] | None = None,
    in_sizes: list[int] | None = None,
    group: Any = None,
) -> None:
    """``dist.all_to_all_single(out, inp, out_sizes, in_sizes, group)``, staged through the device where the
    backend needs it."""
    import torch.distributed as dist

    dev = _target(inp, group)
    if dev is None:
        dist.all_to_all_single(out, inp, out_sizes, in_sizes, group=group)
        return
    staged = torch.empty(out.shape, dtype=out.dtype, device=dev)
    dist.all_to_all_single(staged, inp.to(dev), out_sizes, in_sizes, group=group)
    out.copy_(staged)
