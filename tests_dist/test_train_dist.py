"""The reference trainer under real process groups (CPU/gloo), every launch with a timeout.

- two "nodes" on loopback: two ``torchrun --nnodes 2 --nproc_per_node 2 --rdzv_backend c10d`` launches
  train the tiny model with SCALE on DeepSpeed ZeRO-2 (world size 4) to a checkpoint (4 optimizer shards);
- the demo config, shortened: validation loss drops, the metrics JSONL and loss PNG are written;
- torchrun's automatic restarts (``--max-restarts 1 ... -m shardopt.train --resume``): a worker SIGKILLed
  mid-run, every worker restarted, the run resumed from the last complete checkpoint and ended where the
  uninterrupted run ends (parameters within 1e-6, the same logged losses); CI: the demo on DeepSpeed ZeRO-2 with a
  static port; full tier: DDP and FSDP2, the c10d rendezvous, and two nodes on loopback;
- FSDP2 + SinkGD resume through ``torch.distributed.checkpoint`` reproduces the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tiers import full_only

from launch import ROOT, free_port, run_bounded, run_killing_rank

TIMEOUT = 240
LOG_EVERY = 2
SHORT = [
    "--set",
    "eval.every=0",
    "--set",
    "eval.max_sequences=32",
    "--set",
    f"train.log_every={LOG_EVERY}",
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


def _train_losses(run_dir) -> dict[int, float]:
    """``{step: mean training loss}`` of the run's ``metrics.jsonl``; a step logged twice fails."""
    losses: dict[int, float] = {}
    for line in open(os.path.join(run_dir, "metrics.jsonl")):
        rec = json.loads(line)
        if "loss" in rec:
            assert rec["step"] not in losses, f"step {rec['step']} logged twice in {run_dir}/metrics.jsonl"
            losses[rec["step"]] = rec["loss"]
    return losses


def _summary(run_dir) -> dict:
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)


@full_only("the one-node torchrun restart of the demo (test_killed_worker_restarts_and_resumes_on_deepspeed)")
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


DEMO_STEPS = ["--set", "train.steps=30", "--set", "eval.every=15", "--set", "checkpoint.every=15"]


def final_params(run_dir) -> dict:
    """The parameters of the run's last checkpoint (any engine), as whole tensors."""
    from shardopt.checkpoint import convert

    tensors = convert.read(str(os.path.join(run_dir, "checkpoints"))).tensors
    return {n: t.clone() for n, t in tensors.items() if n.endswith("::param")}


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """The demo config run for 30 steps without interruption: the run directory, the launch and its final
    parameters (read before any test resumes in that directory)."""
    run = tmp_path_factory.mktemp("demo") / "run"
    proc = run_single_node(2, "demo.json", run, DEMO_STEPS)
    _check(proc, "short demo run")
    return run, proc, final_params(run), _summary(run), _train_losses(run)


def test_demo_config_short_run_learns(demo_run):
    run, proc, _, s, _ = demo_run
    assert s["world_size"] == 2 and s["optimizer"] == "scale"
    assert s["end_val_loss"] < s["start_val_loss"] - 1.0, s
    assert (run / "loss.png").stat().st_size > 5000
    recs = [json.loads(line) for line in open(run / "metrics.jsonl")]
    vals = [r["val_loss"] for r in recs if "val_loss" in r]
    assert len(vals) == 3 and vals[0] > vals[1] > vals[2]
    train = [r for r in recs if "loss" in r]
    assert len(train) == 15 and all(r["tokens_per_s"] > 0 for r in train)
    assert "validation perplexity" in proc.stdout + proc.stderr
    # its resume from the DeepSpeed checkpoint of step 15: test_killed_worker_restarts_and_resumes_on_deepspeed


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


# ------------------------------------------------------------------------------- torchrun's automatic restarts
def restart_commands(config: str, run_dir, extra: list[str], rdzv: str, nnodes: int = 1) -> list[list[str]]:
    """``torchrun --max-restarts 1 ... -m shardopt.train --resume``, one command per node: a static port
    (``--master_port``), the c10d rendezvous, or ``launch/multinode.sh`` itself (``MAX_RESTARTS=1``; c10d)."""
    port = free_port()
    cmds = []
    for node in range(nnodes):
        if rdzv == "multinode.sh":
            script_env = [f"NNODES={nnodes}", f"NODE_RANK={node}", "NPROC_PER_NODE=2", f"MASTER_PORT={port}"]
            args = _trainer_args(config, run_dir, [*extra, "--resume"])[2:]  # the script adds -m shardopt.train
            cmds.append(["env", *script_env, "MAX_RESTARTS=1", "bash", str(ROOT / "launch" / "multinode.sh"), *args])
            continue
        if rdzv == "static":
            launch = ["--master_addr=127.0.0.1", f"--master_port={port}"]
        else:
            launch = [
                f"--node_rank={node}",
                "--rdzv_backend=c10d",
                f"--rdzv_endpoint=127.0.0.1:{port}",
                f"--rdzv_id=shardopt-restart-{port}",
            ]
        cmds.append(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={nnodes}",
                "--nproc_per_node=2",
                "--max-restarts=1",
                *launch,
                *_trainer_args(config, run_dir, [*extra, "--resume"]),
            ]
        )
    return cmds


def check_restarted_run(
    run, cmds, kill_rank: int, after: str, want: dict, want_losses: dict, want_summary: dict, resumed_at
) -> None:
    """Kill ``kill_rank``'s worker once ``after`` is logged; every node's torchrun must restart its workers, which
    resume from the last complete checkpoint (a step in ``resumed_at``) and end where the uninterrupted run
    ends: parameters within 1e-6, one metrics record per step with the same losses."""
    procs, killed = run_killing_rank(cmds, _env(), timeout=2 * TIMEOUT, rank=kill_rank, after=after)
    out = "".join(p.stdout for p in procs)
    assert killed is not None, f"{after!r} never logged, or no worker of rank {kill_rank}:\n{out[-4000:]}"
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"node {i}: torchrun exited {p.returncode} after the restart:\n{p.stdout[-6000:]}"
    summary = _summary(run)
    assert summary["start_step"] in resumed_at, summary
    assert f"resumed from {run}/checkpoints/step_{summary['start_step']} at step {summary['start_step']}" in out
    got = final_params(run)
    assert got.keys() == want.keys()
    diff = max((got[n] - want[n]).abs().max().item() for n in want)
    losses = _train_losses(run)
    # the first record after the resume averages fewer steps (its window opens at the resume step)
    start = summary["start_step"]
    loss_diff = max(abs(losses[k] - want_losses[k]) for k in want_losses if not start < k < start + LOG_EVERY)
    print(
        f"rank {kill_rank} killed after {after!r}, restarted from step {summary['start_step']}: "
        f"max |params - uninterrupted| = {diff:.3g}, max |loss - uninterrupted| = {loss_diff:.3g}"
    )
    assert diff <= 1e-6
    assert losses.keys() == want_losses.keys() and loss_diff <= 1e-6
    assert summary["end_val_loss"] == pytest.approx(want_summary["end_val_loss"], abs=1e-6)


def test_killed_worker_restarts_and_resumes_on_deepspeed(demo_run, tmp_path):
    """The demo (DeepSpeed ZeRO-2 + SCALE, 2 ranks) under ``torchrun --max-restarts 1 --master_port ...``:
    rank 1's worker SIGKILLed after step 20 of 30; both workers restart and resume from step 15 (the gloo groups
    of the restarted attempt on fresh store keys, shardopt.train.process_group) and end as the uninterrupted
    run."""
    run = tmp_path / "restarted"
    _, _, want, want_summary, want_losses = demo_run
    cmds = restart_commands("demo.json", run, DEMO_STEPS, "static")
    check_restarted_run(run, cmds, 1, "step 20/30", want, want_losses, want_summary, resumed_at=(15,))


RESTART_STEPS = ["--set", "train.steps=12", "--set", "checkpoint.every=4", "--set", "eval.every=0"]


@full_only("DeepSpeed ZeRO-2 with a static port (test_killed_worker_restarts_and_resumes_on_deepspeed)")
@pytest.mark.parametrize(
    "config,rdzv",
    [("ddp_racs.json", "static"), ("fsdp2_sinkgd.json", "static"), ("demo.json", "c10d"), ("ddp_racs.json", "c10d")],
)
def test_killed_worker_restarts_and_resumes_on_every_engine(config, rdzv, tmp_path):
    want_run = tmp_path / "uninterrupted"
    _check(run_single_node(2, config, want_run, RESTART_STEPS), f"{config} uninterrupted")
    run = tmp_path / "restarted"
    cmds = restart_commands(config, run, RESTART_STEPS, rdzv)
    want = final_params(want_run), _train_losses(want_run), _summary(want_run)
    check_restarted_run(run, cmds, 1, "step 6/12", *want, resumed_at=(4, 8))


@full_only("one node, DeepSpeed (test_killed_worker_restarts_and_resumes_on_deepspeed)")
def test_killed_worker_restarts_and_resumes_on_two_nodes(tmp_path):
    """``launch/multinode.sh`` with ``MAX_RESTARTS=1``, two nodes of 2 on loopback (c10d): a worker of node 1
    killed; node 1's agent restarts its workers (TORCHELASTIC_RESTART_COUNT 1), node 0's restarts them for the
    membership change (count 0), and the attempt's process group still forms and resumes."""
    want_run = tmp_path / "uninterrupted"
    _check(run_two_nodes("demo.json", want_run, RESTART_STEPS), "two-node uninterrupted")
    run = tmp_path / "restarted"
    cmds = restart_commands("demo.json", run, RESTART_STEPS, "multinode.sh", nnodes=2)
    want = final_params(want_run), _train_losses(want_run), _summary(want_run)
    check_restarted_run(run, cmds, 3, "step 6/12", *want, resumed_at=(4, 8))
