"""Stochastic rounding of fp32 values into bf16 weights, the same whatever the sharding.

bf16 keeps 8 significant bits, so an update below half a unit in the last place of the weight is lost to
round-to-nearest, step after step. Rounding up with probability equal to the discarded fraction (and down
otherwise) keeps the expected weight exact. The random bits of an element come from a counter-based hash of
its LOGICAL index in the unsharded parameter, the step and a seed, never of the rank or the shard, so a weight
sharded over any number of ranks rounds exactly as the whole weight does in one process, and a rerun repeats.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["hash_bits", "stochastic_round_", "logical_index_offsets", "IndexMap"]

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B
#: elements rounded per chunk (bounds the int64 index and hash transients to a few MB)
CHUNK = 1 << 20

#: (global offset per dim, global strides) of a tensor's local elements in its unsharded parameter
IndexMap = tuple[tuple[int, ...], tuple[int, ...]]


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer (values in [0, 2^32) in int64: products stay below 2^59)."""
    x = ((x >> 16) ^ x) * _MUL & _M32
    x = ((x >> 16) ^ x) * _MUL & _M32
    return (x >> 16) ^ x


def _mix32_int(x: int) -> int:
    x &= _M32
    x = (((x >> 16) ^ x) * _MUL) & _M32
    x = (((x >> 16) ^ x) * _MUL) & _M32
    return (x >> 16) ^ x


def hash_bits(index: torch.Tensor, step: int, seed: int) -> torch.Tensor:
    """16 random bits (int32 in [0, 2^16)) per logical element ``index`` (int64) at ``step`` under ``seed``."""
    key1 = _mix32_int(seed * 0x9E3779B1 + _mix32_int(step))
    key2 = _mix32_int(key1 ^ 0x85EBCA6B)
    h = _mix32((index & _M32) ^ key1)
    h = _mix32(h ^ (index >> 32) ^ key2)
    return (h & 0xFFFF).to(torch.int32)


def logical_index_offsets(p: torch.Tensor) -> IndexMap:
    """Where ``p``'s local elements sit in the unsharded parameter: per dimension the global offset of its local
    block and the unsharded tensor's contiguous strides (a DTensor: its shard's offset; a plain tensor: zeros)."""
    shape = tuple(p.shape)
    offsets: tuple[int, ...] = (0,) * len(shape)
    if hasattr(p, "device_mesh") and hasattr(p, "placements"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, off = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        offsets = tuple(int(o) for o in off)
    strides = []
    acc = 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= int(d)
    return offsets, tuple(reversed(strides))


def _indices(local_shape: Sequence[int], rows: slice, index_map: IndexMap, device: torch.device) -> torch.Tensor:
    """The logical indices of the local elements in ``rows`` (of dimension 0), flattened."""
    offsets, strides = index_map
    idx = torch.zeros((), dtype=torch.int64, device=device)
    for d, n in enumerate(local_shape):
        r = (
            torch.arange(n, dtype=torch.int64, device=device)
            if d
            else torch.arange(rows.start, rows.stop, dtype=torch.int64, device=device)
        )
        shape = [1] * len(local_shape)
        shape[d] = -1
        idx = idx + ((r + offsets[d]) * strides[d]).view(shape)
    return idx.reshape(-1)


@torch.no_grad()
def stochastic_round_(dst: torch.Tensor, src: torch.Tensor, index_map: IndexMap, step: int, seed: int) -> None:
    """``dst`` (bf16, local elements) <- ``src`` (fp32, same shape) rounded stochastically: the 16 bits bf16 drops
    are compared with ``hash_bits`` of each element's logical index, step and seed (round away from zero when
    their sum carries). Chunked along dimension 0 so the integer transients stay small."""
    if dst.dtype != torch.bfloat16:
        raise TypeError(f"stochastic rounding writes bf16 tensors, got {dst.dtype}")
    if dst.numel() == 0:
        return
    shape = tuple(src.shape) if src.dim() else (1,)
    if not src.dim():
        index_map = ((0,), (1,))
    src2 = src.reshape(shape)
    dst2 = dst.view(shape)
    row = max(1, src2[0].numel())
    per = max(1, CHUNK // row)
    for start in range(0, shape[0], per):
        rows = slice(start, min(start + per, shape[0]))
        bits = src2[rows].contiguous().view(torch.int32).reshape(-1)
        r = hash_bits(_indices(shape, rows, index_map, src.device), step, seed)
        rounded = ((bits + r) & -65536).view(torch.float32)
        finite = torch.isfinite(src2[rows].reshape(-1))
        out = torch.where(finite, rounded, src2[rows].reshape(-1))
        dst2[rows].copy_(out.view(dst2[rows].shape).to(torch.bfloat16))
