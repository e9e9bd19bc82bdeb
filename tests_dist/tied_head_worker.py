"""The functional tied head on every engine (issue 52): logits ``F.linear(x, wte.weight)``, learned positions, an MLP
(``tests/role_corpus.FunctionalTiedLM``). Routing used to take the last ``fc2`` for the LM head and hand it AdamW;
now no Linear is the head and every parameter keeps one process's role. Each engine trains 3 steps on the same global
batches as one process; the record holds the max difference of every parameter and the role table of each side.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from role_corpus import FunctionalTiedLM  # noqa: E402

import shardopt  # noqa: E402
from launch import finish_worker, record_case  # noqa: E402

ENGINES = ("zero2", "zero3", "fsdp2")
STEPS, GLOBAL, SEQ, VOCAB = 3, 8, 12, 50
HP = {"lr": 1e-2}


def build() -> FunctionalTiedLM:
    torch.manual_seed(0)
    return FunctionalTiedLM()


def loss_of(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1), torch.roll(tokens, -1, 1).flatten())


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=torch.Generator().manual_seed(100 + step))


def rows(table: str) -> list[list[str]]:
    return sorted(line.split() for line in table.splitlines()[1:])


def one_process(name: str) -> tuple[dict, list]:
    model = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = shardopt.create_optimizer(model, name, **HP)
    for s in range(STEPS):
        loss_of(model, batch(s)).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, rows(opt.describe())


def on_engine(engine: str, name: str) -> tuple[dict, list]:
    world, rank = dist.get_world_size(), dist.get_rank()
    per = GLOBAL // world
    model = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if engine.startswith("zero"):
            cfg = {
                "train_batch_size": GLOBAL,
                "train_micro_batch_size_per_gpu": per,
                "gradient_clipping": 0.0,
                "zero_optimization": {"stage": int(engine[4])},
                "shardopt": {"optimizer": name, "params": HP},
            }
            eng, opt, _, _ = shardopt.deepspeed.initialize(model=model, config=cfg)
            for s in range(STEPS):
                loss = loss_of(eng, batch(s)[rank * per : (rank + 1) * per])
                eng.backward(loss)
                eng.step()
            import deepspeed

            params = list(eng.module.named_parameters())
            with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=engine == "zero3"):
                final = {n: p.detach().clone() for n, p in params}
            return final, rows(opt.describe())
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        opt = shardopt.create_optimizer(model, name, **HP)
    for s in range(STEPS):
        # the mean over the global batch: each rank's mean, averaged by FSDP2's reduce-scatter
        loss_of(model, batch(s)[rank * per : (rank + 1) * per]).backward()
        opt.step()
        opt.zero_grad()
    final = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return final, rows(opt.describe())


def case(engine: str, name: str) -> dict:
    want, want_rows = one_process(name)
    got, got_rows = on_engine(engine, name)
    diff = max((got[n].float() - want[n]).abs().max().item() for n in want)
    return {"max_abs_diff": diff, "rows": got_rows, "reference_rows": want_rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--optimizers", required=True)
    ap.add_argument("--engines", default=",".join(ENGINES))
    args = ap.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed("gloo", timeout=timedelta(seconds=180))
    records: list = []
    for name in args.optimizers.split(","):
        for engine in args.engines.split(","):
            record_case(records, {"optimizer": name, "engine": engine}, partial(case, engine, name))
    finish_worker(records, args.out)


if __name__ == "__main__":
    from launch import settle_heap

    settle_heap()
    main()
