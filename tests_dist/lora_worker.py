"""Worker for tests_dist/test_lora.py (issue 56): the tiny LLaMA of ``hf_worker.py`` with a peft LoRA adapter
(``r=4`` on ``q_proj`` and ``v_proj``, every base parameter frozen), a shardopt optimizer stepping the LoRA A and B
matrices, 3 steps under ``--engine`` ``zero2`` / ``zero3`` (``shardopt.deepspeed.initialize``) or ``fsdp2``
(``fully_shard`` per decoder layer and the root), or ``reference`` (one process, ``shardopt.create_optimizer``) on
the same global batches. Rank 0 writes, per optimizer, every parameter (whole, fp32), the initial values under
``init.<name>``, and what ran: each trainable parameter's ``describe()`` row, the engine, the stepped tensors.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
warnings.filterwarnings("ignore")
from hf_worker import HP, full_params, samples, tiny_model  # noqa: E402

BATCH = 2  # sequences per rank and step (the reference takes world size x BATCH)
STEPS = 3


def lora_model() -> torch.nn.Module:
    """The tiny LLaMA with LoRA adapters on the attention's q and v projections; peft freezes the base."""
    from peft import LoraConfig, get_peft_model

    model = tiny_model()
    torch.manual_seed(1)  # LoRA A's initialization: the same in every process
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))


def roles(opt: object) -> dict[str, list[str]]:
    """Each parameter's ``describe()`` row (role, where it came from, rule) by name, without peft's prefix."""
    from shardopt.integrations.accelerate import unwrap_optimizer

    inner = unwrap_optimizer(opt)
    return {row[0].removeprefix("base_model.model."): list(row[2:]) for row in inner.describe_rows()}


def train(name: str, engine: str, world: int, rank: int) -> dict:
    import shardopt

    model = lora_model()
    init = {f"init.{n}": p.detach().float().clone() for n, p in model.named_parameters()}
    frozen = sorted(n for n, p in model.named_parameters() if not p.requires_grad)
    data = samples()
    batch = BATCH if engine != "reference" else BATCH * world
    if engine.startswith("zero"):
        import shardopt.deepspeed

        cfg = {
            "train_micro_batch_size_per_gpu": batch,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": int(engine[-1]), "overlap_comm": False},
            "shardopt": {"optimizer": name, "params": HP[name]},
        }
        wrapped, opt, _, _ = shardopt.deepspeed.initialize(model=model, config=cfg)
        backward, step, module = wrapped.backward, wrapped.step, wrapped.module
    else:
        if engine == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for layer in model.base_model.model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        opt = shardopt.create_optimizer(model, name, **HP[name])
        module = model

        def step() -> None:
            opt.step()
            opt.zero_grad()

        wrapped, backward = model, lambda loss: loss.backward()
    for s in range(STEPS):
        lo = s * BATCH * world + (0 if engine == "reference" else rank * BATCH)
        ids = torch.stack([c["input_ids"] for c in data[lo : lo + batch]])
        backward(wrapped(input_ids=ids, labels=ids).loss)
        step()
    out = {**full_params(module), **init}
    out["__meta__"] = {
        "roles": roles(opt),
        "frozen": frozen,
        "engine": type(wrapped).__name__,
        "zero_stage": wrapped.zero_optimization_stage() if hasattr(wrapped, "zero_optimization_stage") else None,
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=("zero2", "zero3", "fsdp2", "reference"), required=True)
    ap.add_argument("--optimizer", default="scale", help="comma-separated optimizers")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if args.engine == "reference":
        world, rank = int(os.environ.get("LORA_WORLD", "2")), 0
    else:
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        world, rank = dist.get_world_size(), dist.get_rank()
    results = {name: train(name, args.engine, world, rank) for name in args.optimizer.split(",")}
    if rank == 0:
        torch.save(results, args.out)
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    from launch import settle_heap

    settle_heap()
    main()
