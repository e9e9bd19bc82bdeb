"""Checkpoints: exact resume on every engine, resharding across world sizes and engines, broken files.

Phase 1 (world size 2, ``checkpoint_worker.py --phase save``): for every optimizer on DDP, FSDP2 (DCP),
ZeRO-1, ZeRO-2, ZeRO-3: train 3 steps, save the engine's own way, rebuild, load, train 3 more, compare with
6 uninterrupted steps (<= 1e-6). Phase 2 (world sizes 1, 2, 3, 4): load the step-3 checkpoints into fresh
engines, including ZeRO-2 -> FSDP2, FSDP2 -> ZeRO-2, ZeRO-2 -> ZeRO-3 and the outputs of
``shardopt checkpoint convert``, continue 3 steps and compare with a single-process run (<= 1e-5).
Both launches also run ``ckpt_options_worker``'s CI case of DeepSpeed's load options (issue 55; every option,
optimizer and target: ``test_checkpoint_options.py``, full tier): a model with a frozen layer, tied weights and
buffers saved at ZeRO-2 on 2 ranks, loaded with ``load_optimizer_states=False`` at ZeRO-3 (2 ranks) and at each
resume world size, and ``ds_to_universal`` on the ZeRO-3 checkpoint.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
import types

import pytest
from checkpoint_worker import ENGINES, RESHARD
from parity_worker import OPTIMIZERS
from tiers import optimizers, world_sizes

from launch import run_ranks

RESUME_TOL = 1e-6
RESHARD_TOL = 1e-5
_state: dict = {}


def checkpoint_root() -> str:
    if "root" not in _state:
        root = tempfile.mkdtemp(prefix="shardopt-ckpt-")
        out = os.path.join(root, "save.json")
        proc = run_ranks("checkpoint_worker.py", 2, ["--phase", "save", "--dir", root, "--out", out], timeout=900)
        if proc.returncode != 0:
            pytest.fail(f"checkpoint save phase failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        recs = json.load(open(out))
        _state["root"], _state["save"] = root, [r for r in recs if r["phase"] != "options"]
        _state["options"] = [r for r in recs if r["phase"] == "options"]
    return _state["root"]


def resume(ws: int) -> list[dict]:
    key = f"resume{ws}"
    if key not in _state:
        root = checkpoint_root()
        out = os.path.join(root, f"resume{ws}.json")
        proc = run_ranks("checkpoint_worker.py", ws, ["--phase", "resume", "--dir", root, "--out", out], timeout=900)
        if proc.returncode != 0:
            pytest.fail(f"resume at world size {ws} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        recs = json.load(open(out))
        _state[key] = [r for r in recs if r["phase"] != "options"]
        _state[f"options{ws}"] = [r for r in recs if r["phase"] == "options"]
    return _state[key]


def test_resume_is_exact_on_every_engine() -> None:
    checkpoint_root()
    recs = _state["save"]
    assert len(recs) == len(optimizers(OPTIMIZERS)) * len(ENGINES)
    for rec in recs:
        assert "error" not in rec, rec.get("error")
        print(f"{rec['optimizer']} {rec['engine']}: resumed vs uninterrupted {rec['max_abs_diff']:.3g}")
        assert rec["max_abs_diff"] <= RESUME_TOL, rec


@pytest.mark.parametrize("ws", world_sizes((1, 2, 3, 4), ci=(3,)))
def test_reshard_across_world_sizes_and_engines(ws: int) -> None:
    recs = resume(ws)
    assert len(recs) == len(optimizers(OPTIMIZERS)) * len(RESHARD)
    for rec in recs:
        assert "error" not in rec, rec.get("error")
        print(f"{rec['optimizer']} {rec['source']} (ws 2) -> {rec['engine']} (ws {ws}): {rec['max_abs_diff']:.3g}")
        assert rec["max_abs_diff"] <= RESHARD_TOL, rec


OPTIONS_TOL = 1e-6


def check_options(rec: dict) -> None:
    """``load_optimizer_states=False`` after a change of stage or world size: frozen weights and buffers (the call
    counter) are the saved ones, the trained weights too, the global step and client state come back, and 3 more
    steps equal a fresh optimizer on the saved weights with the saved scheduler."""
    assert "error" not in rec, rec["error"]
    print(
        f"options {rec['case']}: frozen+buffers {rec['frozen_buffers_vs_saved']:.3g}, trained "
        f"{rec['trained_vs_saved']:.3g}, after 3 steps {rec['vs_reference']:.3g} ({rec['seconds']:.1f} s)"
    )
    assert rec["frozen_buffers_vs_saved"] <= OPTIONS_TOL and rec["trained_vs_saved"] <= OPTIONS_TOL, rec
    assert rec["vs_reference"] <= OPTIONS_TOL and rec["calls"] == 6, rec
    assert rec["global_steps"] == 3 and rec["client_epoch"] == 7, rec


def test_load_options_after_a_stage_change_and_ds_to_universal_on_zero3() -> None:
    checkpoint_root()
    (rec,) = _state["options"]
    check_options(rec)
    assert rec["path"] == os.path.join("step3", "mp_rank_00_model_states.pt"), rec  # DeepSpeed's return value
    msg = rec["universal_zero3"]  # ZeRO-3: stops before reading optimizer state, naming shardopt's route
    assert (
        msg.startswith("RuntimeError")
        and "engine.load_checkpoint" in msg
        and "shardopt checkpoint convert" in msg
        and "exp_avg" in msg
    ), msg
    # shardopt checkpoint convert reads frozen weights and buffers from DeepSpeed's files (ZeRO-2 and ZeRO-3)
    assert rec["convert_step3_missing"] == [] and rec["convert_zero3_missing"] == [], rec
    assert rec["convert_step3_vs_saved"] == 0.0 and rec["convert_zero3_vs_saved"] == 0.0, rec
    assert rec["convert_step3_calls"] == 3 and rec["convert_zero3_calls"] == 6, rec


@pytest.mark.parametrize("ws", world_sizes((1, 2, 3, 4), ci=(3,)))
def test_load_options_at_another_world_size(ws: int) -> None:
    resume(ws)
    (rec,) = _state[f"options{ws}"]
    check_options(rec)
    assert rec["path"] == os.path.join("step3", "mp_rank_00_model_states.pt"), rec


def cli(capsys, *args: str) -> types.SimpleNamespace:
    """``shardopt checkpoint ARGS`` in this process (``shardopt.cli.main``): its exit code and output. A new
    process would only add the interpreter's start (7-10 s of CI each); ``python -m shardopt checkpoint``'s own
    exit codes are checked in a new process by tests/test_checkpoint.py and tests/test_untrusted_checkpoint.py."""
    from shardopt.cli import main

    capsys.readouterr()
    code = main(["checkpoint", *args])
    out = capsys.readouterr()
    return types.SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)


def test_cli_inspect_and_missing_shard(capsys) -> None:
    root = checkpoint_root()
    ok = cli(capsys, "inspect", os.path.join(root, "racs", "zero2"))
    assert ok.returncode == 0, ok.stderr
    assert ", q(5,) [rows" in ok.stdout and "step [3.0]" in ok.stdout
    broken = tempfile.mkdtemp()
    shutil.copytree(os.path.join(root, "scale", "fsdp2", "dcp"), os.path.join(broken, "dcp"))
    os.remove(sorted(glob.glob(os.path.join(broken, "dcp", "*.distcp")))[-1])
    bad = cli(capsys, "inspect", os.path.join(broken, "dcp"))
    assert bad.returncode == 2 and "incomplete DCP checkpoint, shard file '__1_0.distcp' is missing" in bad.stderr, (
        bad.stderr
    )
    bad = cli(capsys, "convert", os.path.join(broken, "dcp"), os.path.join(broken, "out"), "--to", "file")
    assert bad.returncode == 2 and not os.path.exists(os.path.join(broken, "out"))
