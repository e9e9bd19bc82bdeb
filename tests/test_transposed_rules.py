"""Transposed storage for every rule (issue 52, item 4): a weight stored in x out (transformers' ``Conv1D``, role
``matrix_transposed``; fused experts with ``is_transposed``: tests/test_fused_experts.py) is stepped by every rule
as its logical out x in matrix.

The reference is the same weights as ``nn.Linear`` (out x in) with the same gradients transposed: step after step the
stored weights equal the transpose of the Linear ones, and the state means the same (per-line and small state equal,
element-wise state transposed), for a wide, a tall and a square matrix (a square one is where a rule that orients
by shape must break its tie on the logical side). No rule refuses GPT-2.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from transformers.pytorch_utils import Conv1D  # noqa: E402

import shardopt  # noqa: E402
from shardopt.optim.registry import OPTIMIZERS  # noqa: E402
from shardopt.optim.routing import param_roles  # noqa: E402

#: (out, in) of the logical matrices: wide, tall, square
SHAPES = {"wide": (12, 20), "tall": (20, 12), "square": (16, 16)}
#: hyperparameters that make every rule do its whole-matrix work within the steps (SUMO refreshes, Alice switches)
OPTIONS = {
    "sumo": {"rank": 3, "refresh_interval": 2},
    "alice": {"rank": 3, "leading": 1, "refresh_interval": 2},
    "alice0": {"rank": 3, "leading": 1, "refresh_interval": 2},
    "asgo": {"refresh_interval": 2},
}
STEPS = 3


def twins() -> tuple[nn.ModuleDict, nn.ModuleDict]:
    """The same matrices as Linears (out x in) and as Conv1Ds (stored in x out), named alike (names key SUMO's and
    Alice's seeded draws); the Conv1D biases are frozen (the Linears have none)."""
    torch.manual_seed(0)
    linear = nn.ModuleDict({k: nn.Linear(i, o, bias=False) for k, (o, i) in SHAPES.items()})
    conv = nn.ModuleDict({k: Conv1D(o, i) for k, (o, i) in SHAPES.items()})
    with torch.no_grad():
        for k, m in conv.items():
            m.weight.copy_(linear[k].weight.T)
            m.bias.requires_grad_(False)
    return linear, conv


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_stored_in_x_out_steps_as_the_transpose(name: str) -> None:
    linear, conv = twins()
    assert all(r == "matrix_transposed" for n, r in param_roles(conv).items() if n.endswith("weight"))
    opt_linear = shardopt.create_optimizer(linear, name, **OPTIONS.get(name, {}))
    opt_conv = shardopt.create_optimizer(conv, name, **OPTIONS.get(name, {}))
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        for k, (o, i) in SHAPES.items():
            g = torch.randn(o, i, generator=gen)
            linear[k].weight.grad = g.clone()
            conv[k].weight.grad = g.T.contiguous()
        opt_linear.step()
        opt_conv.step()
        for k in SHAPES:
            diff = (conv[k].weight.detach().T - linear[k].weight.detach()).abs().max().item()
            assert diff <= 1e-6, f"{name} step {step + 1}, {k}: stored in x out {diff:.2e} from the transposed Linear"
    moved = max((linear[k].weight.detach() - twins()[0][k].weight).abs().max().item() for k in SHAPES)
    assert moved > 1e-4, "the weights did not train"
    for k in SHAPES:  # the state means the same: per-line and small state equal, element-wise state transposed
        want, got = opt_linear.state[linear[k].weight], opt_conv.state[conv[k].weight]
        assert sorted(want) == sorted(got), k
        for key, value in want.items():
            if not isinstance(value, torch.Tensor):
                continue
            stored = got[key]
            if opt_conv.state_kinds.get(key) == "elements":
                stored = stored.T  # element-wise, stored like its weight
            assert stored.shape == value.shape, (k, key)
            scale = value.abs().max().clamp_min(1e-30)
            assert ((stored - value).abs().max() / scale).item() <= 1e-5, f"{name} {k} state {key!r}"


def tiny_gpt2() -> nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32)
    )


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_gpt2_builds_for_every_rule(name: str) -> None:
    """No rule refuses GPT-2: every Conv1D weight gets the matrix rule on its logical axes (the group option
    ``transposed``; SCALE's per-output-unit ``norm_dim`` of the stored weight), and a step trains it."""
    model = tiny_gpt2()
    opt = shardopt.create_optimizer(model, name, **OPTIONS.get(name, {}))
    convs = {f"{n}.weight": m.weight for n, m in model.named_modules() if isinstance(m, Conv1D)}
    assert len(convs) == 8
    for n, w in convs.items():
        group = next(g for g in opt.param_groups if any(p is w for p in g["params"]))
        assert group["treatment"] == name, n
        assert group.get("transposed") or (name == "scale" and group["norm_dim"] == 0), n
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    before = {n: w.detach().clone() for n, w in convs.items()}
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert all((w.detach() - before[n]).abs().max() > 0 for n, w in convs.items())
