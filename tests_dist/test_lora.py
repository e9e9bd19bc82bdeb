"""peft LoRA as a regression (issue 56): the tiny LLaMA of ``hf_worker.py`` with a LoRA adapter (``r=4`` on
``q_proj`` and ``v_proj``; peft freezes every base parameter), a shardopt optimizer stepping the LoRA A and B
matrices, 3 steps on 2 CPU ranks under DeepSpeed ZeRO-2 and ZeRO-3 (``shardopt.deepspeed.initialize``) and FSDP2
(``fully_shard`` per decoder layer), against one process on the same global batches: every trainable parameter
within 1e-5, every frozen one unchanged (bit for bit), and ``describe()`` giving each LoRA matrix the ``matrix``
role by its type (``nn.Linear``) and the optimizer's own rule, under every engine as in one process.

CI: ZeRO-3 with SUMO (a whole-matrix rule on partitioned 16 x 4 / 4 x 16 adapters); the full tier every engine and
optimizer (``lora_worker.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from tiers import FULL, tiered

from launch import ROOT, run_ranks

pytest.importorskip("peft")
pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

TOL = 1e-5
ALL = ("scale", "sinkgd", "racs", "muon", "swan", "asgo", "dasgo", "sumo", "alice", "alice0")
ENGINES = ("zero2", "zero3", "fsdp2")
CI_ENGINE, CI_RULES = "zero3", ("sumo",)
CI_WHAT = f"{CI_ENGINE} with {CI_RULES}"
_cache: dict = {}


def _launch(engine: str, names: tuple[str, ...]) -> dict:
    """``lora_worker.py`` on 2 ranks, or one process for ``engine="reference"``."""
    key = (engine, names)
    if key not in _cache:
        with tempfile.TemporaryDirectory(prefix="lora56_") as tmp:
            out = str(Path(tmp) / "out.pt")
            args = ["--engine", engine, "--optimizer", ",".join(names), "--out", out]
            if engine == "reference":
                env = {
                    **os.environ,
                    "OMP_NUM_THREADS": "1",
                    "LORA_WORLD": "2",
                    "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                }
                script = str(ROOT / "tests_dist" / "lora_worker.py")
                proc = subprocess.run(
                    [sys.executable, script, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
                )
            else:
                proc = run_ranks("lora_worker.py", 2, args, timeout=900)
            if proc.returncode != 0:
                pytest.fail(f"lora_worker {args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}")
            _cache[key] = torch.load(out)
    return _cache[key]


#: Alice and Alice-0 with the subspace rank at the adapter's rank (``hf_worker.HP``: rank 4 = min(16, 4)) differed
#: from one process by 3e-3 until each basis vector's sign was pinned (issue 63: M is not rotated at a switch, and a
#: square basis's Ritz vectors took their sign from rounding); now they must match one process 10x tighter than TOL
ALICE_TOL = 1e-6


def _cases() -> list:
    """Every engine x optimizer (CI: ``CI_ENGINE`` with ``CI_RULES``)."""
    return tiered([(e, n) for e in ENGINES for n in ALL], [(CI_ENGINE, n) for n in CI_RULES], CI_WHAT)


@pytest.mark.parametrize("engine,name", _cases())
def test_lora_matches_single_process(engine: str, name: str) -> None:
    names = ALL if FULL else CI_RULES
    got, ref = _launch(engine, names), _launch("reference", names)
    run, one = got[name], ref[name]
    meta = run["__meta__"]
    frozen = set(meta["frozen"])
    params = [k for k in one if k != "__meta__" and not k.startswith("init.")]
    trainable = [k for k in params if k not in frozen]
    assert frozen == set(one["__meta__"]["frozen"]) and len(frozen) > 0, meta["frozen"]
    assert sorted(trainable) == sorted(k for k in params if ".lora_A." in k or ".lora_B." in k), trainable
    # the role table: each LoRA matrix a matrix by its type, stepped by the optimizer's rule; the same as in
    # one process (and only the trainable parameters listed: the frozen base is not the optimizer's)
    assert meta["roles"] == one["__meta__"]["roles"], (meta["roles"], one["__meta__"]["roles"])
    assert len(meta["roles"]) == len(trainable), meta["roles"]
    for row in meta["roles"].values():
        role, source, rule = row
        assert (role, source, rule.split()[0]) == ("matrix", "type", name), row
    diff = max((run[k] - one[k]).abs().max().item() for k in trainable)
    moved = {k: (one[k] - one["init." + k]).abs().max().item() for k in trainable}
    print(
        f"LoRA {engine} {name}: max |2 ranks - one process| = {diff:.3g} (moves {min(moved.values()):.3g} to "
        f"{max(moved.values()):.3g})"
    )
    assert diff <= (ALICE_TOL if name in ("alice", "alice0") else TOL), (name, diff)
    # the adapters trained: every matrix moved (B from zero, A once B is not), most by far more than TOL (ASGO's
    # damping eps = 1e-6 moves an A whose gradient is 1e-7 by about that much)
    assert min(moved.values()) > 0 and max(moved.values()) > 100 * TOL, (name, moved)
    for k in frozen:
        assert torch.equal(run[k], run["init." + k]), (name, k)
