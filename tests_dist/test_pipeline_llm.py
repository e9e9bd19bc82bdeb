"""A pipelined LLM on DeepSpeed (issue 45; ``pipeline_llm_worker.py``): ``[embedding, block, block, norm, head]`` as
LayerSpecs on 2 stages x 2 data-parallel ranks, ZeRO-1, accumulation 2, untied and tied through ``TiedLayerSpec``,
with no routing given. Every parameter gets the role and rule one process gives it (the last stage's head is the
LM head), the stages form different numbers of param groups and still train, 3 steps equal one process within
1e-5, and a save and resume continues exactly.

CI: SCALE, RACS and SUMO; the full tier every optimizer."""

from __future__ import annotations

import json
import tempfile

import pytest
from layout_options import OPTIONS
from tiers import CI_LAYOUT_OPTIMIZERS, selected

from launch import run_ranks

TOL, RESUME_TOL = 1e-5, 1e-6
NAMES = selected(OPTIONS, CI_LAYOUT_OPTIMIZERS)
_cache: dict = {}


def records() -> list:
    if "recs" not in _cache:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            proc = run_ranks(
                "pipeline_llm_worker.py", 4, ["--out", out.name, "--optimizers", ",".join(NAMES)], timeout=900
            )
            if proc.returncode != 0:
                pytest.fail(f"pipeline llm worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            _cache["recs"] = json.load(open(out.name))
    return _cache["recs"]


@pytest.mark.parametrize("tied,clip", [(False, 0.0), (True, 0.0), (False, 0.2)])
@pytest.mark.parametrize("name", NAMES)
def test_pipelined_llm_like_one_process(name: str, tied: bool, clip: float) -> None:
    """(``clip``: gradient clipping on; every stage must clip by the same global norm, DeepSpeed's.)"""
    rec = next(r for r in records() if (r["optimizer"], r["tied"], r["clip"]) == (name, tied, clip))
    assert "error" not in rec, rec["error"]
    print(
        f"{name} tied={tied} (param groups per rank {rec['groups_per_rank']}): {rec['max_abs_diff']:.2e} after 3 "
        f"steps, resume {rec['resume_max_abs_diff']:.2e}, 6 steps {rec['six_steps_max_abs_diff']:.2e}"
    )
    assert rec["same_rules"], rec["rules"]
    # engine.describe(all_stages=True): every stage's parameters, each row as one process prints it (the role's source
    # aside: the pipeline's layer specs declare what one process finds from the modules), on every rank
    got, want = (sorted(line.split(maxsplit=4) for line in rec[k][1:]) for k in ("table", "one_process_table"))
    assert [r[:3] + r[4:] for r in got] == [r[:3] + r[4:] for r in want], "\n".join(rec["table"])
    head = "tied_modules.embed.weight" if tied else "4.weight"
    assert any(r.startswith(f"{head} lm_head ") for r in rec["rules"]), rec["rules"]
    if name in ("scale", "racs"):  # these stages form different numbers of param groups
        assert len(set(rec["groups_per_rank"])) > 1
    norms = rec["grad_norms"]
    if clip:  # the same global norm on every stage (DeepSpeed's, over both stages' groups), above the clip
        assert all(n == pytest.approx(norms[0], rel=1e-5) for n in norms) and min(norms[0]) > clip, norms
    assert rec["max_abs_diff"] <= TOL
    assert rec["resume_max_abs_diff"] <= RESUME_TOL
    assert rec["six_steps_max_abs_diff"] <= TOL
