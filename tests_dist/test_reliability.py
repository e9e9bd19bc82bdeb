"""Reliability: consistent non-finite skips, no hangs with frozen/missing grads or mismatched plans, and
crash-and-resume under torchrun (a rank SIGKILLed mid-training)."""

from __future__ import annotations

import json
import os
import sys
import tempfile

import pytest
import torch
from parity_worker import OPTIMIZERS
from reliability_worker import DEVICE_GATED
from tiers import full_only

from launch import ROOT, free_port, run_bounded, run_ranks

_cache: dict = {}


def records() -> list:
    if "recs" not in _cache:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            proc = run_ranks("reliability_worker.py", 2, ["--out", out.name], timeout=600)
            if proc.returncode != 0:
                pytest.fail(f"reliability worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            _cache["recs"] = json.load(open(out.name))
    return _cache["recs"]


def test_nonfinite_on_one_rank_is_skipped_on_every_rank():
    cases = [ranks for ranks in records() if ranks[0]["kind"] == "nonfinite"]
    assert len(cases) == 3 * len(OPTIMIZERS)
    for ranks in cases:
        for rec in ranks:
            assert "error" not in rec, rec.get("error")
            assert rec["changed_on_skipped_step"] == [] and rec["finite"], rec
            if rec["engine"] != "zero2":  # DeepSpeed skips on its own global-norm overflow check first
                assert rec["skipped"] == 1, rec


def test_nonfinite_skip_decided_on_the_device_on_every_rank():
    """The skip decided on the device by every rule but ASGO (as on CUDA; here the CPU is made to): the flag
    all-reduced and never read in the step, the skipped step leaving every rank's shard untouched, counted at
    ``skipped_steps``."""
    cases = [ranks for ranks in records() if ranks[0]["kind"] == "nonfinite_on_device"]
    assert len(cases) == 2 * len(DEVICE_GATED)
    for ranks in cases:
        for rec in ranks:
            assert "error" not in rec, rec.get("error")
            assert rec["gated"] and rec["changed_on_skipped_step"] == [] and rec["finite"], rec
            assert rec["skipped"] == 1, rec


def test_frozen_params_and_missing_grads_do_not_hang():
    cases = [ranks for ranks in records() if ranks[0]["kind"] == "frozen_missing"]
    assert len(cases) == len(OPTIMIZERS)
    for ranks in cases:
        for rec in ranks:
            assert "error" not in rec, rec.get("error") and rec["finite"]


def test_plan_mismatch_is_named_not_hung():
    (ranks,) = [r for r in records() if r[0]["kind"] == "plan_mismatch"]
    for rec in ranks:
        assert "error" not in rec, rec.get("error")
        assert "step plans differ between ranks" in rec["error_message"]
        assert "rank 0 has 'group 0: treatment=adamw tensors=7' where rank 1 has" in rec["error_message"]


@full_only("torchrun's restart of the reference trainer (test_killed_worker_restarts_and_resumes_on_deepspeed)")
def test_crash_and_resume_under_torchrun():
    from parity_worker import reference

    with tempfile.TemporaryDirectory() as tmp:
        env = dict(
            os.environ,
            DS_ACCELERATOR="cpu",
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        )
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--max-restarts=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}",
            str(ROOT / "tests_dist" / "crash_worker.py"),
            "--dir",
            tmp,
            "--optimizer",
            "racs",
        ]
        proc = run_bounded(cmd, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        result = json.load(open(os.path.join(tmp, "result.json")))
    assert result["attempt"] == 1 and result["resumed_from"] == 4, result["attempt"]
    want, _ = reference("racs", steps=8)
    diff = max((torch.tensor(result["params"][n]) - want[n]).abs().max().item() for n in want)
    print(f"crash at step 5, restarted from step 4: max |resumed - uninterrupted| = {diff:.3g}")
    assert diff <= 1e-5
