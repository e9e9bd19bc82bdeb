"""What whole-matrix work a block of code really ran: products' FLOPs and factorization calls.

Counted by torch's own ``FlopCounterMode`` (a dispatch mode: it sees every aten op, on any device), given
FLOP formulas for the factorizations it does not know. Two uses:

* "work divides over the ranks" as a count, not a clock: a rank's FLOPs inside whole-matrix work against
  the single process's (a CPU-time ratio of 4 processes sharing 2 cores moves by 30% from run to run);
* "no ``eigh``/``svd``/``qr`` between refreshes" (issue 42): the calls, by kind, inside ``step()``.

The factorization FLOPs are the conventional dense counts (Golub & Van Loan): they weigh work, they do not
predict its time (the time model does that, with measured rates).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["FACTORIZATIONS", "OpCensus", "census"]

aten = torch.ops.aten


def _k_m_n(shape: Sequence[int]) -> tuple[int, int, int]:
    *batch, m, n = shape
    count = 1
    for b in batch:
        count *= b
    return count, max(m, n), min(m, n)


def _eigh_flops(a_shape: Sequence[int], *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    count, n, _ = _k_m_n(a_shape)
    return count * 10 * n**3


def _svd_flops(a_shape: Sequence[int], *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    count, m, n = _k_m_n(a_shape)
    return count * (4 * m * n * n + 22 * n**3)


def _qr_flops(a_shape: Sequence[int], *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    count, m, n = _k_m_n(a_shape)
    return count * 4 * m * n * n


def _cholesky_flops(a_shape: Sequence[int], *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    count, n, _ = _k_m_n(a_shape)
    return count * n**3 // 3


def _triangular_flops(
    a_shape: Sequence[int], b_shape: Sequence[int], *args: Any, out_shape: Any = None, left: bool = True, **kwargs: Any
) -> int:
    """``n^2`` per solved vector: ``B``'s columns (``left``) or rows (``X A = B``), over the broadcast batch."""
    n = a_shape[-1]
    batch = 1
    for d in torch.broadcast_shapes(tuple(a_shape[:-2]), tuple(b_shape[:-2])):
        batch *= d
    return batch * n * n * (b_shape[-1] if left else b_shape[-2])


#: the aten ops behind torch.linalg's factorizations, by the name this module reports them under
FACTORIZATIONS: dict[str, tuple] = {
    "eigh": (aten._linalg_eigh, _eigh_flops),
    "svd": (aten._linalg_svd, _svd_flops),
    "qr": (aten.linalg_qr, _qr_flops),
    "cholesky": (aten.linalg_cholesky_ex, _cholesky_flops),
    "solve_triangular": (aten.linalg_solve_triangular, _triangular_flops),
}


@dataclass
class OpCensus:
    """Totals over every block counted into it."""

    flops: int = 0
    calls: dict[str, int] = field(default_factory=dict)

    @property
    def factorizations(self) -> int:
        """``eigh``, ``svd`` and ``qr`` calls (Cholesky and triangular solves are the matmul-rate routes' own)."""
        return sum(self.calls.get(k, 0) for k in ("eigh", "svd", "qr"))


@contextlib.contextmanager
def census(into: OpCensus | None = None) -> Iterator[OpCensus]:
    """Counts the FLOPs and factorization calls of the block into ``into`` (a fresh census by default)."""
    out = into if into is not None else OpCensus()

    def counted(kind: str, flops: Callable[..., int]) -> Callable[..., int]:
        def formula(*args: Any, **kwargs: Any) -> int:
            out.calls[kind] = out.calls.get(kind, 0) + 1
            return flops(*args, **kwargs)

        return formula

    mode = FlopCounterMode(
        display=False, custom_mapping={op: counted(kind, f) for kind, (op, f) in FACTORIZATIONS.items()}
    )
    with mode:
        yield out
    out.flops += mode.get_total_flops()
