"""Muon under each whole-matrix strategy on FSDP2 row and column shards vs the single-process run
(``test_muon_strategies.py``): fp32 and bf16 Newton-Schulz, collective calls per kind."""

from __future__ import annotations

import argparse
import contextlib
import io
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor

from launch import finish_worker
from shardopt import Muon

SHAPES = [(7, 5), (3, 9), (6, 6), (1, 4), (12, 4)]


def run(kind: str, strategy: str, ns_dtype: str, n_copies: int = 1) -> tuple[list[torch.Tensor], list[str], dict]:
    torch.manual_seed(0)
    shapes = SHAPES * n_copies
    init = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(3)]
    if kind == "single":
        ps = [torch.nn.Parameter(w) for w in init]
    else:
        mesh = DeviceMesh("cpu", list(range(dist.get_world_size())))
        place = [Shard(0 if kind == "rows" else 1)]
        ps = [torch.nn.Parameter(distribute_tensor(w, mesh, place)) for w in init]
    # "tf32": the iteration's products in TF32 (matrix_ops.precision; emulated on the CPU by operand rounding)
    precision = {"precision": "tf32"} if ns_dtype == "tf32" else {}
    opt = Muon(
        [(f"w{i}", p) for i, p in enumerate(ps)],
        lr=0.05,
        matrix_ops={"strategy": strategy, **precision},
        ns_dtype="auto" if precision else ns_dtype,
    )
    for gs in grads:
        for p, g in zip(ps, gs):
            p.grad = g if kind == "single" else distribute_tensor(g, p.device_mesh, p.placements)
        opt.step()
    out = [p.detach() if kind == "single" else p.full_tensor() for p in ps]
    kinds = [k for g in range(len(opt.param_groups)) if opt.matrix_plan(g) for k in opt.matrix_plan(g).kinds]
    return out, kinds, {k: v["calls"] for k, v in opt.comm_stats().items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    records = []
    for ns_dtype in ("float32", "bfloat16", "tf32"):
        ref, _, _ = run("single", "gather", ns_dtype)
        for kind in ("rows", "cols"):
            for strategy in ("gather", "distributed", "auto"):
                with contextlib.redirect_stdout(io.StringIO()):
                    out, kinds, calls = run(kind, strategy, ns_dtype)
                    _, _, calls3 = run(kind, strategy, ns_dtype, n_copies=3)
                records.append(
                    {
                        "ns_dtype": ns_dtype,
                        "layout": kind,
                        "strategy": strategy,
                        "kinds": kinds,
                        "max_abs_diff": max((a - b).abs().max().item() for a, b in zip(out, ref)),
                        "calls": calls,
                        "calls_3x": calls3,
                    }
                )
    finish_worker(records, args.out)


if __name__ == "__main__":
    from launch import settle_heap

    settle_heap()
    main()
