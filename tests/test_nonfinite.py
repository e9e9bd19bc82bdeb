"""Non-finite gradients: skip (default) leaves parameters and state untouched; raise raises."""

from __future__ import annotations

import pytest
import torch
from tiny_model import Tiny
from torch import nn

import shardopt
from shardopt.optim import OPTIMIZERS


def step(model, opt, seed, poison=None):
    x = torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(seed))
    opt.zero_grad()
    nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    if poison is not None:
        dict(model.named_parameters())[poison].grad.view(-1)[0] = poison_value
    opt.step()


poison_value = float("nan")


def snapshot(model, opt):
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {
        id(p): {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items() if k != "matrices"}
        for p, st in opt.state.items()
    }
    return params, state


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("bad", ["proj.weight", "norm.bias", "lm_head.weight"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_skip_leaves_everything_untouched(name, bad, value):
    global poison_value
    poison_value = value
    torch.manual_seed(0)
    model = Tiny()
    opt = shardopt.create_optimizer(model, name)
    step(model, opt, 0)
    before = snapshot(model, opt)
    with pytest.warns(RuntimeWarning, match="skipped step with non-finite gradients"):
        step(model, opt, 1, poison=bad)
    after = snapshot(model, opt)
    assert opt.skipped_steps == 1
    for n in before[0]:
        assert torch.equal(before[0][n], after[0][n]), n
    for pid in before[1]:
        for k, v in before[1][pid].items():
            assert torch.equal(v, after[1][pid][k]) if isinstance(v, torch.Tensor) else v == after[1][pid][k]
    step(model, opt, 2)  # training continues normally
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_raise_names_the_parameter():
    model = Tiny()
    opt = shardopt.create_optimizer(model, "racs", on_nonfinite="raise")
    with pytest.raises(FloatingPointError, match="proj.weight"):
        step(model, opt, 0, poison="proj.weight")


@pytest.mark.parametrize(
    "wrapper,dtype,check,norm,skips",
    [
        ("zero12", torch.float32, False, True, True),  # the global norm DeepSpeed computes by default: invalid -> skip
        ("zero12", torch.float16, True, True, True),  # fp16: DeepSpeed's overflow check
        ("zero12", torch.bfloat16, False, True, False),  # bf16: DeepSpeed steps through an invalid norm, we check
        ("zero12", torch.bfloat16, True, True, True),  # bf16 with check_grad_overflow
        ("zero12", torch.float32, False, False, False),  # compute_grad_norm disabled
        ("zero3", torch.float32, False, True, True),
        ("bf16_zero1", torch.bfloat16, False, True, True),
    ],
)
def test_deepspeed_wrappers_that_skip_nonfinite_steps_themselves(wrapper, dtype, check, norm, skips):
    """Where DeepSpeed skips a non-finite step on every rank before calling the optimizer, ours would only
    repeat that decision with one more all-reduce per call: the adapter turns it off exactly there."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from shardopt.plugin.deepspeed_engine import _skips_nonfinite_steps

    cls = {"zero12": DeepSpeedZeroOptimizer, "zero3": DeepSpeedZeroOptimizer_Stage3, "bf16_zero1": BF16_Optimizer}
    w = object.__new__(cls[wrapper])
    w.__dict__.update(dtype=dtype, check_grad_overflow=check, compute_grad_norm=norm)
    assert _skips_nonfinite_steps(w) is skips
    assert _skips_nonfinite_steps(object()) is False  # stage 0: the engine steps our optimizer directly
