"""What ``strategy="auto"`` does with a model on many ranks, before renting them: the whole-matrix plan
(strategy, owner, modeled milliseconds per matrix, this rank's modeled step) for a LLaMA preset under FSDP2
row shards at a simulated world size, with a hardware profile and memory budget of your choice.

    python examples/plan_at_scale.py                                  # 1b, asgo, 64 ranks, the gpu profile
    python examples/plan_at_scale.py --model 7b --world 1024 --optimizer sumo --budget-mib 64

Nothing is allocated (meta device) and nothing is communicated: plans depend only on the shapes and on which
rows each rank holds, which every rank derives identically, so one process can print any rank's plan.
"""

from __future__ import annotations

import argparse

import torch

import shardopt
from shardopt.sharding import MatrixLayout
from shardopt.train.model import Llama, model_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="1b", help="a shardopt.train.model preset (60m, 130m, 350m, 1b, 7b, ...)")
    ap.add_argument("--optimizer", default="asgo")
    ap.add_argument("--world", type=int, default=64, help="simulated ranks (FSDP2 Shard(0) over all of them)")
    ap.add_argument("--rank", type=int, default=0, help="whose plan to print")
    ap.add_argument("--profile", default="gpu", help="gpu, cpu, or base:gpu,bandwidth_gbs:50,... numbers")
    ap.add_argument("--budget-mib", type=float, default=None, help="matrix_ops.memory_budget_mib")
    ap.add_argument("--rows", type=int, default=12, help="matrices to list (0: all)")
    args = ap.parse_args()
    profile = (
        args.profile
        if ":" not in args.profile
        else {k: (v if k == "base" else float(v)) for k, v in (kv.split(":") for kv in args.profile.split(","))}
    )

    with torch.device("meta"):
        model = Llama(model_config(args.model, 32000))
    opt = shardopt.create_optimizer(
        model, args.optimizer, matrix_ops={"profile": profile, "memory_budget_mib": args.budget_mib}
    )
    group = object()  # stands for the process group: plans only compare it by identity
    opt.use_layouts(
        lambda p: MatrixLayout.row_chunks(
            tuple(p.shape) if p.dim() == 2 else (p.numel(), 1), args.world, args.rank, group
        )
    )
    lines = opt.describe_plan().splitlines()
    if args.rows and len(lines) > args.rows + 3:
        lines = lines[: args.rows + 2] + [f"... ({len(lines) - args.rows - 3} more matrices)"] + lines[-1:]
    print(f"{args.optimizer} on LLaMA-{args.model}, FSDP2 rows over {args.world} ranks, rank {args.rank}:")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
