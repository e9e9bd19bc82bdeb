"""The Megatron-core adapter's pure parts (``shardopt.plugin.megatron_engine``): what it refuses, before any collective,
naming the setting; and the ``ColFlatPiece`` layout of a row-parallel weight's shard cut flat by the distributed
optimizer. The engine itself runs in ``tests_dist/test_megatron.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from shardopt.checkpoint.files import _piece, piece_spec
from shardopt.plugin.megatron_engine import MegatronError, _tp_pieces, refuse_unsupported
from shardopt.plugin.zero_layouts import flat_pieces
from shardopt.sharding.layout import ColFlatPiece, FlatPiece, MatrixLayout, _blocks_of


def optimizer_config(**overrides):
    base = dict(
        use_distributed_optimizer=True,
        fp16=False,
        bf16=False,
        use_precision_aware_optimizer=False,
        optimizer_cpu_offload=False,
        overlap_param_gather_with_optimizer_step=False,
        reuse_grad_buf_for_mxfp8_param_ag=False,
        fp8_recipe=None,
    )
    return SimpleNamespace(**{**base, **overrides})


class Chunk(nn.Module):
    """What the adapter reads of Megatron's DistributedDataParallel: ``ddp_config`` and ``buffers``."""

    def __init__(self, **ddp):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.ddp_config = SimpleNamespace(
            **{
                "use_distributed_optimizer": True,
                "use_megatron_fsdp": False,
                "num_distributed_optimizer_instances": 1,
                **ddp,
            }
        )
        self.buffers = []
        self.expert_parallel_buffers = []


def test_supported_settings_pass() -> None:
    refuse_unsupported(optimizer_config(), [Chunk()])
    refuse_unsupported(optimizer_config(bf16=True), [Chunk()])


@pytest.mark.parametrize(
    "config, chunk, setting",
    [
        (dict(use_distributed_optimizer=False), {}, "OptimizerConfig.use_distributed_optimizer"),
        ({}, dict(use_distributed_optimizer=False), "DistributedDataParallelConfig.use_distributed_optimizer"),
        (dict(fp16=True), {}, "OptimizerConfig.fp16"),
        (dict(use_precision_aware_optimizer=True), {}, "OptimizerConfig.use_precision_aware_optimizer"),
        (dict(optimizer_cpu_offload=True), {}, "OptimizerConfig.optimizer_cpu_offload"),
        (
            dict(overlap_param_gather_with_optimizer_step=True),
            {},
            "OptimizerConfig.overlap_param_gather_with_optimizer_step",
        ),
        ({}, dict(use_megatron_fsdp=True), "DistributedDataParallelConfig.use_megatron_fsdp"),
        ({}, dict(num_distributed_optimizer_instances=2), "num_distributed_optimizer_instances"),
    ],
)
def test_unsupported_settings_are_named(config: dict, chunk: dict, setting: str) -> None:
    with pytest.raises(MegatronError, match=setting.replace(".", r"\.")):
        refuse_unsupported(optimizer_config(**config), [Chunk(**chunk)])


def test_plain_modules_and_expert_parallel_are_refused() -> None:
    with pytest.raises(MegatronError, match="DistributedDataParallel"):
        refuse_unsupported(optimizer_config(), [nn.Linear(2, 2)])
    chunk = Chunk()
    chunk.expert_parallel_buffers = [object()]
    with pytest.raises(MegatronError, match="expert"):
        refuse_unsupported(optimizer_config(), [chunk])
    with pytest.raises(MegatronError, match="model_chunks"):
        refuse_unsupported(optimizer_config(), [])


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("start, partition", [(0, 8), (5, 10), (3, 9), (0, 30)])
def test_tensor_parallel_shards_cut_flat_cover_the_matrix_once(dim: int, start: int, partition: int) -> None:
    """Every (tp, dp) rank's piece of an (m, n) weight split over 2 tensor-parallel ranks (rows: column-parallel,
    columns: row-parallel) and cut flat over 3 data-parallel ranks: the blocks tile the matrix exactly once."""
    m, n, tp, dp = 6, 8, 2, 3
    local = (m // tp, n) if dim == 0 else (m, n // tp)
    dp_pieces = flat_pieces(start, local[0] * local[1], partition, dp)
    coords = [(t, d) for t in range(tp) for d in range(dp)]
    pieces = _tp_pieces(dp_pieces, coords, dim, local)
    seen = torch.zeros(m, n, dtype=torch.int64)
    for rank in range(len(coords)):
        layout = MatrixLayout((m, n), pieces, rank)
        offset = 0
        for b in layout.blocks:
            assert b.offset == offset
            seen[b.row : b.row + b.height, b.col : b.col + b.width] += 1
            offset += b.height * b.width
        assert offset == layout.local_numel
    assert bool((seen == 1).all())
    if dim == 1:
        assert all(isinstance(p, ColFlatPiece) for p in pieces)


def test_colflat_piece_round_trips_through_the_checkpoint_index() -> None:
    piece = ColFlatPiece(4, 8, 3, 13)
    assert _piece(*piece_spec(piece)) == piece
    blocks = _blocks_of(piece, 5, 12)  # a 5 x 4 column block, elements 3..13: 1 + 2 rows + 1 element
    assert [(b.row, b.col, b.height, b.width) for b in blocks] == [(0, 7, 1, 1), (1, 4, 2, 4), (3, 4, 1, 1)]
    assert _blocks_of(FlatPiece(3, 13), 5, 4) == tuple(b._replace(col=b.col - 4) for b in blocks)
