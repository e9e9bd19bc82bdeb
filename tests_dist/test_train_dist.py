"""The reference trainer under real process groups (CPU/gloo), every launch with a timeout.

- two "nodes" on loopback: two ``torchrun --nnodes 2 --nproc_per_node 2 --rdzv_backend c10d`` launches
  train the tiny model with SCALE on DeepSpeed ZeRO-2 (world size 4) to a checkpoint (4 optimizer shards);
- the demo config, shortened: validation loss drops, the metrics JSONL and loss PNG are written, and a
  resume from the middle DeepSpeed checkpoint reaches the same validation loss;
- FSDP2 + SinkGD resume through ``torch.distributed.checkpoint`` reproduces the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tiers import full_only

from launch import ROOT, free_port, run_bounded

TIMEOUT = 240
SHORT = [
    "--set",
    "eval.every=0",
    "--set",
    "eval.max_sequences=32",
    "--set",
    "train.log_every=2",
    "--set",
    "train.progress=false",
]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONWARNINGS"] = "ignore::FutureWarning"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _trainer_args(config: str, run_dir, extra: list[str]) -> list[str]:
    return [
        "-m",
        "shardopt.train",
        "--config",
        str(ROOT / "configs" / "train" / config),
        "--run_dir",
        str(run_dir),
        "--set",
        "data.cache_dir=" + str(ROOT / "runs" / "cache"),
        *SHORT,
        *extra,
    ]


def _check(proc: subprocess.CompletedProcess | tuple, what: str) -> None:
    procs = proc if isinstance(proc, tuple) else (proc,)
    for i, p in enumerate(procs):
        if p.returncode != 0:
            pytest.fail(f"{what} (launch {i}) failed with {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")


def run_single_node(nproc: int, config: str, run_dir, extra: list[str]) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        *_trainer_args(config, run_dir, extra),
    ]
    return run_bounded(cmd, env=_env(), timeout=TIMEOUT)


def run_two_nodes(config: str, run_dir, extra: list[str]) -> tuple[subprocess.CompletedProcess, ...]:
    port = free_port()
    procs = []
    for node in (0, 1):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc_per_node=2",
            f"--node_rank={node}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{port}",
            f"--rdzv_id=shardopt-test-{port}",
            *_trainer_args(config, run_dir, extra),
        ]
        procs.append(
            subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    done = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=TIMEOUT)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return tuple(done)


def _summary(run_dir) -> dict:
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)


def test_two_nodes_loopback_deepspeed_checkpoint(tmp_path):
    run = tmp_path / "two_nodes"
    _check(
        run_two_nodes("demo.json", run, ["--set", "train.steps=4", "--set", "checkpoint.every=2"]), "two-node training"
    )
    s = _summary(run)
    assert s["world_size"] == 4 and s["steps"] == 4 and s["engine"] == "deepspeed"
    assert s["tokens_per_step"] == 4 * 8 * 128
    assert s["end_val_loss"] < s["start_val_loss"]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_4"
    for tag in ("step_2", "step_4"):
        files = os.listdir(run / "checkpoints" / tag)
        assert sorted(f for f in files if f.startswith("zero_pp_rank_")) == [
            f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(4)
        ]


def test_demo_config_short_run_learns_and_resumes(tmp_path):
    run = tmp_path / "demo"
    steps = ["--set", "train.steps=30", "--set", "eval.every=15", "--set", "checkpoint.every=15"]
    proc = run_single_node(2, "demo.json", run, steps)
    _check(proc, "short demo run")
    s = _summary(run)
    assert s["world_size"] == 2 and s["optimizer"] == "scale"
    assert s["end_val_loss"] < s["start_val_loss"] - 1.0, s
    assert (run / "loss.png").stat().st_size > 5000
    recs = [json.loads(line) for line in open(run / "metrics.jsonl")]
    vals = [r["val_loss"] for r in recs if "val_loss" in r]
    assert len(vals) == 3 and vals[0] > vals[1] > vals[2]
    train = [r for r in recs if "loss" in r]
    assert len(train) == 15 and all(r["tokens_per_s"] > 0 for r in train)
    assert "validation perplexity" in proc.stdout + proc.stderr

    # DeepSpeed checkpoint (engine.save_checkpoint with the shardopt optimizer) resumes exactly
    (run / "checkpoints" / "latest").write_text("step_15")
    _check(run_single_node(2, "demo.json", run, steps + ["--resume"]), "demo resume")
    resumed = _summary(run)
    assert resumed["start_step"] == 15 and resumed["steps"] == 30
    assert resumed["end_val_loss"] == pytest.approx(s["end_val_loss"], abs=1e-5)


@full_only(
    "the demo's DeepSpeed run and its resume; FSDP2 resumes exactly in test_checkpoint_dist.py and the trainer's "
    "FSDP2 run resumes on DeepSpeed in test_convert_resume.py"
)
def test_fsdp2_resume_matches_uninterrupted_run(tmp_path):
    run = tmp_path / "fsdp2"
    steps = [
        "--set",
        "train.steps=4",
        "--set",
        "checkpoint.every=2",
        "--set",
        "train.grad_accum=2",
        "--set",
        "eval.max_sequences=16",
    ]
    _check(run_single_node(2, "fsdp2_sinkgd.json", run, steps), "fsdp2 run")
    full = _summary(run)
    assert full["end_val_loss"] < full["start_val_loss"]
    (run / "checkpoints" / "latest").write_text("step_2")
    _check(run_single_node(2, "fsdp2_sinkgd.json", run, steps + ["--resume"]), "fsdp2 resume")
    resumed = _summary(run)
    assert resumed["start_step"] == 2
    assert resumed["end_val_loss"] == pytest.approx(full["end_val_loss"], abs=1e-5)
