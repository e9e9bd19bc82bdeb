"""No hangs and consistent decisions: non-finite gradients on one rank, frozen parameters, gradients missing on
some ranks, and a step-plan mismatch caught by the debug check. Process-group timeout 30 s: a collective
mismatch fails the test quickly instead of hanging it."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import sys
import traceback
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from parity_worker import OPTIMIZERS, local_batch  # noqa: E402
from toy_models import GLOBAL_BATCH, loss_fn, make_model  # noqa: E402

import shardopt  # noqa: E402
from launch import finish_worker  # noqa: E402


def fsdp2(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def local_params(model):
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for n, p in model.named_parameters()}


#: the rules whose writes are gated by a skip decided on the device (``ShardedOptimizer.skips_on_device``)
DEVICE_GATED = ("scale", "sinkgd", "dasgo", "racs", "alice", "muon", "swan", "sumo")


def nonfinite_on_one_rank(opt_name: str, engine: str, on_device: bool = False) -> dict:
    """Rank 1 alone sees a NaN gradient: every rank must skip the step, leaving parameters untouched
    (``on_device``: the skip decided on the device, ``nonfinite.gate_step``, as CUDA does)."""
    model = make_model()
    kw = dict(OPTIMIZERS[opt_name])
    if on_device and "refresh_interval" in kw:
        kw["refresh_interval"] = 5  # the NaN step (2) switches no basis, so the device decides it (Alice)
    if engine == "zero2":
        config = {
            "train_batch_size": GLOBAL_BATCH,
            "train_micro_batch_size_per_gpu": GLOBAL_BATCH // dist.get_world_size(),
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": 2},
            "shardopt": {
                "optimizer": opt_name,
                "params": {k: v for k, v in kw.items() if k != "routing"},
                "routing": kw.get("routing", {}),
            },
        }
        eng, opt, _, _ = shardopt.deepspeed.initialize(model=model, config=config)
        run = eng
    else:
        if engine == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            run = DDP(model)
        else:
            run = fsdp2(model)
        opt = shardopt.create_optimizer(model, opt_name, **kw)
        opt.nonfinite_on_device = on_device
    mod = eng.module if engine == "zero2" else model
    for s in range(2):
        loss = loss_fn(run, local_batch(s))
        if s == 1 and dist.get_rank() == 1:
            loss = loss * float("nan")
        if engine == "zero2":
            before = local_params(mod)
            eng.backward(loss)
            eng.step()
        else:
            opt.zero_grad()
            loss.backward()
            before = local_params(mod)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opt.step()
    after = local_params(mod)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    finite = all(torch.isfinite(v).all().item() for v in after.values())
    gated = opt._gates_on_device() if engine != "zero2" else None  # the gradients of the skipped step are still there
    return {
        "changed_on_skipped_step": changed,
        "finite": finite,
        "skipped": getattr(opt, "skipped_steps", None),
        "gated": gated,
    }


def frozen_and_missing_grads(opt_name: str) -> dict:
    """l1 frozen; rank 1 has no gradient for `wide.weight` and `lm_head.weight`: the step must still complete."""
    model = make_model()
    for p in model.blocks[0].l1.parameters():
        p.requires_grad_(False)
    fsdp2(model)
    opt = shardopt.create_optimizer(model, opt_name, **OPTIMIZERS[opt_name])
    for s in range(3):
        opt.zero_grad()
        loss_fn(model, local_batch(s)).backward()
        if dist.get_rank() == 1:
            model.wide.weight.grad = None
            model.lm_head.weight.grad = None
        opt.step()
    return {"finite": all(torch.isfinite(v).all().item() for v in local_params(model).values())}


def plan_mismatch() -> dict:
    """Ranks built different routings: the debug check names the first difference instead of hanging."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model()
    ddp = DDP(model)
    routing = {"lm_head.weight": "matrix"} if dist.get_rank() == 1 else {}
    opt = shardopt.create_optimizer(model, "sinkgd", routing=routing, debug_plan=True)
    opt.zero_grad()
    loss_fn(ddp, local_batch(0)).backward()
    try:
        opt.step()
    except RuntimeError as err:
        return {"error_message": str(err)}
    return {"error_message": None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    records = []
    cases = [("nonfinite", o, e) for o in OPTIMIZERS for e in ("ddp", "fsdp2", "zero2")]
    cases += [("nonfinite_on_device", o, e) for o in DEVICE_GATED for e in ("ddp", "fsdp2")]
    cases += [("frozen_missing", o, "fsdp2") for o in OPTIMIZERS] + [("plan_mismatch", "sinkgd", "ddp")]
    for kind, opt_name, engine in cases:
        rec = {"kind": kind, "optimizer": opt_name, "engine": engine, "world_size": dist.get_world_size()}
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                if kind.startswith("nonfinite"):
                    rec.update(nonfinite_on_one_rank(opt_name, engine, on_device=kind == "nonfinite_on_device"))
                elif kind == "frozen_missing":
                    rec.update(frozen_and_missing_grads(opt_name))
                else:
                    rec.update(plan_mismatch())
        except Exception:
            rec["error"] = traceback.format_exc()
        all_recs = [None] * dist.get_world_size()
        dist.all_gather_object(all_recs, rec)
        records.append(all_recs)
        if dist.get_rank() == 0:
            print(json.dumps(all_recs), flush=True)
    finish_worker(records, args.out)


if __name__ == "__main__":
    from launch import settle_heap

    settle_heap()
    main()
