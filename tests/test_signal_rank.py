"""``signal_rank`` (issue 63): SUMO's refresh and Alice's switch leave out, as zero columns until the next one, the
directions of a new basis whose singular values are at the gradient precision's rounding, instead of completing
them from seeded draws that the orthogonalized or Adam-normalized step would weigh like signal."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import shardopt
from shardopt.sharding.precision import record_arrival_dtypes

RULES = {
    "sumo": dict(lr=0.02, rank=8, refresh_interval=2),
    "alice": dict(lr=0.02, rank=8, leading=8, refresh_interval=2),
    "alice0": dict(lr=0.02, rank=8, leading=8, refresh_interval=2),
}
BASIS = {"sumo": "Q", "alice": "U", "alice0": "U"}
#: the step of the second switch at refresh_interval 2: Alice at steps 1, 2, 4, ..., SUMO at steps 1, 3, 5, ...
SECOND = {"sumo": 3, "alice": 2, "alice0": 2}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 16, bias=False), nn.Linear(16, 12, bias=False))


def _grads(model: nn.Module, step: int, rank: int | None, bf16: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    out = []
    for p in model.parameters():
        m, n = p.shape
        k = min(m, n) if rank is None else rank
        grad = torch.randn(m, k, generator=g) @ torch.randn(k, n, generator=g)
        out.append(grad.bfloat16().float() if bf16 else grad)  # a gradient that arrived in bf16
    return out


def _run(
    name: str, steps: int, rank: int | None, bf16: bool, **options
) -> tuple[list[torch.Tensor], nn.Module, object]:
    model = _model()
    opt = shardopt.create_optimizer(model, name, routing={"*": "matrix"}, **RULES[name], **options)
    if bf16:
        record_arrival_dtypes(opt, {n: torch.bfloat16 for n, _ in model.named_parameters()})
    for step in range(steps):
        for p, g in zip(model.parameters(), _grads(model, step, rank if step == 0 else None, bf16)):
            p.grad = g
        opt.step()
    return [p.detach().clone() for p in model.parameters()], model, opt


def _kept(opt, model: nn.Module, key: str) -> list[int]:
    return [int((opt.state[p][key].square().sum(-2) > 0).sum()) for p in model.parameters()]


@pytest.mark.parametrize("name", sorted(RULES))
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_full_rank_gradients_unchanged_bit_for_bit(name: str, bf16: bool) -> None:
    """Every direction of a full-rank gradient is signal: the option changes nothing, bit for bit."""
    want = _run(name, 5, None, bf16)[0]
    got = _run(name, 5, None, bf16, signal_rank=True)[0]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("name", sorted(RULES))
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_rank_deficient_first_gradient_leaves_the_rest_out_until_the_next_switch(name: str, bf16: bool) -> None:
    """A rank-3 gradient at step 1 (rank 8 subspaces): 3 directions kept, 5 zero columns (completed from seeded
    draws without the option); the next switch, on a full-rank gradient, brings all 8 back."""
    key = BASIS[name]
    _, model, opt = _run(name, 1, 3, bf16, signal_rank=True)
    assert _kept(opt, model, key) == [3, 3]
    _, model, opt = _run(name, 1, 3, bf16)
    assert _kept(opt, model, key) == [8, 8]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing non-finite from the zero columns
        params, model, opt = _run(name, SECOND[name], 3, bf16, signal_rank=True)
    assert _kept(opt, model, key) == [8, 8]
    assert all(bool(torch.isfinite(p).all()) for p in params)
