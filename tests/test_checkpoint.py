"""Logical checkpoints in one process: round trip, atomic writes, truncated and incomplete files."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from tiny_model import Tiny
from torch import nn

import shardopt
import shardopt.checkpoint as ckpt
from shardopt.checkpoint import files
from shardopt.optim import OPTIMIZERS


def train(model, opt, steps, start=0):
    for s in range(start, start + steps):
        x = torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(s))
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()


def fresh(name):
    torch.manual_seed(0)
    model = Tiny()
    return model, shardopt.create_optimizer(
        model, name, routing={"embed.weight": "matrix"} if name != "scale" else None
    )


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_logical_round_trip_resumes_exactly(tmp_path, name):
    ref, ref_opt = fresh(name)
    train(ref, ref_opt, 6)
    model, opt = fresh(name)
    train(model, opt, 3)
    ckpt.save(str(tmp_path), opt)
    model2, opt2 = fresh(name)  # parameters come back from the checkpoint too
    ckpt.load(str(tmp_path), opt2)
    train(model2, opt2, 3, start=3)
    for (n, a), b in zip(ref.named_parameters(), model2.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=n)


def state_snapshot(opt):
    return {k: v.clone() for k, v in ckpt.export_state(opt)[0].items()}


def test_truncated_file_is_a_clear_error_and_loads_nothing(tmp_path):
    model, opt = fresh("racs")
    train(model, opt, 2)
    path = ckpt.save(str(tmp_path), opt)
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    model2, opt2 = fresh("racs")
    train(model2, opt2, 1)
    before = state_snapshot(opt2)
    with pytest.raises(ckpt.CheckpointError, match="corrupt or truncated"):
        ckpt.load(str(tmp_path), opt2)
    after = state_snapshot(opt2)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    proc = subprocess.run(
        [sys.executable, "-m", "shardopt", "checkpoint", "inspect", path], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "corrupt or truncated" in proc.stderr


def test_incomplete_file_names_the_missing_parameter(tmp_path):
    model, opt = fresh("scale")
    train(model, opt, 2)
    tensors, kinds = ckpt.export_state(opt)
    meta = {
        "kinds": kinds,
        "optimizer": "SCALE",
        "param_groups": [{} for _ in opt.param_groups],
        "world_size": 1,
        "engine": "torch",
        "extra": {},
    }
    partial = {k: v for k, v in tensors.items() if not k.startswith("proj.weight")}
    files.write_state_file(str(tmp_path / files.STATE_FILE), partial, {**meta, "keys": sorted(partial)})
    model2, opt2 = fresh("scale")
    before = {n: p.detach().clone() for n, p in model2.named_parameters()}
    with pytest.raises(ckpt.CheckpointError, match="'proj.weight'"):
        ckpt.load(str(tmp_path), opt2)
    for n, p in model2.named_parameters():
        assert torch.equal(before[n], p), n  # nothing half-loaded
    assert not opt2.state


def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model, opt = fresh("scale")
    train(model, opt, 1)
    path = ckpt.save(str(tmp_path), opt)
    good = open(path, "rb").read()
    import safetensors.torch

    def crash(tensors, filename, metadata=None):
        open(filename, "wb").write(b"partial")
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    train(model, opt, 1)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(str(tmp_path), opt)
    assert open(path, "rb").read() == good
    assert os.listdir(tmp_path) == [files.STATE_FILE]  # no temporary file left behind
    monkeypatch.undo()
    ckpt.load(str(tmp_path), fresh("scale")[1])


def test_files_are_safetensors_not_pickles(tmp_path):
    model, opt = fresh("racs")
    train(model, opt, 1)
    path = ckpt.save(str(tmp_path), opt)
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        assert f.read(1) == b"{" and header_len > 0


def test_groups_match_by_parameter_names_not_position(tmp_path):
    """An engine may list parameters, and so groups, in another order (legacy FSDP's flat parameters): each group
    takes the hyperparameters saved for its own parameters, and a file that gives them another rule is refused."""
    model, opt = fresh("scale")
    train(model, opt, 2)
    for g in opt.param_groups:
        g["lr"] = 0.5 if g["treatment"] == "adamw" else 0.25
    ckpt.save(str(tmp_path / "c"), opt)
    _, fresh_opt = fresh("scale")
    order = list(range(len(fresh_opt.param_groups)))[::-1]  # the same groups, listed the other way round
    fresh_opt.param_groups[:] = [fresh_opt.param_groups[i] for i in order]
    fresh_opt.group_param_names[:] = [fresh_opt.group_param_names[i] for i in order]
    ckpt.load(str(tmp_path / "c"), fresh_opt)
    assert {g["treatment"]: g["lr"] for g in fresh_opt.param_groups} == {"adamw": 0.5, "scale": 0.25}

    _, other = fresh("scale")
    adamw = next(g for g in other.param_groups if g["treatment"] == "adamw")
    adamw["treatment"] = "scale"  # what a group-order mix-up used to do: biases stepped as matrices
    with pytest.raises(ckpt.CheckpointError, match="build it with the same routing"):
        ckpt.load(str(tmp_path / "c"), other)
