"""Legacy FSDP ("FSDP1", issue 47; ``fsdp1_worker.py``): ``FullyShardedDataParallel`` with nested wrapping under
FULL_SHARD, SHARD_GRAD_OP, NO_SHARD and HYBRID_SHARD (2 x 2), ``use_orig_params`` True and False: every matrix on the
requested rule (formerly: AdamW in silence, or refused), within 1e-5 of one process after 3 steps, resume through
``shardopt.checkpoint`` exact, the same checkpoint reloaded into FSDP2 and DeepSpeed ZeRO-2 within 1e-5. In bf16
mixed precision (fp32 master weights): fp32 statistics, either use_orig_params the same run, near the fp32 one.
Parameters without their model, and FSDP1's own optimizer state dict (``FSDP.optim_state_dict``, DCP's
``get_state_dict``: it reshapes state like flat shards), are refused on every rank, naming the fix.

CI: world size 4 (uneven flat shards, ranks holding no element of some matrices; HYBRID_SHARD) for SCALE, RACS and
SUMO under FULL_SHARD with use_orig_params=False (FSDP1's default; reloaded into FSDP2 and ZeRO-2) and HYBRID_SHARD with
use_orig_params=True; the full tier: world sizes 2-4, every setting and optimizer."""

from __future__ import annotations

import json
import tempfile

import pytest
from fsdp1_worker import SETTINGS
from parity_worker import OPTIMIZERS
from tiers import CI_LAYOUT_OPTIMIZERS, FULL, selected, world_sizes

from launch import run_ranks

TOL, RESUME_TOL = 1e-5, 1e-6
#: bf16 forward/backward against the fp32 single process (as test_parity's bf16 layouts: RACS/SinkGD flip on a few
#: bf16-rounded gradient entries)
BF16_TOL = 0.06
NAMES = selected(OPTIMIZERS, CI_LAYOUT_OPTIMIZERS)
RUN = SETTINGS if FULL else ("FULL_SHARD/flat", "HYBRID_SHARD")
_cache: dict = {}


def records(world: int) -> list:
    if world not in _cache:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            proc = run_ranks(
                "fsdp1_worker.py",
                world,
                ["--out", out.name, "--optimizers", ",".join(NAMES), "--settings", ",".join(RUN)],
                timeout=900,
            )
            if proc.returncode != 0:
                pytest.fail(f"fsdp1 worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            _cache[world] = json.load(open(out.name))
    return _cache[world]


def record(world: int, name: str, setting: str) -> dict:
    rec = next(r for r in records(world) if (r["optimizer"], r["setting"]) == (name, setting))
    assert "error" not in rec, rec["error"]
    return rec


@pytest.mark.parametrize("world", world_sizes((2, 3, 4), (4,)))
@pytest.mark.parametrize("setting", [s for s in RUN if "bf16" not in s])
@pytest.mark.parametrize("name", NAMES)
def test_fsdp1_like_one_process(name: str, setting: str, world: int) -> None:
    if setting.startswith("HYBRID_SHARD") and world != 4:
        pytest.skip("HYBRID_SHARD runs as 2 x 2")
    rec = record(world, name, setting)
    print(
        f"{name} {setting} world {world}: {rec['max_abs_diff']:.2e} after 3 steps, resume "
        f"{rec['resume_max_abs_diff']:.2e}"
    )
    matrices = {n: r for n, r in rec["rules"].items() if n.endswith("weight") and "norm" not in n}
    assert matrices and set(matrices.values()) == {name}, rec["rules"]  # never AdamW for a matrix
    if not setting.startswith("NO_SHARD"):
        assert rec["flat_views"]  # the optimizer stepped 1-D views (never a FlatParameter mixing rules)
    assert rec["max_abs_diff"] <= TOL
    assert rec["resume_max_abs_diff"] <= RESUME_TOL
    if setting.startswith("FULL_SHARD"):  # the FSDP1 checkpoint reloaded into FSDP2 and into DeepSpeed ZeRO-2
        print(f"  reload: FSDP2 {rec['fsdp2_reload_max_abs_diff']:.2e}, ZeRO-2 {rec['zero2_reload_max_abs_diff']:.2e}")
        assert rec["fsdp2_reload_max_abs_diff"] <= TOL
        assert rec["zero2_reload_max_abs_diff"] <= TOL


@pytest.mark.parametrize("world", world_sizes((2, 3, 4), (4,)))
@pytest.mark.parametrize("name", NAMES)
def test_fsdp1_mixed_precision_keeps_fp32_statistics(name: str, world: int) -> None:
    if not FULL:
        pytest.skip("full tier only (SHARDOPT_TESTS=full): CI runs FSDP1 in fp32")
    orig, flat = record(world, name, "FULL_SHARD/bf16"), record(world, name, "FULL_SHARD/flat/bf16")
    print(f"{name} bf16 world {world}: {orig['max_abs_diff']:.3g} from fp32 one process; state {orig['state_dtypes']}")
    for rec in (orig, flat):
        assert rec["state_dtypes"] == ["torch.float32"] and rec["stepped_dtypes"] == ["torch.float32"], rec
        assert rec["max_abs_diff"] <= BF16_TOL and rec["resume_max_abs_diff"] <= RESUME_TOL
    # use_orig_params=False steps the same numbers as True: the same flat shards, only another view of them
    assert (
        max(abs(a - b) for n in orig["params"] for a, b in zip(_flat(orig["params"][n]), _flat(flat["params"][n])))
        <= 1e-6
    )


def _flat(x) -> list:
    return [v for item in x for v in _flat(item)] if isinstance(x, list) else [x]


def test_fsdp1_what_it_cannot_describe_is_refused_on_every_rank() -> None:
    rec = next(r for r in records(4) if r["setting"] == "without the model")
    assert "error" not in rec, rec["error"]
    for case in ("flat", "no_model"):
        assert all(m and "without its model" in m and "create_optimizer(fsdp_model" in m for m in rec[case]), rec
    for case in ("dcp", "fsdp_osd"):  # FSDP1's optimizer state dict: refused by name, shardopt.checkpoint named
        assert all(m and "FSDP1Error" in m and "shardopt.checkpoint.save" in m for m in rec[case]), rec


@pytest.mark.parametrize("name", NAMES)
def test_fsdp1_optimizer_built_before_wrapping_as_accelerate_does(name: str) -> None:
    """accelerate's order (``prepare(model, optimizer)``: the optimizer built on the unwrapped model), through
    ``shardopt.integrations.accelerate.after_prepare``: use_orig_params=True exact, False refused on every rank.
    accelerate itself turns FSDP on only on accelerator devices, so its ``prepare`` is not run here."""
    rec = record(4, name, "built before wrapping")
    assert rec["max_abs_diff"] <= TOL, rec
    assert all(m and "FSDP1Error" in m and "Build the optimizer after wrapping" in m for m in rec["flat"]), rec
