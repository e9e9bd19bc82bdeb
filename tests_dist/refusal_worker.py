"""Refusals (issue 28): what the DeepSpeed adapter cannot express yet fails with one clear error on every rank,
before DeepSpeed builds its engine: a routing pattern that matches on no pipeline stage, and a
``deepspeed.moe.layer.MoE`` layer whose experts are split by tensor parallelism. DeepSpeed keys that shardopt does
not own reach DeepSpeed, whose own validation answers (issue 65). (Pipeline stages that form
different numbers of param groups were refused here until issue 45; they train now: ``test_pipeline_llm.py``.) Rank 0
writes, per case, the error type and message every rank saw."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from datetime import timedelta

import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
import shardopt  # noqa: E402
from launch import finish_worker  # noqa: E402

CONFIG = {
    "train_batch_size": 4,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_clipping": 0.0,
    "zero_optimization": {"stage": 1},
    "shardopt": {"optimizer": "scale"},
}


def pipeline() -> nn.Module:
    from deepspeed.pipe import PipelineModule

    return PipelineModule(
        [nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)], num_stages=2, loss_fn=lambda out, y: (out - y).square().mean()
    )


#: the routing of each case (None: the config's)
ROUTING = {"pipeline_routing": {"9.*": "matrix"}}


def moe() -> nn.Module:
    from deepspeed.moe.layer import MoE

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(8, 8)
            self.moe = MoE(
                hidden_size=8, expert=nn.Linear(8, 8), num_experts=2, ep_size=2, enable_expert_tensor_parallelism=True
            )

        def forward(self, x):
            return self.moe(self.inp(x))[0]

    return Model()


class NotOnMeta(nn.Linear):
    """A layer whose construction reads its weight's values (fails on the meta device)."""

    def __init__(self):
        super().__init__(8, 8)
        float(self.weight.sum())


def pipeline_unbuildable() -> nn.Module:
    from deepspeed.pipe import LayerSpec, PipelineModule

    return PipelineModule(
        [LayerSpec(nn.Embedding, 30, 8), LayerSpec(NotOnMeta), LayerSpec(nn.Linear, 8, 30)],
        num_stages=2,
        partition_method="uniform",
        loss_fn=lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()),
    )


def fallback_warning() -> dict:
    """Layer specs that cannot be built on the meta device: each stage's own roles, and one warning on every rank
    naming, on the last stage, the Linear that would be the LM head."""
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        shardopt.deepspeed.initialize(model=pipeline_unbuildable(), config=dict(CONFIG, shardopt={"optimizer": "racs"}))
    messages = [str(w.message) for w in seen if "meta device" in str(w.message)]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, messages)
    return {"case": "pipeline_unbuildable", "warnings": every}


#: DeepSpeed's own keys, which shardopt passes through (issue 65): each case's zero_optimization
DEEPSPEED_KEYS = {
    "zero_future_key": {"stage": 1, "some_future_key": 1},
    "zero_mics": {"stage": 3, "mics_shard_size": 2},
}


def deepspeed_keys() -> list[dict]:
    """``zero_optimization`` keys shardopt does not own reach ``deepspeed.initialize``: the error every rank sees
    is DeepSpeed's own (its ZeRO model's, its removed-feature message)."""
    records = []
    for case, zero in DEEPSPEED_KEYS.items():
        try:
            shardopt.deepspeed.initialize(model=nn.Linear(8, 8), config=dict(CONFIG, zero_optimization=zero))
            error = None
        except Exception as err:
            error = f"{type(err).__module__}.{type(err).__name__}: {err}"
        seen: list = [None] * dist.get_world_size()
        dist.all_gather_object(seen, error)
        records.append({"case": case, "error": error, "every_rank": seen})
    return records


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # PipelineModule reads DeepSpeed's process topology
    records = []
    for case, build in (("pipeline_routing", pipeline), ("moe_expert_tp", moe)):
        rec = {"case": case}
        config = dict(CONFIG, shardopt={"optimizer": "scale", "routing": ROUTING.get(case, {})})
        try:
            shardopt.deepspeed.initialize(model=build(), config=config)
            rec["error"] = None
        except Exception as err:  # what every rank saw
            rec["error"] = f"{type(err).__name__}: {err}"
        seen: list = [None] * dist.get_world_size()
        dist.all_gather_object(seen, rec["error"])
        rec["every_rank"] = seen
        records.append(rec)
    records.extend(deepspeed_keys())
    records.append(fallback_warning())
    finish_worker(records, args.out)


if __name__ == "__main__":
    from launch import settle_heap

    settle_heap()
    main()
