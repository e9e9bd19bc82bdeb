"""Convergence on CUDA's routes against the ieee routes (issue 42): do the GPU defaults train as well?

    python -m benchmarks.routes_convergence            # 6 whole-matrix rules x (ieee, ieee seed 2, cuda), 200 steps
    python -m benchmarks.routes_convergence --quick    # 10 steps, Muon and SUMO

Each whole-matrix rule trains the tiny LLaMA as ``benchmarks.convergence`` does (same data, schedule and budget;
the learning rate its sweep found best, ``BEST_MULT``) three times on one CPU process:

* ``ieee``: the CPU's routes (factorizations, float32/64 products), seed 42;
* ``ieee, seed 43``: the same with another seed: the seed-to-seed spread the comparison is read against;
* ``cuda``: what a CUDA device runs by default, forced on the CPU: the batched iterative routes instead of
  ``eigh``/``svd``/``qr`` (``iterative.forced``), and ``matrix_ops.precision`` as ``"auto"`` resolves it on CUDA
  (bf16 Newton-Schulz products for Muon; the other rules keep ieee products, ``shardopt.sharding.precision``).

The table gives each end validation loss, the relative gap of ``cuda`` to ``ieee`` and the seed spread beside it,
and whether the gap is within 0.5% or within the spread (issue 42's criterion).
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

import torch

from shardopt.sharding import iterative

from . import convergence
from .cli import parse_args
from .results import fmt, markdown_table, write_results

RULES = ("muon", "swan", "asgo", "sumo", "alice", "alice0")
#: each rule's best learning-rate multiplier in benchmarks/results/convergence.md (same budget and data)
BEST_MULT = {"muon": 8.0, "swan": 4.0, "asgo": 8.0, "sumo": 1.0, "alice": 0.5, "alice0": 0.5}
#: matrix_ops.precision as "auto" resolves it on CUDA (shardopt.sharding.precision)
CUDA_PRECISION = {"muon": "bf16"}
TOLERANCE = 0.005


def run_variant(name: str, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    seed = args.seed + 1 if variant == "ieee_seed2" else args.seed
    run_args = argparse.Namespace(**{**vars(args), "seed": seed})
    extra = {"matrix_ops": {"precision": CUDA_PRECISION[name]}} if variant == "cuda" and name in CUDA_PRECISION else {}
    iterative.fallback_counts(reset=True)
    with iterative.forced(variant == "cuda"), _params(extra):
        rec = convergence.run_one(name, BEST_MULT[name], run_args, tag=variant)
    return rec | {"variant": variant, "seed": seed, "fallbacks": iterative.fallback_counts(reset=True)}


@contextlib.contextmanager
def _params(extra: dict[str, Any]):
    """``convergence.run_one`` with ``extra`` hyperparameters merged into the optimizer's."""
    from . import optimizers

    plain = optimizers.sweep_hyperparameters
    optimizers.sweep_hyperparameters = lambda name, mult: {**plain(name, mult), **extra}
    try:
        yield
    finally:
        optimizers.sweep_hyperparameters = plain


def to_markdown(records: list[dict[str, Any]]) -> str:
    rows = []
    for name in dict.fromkeys(r["optimizer"] for r in records):
        by = {r["variant"]: r for r in records if r["optimizer"] == name}
        loss = {v: by[v].get("val_loss") for v in by}
        if any(x is None for x in loss.values()):
            rows.append(
                [name, *[fmt(loss.get(v), ".4f") for v in ("ieee", "ieee_seed2", "cuda")], "n/a", "n/a", "n/a", ""]
            )
            continue
        gap = (loss["cuda"] - loss["ieee"]) / loss["ieee"]
        spread = abs(loss["ieee_seed2"] - loss["ieee"]) / loss["ieee"]
        ok = gap <= TOLERANCE or abs(gap) <= spread
        rows.append(
            [
                name,
                fmt(loss["ieee"], ".4f"),
                fmt(loss["ieee_seed2"], ".4f"),
                fmt(loss["cuda"], ".4f"),
                f"{100 * gap:+.2f}%",
                f"{100 * spread:.2f}%",
                "yes" if ok else "**no**",
                ", ".join(f"{k} {v}" for k, v in by["cuda"]["fallbacks"].items()) or "none",
            ]
        )
    return markdown_table(
        [
            "optimizer",
            "val loss, ieee",
            "ieee, seed 43",
            "cuda routes",
            "cuda vs ieee",
            "seed spread",
            "within 0.5% or spread",
            "fallbacks (cuda)",
        ],
        rows,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optimizers", default=",".join(RULES))
    convergence.add_run_arguments(ap)
    ap.add_argument("--out", default="routes_convergence")
    args = parse_args(ap, argv, dict(steps=10, eval_every=5, optimizers="muon,sumo"))
    torch.set_num_threads(args.threads)
    records = []
    for name in args.optimizers.split(","):
        for variant in ("ieee", "ieee_seed2", "cuda"):
            rec = run_variant(name, variant, args)
            records.append(rec)
            print(
                f"{name:8s} {variant:10s} "
                + (
                    f"val loss {rec['val_loss']:.4f}  {rec['wall_s']:.0f}s"
                    if "val_loss" in rec
                    else str(rec.get("diverged") or rec.get("error"))
                ),
                flush=True,
            )
    notes = [
        f"{args.steps} steps x {args.batch} x {args.seq} tokens on one CPU process; lr: each rule's best "
        "multiplier in convergence.md. 'cuda routes': the iterative routes forced and matrix_ops.precision as "
        "auto resolves it on CUDA (Muon bf16). Within: the gap at most +0.5% or inside the seed spread."
    ]
    path = write_results(args.out, vars(args), records, to_markdown(records), notes, out_dir=args.results_dir)
    print(f"wrote {path} and {path.with_suffix('.md')}")


if __name__ == "__main__":
    main()
