"""DeepSpeed pipeline parallelism worker (issue 28, item 2): ``deepspeed.pipe.PipelineModule`` on 2 stages x 2
data-parallel ranks (ZeRO-1 and ZeRO-2; world size 4), gradient accumulation 2, against one process training
the same layers as an ``nn.Sequential`` (the same parameter names) on the same global batch.

Each stage's optimizer holds only that stage's matrices and reduces over the stage's data-parallel group
(DeepSpeed's ``real_dp_process_group``); owners and teams are chosen inside it. After ``STEPS`` steps every
rank reports the largest difference of its stage's parameters from the reference, then the run is saved
(``engine.save_checkpoint``: DeepSpeed's files per stage and shardopt's logical state), loaded into a fresh
engine and continued for ``STEPS`` more steps, against the reference trained ``2 x STEPS`` steps.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
import shardopt  # noqa: E402
from launch import finish_worker, record_case  # noqa: E402

VOCAB, DIM, HIDDEN, SEQ = 13, 12, 20, 9
MICRO, ACCUM, DP = 2, 2, 2
GLOBAL = MICRO * ACCUM * DP
STEPS = 3
#: the issue's optimizers; whole-matrix ones under each strategy that moves data differently
CASES = [
    ("scale", None),
    ("racs", None),
    ("sumo", "gather"),
    ("sumo", "distributed"),
    ("alice", "gather"),
    ("alice", "distributed"),
    ("asgo", "gather"),
    ("asgo", "distributed"),
]
MATRIX = {"0.weight": "matrix", "5.weight": "matrix"}  # embedding and head take the matrix rule too
OPTIONS = {
    "scale": dict(lr=3e-3, adam_lr=3e-3, routing={"5.weight": "lm_head"}),  # the head: its stage has no embedding
    "racs": dict(lr=0.05, routing=MATRIX),
    "sumo": dict(lr=0.02, rank=2, refresh_interval=2, routing=MATRIX),
    "alice": dict(lr=0.02, rank=3, leading=1, refresh_interval=2, routing=MATRIX),
    "asgo": dict(lr=0.01, refresh_interval=2, routing=MATRIX),
}


class Head(nn.Linear):
    """The LM head (no bias) on a pipeline stage: logits flattened for the loss."""

    def __init__(self):
        super().__init__(DIM, VOCAB, bias=False)


def layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Embedding(VOCAB, DIM),
        nn.Linear(DIM, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, DIM),
        nn.LayerNorm(DIM),
        Head(),
    ]


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def options(name: str, strategy: str | None) -> dict:
    kw = dict(OPTIONS[name])
    if strategy is not None:
        kw["matrix_ops"] = {"strategy": strategy}
    return kw


def reference(name: str, strategy: str | None, steps: int) -> dict[str, torch.Tensor]:
    model = nn.Sequential(*layers())
    opt = shardopt.create_optimizer(model, name, **options(name, strategy))
    for s in range(steps):
        tokens, labels = global_batch(s)
        opt.zero_grad()
        loss_fn(model(tokens), labels).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def micro_batches(step: int, dp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This data-parallel rank's ``ACCUM`` micro-batches of the step (a contiguous share of the global batch)."""
    tokens, labels = global_batch(step)
    per = GLOBAL // DP
    t, y = tokens[dp_rank * per : (dp_rank + 1) * per], labels[dp_rank * per : (dp_rank + 1) * per]
    return list(zip(t.chunk(ACCUM), y.chunk(ACCUM)))


def engine(name: str, strategy: str | None, stage: int):
    from deepspeed.pipe import PipelineModule

    model = PipelineModule(layers=layers(), num_stages=2, loss_fn=loss_fn, partition_method="uniform")
    kw = options(name, strategy)
    config = {
        "train_batch_size": GLOBAL,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "shardopt": {
            "optimizer": name,
            "params": {k: v for k, v in kw.items() if k != "routing"},
            "routing": kw.get("routing", {}),
        },
    }
    eng, _, _, _ = shardopt.deepspeed.initialize(model=model, config=config)
    return eng


def train(eng, first: int, steps: int) -> None:
    dp_rank = eng.grid.get_data_parallel_rank()
    for s in range(first, first + steps):
        eng.train_batch(data_iter=iter(micro_batches(s, dp_rank)))


def stage_params(eng) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in eng.module.named_parameters()}


def diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Largest difference over this rank's stage parameters, the most over all ranks."""
    worst = max((float((p - want[n]).abs().max()) for n, p in got.items()), default=0.0)
    t = torch.tensor(worst, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def case(name: str, strategy: str | None, stage: int, ckpt_root: str) -> dict:
    eng = engine(name, strategy, stage)
    train(eng, 0, STEPS)
    out = {
        "max_abs_diff": diff(stage_params(eng), reference(name, strategy, STEPS)),
        "stage_params": sorted(n for n, _ in eng.module.named_parameters()),
    }
    eng.save_checkpoint(ckpt_root, tag="pp")
    resumed = engine(name, strategy, stage)
    resumed.load_checkpoint(ckpt_root, tag="pp")
    train(resumed, STEPS, STEPS)
    out["resume_max_abs_diff"] = diff(stage_params(resumed), reference(name, strategy, 2 * STEPS))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default=None, help="comma-separated optimizer[:strategy] (default: all)")
    args = ap.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    import deepspeed

    deepspeed.init_distributed("gloo", timeout=timedelta(seconds=180))  # PipelineModule asks deepspeed.comm
    cases = CASES if args.cases is None else [(c.split(":") + [None])[:2] for c in args.cases.split(",")]
    records = []
    for name, strategy in cases:
        for stage in (1,):  # DeepSpeed runs pipelines under ZeRO-0/1 only
            rec = {
                "optimizer": name,
                "strategy": strategy,
                "engine": f"zero{stage}_pp2",
                "world_size": dist.get_world_size(),
            }
            root = [tempfile.mkdtemp(prefix="shardopt_pp_") if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(root, src=0)
            record_case(records, rec, partial(case, name, strategy, stage, root[0]))
    finish_worker(records, args.out)


if __name__ == "__main__":
    from launch import settle_heap

    settle_heap()
    main()
