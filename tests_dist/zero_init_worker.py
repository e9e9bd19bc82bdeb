"""Models built under ``deepspeed.zero.Init`` (issue 47, item 0): what Hugging Face's ``from_pretrained`` does under
ZeRO-3 and what large-model users do so that no rank ever holds the whole model. Every parameter is partitioned
from the start (``p.shape == (0,)``, the real shape in ``ds_shape``); routing, roles and the optimizer read the
logical shape, so the model trains through ``shardopt.deepspeed.initialize`` exactly like one partitioned by
``deepspeed.initialize`` (the parity suite's ZeRO-3).

Each case (the parity suite's toy model and hyperparameters): the model is built under ``zero.Init``, every
matrix must get the requested rule (never AdamW by accident), 3 steps are compared with one process, then the run
is saved (``engine.save_checkpoint``), a fresh ``zero.Init`` model loads it and runs 3 more steps, compared with the
first run continued (resume).
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
from toy_models import GLOBAL_BATCH, loss_fn, make_model  # noqa: E402

import shardopt  # noqa: E402
from launch import finish_worker, max_abs_diff, record_case, shared_tempdir  # noqa: E402


def config(name: str) -> dict:
    kw = options(name)
    return {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // dist.get_world_size(),
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3, "sub_group_size": 100},
        "shardopt": {
            "optimizer": name,
            "params": {k: v for k, v in kw.items() if k != "routing"},
            "routing": kw.get("routing", {}),
        },
    }


def engine(name: str):
    from deepspeed import zero

    cfg = config(name)
    with zero.Init(config_dict_or_path=cfg):
        model = make_model(n_blocks=N_BLOCKS)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    eng, _, _, _ = shardopt.deepspeed.initialize(model=model, config=cfg)
    return eng, shapes


def train(eng, start: int, stop: int) -> None:
    for s in range(start, stop):
        eng.backward(loss_fn(eng, local_batch(s)))
        eng.step()


def params(eng) -> dict[str, torch.Tensor]:
    from deepspeed import zero

    with zero.GatheredParameters(list(eng.module.parameters())):
        return {n: p.detach().float().clone() for n, p in eng.module.named_parameters()}


def case(name: str, root: str) -> dict:
    want, _ = reference(name)
    eng, shapes = engine(name)
    opt = eng.basic_optimizer if hasattr(eng, "basic_optimizer") else eng.optimizer
    rule = {n: g["treatment"] for g, names in zip(opt._groups(), opt.group_param_names) for n in names}
    logical = {n: tuple(p.ds_shape) for n, p in eng.module.named_parameters()}
    train(eng, 0, STEPS)
    out = {
        "partitioned_at_build": all(s == (0,) for s in shapes.values()),
        "matrix_rules": {n: rule[n] for n, s in logical.items() if len(s) == 2},
        "max_abs_diff": max_abs_diff(params(eng), want),
    }
    eng.save_checkpoint(root, tag="zinit")
    train(eng, STEPS, 2 * STEPS)
    resumed, _ = engine(name)
    resumed.load_checkpoint(root, tag="zinit")
    train(resumed, STEPS, 2 * STEPS)
    out["resume_max_abs_diff"] = max_abs_diff(params(resumed), params(eng))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    args = ap.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    import deepspeed

    deepspeed.init_distributed("gloo", timeout=timedelta(seconds=180))
    records: list = []
    for name in args.optimizers.split(","):
        rec = {"optimizer": name, "world_size": dist.get_world_size()}
        root = shared_tempdir("shardopt_zinit_")
        record_case(records, rec, partial(case, name, root))
    finish_worker(records, args.out)


if __name__ == "__main__":
    from launch import settle_heap

    settle_heap()
    main()
