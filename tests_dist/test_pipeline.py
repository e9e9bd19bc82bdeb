"""DeepSpeed pipeline parallelism (issue 28, item 2; ``pipeline_worker.py``): a ``PipelineModule`` on 2 stages x 2
data-parallel ranks under ZeRO-1 with gradient accumulation 2 equals one process training the same layers on
the same global batch, after 3 steps and after a save and resume, for SCALE, RACS, SUMO, Alice and ASGO (the
whole-matrix ones under gather and distributed). DeepSpeed runs pipelines under ZeRO-0/1 only."""

from __future__ import annotations

import json
import tempfile

import pytest
from pipeline_worker import CASES

from launch import run_ranks

TOL = 1e-5
_cache: dict = {}


def records() -> list:
    if "recs" not in _cache:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            proc = run_ranks("pipeline_worker.py", 4, ["--out", out.name], timeout=600)
            if proc.returncode != 0:
                pytest.fail(f"pipeline worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            _cache["recs"] = json.load(open(out.name))
    return _cache["recs"]


@pytest.mark.parametrize("name, strategy", CASES)
def test_pipeline_stages_step_and_resume_like_one_process(name: str, strategy: str | None) -> None:
    rec = next(r for r in records() if (r["optimizer"], r["strategy"]) == (name, strategy))
    assert "error" not in rec, rec["error"]
    print(
        f"{name} ({strategy}) zero1 pp2 x dp2: {rec['max_abs_diff']:.2e} after 3 steps, "
        f"{rec['resume_max_abs_diff']:.2e} after a save, a resume and 3 more"
    )
    assert rec["max_abs_diff"] <= TOL
    assert rec["resume_max_abs_diff"] <= TOL
