"""The cache-blocked CPU passes (``sharding.row_passes``) against the unblocked kernels they replace.

SinkGD and RACS take ``row_block_pass`` / ``scaled_update``, SCALE ``row_normalized_update``, where every row
is whole on the rank, and DASGO ``lerp_col_energies`` on whole matrices; the kernels of
the sharded layouts (``rows_complete`` False) are the reference. Blocks small enough to be stacked and blocks
large enough to be listed, cut into several row blocks (``CHUNK_ELEMENTS`` made small), with weight decay, a
zero row and a zero column, a skipped step decided on the device, and a matrix without a gradient (the update's
fallback): equal to fp32 rounding over 3 steps."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

import shardopt
from shardopt.optim import racs, scale, sinkgd
from shardopt.sharding import row_passes

OPTIONS = {
    "sinkgd": dict(weight_decay=0.1),
    "racs": dict(weight_decay=0.1),
    "scale": dict(weight_decay=0.1, momentum=0.5),
    "dasgo": dict(weight_decay=0.1),
}
MODULES = {"sinkgd": sinkgd, "racs": racs, "scale": scale}


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 300 x 260 and 260 x 300: listed blocks (>= 64K elements); 24 x 40: stacked with its twin
    return nn.Sequential(
        nn.Linear(260, 300, bias=False),
        nn.Linear(300, 260, bias=False),
        nn.Linear(40, 24, bias=False),
        nn.Linear(40, 24, bias=False),
    )


#: where each rule calls its fused pass: (module, name), spied on to prove the fused run took it
ENTRY = {
    "sinkgd": ("shardopt.optim.sinkgd", "row_block_pass"),
    "racs": ("shardopt.optim.racs", "row_block_pass"),
    "scale": ("shardopt.optim.grouped", "row_normalized_update"),
    "dasgo": ("shardopt.optim.asgo", "lerp_col_energies"),
}


def _train(name: str, fused: bool, skip_grad: bool = False) -> tuple[list[torch.Tensor], int]:
    calls = [0]
    with pytest.MonkeyPatch.context() as mp:
        if fused:
            module, attr = ENTRY[name]
            real = getattr(importlib.import_module(module), attr)

            def spy(*args, **kwargs):
                calls[0] += 1
                return real(*args, **kwargs)

            mp.setattr(f"{module}.{attr}", spy)
        else:
            if hasattr(MODULES.get(name), "rows_complete"):
                mp.setattr(MODULES[name], "rows_complete", lambda blocks: False)
            mp.setattr(row_passes, "rows_complete", lambda blocks: False)
            mp.setattr(shardopt.DASGO, "_one_pass_momentum", lambda self, group: False)
        mp.setattr(row_passes, "CHUNK_ELEMENTS", 7 * 260)  # several row blocks per listed matrix
        model = _model()
        opt = shardopt.create_optimizer(model, name, routing={"*": "matrix"}, **OPTIONS[name])
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            for k, p in enumerate(model.parameters()):
                p.grad = torch.randn(p.shape, generator=g)
                p.grad[3] = 0.0  # a zero row: a zero scale, never NaN
                p.grad[:, 5] = 0.0
                if skip_grad and k == 2:
                    p.grad = None
            opt.step()
    return [p.detach().clone() for p in model.parameters()], calls[0]


@pytest.mark.parametrize("name", sorted(OPTIONS))
@pytest.mark.parametrize("skip_grad", [False, True])
def test_row_blocked_steps_equal_the_unblocked_kernels(name, skip_grad):
    want, _ = _train(name, False, skip_grad)
    got, calls = _train(name, True, skip_grad)
    if not (skip_grad and name in ("scale", "dasgo")):  # these fuse only where every matrix has a gradient
        assert calls, f"{name}: the fused pass was not taken"
    for a, b in zip(got, want):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_passes_cover_every_row_once(monkeypatch):
    """``row_block_pass`` on listed and stacked blocks: the row sums, the row scale and the column sums equal
    the direct products with ``P = X * X``."""
    from shardopt.sharding.block_groups import BlockGroups
    from shardopt.sharding.layout import MatrixLayout

    monkeypatch.setattr(row_passes, "CHUNK_ELEMENTS", 5 * 300)
    shapes = [(300, 260), (24, 40), (24, 40)]
    blocks = BlockGroups([MatrixLayout.whole(s) for s in shapes])
    xs = [torch.randn(s) for s in shapes]
    w = torch.rand(blocks.n_cols)
    stacks = blocks.stack(xs)
    (r,), u, c = row_passes.row_block_pass(blocks, stacks, [w], lambda s, rows: 2.0 * s)
    assert u is not None and c is not None
    row, col = 0, 0
    for x in xs:
        m, n = x.shape
        p = x * x
        want_r = p @ w[col : col + n]
        torch.testing.assert_close(r[row : row + m], want_r)
        torch.testing.assert_close(u[row : row + m], 2.0 * want_r)
        torch.testing.assert_close(c[col : col + n], p.T @ (2.0 * want_r))
        row, col = row + m, col + n
