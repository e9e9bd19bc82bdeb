"""ZeRO-Offload through every front door, and bf16 runs whose spread is AdamW's (issue 56); 2 CPU ranks on gloo,
the tiny LLaMA of ``hf_worker.py``.

* offload: ``shardopt.deepspeed.initialize``, the Hugging Face Trainer (``enable``) and accelerate (``prepare``),
  each at ZeRO-2 and ZeRO-3 with ``offload_optimizer`` cpu and ZeRO-3 with ``offload_param`` cpu too: after 3
  steps every parameter within 1e-5 of the single-process run on the same global batches, the shardopt optimizer
  stepping DeepSpeed's CPU partitions (not a ``DeepSpeedCPUAdam`` swapped in). CI: one launch (accelerate, the
  front door that used to lose the optimizer, ZeRO-3 with parameter offload, SCALE and SUMO); the full tier every
  front door, engine and optimizer.
* bf16 spread (full tier): world size 2 against 1 under DeepSpeed bf16 ZeRO-2 / ZeRO-3 and FSDP2 mixed precision,
  the relative difference ``|W_2 - W_1| / |W_1 - W_0|`` of every rule at most 2x torch AdamW's in the same harness:
  ``offload_worker.SpreadMLP``, 8 samples a step, so the gradients are rank-deficient (the harness where SUMO
  measured 78% on bf16 ZeRO-3 with its fp32 cutoff, as in the issue); each rule at its defaults. And the same
  harness in one process for 60 steps (``spread_emulation.py``, issue 63): with ``signal_rank`` SUMO and Alice within
  2x AdamW's in the final loss and the parameters, world size 2 against 1 and bf16 against fp32; Muon at most its
  anchors' (``torch.optim.Muon``, DeepSpeed's Muon).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from tiers import FULL, full_only, tiered

from launch import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")

TOL = 1e-5
ALL = ("scale", "sinkgd", "racs", "muon", "swan", "asgo", "dasgo", "sumo", "alice", "alice0")
CI_CASE = ("accelerate", "zero3p")
CI_RULES = ("scale", "sumo")
_cache: dict = {}


def _launch(nproc: int, args: list[str]) -> dict:
    key = (nproc, tuple(args))
    if key not in _cache:
        with tempfile.TemporaryDirectory(prefix="o56_") as tmp:
            out = str(Path(tmp) / "out.pt")
            proc = run_ranks("offload_worker.py", nproc, [*args, "--out", out, "--dir", tmp], timeout=1500)
            if proc.returncode != 0:
                pytest.fail(f"offload_worker {args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}")
            _cache[key] = torch.load(out)
    return _cache[key]


def _params(run: dict) -> dict:
    return {k: v for k, v in run.items() if k != "__meta__"}


CASES = [(api, engine) for api in ("initialize", "trainer", "accelerate") for engine in ("zero2", "zero3", "zero3p")]


@pytest.mark.parametrize("api,engine", tiered(CASES, [CI_CASE], f"{CI_CASE} with {CI_RULES}"))
def test_offload_matches_single_process(api: str, engine: str) -> None:
    names = ALL if FULL else CI_RULES
    got = _launch(
        2, ["--mode", "offload", "--api", api, "--engine", engine, "--optimizer", ",".join(names), "--reference"]
    )
    for name in names:
        meta = got[name]["__meta__"]
        assert meta["optimizer"] != "None" and meta["stepped"] == meta["optimizer"], meta  # not DeepSpeedCPUAdam
        assert meta["flat_tensors_mapped"] > 0, meta
        a, b = _params(got[name]), _params(got[f"reference.{name}"])
        diff = max((a[k] - b[k]).abs().max().item() for k in b)
        print(f"{api} {engine} {name}: max |offload - one process| = {diff:.3g}")
        assert diff <= TOL, (name, diff)


SPREAD_ENGINES = ["zero2_bf16", "zero3_bf16", "fsdp2_bf16"]


def spread(ws1: dict, ws2: dict) -> float:
    keys = [k for k in ws1 if k != "__meta__" and not k.startswith("init.")]
    num = sum(((ws1[k] - ws2[k]) ** 2).sum() for k in keys).sqrt()
    den = sum(((ws1[k] - ws1["init." + k]) ** 2).sum() for k in keys).sqrt()
    return (num / den).item()


@full_only("tests/test_offload_config.py's SUMO cutoff case")
@pytest.mark.parametrize("engine", SPREAD_ENGINES)
def test_bf16_spread_at_most_twice_adamw(engine: str) -> None:
    names = ("adamw",) + ALL
    args = ["--mode", "spread", "--engine", engine, "--optimizer", ",".join(names)]
    one, two = _launch(1, args), _launch(2, args)
    spreads = {name: spread(one[name], two[name]) for name in names}
    print(engine, {k: f"{v:.3%}" for k, v in spreads.items()})
    worse = {k: v for k, v in spreads.items() if v > 2 * spreads["adamw"]}
    for name in worse:  # where it is: a rule's matrices, or the vectors every rule leaves to AdamW (docs/exactness.md)
        print(f"  {name}: largest parts", largest_parts(one[name], two[name]))
    assert not worse, (engine, spreads)


def largest_parts(ws1: dict, ws2: dict, top: int = 3) -> dict[str, str]:
    """The parameters with the largest share of ``spread``'s numerator, each relative to the same denominator."""
    keys = [k for k in ws1 if k != "__meta__" and not k.startswith("init.")]
    den = sum(((ws1[k] - ws1["init." + k]) ** 2).sum() for k in keys).sqrt()
    parts = {k: ((ws1[k] - ws2[k]) ** 2).sum().sqrt().item() / den.item() for k in keys}
    return {k: f"{v:.2%}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])[:top]}


@full_only("tests/test_offload_config.py's SUMO cutoff case")
def test_sumo_bf16_cutoff_removes_the_rounding_directions() -> None:
    """What the precision-aware cutoff does in the spread harness (DeepSpeed bf16 ZeRO-3): SUMO's spread with its
    fp32 cutoff (the issue's 80%: directions of bf16 rounding at unit weight) falls at least 3x (measured 78% ->
    21%). The rest is not rounding: with bf16 in the first step only and fp32 after it, SUMO still differs by 20%
    (the exact polar factor gives unit weight to the small signal directions that step 1's 0.3% difference
    turns), which no rounding cutoff reaches (docs/exactness.md)."""
    base = ["--mode", "spread", "--engine", "zero3_bf16", "--optimizer", "sumo"]
    with_cutoff = spread(_launch(1, base)["sumo"], _launch(2, base)["sumo"])
    fp32_cutoff = spread(_launch(1, [*base, "--no-cutoff"])["sumo"], _launch(2, [*base, "--no-cutoff"])["sumo"])
    print(f"SUMO bf16 ZeRO-3 spread: {fp32_cutoff:.3%} with the fp32 cutoff, {with_cutoff:.3%} with the bf16 one")
    assert with_cutoff * 3 <= fp32_cutoff, (with_cutoff, fp32_cutoff)


@full_only("tests/test_signal_rank.py (the option's bases, fp32 bit for bit)")
def test_bf16_spread_one_process_signal_rank_within_twice_adamw() -> None:
    """The spread harness in one process, 60 steps (``spread_emulation.py``, issue 63): with ``signal_rank`` SUMO,
    Alice and Alice-0 stay within 2x torch AdamW's spread, world size 2 against 1 and bf16 against fp32, in the
    parameters and in the final loss (at their defaults SUMO measured 60x / 43x AdamW's and Alice 35x / 20x, as
    the float64 references fed the same gradients do: inherent, docs/exactness.md); shardopt's Muon at most its
    anchors' (torch.optim.Muon, DeepSpeed's Muon) in the same harness."""
    import spread_emulation

    got = {name: spread_emulation.measure(name, 60, {}) for name in ("adamw", "muon", "torch_muon", "ds_muon")}
    for name in ("sumo", "alice", "alice0"):
        got[name] = spread_emulation.measure(name, 60, {"signal_rank": True})
    for name, r in got.items():
        print(name, {k: f"{v:.3g}" for k, v in r.items()})
    for name in ("sumo", "alice", "alice0"):
        for key in ("ws", "fp", "ws_loss", "fp_loss"):
            assert got[name][key] <= 2 * got["adamw"][key], (name, key, got[name], got["adamw"])
    for key in ("ws", "fp", "ws_loss", "fp_loss"):
        assert got["muon"][key] <= max(got["torch_muon"][key], got["ds_muon"][key]), (key, got)
