"""Fused mixture-of-experts worker (issue 46): experts stored as 3-D ``(E, m, n)`` parameters, as transformers 5 and
torchtitan store them, on every engine, against one process training the same model on the same global batch.

The model: an embedding, a dense projection, a mixture-of-experts block (a router Linear and fused experts in
transformers' layout, ``gate_up_proj (E, 2F, D)`` and ``down_proj (E, D, F)``, every expert weighted by the
router's softmax so every expert gets a gradient), a norm and the LM head. Engines (``ENGINES``):

* ``fsdp2`` / ``fsdp2_e4``: ``fully_shard`` on every parameter, FSDP2's default ``Shard(0)``: whole experts per rank
  (3 experts: uneven, and on 4 ranks one rank holds none; 4 experts);
* ``fsdp2_rows`` / ``fsdp2_cols``: ``shard_placement_fn`` shards the experts inside each expert (``Shard(1)`` rows,
  ``Shard(2)`` columns);
* ``ep`` / ``ep_fsdp`` (world size 4, an ``("ep", "dp")`` 2 x 2 mesh): the experts are DTensors split over ``ep``
  (``Shard(0)``) as torchtitan's expert parallelism leaves them, replicated over ``dp`` or also sharded over it
  (``Shard(1)``, as torchtitan's FSDP does when it shards experts). The forward reads the whole experts
  (``full_tensor``) and the gradients are averaged over the ranks before DTensor slices them, so the optimizer
  sees exactly the gradient pieces such a run hands it (torchtitan's token dispatch is not what is tested here);
  the other parameters are replicated and their gradients averaged, as DDP does;
* ``zero2`` / ``zero3``: ``shardopt.deepspeed.initialize``; flat partitions cut across experts and rows (ZeRO-3 with
  a small ``sub_group_size``).

``--phase train``: each case runs 3 steps (compared with one process), saves, runs 3 more (the uninterrupted run);
a fresh run loads the step-3 checkpoint and runs steps 3-5 (compared with the uninterrupted run: resume). The
checkpoints stay in ``--dir``. ``--phase reload`` (another world size): each checkpoint loads into an engine at this
world size (ZeRO through DeepSpeed's ``load_checkpoint``, the rest through ``shardopt.checkpoint``'s logical files
into FSDP2), runs steps 3-5 and is compared with one process.
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
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from layout_options import OPTIONS  # noqa: E402

import shardopt  # noqa: E402
import shardopt.checkpoint as sckpt  # noqa: E402
from launch import finish_worker, max_abs_diff, record_case  # noqa: E402

VOCAB, DIM, FFN, SEQ, MICRO = 23, 8, 4, 4, 2
STEPS = 3
#: ``_in_out``: the experts stored in x out (GPT-OSS, ``is_transposed=True``; role ``matrix_transposed``)
IN_OUT = "_in_out"
ENGINES = (
    "fsdp2",
    "fsdp2_e4",
    "fsdp2_rows",
    "fsdp2_cols",
    "ep",
    "ep_fsdp",
    "zero2",
    "zero3",
    "fsdp2_rows" + IN_OUT,
    "zero2" + IN_OUT,
)


def storage(engine: str) -> tuple[str, bool]:
    """The engine without its storage suffix, and whether the experts are stored in x out."""
    return engine.removesuffix(IN_OUT), engine.endswith(IN_OUT)


class Experts(nn.Module):
    """transformers 5's fused experts (``MixtralExperts``): expert ``e`` is ``F.linear(x, W[e])``."""

    def __init__(self, experts: int, transposed: bool = False):
        super().__init__()
        self.num_experts, self.is_transposed = experts, transposed
        up, down = torch.randn(experts, 2 * FFN, DIM) * 0.3, torch.randn(experts, DIM, FFN) * 0.3
        self.gate_up_proj = nn.Parameter(up.mT.contiguous() if transposed else up)  # GPT-OSS: (E, in, out)
        self.down_proj = nn.Parameter(down.mT.contiguous() if transposed else down)

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        up_w, down_w = _whole(self.gate_up_proj), _whole(self.down_proj)
        if self.is_transposed:
            up_w, down_w = up_w.mT, down_w.mT
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            gate, up = F.linear(x, up_w[e]).chunk(2, dim=-1)
            out = out + weights[..., e : e + 1] * F.linear(F.silu(gate) * up, down_w[e])
        return out


class _MeanGrad(torch.autograd.Function):
    """Identity forward; the backward averages the gradient over every rank (the data-parallel reduction of a
    DTensor expert read whole), so that DTensor's slicing hands each rank its piece of the global gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g)
        return g / dist.get_world_size()


def _whole(w: torch.Tensor) -> torch.Tensor:
    return _MeanGrad.apply(w.full_tensor()) if hasattr(w, "full_tensor") else w


class SparseMoeBlock(nn.Module):
    def __init__(self, experts: int, transposed: bool = False):
        super().__init__()
        self.gate = nn.Linear(DIM, experts, bias=False)
        self.experts = Experts(experts, transposed)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.experts(h, self.gate(h).softmax(-1))


class Net(nn.Module):
    def __init__(self, experts: int, transposed: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.proj = nn.Linear(DIM, DIM, bias=False)
        self.moe = SparseMoeBlock(experts, transposed)
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.proj(h)
        h = h + self.moe(h)
        logits = self.lm_head(self.norm(h))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def global_batch(step: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, VOCAB, (MICRO * world, SEQ), generator=g)


def local_batch(step: int) -> torch.Tensor:
    r = dist.get_rank()
    return global_batch(step, dist.get_world_size())[r * MICRO : (r + 1) * MICRO]


_REFERENCE: dict = {}


def reference(name: str, experts: int, worlds: tuple[int, ...], transposed: bool = False) -> dict[str, torch.Tensor]:
    """One process on the global batch of each step (the mean over every rank's sequences; step ``s`` ran at world
    size ``worlds[s]``)."""
    key = (name, experts, worlds, transposed)
    if key not in _REFERENCE:
        model = Net(experts, transposed)
        opt = shardopt.create_optimizer(model, name, **OPTIONS[name])
        for s, world in enumerate(worlds):
            opt.zero_grad()
            model(global_batch(s, world)).backward()
            opt.step()
        _REFERENCE[key] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return _REFERENCE[key]


def experts_of(engine: str) -> int:
    """3 experts where that leaves a rank with none (FSDP2's chunks at world size 4), else 4."""
    return 3 if storage(engine)[0] == "fsdp2" else 4


class Run:
    """One engine and optimizer on a fresh model."""

    def __init__(self, engine: str, name: str, experts: int):
        engine, transposed = storage(engine)
        self.engine, self.name = engine, name
        model = Net(experts, transposed)
        kw = dict(OPTIONS[name])
        self.deepspeed = engine.startswith("zero")
        if engine.startswith("fsdp2"):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            from torch.distributed.tensor import Shard

            dim = {"fsdp2_rows": 1, "fsdp2_cols": 2}.get(engine, 0)
            fully_shard(
                model,
                mesh=init_device_mesh("cpu", (dist.get_world_size(),)),
                shard_placement_fn=lambda p: Shard(dim) if p.dim() == 3 else Shard(0),
            )
            self.model = self.module = model
            self.opt = shardopt.create_optimizer(model, name, **kw)
        elif engine.startswith("ep"):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import Replicate, Shard, distribute_tensor

            mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("ep", "dp"))
            placements = (Shard(0), Shard(1) if engine == "ep_fsdp" else Replicate())
            ex = model.moe.experts
            for pname in ("gate_up_proj", "down_proj"):
                setattr(ex, pname, nn.Parameter(distribute_tensor(getattr(ex, pname).detach(), mesh, placements)))
            self.model = self.module = model
            self.opt = shardopt.create_optimizer(model, name, **kw)
        else:
            stage = int(engine[-1])
            world = dist.get_world_size()
            config = {
                "train_batch_size": MICRO * world,
                "train_micro_batch_size_per_gpu": MICRO,
                "gradient_clipping": 0.0,
                "zero_optimization": {"stage": stage, **({"sub_group_size": 150} if stage == 3 else {})},
                "shardopt": {"optimizer": name, "params": kw},
            }
            self.model, self.opt, _, _ = shardopt.deepspeed.initialize(model=model, config=config)
            self.module = self.model.module

    @property
    def inner(self):
        return self.model.basic_optimizer if self.deepspeed else self.opt

    def train(self, start: int, stop: int) -> None:
        for s in range(start, stop):
            loss = self.model(local_batch(s))
            if self.deepspeed:
                self.model.backward(loss)
                self.model.step()
                continue
            self.opt.zero_grad()
            loss.backward()
            if self.engine.startswith("ep"):  # the replicated parameters: DDP's average
                for p in self.module.parameters():
                    if p.grad is not None and not hasattr(p, "placements"):
                        dist.all_reduce(p.grad)
                        p.grad /= dist.get_world_size()
            self.opt.step()

    def params(self) -> dict[str, torch.Tensor]:
        if self.engine == "zero3":
            from deepspeed import zero

            with zero.GatheredParameters(list(self.module.parameters())):
                return {n: p.detach().float().clone() for n, p in self.module.named_parameters()}
        return {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
            for n, p in self.module.named_parameters()
        }

    def save(self, root: str) -> None:
        if self.deepspeed:
            self.model.save_checkpoint(root, tag="step3")  # DeepSpeed's files and shardopt's logical state
            return
        sckpt.save(os.path.join(root, "logical"), self.opt, engine=self.engine)
        if self.engine.startswith("fsdp2"):  # FSDP2's own way too: DCP
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            msd, osd = get_state_dict(self.model, self.opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, "dcp"))

    def load(self, root: str, same_engine: bool) -> None:
        if self.deepspeed:
            self.model.load_checkpoint(root, tag="step3")
        elif same_engine and self.engine.startswith("fsdp2"):
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            msd, osd = get_state_dict(self.model, self.opt)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, checkpoint_id=os.path.join(root, "dcp"))
            set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        else:
            sckpt.load(os.path.join(root, "logical"), self.opt)


def rules(run: Run) -> dict[str, str]:
    """The rule of every parameter (a batched one by the treatment of its group) and how many matrices the
    optimizer steps per expert parameter (its fragments)."""
    inner = run.inner
    out = {}
    for group, names in zip(inner._groups(), inner.group_param_names):
        for n in names:
            out[n] = group["treatment"]
    return out


def runs_at(engine: str, world: int) -> bool:
    """The ep meshes are 2 x 2; FSDP2 refuses uneven shards of dims other than 0 (world size 3 here)."""
    engine = storage(engine)[0]
    if engine.startswith("ep"):
        return world == 4
    if engine in ("fsdp2_rows", "fsdp2_cols"):
        return all(s % world == 0 for s in (2 * FFN, DIM, FFN))
    return True


def case_root(root: str, name: str, engine: str) -> str:
    path = os.path.join(root, f"{name}-{engine}")
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    return path


def train_case(name: str, engine: str, root: str) -> dict:
    experts = experts_of(engine)
    run = Run(engine, name, experts)
    run.train(0, STEPS)
    want = reference(name, experts, (dist.get_world_size(),) * STEPS, storage(engine)[1])
    out = {"experts": experts, "max_abs_diff": max_abs_diff(run.params(), want), "rules": rules(run)}
    held = [
        f.name for p in run.inner.stepped_tensors() for f in run.inner.fragments(p) if f.index is not None and f.numel
    ]
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, len(held))
    out["matrices_held"] = counts
    path = case_root(root, name, engine)
    run.save(path)
    run.train(STEPS, 2 * STEPS)
    uninterrupted = run.params()
    resumed = Run(engine, name, experts)
    resumed.load(path, same_engine=True)
    resumed.train(STEPS, 2 * STEPS)
    out["resume_max_abs_diff"] = max_abs_diff(resumed.params(), uninterrupted)
    return out


def reload_case(name: str, engine: str, root: str, saved_at: int = 4) -> dict:
    experts = experts_of(engine)
    base, transposed = storage(engine)
    target = "zero2" if base == "zero3" else "zero3" if base == "zero2" else "fsdp2"
    run = Run(target + (IN_OUT if transposed else ""), name, experts)
    run.load(case_root(root, name, engine), same_engine=False)
    run.train(STEPS, 2 * STEPS)
    want = reference(name, experts, (saved_at,) * STEPS + (dist.get_world_size(),) * STEPS, transposed)
    return {"target": target, "max_abs_diff": max_abs_diff(run.params(), want)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=("train", "reload"), required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--optimizers", default=",".join(OPTIONS))
    ap.add_argument("--engines", default=",".join(ENGINES))
    args = ap.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    import deepspeed

    deepspeed.init_distributed("gloo", timeout=timedelta(seconds=180))
    records: list = []
    for name in args.optimizers.split(","):
        for engine in args.engines.split(","):
            if args.phase == "train" and not runs_at(engine, dist.get_world_size()):
                continue
            rec = {"optimizer": name, "engine": engine, "world_size": dist.get_world_size()}
            body = train_case if args.phase == "train" else reload_case
            record_case(records, rec, partial(body, name, engine, args.dir))
    finish_worker(records, args.out)


if __name__ == "__main__":
    from launch import settle_heap

    settle_heap()
    main()
