"""``shardopt checkpoint`` on every checkpoint the project writes, in one process: the trainer's own
files (single-process/DDP ``rank<N>.pt``, run directories, step directories), DCP directories with and without
step counters, and the messages that name the path to give. Also: checkpoint files get the user's umask.
(FSDP2 runs at world size 2 and the DCP -> DeepSpeed -> resume schedule: tests_dist/test_convert_resume.py.)"""

from __future__ import annotations

import json
import os
import stat
import types

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tiny_model import Tiny
from torch.distributed.checkpoint.state_dict import get_state_dict

import shardopt
from shardopt.checkpoint import STATE_FILE, convert
from shardopt.checkpoint.files import write_part
from shardopt.train import load_train_config
from shardopt.train.data import _atomic_save_npy, _atomic_write_bytes
from shardopt.train.trainer import Trainer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def cli(capsys, *args: str) -> types.SimpleNamespace:
    from shardopt.cli import main

    capsys.readouterr()
    code = main(["checkpoint", *args])
    out = capsys.readouterr()
    return types.SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)


def trained(steps: int = 3):
    torch.manual_seed(0)
    model = Tiny()
    opt = shardopt.create_optimizer(model, "racs")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 10)
    for s in range(steps):
        x = torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(s))
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        sched.step()
    return model, opt, sched


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    """A trainer run of engine 'single' (its files are the DDP format: rank0.pt), checkpoints at steps 2 and 4."""
    tmp = tmp_path_factory.mktemp("single")
    corpus = tmp / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"doc{i}.txt").write_text(" ".join(f"word{(i * 7 + j) % 50}" for j in range(3000)))
    cfg = load_train_config(
        {
            "run_dir": str(tmp / "run"),
            "seed": 1,
            "model": {"preset": "tiny", "hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2},
            "data": {
                "source": "text",
                "path": str(corpus / "*.txt"),
                "vocab_size": 300,
                "seq_len": 16,
                "val_documents": 1,
                "cache_dir": str(tmp / "cache"),
            },
            "engine": {"name": "single"},
            "optimizer": {"name": "racs", "params": {"lr": 0.01}},
            "train": {"steps": 4, "micro_batch_size": 2, "log_every": 2, "progress": False},
            "eval": {"every": 0, "max_sequences": 4, "at_start": False},
            "checkpoint": {"every": 2},
        }
    )
    Trainer(cfg, log=lambda m: None).fit()
    return tmp / "run"


def test_inspect_a_trainer_run_directory_reads_its_latest_step(single_run, capsys):
    for path in (single_run, single_run / "checkpoints"):
        out = cli(capsys, "inspect", str(path))
        assert out.returncode == 0, out.stderr
        assert (
            f"latest checkpoint of {single_run / 'checkpoints'}: {single_run / 'checkpoints' / 'step_4'}" in out.stdout
        )
        assert "ddp checkpoint, optimizer RACS, engine ddp, saved at world size 1" in out.stdout
        assert "layers.0.mlp.up_proj.weight: " in out.stdout and ", q(64,) [rows" in out.stdout
        assert "counters: global step 4, LR scheduler at step 4" in out.stdout


def test_inspect_a_ddp_step_directory_and_rank_file(single_run, capsys):
    step2 = single_run / "checkpoints" / "step_2"
    for path in (step2, step2 / "rank0.pt"):
        out = cli(capsys, "inspect", str(path))
        assert out.returncode == 0, out.stderr
        assert f"{step2 / 'rank0.pt'}: ddp checkpoint" in out.stdout
        assert "counters: global step 2, LR scheduler at step 2" in out.stdout


def test_ddp_checkpoint_converts_with_its_counters(single_run, tmp_path, capsys):
    src = str(single_run / "checkpoints" / "step_2")
    out = cli(capsys, "convert", src, str(tmp_path / "ds"), "--to", "deepspeed")
    assert out.returncode == 0 and "global step 2, LR scheduler at step 2" in out.stdout, out.stderr
    ck = convert.read(str(tmp_path / "ds"))
    assert ck.meta["extra"]["global_steps"] == 2 and ck.meta["extra"]["lr_scheduler"]["last_epoch"] == 2
    ddp = torch.load(os.path.join(src, "rank0.pt"), map_location="cpu", weights_only=True)
    for name, value in ddp["model"].items():
        if f"{name}::param" in ck.tensors:
            assert torch.equal(ck.tensors[f"{name}::param"], value.float()), name
    # the DeepSpeed output goes on to DCP and back, keeping the counters
    assert cli(capsys, "convert", str(tmp_path / "ds"), str(tmp_path / "dcp"), "--to", "dcp").returncode == 0
    back = convert.read(str(tmp_path / "dcp"))
    assert back.meta["extra"]["global_steps"] == 2 and back.meta["extra"]["lr_scheduler"]["last_epoch"] == 2
    assert back.tensors.keys() == ck.tensors.keys()


def test_dcp_without_counters_takes_the_optimizer_step_and_says_so(tmp_path, capsys):
    model, opt, sched = trained(3)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    out = cli(capsys, "inspect", str(tmp_path / "plain"))
    assert out.returncode == 0, out.stderr
    assert "saved at world size 1" in out.stdout
    assert "global step 3 taken from the optimizer's step counts" in out.stdout
    assert "no LR-scheduler state in the checkpoint" in out.stdout
    # with the scheduler saved next to model and optim (as the README's FSDP2 example does), both are kept
    msd, osd = get_state_dict(model, opt)
    dcp.save(
        {"model": msd, "optim": osd, "scheduler": sched.state_dict()},
        checkpoint_id=str(tmp_path / "full"),
        no_dist=True,
    )
    out = cli(capsys, "convert", str(tmp_path / "full"), str(tmp_path / "ds"), "--to", "deepspeed")
    assert out.returncode == 0 and "LR scheduler at step 3" in out.stdout, out.stderr


def test_paths_the_tool_cannot_read_name_the_path_to_give(tmp_path, single_run, capsys):
    def error(path):
        out = cli(capsys, "inspect", str(path))
        assert out.returncode == 2, out.stdout
        return out.stderr

    assert "no such file or directory" in error(tmp_path / "nope")
    assert "a trainer run directory (runs/<run> or runs/<run>/checkpoints" in error(tmp_path)
    steps = tmp_path / "interrupted"
    for s in (3, 6):
        (steps / f"step_{s}").mkdir(parents=True)
    msg = error(steps)
    assert "no 'latest' file" in msg and f"{steps / 'step_3'}, {steps / 'step_6'}" in msg
    (steps / "latest").write_text("step_9")
    assert "its 'latest' file names step 'step_9'" in error(steps)
    # a DeepSpeed tag saved without shardopt's optimizer (the AdamW baseline)
    (steps / "latest").write_text("step_6")
    (steps / "step_6" / "mp_rank_00_model_states.pt").write_bytes(b"")
    assert "DeepSpeed engine without shardopt's optimizer" in error(steps)
    # a run directory whose config saves no checkpoints
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text("")
    assert "without checkpoints" in error(run)


def test_state_of_another_optimizer_inspects_but_does_not_convert(tmp_path, capsys):
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(2, 3, dtype=torch.long)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "adamw"), no_dist=True)
    out = cli(capsys, "inspect", str(tmp_path / "adamw"))
    assert out.returncode == 0 and "optimizer not a shardopt optimizer" in out.stdout, out.stderr
    out = cli(capsys, "convert", str(tmp_path / "adamw"), str(tmp_path / "x"), "--to", "file")
    assert out.returncode == 2 and "not shardopt's" in out.stderr


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield 0o640
    os.umask(old)


def modes(root) -> dict[str, int]:
    return {
        os.path.relpath(os.path.join(d, f), root): stat.S_IMODE(os.stat(os.path.join(d, f)).st_mode)
        for d, _, files in os.walk(root)
        for f in files
    }


def test_files_get_the_users_umask_like_torch_save(tmp_path, umask_027, capsys):
    torch.save({}, tmp_path / "torch.pt")
    assert modes(tmp_path) == {"torch.pt": umask_027}
    model, opt, sched = trained(2)
    shardopt.checkpoint.save(str(tmp_path / "own"), opt, extra={"global_steps": 2})
    write_part(str(tmp_path / "part.safetensors"), {"x": torch.zeros(3)})
    for to, dst in (("deepspeed", "ds"), ("dcp", "dcp"), ("file", "one.safetensors")):
        assert cli(capsys, "convert", str(tmp_path / "own"), str(tmp_path / dst), "--to", to).returncode == 0
    _atomic_write_bytes(tmp_path / "cache" / "tokenizer.json", b"{}")
    _atomic_save_npy(tmp_path / "cache" / "train.npy", torch.arange(3).numpy())
    found = modes(tmp_path)
    assert {
        STATE_FILE,
        "ds/latest",
        f"ds/converted/{STATE_FILE}",
        "dcp/.metadata",
        "one.safetensors",
        "cache/tokenizer.json",
        "cache/train.npy",
        "part.safetensors",
    } <= {k.replace("own/", "") for k in found}
    assert {k: v for k, v in found.items() if v != umask_027} == {}
    assert json.loads((tmp_path / "cache" / "tokenizer.json").read_text()) == {}
