"""Rank-deficient gradients (issue 28): a batch smaller than the subspace rank, and inputs with padded (always
zero) features, so every weight gradient has rank below SUMO's and Alice's subspace rank and zero columns.

The directions such a gradient leaves are rounding noise: their vectors depend on summation order, which
differs between a sharded run and a single process. SUMO and Alice must give them no weight (precision-aware
cutoffs, seeded completions of the bases), so that the sharded run equals the single-process one. For each
optimizer x engine x strategy: 3 steps (refresh interval 2: a refresh or switch at steps 1 and 2), every
parameter compared with the single-process run; rank 0 writes one record per case.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
import shardopt  # noqa: E402
from launch import finish_worker, max_abs_diff, record_case  # noqa: E402

GLOBAL = 12  # samples per step, below the subspace rank (16); divisible by world sizes 1-4
STEPS = 3
PAD = 8  # the last input features are always zero: zero columns in the first layer's gradient
OPTIMIZERS_ALL = {
    "sumo": dict(lr=0.02, rank=16, refresh_interval=2),
    "alice": dict(lr=0.02, rank=16, leading=4, refresh_interval=2),
    "alice0": dict(lr=0.02, rank=16, leading=4, refresh_interval=2),
    # issue 63: the bases' rounding directions left out (zero columns), and Alice's next switch restarting there
    "sumo+signal_rank": dict(lr=0.02, rank=16, refresh_interval=2, signal_rank=True),
    "alice+signal_rank": dict(lr=0.02, rank=16, leading=4, refresh_interval=2, signal_rank=True),
}
OPTIMIZERS = OPTIMIZERS_ALL
ENGINES = ("ddp", "fsdp2", "zero2")
STRATEGIES = ("gather", "team", "distributed")


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64, bias=False),
        nn.Tanh(),
        nn.Linear(64, 32, bias=False),
        nn.Tanh(),
        nn.Linear(32, 64, bias=False),
    )


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL, 32, generator=g)
    x[:, -PAD:] = 0.0
    return x, torch.randn(GLOBAL, 64, generator=g)


def loss_fn(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).square().mean()


def rule(name: str) -> str:
    """The optimizer of case ``name`` (``"alice+signal_rank"``: Alice with that option)."""
    return name.split("+")[0]


def options(name: str, strategy: str | None) -> dict:
    kw = dict(OPTIMIZERS[name], routing={"*": "matrix"})
    if strategy is not None:
        kw["matrix_ops"] = {"strategy": strategy, **({"team_size": 2} if strategy == "team" else {})}
    return kw


def reference(name: str) -> dict[str, torch.Tensor]:
    model = make_model()
    opt = shardopt.create_optimizer(model, rule(name), **options(name, None))
    for s in range(STEPS):
        opt.zero_grad()
        loss_fn(model, *batch(s)).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def local(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    per = GLOBAL // dist.get_world_size()
    lo = dist.get_rank() * per
    x, y = batch(step)
    return x[lo : lo + per], y[lo : lo + per]


def run(name: str, engine: str, strategy: str) -> dict[str, torch.Tensor]:
    model = make_model()
    if engine == "zero2":
        kw = options(name, strategy)
        config = {
            "train_batch_size": GLOBAL,
            "train_micro_batch_size_per_gpu": GLOBAL // dist.get_world_size(),
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": 2},
            "shardopt": {
                "optimizer": rule(name),
                "params": {k: v for k, v in kw.items() if k != "routing"},
                "routing": kw["routing"],
            },
        }
        eng, _, _, _ = shardopt.deepspeed.initialize(model=model, config=config)
        for s in range(STEPS):
            eng.backward(loss_fn(eng, *local(s)))
            eng.step()
        return {n: p.detach().clone() for n, p in eng.module.named_parameters()}
    if engine == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model)
    opt = shardopt.create_optimizer(model, rule(name), **options(name, strategy))
    for s in range(STEPS):
        opt.zero_grad()
        loss_fn(wrapped, *local(s)).backward()
        opt.step()
    full = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()
    }
    return full


def case(name: str, engine: str, strategy: str, want: dict[str, torch.Tensor]) -> dict:
    """One case's record: the largest difference from the single-process run."""
    return {"max_abs_diff": max_abs_diff(run(name, engine, strategy), want)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    records = []
    for name in OPTIMIZERS:
        want = reference(name)
        for engine in ENGINES:
            for strategy in STRATEGIES if engine != "ddp" else ("gather",):
                rec = {"optimizer": name, "engine": engine, "strategy": strategy, "world_size": dist.get_world_size()}
                record_case(records, rec, partial(case, name, engine, strategy, want))
    finish_worker(records, args.out)


if __name__ == "__main__":
    from launch import settle_heap

    settle_heap()
    main()
