"""The reference trainer's checkpoints at another world size (issue 55; ``trainer_ckpt_worker.py``), full tier.

``Trainer`` with tied embeddings saves its own checkpoint at step 2 on 2 ranks, on FSDP2 (DCP) and DeepSpeed
ZeRO-2; ``--resume``'s load into a trainer of another seed on 1 and 3 ranks gives the saved model exactly, still
tied, the optimizer's whole logical state exactly, the scheduler and the step. (The trainer's model has no frozen
weights or buffers; DDP runs refuse another world size, naming ``shardopt checkpoint convert``.) CI: the trainer's
resume in ``test_train_dist.py``.
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest
from tiers import full_only

from launch import run_ranks

_state: dict = {}
pytestmark = full_only("the trainer's resume at the same world size (test_train_dist.py)")


def launch(ws: int, phase: str, root: str) -> list[dict]:
    out = os.path.join(root, f"{phase}{ws}.json")
    proc = run_ranks("trainer_ckpt_worker.py", ws, ["--phase", phase, "--dir", root, "--out", out], timeout=900)
    if proc.returncode != 0:
        pytest.fail(
            f"trainer_ckpt_worker {phase} at world size {ws} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    with open(out) as f:
        recs = json.load(f)
    for rec in recs:
        assert "error" not in rec, rec["error"]
    return recs


def saved() -> str:
    if "root" not in _state:
        root = tempfile.mkdtemp(prefix="shardopt-ckpt-trainer-")
        assert [r["steps"] for r in launch(2, "save", root)] == [2, 2]
        _state["root"] = root
    return _state["root"]


@pytest.mark.parametrize("ws", [1, 3])
def test_trainer_resumes_at_another_world_size_losing_nothing(ws: int) -> None:
    recs = launch(ws, "load", saved())
    assert sorted(r["engine"] for r in recs) == ["deepspeed", "fsdp2"]
    for rec in recs:
        print(
            f"trainer {rec['engine']} ws 2 -> {ws}: model {rec['model_vs_saved']:.3g} (before the load "
            f"{rec['model_before_load_vs_saved']:.3g}), optimizer state {rec['optim_vs_saved']:.3g}"
        )
        assert rec["model_before_load_vs_saved"] > 1e-3, rec  # another init: the load is what makes them equal
        assert rec["resumed"] and rec["step"] == 2 and rec["scheduler"] and rec["tied"], rec
        assert rec["model_vs_saved"] == 0.0 and rec["optim_keys_match"] and rec["optim_vs_saved"] == 0.0, rec
