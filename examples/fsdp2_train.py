"""FSDP2 with a shardopt optimizer, end to end: shard a small LLaMA, train, save and resume with
``torch.distributed.checkpoint`` (DCP) at any world size. CPU (gloo) or GPUs (nccl).

    torchrun --nproc_per_node 2 examples/fsdp2_train.py                                # 4 steps
    torchrun --nproc_per_node 2 examples/fsdp2_train.py --steps 4 --save fsdp_ckpt
    torchrun --nproc_per_node 3 examples/fsdp2_train.py --steps 8 --load fsdp_ckpt     # resharded 2 -> 3

The FSDP2 snippets of README.md, docs/guides/fsdp2.md and docs/checkpoints.md are excerpts of this file
(tests_dist/test_readme.py checks that they are).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed.checkpoint as dcp
from common import finish, init_distributed, tiny_llama, token_batches
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import shardopt


def save(path, model, opt, sched) -> None:
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "scheduler": sched.state_dict()}, checkpoint_id=path)  # at world size 2


def load(path, model, opt, sched) -> None:
    # later, at any world size: build model + fully_shard + create_optimizer + the scheduler, then
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd, "scheduler": sched.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    sched.load_state_dict(sd["scheduler"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4, help="train until this many optimizer steps in all")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--save", metavar="DIR", help="write a DCP checkpoint here at the end")
    ap.add_argument("--load", metavar="DIR", help="resume from this DCP checkpoint (any world size)")
    args = ap.parse_args()
    rank, world, device = init_distributed()
    model = tiny_llama().to(device)

    for block in model.layers:  # FSDP2 as usual (skip for single process / DDP)
        fully_shard(block)
    fully_shard(model)

    opt = shardopt.create_optimizer(model, "scale", lr=1e-3)  # or "sinkgd", "racs", "asgo", "sumo", "alice", ...
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    start = 0
    if args.load:
        load(args.load, model, opt, sched)
        start = sched.last_epoch
        if rank == 0:
            print(f"resumed from {args.load} at step {start} on {world} ranks (lr {sched.get_last_lr()[0]:.2e})")
    batches = token_batches(start, args.steps, args.batch_size, rank, device)
    for x, y in batches:
        loss = model(x, y)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {sched.last_epoch}: loss {loss.item():.4f}, lr {sched.get_last_lr()[0]:.2e}")
    if args.save:
        save(args.save, model, opt, sched)
        if rank == 0:
            print(f"saved step {sched.last_epoch} to {args.save} (DCP, {world} ranks)")
    finish()


if __name__ == "__main__":
    main()
