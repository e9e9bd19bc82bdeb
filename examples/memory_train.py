"""Stepping in backward (and bf16 weights without an fp32 master copy): one process, DDP or FSDP2, CPU or GPUs.

    python examples/memory_train.py --steps 4                                            # one process
    torchrun --nproc_per_node 2 examples/memory_train.py --steps 4 --engine ddp
    torchrun --nproc_per_node 2 examples/memory_train.py --steps 4 --engine fsdp2 --bf16

Each layer is stepped inside backward as its gradients complete, and its gradients freed; with ``--bf16`` the model
is bf16 and its updates are rounded stochastically. The snippet of docs/guides/memory.md is an excerpt of this file
(tests_dist/test_readme.py checks that it is).
"""

from __future__ import annotations

import argparse

import torch
from common import finish, init_distributed, tiny_llama, token_batches
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import shardopt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--engine", choices=("single", "ddp", "fsdp2"), default="single")
    ap.add_argument("--bf16", action="store_true", help="bf16 weights, no fp32 master copy")
    args = ap.parse_args()
    rank, world, device = init_distributed()
    model = tiny_llama().to(device)

    if args.bf16:  # bf16 weights without an fp32 master copy: updates rounded stochastically
        model = model.to(torch.bfloat16)
    if args.engine == "fsdp2":
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
    elif args.engine == "ddp":
        model = DDP(model)  # pass the wrapper: its communication hook hands over the averaged gradients
    opt = shardopt.create_optimizer(
        model, "scale", lr=1e-3, step_in_backward=True, bf16_updates="stochastic" if args.bf16 else "nearest"
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    for x, y in token_batches(0, args.steps, args.batch_size, rank, device):
        loss = model(x, y)
        loss.backward()  # every layer is stepped here, and its gradients freed
        opt.step()  # nothing left to do (groups that got no gradient are stepped here, as the ordinary step would)
        sched.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {sched.last_epoch}: loss {loss.item():.4f} ({args.engine}, {world} ranks, bf16={args.bf16})")
    finish()


if __name__ == "__main__":
    main()
