"""``shardopt.checkpoint.save/load(..., model=)``: frozen parameters and persistent buffers travel with the
optimizer's state (issue 55), one process; FSDP2 at other world sizes: ``tests_dist/test_checkpoint_fsdp2.py``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardopt
import shardopt.checkpoint as sckpt


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.tied_a = nn.Linear(8, 8, bias=False)
        self.tied_b = nn.Linear(8, 8, bias=False)
        self.tied_b.weight = self.tied_a.weight
        self.register_buffer("shift", torch.randn(8))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.tied_b(torch.tanh(self.tied_a(self.frozen(torch.tanh(self.fc(x)) + self.shift))))


def trained(seed: int = 0):
    torch.manual_seed(seed)
    model = Net()
    opt = shardopt.create_optimizer(model, "scale", lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 6)).pow(2).mean().backward()
        opt.step()
    return model, opt


def fresh(seed: int = 7):
    torch.manual_seed(seed)
    model = Net()
    return model, shardopt.create_optimizer(model, "scale", lr=1e-2)


def test_model_state_comes_back_with_the_optimizer(tmp_path) -> None:
    model, opt = trained()
    sckpt.save(str(tmp_path), opt, model=model)
    other, other_opt = fresh()
    sckpt.load(str(tmp_path), other_opt, model=other)
    for name, value in model.state_dict().items():
        assert torch.equal(other.state_dict()[name], value), name
    assert int(other.calls) == 3 and other.calls.dtype == torch.long
    assert other.tied_b.weight is other.tied_a.weight
    mine, _ = sckpt.export_state(opt)
    theirs, _ = sckpt.export_state(other_opt)
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(theirs[k], v) for k, v in mine.items())


def test_without_saved_model_state_strict_refuses_and_changes_nothing(tmp_path) -> None:
    model, opt = trained()
    sckpt.save(str(tmp_path), opt)
    other, other_opt = fresh()
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(
        sckpt.CheckpointError,
        match=r"no saved value for \['frozen.weight', 'frozen.bias', 'shift', "
        r"'calls'\].*strict=False",
    ):
        sckpt.load(str(tmp_path), other_opt, model=other)
    assert all(torch.equal(other.state_dict()[k], v) for k, v in before.items())
    sckpt.load(str(tmp_path), other_opt, model=other, strict=False)
    assert torch.equal(other.frozen.weight, before["frozen.weight"]) and torch.equal(other.shift, before["shift"])
    assert torch.equal(other.fc.weight, model.fc.weight)


def test_load_state_false_loads_the_model_only(tmp_path) -> None:
    model, opt = trained()
    sckpt.save(str(tmp_path), opt, model=model)
    other, other_opt = fresh()
    sckpt.load(str(tmp_path), other_opt, model=other, load_state=False)
    assert torch.equal(other.frozen.weight, model.frozen.weight) and torch.equal(other.fc.weight, model.fc.weight)
    assert not other_opt.state


def test_conversion_to_dcp_carries_frozen_weights_and_buffers(tmp_path) -> None:
    from shardopt.checkpoint.convert import read

    model, opt = trained()
    sckpt.save(str(tmp_path / "ck"), opt, model=model)
    tensors = read(str(tmp_path / "ck")).tensors
    for name in ("frozen.weight", "frozen.bias", "shift", "calls", "fc.weight", "tied_a.weight"):
        assert torch.equal(tensors[f"{name}::param"].reshape(-1), model.state_dict()[name].float().reshape(-1)), name
