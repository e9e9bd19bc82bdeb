"""Legacy FSDP ("FSDP1", ``FullyShardedDataParallel``) worker (issue 47): the parity suite's toy model wrapped with
``use_orig_params=True`` (each original parameter a 1-D view of its piece of a flat shard) under FULL_SHARD,
SHARD_GRAD_OP, NO_SHARD and (world size 4, as 2 x 2) HYBRID_SHARD, with nested wrapping (an auto-wrap policy puts
each block in an FSDP unit of its own): every matrix must get the requested rule, 3 steps equal one process, and a
save through ``shardopt.checkpoint`` after 3 steps resumes exactly in a fresh wrapped model. ``use_orig_params=False``
must be refused on every rank (never stepped as AdamW).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from launch import finish_worker, max_abs_diff, record_case, shared_tempdir  # noqa: E402
import shardopt  # noqa: E402
import shardopt.checkpoint as sckpt  # noqa: E402
from parity_worker import N_BLOCKS, OPTIMIZERS, STEPS, local_batch, options, reference  # noqa: E402
from toy_models import GLOBAL_BATCH, Block, loss_fn, make_model  # noqa: E402

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")


def wrap(strategy: str, orig: bool = True):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = make_model(n_blocks=N_BLOCKS)
    kw = {}
    if strategy == "HYBRID_SHARD":
        from torch.distributed.device_mesh import init_device_mesh
        kw["device_mesh"] = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("rep", "shard"))
    return FSDP(model, device_id=torch.device("cpu"), use_orig_params=orig,
                sharding_strategy=getattr(ShardingStrategy, strategy),
                auto_wrap_policy=ModuleWrapPolicy({Block}), **kw)


def train(model, opt, start: int, stop: int) -> None:
    for s in range(start, stop):
        opt.zero_grad()
        loss_fn(model, local_batch(s)).backward()
        opt.step()


def params(model) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from shardopt.optim.routing import clean_name

    with FSDP.summon_full_params(model):
        return {clean_name(n): p.detach().clone() for n, p in model.named_parameters()}


def case(name: str, strategy: str, root: str) -> dict:
    want, _ = reference(name)
    model = wrap(strategy)
    opt = shardopt.create_optimizer(model, name, **options(name))
    rule = {n: g["treatment"] for g, names in zip(opt._groups(), opt.group_param_names) for n in names}
    flat_views = all(p.dim() == 1 for p in model.parameters())
    train(model, opt, 0, STEPS)
    out = {"flat_views": flat_views, "rules": rule, "max_abs_diff": max_abs_diff(params(model), want)}
    sckpt.save(os.path.join(root, "logical"), opt, engine="fsdp1")
    train(model, opt, STEPS, 2 * STEPS)
    resumed = wrap(strategy)
    ropt = shardopt.create_optimizer(resumed, name, **options(name))
    sckpt.load(os.path.join(root, "logical"), ropt)
    train(resumed, ropt, STEPS, 2 * STEPS)
    out["resume_max_abs_diff"] = max_abs_diff(params(resumed), params(model))
    if strategy == "FULL_SHARD":  # the same checkpoint into FSDP2 and DeepSpeed ZeRO-2: its logical meaning
        want6, _ = reference(name, 2 * STEPS)
        out["fsdp2_reload_max_abs_diff"] = max_abs_diff(reload_fsdp2(name, root), want6)
        out["zero2_reload_max_abs_diff"] = max_abs_diff(reload_zero2(name, root), want6)
    return out


def reload_fsdp2(name: str, root: str) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = make_model(n_blocks=N_BLOCKS)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = shardopt.create_optimizer(model, name, **options(name))
    sckpt.load(os.path.join(root, "logical"), opt)
    train(model, opt, STEPS, 2 * STEPS)
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def reload_zero2(name: str, root: str) -> dict[str, torch.Tensor]:
    kw = options(name)
    config = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // dist.get_world_size(),
              "gradient_clipping": 0.0, "zero_optimization": {"stage": 2},
              "shardopt": {"optimizer": name, "params": {k: v for k, v in kw.items() if k != "routing"},
                           "routing": kw.get("routing", {})}}
    engine, _, _, _ = shardopt.deepspeed.initialize(model=make_model(n_blocks=N_BLOCKS), config=config)
    engine.load_checkpoint(root, tag="logical")  # shardopt's logical files, laid out as <dir>/<tag>/
    for s in range(STEPS, 2 * STEPS):
        engine.backward(loss_fn(engine, local_batch(s)))
        engine.step()
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def refusal() -> dict:
    """``use_orig_params=False`` (flat parameters mixing rules) and an FSDP1 model's parameters without the model
    (shapes gone): one error on every rank, never AdamW in silence."""
    out = {}
    for case, build in (("flat", lambda: shardopt.create_optimizer(wrap("FULL_SHARD", orig=False), "racs", lr=0.01)),
                        ("no_model", lambda: shardopt.RACS(wrap("FULL_SHARD").parameters(), lr=0.01))):
        try:
            build()
            message = None
        except NotImplementedError as err:
            message = f"{type(err).__name__}: {err}"
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, message)
        out[case] = every
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    args = ap.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed("gloo", timeout=timedelta(seconds=180))  # the ZeRO-2 reload's engine
    records: list = []
    for name in args.optimizers.split(","):
        for strategy in args.strategies.split(","):
            if strategy == "HYBRID_SHARD" and dist.get_world_size() != 4:
                continue
            rec = {"optimizer": name, "strategy": strategy, "world_size": dist.get_world_size()}
            root = shared_tempdir("shardopt_fsdp1_")
            record_case(records, rec, lambda: case(name, strategy, root))
    record_case(records, {"optimizer": "racs", "strategy": "use_orig_params=False"}, refusal)
    finish_worker(records, args.out)


if __name__ == "__main__":
    from launch import settle_heap

    settle_heap()
    main()
