"""Gradient accumulation worker (issue 28): the step after ``ACCUM`` micro-batches equals the single-process
step on the whole global batch.

DeepSpeed (``gradient_accumulation_steps = ACCUM``; ZeRO-1, ZeRO-2, ZeRO-3) averages the micro-batches' losses
itself; FSDP2 runs ``set_requires_gradient_sync(False)`` and DDP ``no_sync()`` on all but the last micro-batch,
each loss scaled by ``1 / ACCUM``. Each rank sees ``GLOBAL // world`` samples per step in ``ACCUM`` micro-batches; the
reference trains one process on the same ``GLOBAL`` samples per step. Each case is also saved after ``STEPS`` steps
(DeepSpeed: ``engine.save_checkpoint``; FSDP2 and DDP: ``shardopt.checkpoint``), loaded into a fresh run and continued
for ``STEPS`` more, against the reference at ``2 x STEPS``. Rank 0 writes one record per case.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import tempfile
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from parity_worker import options  # noqa: E402
from tiers import selected  # noqa: E402
from toy_models import batch, loss_fn, make_model  # noqa: E402

import shardopt  # noqa: E402
from launch import finish_worker, max_abs_diff, record_case  # noqa: E402

ACCUM = 4
GLOBAL = 48  # divisible by ACCUM x world size for world sizes 1-4
STEPS = 3
ENGINES = ("zero1", "zero2", "zero3", "fsdp2", "ddp")
#: the issue's optimizers; the whole-matrix ones under each of their strategies that move data differently
CASES = [
    ("scale", None),
    ("racs", None),
    ("sumo", "gather"),
    ("sumo", "distributed"),
    ("alice", "team"),
    ("alice", "distributed"),
    ("asgo", "gather"),
    ("asgo", "distributed"),
    ("muon", None),
]
#: CI runs each optimizer once, the whole-matrix ones under the strategy that moves data along the grain
CI_CASES = [("scale", None), ("racs", None), ("sumo", "distributed"), ("alice", "team"), ("asgo", "gather")]


def reference(opt_name: str, strategy: str | None, steps: int = STEPS) -> dict[str, torch.Tensor]:
    model = make_model()
    opt = shardopt.create_optimizer(model, opt_name, **options(opt_name, strategy))
    for s in range(steps):
        opt.zero_grad()
        loss_fn(model, batch(s, GLOBAL)).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def micro_batches(step: int) -> list[torch.Tensor]:
    """This rank's ``ACCUM`` micro-batches of the step's global batch (each rank a contiguous share)."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    per = GLOBAL // ws
    mine = batch(step, GLOBAL)[rank * per : (rank + 1) * per]
    return list(mine.chunk(ACCUM))


class ZeroRun:
    """DeepSpeed with ``gradient_accumulation_steps = ACCUM``; checkpoints by ``engine.save_checkpoint``."""

    def __init__(self, opt_name: str, strategy: str | None, stage: int):
        kw = options(opt_name, strategy)
        per = GLOBAL // dist.get_world_size()
        config = {
            "train_batch_size": GLOBAL,
            "train_micro_batch_size_per_gpu": per // ACCUM,
            "gradient_accumulation_steps": ACCUM,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage},
            "shardopt": {
                "optimizer": opt_name,
                "params": {k: v for k, v in kw.items() if k != "routing"},
                "routing": kw.get("routing", {}),
            },
        }
        if stage == 3:
            config["zero_optimization"]["sub_group_size"] = 100
        self.stage = stage
        self.engine, _, _, _ = shardopt.deepspeed.initialize(model=make_model(), config=config)

    def train(self, first: int, steps: int) -> None:
        for s in range(first, first + steps):
            for x in micro_batches(s):
                self.engine.backward(loss_fn(self.engine, x))
                self.engine.step()  # DeepSpeed steps the optimizer at the accumulation boundary only

    def params(self) -> dict[str, torch.Tensor]:
        from deepspeed import zero

        params = list(self.engine.module.parameters())
        with zero.GatheredParameters(params) if self.stage == 3 else contextlib.nullcontext():
            return {n: p.detach().float().clone() for n, p in self.engine.module.named_parameters()}

    def save(self, path: str) -> None:
        self.engine.save_checkpoint(path, tag="accum")

    def load(self, path: str) -> None:
        self.engine.load_checkpoint(path, tag="accum")


class TorchRun:
    """FSDP2 (``set_requires_gradient_sync(False)``) or DDP (``no_sync()``) on all but the last micro-batch, each
    loss scaled by ``1 / ACCUM``; checkpoints by ``shardopt.checkpoint`` (optimizer state and parameters)."""

    def __init__(self, opt_name: str, strategy: str | None, engine: str):
        self.model = make_model()
        self.engine = engine
        if engine == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for blk in self.model.blocks:
                fully_shard(blk, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
            self.wrapped = self.model
        else:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.wrapped = DDP(self.model)
        self.opt = shardopt.create_optimizer(self.model, opt_name, **options(opt_name, strategy))

    def _no_sync(self, last: bool):
        if self.engine == "fsdp2":
            self.model.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
        return contextlib.nullcontext() if last else self.wrapped.no_sync()

    def train(self, first: int, steps: int) -> None:
        for s in range(first, first + steps):
            self.opt.zero_grad()
            parts = micro_batches(s)
            for j, x in enumerate(parts):
                with self._no_sync(j == len(parts) - 1):
                    (loss_fn(self.wrapped, x) / ACCUM).backward()
            self.opt.step()

    def params(self) -> dict[str, torch.Tensor]:
        return {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in self.model.named_parameters()
        }

    def save(self, path: str) -> None:
        shardopt.checkpoint.save(path, self.opt, engine=self.engine)

    def load(self, path: str) -> None:
        shardopt.checkpoint.load(path, self.opt, load_params=True)


def make_run(opt_name: str, strategy: str | None, engine: str):
    return (
        ZeroRun(opt_name, strategy, int(engine[-1]))
        if engine.startswith("zero")
        else TorchRun(opt_name, strategy, engine)
    )


def case(opt_name: str, strategy: str | None, engine: str, want: dict, resume_root: str | None) -> dict:
    """``STEPS`` accumulated steps against the reference; with ``resume_root``, also a save there, a fresh run
    that loads it and ``STEPS`` more steps against the reference at ``2 x STEPS``."""
    run = make_run(opt_name, strategy, engine)
    run.train(0, STEPS)
    out = {"max_abs_diff": max_abs_diff(run.params(), want)}
    if resume_root is not None:
        path = os.path.join(resume_root, f"{opt_name}_{strategy}_{engine}")
        run.save(path)
        resumed = make_run(opt_name, strategy, engine)
        resumed.load(path)
        resumed.train(STEPS, STEPS)
        out["resume_max_abs_diff"] = max_abs_diff(resumed.params(), reference(opt_name, strategy, 2 * STEPS))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    root = [tempfile.mkdtemp(prefix="shardopt_accum_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root, src=0)
    records = []
    for opt_name, strategy in selected(CASES, CI_CASES):
        want = reference(opt_name, strategy)
        for engine in ENGINES:
            rec = {"optimizer": opt_name, "strategy": strategy, "engine": engine, "world_size": dist.get_world_size()}
            record_case(records, rec, partial(case, opt_name, strategy, engine, want, root[0]))
    finish_worker(records, args.out)


if __name__ == "__main__":
    from launch import settle_heap

    settle_heap()
    main()
