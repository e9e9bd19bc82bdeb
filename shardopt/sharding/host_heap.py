"""Hand the C heap's free pages back to the system, where the C library can (glibc's ``malloc_trim``).

On a CPU, torch allocates tensors with ``malloc``. glibc serves blocks below its mmap threshold (128 KiB at first,
raised up to 32 MiB as large blocks are freed) from its heap and keeps freed ones there for reuse, so a backward
that frees activations and gradients leaves the process's resident memory where it was, and the next large
transient (mmapped above the threshold: it cannot reuse those pages) stacks on that slack. ``malloc_trim(0)``
releases every whole free page of the heap, in its middle too, for a walk of the heap and the page faults of
reusing what it released.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

__all__ = ["release_free_heap"]


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim`` (None for musl, macOS, Windows: nothing to do)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    return trim


def release_free_heap() -> bool:
    """Return the heap's free pages to the system; False where the C library offers no way to."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
