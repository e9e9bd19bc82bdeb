"""Read what an optimizer holds and sends: state bytes from its state tensors, collectives per step.

Collectives come from ``optimizer.comm_stats()`` when the optimizer has it (by kind: "stats", "gather",
"distributed", "local", each with calls, bytes sent and estimated FLOPs), else from shardopt's global
``collective_counter`` (calls and bytes only).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

__all__ = ["state_tensors", "state_bytes", "state_elements_by_param", "CommProbe"]

#: per-tensor counters, not optimizer state in the papers' memory tables
COUNTER_KEYS = ("step",)


def state_tensors(state: Any, key: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every (key, tensor) inside an optimizer state entry, nested dicts included (ZeRO flat partitions keep
    per-matrix state under ``"matrices"``; peers keep projector objects, whose tensors count too)."""
    if isinstance(state, torch.Tensor):
        yield key, state
    elif isinstance(state, dict):
        for k, v in state.items():
            yield from state_tensors(v, str(k))
    elif isinstance(state, (list, tuple)):
        for v in state:
            yield from state_tensors(v, key)
    elif hasattr(state, "__dict__") and not isinstance(state, type):
        for k, v in vars(state).items():
            if isinstance(v, (torch.Tensor, dict, list, tuple)):
                yield from state_tensors(v, k)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def state_bytes(optimizer: torch.optim.Optimizer, include_counters: bool = True) -> int:
    """Bytes of this rank's optimizer state (DTensor state counted by its local shard)."""
    parts = getattr(optimizer, "parts", None) or [optimizer]  # a hybrid of several optimizers
    total = 0
    for opt in parts:
        for entry in opt.state.values():
            for key, t in state_tensors(entry):
                if include_counters or key not in COUNTER_KEYS:
                    lt = _local(t)
                    total += lt.numel() * lt.element_size()
    return total


def state_elements_by_param(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """Elements of state per parameter (``id(param)``), counters left out (single process, real params)."""
    return {
        id(p): sum(_local(t).numel() for k, t in state_tensors(entry) if k not in COUNTER_KEYS)
        for p, entry in optimizer.state.items()
    }


class CommProbe:
    """Collectives of one optimizer step on this rank: ``start()`` before the step, ``stop()`` after."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.native = hasattr(optimizer, "comm_stats")

    def start(self) -> None:
        from shardopt.sharding import collective_counter

        if self.native:
            self.optimizer.comm_stats(reset=True)
        collective_counter.reset()

    def stop(self) -> dict[str, Any]:
        """``{"calls", "bytes", "flops", "by_kind"}`` since ``start()``."""
        from shardopt.sharding import collective_counter

        if not self.native:
            return {"calls": collective_counter.calls, "bytes": collective_counter.bytes, "flops": None, "by_kind": {}}
        kinds = self.optimizer.comm_stats(reset=True)
        total = {k: sum(float(v.get(k, 0)) for v in kinds.values()) for k in ("calls", "bytes", "flops")}
        return {"calls": int(total["calls"]), "bytes": int(total["bytes"]), "flops": total["flops"], "by_kind": kinds}
