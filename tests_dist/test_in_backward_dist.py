"""Stepping in backward on DDP and FSDP2 (issue 62): ``create_optimizer(..., step_in_backward=True)`` at 2 ranks
equals the single process's ordinary step on the whole global batch (3 steps, ToyLM with 2 blocks), FSDP2 leaves
no gradient after backward, and bf16 stochastic rounding of FSDP2 row and column shards equals the whole matrix
rounded in one process (``in_backward_worker.py``). CI: SCALE and SUMO; the full tier every rule."""

from __future__ import annotations

import json
import tempfile

import pytest
from in_backward_worker import CI_RULES, ENGINES, RULES
from tiers import tiered

from launch import run_ranks

TOL = 1e-5
_results: list[dict] = []


def results() -> list[dict]:
    if not _results:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            proc = run_ranks("in_backward_worker.py", 2, ["--out", out.name], timeout=900)
            if proc.returncode != 0:
                pytest.fail(f"in-backward worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            _results.extend(json.load(open(out.name)))
    return _results


def _record(opt: str, engine: str) -> dict:
    rec = next(r for r in results() if (r["optimizer"], r["engine"]) == (opt, engine))
    assert "error" not in rec, rec["error"]
    return rec


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("opt", tiered(RULES, CI_RULES, f"{CI_RULES}"))
def test_in_backward_equals_one_process(opt: str, engine: str) -> None:
    rec = _record(opt, engine)
    print(f"{opt} in backward on {engine}, 2 ranks: max |diff| to one process = {rec['max_abs_diff']:.3g}")
    assert rec["max_abs_diff"] <= TOL
    assert rec["grads_left"] == 0


def test_stochastic_rounding_is_the_same_on_fsdp2_shards() -> None:
    rec = _record("rounding", "fsdp2")
    assert rec["max_abs_diff"] == 0.0
    assert rec["differs_from_nearest"]


def test_a_plain_model_under_a_process_group_is_refused() -> None:
    rec = _record("plain_model", "ddp")
    assert "pass the DistributedDataParallel wrapper" in rec["message"]
