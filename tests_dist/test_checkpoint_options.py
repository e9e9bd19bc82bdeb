"""DeepSpeed's checkpoint scenarios on shardopt's resharding load (``ckpt_options_worker.py``).

Saved at ZeRO-2, world size 2, after 3 steps of a model with a frozen layer, tied weights and buffers; loaded into
another random init at world sizes 1 and 3 (ZeRO-2) and at stages 1 and 3 (world size 2), which DeepSpeed's own
files cannot serve. Every load option: frozen weights and buffers equal the saved ones; ``full`` continues as the
uninterrupted run, ``load_optimizer_states=False`` as a fresh optimizer on the saved weights with the saved
scheduler, ``load_module_only=True`` as a fresh optimizer and scheduler, ``load_lr_scheduler_states=False`` as
DeepSpeed's own load with that option (each within 1e-6 after 3 more steps); the return value is DeepSpeed's;
``load_module_strict`` refuses a checkpoint saved with ``exclude_frozen_parameters`` and ``False`` keeps the model's
own frozen weights; ``custom_load_fn`` gets the whole saved module. ``ds_to_universal`` stops at once naming
shardopt's route. Full tier only (every optimizer, every target: about 10 minutes on 2 cores): even SCALE alone
costs CI 1.5-3 minutes of launches on a loaded 2-core machine, past its budget; CI runs the ``load_universal``
refusal (``tests/test_checkpoint_universal.py``) and the world-size resharding of ``test_checkpoint_dist.py``.
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest
from ckpt_options_worker import VARIANTS
from parity_worker import OPTIMIZERS
from tiers import FULL, full_only

from launch import run_ranks

TOL = 1e-6
#: (world size, ZeRO stage) of the loads; the checkpoint is ZeRO-2 at world size 2
TARGETS = [(1, 2), (3, 2), (2, 1), (2, 3)]
_state: dict = {}
pytestmark = full_only("tests/test_checkpoint_universal.py; test_checkpoint_dist.py's resharding")


def names() -> list[str]:
    return list(OPTIMIZERS) if FULL else ["scale"]


def launch(ws: int, args: list[str], out: str) -> list[dict]:
    proc = run_ranks(
        "ckpt_options_worker.py", ws, [*args, "--out", out, "--optimizers", ",".join(names())], timeout=1800
    )
    if proc.returncode != 0:
        pytest.fail(
            f"ckpt_options_worker {args} at world size {ws} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    with open(out) as f:
        return json.load(f)


def saved() -> tuple[str, list[dict]]:
    if "root" not in _state:
        root = tempfile.mkdtemp(prefix="shardopt-ckpt-options-")
        _state["root"], _state["save"] = (
            root,
            launch(2, ["--phase", "save", "--dir", root], os.path.join(root, "save.json")),
        )
    return _state["root"], _state["save"]


def test_deepspeed_own_load_means_the_references() -> None:
    """At the saved world size and stage DeepSpeed loads its own files: each option equals its reference (what
    the resharding path is held to), and the return value is what the resharding path returns."""
    _, recs = saved()
    assert [r["optimizer"] for r in recs] == names()
    for rec in recs:
        assert "error" not in rec, rec["error"]
        for variant in ("full", "no_optimizer", "module_only"):
            assert rec[f"native_{variant}_vs_reference"] <= TOL, (variant, rec)
        assert rec["no_scheduler_differs_from_full"] > 1e-4, rec  # the scheduler position matters here
        assert rec["native_full_path"] == os.path.join("step3", "mp_rank_00_model_states.pt")


def test_ds_to_universal_names_shardopts_route() -> None:
    _, recs = saved()
    for rec in recs:
        msg = rec["universal"]
        assert (
            msg.startswith("ValueError")
            and "engine.load_checkpoint" in msg
            and "shardopt checkpoint convert" in msg
            and "shardopt.checkpoint" in msg
        ), msg


@pytest.mark.parametrize("ws,stage", TARGETS)
def test_every_load_option_after_resharding(ws: int, stage: int) -> None:
    root, saves = saved()
    native = {r["optimizer"]: r for r in saves}
    recs = launch(
        ws, ["--phase", "load", "--dir", root, "--stage", str(stage)], os.path.join(root, f"load{ws}_{stage}.json")
    )
    loads = [r for r in recs if r["phase"] == "load"]
    assert len(loads) == len(names()) * len(VARIANTS)
    for rec in loads:
        assert "error" not in rec, rec["error"]
        what = f"{rec['optimizer']} {rec['variant']} -> ws {ws} ZeRO-{stage}"
        print(f"{what}: frozen+buffers {rec['frozen_buffers_vs_saved']:.3g}, after 3 steps {rec['vs_reference']:.3g}")
        assert rec["frozen_buffers_vs_saved"] <= TOL, (what, rec)
        assert rec["trained_vs_saved"] <= TOL, (what, rec)
        assert rec["vs_reference"] <= TOL, (what, rec)
        assert rec["calls"] == 6, (what, rec)  # the counter buffer came back as 3
        module_only = rec["variant"] == "module_only"
        assert rec["global_steps"] == (0 if module_only else 3), (what, rec)
        resumed = rec["variant"] in ("full", "no_optimizer")
        assert rec["lr_scheduler_position"] == (2 if resumed else -1), (what, rec)
        assert rec["client_epoch"] == 7, (what, rec)
        # DeepSpeed's return value: the model-states file, and what its own load leaves in the client state
        assert rec["path"] == native[rec["optimizer"]][f"native_{rec['variant']}_path"], (what, rec)
        assert rec["client"] == native[rec["optimizer"]][f"native_{rec['variant']}_client"], (what, rec)
    for rec in (r for r in recs if r["phase"] == "options"):
        assert "error" not in rec, rec["error"]
        assert (
            rec["strict_error"]
            and "missing ['frozen.weight', 'frozen.bias']" in rec["strict_error"]
            and "load_module_strict=False" in rec["strict_error"]
        ), rec
        assert (
            rec["nofrozen_frozen_vs_own"] == 0.0
            and rec["nofrozen_trained_vs_saved"] <= TOL
            and rec["nofrozen_buffers_vs_saved"] <= TOL
        ), rec
        assert rec["custom_calls"] == 1 and rec["custom_keys_match"], rec
        assert rec["custom_vs_reference"] <= TOL, rec
