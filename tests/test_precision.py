"""``matrix_ops.precision`` (``shardopt.sharding.precision``): low-precision whole-matrix iterations as a documented
policy. Each route is checked against the float64 oracle within its documented tolerance on the CPU (bf16 runs as
is, TF32 is emulated by rounding operands to 10 mantissa bits); the CPU default stays the ieee route; rules without a
low-precision route refuse one instead of ignoring it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardopt
from shardopt.sharding.matfun import MUON_COEFFICIENTS, newton_schulz
from shardopt.sharding.precision import AUTO_CUDA, matmul_in, resolve_precision, round_tf32

#: documented tolerances of Muon's fixed 5-step quintic iteration against the same iteration in float64 (relative
#: Frobenius error of the result; its output is only near-orthogonal by design, so there is nothing to polish)
MUON_RTOL = {"tf32": 5e-3, "bf16": 5e-2}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(a.double() - b.double()).max() / torch.linalg.matrix_norm(b.double()).max())


def test_auto_is_ieee_on_the_cpu_and_the_rule_choice_on_cuda():
    for rule in ("muon", "swan", "asgo", "sumo", "alice", "racs"):
        assert resolve_precision("auto", rule, "cpu") == "ieee"
        assert resolve_precision("auto", rule, "cuda") == AUTO_CUDA.get(rule, "ieee")
        assert resolve_precision("tf32", rule, "cpu") == "tf32"
    assert AUTO_CUDA == {"muon": "bf16"}
    with pytest.raises(ValueError, match="matrix_ops.precision"):
        resolve_precision("fp8", "muon", "cpu")
    with pytest.raises(Exception, match="precision"):
        shardopt.create_optimizer(nn.Linear(4, 4), "muon", matrix_ops={"precision": "fp8"})


@pytest.mark.parametrize("name", ["swan", "asgo", "sumo", "alice", "alice0"])
def test_rules_without_a_low_precision_route_refuse_one(name: str):
    with pytest.raises(ValueError, match="has no low-precision route"):
        shardopt.create_optimizer(nn.Linear(4, 4), name, matrix_ops={"precision": "bf16"})
    shardopt.create_optimizer(nn.Linear(4, 4), name, matrix_ops={"precision": "ieee"})


def test_tf32_rounding_keeps_ten_mantissa_bits_to_nearest_even():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10000, generator=gen) * 10.0 ** torch.randint(-20, 20, (10000,), generator=gen)
    r = round_tf32(x)
    assert torch.all(r.view(torch.int32) & 0x1FFF == 0)  # the 13 dropped bits are zero
    assert torch.all((r.double() - x.double()).abs() <= x.double().abs() * 2.0**-11)  # half a TF32 ulp
    ties = torch.tensor([1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11])  # halfway: to the even neighbour
    assert round_tf32(ties).tolist() == [1.0, 1.0 + 2 * 2.0**-10]
    special = round_tf32(torch.tensor([float("inf"), -float("inf"), float("nan")]))
    assert special[0] == float("inf") and special[1] == -float("inf") and torch.isnan(special[2])
    a, b = torch.randn(3, 8, 8, generator=gen), torch.randn(3, 8, 8, generator=gen)
    assert torch.equal(matmul_in("tf32")(a, b), round_tf32(a) @ round_tf32(b))


@pytest.mark.parametrize("precision", ["bf16", "tf32"])
def test_muon_iteration_at_low_precision_stays_near_the_float64_one(precision: str):
    g = torch.randn(4, 32, 48, generator=torch.Generator().manual_seed(4))
    oracle = newton_schulz(g.double(), 5, MUON_COEFFICIENTS, 1e-7, torch.float64)
    if precision == "bf16":
        got = newton_schulz(g, 5, MUON_COEFFICIENTS, 1e-7, torch.bfloat16)
    else:
        got = newton_schulz(g, 5, MUON_COEFFICIENTS, 1e-7, torch.float32, matmul_in("tf32"))
    assert _rel(got, oracle) <= MUON_RTOL[precision]
    ieee = newton_schulz(g, 5, MUON_COEFFICIENTS, 1e-7, torch.float32)
    assert _rel(ieee, oracle) <= 1e-5  # the ieee route, for scale


def _train(matrix_ops: dict | None = None, **kw) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 32), nn.ReLU(), nn.Linear(32, 16))
    opt = shardopt.create_optimizer(model, "muon", lr=0.01, **({"matrix_ops": matrix_ops} if matrix_ops else {}), **kw)
    for s in range(3):
        x = torch.randn(8, 24, generator=torch.Generator().manual_seed(s))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_muon_precisions_end_to_end():
    default = _train()
    ieee = _train({"strategy": "gather", "precision": "ieee"})
    assert all(torch.equal(a, b) for a, b in zip(default, ieee))  # the CPU default is the ieee route
    bf16 = _train({"strategy": "gather", "precision": "bf16"})
    assert all(torch.equal(a, b) for a, b in zip(bf16, _train(ns_dtype="bfloat16")))  # torch.optim.Muon's iteration
    tf32 = _train({"strategy": "gather", "precision": "tf32"})
    with pytest.raises(ValueError, match="ask for different iterations"):  # never one silently over the other
        _train({"precision": "tf32"}, ns_dtype="float32")
    assert all(torch.equal(a, b) for a, b in zip(_train({"precision": "tf32"}), tf32))  # Muon keeps gather
    for run in (bf16, tf32):  # 3 steps of lr 0.01 x an update of RMS ~0.2: low precision moves them by far less
        assert max((a - b).abs().max().item() for a, b in zip(run, ieee)) <= 2e-3
