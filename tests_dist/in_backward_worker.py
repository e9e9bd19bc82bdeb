"""Stepping in backward (issue 62) on DDP and FSDP2: ``create_optimizer(..., step_in_backward=True)`` against the
single process's ordinary step on the whole global batch, and bf16 stochastic rounding on FSDP2 shards against the
whole matrix rounded in one process.

Each rank trains ``ToyLM`` (2 blocks, so groups complete one layer at a time in backward) on its share of each
step's global batch for ``STEPS`` steps; rank 0 writes one record per case: the largest difference to the
reference, and that the step after backward found nothing left (every gradient freed).
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from parity_worker import options  # noqa: E402
from tiers import selected  # noqa: E402
from toy_models import GLOBAL_BATCH, batch, loss_fn, make_model  # noqa: E402

import shardopt  # noqa: E402
from launch import finish_worker, max_abs_diff, record_case  # noqa: E402
from shardopt.sharding.stochastic_round import logical_index_offsets, stochastic_round_  # noqa: E402

STEPS = 3
N_BLOCKS = 2
ENGINES = ("ddp", "fsdp2")
RULES = ("scale", "sinkgd", "racs", "swan", "asgo", "dasgo", "sumo", "alice", "alice0", "muon")
#: CI runs these (an LM-head momentum, row/column state, a whole-matrix basis with collectives)
CI_RULES = ("scale", "sumo")


def reference(opt_name: str) -> dict[str, torch.Tensor]:
    model = make_model(n_blocks=N_BLOCKS)
    opt = shardopt.create_optimizer(model, opt_name, **options(opt_name))
    for s in range(STEPS):
        opt.zero_grad()
        loss_fn(model, batch(s)).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def run(opt_name: str, engine: str) -> dict:
    model = make_model(n_blocks=N_BLOCKS)
    if engine == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped = model
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model)
    kw = {k: v for k, v in options(opt_name).items() if k != "on_nonfinite"}
    opt = shardopt.create_optimizer(wrapped, opt_name, step_in_backward=True, **kw)
    ws, rank = dist.get_world_size(), dist.get_rank()
    per = GLOBAL_BATCH // ws
    left = 0
    for s in range(STEPS):
        x = batch(s)[rank * per : (rank + 1) * per]
        loss_fn(wrapped, x).backward()
        left += sum(p.grad is not None for p in model.parameters() if engine == "fsdp2")
        opt.step()
        opt.zero_grad()
    got = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()
    }
    return {"max_abs_diff": max_abs_diff(got, reference(opt_name)), "grads_left": left}


def rounding() -> dict:
    """A 37 x 24 fp32 matrix rounded into bf16 FSDP2 row shards equals the whole matrix rounded in one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(3)
    w = torch.randn(37, 24, generator=g) * (1 + torch.rand(37, 24, generator=g) * 1e-2)
    whole = torch.empty(37, 24, dtype=torch.bfloat16)
    stochastic_round_(whole, w, logical_index_offsets(whole), 7, 11)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    diffs = []
    for dim in (0, 1):
        d = distribute_tensor(torch.zeros(37, 24, dtype=torch.bfloat16), mesh, [Shard(dim)])
        src = distribute_tensor(w, mesh, [Shard(dim)]).to_local()
        stochastic_round_(d.to_local(), src, logical_index_offsets(d), 7, 11)
        diffs.append((d.full_tensor().float() - whole.float()).abs().max().item())
    return {"max_abs_diff": max(diffs), "differs_from_nearest": bool((whole.float() != w.bfloat16().float()).any())}


def plain_model_refused() -> dict:
    """A plain model under a process group of 2 (DDP's inner module): its parameters' hooks would step on this
    rank's gradient alone, so the mode refuses it and names the DDP wrapper."""
    try:
        shardopt.create_optimizer(make_model(n_blocks=N_BLOCKS), "scale", step_in_backward=True)
    except shardopt.ConfigError as err:
        return {"message": str(err)}
    return {"message": ""}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    records: list = []
    for opt_name in selected(RULES, CI_RULES):
        for engine in ENGINES:
            record_case(records, {"optimizer": opt_name, "engine": engine}, partial(run, opt_name, engine))
    record_case(records, {"optimizer": "rounding", "engine": "fsdp2"}, rounding)
    record_case(records, {"optimizer": "plain_model", "engine": "ddp"}, plain_model_refused)
    finish_worker(records, args.out)


if __name__ == "__main__":
    main()
