"""Stacks for batched kernels (``sharding/stacking.py``)."""

from __future__ import annotations

import torch

from shardopt.sharding.stacking import stack, stack_stored


def test_stack_stored_keeps_transposed_blocks_in_their_memory_order():
    """Blocks of ``A = G^T`` assembled as ``G`` (transposed views of row-major matrices) are stacked as stored
    and viewed transposed: the values of ``torch.stack``, with ``G``'s rows contiguous in memory."""
    gs = [torch.randn(7, 3) for _ in range(3)]
    blocks = [g.T for g in gs]
    a = stack_stored(blocks)
    assert torch.equal(a, torch.stack(blocks))
    assert a.shape == (3, 3, 7) and a.mT.is_contiguous() and not a.is_contiguous()
    a.mT[0, 0, 0] = 99.0  # a copy, not a view of the blocks
    assert gs[0][0, 0] != 99.0


def test_stack_stored_of_row_major_or_mixed_blocks_is_a_plain_stack():
    plain = [torch.randn(3, 7) for _ in range(2)]
    assert stack_stored(plain).is_contiguous() and torch.equal(stack_stored(plain), torch.stack(plain))
    mixed = [torch.randn(3, 7), torch.randn(7, 3).T]
    assert stack_stored(mixed).is_contiguous() and torch.equal(stack_stored(mixed), torch.stack(mixed))


def test_a_stack_of_one_is_a_view():
    g = torch.randn(7, 3)
    for t in (g, g.T):
        s = stack_stored([t])
        assert s._base is not None and torch.equal(s[0], t)
        assert stack([t]).data_ptr() == t.data_ptr()
