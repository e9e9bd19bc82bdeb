"""DeepSpeed's checkpoint scenarios on FSDP2 (issue 55): ``ckpt_options_worker``'s model (a frozen layer, tied
weights, a persistent buffer and a call counter), a warmup ``LambdaLR``, global batch 12 over the ranks.

``--phase save`` (world size 2): train 3 steps, save through DCP (``get_state_dict`` + the scheduler, as
``examples/fsdp2_train.py`` does) and through ``shardopt.checkpoint.save(..., model=model)`` (the scheduler in
``extra``), also once without ``model=``; run on to step 6 (the uninterrupted run) and build the references: a
fresh optimizer on the saved weights with the saved scheduler (no optimizer state loaded) and with a fresh one
(module only). ``--phase load`` (any world size): each path and variant into another random init: frozen weights
and buffers against the saved ones, then 3 steps against the reference; ``strict`` against the checkpoint saved
without ``model=``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from ckpt_options_worker import (
    OTHER_SEED,
    SAVED_SEED,
    SPLIT,
    TOTAL,
    diff,
    frozen_and_buffers,  # noqa: E402
    local_batch,
    make_net,
    options,
    quiet,
    trainable,
)
from parity_worker import OPTIMIZERS  # noqa: E402
from tiers import selected  # noqa: E402

import shardopt  # noqa: E402
import shardopt.checkpoint as sckpt  # noqa: E402
from launch import finish_worker  # noqa: E402

#: what each path loads, by variant name (DeepSpeed's option each one corresponds to)
VARIANTS = ("full", "no_optimizer", "module_only")
PATHS = ("dcp", "shardopt")


class Run:
    """The model under ``fully_shard`` (each Linear, then the root: tied weights and buffers), shardopt's
    optimizer and a warmup schedule."""

    def __init__(self, opt_name: str, model: nn.Module):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for name in ("fc1", "frozen", "fc2", "fc3"):
            fully_shard(getattr(model, name), mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.opt = shardopt.create_optimizer(model, opt_name, **options(opt_name))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / 5))

    def train(self, start: int, stop: int) -> None:
        for s in range(start, stop):
            x, y = local_batch(s)
            loss = nn.functional.mse_loss(self.model(x), y)
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.sched.step()

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Every tensor of the module's state dict, whole, fp32, on every rank (tied names both)."""
        out = {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
            for n, p in self.model.named_parameters(remove_duplicate=False)
        }
        out.update({n: b.detach().float().clone() for n, b in self.model.named_buffers()})
        return out

    def save_dcp(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.opt)
        dcp.save({"model": msd, "optim": osd, "scheduler": self.sched.state_dict()}, checkpoint_id=path)

    def load_dcp(self, path: str, variant: str) -> None:
        """``full``: model, optimizer, scheduler; ``no_optimizer``: model and scheduler; ``module_only``: model."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_state_dict,
            set_model_state_dict,
            set_state_dict,
        )

        if variant == "full":
            msd, osd = get_state_dict(self.model, self.opt)
            sd = {"model": msd, "optim": osd, "scheduler": self.sched.state_dict()}
            dcp.load(sd, checkpoint_id=path)
            set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        else:
            sd = {"model": get_model_state_dict(self.model)}
            if variant == "no_optimizer":
                sd["scheduler"] = self.sched.state_dict()
            dcp.load(sd, checkpoint_id=path)
            set_model_state_dict(self.model, sd["model"])
        if "scheduler" in sd:
            self.sched.load_state_dict(sd["scheduler"])

    def load_shardopt(self, path: str, variant: str, strict: bool = True) -> dict:
        meta = sckpt.load(path, self.opt, model=self.model, load_state=variant == "full", strict=strict)
        if variant != "module_only":
            self.sched.load_state_dict(meta["extra"]["scheduler"])
        return meta


def phase_save(root: str, names: list[str], records: list) -> None:
    for opt_name in names:
        base = os.path.join(root, opt_name)
        rec = {"phase": "save", "optimizer": opt_name, "world_size": dist.get_world_size()}
        try:
            with quiet():
                first = Run(opt_name, make_net(SAVED_SEED))
                first.train(0, SPLIT)
                first.save_dcp(os.path.join(base, "dcp"))
                sched = first.sched.state_dict()
                sckpt.save(
                    os.path.join(base, "shardopt"),
                    first.opt,
                    engine="fsdp2",
                    model=first.model,
                    extra={"scheduler": sched},
                )
                sckpt.save(os.path.join(base, "optimizer_only"), first.opt, engine="fsdp2", extra={"scheduler": sched})
                saved = first.snapshot()
                first.train(SPLIT, TOTAL)
                refs = {"full": first.snapshot()}
                for variant in ("no_optimizer", "module_only"):
                    model = make_net(OTHER_SEED)
                    model.load_state_dict({n: v for n, v in saved.items() if n in model.state_dict()})
                    ref = Run(opt_name, model)
                    if variant == "no_optimizer":
                        ref.sched.load_state_dict(sched)
                    ref.train(SPLIT, TOTAL)
                    refs[variant] = ref.snapshot()
            if dist.get_rank() == 0:
                torch.save({"saved": saved, "refs": refs}, os.path.join(base, "expected.pt"))
        except Exception:
            rec["error"] = traceback.format_exc()
        records.append(rec)
        dist.barrier()


def phase_load(root: str, names: list[str], records: list) -> None:
    ws = dist.get_world_size()
    for opt_name in names:
        base = os.path.join(root, opt_name)
        expected = torch.load(os.path.join(base, "expected.pt"), weights_only=True)
        saved, refs = expected["saved"], expected["refs"]
        for path in PATHS:
            for variant in VARIANTS:
                rec = {"phase": "load", "optimizer": opt_name, "path": path, "variant": variant, "world_size": ws}
                try:
                    with quiet():
                        run = Run(opt_name, make_net(OTHER_SEED))
                        getattr(run, f"load_{path}")(os.path.join(base, path), variant)
                        now = run.snapshot()
                        rec["frozen_buffers_vs_saved"] = diff(now, saved, frozen_and_buffers(run.model))
                        rec["trained_vs_saved"] = diff(now, saved, trainable(run.model))
                        rec["scheduler_epoch"] = run.sched.last_epoch
                        run.train(SPLIT, TOTAL)
                        after = run.snapshot()
                        rec["vs_reference"] = diff(after, refs[variant], refs[variant])
                        rec["calls"] = int(after["calls"])
                except Exception:
                    rec["error"] = traceback.format_exc()
                records.append(rec)
                if dist.get_rank() == 0:
                    print(json.dumps(rec), flush=True)
                dist.barrier()
        records.append(strict_record(opt_name, base, saved))
        dist.barrier()


def strict_record(opt_name: str, base: str, saved: dict) -> dict:
    """A checkpoint saved without ``model=``: ``strict`` refuses before anything changes; ``strict=False``
    keeps the model's own frozen weights and buffers and loads the rest."""
    rec = {"phase": "strict", "optimizer": opt_name, "world_size": dist.get_world_size()}
    try:
        with quiet():
            run = Run(opt_name, make_net(OTHER_SEED))
            own = run.snapshot()
            try:
                run.load_shardopt(os.path.join(base, "optimizer_only"), "full")
                rec["strict_error"] = None
            except sckpt.CheckpointError as err:
                rec["strict_error"] = str(err)
            rec["unchanged_after_refusal"] = diff(run.snapshot(), own, own)
            run.load_shardopt(os.path.join(base, "optimizer_only"), "full", strict=False)
            now = run.snapshot()
            rec["kept_vs_own"] = diff(now, own, frozen_and_buffers(run.model))
            rec["trained_vs_saved"] = diff(now, saved, trainable(run.model))
    except Exception:
        rec["error"] = traceback.format_exc()
    if dist.get_rank() == 0:
        print(json.dumps(rec), flush=True)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=["save", "load"], required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--optimizers", default="")
    args = ap.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    names = [n for n in args.optimizers.split(",") if n] or selected(OPTIMIZERS, ("scale",))
    records: list = []
    (phase_save if args.phase == "save" else phase_load)(args.dir, names, records)
    finish_worker(records, args.out)


if __name__ == "__main__":
    from launch import settle_heap

    settle_heap()
    main()
