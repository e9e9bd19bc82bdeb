"""DeepSpeed ZeRO's partitioning rules as pure functions: which piece of every matrix each rank's flat fp32
partition holds, from the parameters' names and shapes alone (no engine, no tensors).

The DeepSpeed adapter (``deepspeed_engine.attach_zero_layouts``) maps a started engine's partitions with these
functions, and ``benchmarks.scale`` builds the same layouts for thousands of simulated ranks without starting
DeepSpeed. The rules are those of DeepSpeed 0.19 (``deepspeed/runtime/zero``):

* ZeRO-1/2 (``stage_1_and_2.DeepSpeedZeroOptimizer``): the trainable parameters of a param group (optionally
  reordered round-robin over the ranks) are concatenated, each followed by padding to ``param_alignment``
  elements when ``parameter_alignment`` is set (not after the last one); the flat buffer is padded to a
  multiple of ``nccl_start_alignment_factor (2) x world`` and cut into ``world`` equal partitions. ZeRO-1 and
  ZeRO-2 partition the optimizer state identically.
* ZeRO-3 (``partition_parameters`` / ``stage3``): every parameter is cut on its own into ``world`` partitions of
  ``ceil(numel / world)`` elements (the last ones padded or empty); a sub-group's flat fp32 tensor
  concatenates its parameters' partitions, and sub-groups close when their partitions reach
  ``sub_group_size`` elements.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from ..sharding.discover import matrix_shape
from ..sharding.fragment import Fragment
from ..sharding.layout import FlatPiece, MatrixLayout

__all__ = [
    "NCCL_START_ALIGNMENT_FACTOR",
    "SUB_GROUP_SIZE",
    "round_robin_order",
    "zero12_offsets",
    "zero12_partition_size",
    "flat_pieces",
    "flat_fragments",
    "zero12_fragments",
    "zero3_partition_numel",
    "zero3_fragments",
    "zero3_sub_groups",
]

#: ``DeepSpeedZeroOptimizer.nccl_start_alignment_factor``: 4-byte alignment / sizeof(fp16)
NCCL_START_ALIGNMENT_FACTOR = 2
#: ``zero_optimization.sub_group_size`` default (``DeepSpeedZeroConfig``)
SUB_GROUP_SIZE = 1_000_000_000


def round_robin_order(count: int, world: int) -> list[int]:
    """``DeepSpeedZeroOptimizer._round_robin_reorder``: the new order of ``count`` parameters (indices into the
    original order) when ``round_robin_gradients`` is on."""
    buckets: dict[int, list[int]] = {}
    for i in range(count):
        buckets.setdefault(i % world, []).append(i)
    return [i for j in buckets for i in buckets[j]]


def zero12_offsets(numels: Sequence[int], param_alignment: int = 1) -> tuple[list[int], int]:
    """Start of each parameter in a ZeRO-1/2 flat group (``round_robin_bit16_offsets``) and the group's
    length before the final alignment (each parameter but the last is padded to ``param_alignment``)."""
    offsets, cursor = [], 0
    for i, n in enumerate(numels):
        offsets.append(cursor)
        cursor += int(n)
        if i != len(numels) - 1:
            cursor += (-cursor) % param_alignment
    return offsets, cursor


def zero12_partition_size(padded_numel: int, world: int, alignment_factor: int = NCCL_START_ALIGNMENT_FACTOR) -> int:
    """Elements of each rank's partition: the flat buffer (``align_dense_tensors``) is padded to a multiple of
    ``alignment_factor x world`` and split evenly (``get_data_parallel_partitions``)."""
    alignment = alignment_factor * world
    total = -(-padded_numel // alignment) * alignment
    return total // world


def flat_pieces(start: int, numel: int, partition: int, world: int) -> list[FlatPiece]:
    """Every rank's piece of a parameter occupying ``[start, start + numel)`` of a flat buffer cut into
    ``world`` parts of ``partition`` elements (pieces relative to the parameter; ranks before it hold
    ``[0, 0)``, ranks after it ``[numel, numel)``). O(ranks it spans) work beyond the list itself."""
    if numel <= 0 or partition <= 0:
        return [
            FlatPiece(
                min(max(start, r * partition), start + numel) - start,
                max(min(start + numel, (r + 1) * partition), min(max(start, r * partition), start + numel)) - start,
            )
            for r in range(world)
        ]
    first = min(max(start // partition, 0), world - 1)
    last = min(max((start + numel - 1) // partition, 0), world - 1)
    pieces = [FlatPiece(0, 0)] * first
    for r in range(first, last + 1):
        a = min(max(start, r * partition), start + numel)
        b = max(min(start + numel, (r + 1) * partition), a)
        pieces.append(FlatPiece(a - start, b - start))
    pieces += [FlatPiece(numel, numel)] * (world - last - 1)
    return pieces


def flat_fragments(
    names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    offsets: Sequence[int],
    partition: int,
    world: int,
    rank: int,
    group: Any = None,
) -> list[Fragment]:
    """Fragments of parameters (``names``, logical ``shapes``) concatenated at ``offsets`` into a flat buffer
    cut into ``world`` parts of ``partition`` elements; ``rank``'s flat partition holds the local pieces
    (ZeRO-1/2 and the bf16 ZeRO-1 wrapper)."""
    frags = []
    lo_mine = rank * partition
    for name, logical, start in zip(names, shapes, offsets):
        logical = tuple(int(s) for s in logical)
        shape = matrix_shape(logical)
        numel = shape[0] * shape[1]
        layout = MatrixLayout(shape, flat_pieces(int(start), numel, partition, world), rank, group)
        offset = max(start, lo_mine) - lo_mine if layout.local_numel else 0
        frags.append(Fragment(name, layout, offset, logical))
    return frags


def zero12_fragments(
    names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    world: int,
    rank: int,
    group: Any = None,
    round_robin: bool = False,
    parameter_alignment: bool = False,
    element_size: int = 2,
) -> tuple[list[Fragment], int]:
    """One ZeRO-1/2 param group's fragments on ``rank`` and its partition size (elements of each rank's flat
    fp32 tensor), from the trainable parameters' names and shapes in param-group order.
    ``element_size``: bytes per element of the model's (bit16) parameters, for ``parameter_alignment``."""
    order = round_robin_order(len(names), world) if round_robin else list(range(len(names)))
    names = [names[i] for i in order]
    shapes = [tuple(shapes[i]) for i in order]
    numels = [math.prod(s) for s in shapes]
    param_alignment = 16 // math.gcd(16, element_size) if parameter_alignment else 1
    offsets, padded = zero12_offsets(numels, param_alignment)
    partition = zero12_partition_size(padded, world)
    return flat_fragments(names, shapes, offsets, partition, world, rank, group), partition


def zero3_partition_numel(numel: int, world: int) -> int:
    """``partition_numel()`` of a ZeRO-3 parameter: its numel padded to a multiple of ``world``, over ``world``."""
    return -(-int(numel) // world)


def zero3_sub_groups(partition_numels: Sequence[int], sub_group_size: int = SUB_GROUP_SIZE) -> list[list[int]]:
    """``DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups``: indices of the parameters in each sub-group."""
    if sub_group_size is None or sub_group_size >= sum(partition_numels):
        return [list(range(len(partition_numels)))]
    groups, current, size = [], [], 0
    for i, n in enumerate(partition_numels):
        current.append(i)
        size += n
        if size >= sub_group_size or i == len(partition_numels) - 1:
            groups.append(current)
            current, size = [], 0
    return groups


def zero3_fragments(
    names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    world: int,
    rank: int,
    group: Any = None,
    partition_numels: Sequence[int] | None = None,
) -> tuple[list[Fragment], int]:
    """Fragments of one ZeRO-3 sub-group's flat fp32 tensor on ``rank`` and its length: each parameter is cut
    into ``world`` parts of ``partition_numel`` elements (default: ``zero3_partition_numel``; the adapter passes
    the engine's own values), and the sub-group's tensor concatenates this rank's parts."""
    frags, cursor = [], 0
    for i, (name, logical) in enumerate(zip(names, shapes)):
        logical = tuple(int(s) for s in logical)
        shape = matrix_shape(logical)
        numel = shape[0] * shape[1]
        part = int(partition_numels[i]) if partition_numels is not None else zero3_partition_numel(numel, world)
        pieces = [FlatPiece(min(r * part, numel), min((r + 1) * part, numel)) for r in range(world)]
        frags.append(Fragment(name, MatrixLayout(shape, pieces, rank, group), cursor, logical))
        cursor += part
    return frags, cursor
