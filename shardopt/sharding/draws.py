"""Seeded random draws that are the same on every rank, at every world size and on every device.

Keyed by ``(seed, *keys)`` (a parameter name, a refresh count), drawn on the CPU and then moved, so SUMO's range
finder and Alice's complement draws never depend on the process layout.
"""

from __future__ import annotations

import zlib

import torch

__all__ = ["seeded_normal", "seeded_permutation"]


def _generator(seed: int, keys: tuple) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr((seed,) + keys).encode()))


def seeded_normal(shape: tuple[int, ...], seed: int, *keys: object, device: torch.device | str = "cpu") -> torch.Tensor:
    """Standard normal draws that depend only on ``seed`` and ``keys`` (a parameter name, a refresh count):
    the same on every rank, at every world size and on every device (drawn on the CPU, then moved)."""
    return torch.randn(shape, generator=_generator(seed, keys), dtype=torch.float32).to(device)


def seeded_permutation(n: int, seed: int, *keys: object) -> torch.Tensor:
    """A permutation of ``range(n)`` with the same guarantees as ``seeded_normal``."""
    return torch.randperm(n, generator=_generator(seed, keys))
