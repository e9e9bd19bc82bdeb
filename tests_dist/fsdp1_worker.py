"""Legacy FSDP ("FSDP1", ``FullyShardedDataParallel``) worker (issue 47): the parity suite's toy model wrapped under
FULL_SHARD, SHARD_GRAD_OP, NO_SHARD and (world size 4, as 2 x 2) HYBRID_SHARD, with nested wrapping (an auto-wrap
policy puts each block in an FSDP unit of its own), with ``use_orig_params=True`` (each original parameter a 1-D view
of its piece of a flat shard) and ``use_orig_params=False`` (the optimizer is handed ``FlatParameter``s mixing
matrices and vectors; shardopt steps a view per original parameter). A setting is ``STRATEGY`` plus ``/flat``
(use_orig_params=False) and ``/bf16`` (``MixedPrecision(param_dtype=bf16)``, fp32 master weights and statistics).
Every matrix must get the requested rule, 3 steps equal one process, and a save through ``shardopt.checkpoint``
after 3 steps resumes exactly in a fresh wrapped model. Parameters without their model are refused on every rank.
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

sys.path.insert(0, os.path.dirname(__file__))
from parity_worker import N_BLOCKS, OPTIMIZERS, STEPS, local_batch, options, reference  # noqa: E402
from toy_models import GLOBAL_BATCH, Block, loss_fn, make_model  # noqa: E402

import shardopt  # noqa: E402
import shardopt.checkpoint as sckpt  # noqa: E402
from launch import finish_worker, max_abs_diff, record_case, shared_tempdir  # noqa: E402

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
#: every strategy with either use_orig_params, and FULL_SHARD in bf16 mixed precision with either
SETTINGS = tuple(f"{s}{flat}" for s in STRATEGIES for flat in ("", "/flat")) + (
    "FULL_SHARD/bf16",
    "FULL_SHARD/flat/bf16",
)


def wrap(setting: str, before=None):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    strategy, *flags = setting.split("/")
    model = make_model(n_blocks=N_BLOCKS)
    if before is not None:  # e.g. build the optimizer on the unwrapped model, as accelerate's users do
        model = before(model)
    kw = {}
    if "bf16" in flags:
        kw["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if strategy == "HYBRID_SHARD":
        from torch.distributed.device_mesh import init_device_mesh

        kw["device_mesh"] = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("rep", "shard"))
    return FSDP(
        model,
        device_id=torch.device("cpu"),
        use_orig_params="flat" not in flags,
        sharding_strategy=getattr(ShardingStrategy, strategy),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        **kw,
    )


def train(model, opt, start: int, stop: int) -> None:
    for s in range(start, stop):
        opt.zero_grad()
        loss_fn(model, local_batch(s)).backward()
        opt.step()


def params(model) -> dict[str, torch.Tensor]:
    """Every original parameter, whole, on every rank (FSDP's full state dict: the same under either
    use_orig_params)."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from shardopt.optim.routing import clean_name

    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
        return {clean_name(n): t.detach().clone() for n, t in model.state_dict().items()}


def case(name: str, setting: str, root: str) -> dict:
    want, _ = reference(name)
    model = wrap(setting)
    opt = shardopt.create_optimizer(model, name, **options(name))
    rule = {n: g["treatment"] for g, names in zip(opt._groups(), opt.group_param_names) for n in names}
    stepped = [p for g in opt.param_groups for p in g["params"]]
    flat_views = all(p.dim() == 1 for p in stepped) and not any(type(p).__name__ == "FlatParameter" for p in stepped)
    train(model, opt, 0, STEPS)
    state_dtypes = sorted({str(t.dtype) for st in opt.state.values() for t in _tensors(st) if t.is_floating_point()})
    out = {
        "flat_views": flat_views,
        "rules": rule,
        "max_abs_diff": max_abs_diff(params(model), want),
        "params": {n: t.tolist() for n, t in params(model).items()},
        "state_dtypes": state_dtypes,
        "stepped_dtypes": sorted({str(p.dtype) for p in stepped}),
    }
    sckpt.save(os.path.join(root, "logical"), opt, engine="fsdp1")
    train(model, opt, STEPS, 2 * STEPS)
    resumed = wrap(setting)
    ropt = shardopt.create_optimizer(resumed, name, **options(name))
    sckpt.load(os.path.join(root, "logical"), ropt)
    train(resumed, ropt, STEPS, 2 * STEPS)
    out["resume_max_abs_diff"] = max_abs_diff(params(resumed), params(model))
    if setting.startswith("FULL_SHARD") and "bf16" not in setting:  # the checkpoint into FSDP2 and ZeRO-2
        want6, _ = reference(name, 2 * STEPS)
        out["fsdp2_reload_max_abs_diff"] = max_abs_diff(reload_fsdp2(name, root), want6)
        out["zero2_reload_max_abs_diff"] = max_abs_diff(reload_zero2(name, root), want6)
    return out


def _tensors(entries: dict) -> list[torch.Tensor]:
    out = []
    for v in entries.values():
        out += _tensors(v) if isinstance(v, dict) else [v] if isinstance(v, torch.Tensor) else []
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
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // dist.get_world_size(),
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 2},
        "shardopt": {
            "optimizer": name,
            "params": {k: v for k, v in kw.items() if k != "routing"},
            "routing": kw.get("routing", {}),
        },
    }
    engine, _, _, _ = shardopt.deepspeed.initialize(model=make_model(n_blocks=N_BLOCKS), config=config)
    engine.load_checkpoint(root, tag="logical")  # shardopt's logical files, laid out as <dir>/<tag>/
    for s in range(STEPS, 2 * STEPS):
        engine.backward(loss_fn(engine, local_batch(s)))
        engine.step()
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def built_before_wrapping(name: str) -> dict:
    """accelerate's FSDP1 order (``accelerator.prepare(model, optimizer)``, the optimizer built on the unwrapped
    model, through ``shardopt.integrations.accelerate.after_prepare``; accelerate itself enables FSDP only on
    accelerator devices): ``use_orig_params=True`` trains like one process, ``False`` is refused on every rank."""
    from types import SimpleNamespace

    from shardopt.integrations.accelerate import after_prepare

    want, _ = reference(name)
    accelerator = SimpleNamespace(deepspeed_engine_wrapped=None)
    out = {}
    for setting in ("FULL_SHARD", "FULL_SHARD/flat"):
        holder = {}

        def build(model, holder=holder):
            holder["opt"] = shardopt.create_optimizer(model, name, **options(name))
            return model

        model = wrap(setting, before=build)
        try:
            after_prepare(accelerator, (model, holder["opt"]))
            train(model, holder["opt"], 0, STEPS)
            out[setting] = max_abs_diff(params(model), want)
        except NotImplementedError as err:
            out[setting] = f"{type(err).__name__}: {err}"
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, out["FULL_SHARD/flat"])
    return {"max_abs_diff": out["FULL_SHARD"], "flat": every}


def _trained(setting: str = "FULL_SHARD"):
    model = wrap(setting)
    opt = shardopt.create_optimizer(model, "racs", lr=0.01)
    train(model, opt, 0, 1)
    return model, opt


def _dcp_state_dict() -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    get_state_dict(*_trained("FULL_SHARD/flat"))


def _fsdp_optim_state_dict() -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    FSDP.optim_state_dict(*_trained())


def refusal() -> dict:
    """An FSDP1 model's parameters without the model (shapes gone), either use_orig_params: one error on every
    rank, never AdamW in silence. FSDP1's own optimizer state dict (``FSDP.optim_state_dict``, DCP's
    ``get_state_dict``), which reshapes state like flat shards: one error naming shardopt.checkpoint."""
    out = {}
    for case, build in (
        ("flat", lambda: shardopt.RACS(wrap("FULL_SHARD/flat").parameters(), lr=0.01)),
        ("no_model", lambda: shardopt.RACS(wrap("FULL_SHARD").parameters(), lr=0.01)),
        ("dcp", _dcp_state_dict),
        ("fsdp_osd", _fsdp_optim_state_dict),
    ):
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
    ap.add_argument("--settings", default=",".join(SETTINGS))
    args = ap.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed("gloo", timeout=timedelta(seconds=180))  # the ZeRO-2 reload's engine
    records: list = []
    for name in args.optimizers.split(","):
        for setting in args.settings.split(","):
            if setting.startswith("HYBRID_SHARD") and dist.get_world_size() != 4:
                continue
            rec = {"optimizer": name, "setting": setting, "world_size": dist.get_world_size()}
            root = shared_tempdir("shardopt_fsdp1_")
            record_case(records, rec, partial(case, name, setting, root))
    record_case(records, {"optimizer": "racs", "setting": "without the model"}, refusal)
    for name in args.optimizers.split(","):
        record_case(
            records, {"optimizer": name, "setting": "built before wrapping"}, partial(built_before_wrapping, name)
        )
    finish_worker(records, args.out)


if __name__ == "__main__":
    from launch import settle_heap

    settle_heap()
    main()
