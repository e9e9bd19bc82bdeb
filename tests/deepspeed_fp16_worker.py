"""One process, one GPU: DeepSpeed fp16 with dynamic loss scaling and a shardopt optimizer (tests/test_cuda.py).

python tests/deepspeed_fp16_worker.py NAME STAGE OUT.json
"""

from __future__ import annotations

import json
import logging
import sys

import torch


def main(name: str, stage: int, out: str) -> None:
    from deepspeed.utils import logger

    import shardopt.deepspeed as sds
    from shardopt.optim.base import ShardedOptimizer
    from shardopt.train.model import Llama, LlamaConfig

    logger.setLevel(logging.ERROR)
    torch.manual_seed(0)
    model = Llama(
        LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_heads=2, num_layers=2, max_seq_len=16)
    )
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": stage},
        "fp16": {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": 30,
            "loss_scale_window": 4,
            "hysteresis": 1,
            "min_loss_scale": 1,
        },
        "shardopt": {"optimizer": name, "params": {"lr": 3e-3}},
    }
    engine, _, _, _ = sds.initialize(model=model, config=config)
    inner = engine.optimizer
    while not isinstance(inner, ShardedOptimizer):  # DeepSpeed's ZeRO wrapper holds shardopt's optimizer
        inner = inner.optimizer
    calls = []
    real_step = inner.step
    inner.step = lambda *a, **k: (calls.append(1), real_step(*a, **k))[1]
    initial_scale = (
        engine.optimizer.cur_scale if hasattr(engine.optimizer, "cur_scale") else engine.optimizer.loss_scale
    )
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 96, (4, 17), generator=gen).to(engine.device)
    losses, steps, agree = [], 30, True
    for _ in range(steps):
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        skipped_before, calls_before = engine.skipped_steps, len(calls)
        engine.step()
        skipped = engine.skipped_steps > skipped_before
        agree &= skipped != (len(calls) > calls_before)
        losses.append(float(loss))
    counts = [int(st["step"]) for st in inner.state.values() if "step" in st]
    finite = all(bool(torch.isfinite(p.float()).all()) for p in engine.module.parameters())
    final_scale = engine.optimizer.cur_scale if hasattr(engine.optimizer, "cur_scale") else engine.optimizer.loss_scale
    rec = {
        "steps": steps,
        "skipped": int(engine.skipped_steps),
        "stepped_when_not_skipped": agree,
        "optimizer_step_count": max(counts) if counts else 0,
        "initial_scale": float(initial_scale),
        "final_scale": float(final_scale),
        "finite": finite,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "losses": losses,
    }
    print(json.dumps(rec))
    with open(out, "w") as f:
        json.dump(rec, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
