"""No code runs from a checkpoint file: crafted pickles are refused with a clear error, real checkpoints load.

Each crafted file carries a live payload (it writes a marker file when unpickled with full pickle; the first
test proves that), placed where a full-pickle reader would run it: a DCP ``.metadata``, a DCP non-tensor value,
the trainer's own ``.pt`` files, and a pickle passed off as shardopt's safetensors file. ``shardopt checkpoint
inspect/convert`` must exit 2 and the loaders must raise ``CheckpointError``, with no marker written; a real
DCP checkpoint (written here with ``torch.distributed.checkpoint`` in one process) still inspects, converts and
loads.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tiny_model import Tiny
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import shardopt
from shardopt.checkpoint import STATE_FILE, CheckpointError, convert
from shardopt.checkpoint.safe_pickle import SafeFileSystemReader, SafeLoadPlanner, load_dcp_metadata
from shardopt.train.trainer import Trainer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Payload:
    """Unpickling this with full pickle runs ``exec``, which writes ``marker``."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('payload ran')",)


def cli(*args: str) -> subprocess.CompletedProcess:
    """``shardopt checkpoint ARGS`` as a user runs it (a new process)."""
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    return subprocess.run(
        [sys.executable, "-m", "shardopt", "checkpoint", *args], capture_output=True, text=True, timeout=120, env=env
    )


def cli_here(capsys, *args: str) -> types.SimpleNamespace:
    """The same command line in this process (``shardopt.cli.main``; fast)."""
    from shardopt.cli import main

    capsys.readouterr()
    code = main(["checkpoint", *args])
    out = capsys.readouterr()
    return types.SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)


def trained(name: str = "racs"):
    torch.manual_seed(0)
    model = Tiny()
    opt = shardopt.create_optimizer(model, name)
    x = torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    return model, opt


def save_dcp(path: str, model, opt) -> None:
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path, no_dist=True)


def test_the_payload_is_live(tmp_path):
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(Payload(str(marker))))
    assert marker.exists()


def test_crafted_dcp_metadata_is_refused_everywhere(tmp_path, capsys):
    marker = str(tmp_path / "ran")
    ckpt_dir = tmp_path / "dcp"
    model, opt = trained()
    save_dcp(str(ckpt_dir), model, opt)
    (ckpt_dir / ".metadata").write_bytes(pickle.dumps(Payload(marker)))

    inspect = cli("inspect", str(ckpt_dir))
    assert inspect.returncode == 2 and "refusing to read DCP metadata" in inspect.stderr, inspect.stderr
    assert "builtins.exec" in inspect.stderr
    for to in ("file", "deepspeed", "dcp"):
        conv = cli_here(capsys, "convert", str(ckpt_dir), str(tmp_path / f"out_{to}"), "--to", to)
        assert conv.returncode == 2 and "refusing to read DCP metadata" in conv.stderr, conv.stderr
        assert not (tmp_path / f"out_{to}").exists()
    with pytest.raises(CheckpointError, match="refusing to read DCP metadata"):
        convert.read_any(str(ckpt_dir))
    with pytest.raises(CheckpointError, match="builtins.exec"):
        load_dcp_metadata(str(ckpt_dir / ".metadata"))
    # the trainer's FSDP2 resume path (and anyone loading through shardopt's reader)
    msd, osd = get_state_dict(model, opt)
    with pytest.raises((CheckpointError, CheckpointException)):
        dcp.load(
            {"model": msd, "optim": osd},
            storage_reader=SafeFileSystemReader(str(ckpt_dir)),
            planner=SafeLoadPlanner(),
            no_dist=True,
        )
    assert not os.path.exists(marker)


def test_crafted_dcp_value_is_refused(tmp_path, capsys):
    """A valid ``.metadata`` whose non-tensor value (a param-group entry) is a crafted ``torch.save`` blob:
    DCP's own planner would ``torch.load(weights_only=False)`` it."""
    marker = str(tmp_path / "ran")
    ckpt_dir = tmp_path / "dcp"
    model, opt = trained()
    msd, osd = get_state_dict(model, opt)
    osd["param_groups"][0]["lr"] = Payload(marker)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(ckpt_dir), no_dist=True)
    assert not os.path.exists(marker)  # saving records the payload, it does not run it

    for args in (("inspect", str(ckpt_dir)), ("convert", str(ckpt_dir), str(tmp_path / "out"), "--to", "file")):
        proc = cli_here(capsys, *args)
        assert proc.returncode == 2 and "refusing to unpickle DCP value 'optim.param_groups.0.lr'" in proc.stderr, (
            proc.stderr
        )
    with pytest.raises(CheckpointError, match="refusing to unpickle DCP value"):
        convert.read_any(str(ckpt_dir))
    msd, osd = get_state_dict(model, opt)
    with pytest.raises((CheckpointError, CheckpointException), match="refusing to unpickle"):
        dcp.load(
            {"model": msd, "optim": osd},
            storage_reader=SafeFileSystemReader(str(ckpt_dir)),
            planner=SafeLoadPlanner(),
            no_dist=True,
        )
    assert not os.path.exists(marker)


def _trainer_stub(root: str, engine: str, model=None, opt=None, sched=None):
    """What ``Trainer._load`` reads from its trainer: the checkpoint directory, engine, rank and the objects
    it loads into (a real model, optimizer and scheduler, so DCP gets real state dicts)."""
    return types.SimpleNamespace(
        cfg=types.SimpleNamespace(checkpoint_dir=root),
        engine_name=engine,
        rank=0,
        world=1,
        device="cpu",
        model=model,
        module=model,
        optimizer=opt,
        scheduler=sched,
        step=0,
        log=lambda m: None,
    )


def test_crafted_trainer_files_are_refused(tmp_path):
    marker = str(tmp_path / "ran")
    # single-process / DDP resume: checkpoints/<tag>/rank<r>.pt
    single = tmp_path / "single"
    (single / "step_3").mkdir(parents=True)
    (single / "latest").write_text("step_3")
    torch.save({"step": 3, "model": Payload(marker)}, single / "step_3" / "rank0.pt")
    with pytest.raises(CheckpointError, match=r"rank0\.pt: refusing to unpickle"):
        Trainer._load(_trainer_stub(str(single), "single"))

    # FSDP2 resume: a real DCP checkpoint next to a crafted trainer_state.pt
    def with_scheduler():
        model, opt = trained()
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

    fsdp = tmp_path / "fsdp"
    model, opt, sched = with_scheduler()
    save_dcp(str(fsdp / "step_3"), model, opt)
    (fsdp / "latest").write_text("step_3")
    torch.save({"step": 3, "scheduler": Payload(marker)}, fsdp / "step_3" / "trainer_state.pt")
    with pytest.raises(CheckpointError, match=r"trainer_state\.pt: refusing to unpickle"):
        Trainer._load(_trainer_stub(str(fsdp), "fsdp2", *with_scheduler()))
    # the same directory with an honest trainer_state.pt resumes
    torch.save({"step": 3, "scheduler": sched.state_dict()}, fsdp / "step_3" / "trainer_state.pt")
    stub = _trainer_stub(str(fsdp), "fsdp2", *with_scheduler())
    assert Trainer._load(stub) and stub.step == 3
    assert not os.path.exists(marker)


def test_pickle_posing_as_a_shardopt_file_is_refused(tmp_path, capsys):
    marker = str(tmp_path / "ran")
    logical = tmp_path / "logical"
    logical.mkdir()
    torch.save(Payload(marker), logical / STATE_FILE)
    deepspeed = tmp_path / "ds"
    (deepspeed / "global_step2").mkdir(parents=True)
    (deepspeed / "latest").write_text("global_step2")
    torch.save(Payload(marker), deepspeed / "global_step2" / STATE_FILE)
    plain_pt = tmp_path / "optimizer.pt"
    torch.save(Payload(marker), plain_pt)
    for path in (logical, deepspeed, plain_pt):
        proc = cli_here(capsys, "inspect", str(path))
        assert proc.returncode == 2 and "corrupt or truncated" in proc.stderr, proc.stderr
        with pytest.raises(CheckpointError):
            convert.read_any(str(path))
    _, opt = trained()
    with pytest.raises(CheckpointError):
        shardopt.checkpoint.load(str(logical), opt)
    assert not os.path.exists(marker)


def test_real_dcp_checkpoint_still_inspects_converts_and_loads(tmp_path, capsys):
    model, opt = trained()
    ckpt_dir = str(tmp_path / "dcp")
    save_dcp(ckpt_dir, model, opt)

    proc = cli("inspect", ckpt_dir)
    assert proc.returncode == 0 and "dcp checkpoint, optimizer RACS" in proc.stdout, proc.stderr
    assert "proj.weight: " in proc.stdout and ", s(6,) [cols" in proc.stdout
    tensors, meta, kind = convert.read_any(ckpt_dir)
    assert kind == "dcp" and meta["optimizer"] == "RACS"
    for name, p in model.named_parameters():
        assert torch.equal(tensors[f"{name}::param"], p.detach()), name

    for to, target in (("file", "state.safetensors"), ("deepspeed", "ds"), ("dcp", "dcp2")):
        conv = cli_here(capsys, "convert", ckpt_dir, str(tmp_path / target), "--to", to)
        assert conv.returncode == 0, conv.stderr
        again, _, _ = convert.read_any(str(tmp_path / target))
        assert again.keys() == tensors.keys()
        assert all(torch.equal(again[k], tensors[k]) for k in tensors), to

    # the logical file loads into a fresh optimizer, and the trainer's reader loads the DCP directory exactly
    torch.manual_seed(0)
    model2 = Tiny()
    opt2 = shardopt.create_optimizer(model2, "racs")
    shardopt.checkpoint.load(str(tmp_path / "state.safetensors"), opt2)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    model3 = Tiny()
    opt3 = shardopt.create_optimizer(model3, "racs")
    msd, osd = get_state_dict(model3, opt3)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, storage_reader=SafeFileSystemReader(ckpt_dir), planner=SafeLoadPlanner(), no_dist=True)
    set_state_dict(model3, opt3, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    for a, b in zip(model.parameters(), model3.parameters()):
        assert torch.equal(a, b)
    assert opt3.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
