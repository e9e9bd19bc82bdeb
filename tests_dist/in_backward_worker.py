"""Stepping in backward (issue 62) on DDP and FSDP2 at any world size: ``create_optimizer(...,
step_in_backward=True)`` against the single process's ordinary step on the whole global batch, and bf16 weights
with stochastic rounding on FSDP2 shards against the whole matrices rounded in one process.

Each rank trains ``ToyLM`` (2 blocks, so groups complete one layer at a time in backward) on its share of each
step's global batch for ``STEPS`` steps; rank 0 writes one record per case: the largest difference to the
reference, and that the step after backward found nothing left (every gradient freed). At world size 3 FSDP2's
dim-0 shards are uneven (padded: the 5-row ``l1`` splits 2/2/1) and the 2-row ``wide`` leaves a rank empty. DDP
over each half of the ranks checks that the communication hook reduces over DDP's own group.

The bf16 cases (``bf16_training``) train a bf16 ToyLM in backward with ``bf16_updates="stochastic"`` and check
two levels. (1) Every rounding the driver does on a shard writes the bits that rounding the whole fp32 matrix
(assembled from the shards) in one process writes: a spy on ``stochastic_round_`` records each call's fp32 input
and bf16 output. That must hold whatever the gradients. (2) The final bf16 weights equal the single process's
bit for bit, where the ranks' gradient is the single process's: every rank takes the whole batch and FSDP2
reduces in fp32 (the mean of identical bf16 gradients is then exact). With each rank on its own share the
gradients differ from the whole batch's in their bf16 rounding (each rank's bf16 gradient of its share, summed),
so the weights differ too; the record counts by how much (``bf16_split``), which the test reports.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from datetime import timedelta
from functools import lru_cache, partial
from typing import Iterator

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from parity_worker import options  # noqa: E402
from tiers import selected  # noqa: E402
from toy_models import GLOBAL_BATCH, batch, loss_fn, make_model  # noqa: E402

import shardopt  # noqa: E402
import shardopt.optim.in_backward as in_backward  # noqa: E402
from launch import finish_worker, max_abs_diff, record_case  # noqa: E402
from shardopt.sharding.stochastic_round import logical_index_offsets, stochastic_round_  # noqa: E402

STEPS = 3
N_BLOCKS = 2
ENGINES = ("ddp", "fsdp2")
RULES = ("scale", "sinkgd", "racs", "swan", "asgo", "dasgo", "sumo", "alice", "alice0", "muon")
#: CI runs these (an LM-head momentum, row/column state, a whole-matrix basis with collectives)
CI_RULES = ("scale", "sumo")
#: the bf16 run: SCALE (no state for hidden matrices: the weights carry the whole run), 5 steps at lr 1e-2
BF16_RULE, BF16_STEPS, BF16_LR, BF16_SEED = "scale", 5, 1e-2, 11
#: the bf16 runs: every rank the whole batch (same gradient as one process), or each rank its share
BF16_BATCHES = ("whole", "split")


@lru_cache(maxsize=None)
def reference(opt_name: str) -> dict[str, torch.Tensor]:
    model = make_model(n_blocks=N_BLOCKS)
    opt = shardopt.create_optimizer(model, opt_name, **options(opt_name))
    for s in range(STEPS):
        opt.zero_grad()
        loss_fn(model, batch(s)).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def shard(model: torch.nn.Module, **kw) -> None:
    """FSDP2 over every rank: each block, then the rest (as a trainer wraps a transformer)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()
    }


def run(opt_name: str, engine: str) -> dict:
    model = make_model(n_blocks=N_BLOCKS)
    if engine == "fsdp2":
        shard(model)
        wrapped = model
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model)
    kw = {k: v for k, v in options(opt_name).items() if k != "on_nonfinite"}
    opt = shardopt.create_optimizer(wrapped, opt_name, step_in_backward=True, **kw)
    ws, rank = dist.get_world_size(), dist.get_rank()
    per = GLOBAL_BATCH // ws
    left = 0
    for s in range(STEPS):
        x = batch(s)[rank * per : (rank + 1) * per]
        loss_fn(wrapped, x).backward()
        left += sum(p.grad is not None for p in model.parameters() if engine == "fsdp2")
        opt.step()
        opt.zero_grad()
    return {"max_abs_diff": max_abs_diff(full_weights(model), reference(opt_name)), "grads_left": left}


def ddp_in_a_subgroup() -> dict:
    """DDP over a subgroup (the ranks split in two halves, each half its own batches, as data parallelism inside
    pipeline or tensor parallelism): in backward equals the ordinary step of DDP over the same subgroup, so the
    communication hook reduces over DDP's group, not the whole world."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ws, rank = dist.get_world_size(), dist.get_rank()
    halves = [list(range(0, (ws + 1) // 2)), list(range((ws + 1) // 2, ws))]
    groups = [dist.new_group(ranks) for ranks in halves]  # every rank creates every group, in the same order
    half = 0 if rank in halves[0] else 1
    members = halves[half]
    per = GLOBAL_BATCH // len(members)
    got = {}
    for in_bwd in (True, False):
        model = make_model(n_blocks=N_BLOCKS)
        wrapped = DDP(model, process_group=groups[half])
        opt = shardopt.create_optimizer(wrapped, "scale", step_in_backward=in_bwd, on_nonfinite="ignore")
        for s in range(STEPS):
            x = batch(s + 100 * half)[members.index(rank) * per : (members.index(rank) + 1) * per]
            loss_fn(wrapped, x).backward()
            opt.step()
            opt.zero_grad()
        got[in_bwd] = full_weights(model)
    diff = torch.tensor([max_abs_diff(got[True], got[False])])
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return {"max_abs_diff": diff.item(), "grads_left": 0}


def rounding() -> dict:
    """A 37 x 22 fp32 matrix rounded into bf16 row and column shards (uneven at world sizes 3 and 4: 13/13/11
    rows, 8/8/6 columns) equals the whole matrix rounded in one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(3)
    w = torch.randn(37, 22, generator=g) * (1 + torch.rand(37, 22, generator=g) * 1e-2)
    whole = torch.empty(37, 22, dtype=torch.bfloat16)
    stochastic_round_(whole, w, logical_index_offsets(whole), 7, 11)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    diffs = []
    for dim in (0, 1):
        d = distribute_tensor(torch.zeros(37, 22, dtype=torch.bfloat16), mesh, [Shard(dim)])
        src = distribute_tensor(w, mesh, [Shard(dim)]).to_local()
        stochastic_round_(d.to_local(), src, logical_index_offsets(d), 7, 11)
        diffs.append((d.full_tensor().float() - whole.float()).abs().max().item())
    return {"max_abs_diff": max(diffs), "differs_from_nearest": bool((whole.float() != w.bfloat16().float()).any())}


@contextlib.contextmanager
def spy_on_rounding() -> Iterator[list[tuple]]:
    """Record each stochastic rounding the step driver does: (global offsets, fp32 input, bf16 output, step,
    seed), in call order (the same parameters in the same order on every rank)."""
    calls: list[tuple] = []
    original = in_backward.stochastic_round_

    def spy(dst: torch.Tensor, src: torch.Tensor, index_map, step: int, seed: int) -> None:
        original(dst, src, index_map, step, seed)
        calls.append((index_map[0], src.detach().clone(), dst.detach().clone(), step, seed))

    in_backward.stochastic_round_ = spy
    try:
        yield calls
    finally:
        in_backward.stochastic_round_ = original


def whole_roundings_differing(per_rank: list[list[tuple]]) -> tuple[int, int]:
    """(bf16 elements whose shard rounding differs from the whole matrix's, roundings checked): the i-th call of
    every rank assembled into the whole fp32 matrix and the bf16 shards, the matrix rounded in one piece."""
    if len({len(calls) for calls in per_rank}) != 1:
        raise AssertionError(f"ranks rounded different numbers of tensors: {[len(c) for c in per_rank]}")
    wrong = 0
    for parts in zip(*per_rank):
        if len({(step, seed) for _, _, _, step, seed in parts}) != 1:
            raise AssertionError(f"ranks rounded one tensor with different steps or seeds: {parts[0][3:]}")
        filled = [p for p in parts if p[1].numel()]
        dims = filled[0][1].dim()
        shape = [max(off[d] + src.shape[d] for off, src, *_ in filled) for d in range(dims)]
        src_whole, got = torch.zeros(shape), torch.zeros(shape, dtype=torch.bfloat16)
        covered = torch.zeros(shape, dtype=torch.int32)
        for off, src, dst, *_ in filled:
            where = tuple(slice(o, o + n) for o, n in zip(off, src.shape))
            src_whole[where], got[where] = src, dst
            covered[where] += 1
        if not bool((covered == 1).all()):
            raise AssertionError(f"the shards of a {shape} tensor do not cover it once: {covered.tolist()}")
        want = torch.empty(shape, dtype=torch.bfloat16)
        stochastic_round_(want, src_whole, logical_index_offsets(want), parts[0][3], parts[0][4])
        wrong += int((want.view(torch.int16) != got.view(torch.int16)).sum())
    return wrong, len(per_rank[0])


@lru_cache(maxsize=None)
def bf16_reference() -> dict[str, torch.Tensor]:
    """The bf16 run in one process: whole matrices, the ordinary step (through the same driver), whole batch."""
    model = make_model(n_blocks=N_BLOCKS).to(torch.bfloat16)
    opt = shardopt.create_optimizer(
        model, BF16_RULE, lr=BF16_LR, bf16_updates="stochastic", bf16_seed=BF16_SEED, on_nonfinite="ignore"
    )
    for s in range(BF16_STEPS):
        loss_fn(model, batch(s)).backward()
        opt.step()
        opt.zero_grad()
    return full_weights(model)


def bf16_training(batches: str) -> dict:
    """bf16 ToyLM stepped in backward with stochastic rounding: FSDP2 over the ranks (world size 1: the plain
    model), ``batches`` "whole" (every rank the global batch, gradients reduced in fp32) or "split" (each rank
    its share, FSDP2's default bf16 reduction)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    ws, rank = dist.get_world_size(), dist.get_rank()
    model = make_model(n_blocks=N_BLOCKS).to(torch.bfloat16)
    if ws > 1:
        reduce_dtype = torch.float32 if batches == "whole" else None
        shard(model, mp_policy=MixedPrecisionPolicy(reduce_dtype=reduce_dtype))
    opt = shardopt.create_optimizer(
        model, BF16_RULE, lr=BF16_LR, step_in_backward=True, bf16_updates="stochastic", bf16_seed=BF16_SEED
    )
    per = GLOBAL_BATCH // ws if batches == "split" else GLOBAL_BATCH
    with spy_on_rounding() as calls:
        for s in range(BF16_STEPS):
            loss_fn(model, batch(s)[rank * per : (rank + 1) * per] if batches == "split" else batch(s)).backward()
            opt.step()
            opt.zero_grad()
    gathered: list = [None] * ws
    dist.all_gather_object(gathered, calls)
    got, want = full_weights(model), bf16_reference()
    wrong, checked = whole_roundings_differing(gathered)
    differing = sum(int((got[n].view(torch.int16) != want[n].view(torch.int16)).sum()) for n in want)
    return {
        "weights_differing": differing,
        "weights": sum(w.numel() for w in want.values()),
        "max_abs_diff": max_abs_diff(got, want),
        "roundings": checked,
        "roundings_differing_from_whole": wrong,
        "all_bf16": all(w.dtype == torch.bfloat16 for w in got.values()),
    }


def plain_model_refused() -> dict:
    """A plain model under a process group of 2 or more (DDP's inner module): its parameters' hooks would step
    on this rank's gradient alone, so the mode refuses it and names the DDP wrapper."""
    try:
        shardopt.create_optimizer(make_model(n_blocks=N_BLOCKS), "scale", step_in_backward=True)
    except shardopt.ConfigError as err:
        return {"message": str(err)}
    return {"message": ""}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    ws = dist.get_world_size()
    records: list = []
    if ws > 1:  # DDP and FSDP2 against one process; at world size 1 there is nothing to reduce or shard
        for opt_name in selected(RULES, CI_RULES):
            for engine in ENGINES:
                record_case(records, {"optimizer": opt_name, "engine": engine}, partial(run, opt_name, engine))
        record_case(records, {"optimizer": "plain_model", "engine": "ddp"}, plain_model_refused)
        record_case(records, {"optimizer": "scale", "engine": "ddp_subgroup"}, ddp_in_a_subgroup)
    record_case(records, {"optimizer": "rounding", "engine": "fsdp2"}, rounding)
    for batches in BF16_BATCHES:
        record_case(records, {"optimizer": f"bf16_{batches}", "engine": "fsdp2"}, partial(bf16_training, batches))
    finish_worker(records, args.out)


if __name__ == "__main__":
    from launch import settle_heap

    settle_heap()
    main()
