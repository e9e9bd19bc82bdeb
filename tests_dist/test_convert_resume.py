"""``shardopt checkpoint`` on the trainer's multi-process checkpoints, and conversions that keep the schedule.

- An FSDP2 run at world size 2 (RACS, 6 steps, checkpoints at 3 and 6): ``inspect`` on the run directory
  reads its latest step, on a step directory it reports world size 2 and the step counters.
- That step-3 DCP checkpoint converted to DeepSpeed and resumed by the trainer on ZeRO-2: the resumed run
  starts at step 3 (the converted file carries no client state, so this is the engine's ``global_steps``
  restored from the conversion) and its learning rates and losses at steps 4-6 are the uninterrupted
  FSDP2 run's.
- A DDP run at world size 2: ``inspect`` reads its rank files and reports world size 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tiers import full_only

from launch import ROOT, free_port, run_bounded

TIMEOUT = 300


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONWARNINGS"] = "ignore::FutureWarning"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _config(tmp, name: str, engine: dict, steps: int, every: int) -> str:
    corpus = tmp / "corpus"
    if not corpus.exists():
        corpus.mkdir()
        for i in range(3):
            (corpus / f"doc{i}.txt").write_text(" ".join(f"w{(i * 13 + j * 7) % 97}" for j in range(4000)))
    raw = {
        "run_dir": str(tmp / name),
        "seed": 5,
        "model": {"preset": "tiny", "hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2},
        "data": {
            "source": "text",
            "path": str(corpus / "*.txt"),
            "vocab_size": 300,
            "seq_len": 16,
            "val_documents": 1,
            "cache_dir": str(tmp / "cache"),
        },
        "engine": engine,
        "optimizer": {"name": "racs", "params": {"lr": 0.01}},
        "train": {"steps": steps, "micro_batch_size": 2, "warmup_fraction": 0.5, "log_every": 1, "progress": False},
        "eval": {"every": 0, "max_sequences": 4, "at_start": False},
        "checkpoint": {"every": every},
    }
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(raw))
    return str(path)


def train(config: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "-m",
        "shardopt.train",
        "--config",
        config,
        *extra,
    ]
    proc = run_bounded(cmd, env=_env(), timeout=TIMEOUT)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} failed with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def cli(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "shardopt", "checkpoint", *map(str, args)],
        env=_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def metrics(run) -> dict[int, dict]:
    with open(run / "metrics.jsonl") as f:
        return {r["step"]: r for r in map(json.loads, f) if "loss" in r}


@full_only("cross-engine reshards and the CLI's inspection in test_checkpoint_dist.py")
def test_fsdp2_run_inspects_and_resumes_its_schedule_on_deepspeed(tmp_path):
    train(_config(tmp_path, "fsdp2", {"name": "fsdp2"}, steps=6, every=3))
    run = tmp_path / "fsdp2"
    out = cli("inspect", run).stdout
    assert f"latest checkpoint of {run / 'checkpoints'}: {run / 'checkpoints' / 'step_6'}" in out
    assert "dcp checkpoint, optimizer RACS, engine dcp, saved at world size 2" in out
    assert "counters: global step 6, LR scheduler at step 6" in out
    step3 = run / "checkpoints" / "step_3"
    out = cli("inspect", step3).stdout
    assert f"{step3}: dcp checkpoint, optimizer RACS, engine dcp, saved at world size 2" in out
    assert "counters: global step 3, LR scheduler at step 3" in out

    converted = tmp_path / "ds_checkpoints"
    assert "global step 3, LR scheduler at step 3" in cli("convert", step3, converted, "--to", "deepspeed").stdout
    ds = _config(
        tmp_path,
        "deepspeed",
        {"name": "deepspeed", "deepspeed_config": "configs/deepspeed/zero2_racs.json"},
        steps=6,
        every=0,
    )
    proc = train(ds, "--resume", "--set", f"checkpoint.dir={converted}")
    assert f"resumed from {converted}/converted at step 3" in proc.stdout + proc.stderr
    full, resumed = metrics(run), metrics(tmp_path / "deepspeed")
    assert sorted(resumed) == [4, 5, 6]
    assert len({full[s]["lr"] for s in (1, 4, 5, 6)}) == 4  # a restarted schedule would show other rates
    for s in (4, 5, 6):
        assert resumed[s]["lr"] == pytest.approx(full[s]["lr"], rel=1e-12), s
        assert resumed[s]["loss"] == pytest.approx(full[s]["loss"], abs=1e-4), s


@full_only("the FSDP2 run's inspection and resume; the CLI's inspection in test_checkpoint_dist.py")
def test_ddp_run_inspects_at_its_world_size(tmp_path):
    train(_config(tmp_path, "ddp", {"name": "ddp"}, steps=2, every=2))
    run = tmp_path / "ddp"
    out = cli("inspect", run).stdout
    assert (
        f"{run / 'checkpoints' / 'step_2' / 'rank0.pt'}: ddp checkpoint, optimizer RACS, engine ddp, saved at "
        "world size 2" in out
    )
    assert "counters: global step 2, LR scheduler at step 2" in out
    out = cli("inspect", run / "checkpoints" / "step_2" / "rank1.pt").stdout
    assert "saved at world size 2" in out
