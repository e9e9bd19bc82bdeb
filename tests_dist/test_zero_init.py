"""Models built under ``deepspeed.zero.Init`` (issue 47, item 0; ``zero_init_worker.py``): partitioned from the start
(``p.shape == (0,)``), formerly refused with advice to route the matrices to AdamW. Routing and the optimizer read
the logical shape (``ds_shape``), so such a model trains through ``shardopt.deepspeed.initialize`` with every matrix
on the requested rule, within 1e-5 of one process after 3 steps, and resumes exactly. HF's ``from_pretrained`` under a
ZeRO-3 config is ``test_hf_integration.py``'s.

CI: world size 2, SCALE, RACS and SUMO; the full tier: world sizes 2 and 3, every optimizer."""

from __future__ import annotations

import json
import tempfile

import pytest
from parity_worker import OPTIMIZERS
from tiers import CI_LAYOUT_OPTIMIZERS, selected, world_sizes

from launch import run_ranks

TOL, RESUME_TOL = 1e-5, 1e-6
NAMES = selected(OPTIMIZERS, CI_LAYOUT_OPTIMIZERS)
_cache: dict = {}


def records(world: int) -> list:
    if world not in _cache:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            proc = run_ranks(
                "zero_init_worker.py", world, ["--out", out.name, "--optimizers", ",".join(NAMES)], timeout=900
            )
            if proc.returncode != 0:
                pytest.fail(f"zero.Init worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            _cache[world] = json.load(open(out.name))
    return _cache[world]


@pytest.mark.parametrize("world", world_sizes((2, 3), (2,)))
@pytest.mark.parametrize("name", NAMES)
def test_zero_init_model_trains_like_one_process(name: str, world: int) -> None:
    rec = next(r for r in records(world) if r["optimizer"] == name)
    assert "error" not in rec, rec["error"]
    print(
        f"{name} zero.Init world {world}: {rec['max_abs_diff']:.2e} after 3 steps, resume "
        f"{rec['resume_max_abs_diff']:.2e}; rules {rec['matrix_rules']}"
    )
    assert rec["partitioned_at_build"]
    assert set(rec["matrix_rules"].values()) == {name}  # never AdamW for a matrix
    assert rec["max_abs_diff"] <= TOL
    assert rec["resume_max_abs_diff"] <= RESUME_TOL
