"""More engines vs the single-process run: torch ZeroRedundancyOptimizer and fairscale OSS (whole parameters
per rank), and Megatron-core tensor parallelism (TP=2 x DP=2 and TP=4 at world size 4)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import sys
import traceback
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from parity_worker import OPTIMIZERS, STEPS, local_batch, reference  # noqa: E402
from toy_models import loss_fn, make_model  # noqa: E402

import shardopt  # noqa: E402
from launch import finish_worker  # noqa: E402
from shardopt.optim.registry import OPTIMIZERS as REGISTRY  # noqa: E402


def whole_param_sharder(opt_name: str, kind: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model()
    ddp = DDP(model)
    groups = shardopt.param_groups(model, opt_name, **OPTIMIZERS[opt_name])
    cls = REGISTRY[opt_name]
    if kind == "zero_redundancy":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(groups, optimizer_class=cls)
    else:
        from fairscale.optim import OSS

        opt = OSS(groups, optim=cls)
    for s in range(STEPS):
        opt.zero_grad()
        loss_fn(ddp, local_batch(s)).backward()
        opt.step()
    if kind == "zero_redundancy":
        opt.consolidate_state_dict(to=0)
    else:
        opt.consolidate_state_dict(recipient_rank=0)
    consolidated = opt.state_dict() if dist.get_rank() == 0 else None
    ref, _ = reference(opt_name)
    diff = max((p.detach() - ref[n]).abs().max().item() for n, p in model.named_parameters())
    return {"max_abs_diff": diff, "consolidated_states": None if consolidated is None else len(consolidated["state"])}


# ------------------------------------------------------------------------------------------ Megatron TP
V, D, H = 16, 8, 12


class PlainTP(nn.Module):
    """The unsplit reference of ``MegatronTP``."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)
        self.norm = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)

    def forward(self, x):
        h = self.embed(x)
        h = h + self.down(torch.tanh(self.up(h)))
        return self.lm_head(self.norm(h))


class MegatronTP(nn.Module):
    def __init__(self, plain: PlainTP):
        super().__init__()
        from megatron.core import ModelParallelConfig
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

        cfg = ModelParallelConfig(
            tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
            use_cpu_initialization=True,
            perform_initialization=True,
            params_dtype=torch.float32,
        )
        init = nn.init.zeros_
        self.embed = VocabParallelEmbedding(V, D, init_method=init, config=cfg)
        self.up = ColumnParallelLinear(D, H, config=cfg, init_method=init, bias=True, gather_output=False)
        self.down = RowParallelLinear(
            H, D, config=cfg, init_method=init, bias=True, input_is_parallel=True, skip_bias_add=False
        )
        self.norm = nn.LayerNorm(D)
        # gather_output=True allocates on CUDA in megatron-core 0.16; gather the vocab shards ourselves
        self.lm_head = ColumnParallelLinear(D, V, config=cfg, init_method=init, bias=False, gather_output=False)
        self.tp_group = ps.get_tensor_model_parallel_group()
        with torch.no_grad():
            for name, p in self.named_parameters():
                full = dict(plain.named_parameters())[name]
                if getattr(p, "tensor_model_parallel", False):
                    tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
                    p.copy_(full.chunk(tp, dim=p.partition_dim)[r])
                else:
                    p.copy_(full)

    def forward(self, x):
        h = self.embed(x)
        h = h + self.down(torch.tanh(self.up(h)[0]))[0]
        return _GatherVocab.apply(self.lm_head(self.norm(h))[0], self.tp_group)


class _GatherVocab(torch.autograd.Function):
    """All-gather vocab shards of the logits; every TP rank then computes the same loss, so the gradient of
    a rank's shard is its own slice (no reduction), as in Megatron's gather_from_tensor_model_parallel_region."""

    @staticmethod
    def forward(ctx, local, group):
        ctx.group = group
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        tp = dist.get_world_size(ctx.group)
        return grad.chunk(tp, dim=-1)[dist.get_rank(ctx.group)].contiguous(), None


def tp_loss(model, tokens):
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.flatten(0, 1), torch.roll(tokens, -1, 1).flatten())


def tp_batch(step):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, V, (8, 5), generator=g)


def megatron_tp(opt_name: str, tp: int) -> dict:
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        torch.manual_seed(0)
        plain = PlainTP()
        model = MegatronTP(plain)
        kw = {k: v for k, v in OPTIMIZERS[opt_name].items() if k != "routing"}
        routing = {"embed.weight": "matrix", "lm_head.weight": "matrix"} if opt_name != "scale" else None
        opt = shardopt.create_optimizer(model, opt_name, routing=routing, **kw)
        ref_opt = shardopt.create_optimizer(plain, opt_name, routing=routing, **kw)
        dp_group, dp = ps.get_data_parallel_group(), ps.get_data_parallel_world_size()
        dp_rank = ps.get_data_parallel_rank()
        for s in range(STEPS):
            x = tp_batch(s)
            per = x.shape[0] // dp
            opt.zero_grad()
            tp_loss(model, x[dp_rank * per : (dp_rank + 1) * per]).backward()
            for p in model.parameters():  # data-parallel gradient averaging
                dist.all_reduce(p.grad, group=dp_group)
                p.grad /= dp
            opt.step()
            ref_opt.zero_grad()
            tp_loss(plain, x).backward()
            ref_opt.step()
        diff = 0.0
        tp_group = ps.get_tensor_model_parallel_group()
        for name, p in model.named_parameters():
            full = p.detach()
            if getattr(p, "tensor_model_parallel", False):
                parts = [torch.empty_like(full) for _ in range(tp)]
                dist.all_gather(parts, full.contiguous(), group=tp_group)
                full = torch.cat(parts, dim=p.partition_dim)
            diff = max(diff, (full - dict(plain.named_parameters())[name].detach()).abs().max().item())
        roles = {g["treatment"] for g in opt.param_groups}
        return {"max_abs_diff": diff, "treatments": sorted(roles)}
    finally:
        ps.destroy_model_parallel()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--megatron", action="store_true")
    args = ap.parse_args()
    logging.getLogger().setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    records = []
    cases = [("zero_redundancy", o, None) for o in OPTIMIZERS] + [("oss", o, None) for o in OPTIMIZERS]
    if args.megatron:
        cases = [("megatron", o, tp) for o in OPTIMIZERS for tp in (2, 4)]
    for kind, opt_name, tp in cases:
        rec = {"kind": kind, "optimizer": opt_name, "tp": tp, "world_size": dist.get_world_size()}
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                rec.update(megatron_tp(opt_name, tp) if kind == "megatron" else whole_param_sharder(opt_name, kind))
        except Exception:
            rec["error"] = traceback.format_exc()
            print(f"rank {dist.get_rank()}: {rec['error']}", file=sys.stderr, flush=True)
        records.append(rec)
        if dist.get_rank() == 0:
            print(json.dumps(rec), flush=True)
        dist.barrier()
    finish_worker(records, args.out)


if __name__ == "__main__":
    from launch import settle_heap

    settle_heap()
    main()
