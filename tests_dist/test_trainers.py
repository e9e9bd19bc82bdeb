"""The trainers users already run, as front doors (issue 64): each drives shardopt the way its users do, on 2 CPU
ranks (gloo), and ends within 1e-6 of the same run in one process (``trainers_worker.py`` says how each is
driven).

* torchtitan's ``CheckpointManager`` with ``shardopt.create_optimizer(model, ...)`` (the README's form) in its
  ``OptimizersContainer``, FSDP2: saved at step 2 (sync and async), resumed at world size 2 and resharded to 1,
  against the uninterrupted run.
* torchtune: a config's ``_component_: shardopt.<Name>`` built as its distributed recipe does, FSDP2 through
  ``training.shard_model``; one optimizer, or one per parameter stepped in backward (``optimizer_in_bwd``): the
  embedding and the output layer get their declared roles with no warning (found on the call stack under
  ``config.instantiate``), and torchtune's full optimizer state dict round trip changes nothing.
* Lightning: ``configure_optimizers`` returning ``shardopt.create_optimizer(self, ...)`` under DDP and
  ``ModelParallelStrategy`` (FSDP2 in ``configure_model``), resumed with ``fit(ckpt_path=...)``.
* TRL's ``SFTTrainer`` under DeepSpeed ZeRO-2 (a ``"shardopt"`` section and ``enable(trainer)``).

CI runs one case per trainer (SCALE: the embedding's and the LM head's own rules show up in the result); the
full tier every optimizer and mode. Lightning's GPU-only strategies (``fsdp``, ``deepspeed_stage_*``):
benchmarks/gpu_checks.sh.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile

import pytest
import torch
from tiers import FULL, tiered

from launch import run_ranks

TOL = 1e-6
#: torchtune 0.6's torchao (<= 0.15, which peft >= 0.19 refuses), installed apart by make setup
TORCHAO = os.path.join(sys.prefix, "torchtune-torchao")
OPTIMIZERS = ("scale", "racs", "muon", "sumo")


def launch(nproc: int, args: list[str], tmp: str, name: str) -> dict:
    out = os.path.join(tmp, f"{name}.pt")
    proc = run_ranks("trainers_worker.py", nproc, [*args, "--out", out], timeout=900)
    if proc.returncode != 0:
        pytest.fail(f"trainers_worker {args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return torch.load(out)


def worst(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def roles_declared(meta: dict, embedding: str, head: str) -> None:
    assert meta[embedding][:2] == ["embedding", "declared"], meta[embedding]
    assert meta[head][:2] == ["lm_head", "declared"], meta[head]


# ---------------------------------------------------------------------------------------------- torchtitan
@pytest.mark.parametrize(
    "name,mode",
    tiered([(n, m) for n in OPTIMIZERS for m in ("disabled", "async")], [("scale", "async")], "SCALE, async save"),
)
def test_torchtitan_checkpoint_manager_resumes_and_reshards(name: str, mode: str) -> None:
    pytest.importorskip("torchtitan")
    with tempfile.TemporaryDirectory(prefix="titan64_") as tmp:
        base = ["--trainer", "titan", "--optimizer", name, "--async-mode", mode, "--dir", tmp]
        whole = launch(2, [*base, "--phase", "save"], tmp, "save")
        roles_declared(whole["meta"], "tok_embeddings.weight", "output.weight")
        for ws in (2, 1) if FULL else (1,):  # CI: the resharded load (world size 2's: the full tier)
            resumed = launch(ws, [*base, "--phase", "resume"], tmp, f"resume{ws}")
            diff = worst(whole["params"], resumed["params"])
            print(f"torchtitan {name} {mode}: resumed at world size {ws} vs uninterrupted {diff:.3g}")
            assert diff <= TOL, (ws, diff)


# ---------------------------------------------------------------------------------------------- torchtune
_tune_refs: dict = {}


@pytest.mark.parametrize(
    "name,in_bwd",
    tiered([(n, b) for n in OPTIMIZERS for b in (False, True)], [("scale", True)], "SCALE, optimizer_in_bwd"),
)
def test_torchtune_component_config_on_fsdp2(name: str, in_bwd: bool) -> None:
    if importlib.util.find_spec("torchtune") is None or not os.path.isdir(TORCHAO):
        pytest.skip(f"torchtune, and torchao 0.15 in {TORCHAO} (make setup installs both)")
    with tempfile.TemporaryDirectory(prefix="tune64_") as tmp:
        got = launch(2, ["--trainer", "tune", "--optimizer", name, *(["--in-bwd"] if in_bwd else [])], tmp, "run")
    ref = got["reference"]
    diff = worst(ref["params"], got["params"])
    print(f"torchtune {name} in_bwd={in_bwd}: 2 ranks vs one process {diff:.3g}")
    assert got["unnamed_warnings"] == []
    assert got["meta"] == ref["meta"]  # every parameter's role, source and rule as create_optimizer(model) gives
    roles_declared(got["meta"], "tok_embeddings.weight", "output.weight")
    assert diff <= TOL
    if not in_bwd:
        assert got["state_round_trip"] == 0.0


# ---------------------------------------------------------------------------------------------- Lightning
@pytest.mark.parametrize(
    "name,strategy",
    tiered([(n, s) for n in OPTIMIZERS for s in ("ddp", "fsdp2")], [("scale", "ddp")], "SCALE, DDP"),
)
def test_lightning_fit_and_resume(name: str, strategy: str) -> None:
    pytest.importorskip("lightning")
    with tempfile.TemporaryDirectory(prefix="lightning64_") as tmp:
        args = ["--trainer", "lightning", "--optimizer", name, "--strategy", strategy, "--dir", tmp]
        got = launch(2, [*args, "--phase", "resume"], tmp, "run")
    ref = got["reference"]
    diff = worst(ref["params"], got["params"])
    print(f"Lightning {strategy} {name}: 2 steps, a checkpoint, fit(ckpt_path) to 4 vs one process {diff:.3g}")
    assert got["meta"] == ref["meta"]
    roles_declared(got["meta"], "tok_embeddings.weight", "output.weight")
    assert diff <= TOL


# ---------------------------------------------------------------------------------------------- TRL
@pytest.mark.parametrize("name", tiered(OPTIMIZERS, ["scale"], "SCALE"))
def test_trl_sft_trainer_on_zero2(name: str) -> None:
    pytest.importorskip("trl")
    pytest.importorskip("deepspeed")
    with tempfile.TemporaryDirectory(prefix="trl64_") as tmp:
        args = ["--trainer", "trl", "--optimizer", name, "--dir", tmp]
        got = launch(2, args, tmp, "run")
    ref = got["reference"]
    diff = worst(ref["params"], got["params"])
    print(f"TRL SFTTrainer ZeRO-2 {name}: 2 ranks vs one process {diff:.3g}")
    assert got["meta"] == ref["meta"]
    roles_declared(got["meta"], "embed_tokens.weight", "lm_head.weight")
    assert diff <= TOL
