"""DeepSpeed's checkpoint scenarios on FSDP2 (issue 55; ``ckpt_fsdp2_worker.py``), full tier.

A model with a frozen layer, tied weights, a persistent buffer and a call counter, saved after 3 steps at world
size 2 through DCP (``get_state_dict`` + the scheduler) and through ``shardopt.checkpoint.save(..., model=)``,
loaded into another random init at world sizes 1 and 3: for both paths, loading everything (``full``), the model
and the scheduler (``no_optimizer``) and the model alone (``module_only``) restore frozen weights and buffers
exactly and continue within 1e-6 of the uninterrupted run / a fresh optimizer on the saved weights with the saved
or a fresh scheduler, every optimizer; a checkpoint saved without ``model=`` is refused with ``strict`` (nothing
changes) and ``strict=False`` keeps the model's own frozen weights and buffers. CI runs the DeepSpeed case of
``test_checkpoint_dist.py`` (its FSDP2 resume is exact there on the toy model).
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest
from ckpt_fsdp2_worker import PATHS, VARIANTS
from parity_worker import OPTIMIZERS
from tiers import full_only

from launch import run_ranks

TOL = 1e-6
_state: dict = {}
pytestmark = full_only("test_checkpoint_dist.py's DeepSpeed load-options case and FSDP2 resume")


def launch(ws: int, args: list[str], out: str) -> list[dict]:
    proc = run_ranks(
        "ckpt_fsdp2_worker.py", ws, [*args, "--out", out, "--optimizers", ",".join(OPTIMIZERS)], timeout=1800
    )
    if proc.returncode != 0:
        pytest.fail(
            f"ckpt_fsdp2_worker {args} at world size {ws} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    with open(out) as f:
        return json.load(f)


def saved() -> str:
    if "root" not in _state:
        root = tempfile.mkdtemp(prefix="shardopt-ckpt-fsdp2-")
        recs = launch(2, ["--phase", "save", "--dir", root], os.path.join(root, "save.json"))
        for rec in recs:
            assert "error" not in rec, rec["error"]
        _state["root"] = root
    return _state["root"]


@pytest.mark.parametrize("ws", [1, 3])
def test_dcp_and_shardopt_checkpoint_lose_nothing(ws: int) -> None:
    root = saved()
    recs = launch(ws, ["--phase", "load", "--dir", root], os.path.join(root, f"load{ws}.json"))
    loads = [r for r in recs if r["phase"] == "load"]
    assert len(loads) == len(OPTIMIZERS) * len(PATHS) * len(VARIANTS)
    for rec in loads:
        assert "error" not in rec, rec["error"]
        what = f"{rec['optimizer']} {rec['path']} {rec['variant']} ws 2 -> {ws}"
        print(f"{what}: frozen+buffers {rec['frozen_buffers_vs_saved']:.3g}, after 3 steps {rec['vs_reference']:.3g}")
        assert rec["frozen_buffers_vs_saved"] <= TOL and rec["trained_vs_saved"] <= TOL, (what, rec)
        assert rec["vs_reference"] <= TOL, (what, rec)
        assert rec["calls"] == 6, (what, rec)
        assert rec["scheduler_epoch"] == (0 if rec["variant"] == "module_only" else 3), (what, rec)
    for rec in (r for r in recs if r["phase"] == "strict"):
        assert "error" not in rec, rec["error"]
        assert (
            rec["strict_error"]
            and "['frozen.weight', 'frozen.bias', 'shift', 'calls']" in rec["strict_error"]
            and "strict=False" in rec["strict_error"]
        ), rec
        assert rec["unchanged_after_refusal"] == 0.0 and rec["kept_vs_own"] == 0.0, rec
        assert rec["trained_vs_saved"] <= TOL, rec
