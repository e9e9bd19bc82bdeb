"""Gradient accumulation worker (issue 28): the step after ``ACCUM`` micro-batches equals the single-process
step on the whole global batch.

DeepSpeed (``gradient_accumulation_steps = ACCUM``; ZeRO-1, ZeRO-2, ZeRO-3) averages the micro-batches' losses
itself; FSDP2 runs ``set_requires_gradient_sync(False)`` and DDP ``no_sync()`` on all but the last micro-batch,
each loss scaled by ``1 / ACCUM``. Each rank sees ``GLOBAL // world`` samples per step in ``ACCUM`` micro-batches; the reference
trains one process on the same ``GLOBAL`` samples per step. Rank 0 writes one record per case.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from launch import finish_worker, max_abs_diff, record_case  # noqa: E402
import shardopt  # noqa: E402
from parity_worker import OPTIMIZERS, options  # noqa: E402
from toy_models import batch, loss_fn, make_model  # noqa: E402

ACCUM = 4
GLOBAL = 48  # divisible by ACCUM x world size for world sizes 1-4
STEPS = 3
ENGINES = ("zero1", "zero2", "zero3", "fsdp2", "ddp")
#: the issue's optimizers; the whole-matrix ones under each of their strategies that move data differently
CASES = [("scale", None), ("racs", None), ("sumo", "gather"), ("sumo", "distributed"), ("alice", "team"),
         ("alice", "distributed"), ("asgo", "gather"), ("asgo", "distributed"), ("muon", None)]


def reference(opt_name: str, strategy: str | None) -> dict[str, torch.Tensor]:
    model = make_model()
    opt = shardopt.create_optimizer(model, opt_name, **options(opt_name, strategy))
    for s in range(STEPS):
        opt.zero_grad()
        loss_fn(model, batch(s, GLOBAL)).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def micro_batches(step: int) -> list[torch.Tensor]:
    """This rank's ``ACCUM`` micro-batches of the step's global batch (each rank a contiguous share)."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    per = GLOBAL // ws
    mine = batch(step, GLOBAL)[rank * per:(rank + 1) * per]
    return list(mine.chunk(ACCUM))


def run_zero(opt_name: str, strategy: str | None, stage: int) -> dict[str, torch.Tensor]:
    from deepspeed import zero

    kw = options(opt_name, strategy)
    per = GLOBAL // dist.get_world_size()
    config = {"train_batch_size": GLOBAL, "train_micro_batch_size_per_gpu": per // ACCUM,
              "gradient_accumulation_steps": ACCUM, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
              "shardopt": {"optimizer": opt_name, "params": {k: v for k, v in kw.items() if k != "routing"},
                           "routing": kw.get("routing", {})}}
    if stage == 3:
        config["zero_optimization"]["sub_group_size"] = 100
    engine, _, _, _ = shardopt.deepspeed.initialize(model=make_model(), config=config)
    for s in range(STEPS):
        for x in micro_batches(s):
            engine.backward(loss_fn(engine, x))
            engine.step()  # DeepSpeed steps the optimizer at the accumulation boundary only
    if stage == 3:
        with zero.GatheredParameters(list(engine.module.parameters())):
            return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def run_fsdp2(opt_name: str, strategy: str | None) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = make_model()
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = shardopt.create_optimizer(model, opt_name, **options(opt_name, strategy))
    for s in range(STEPS):
        opt.zero_grad()
        parts = micro_batches(s)
        for j, x in enumerate(parts):
            model.set_requires_gradient_sync(j == len(parts) - 1)
            (loss_fn(model, x) / ACCUM).backward()
        opt.step()
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def run_ddp(opt_name: str, strategy: str | None) -> dict[str, torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model()
    ddp = DDP(model)
    opt = shardopt.create_optimizer(model, opt_name, **options(opt_name, strategy))
    for s in range(STEPS):
        opt.zero_grad()
        parts = micro_batches(s)
        for j, x in enumerate(parts):
            ctx = ddp.no_sync() if j < len(parts) - 1 else contextlib.nullcontext()
            with ctx:
                (loss_fn(ddp, x) / ACCUM).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    records = []
    for opt_name, strategy in CASES:
        want = reference(opt_name, strategy)
        for engine in ENGINES:
            rec = {"optimizer": opt_name, "strategy": strategy, "engine": engine, "world_size": dist.get_world_size()}
            record_case(records, rec, lambda: {"max_abs_diff": max_abs_diff(
                run_fsdp2(opt_name, strategy) if engine == "fsdp2" else run_ddp(opt_name, strategy)
                if engine == "ddp" else run_zero(opt_name, strategy, int(engine[-1])), want)})
    finish_worker(records, args.out)


if __name__ == "__main__":
    main()
