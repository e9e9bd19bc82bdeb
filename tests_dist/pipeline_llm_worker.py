"""A pipelined LLM on DeepSpeed (issue 45): ``PipelineModule`` of LayerSpecs ``[embedding, block, block, norm,
head]`` (LLaMA blocks: attention, SwiGLU MLP, RMSNorms) on 2 stages x 2 data-parallel ranks (world size 4), ZeRO-1,
gradient accumulation 2, with **no routing given**: every parameter must get the role one process gives it (the
head on the last stage is the LM head although that stage holds no embedding), whatever param groups each stage
forms (``partition_method="uniform"`` puts the embedding and both blocks on stage 0, the norm and the head on stage
1: the stages form different numbers of groups). ``tied``: the embedding and the head are one ``TiedLayerSpec``
(the head a ``forward_fn`` on the embedding's weight), against one process whose Linear head shares the
embedding's weight.

Sequences are 16 tokens (64 a micro-batch): with 6 (24) ASGO's inverse root of the nearly singular statistic of
the tied run's value projections magnified one-ulp differences of the tied gradient's cross-stage sum to 1.4e-5.

Each case: the rules of every stage (``describe()``) gathered and compared with one process's, 3 steps compared
with one process on the whole batch, then a save (``engine.save_checkpoint``), a fresh engine that loads it and
runs 3 more steps compared with the first engine continued (resume) and with one process (6 steps).
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
from tp_llm_worker import DIM, VOCAB, Block  # noqa: E402

import shardopt  # noqa: E402
from launch import finish_worker, record_case, shared_tempdir  # noqa: E402

SEQ, MICRO, ACCUM, DP = 16, 2, 2, 2
GLOBAL = MICRO * ACCUM * DP
STEPS = 3
#: gradient clipping of the clipped case, below every step's global norm (about 0.4 here): DeepSpeed's norm must
#: be the global one on every stage, although the stages form different numbers of param groups
CLIP = 0.2


class Head(nn.Linear):
    def __init__(self):
        super().__init__(DIM, VOCAB, bias=False)


def _tied_head(embedding: nn.Embedding, h: torch.Tensor) -> torch.Tensor:
    return F.linear(h, embedding.weight)


def specs(tied: bool) -> list:
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    first = TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM) if tied else LayerSpec(nn.Embedding, VOCAB, DIM)
    last = TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM, forward_fn=_tied_head) if tied else LayerSpec(Head)
    return [first, LayerSpec(Block), LayerSpec(Block), LayerSpec(nn.RMSNorm, DIM), last]


class Reference(nn.Module):
    """The same model in one process under the names the pipeline gives its parameters; tied: a Linear head whose
    weight is the embedding's (one name, ``tied_modules.embed.weight``)."""

    def __init__(self, tied: bool):
        super().__init__()
        torch.manual_seed(0)
        if tied:
            self.tied_modules = nn.ModuleDict({"embed": nn.Embedding(VOCAB, DIM)})
        else:
            self.add_module("0", nn.Embedding(VOCAB, DIM))
        self.add_module("1", Block())
        self.add_module("2", Block())
        self.add_module("3", nn.RMSNorm(DIM))
        self.add_module("4", Head())
        if tied:
            getattr(self, "4").weight = self.tied_modules["embed"].weight
        self.tied = tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = (self.tied_modules["embed"] if self.tied else getattr(self, "0"))(tokens)
        for i in ("1", "2", "3", "4"):
            h = getattr(self, i)(h)
        return h


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (GLOBAL, SEQ + 1), generator=torch.Generator().manual_seed(900 + step))
    return tokens[:, :-1], tokens[:, 1:]


def rules(model: nn.Module, opt) -> list[str]:
    """``<name> <role> <rule>`` for every parameter of ``model`` (the role that chose its rule, the rule of the
    group that lists it), also after DeepSpeed replaced the groups' tensors by flat partitions."""
    from shardopt.optim.routing import role_of

    rule = {n: g["treatment"] for g, names in zip(opt._groups(), opt.group_param_names) for n in names}
    return sorted(f"{n} {role_of(p)} {rule.get(n)}" for n, p in model.named_parameters())


def reference(name: str, tied: bool, steps: int, clip: float = 0.0) -> tuple[dict[str, torch.Tensor], list[str]]:
    model = Reference(tied)
    opt = shardopt.create_optimizer(model, name, **OPTIONS[name])
    for s in range(steps):
        tokens, labels = global_batch(s)
        opt.zero_grad()
        loss_fn(model(tokens), labels).backward()
        if clip:  # DeepSpeed's clipping: g * clip / (|g| + 1e-6) where the global norm exceeds clip
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, rules(model, opt)


def engine(name: str, tied: bool, clip: float = 0.0):
    from deepspeed.pipe import PipelineModule

    model = PipelineModule(layers=specs(tied), num_stages=2, loss_fn=loss_fn, partition_method="uniform")
    start = dict(Reference(tied).named_parameters())
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(start[n])
    config = {
        "train_batch_size": GLOBAL,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": 1},
        "shardopt": {"optimizer": name, "params": OPTIONS[name]},
    }
    eng, _, _, _ = shardopt.deepspeed.initialize(model=model, config=config)
    return eng


def train(eng, first: int, steps: int) -> list[float]:
    """Steps ``first .. first + steps - 1``; the global gradient norm DeepSpeed computed at each."""
    dp_rank, per = eng.grid.get_data_parallel_rank(), GLOBAL // DP
    norms = []
    for s in range(first, first + steps):
        tokens, labels = global_batch(s)
        mine = slice(dp_rank * per, (dp_rank + 1) * per)
        eng.train_batch(data_iter=iter(list(zip(tokens[mine].chunk(ACCUM), labels[mine].chunk(ACCUM)))))
        norm = eng.get_global_grad_norm()
        norms.append(float(norm) if norm is not None else float("nan"))
    return norms


def params(eng) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in eng.module.named_parameters()}


def worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Largest difference over this stage's parameters, the most over all ranks."""
    t = torch.tensor(max((float((p - want[n]).abs().max()) for n, p in got.items()), default=0.0), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def case(name: str, tied: bool, root: str, clip: float = 0.0) -> dict:
    want, want_rules = reference(name, tied, STEPS, clip)
    eng = engine(name, tied, clip)
    opt = eng.basic_optimizer if hasattr(eng, "basic_optimizer") else eng.optimizer
    stage_rules: list = [None] * dist.get_world_size()
    dist.all_gather_object(stage_rules, rules(eng.module, opt))
    got_rules = sorted({r for rs in stage_rules for r in rs})
    table = eng.describe(all_stages=True)  # every stage's rows, gathered over the stages (shardopt.describe)
    want_table = shardopt.create_optimizer(Reference(tied), name, **OPTIONS[name]).describe()
    groups: list = [None] * dist.get_world_size()
    dist.all_gather_object(groups, len(opt._groups()))
    norms: list = [None] * dist.get_world_size()
    dist.all_gather_object(norms, train(eng, 0, STEPS))
    out = {
        "rules": got_rules,
        "same_rules": got_rules == want_rules,
        "groups_per_rank": groups,
        "table": table.splitlines(),
        "one_process_table": want_table.splitlines(),
        "max_abs_diff": worst(params(eng), want),
        "grad_norms": norms,
    }
    mine = {n: float((p - want[n]).abs().max()) for n, p in params(eng).items()}
    per_param: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_param, mine)
    out["worst_param"] = max(((n, d) for m in per_param for n, d in m.items()), key=lambda nd: nd[1])
    eng.save_checkpoint(root, tag="pp")
    train(eng, STEPS, STEPS)
    resumed = engine(name, tied, clip)
    resumed.load_checkpoint(root, tag="pp")
    train(resumed, STEPS, STEPS)
    out["resume_max_abs_diff"] = worst(params(resumed), params(eng))
    out["six_steps_max_abs_diff"] = worst(params(resumed), reference(name, tied, 2 * STEPS, clip)[0])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--optimizers", default=",".join(OPTIONS))
    args = ap.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    import deepspeed

    deepspeed.init_distributed("gloo", timeout=timedelta(seconds=180))  # PipelineModule asks deepspeed.comm
    records = []
    for name in args.optimizers.split(","):
        for tied, clip in ((False, 0.0), (True, 0.0), (False, CLIP)):
            rec = {"optimizer": name, "tied": tied, "clip": clip, "world_size": dist.get_world_size()}
            root = shared_tempdir("shardopt_pp_llm_")
            record_case(records, rec, partial(case, name, tied, root, clip))
    finish_worker(records, args.out)


if __name__ == "__main__":
    from launch import settle_heap

    settle_heap()
    main()
