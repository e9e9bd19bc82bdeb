"""Checkpoint worker: exact resume on every engine, and resharding across world sizes and engines.

``--phase save`` (world size 2): for each optimizer and engine, run 6 steps uninterrupted; run 3 steps,
save with the engine's own mechanism, rebuild, load and run steps 3-5; compare. It leaves the step-3
checkpoints in ``--dir`` for the resume phase.
``--phase resume`` (any world size): load those checkpoints into a fresh engine at this world size (also
across engines: ZeRO-2 -> FSDP2 and FSDP2 -> ZeRO-2), run steps 3-5 and compare with a single-process run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from parity_worker import OPTIMIZERS, local_batch, reference  # noqa: E402
from tiers import optimizers  # noqa: E402
from toy_models import GLOBAL_BATCH, loss_fn, make_model  # noqa: E402

import shardopt  # noqa: E402
import shardopt.checkpoint as sckpt  # noqa: E402
from launch import finish_worker  # noqa: E402

ENGINES = ["ddp", "fsdp2", "zero1", "zero2", "zero3"]
TOTAL, SPLIT = 6, 3


class Run:
    """One engine + optimizer on a fresh toy model, with save/load in the engine's native way."""

    def __init__(self, engine: str, opt_name: str):
        self.kind, self.opt_name = engine, opt_name
        model = make_model()
        kw = dict(OPTIMIZERS[opt_name])
        if engine == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.model, self.module = DDP(model), model
            self.opt = shardopt.create_optimizer(model, opt_name, **kw)
        elif engine == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for blk in model.blocks:
                fully_shard(blk, mesh=mesh)
            fully_shard(model, mesh=mesh)
            self.model = self.module = model
            self.opt = shardopt.create_optimizer(model, opt_name, **kw)
        else:
            stage = int(engine[-1])
            config = {
                "train_batch_size": GLOBAL_BATCH,
                "train_micro_batch_size_per_gpu": GLOBAL_BATCH // dist.get_world_size(),
                "gradient_clipping": 0.0,
                "zero_optimization": {"stage": stage, **({"sub_group_size": 100} if stage == 3 else {})},
                "shardopt": {
                    "optimizer": opt_name,
                    "params": {k: v for k, v in kw.items() if k != "routing"},
                    "routing": kw.get("routing", {}),
                },
            }
            self.model, self.opt, _, _ = shardopt.deepspeed.initialize(model=model, config=config)
            self.module = self.model.module

    def train(self, start: int, stop: int) -> None:
        for s in range(start, stop):
            loss = loss_fn(self.model, local_batch(s))
            if self.kind.startswith("zero"):
                self.model.backward(loss)
                self.model.step()
            else:
                self.opt.zero_grad()
                loss.backward()
                self.opt.step()

    def full_params(self) -> dict[str, torch.Tensor]:
        if self.kind == "zero3":
            from deepspeed import zero

            with zero.GatheredParameters(list(self.module.parameters())):
                return {n: p.detach().float().clone() for n, p in self.module.named_parameters()}
        out = {}
        for n, p in self.module.named_parameters():
            out[n] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
        return out

    def save(self, path: str) -> None:
        if self.kind.startswith("zero"):
            self.model.save_checkpoint(path, tag="step3")
        elif self.kind == "fsdp2":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            msd, osd = get_state_dict(self.model, self.opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(path, "dcp"))
            sckpt.save(os.path.join(path, "logical"), self.opt, engine="fsdp2")  # for other engines
        else:
            if dist.get_rank() == 0:
                os.makedirs(path, exist_ok=True)
                torch.save(
                    {"model": self.module.state_dict(), "optim": self.opt.state_dict()}, os.path.join(path, "state.pt")
                )
            dist.barrier()

    def load(self, path: str, source: str) -> None:
        if self.kind.startswith("zero") and source == "conv_ds":
            self.model.load_checkpoint(path)  # converted by `shardopt checkpoint convert --to deepspeed`
        elif self.kind.startswith("zero"):
            # a DeepSpeed directory, or a logical checkpoint from another engine laid out as <dir>/<tag>/
            self.model.load_checkpoint(path, tag="step3" if source.startswith("zero") else "logical")
        elif self.kind == "fsdp2" and source in ("fsdp2", "conv_dcp"):
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            msd, osd = get_state_dict(self.model, self.opt)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, checkpoint_id=os.path.join(path, "dcp") if source == "fsdp2" else path)
            set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        elif self.kind == "ddp" and source == "ddp":
            sd = torch.load(os.path.join(path, "state.pt"), weights_only=True)
            self.module.load_state_dict(sd["model"])
            self.opt.load_state_dict(sd["optim"])
        else:  # another engine's logical state (DeepSpeed writes it into <dir>/<tag>/)
            sub = os.path.join(path, "step3") if source.startswith("zero") else os.path.join(path, "logical")
            sckpt.load(sub, self.opt)


def max_diff(a: dict, b: dict) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in b)


def phase_save(root: str, records: list) -> None:
    for opt_name in optimizers(OPTIMIZERS):
        for engine in ENGINES:
            rec = {"phase": "save", "optimizer": opt_name, "engine": engine, "world_size": dist.get_world_size()}
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    full = Run(engine, opt_name)
                    full.train(0, TOTAL)
                    want = full.full_params()
                    first = Run(engine, opt_name)
                    first.train(0, SPLIT)
                    path = os.path.join(root, opt_name, engine)
                    first.save(path)
                    second = Run(engine, opt_name)
                    second.load(path, engine)
                    second.train(SPLIT, TOTAL)
                    rec["max_abs_diff"] = max_diff(second.full_params(), want)
            except Exception:
                rec["error"] = traceback.format_exc()
            records.append(rec)
            if dist.get_rank() == 0:
                print(json.dumps(rec), flush=True)
            dist.barrier()


RESHARD = [
    ("zero2", "zero2"),
    ("zero3", "zero3"),
    ("zero2", "zero3"),
    ("fsdp2", "fsdp2"),
    ("zero2", "fsdp2"),
    ("fsdp2", "zero2"),
    ("zero1", "ddp"),
    ("conv_dcp", "fsdp2"),
    ("conv_ds", "zero2"),
]


def convert_sources(root: str) -> None:
    """What `shardopt checkpoint convert` makes: ZeRO-2 -> DCP directory, FSDP2 DCP -> DeepSpeed directory."""
    from shardopt.cli import main as cli

    if dist.get_rank() == 0:
        for opt_name in optimizers(OPTIMIZERS):
            base = os.path.join(root, opt_name)
            for src, dst, to in (("zero2", "conv_dcp", "dcp"), ("fsdp2/dcp", "conv_ds", "deepspeed")):
                if not os.path.exists(os.path.join(base, dst)):
                    assert (
                        cli(["checkpoint", "convert", os.path.join(base, src), os.path.join(base, dst), "--to", to])
                        == 0
                    )
    dist.barrier()


def phase_resume(root: str, records: list) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        convert_sources(root)
    for opt_name in optimizers(OPTIMIZERS):
        want, _ = reference(opt_name, TOTAL)
        for source, engine in RESHARD:
            rec = {
                "phase": "resume",
                "optimizer": opt_name,
                "source": source,
                "engine": engine,
                "world_size": dist.get_world_size(),
            }
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    run = Run(engine, opt_name)
                    run.load(os.path.join(root, opt_name, source), source)
                    run.train(SPLIT, TOTAL)
                    rec["max_abs_diff"] = max_diff(run.full_params(), want)
            except Exception:
                rec["error"] = traceback.format_exc()
            records.append(rec)
            if dist.get_rank() == 0:
                print(json.dumps(rec), flush=True)
            dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=["save", "resume"], required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    records: list = []
    (phase_save if args.phase == "save" else phase_resume)(args.dir, records)
    # DeepSpeed's load options on a model with frozen weights and buffers (ckpt_options_worker's CI case)
    from ckpt_options_worker import ci_load, ci_save

    rec = (ci_save if args.phase == "save" else ci_load)(args.dir)
    if dist.get_rank() == 0:
        print(json.dumps(rec), flush=True)
    records.append(rec)
    finish_worker(records, args.out)


if __name__ == "__main__":
    from launch import settle_heap

    settle_heap()
    main()
