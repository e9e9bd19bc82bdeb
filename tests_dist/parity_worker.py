"""Distributed parity worker: every optimizer x layout at this world size, in one process group.

Launched by ``tests_dist/test_parity.py`` through ``torch.distributed.run``. For each case it trains the toy
model for ``STEPS`` steps on the engine, rebuilds full parameters, and compares them with a single-process
run of the same optimizer on the same global batches (computed locally on every rank). Rank 0 writes one
JSON record per case: max abs difference, loss curve, collective counts.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from toy_models import GLOBAL_BATCH, batch, loss_fn, make_model  # noqa: E402

import shardopt  # noqa: E402
from launch import finish_worker  # noqa: E402
from shardopt.sharding import (
    collective_counter,  # noqa: E402
    iterative,  # noqa: E402
)

STEPS = 6
OPTIMIZERS = {
    # every 2-D weight goes to the matrix rule, so embedding and LM head are exercised sharded too
    "scale": dict(lr=3e-3, adam_lr=3e-3),
    "sinkgd": dict(lr=0.02, routing={"embed.weight": "matrix", "lm_head.weight": "matrix"}),
    "racs": dict(lr=0.05, routing={"embed.weight": "matrix", "lm_head.weight": "matrix"}),
    # whole-matrix optimizers: Newton-Schulz on matrices gathered to owner ranks
    "muon": dict(lr=0.02, routing={"embed.weight": "matrix", "lm_head.weight": "matrix"}),
    "swan": dict(lr=0.05, routing={"embed.weight": "matrix", "lm_head.weight": "matrix"}),
    "dasgo": dict(lr=0.01, routing={"embed.weight": "matrix", "lm_head.weight": "matrix"}),
    # refresh intervals of 2 over 6 steps: ASGO reuses a stale root, SUMO refreshes 3 times, Alice switches 4
    # times; the other suites (checkpoint, reliability, engines) run each with a different default strategy
    "asgo": dict(lr=0.01, refresh_interval=2, routing={"embed.weight": "matrix", "lm_head.weight": "matrix"}),
    "sumo": dict(
        lr=0.02,
        rank=2,
        refresh_interval=2,
        matrix_ops={"strategy": "gather"},
        routing={"embed.weight": "matrix", "lm_head.weight": "matrix"},
    ),
    "alice": dict(
        lr=0.02,
        rank=3,
        leading=1,
        refresh_interval=2,
        matrix_ops={"strategy": "distributed"},
        routing={"embed.weight": "matrix", "lm_head.weight": "matrix"},
    ),
    "alice0": dict(
        lr=0.02,
        rank=3,
        leading=1,
        refresh_interval=2,
        matrix_ops={"strategy": "team", "team_size": 2},
        routing={"embed.weight": "matrix", "lm_head.weight": "matrix"},
    ),
}
#: optimizers whose whole-matrix work runs under every strategy: the parity matrix runs each (``team``: teams of
#: two ranks; "distributed" last, the strategy of the collective-count check); Muon's own suite
#: (test_muon_strategies.py) covers its gather and distributed strategies, this one its teams
STRATEGIES = {name: ("gather", "team", "distributed") for name in ("swan", "asgo", "sumo", "alice", "alice0")}
STRATEGIES["muon"] = (None, "team")
TEAM_SIZE = 2
#: teams run from this world size: below it a team of two is the whole group (its collectives those of
#: ``distributed``, on the parent group), and CI time goes to the sizes where teams are subgroups
TEAM_WORLD = 3


def options(opt_name: str, strategy: str | None = None) -> dict:
    """The test hyperparameters of ``opt_name``, with the whole-matrix strategy forced when given."""
    kw = dict(OPTIMIZERS[opt_name])
    if strategy is not None:
        kw["matrix_ops"] = {"strategy": strategy, **({"team_size": TEAM_SIZE} if strategy == "team" else {})}
    return kw


N_BLOCKS = 1  # the collective-count check reruns cases with more matrices
CONFIG_FILE = os.path.join(os.path.dirname(__file__), "..", "configs", "deepspeed", "zero2_scale.json")
LAYOUTS = ["ddp", "fsdp2_rows", "fsdp2_cols", "zero0", "zero1", "zero2", "zero2_rr", "zero3"]
BF16_LAYOUTS = ["zero2_bf16", "fsdp2_bf16"]


def reference(opt_name: str, steps: int = STEPS) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = make_model(n_blocks=N_BLOCKS)
    kw = dict(OPTIMIZERS[opt_name])
    opt = shardopt.create_optimizer(model, opt_name, **kw)
    losses = []
    for s in range(steps):
        loss = loss_fn(model, batch(s))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses


def local_batch(step: int) -> torch.Tensor:
    ws, rank = dist.get_world_size(), dist.get_rank()
    per = GLOBAL_BATCH // ws
    return batch(step)[rank * per : (rank + 1) * per]


def run_ddp(opt_name: str, strategy: str | None = None) -> tuple[dict, list, list]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model(n_blocks=N_BLOCKS)
    ddp = DDP(model)
    opt = shardopt.create_optimizer(model, opt_name, **options(opt_name, strategy))
    return _train(ddp, opt, lambda: {n: p.detach().clone() for n, p in model.named_parameters()})


def run_fsdp2(
    opt_name: str, cols: bool = False, bf16: bool = False, strategy: str | None = None
) -> tuple[dict, list, list]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    ws = dist.get_world_size()
    mesh = init_device_mesh("cpu", (ws,))
    model = make_model(n_blocks=N_BLOCKS)
    kw = {"mesh": mesh}
    if cols:
        kw["shard_placement_fn"] = lambda p: Shard(1) if p.ndim == 2 and p.shape[1] % ws == 0 else Shard(0)
    if bf16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in model.blocks:
        fully_shard(blk, **kw)
    fully_shard(model, **kw)
    opt = shardopt.create_optimizer(model, opt_name, **options(opt_name, strategy))
    return _train(model, opt, lambda: {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()})


def run_zero(
    opt_name: str, stage: int, round_robin: bool = False, bf16: bool = False, strategy: str | None = None
) -> tuple[dict, list, list]:
    from deepspeed import zero

    ws = dist.get_world_size()
    model = make_model(n_blocks=N_BLOCKS)
    kw = options(opt_name, strategy)
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // ws,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "shardopt": {
            "optimizer": opt_name,
            "params": {k: v for k, v in kw.items() if k != "routing"},
            "routing": kw.get("routing", {}),
        },
    }
    if round_robin:
        config["zero_optimization"]["round_robin_gradients"] = True
    if stage == 3:
        config["zero_optimization"]["sub_group_size"] = 100
    if bf16:
        config["bf16"] = {"enabled": True}
    engine, opt, _, _ = shardopt.deepspeed.initialize(model=model, config=config)

    def full_params() -> dict:
        if stage == 3:
            with zero.GatheredParameters(list(engine.module.parameters())):
                return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
        if bf16:  # fp32 masters live in the flat partitions: gather them through the hp mapping
            from deepspeed.utils import safe_get_full_fp32_param

            return {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}

    return _train(engine, opt, full_params, deepspeed_engine=engine)


def _train(model, opt, full_params, deepspeed_engine=None) -> tuple[dict, list, list]:
    global LAST_OPTIMIZER
    LAST_OPTIMIZER = opt
    losses, calls = [], []
    for s in range(STEPS):
        x = local_batch(s)
        loss = loss_fn(model, x)
        if deepspeed_engine is not None:
            deepspeed_engine.backward(loss)
            collective_counter.reset()
            deepspeed_engine.step()
        else:
            opt.zero_grad()
            loss.backward()
            collective_counter.reset()
            opt.step()
        calls.append(collective_counter.calls)
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        losses.append(avg.item() / dist.get_world_size())
    return full_params(), losses, calls


def run_config_file() -> dict:
    """The shipped JSON enables SCALE on ZeRO-2 with nothing but ``shardopt.deepspeed.initialize``."""
    model = make_model()
    engine, opt, _, _ = shardopt.deepspeed.initialize(model=model, config=CONFIG_FILE)
    micro = engine.train_micro_batch_size_per_gpu()
    losses = []
    for s in range(STEPS):
        x = batch(s, micro * dist.get_world_size())[dist.get_rank() * micro : (dist.get_rank() + 1) * micro]
        loss = loss_fn(engine, x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {
        "optimizer_class": type(opt).__name__
        if not hasattr(engine.optimizer, "optimizer")
        else type(engine.optimizer.optimizer).__name__,
        "zero_stage": engine.zero_optimization_stage(),
        "losses": losses,
    }


LAST_OPTIMIZER = None


def _inner(opt):
    """The shardopt optimizer inside an engine's wrapper (DeepSpeed ZeRO keeps it as ``.optimizer``)."""
    while not hasattr(opt, "comm_stats") and hasattr(opt, "optimizer"):
        opt = opt.optimizer
    return opt


def plan_summary(opt) -> list[dict]:
    """Per matrix of the optimizer's whole-matrix plans: strategy and the most elements any rank receives."""
    out = []
    for ops in getattr(opt, "_ops_cache", {}).values():
        if ops is None:  # a group without whole-matrix work
            continue
        for name, kind, plan in zip(ops.names, ops.kinds, ops.plans):
            lay = plan.layout
            recv = max((sum(plan.moved(s, d) for s in range(lay.world) if s != d) for d in range(lay.world)), default=0)
            rows, cols = plan.a_shape
            from shardopt.sharding.layout import ColPiece

            out.append(
                dict(
                    name=name,
                    kind=kind,
                    max_received=recv,
                    numel=rows * cols,
                    a_cols=cols,
                    along=isinstance(lay.pieces[0], ColPiece) == plan.transpose,
                )
            )
    return out


def run_case(opt_name: str, layout: str, strategy: str | None = None):
    if layout == "ddp":
        return run_ddp(opt_name, strategy)
    if layout == "fsdp2_rows":
        return run_fsdp2(opt_name, strategy=strategy)
    if layout == "fsdp2_cols":
        return run_fsdp2(opt_name, cols=True, strategy=strategy)
    if layout == "fsdp2_bf16":
        return run_fsdp2(opt_name, bf16=True, strategy=strategy)
    if layout == "zero2_bf16":
        return run_zero(opt_name, 2, bf16=True, strategy=strategy)
    stage = int(layout[4])
    return run_zero(opt_name, stage, round_robin=layout.endswith("_rr"), strategy=strategy)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    ap.add_argument("--layouts", default=",".join(LAYOUTS + BF16_LAYOUTS))
    ap.add_argument(
        "--strategy-layouts",
        default=None,
        help="layouts on which the strategies after an optimizer's first run (default: every layout)",
    )
    ap.add_argument(
        "--count-blocks",
        default="1,6",
        help="block counts for the collective-count check (fsdp2_rows and zero2, no comparison)",
    )
    ap.add_argument(
        "--iterative",
        action="store_true",
        help="CUDA's iterative routes (no eigh/svd/qr between refreshes) for the runs and the reference",
    )
    ap.add_argument(
        "--config-file",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the shipped DeepSpeed JSON (one launch per world size needs it)",
    )
    args = ap.parse_args()
    with iterative.forced(True) if args.iterative else contextlib.nullcontext():
        run_all(args)


def run_all(args: argparse.Namespace) -> None:
    global N_BLOCKS, LAST_OPTIMIZER
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    rank, ws = dist.get_rank(), dist.get_world_size()
    records = []
    #: each case's collective counts by (optimizer, layout, strategy): the collective-count check's one-block run
    #: of a case the matrix ran (N_BLOCKS 1) is the same run, so it reads them instead of running it again
    counted: dict[tuple, list] = {}
    for opt_name in args.optimizers.split(","):
        ref, ref_losses = reference(opt_name)
        strategies = [s for s in STRATEGIES.get(opt_name, (None,)) if s != "team" or ws >= TEAM_WORLD]
        others = set(args.strategy_layouts.split(",")) if args.strategy_layouts else None
        cases = [
            (layout, s)
            for layout in args.layouts.split(",")
            for s in strategies
            if (s == strategies[-1] or layout not in BF16_LAYOUTS)  # bf16 runs once (the last) per optimizer
            and (s == strategies[0] or others is None or layout in others or layout in BF16_LAYOUTS)
        ]
        for layout, strategy in cases:
            t0 = time.time()
            rec = {"optimizer": opt_name, "layout": layout, "world_size": ws, "strategy": strategy}
            iterative.fallback_counts(reset=True)
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    params, losses, calls = run_case(opt_name, layout, strategy)
                diff = max((params[n].float() - ref[n]).abs().max().item() for n in ref)
                rec.update(
                    max_abs_diff=diff,
                    losses=losses,
                    ref_losses=ref_losses,
                    collective_calls=calls,
                    comm_stats=_inner(LAST_OPTIMIZER).comm_stats(),
                    matrix_numel={n: p.numel() for n, p in ref.items() if p.dim() == 2},
                    plans=plan_summary(_inner(LAST_OPTIMIZER)),
                    routed=iterative.routed_counts(),
                    fallbacks=iterative.fallback_counts(reset=True),
                )
                counted[(opt_name, layout, strategy)] = calls
            except Exception:  # record and go on: the other ranks raise the same way
                rec["error"] = traceback.format_exc()
            rec["seconds"] = round(time.time() - t0, 2)
            if rank == 0:
                print(json.dumps({k: v for k, v in rec.items() if k not in ("losses", "ref_losses")}), flush=True)
            records.append(rec)
            dist.barrier()
    for opt_name in args.optimizers.split(","):
        for layout in ("fsdp2_rows", "fsdp2_cols", "zero2"):
            for nb in (int(b) for b in args.count_blocks.split(",") if b):
                N_BLOCKS = nb
                strategy = STRATEGIES.get(opt_name, (None,))[-1]
                rec = {
                    "optimizer": opt_name,
                    "layout": layout,
                    "world_size": ws,
                    "n_blocks": nb,
                    "kind": "count",
                    "strategy": strategy,
                }
                try:
                    calls = counted.get((opt_name, layout, strategy)) if nb == 1 else None
                    if calls is None:
                        with contextlib.redirect_stdout(io.StringIO()):
                            _, _, calls = run_case(opt_name, layout, strategy)
                    rec["collective_calls"] = calls
                except Exception:
                    rec["error"] = traceback.format_exc()
                records.append(rec)
                if rank == 0:
                    print(json.dumps(rec), flush=True)
    N_BLOCKS = 1
    if args.config_file:
        rec = {"kind": "config_file", "world_size": ws}
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                rec.update(run_config_file())
        except Exception:
            rec["error"] = traceback.format_exc()
        records.append(rec)
        if rank == 0:
            print(json.dumps(rec), flush=True)
    LAST_OPTIMIZER = None  # released with the engines before the group goes
    finish_worker(records, args.out)  # the ranks meet before the group goes (see crash_worker.py)


if __name__ == "__main__":
    from launch import settle_heap

    settle_heap()
    main()
