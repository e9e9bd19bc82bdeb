r"""DeepSpeed ZeRO with a shardopt optimizer from the JSON's "shardopt" section: train a small LLaMA, save
with ``engine.save_checkpoint`` and resume with ``engine.load_checkpoint`` at another world size or ZeRO
stage (or from a checkpoint ``shardopt checkpoint convert`` made). CPU (DS_ACCELERATOR=cpu, gloo) or GPUs.

    torchrun --nproc_per_node 2 examples/deepspeed_train.py --config configs/deepspeed/zero2_scale.json
    torchrun --nproc_per_node 2 examples/deepspeed_train.py --steps 4 --save ckpt
    torchrun --nproc_per_node 4 examples/deepspeed_train.py --steps 8 --load ckpt \
        --config configs/deepspeed/zero3_scale.json

The DeepSpeed snippets of README.md and docs/guides/deepspeed.md are excerpts of this file (tests_dist/test_readme.py
checks that they are).
"""

from __future__ import annotations

import argparse
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported

from common import finish, init_distributed, tiny_llama, token_batches

import shardopt.deepspeed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--config",
        default="configs/deepspeed/zero2_scale.json",
        help="a DeepSpeed JSON with a 'shardopt' section (configs/deepspeed/ has one per optimizer and stage)",
    )
    ap.add_argument("--steps", type=int, default=4, help="train until this many optimizer steps in all")
    ap.add_argument("--save", metavar="DIR", help="engine.save_checkpoint(DIR) at the end")
    ap.add_argument("--load", metavar="DIR", help="engine.load_checkpoint(DIR) first (any world size or ZeRO stage)")
    ap.add_argument("--roles", action="store_true", help="print each parameter's role and rule (rank 0)")
    args = ap.parse_args()
    rank, world, device = init_distributed()
    model = tiny_llama()
    config = args.config

    def schedule(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))

    engine, optimizer, _, scheduler = shardopt.deepspeed.initialize(model=model, config=config, lr_scheduler=schedule)
    if args.roles and rank == 0:
        print(optimizer.describe())  # or engine.describe(), shardopt.describe(engine)
    if args.load:
        engine.load_checkpoint(args.load)
        if rank == 0:
            print(
                f"resumed from {args.load} at step {engine.global_steps} on {world} ranks "
                f"(lr {scheduler.get_last_lr()[0]:.2e})"
            )
    batches = token_batches(
        engine.global_steps, args.steps, engine.train_micro_batch_size_per_gpu(), rank, engine.device
    )
    for x, y in batches:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        if rank == 0:
            print(f"step {engine.global_steps}: loss {loss.item():.4f}, lr {scheduler.get_last_lr()[0]:.2e}")
    if args.save:
        engine.save_checkpoint(args.save, tag=f"step{engine.global_steps}")
        if rank == 0:
            print(f"saved step {engine.global_steps} to {args.save} ({world} ranks, {config})")
    finish()


if __name__ == "__main__":
    main()
