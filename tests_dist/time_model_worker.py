"""Time-model worker (issue 27): what the whole-matrix plans predict against what the ranks really do.

Every whole-matrix optimizer under ``strategy="auto"`` (the CPU profile: the parameters are on the CPU),
``"distributed"`` (row realignment, reduced small matrices, shared factorizations, resting state) and
``"team"`` (teams of two ranks: pieces to the members, reductions and state among them) on FSDP2 and ZeRO-2
at this world size. Per rank and step: the bytes shardopt's collectives really hand to gloo
(``comm_stats``, by tag) beside the plan's prediction (``MatrixOps.modeled_payload``), and the FLOPs this
rank runs inside whole-matrix work (counted by ``sharding.op_census``) beside the single-process run's. The model is a
SmallLM whose matrices (256 x 256 and 704 x 256, 4 blocks) make whole-matrix work, not Python, the bulk of
a step. SUMO and Alice refresh at the first step only (interval 100): the compared steps are those between
refreshes; the refresh step's bytes are recorded beside them with the plans' prediction for a refresh step.
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
from shardopt.sharding.op_census import OpCensus, census  # noqa: E402
from shardopt.sharding.state_split import moving_numel  # noqa: E402

LM = toy_models.LMSetup(256, 256, 704, 4, 8, 4)  # vocab, dim, ffn, blocks, seq, batch
BATCH = LM.batch_size
OPTIMIZERS = ("muon", "swan", "asgo", "sumo", "alice", "alice0")
EXTRA = {
    "sumo": {"rank": 64, "refresh_interval": 100},
    "alice": {"rank": 64, "leading": 4, "refresh_interval": 100},
    "alice0": {"rank": 64, "leading": 4, "refresh_interval": 100},
}
TAGS = ("gather", "realign", "distributed", "state")
#: auto (what the model picks for this size under the CPU profile), and each path forced: row realignment with
#: reduced small matrices, and teams of two ranks (pieces to the members, reductions among them)
STRATEGIES = ("auto", "distributed", "team")
MEASURED_STEPS = 5


def predicted(opt, refresh: bool = False) -> dict[str, float]:
    """The plans' bytes per tag for this rank (each matrix's resting state cut as the optimizer cuts it; of it a
    step gathers all but the ``ROWS`` state, which stays with its rows); ``refresh``: at a step where every
    matrix refreshes."""
    out = dict.fromkeys(TAGS, 0.0)
    groups = opt._groups()
    for g in range(len(groups)):
        ops = opt.matrix_plan(g)
        if ops is None:
            continue

        def state_share(i: int, rank: int, ops=ops, group=groups[g]) -> float:
            return moving_numel(ops.placements[i], opt.matrix_state_spec(group, ops.plans[i].a_shape), rank)

        for tag, b in ops.modeled_payload(state_share=state_share, refresh=refresh).items():
            out[tag] += b
    return out


def measured(opt) -> dict[str, float]:
    stats = opt.comm_stats(reset=True)
    return {tag: float(stats.get(tag, {}).get("bytes", 0)) for tag in TAGS}


def count_whole_matrix_work(opt) -> OpCensus:
    """From now on, the FLOPs this rank runs inside the optimizer's whole-matrix work (``op_census``)."""
    work, timing = OpCensus(), opt.whole_matrix_timing

    @contextlib.contextmanager
    def counted():
        with timing(), census(work):
            yield

    opt.whole_matrix_timing = counted
    return work


def run(name: str, engine: str | None, strategy: str = "auto") -> dict:
    """Steps 1 (plans, state, refreshes) and 2..1+MEASURED_STEPS: bytes per step and whole-matrix FLOPs."""
    torch.manual_seed(0)
    model = LM.model()
    kw = dict(
        EXTRA.get(name, {}), matrix_ops={"strategy": strategy, **({"team_size": 2} if strategy == "team" else {})}
    )
    if engine == "zero2":
        config = {
            "train_batch_size": BATCH * dist.get_world_size(),
            "train_micro_batch_size_per_gpu": BATCH,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": 2},
            "shardopt": {"optimizer": name, "params": kw},
        }
        eng, _, _, _ = shardopt.deepspeed.initialize(model=model, config=config)
        opt = eng.optimizer.optimizer

        def step(s: int) -> None:
            eng.backward(LM.loss(eng, LM.batch(s)))
            eng.step()
    else:
        if engine == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for b in model.blocks:
                fully_shard(b, mesh=mesh)
            fully_shard(model, mesh=mesh)
        opt = shardopt.create_optimizer(model, name, **kw)

        def step(s: int) -> None:
            opt.zero_grad()
            LM.loss(model, LM.batch(s)).backward()
            opt.step()

    opt.comm_stats(reset=True)
    step(0)
    rec = {"refresh_bytes": measured(opt)}
    rec["bytes"] = []
    work = count_whole_matrix_work(opt)
    for s in range(1, 1 + MEASURED_STEPS):
        step(s)
        rec["bytes"].append(measured(opt))
    rec["flops"] = work.flops / MEASURED_STEPS
    rec["predicted"] = predicted(opt)
    rec["predicted_refresh"] = predicted(opt, refresh=True)
    rec["kinds"] = sorted(
        {k for g in range(len(opt._groups())) if opt.matrix_plan(g) is not None for k in opt.matrix_plan(g).kinds}
    )
    return rec


def single_run(name: str) -> dict:
    """The single-process run's whole-matrix FLOPs per step (``single_flops``), or its traceback (``error``)."""
    try:
        return {"single_flops": run(name, None)["flops"]}
    except Exception:
        return {"error": "the single-process run failed:\n" + traceback.format_exc()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    args = ap.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    names = args.optimizers.split(",")
    # the single-process FLOPs each optimizer's division of work is measured against (the auto cases): one run
    # per optimizer, in rank 0 before any process group (a run inside one is an all-reduce on every rank, and the
    # same count on each), while the other ranks wait in the rendezvous
    single = {name: single_run(name) for name in names} if int(os.environ["RANK"]) == 0 else {}
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    records = []
    for name in names:
        for engine, strategy in [(e, s) for e in ("fsdp2", "zero2") for s in STRATEGIES]:
            rec = {"optimizer": name, "engine": engine, "strategy": strategy}
            if strategy == "auto":  # the case whose division of work the test checks
                rec.update(single.get(name, {}))
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    result = run(name, engine, strategy)
                got: list = [None] * dist.get_world_size()
                dist.all_gather_object(got, result)
                rec["ranks"] = got
            except Exception:
                rec["error"] = traceback.format_exc()
            records.append(rec)
            dist.barrier()
    finish_worker(records, args.out)


if __name__ == "__main__":
    from launch import settle_heap

    settle_heap()
    main()
