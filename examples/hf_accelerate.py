"""``accelerate`` with a shardopt optimizer under DeepSpeed ZeRO: one call,
``shardopt.integrations.accelerate.prepare(accelerator, model, optimizer)`` in place of ``accelerator.prepare``,
maps ZeRO's flat partitions to matrices and hooks shardopt's state into ``accelerator.save_state`` /
``load_state`` (resumable at another world size). A tiny LLaMA built from its config on synthetic tokens, so it
runs in seconds on a CPU (DS_ACCELERATOR=cpu, gloo).

    torchrun --nproc_per_node 2 examples/hf_accelerate.py --steps 4 --save runs/hf_accelerate
    torchrun --nproc_per_node 2 examples/hf_accelerate.py --steps 6 --load runs/hf_accelerate

The accelerate snippets of README.md and docs/guides/accelerate.md are excerpts of this file (tests_dist/test_readme.py
checks that they are).
"""

from __future__ import annotations

import argparse
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported

from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin
from hf_trainer import tiny_llama, token_dataset

import shardopt
import shardopt.integrations.accelerate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4, help="train until this many optimizer steps in all")
    ap.add_argument("--batch", type=int, default=4, help="per-device batch")
    ap.add_argument("--stage", type=int, default=2, help="ZeRO stage (1, 2 or 3)")
    ap.add_argument("--save", metavar="DIR", help="accelerator.save_state(DIR) at the end")
    ap.add_argument("--load", metavar="DIR", help="accelerator.load_state(DIR) first")
    ap.add_argument("--offload", action="store_true", help="ZeRO-Offload: the optimizer's partitions on the CPU")
    args = ap.parse_args()

    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.stage},
    }
    if args.offload:  # prepare sets zero_force_ds_cpu_optimizer false, so accelerate keeps shardopt's optimizer
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    model = tiny_llama()
    optimizer = shardopt.create_optimizer(model, "scale", lr=1e-2)
    model, optimizer = shardopt.integrations.accelerate.prepare(accelerator, model, optimizer)
    start = 0
    if args.load:
        accelerator.load_state(args.load)
        start = int(open(os.path.join(args.load, "step.txt")).read())
        if torch.distributed.get_rank() == 0:
            print(f"resumed from {args.load} at step {start} on {torch.distributed.get_world_size()} ranks")
    # DeepSpeed's process group (accelerate 1.x reports one process for DeepSpeed on CPU)
    data, rank, world = token_dataset(), torch.distributed.get_rank(), torch.distributed.get_world_size()
    for step in range(start, args.steps):
        lo = (step * world + rank) * args.batch
        ids = torch.stack([d["input_ids"] for d in data[lo : lo + args.batch]]).to(accelerator.device)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)  # DeepSpeed steps the optimizer here
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step + 1}: loss {loss.item():.4f}")
    if args.save:
        accelerator.save_state(args.save)
        if torch.distributed.get_rank() == 0:
            open(os.path.join(args.save, "step.txt"), "w").write(str(args.steps))
    accelerator.wait_for_everyone()  # docs/reliability.md: the ranks meet before end_training destroys the group
    accelerator.end_training()


if __name__ == "__main__":
    main()
