"""What shardopt does not support yet fails with one clear error on every rank (issue 28): a routing pattern no
pipeline stage matches, and MoE experts split by tensor parallelism (``refusal_worker.py``, world size 2). What
shardopt does not own it does not refuse: DeepSpeed's own keys reach DeepSpeed's validation (issue 65).
Pipelines and expert parallelism themselves are exact (``test_pipeline.py``, ``test_pipeline_llm.py``, whose stages
form different numbers of param groups, ``test_moe.py``)."""

from __future__ import annotations

import json
import tempfile

import pytest

from launch import run_ranks

_cache: dict = {}


def records() -> dict:
    if "recs" not in _cache:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            proc = run_ranks("refusal_worker.py", 2, ["--out", out.name], timeout=300)
            if proc.returncode != 0:
                pytest.fail(f"refusal worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            _cache["recs"] = {r["case"]: r for r in json.load(open(out.name))}
    return _cache["recs"]


@pytest.mark.parametrize(
    "case, words",
    [
        (
            "pipeline_routing",
            ["ConfigError", "shardopt.routing: patterns ['9.*'] match no trainable parameter on any pipeline stage"],
        ),
        (
            "moe_expert_tp",
            [
                "NotImplementedError",
                "deepspeed.moe.layer.MoE at 'moe'",
                "enable_expert_tensor_parallelism",
                "enable_expert_tensor_parallelism=False",
            ],
        ),
    ],
)
def test_unsupported_parallelism_is_refused_on_every_rank(case: str, words: list[str]) -> None:
    rec = records()[case]
    print(f"{case}: {rec['error']}")
    assert rec["error"] is not None
    assert all(w in rec["error"] for w in words), rec["error"]
    assert len(set(rec["every_rank"])) == 1  # the same error on every rank


def test_pipeline_specs_not_buildable_on_meta_warn_on_every_rank() -> None:
    """Where the whole model cannot be seen (a layer spec that cannot be built on the meta device), every rank says
    so once, and the last stage names its would-be LM head with the routing to pass."""
    warned = records()["pipeline_unbuildable"]["warnings"]
    print(warned)
    assert all(len(w) == 1 for w in warned)
    assert "routing={'<name>': 'lm_head'}" in warned[0][0]
    assert "on this stage ['2.weight'] would be the LM head" in warned[-1][0]


def test_deepspeed_keys_reach_deepspeeds_own_validation() -> None:
    """``zero_optimization`` keys are DeepSpeed's (issue 65): a key this DeepSpeed does not know is answered by
    DeepSpeed's ZeRO model, and MiCS (removed in DeepSpeed 0.19.8) by DeepSpeed's own message with its link; shardopt
    calls neither a hyperparameter."""
    future, mics = records()["zero_future_key"], records()["zero_mics"]
    print(f"zero_optimization.some_future_key: {future['error']}\nzero_optimization.mics_shard_size: {mics['error']}")
    assert future["error"].startswith(
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for DeepSpeedZeroConfig"
    )
    assert "some_future_key\n  Extra inputs are not permitted" in future["error"]
    assert mics["error"].startswith(
        "deepspeed.runtime.config.DeepSpeedConfigError: MiCS ZeRO-3 sharding has been removed; "
        "'zero_optimization.mics_shard_size' is no longer supported. See https://github.com/deepspeedai/"
    )
    for rec in (future, mics):
        assert "hyperparameter" not in rec["error"] and not rec["error"].startswith("shardopt.")
        assert len(set(rec["every_rank"])) == 1
