"""Tensor parallelism on DTensor meshes (issue 28): FSDP2 x TP on a 2 x 2 ("dp", "tp") mesh and TP alone.

The model is an MLP of two blocks, each a column-parallel ``up`` (64 x 16) and a row-parallel ``down``
(16 x 64) (``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` on "tp"), a LayerNorm and a
column-parallel head, then ``fully_shard`` of every block on "dp": the weights are DTensors over both mesh
dimensions (``_StridedShard`` on "dp" over ``Shard(0)`` on "tp" for the column-parallel ones, ``Shard(0)`` x
``Shard(1)`` for the row-parallel ones, ``Shard(0)`` x ``Replicate`` for the biases of row-parallel layers and
the norm). Ranks of one "dp" coordinate see the same samples. For each optimizer and strategy: 3 steps, every
parameter compared with the single-process run on the whole batch; rank 0 writes one record per case.
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
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
import shardopt  # noqa: E402
from launch import finish_worker, max_abs_diff, record_case  # noqa: E402

GLOBAL = 8
SEQ = 4
STEPS = 3
DIM, HIDDEN, OUT = 16, 64, 32
MATRICES = ("blocks.0.up.weight", "blocks.0.down.weight", "blocks.1.up.weight", "blocks.1.down.weight", "head.weight")
OPTIMIZERS = {
    "scale": dict(lr=3e-3),
    "racs": dict(lr=0.05),
    "sumo": dict(lr=0.02, rank=4, refresh_interval=2),
    "alice": dict(lr=0.02, rank=4, leading=1, refresh_interval=2),
    "asgo": dict(lr=0.01, refresh_interval=2),
}
WHOLE = ("sumo", "alice", "asgo")
STRATEGIES = ("gather", "team", "distributed")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.tanh(self.up(h)))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, OUT, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def make_model() -> MLP:
    torch.manual_seed(0)
    return MLP()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL, SEQ, DIM, generator=g), torch.randn(GLOBAL, SEQ, OUT, generator=g)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).square().mean()


def options(name: str, strategy: str | None) -> dict:
    kw = dict(OPTIMIZERS[name], routing={n: "matrix" for n in MATRICES})
    if strategy is not None:
        kw["matrix_ops"] = {"strategy": strategy, **({"team_size": 2} if strategy == "team" else {})}
    return kw


def reference(name: str, strategy: str | None) -> dict[str, torch.Tensor]:
    model = make_model()
    opt = shardopt.create_optimizer(model, name, **options(name, strategy))
    for s in range(STEPS):
        opt.zero_grad()
        loss_fn(model(batch(s)[0]), batch(s)[1]).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def parallelize(model: MLP, mesh, sequence: bool = False) -> None:
    """Megatron-style TP; with ``sequence`` also sequence parallelism (torchtitan's plan): activations between
    the blocks stay cut along the sequence, the LayerNorm runs on its sequence shard (``SequenceParallel``,
    whose gradients DTensor leaves partial)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    seq = {"input_layouts": Shard(1)} if sequence else {}
    plan = {}
    for i in range(len(model.blocks)):
        plan[f"blocks.{i}.up"] = ColwiseParallel(**seq)
        plan[f"blocks.{i}.down"] = RowwiseParallel(**({"output_layouts": Shard(1)} if sequence else {}))
    if sequence:
        plan["norm"] = SequenceParallel()
    plan["head"] = ColwiseParallel(output_layouts=Replicate(), **seq)  # the whole output on every rank
    parallelize_module(model, mesh, plan)


def build(name: str, strategy: str | None, layout: str):
    """The model on ``layout``, its optimizer, and this rank's share of the batch (dp size, dp rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    ws = dist.get_world_size()
    if layout == "fsdp2_tp":
        mesh = init_device_mesh("cpu", (ws // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize(model, mesh["tp"])
        for b in model.blocks:
            fully_shard(b, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    elif layout == "hsdp_tp":  # 2 x 2 x 2: replicas of an FSDP2 x TP model (HSDP's Replicate x Shard on "rep", "dp")
        mesh = init_device_mesh("cpu", (2, ws // 4, 2), mesh_dim_names=("rep", "dp", "tp"))
        parallelize(model, mesh["tp"])
        for b in model.blocks:
            fully_shard(b, mesh=mesh["rep", "dp"])
        fully_shard(model, mesh=mesh["rep", "dp"])
        data = mesh["rep", "dp"]._flatten()
        dp, dp_rank = data.size(), data.get_local_rank()
    else:  # TP alone, on every rank ("tp_sp": with sequence parallelism, each rank its part of the sequence)
        mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",))
        parallelize(model, mesh, sequence=layout == "tp_sp")
        dp, dp_rank = 1, 0
        if layout == "tp_sp":
            dp, dp_rank = -ws, mesh.get_local_rank()  # negative: cut the sequence, not the batch
    return model, shardopt.create_optimizer(model, name, **options(name, strategy)), dp, dp_rank


def train(model, opt, dp: int, dp_rank: int, start: int, stop: int) -> None:
    for s in range(start, stop):
        x, y = batch(s)
        if dp > 0:
            per = GLOBAL // dp
            x, y = x[dp_rank * per : (dp_rank + 1) * per], y[dp_rank * per : (dp_rank + 1) * per]
        else:  # sequence parallel: the whole batch, this rank's positions in; the whole output out
            per = SEQ // -dp
            x = x[:, dp_rank * per : (dp_rank + 1) * per]
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()


def full(model) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()
    }


def run(name: str, strategy: str | None, layout: str) -> dict[str, torch.Tensor]:
    model, opt, dp, dp_rank = build(name, strategy, layout)
    train(model, opt, dp, dp_rank, 0, STEPS)
    return full(model)


def resume(name: str, strategy: str | None, layout: str, root: str, how: str) -> float:
    """Train 2 steps, save (``how``: DCP through ``get_state_dict``, or ``shardopt.checkpoint``), rebuild, load,
    train the last step; the largest difference from the uninterrupted run."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import shardopt.checkpoint as sckpt

    model, opt, dp, dp_rank = build(name, strategy, layout)
    train(model, opt, dp, dp_rank, 0, STEPS)
    want = full(model)
    model, opt, dp, dp_rank = build(name, strategy, layout)
    train(model, opt, dp, dp_rank, 0, STEPS - 1)
    path = os.path.join(root, f"{name}-{strategy}-{layout}-{how}")
    if how == "dcp":
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    else:
        msd, _ = get_state_dict(model, opt)
        dcp.save({"model": msd}, checkpoint_id=path + "-model")
        sckpt.save(path, opt, engine="fsdp2")
    model, opt, dp, dp_rank = build(name, strategy, layout)
    msd, osd = get_state_dict(model, opt)
    if how == "dcp":
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    else:
        sd = {"model": msd}
        dcp.load(sd, checkpoint_id=path + "-model")
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=osd)
        sckpt.load(path, opt)
    train(model, opt, dp, dp_rank, STEPS - 1, STEPS)
    got = full(model)
    return max((got[n] - want[n]).abs().max().item() for n in want)


#: one strategy per whole-matrix optimizer for the save/resume cases (the others' states rest alike)
RESUME = [("scale", None), ("racs", None), ("sumo", "team"), ("alice", "distributed"), ("asgo", "gather")]
#: under ``--lean``, each optimizer's one save/resume path: both paths stay covered, by different optimizers
LEAN_RESUME = {"scale": "dcp", "racs": "shardopt", "sumo": "dcp", "alice": "shardopt", "asgo": "dcp"}


def case(name: str, strategy: str | None, layout: str, want: dict[str, torch.Tensor]) -> dict:
    """One case's record: the largest difference from the single-process run."""
    return {"max_abs_diff": max_abs_diff(run(name, strategy, layout), want)}


def resume_case(name: str, strategy: str | None, layout: str, root: str, how: str) -> dict:
    """One resume case's record: the largest difference from the uninterrupted run."""
    return {"max_abs_diff": resume(name, strategy, layout, root, how)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layouts", default="fsdp2_tp,tp,tp_sp")
    ap.add_argument(
        "--lean",
        action="store_true",
        help="the 8-process mesh (CI time): each whole-matrix optimizer under its RESUME strategy only, "
        "and one save/resume path per optimizer (LEAN_RESUME)",
    )
    args = ap.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    records = []
    import tempfile

    root = tempfile.mkdtemp(prefix="shardopt-tp-") if dist.get_rank() == 0 else None
    holder = [root]
    dist.broadcast_object_list(holder)
    root = holder[0]
    for name, strategy in RESUME:
        for layout in args.layouts.split(","):
            for how in (LEAN_RESUME[name],) if args.lean else ("dcp", "shardopt"):
                rec = {
                    "optimizer": name,
                    "strategy": strategy,
                    "layout": layout,
                    "resume": how,
                    "world_size": dist.get_world_size(),
                }
                record_case(records, rec, partial(resume_case, name, strategy, layout, root, how))
    for name in OPTIMIZERS:
        for strategy in STRATEGIES if name in WHOLE else (None,):
            if args.lean and (name, strategy) not in RESUME:
                continue
            want = reference(name, strategy)
            for layout in args.layouts.split(","):
                rec = {"optimizer": name, "strategy": strategy, "layout": layout, "world_size": dist.get_world_size()}
                record_case(records, rec, partial(case, name, strategy, layout, want))
    finish_worker(records, args.out)


if __name__ == "__main__":
    from launch import settle_heap

    settle_heap()
    main()
