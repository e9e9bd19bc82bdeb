"""The reference trainer's checkpoints at another world size (issue 55): ``shardopt.train``'s ``Trainer`` with
tied embeddings, on FSDP2 (DCP) and DeepSpeed ZeRO-2 (``engine.save_checkpoint``).

``--phase save`` (world size 2): 2 steps, the trainer's own checkpoint at step 2; the whole model and the
optimizer's logical state are kept. ``--phase load`` (any world size): ``--resume``'s load into a fresh trainer
(another seed, so nothing matches by chance); the model, the tie, the optimizer's logical state, the scheduler and
the step against the saved ones.
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
import shardopt.checkpoint as sckpt  # noqa: E402
from launch import ROOT, finish_worker  # noqa: E402
from shardopt.train.config import load_train_config  # noqa: E402
from shardopt.train.trainer import Trainer  # noqa: E402

CONFIGS = {"fsdp2": "fsdp2_sinkgd.json", "deepspeed": "demo.json"}
STEPS = 2


def trainer(engine: str, run_dir: str, seed: int, resume: bool) -> Trainer:
    cfg = load_train_config(
        str(ROOT / "configs" / "train" / CONFIGS[engine]),
        [
            f"run_dir={run_dir}",
            f"seed={seed}",
            f"data.cache_dir={ROOT / 'runs' / 'cache'}",
            "model.tie_embeddings=true",
            f"train.steps={STEPS}",
            "train.progress=false",
            "train.log_every=1",
            "train.micro_batch_size=2",
            "eval.every=0",
            "eval.at_start=false",
            "eval.max_sequences=4",
            f"checkpoint.every={STEPS}",
            "checkpoint.at_end=true",
        ],
    )
    return Trainer(cfg, resume=resume, log=lambda msg: None)


def model_state(t: Trainer) -> dict[str, torch.Tensor]:
    from deepspeed import zero

    module = t.module
    with zero.GatheredParameters([p for p in module.parameters() if hasattr(p, "ds_id")]):
        return {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
            for n, p in module.named_parameters(remove_duplicate=False)
        }


def optimizer_state(t: Trainer, scratch: str) -> dict[str, torch.Tensor]:
    """The optimizer's whole logical state (every rank): DeepSpeed's engine writes it into a tag it saves,
    FSDP2's optimizer is shardopt's own."""
    if t.engine_name == "deepspeed":
        with contextlib.redirect_stdout(io.StringIO()):
            t.model.save_checkpoint(scratch, tag="probe", save_latest=False)
        return sckpt.read_state_file(sckpt.state_path(os.path.join(scratch, "probe")))[0]
    full, _ = sckpt.export_state(t.optimizer)
    box = [full]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def phase_save(root: str, engine: str) -> dict:
    rec = {"phase": "save", "engine": engine, "world_size": dist.get_world_size()}
    t = trainer(engine, os.path.join(root, engine), 0, False)
    rec["steps"] = t.fit()["steps"]
    state = {
        "model": model_state(t),
        "optim": optimizer_state(t, os.path.join(root, f"{engine}-probe-save")),
        "scheduler": t.scheduler.state_dict()["last_epoch"],
    }
    if dist.get_rank() == 0:
        torch.save(state, os.path.join(root, f"{engine}-expected.pt"))
    return rec


def phase_load(root: str, engine: str) -> dict:
    rec = {"phase": "load", "engine": engine, "world_size": dist.get_world_size()}
    expected = torch.load(os.path.join(root, f"{engine}-expected.pt"), weights_only=True)
    t = trainer(engine, os.path.join(root, engine), 1, True)
    t._build()
    before = model_state(t)
    rec["model_before_load_vs_saved"] = max((before[n] - v).abs().max().item() for n, v in expected["model"].items())
    rec["resumed"] = t._load()
    rec["step"] = t.step
    rec["scheduler"] = t.scheduler.state_dict()["last_epoch"] == expected["scheduler"]
    rec["tied"] = t.module.lm_head.weight is t.module.embed_tokens.weight
    now = model_state(t)
    rec["model_vs_saved"] = max((now[n] - v).abs().max().item() for n, v in expected["model"].items())
    optim = optimizer_state(t, os.path.join(root, f"{engine}-probe-{dist.get_world_size()}"))
    rec["optim_keys_match"] = sorted(optim) == sorted(expected["optim"])
    rec["optim_vs_saved"] = max(
        ((optim[k] - v).abs().max().item() for k, v in expected["optim"].items() if k in optim), default=0.0
    )
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=["save", "load"], required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    records = []
    for engine in CONFIGS:
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                rec = (phase_save if args.phase == "save" else phase_load)(args.dir, engine)
        except Exception:
            rec = {"phase": args.phase, "engine": engine, "error": traceback.format_exc()}
        records.append(rec)
        if dist.get_rank() == 0:
            print(json.dumps(rec), flush=True)
        dist.barrier()
    finish_worker(records, args.out)


if __name__ == "__main__":
    from launch import settle_heap

    settle_heap()
    main()
