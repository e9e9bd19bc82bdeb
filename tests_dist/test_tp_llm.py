"""torchtitan's tensor-parallel plan on an LLM (issue 45; ``tp_llm_worker.py``): the embedding (``Shard(0)`` over the
vocabulary, its gradient left whole on every rank by autograd) and the LM head sharded as torchtitan shards them,
sequence-parallel norms, with and without ``loss_parallel``, on a 2-rank "tp" mesh and a 2 x 2 FSDP2 x TP mesh.
Every parameter gets the rule it gets in one process (``describe()`` compared row by row), 3 steps equal one
process within 1e-5, a save after 2 steps (DCP or ``shardopt.checkpoint``) resumes exactly, and a gradient that
cannot take its parameter's placements raises one clear error on every rank before anything moves.

CI: world size 4 (FSDP2 x TP, both losses, and the mismatched gradient) for SCALE, RACS and SUMO; the full tier adds
world size 2 (TP alone, both losses) and every optimizer."""

from __future__ import annotations

import json
import tempfile

import pytest
from tiers import CI_LAYOUT_OPTIMIZERS, selected, world_sizes
from tp_llm_worker import OPTIONS

from launch import run_ranks

TOL, RESUME_TOL = 1e-5, 1e-6
RUNS = {2: ("tp", "tp_lossp"), 4: ("fsdp2_tp", "fsdp2_tp_lossp")}
NAMES = selected(OPTIONS, CI_LAYOUT_OPTIMIZERS)
_results: dict[int, list[dict]] = {}


def results(world: int) -> list[dict]:
    if world not in _results:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            proc = run_ranks(
                "tp_llm_worker.py",
                world,
                ["--out", out.name, "--layouts", ",".join(RUNS[world]), "--optimizers", ",".join(NAMES)],
                timeout=900,
            )
            if proc.returncode != 0:
                pytest.fail(
                    f"tp llm worker at world size {world} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
                )
            _results[world] = json.load(open(out.name))
    return _results[world]


@pytest.mark.parametrize("world,layout", world_sizes([(w, lay) for w, lays in RUNS.items() for lay in lays], (4,)))
@pytest.mark.parametrize("name", NAMES)
def test_torchtitan_plan_like_one_process(name: str, world: int, layout: str) -> None:
    rec = next(r for r in results(world) if (r["optimizer"], r["layout"]) == (name, layout))
    assert "error" not in rec, rec["error"]
    print(
        f"{name} {layout} (world {world}): {rec['max_abs_diff']:.2e} after 3 steps, resume ({rec['resume']}) "
        f"{rec['resume_max_abs_diff']:.2e}"
    )
    assert rec["same_rules"], rec["rules"]
    assert any(r.startswith("tok_embeddings.weight 48x16 embedding") for r in rec["rules"])
    assert any(r.startswith("output.weight 48x16 lm_head") for r in rec["rules"])
    assert rec["max_abs_diff"] <= TOL
    assert rec["resume_max_abs_diff"] <= RESUME_TOL


def test_gradient_of_another_shape_raises_before_any_collective() -> None:
    rec = next(r for r in results(4) if r["layout"] == "mismatch")
    assert "error" not in rec, rec["error"]
    assert rec["message"] is not None and "'tok_embeddings.weight'" in rec["message"]
    assert "placements (R) on mesh DeviceMesh((other=4)" in rec["message"], rec["message"]
    assert "placements (_S(0, 2), S(0)) on mesh DeviceMesh((dp=2, tp=2)" in rec["message"], rec["message"]
    assert rec["raised_on"] == [True] * 4  # every rank, and none issued a collective first (no hang)
    assert rec["unchanged"]
