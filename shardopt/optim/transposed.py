"""Weights stored in x out (role ``matrix_transposed``: transformers' ``Conv1D`` in GPT-2, fused experts with
``is_transposed``), stepped by every rule as their logical out x in matrix.

A rule's role table gives such a weight's param group the option ``transposed: True``. The stored matrix stays as
the engine holds it (rows cut anywhere by ZeRO's flat partitions, FSDP2's row or column shards); what flips is which
stored axis a rule calls its rows: the logical rows (output units) are the stored columns. So the line statistics
(SinkGD, RACS, DASGO) run on the same sharded row and column sums with the axes swapped, whole-matrix rules choose
their orientation ``A`` on the logical shape (``ShardedOptimizer.a_transpose``: a square matrix breaks the tie on
its logical side) and Muon's shape-dependent lr reads the logical shape. State keeps its logical meaning: a
per-row entry (kind ``"rows"``: RACS's ``q``) is per logical row, i.e. per stored column
(``ShardedOptimizer.line_axis``), so a checkpoint of a transposed weight means what it means for ``nn.Linear``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

if TYPE_CHECKING:
    from ..sharding.block_groups import BlockGroups

__all__ = [
    "TRANSPOSED",
    "is_transposed",
    "logical_axes",
    "logical_2d",
    "line_sums",
    "line_length",
    "line_items",
    "item_lines",
]

#: the param-group option that marks weights stored in x out (set by the ``matrix_transposed`` role)
TRANSPOSED = "transposed"


def is_transposed(group: Mapping[str, Any]) -> bool:
    """Whether ``group``'s matrices are stored in x out (stepped as their transpose)."""
    return bool(group.get(TRANSPOSED, False))


def logical_axes(group: Mapping[str, Any]) -> tuple[int, int]:
    """The stored axes that hold the logical rows and the logical columns: ``(0, 1)``, or ``(1, 0)`` in x out."""
    return (1, 0) if is_transposed(group) else (0, 1)


def logical_2d(shape: Sequence[int], group: Mapping[str, Any]) -> tuple[int, int]:
    """The logical ``(out, in)`` shape of a stored 2-D matrix shape."""
    m, n = shape
    return (n, m) if is_transposed(group) else (m, n)


def line_sums(
    blocks: BlockGroups, axis: int, stacks: Sequence, weight: torch.Tensor | None = None, square: bool = False
) -> torch.Tensor:
    """Partial sums of the lines along stored ``axis`` (0: row sums, weighted per column; 1: column sums, weighted
    per row) of every matrix of ``blocks`` (``sharding.block_groups.BlockGroups``), concatenated."""
    if axis == 0:
        return blocks.row_sums(stacks, weight, square=square)
    return blocks.col_sums(stacks, weight, square=square)


def line_length(blocks: BlockGroups, axis: int) -> torch.Tensor:
    """Per line along stored ``axis``, its length (a row's is its matrix's n, a column's its m), fp32."""
    return blocks.row_length if axis == 0 else blocks.col_length


def line_items(blocks: BlockGroups, axis: int) -> torch.Tensor:
    """Per line along stored ``axis``, the index of its matrix."""
    return blocks.item_of_row if axis == 0 else blocks.item_of_col


def item_lines(blocks: BlockGroups, axis: int) -> torch.Tensor:
    """Per matrix, its number of lines along stored ``axis`` (m for rows, n for columns), fp32."""
    if axis == 0:
        return blocks.item_rows
    cached = blocks.__dict__.get("_item_cols")
    if cached is None:
        cached = blocks.__dict__["_item_cols"] = torch.tensor(blocks.ns, dtype=torch.float32).to(blocks.device)
    return cached
