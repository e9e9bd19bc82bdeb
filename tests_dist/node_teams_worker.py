"""Node-aware teams on two loopback "nodes" of 2 ranks each (issue 53; gloo, world size 4).

The ranks see the environment torchrun gives ``launch/multinode.sh``'s processes with ``NNODES=2`` and
``NPROC_PER_NODE=2`` (``LOCAL_WORLD_SIZE=2``, ``LOCAL_RANK``, ``GROUP_RANK``: ranks 0-1 are node 0, 2-3 node 1),
and a CPU profile whose links inside a node are fast (``node_bandwidth_gbs``), as NVLink is beside the network.
SWAN and ASGO (tau = 1, the GPU's iterative routes forced, so ASGO's root is the checked float64 iteration)
on FSDP2 under ``auto`` and forced teams of 2. Per rank: the plan's teams and split roots, the whole-matrix
FLOPs (``sharding.op_census``) beside the single process's and the plan's own count, the bytes the collectives
move beside ``MatrixOps.modeled_payload`` (with the step count the split roots took), and the parameters after
the steps beside one process's.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import toy_models  # noqa: E402

import shardopt  # noqa: E402
from launch import finish_worker  # noqa: E402
from shardopt.sharding import iterative  # noqa: E402
from shardopt.sharding.op_census import OpCensus, census  # noqa: E402
from shardopt.sharding.state_split import moving_numel  # noqa: E402
from shardopt.sharding.teams import RowExchange  # noqa: E402

LM = toy_models.LMSetup(256, 64, 176, 2, 8, 16)  # 128 tokens a step: full-rank 64 x 64 Grams
PER_NODE = 2
PROFILE = {"base": "cpu", "node_bandwidth_gbs": 100, "node_latency_us": 5}
EXTRA = {"asgo": {"refresh_interval": 1}, "swan": {}}
STEPS = 3
TAGS = ("gather", "realign", "distributed", "state")


def as_node_ranks() -> None:
    """The environment of a two-node torchrun launch (``launch/multinode.sh``): 2 processes per node."""
    rank = dist.get_rank()
    os.environ.update(LOCAL_WORLD_SIZE=str(PER_NODE), LOCAL_RANK=str(rank % PER_NODE), GROUP_RANK=str(rank // PER_NODE))


def full(model) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        t = p.detach()
        out.append(t.full_tensor() if hasattr(t, "full_tensor") else t.clone())
    return out


def run(name: str, strategy: str | None) -> dict:
    torch.manual_seed(0)
    model = LM.model()
    kw = dict(EXTRA[name])
    if strategy is not None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        kw["matrix_ops"] = {
            "strategy": strategy,
            "profile": PROFILE,
            **({"team_size": 2} if strategy == "team" else {}),
        }
    opt = shardopt.create_optimizer(model, name, **kw)
    work = OpCensus()
    timing = opt.whole_matrix_timing

    @contextlib.contextmanager
    def counted():
        with timing(), census(work):
            yield

    opt.whole_matrix_timing = counted
    rec: dict = {"bytes": [], "seen_steps": []}
    for s in range(STEPS):
        opt.zero_grad()
        LM.loss(model, LM.batch(s)).backward()
        opt.comm_stats(reset=True)
        RowExchange.seen_steps = 0
        opt.step()
        stats = opt.comm_stats(reset=True)
        rec["bytes"].append({t: float(stats.get(t, {}).get("bytes", 0)) for t in TAGS})
        rec["seen_steps"].append(RowExchange.seen_steps)
    rec["flops"] = work.flops / STEPS
    rec["params"] = [p.tolist() for p in full(model)]
    if strategy is None:
        return rec
    rec["predicted"] = [dict.fromkeys(TAGS, 0.0) for _ in range(STEPS)]
    rec["teams"], rec["split"], rec["kinds"] = [], [], []
    planned, whole = 0.0, 0.0
    groups = opt._groups()
    for g in range(len(groups)):
        ops = opt.matrix_plan(g)
        if ops is None:
            continue

        def share(i: int, rank: int, ops=ops, group=groups[g]) -> float:
            return moving_numel(ops.placements[i], opt.matrix_state_spec(group, ops.plans[i].a_shape), rank)

        for step, seen in enumerate(rec["seen_steps"]):  # the bytes of a split root follow its step count
            for tag, b in ops.modeled_payload(state_share=share, steps=seen or None).items():
                rec["predicted"][step][tag] += b
        rec["teams"] += [list(t) if t else None for t in ops.teams]
        rec["split"] += list(ops.split_roots)
        rec["kinds"] += list(ops.kinds)
        planned += sum(ops._make_flop_totals().values())
        whole += sum(c.row_flops + c.small_matmul + c.small_flops for c in ops.costs)
    rec["planned_flops"], rec["whole_planned_flops"] = planned, whole
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="asgo:team,swan:team,asgo:auto")
    args = ap.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    as_node_ranks()
    records = []
    with iterative.forced(True):
        for case in args.cases.split(","):
            name, strategy = case.split(":")
            rec = {"optimizer": name, "strategy": strategy}
            try:
                single = run(name, None)
                rec["single_flops"], rec["single_params"] = single["flops"], single["params"]
                with contextlib.redirect_stdout(io.StringIO()):
                    got = run(name, strategy)
                ranks: list = [None] * dist.get_world_size()
                dist.all_gather_object(ranks, got)
                rec["ranks"] = ranks
            except Exception:
                rec["error"] = traceback.format_exc()
            records.append(rec)
            dist.barrier()
    finish_worker(records, args.out)


if __name__ == "__main__":
    from launch import settle_heap

    settle_heap()
    main()
