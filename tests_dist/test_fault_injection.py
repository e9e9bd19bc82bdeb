"""Fault injection into checkpoint saves (issue 57): a rank SIGKILLed at each point of saving checkpoint B on
DeepSpeed ZeRO-2/3; the restart (``engine.load_checkpoint(dir)``) resumes from the last complete checkpoint and
equals the uninterrupted run, a load naming B stops on every rank naming B as incomplete, and shardopt's files
with flipped bytes are refused on every rank (``fault_worker.py``). CI runs the two kills the issue names on
ZeRO-2 (halfway through rank 1's DeepSpeed optimizer file and through its shardopt part file); the full tier
runs every kill point on ZeRO-2 and ZeRO-3."""

from __future__ import annotations

import json
import os
import tempfile

import pytest
from fault_worker import FSDP2_POINTS, POINTS
from tiers import FULL, full_only

from launch import run_ranks

CI_POINTS = ("ds_half", "part_half")
_cache: dict = {}


def _launch(args: list[str], timeout: float = 300):
    return run_ranks("fault_worker.py", 2, args, timeout=timeout)


def results(engine: str, points: tuple[str, ...]) -> dict[str, list]:
    """Per kill point, every rank's record of the restart."""
    key = (engine, points)
    if key not in _cache:
        root = tempfile.mkdtemp(prefix=f"shardopt-fault-{engine}-")
        dirs = []
        for point in points:
            d = os.path.join(root, point)
            os.makedirs(d)
            proc = _launch(["--phase", "crash", "--engine", engine, "--point", point, "--dir", d])
            assert proc.returncode != 0, f"{point}: the launch did not fail:\n{proc.stdout[-2000:]}"
            assert "did not happen" not in proc.stdout + proc.stderr, f"{point}: {proc.stderr[-2000:]}"
            dirs.append(d)
        out = os.path.join(root, "resume.json")
        proc = _launch(["--phase", "resume", "--engine", engine, "--flip", "--out", out, "--dirs", *dirs])
        if proc.returncode != 0:
            pytest.fail(f"resume launch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        recs = json.load(open(out))
        _cache[key] = {point: ranks for point, ranks in zip(points, recs)}
    return _cache[key]


def _check_resume(point: str, ranks: list) -> None:
    _, expect, b_complete = POINTS[point]
    for rec in ranks:
        assert "error" not in rec, f"{point} rank {rec['rank']}: {rec['error']}"
        print(
            f"{point} rank {rec['rank']}: resumed from {rec['loaded']} (step {rec['resumed_at']}), "
            f"max |resumed - uninterrupted| at step 4 = {rec['diff']:.3g}"
        )
        assert rec["loaded"] == expect, (point, rec)
        assert rec["diff"] == 0.0, (point, rec["diff"])
        if not b_complete:  # B named explicitly: refused, naming B as incomplete and A as the last complete one
            msg = rec["named_b"]
            assert msg is not None, f"{point}: loading the interrupted B did not fail on rank {rec['rank']}"
            assert f"{os.path.join(rec['dir'], 'B')} is incomplete" in msg, msg
            assert f"the last complete checkpoint is {os.path.join(rec['dir'], 'A')}" in msg, msg
        else:
            assert rec["named_b"] is None, rec["named_b"]
    assert len({r["named_b"] for r in ranks}) == 1  # the same error on every rank


def _check_flips(ranks: list) -> None:
    for rec in ranks:
        for which, got in rec["flipped"].items():
            path, tensor = got["where"]
            assert got["error"] is not None, f"{which} file with flipped bytes loaded on rank {rec['rank']}"
            assert f"{path}: checksum mismatch in tensor {tensor!r}" in got["error"], got["error"]


ENGINES = ["zero2", pytest.param("zero3", marks=full_only("ZeRO-2"))]


@pytest.mark.parametrize("engine", ENGINES)
def test_rank_killed_in_a_save_resumes_from_the_last_complete_checkpoint(engine):
    points = tuple(POINTS) if FULL else CI_POINTS
    for point, ranks in results(engine, points).items():
        _check_resume(point, ranks)


@pytest.mark.parametrize("engine", ENGINES)
def test_flipped_bytes_in_shardopt_files_are_refused_on_every_rank(engine):
    points = tuple(POINTS) if FULL else CI_POINTS
    for ranks in results(engine, points).values():
        _check_flips(ranks)


@full_only("ZeRO-2's kills (shardopt's part file included)")
def test_fsdp2_rank_killed_in_shardopt_checkpoint_save():
    """``shardopt.checkpoint.save`` on FSDP2: B interrupted is refused on every rank as interrupted, naming A;
    A resumes exactly."""
    for point, ranks in results("fsdp2", FSDP2_POINTS).items():
        for rec in ranks:
            assert "error" not in rec, f"{point} rank {rec['rank']}: {rec['error']}"
            print(f"fsdp2 {point} rank {rec['rank']}: B refused ({rec['named_b']}); from A: {rec['diff']:.3g}")
            assert rec["diff"] == 0.0, (point, rec["diff"])
            assert rec["named_b"] and "the save was interrupted" in rec["named_b"], rec["named_b"]
            assert f"last complete checkpoint beside it is {os.path.join(rec['dir'], 'A')}" in rec["named_b"]
        assert len({r["named_b"] for r in ranks}) == 1


@full_only("shardopt's DeepSpeed save through engine.save_checkpoint (ZeRO-2 above)")
def test_trainer_rank_killed_in_a_save_resumes_from_the_last_complete_step(tmp_path):
    """``python -m shardopt.train`` on DeepSpeed (demo config, 2 ranks): rank 1 killed halfway through its
    optimizer file of step 4; ``--resume`` continues from step 2 and ends where the uninterrupted run ends."""
    import sys

    from test_train_dist import _env, _summary, _trainer_args

    from launch import ROOT, free_port, run_bounded

    steps = [
        "--set",
        "train.steps=6",
        "--set",
        "checkpoint.every=2",
        "--set",
        "eval.every=0",
        "--set",
        "eval.max_sequences=16",
    ]

    def launch(run, extra, env):
        args = _trainer_args("demo.json", run, steps + extra)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
            str(ROOT / "tests_dist" / "trainer_fault.py"),
            *args[2:],
        ]
        return run_bounded(cmd, env=env, timeout=300)

    full = tmp_path / "full"
    assert launch(full, [], _env()).returncode == 0
    run = tmp_path / "killed"
    crashed = launch(run, [], dict(_env(), FAULT_TAG="step_4", FAULT_RANK="1"))
    assert crashed.returncode != 0
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_2"
    resumed = launch(run, ["--resume"], _env())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got, want = _summary(run), _summary(full)
    print(
        f"trainer: resumed at step {got['start_step']}, end val loss {got['end_val_loss']} "
        f"(uninterrupted {want['end_val_loss']})"
    )
    assert got["start_step"] == 2 and got["end_val_loss"] == want["end_val_loss"]
