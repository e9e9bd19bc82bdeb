"""torchtitan's tensor-parallel plan on a real LLM shape (issue 45): an embedding, 2 LLaMA blocks (attention and a
SwiGLU MLP, RMSNorms), a final norm and an untied LM head, parallelized as torchtitan's llama3 does it:

* ``tok_embeddings``: ``RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))``: the weight is
  ``Shard(0)`` over the vocabulary, and the gradient autograd leaves on it is whole on every rank (``Replicate``);
* norms: ``SequenceParallel`` (their gradients are partial sums);
* attention and MLP: ``PrepareModuleInput`` from the sequence shard, ``ColwiseParallel`` q/k/v, w1, w3 and
  ``RowwiseParallel`` o, w2 back to the sequence shard;
* ``output``: ``ColwiseParallel(input_layouts=Shard(1))``, its logits whole (``Replicate``) or, with
  ``loss_parallel``, cut over the vocabulary and the loss computed on the shards.

Layouts: ``tp`` (every rank on a "tp" mesh, the whole batch) and ``fsdp2_tp`` (a 2 x 2 ("dp", "tp") mesh, FSDP2 over
"dp"), each with and without ``loss_parallel``. For each optimizer: the rule of every parameter (``describe()``)
must be the single-process one, 3 steps must equal one process on the whole batch, and a save after 2 steps (DCP
through ``get_state_dict``, or ``shardopt.checkpoint``) continued by a fresh run must equal the uninterrupted one.
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
from launch import finish_worker, max_abs_diff, record_case, shared_tempdir  # noqa: E402

VOCAB, DIM, HEADS, HIDDEN, SEQ, BATCH = 48, 16, 4, 24, 8, 4
STEPS = 3
LAYOUTS = ("tp", "tp_lossp", "fsdp2_tp", "fsdp2_tp_lossp")


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        head = DIM // HEADS  # the local heads of a column-parallel projection: -1 (torchtitan's view)
        q, k, v = (w(x).view(b, s, -1, head).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention, self.feed_forward = Attention(), FeedForward()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attention(self.attention_norm(h))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """torchtitan's llama3 module names (``tok_embeddings``, ``layers``, ``norm``, ``output``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(2)})
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def tp_plan(model: Transformer, mesh, loss_parallel: bool) -> None:
    """torchtitan's ``apply_tp`` for llama3 (``torchtitan/models/llama3/infra/parallelize.py``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(
        model,
        mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(
                input_layouts=Shard(1),
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            ),
        },
    )
    for block in model.layers.values():
        parallelize_module(
            block,
            mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            },
        )


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(700 + step))


def loss_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def reference(name: str) -> tuple[dict[str, torch.Tensor], list[list[str]]]:
    model = Transformer()
    opt = shardopt.create_optimizer(model, name, **OPTIONS[name])
    for s in range(STEPS):
        tokens = batch(s)
        opt.zero_grad()
        loss_of(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, rules(opt)


def rules(opt) -> list[list[str]]:
    """Every parameter's row of ``describe()``: name, role, rule (the shape column is the global shape)."""
    return sorted(line.split() for line in opt.describe().splitlines()[1:])


class Run:
    def __init__(self, name: str, layout: str):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.model = Transformer()
        self.loss_parallel = layout.endswith("_lossp")
        ws = dist.get_world_size()
        if layout.startswith("fsdp2_tp"):
            mesh = init_device_mesh("cpu", (ws // 2, 2), mesh_dim_names=("dp", "tp"))
            tp_plan(self.model, mesh["tp"], self.loss_parallel)
            for block in self.model.layers.values():
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(self.model, mesh=mesh["dp"])
            self.dp, self.dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
        else:
            tp_plan(self.model, init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",)), self.loss_parallel)
            self.dp, self.dp_rank = 1, 0
        self.opt = shardopt.create_optimizer(self.model, name, **OPTIONS[name])

    def train(self, start: int, stop: int) -> None:
        from torch.distributed.tensor.parallel import loss_parallel

        per = BATCH // self.dp
        for s in range(start, stop):
            tokens = batch(s)[self.dp_rank * per : (self.dp_rank + 1) * per]
            self.opt.zero_grad()
            logits = self.model(tokens[:, :-1])
            if self.loss_parallel:
                with loss_parallel():
                    loss_of(logits, tokens[:, 1:]).backward()
            else:
                loss_of(logits, tokens[:, 1:]).backward()
            self.opt.step()

    def params(self) -> dict[str, torch.Tensor]:
        return {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in self.model.named_parameters()
        }

    def save(self, path: str, how: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        import shardopt.checkpoint as sckpt

        msd, osd = get_state_dict(self.model, self.opt)
        if how == "dcp":
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        else:
            dcp.save({"model": msd}, checkpoint_id=path + "-model")
            sckpt.save(path, self.opt, engine="fsdp2")

    def load(self, path: str, how: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        import shardopt.checkpoint as sckpt

        msd, osd = get_state_dict(self.model, self.opt)
        if how == "dcp":
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, checkpoint_id=path)
            set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        else:
            sd = {"model": msd}
            dcp.load(sd, checkpoint_id=path + "-model")
            set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=osd)
            sckpt.load(path, self.opt)


def case(name: str, layout: str, root: str, how: str) -> dict:
    want, want_rules = reference(name)
    run = Run(name, layout)
    got_rules = rules(run.opt)
    run.train(0, STEPS)
    out = {
        "max_abs_diff": max_abs_diff(run.params(), want),
        "same_rules": got_rules == want_rules,
        "rules": [" ".join(r) for r in got_rules],
    }
    path = os.path.join(root, f"{name}-{layout}-{how}")
    first = Run(name, layout)
    first.train(0, STEPS - 1)
    first.save(path, how)
    resumed = Run(name, layout)
    resumed.load(path, how)
    resumed.train(STEPS - 1, STEPS)
    out["resume_max_abs_diff"] = max_abs_diff(resumed.params(), run.params())
    return out


def mismatch_case() -> dict:
    """A gradient that cannot be brought to its parameter's placements (a DTensor on another mesh): one clear error
    on every rank, raised before any collective, and nothing stepped."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from shardopt.sharding.discover import GradientPlacementError

    run = Run("racs", "fsdp2_tp" if dist.get_world_size() == 4 else "tp")
    tokens = batch(0)
    loss_of(run.model(tokens[:, :-1]), tokens[:, 1:]).backward()
    weight = run.model.tok_embeddings.weight
    other = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("other",))
    weight.grad = distribute_tensor(torch.zeros(VOCAB, DIM), other, [Replicate()])
    before = run.params()
    try:
        run.opt.step()
    except GradientPlacementError as err:
        message = str(err)
    else:
        message = None
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, message is not None)
    return {"message": message, "raised_on": every, "unchanged": max_abs_diff(run.params(), before) == 0.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--optimizers", default=",".join(OPTIONS))
    args = ap.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    root = shared_tempdir("shardopt-tp-llm-")
    records: list = []
    for i, name in enumerate(args.optimizers.split(",")):
        for layout in args.layouts.split(","):
            how = ("dcp", "shardopt")[i % 2]  # both save paths, by alternating optimizers
            rec = {"optimizer": name, "layout": layout, "resume": how, "world_size": dist.get_world_size()}
            record_case(records, rec, partial(case, name, layout, root, how))
    record_case(records, {"optimizer": "racs", "layout": "mismatch"}, mismatch_case)
    finish_worker(records, args.out)


if __name__ == "__main__":
    from launch import settle_heap

    settle_heap()
    main()
