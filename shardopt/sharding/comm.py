"""Bucketed reductions: one all-reduce per process group per round, whatever the number of matrices.

An optimizer step runs its algorithm in *rounds*. In a round every matrix registers the partial statistics
it needs summed across ranks (only the split indices of an axis, or a scalar); ``Round.run`` packs them into
one fp32 buffer per process group, issues one ``all_reduce`` for each, and writes the sums back in place.
Whether a matrix registers anything depends only on its static layout, so every rank issues the same
collectives in the same order, including ranks whose shard is empty.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from . import staging
from .layout import MatrixLayout

_device_copies: "weakref.WeakKeyDictionary[torch.Tensor, dict]" = weakref.WeakKeyDictionary()


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A cached copy of a static plan tensor on ``device`` (one host-to-device copy per layout, not per round)."""
    if t.device == device:
        return t
    copies = _device_copies.setdefault(t, {})
    if device not in copies:
        copies[device] = t.to(device)
    return copies[device]


__all__ = ["Round", "CollectiveCounter", "collective_counter", "on_device"]


class CollectiveCounter:
    """Counts collective calls and bytes sent by shardopt (tests, benchmarks, ``optimizer.comm_stats()``).

    Every record carries a tag: ``"stats"`` (bucketed row/column/scalar reductions), ``"gather"`` (pieces to
    owner ranks and results back), ``"realign"`` (distributed strategy: rows cut by partition boundaries, or an
    all-to-all across the grain) or ``"distributed"`` (reduced small matrices: Grams, projections).
    ``capture(d)`` also adds each record into ``d`` (an optimizer's own counters) while active.
    """

    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0
        self.by_tag: dict[str, dict[str, float]] = {}
        self._sinks: list[dict[str, dict[str, float]]] = []

    def reset(self) -> None:
        self.calls = 0
        self.bytes = 0
        self.by_tag = {}

    def _add(self, tag: str, key: str, value: float) -> None:
        for d in [self.by_tag, *self._sinks]:
            entry = d.setdefault(tag, {"calls": 0, "bytes": 0, "flops": 0.0})
            entry[key] += value

    def record(self, tensor: torch.Tensor, tag: str = "stats", bytes_by_tag: dict[str, int] | None = None) -> None:
        """One collective sending ``tensor`` (bytes split over tags by ``bytes_by_tag`` when it mixes them)."""
        nbytes = tensor.numel() * tensor.element_size()
        self.calls += 1
        self.bytes += nbytes
        self._add(tag, "calls", 1)
        for t, b in (bytes_by_tag or {tag: nbytes}).items():
            self._add(t, "bytes", b)

    def add_flops(self, tag: str, flops: float) -> None:
        """Estimated floating-point work done on this rank for ``tag`` (benchmarks, load-balance checks)."""
        self._add(tag, "flops", flops)

    @contextmanager
    def capture(self, sink: dict[str, dict[str, float]]) -> Iterator[None]:
        self._sinks.append(sink)
        try:
            yield
        finally:
            self._sinks.remove(sink)


collective_counter = CollectiveCounter()


def _all_reduce(buf: torch.Tensor, group: Any) -> None:
    import torch.distributed as dist

    collective_counter.record(buf)
    staging.all_reduce(buf, group, dist.ReduceOp.SUM)  # through the device for CPU buffers on NCCL (offload)


def world_group_allreduce_max(flag: torch.Tensor) -> None:
    """Agree on a flag across all ranks (no-op outside ``torch.distributed`` or with one process)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        collective_counter.record(flag)
        staging.all_reduce(flag, None, dist.ReduceOp.MAX)


class Round:
    """Collects the partial sums of one round and reduces them together."""

    def __init__(self) -> None:
        # group key -> (group, list of (target tensor, index or slice or None-for-scalar))
        self._items: dict[int, tuple[Any, list[tuple[torch.Tensor, Any]]]] = {}

    def _bucket(self, group: Any) -> list[tuple[torch.Tensor, Any]]:
        key = id(group)
        if key not in self._items:
            self._items[key] = (group, [])
        return self._items[key][1]

    def add_axis(self, layout: MatrixLayout, vector: torch.Tensor, axis: int) -> None:
        """Register the split indices of a per-row (axis 0) or per-column (axis 1) partial-sum vector."""
        split = layout.axis_plan(axis).split
        if split is not None:
            self._bucket(layout.group).append((vector, split))

    def add_full(self, layout: MatrixLayout, vector: torch.Tensor) -> None:
        """Register a whole vector to be summed over the layout's group (e.g. owner-masked state to replicate)."""
        if layout.group is not None:
            self._bucket(layout.group).append((vector, slice(None)))

    def add_sum(self, layout: MatrixLayout, scalar: torch.Tensor) -> None:
        """Register a 0-d partial sum over this rank's elements (e.g. a squared Frobenius norm).

        Reduced whenever the matrix is sharded, even if one rank holds all of it: every rank of the group must
        end with the same value (state such as RACS's limiter norm is checkpointed from any rank)."""
        if layout.group is not None:
            self._bucket(layout.group).append((scalar, None))

    def run(self) -> None:
        for group, items in self._items.values():
            parts = []
            for tensor, index in items:
                if index is None:
                    parts.append(tensor.reshape(1))
                elif isinstance(index, slice):
                    parts.append(tensor.reshape(-1))
                else:
                    parts.append(tensor.index_select(0, on_device(index, tensor.device)))
            buf = torch.cat([p if p.dtype is torch.float32 else p.to(torch.float32) for p in parts])
            _all_reduce(buf, group)
            start = 0
            for (tensor, index), part in zip(items, parts):
                size = part.numel()
                chunk = buf[start : start + size]
                chunk = chunk if tensor.dtype is torch.float32 else chunk.to(tensor.dtype)
                start += size
                if index is None:
                    tensor.copy_(chunk.reshape(tensor.shape))
                elif isinstance(index, slice):
                    tensor.copy_(chunk.reshape(tensor.shape))
                else:
                    tensor.index_copy_(0, on_device(index, tensor.device), chunk)
        self._items.clear()
