"""shardopt's part of legacy FSDP checkpoints through the Hugging Face Trainer and accelerate
(``integrations.accelerate.fsdp1_optimizer_io``): inside the block, the ``save_fsdp_optimizer`` /
``load_fsdp_optimizer`` that ``transformers.trainer`` and ``accelerate.accelerator`` call write and read a shardopt
optimizer's logical state (never FSDP1's optimizer state dict, which shardopt refuses), hand anything else to
accelerate's functions, and are restored afterwards. One process: the FSDP1 layouts themselves are checked in
``tests_dist/test_fsdp1.py`` (the same ``shardopt.checkpoint`` files resume exactly there); accelerate's FSDP1 model
save does not run on the CPU, so the Trainer's whole save is a GPU path."""

from __future__ import annotations

import sys
import types

import torch
from torch import nn

import shardopt
from shardopt.integrations.accelerate import FSDP1_OPTIMIZER_DIR, fsdp1_optimizer_io


class AcceleratedOptimizer:
    """accelerate's wrapper: the optimizer under ``.optimizer``."""

    def __init__(self, optimizer):
        self.optimizer = optimizer


def _trained(steps: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))
    opt = shardopt.create_optimizer(model, "racs", lr=0.01)
    for s in range(steps):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(s))
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
    return model, opt


def test_fsdp1_optimizer_io_writes_and_reads_shardopt_state(tmp_path, monkeypatch):
    calls = []
    fake = types.ModuleType("fake_trainer_module")
    fake.save_fsdp_optimizer = lambda *a, **k: calls.append(("save", a[0].fsdp_version))
    fake.load_fsdp_optimizer = lambda *a, **k: calls.append(("load", a[0].fsdp_version))
    original = fake.save_fsdp_optimizer, fake.load_fsdp_optimizer
    monkeypatch.setitem(sys.modules, "fake_trainer_module", fake)
    v1, v2 = types.SimpleNamespace(fsdp_version=1), types.SimpleNamespace(fsdp_version=2)

    _, opt = _trained(3)
    with fsdp1_optimizer_io("fake_trainer_module"):
        fake.save_fsdp_optimizer(v1, None, AcceleratedOptimizer(opt), None, str(tmp_path))
        fake.save_fsdp_optimizer(v2, None, AcceleratedOptimizer(opt), None, str(tmp_path))  # FSDP2: accelerate's
    assert (fake.save_fsdp_optimizer, fake.load_fsdp_optimizer) == original  # restored
    assert (tmp_path / f"{FSDP1_OPTIMIZER_DIR}_0").is_dir() and calls == [("save", 2)]

    model, fresh = _trained(0)
    with fsdp1_optimizer_io("fake_trainer_module"):
        fake.load_fsdp_optimizer(v1, None, AcceleratedOptimizer(fresh), model, str(tmp_path))
    assert calls == [("save", 2)]
    want = {n: t for n, t in opt.state_dict()["state"].items()}
    got = fresh.state_dict()["state"]
    assert want.keys() == got.keys()
    for key, entries in want.items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, got[key][name]), (key, name)


def test_fsdp1_optimizer_io_leaves_other_optimizers_to_accelerate(tmp_path, monkeypatch):
    calls = []
    fake = types.ModuleType("fake_accelerate_module")
    fake.save_fsdp_optimizer = lambda *a, **k: calls.append("save")
    fake.load_fsdp_optimizer = lambda *a, **k: calls.append("load")
    monkeypatch.setitem(sys.modules, "fake_accelerate_module", fake)
    adamw = torch.optim.AdamW(nn.Linear(2, 2).parameters())
    with fsdp1_optimizer_io("fake_accelerate_module"):
        fake.save_fsdp_optimizer(types.SimpleNamespace(fsdp_version=1), None, adamw, None, str(tmp_path))
        fake.load_fsdp_optimizer(types.SimpleNamespace(fsdp_version=1), None, adamw, None, str(tmp_path))
    assert calls == ["save", "load"] and not any(tmp_path.iterdir())
