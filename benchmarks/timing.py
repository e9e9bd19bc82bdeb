"""Wall-clock timing that is honest on CPU and GPU, and the machine's own roofline numbers.

GPU work is asynchronous, so every timed region synchronizes before reading the clock. The roofline
numbers (streaming bandwidth, matmul FLOP/s) are measured in the same process with the same threads, so
"measured time / floor" compares like with like.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

__all__ = ["sync", "time_call", "repeat_timing", "paired_timing", "stream_bandwidth", "matmul_flops"]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds for one call, the device's queued work included."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def repeat_timing(
    fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 1, max_seconds: float | None = None
) -> list[float]:
    """Times of ``repeats`` calls after ``warmup`` untimed ones; stops early (never below one timed call)
    once ``max_seconds`` of timed calls have passed, so slow optimizers on a CPU stay affordable."""
    for _ in range(warmup):
        time_call(fn, device)
    times: list[float] = []
    while len(times) < repeats:
        times.append(time_call(fn, device))
        if max_seconds is not None and sum(times) >= max_seconds:
            break
    return times


def paired_timing(
    fn: Callable[[], object],
    reference: Callable[[], object],
    device: torch.device,
    rounds: int,
    per_round: int = 1,
    warmup: int = 1,
    max_seconds: float | None = None,
) -> tuple[list[float], list[float]]:
    """Alternate one ``reference`` call with ``per_round`` calls of ``fn``, ``rounds`` times: (seconds per ``fn``
    call, seconds per reference call), one entry per round. Timing the two back to back in every round lets
    ``median(fn_i / reference_i)`` cancel the load drift of a shared machine, which timing one after the
    other (even minutes apart) does not. Stops early, as ``repeat_timing`` does, after ``max_seconds`` of ``fn``."""
    for _ in range(warmup):
        time_call(fn, device)
    times: list[float] = []
    refs: list[float] = []
    while len(times) < rounds:
        refs.append(time_call(reference, device))
        times.append(time_call(lambda: [fn() for _ in range(per_round)], device) / per_round)
        if max_seconds is not None and sum(times) * per_round >= max_seconds:
            break
    return times, refs


def stream_bandwidth(device: torch.device, megabytes: int = 256, repeats: int = 5) -> dict[str, float]:
    """Bytes/s of large streaming kernels: ``copy`` (read + write), in-place ``scale`` (read + write the same
    array, what optimizer updates do) and ``read`` (a sum), and ``best`` of them: the practical ceiling.
    On CPUs a copy into another buffer can run at half the in-place rate (write-allocate traffic)."""
    n = megabytes * 2**20 // 4
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    kernels = {"copy": (lambda: dst.copy_(src), 2), "scale": (lambda: src.mul_(1.0), 2), "read": (src.sum, 1)}
    out = {
        name: passes * n * 4 / statistics.median(repeat_timing(fn, device, repeats))
        for name, (fn, passes) in kernels.items()
    }
    out["best"] = max(out.values())
    return out


def matmul_flops(device: torch.device, size: int | None = None, repeats: int = 3) -> float:
    """FLOP/s of an fp32 ``size`` x ``size`` matmul (the compute ceiling for Newton-Schulz-type work; 2048 on
    a CPU, 8192 on a GPU, large enough to reach the device's rate)."""
    size = size or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    times = repeat_timing(lambda: a @ b, device, repeats)
    return 2.0 * size**3 / statistics.median(times)
