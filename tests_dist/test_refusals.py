"""What shardopt does not support yet fails with one clear error on every rank (issue 28): a routing pattern no
pipeline stage matches, and MoE experts split by tensor parallelism (``refusal_worker.py``, world size 2).
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
