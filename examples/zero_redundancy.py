"""Whole-parameter sharders with a shardopt optimizer inside: torch's ZeroRedundancyOptimizer and
fairscale's OSS (extra "engines") each shard the optimizer state of a DDP model by whole parameters, and
the shardopt optimizer (here SCALE) is their inner optimizer. CPU (gloo) or GPUs.

    torchrun --nproc_per_node 2 examples/zero_redundancy.py                 # both engines, 4 steps each
    torchrun --nproc_per_node 2 examples/zero_redundancy.py --engine oss --steps 10

The snippet of docs/guides/more-engines.md is an excerpt of this file (tests_dist/test_readme.py checks that it is).
"""

from __future__ import annotations

import argparse
import warnings

from common import finish, init_distributed, tiny_llama, token_batches
from torch.nn.parallel import DistributedDataParallel as DDP

import shardopt


def train(model, opt, steps: int, rank: int, device, name: str) -> None:
    ddp = DDP(model)
    for step, (x, y) in enumerate(token_batches(0, steps, 8, rank, device), 1):
        loss = ddp(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"{name} step {step}: loss {loss.item():.4f}")


def with_zero_redundancy(steps: int, rank: int, device) -> dict | None:
    model = tiny_llama().to(device)
    groups = shardopt.param_groups(model, "scale", lr=1e-3)  # one named group per parameter, every hyperparameter
    from torch.distributed.optim import ZeroRedundancyOptimizer  # torch

    opt = ZeroRedundancyOptimizer(groups, optimizer_class=shardopt.SCALE)
    train(model, opt, steps, rank, device, "ZeroRedundancyOptimizer")
    opt.consolidate_state_dict(to=0)
    return opt.state_dict() if rank == 0 else None


def with_oss(steps: int, rank: int, device) -> dict | None:
    model = tiny_llama().to(device)
    groups = shardopt.param_groups(model, "scale", lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fairscale 0.4.13 warns about deprecated torch APIs on import
        from fairscale.optim import OSS  # fairscale (extra "engines")
    opt = OSS(groups, optim=shardopt.SCALE)
    train(model, opt, steps, rank, device, "OSS")
    opt.consolidate_state_dict(recipient_rank=0)
    return opt.state_dict() if rank == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["zero_redundancy", "oss", "both"], default="both")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    rank, world, device = init_distributed()
    runs = {"zero_redundancy": with_zero_redundancy, "oss": with_oss}
    for name, run in runs.items():
        if args.engine in (name, "both"):
            state = run(args.steps, rank, device)
            if rank == 0:
                print(
                    f"{name}: {world} ranks; the consolidated state dict on rank 0 holds "
                    f"{len(state['state'])} parameters' state"
                )
    finish()


if __name__ == "__main__":
    main()
