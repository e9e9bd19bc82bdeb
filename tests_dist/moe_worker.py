"""DeepSpeed mixture-of-experts worker (issue 28, item 3): a ``deepspeed.moe.layer.MoE`` layer with 4 experts at
expert-parallel size 2 (world size 4: each rank holds 2 experts, each expert lives on 2 ranks), ZeRO-0, 1 and 2
(DeepSpeed refuses its MoE under ZeRO-3 itself), gradient accumulation 2, against one process training the same
model with every expert local (a plain torch top-1 mixture with the same parameter names, experts numbered
globally) on the same global batch.

DeepSpeed reduces an expert's gradient over its expert data-parallel group (ranks ``{0, 2}`` and ``{1, 3}``) and
partitions it there; the optimizer's statistics, owners and teams for an expert matrix must stay inside that group,
while the dense matrices reduce over the world in the same step. Tokens are never dropped (``drop_tokens=False``)
and the auxiliary loss is not trained, so the distributed model is the same function of the global batch as the
reference. The vocabulary is large enough that every expert's inputs span its width (with 13 tokens an expert saw
at most 13 distinct inputs, and Alice's fp32 step then magnified rounding to 1e-5: that is the rank-deficient case
of item 5, tested in ``test_deficient.py``). After ``STEPS`` steps every rank reports the largest difference of its
parameters from the reference; then the run is saved (``engine.save_checkpoint``: DeepSpeed's expert files and
shardopt's logical state), loaded into a fresh engine and continued for ``STEPS`` more steps, and loaded into an
engine at another ZeRO stage (through shardopt's logical state, experts keyed by global index) and continued.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
import shardopt  # noqa: E402
from launch import finish_worker, record_case  # noqa: E402

VOCAB, DIM, HIDDEN, SEQ = 61, 12, 16, 6
EXPERTS, EP = 4, 2
MICRO, ACCUM = 2, 2
STEPS = 3
#: the ZeRO stage a checkpoint of each stage is reloaded at (shardopt's logical state, not DeepSpeed's files)
RESHARD = {0: 1, 1: 2, 2: 1}
PREFIX = "moe.deepspeed_moe.experts.deepspeed_experts"
CASES = [
    ("scale", None),
    ("racs", None),
    ("sumo", "gather"),
    ("sumo", "distributed"),
    ("alice", "gather"),
    ("alice", "distributed"),
    ("asgo", "gather"),
    ("asgo", "distributed"),
]
HEAD = {"lm_head.weight": "matrix"}  # a dense matrix (world group) stepped beside the experts (expert groups)
OPTIONS = {
    "scale": dict(lr=3e-3, adam_lr=3e-3),
    "racs": dict(lr=0.05, routing=HEAD),
    "sumo": dict(lr=0.02, rank=2, refresh_interval=2, routing=HEAD),
    "alice": dict(lr=0.02, rank=3, leading=1, refresh_interval=2, routing=HEAD),
    "asgo": dict(lr=0.01, refresh_interval=2, routing=HEAD),
}


def expert() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, DIM))


class Net(nn.Module):
    """Embedding, a residual mixture-of-experts block, a norm and the LM head; returns the loss."""

    def __init__(self, moe: nn.Module):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.moe = moe
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        out = self.moe(h)
        h = h + (out[0] if isinstance(out, tuple) else out)
        return nn.functional.cross_entropy(self.lm_head(self.norm(h)).flatten(0, 1), labels.flatten())


class RefGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.wg = nn.Linear(DIM, EXPERTS, bias=False)


class RefMoE(nn.Module):
    """Top-1 mixture with every expert local, named as DeepSpeed names a rank's MoE layer: a token's output is
    its top expert's output times that expert's gate probability (DeepSpeed's top-1 gate without token drops)."""

    def __init__(self):
        super().__init__()
        self.deepspeed_moe = nn.Module()
        self.deepspeed_moe.gate = RefGate()
        self.deepspeed_moe.experts = nn.Module()
        self.deepspeed_moe.experts.deepspeed_experts = nn.ModuleList(expert() for _ in range(EXPERTS))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.reshape(-1, DIM)
        gates = torch.softmax(nn.functional.linear(x.float(), self.deepspeed_moe.gate.wg.weight), dim=1)
        top = gates.argmax(dim=1)
        out = torch.zeros_like(x)
        for e, layer in enumerate(self.deepspeed_moe.experts.deepspeed_experts):
            sel = top == e
            if sel.any():
                out[sel] = gates[sel, e, None] * layer(x[sel])
        return out.reshape(h.shape)


def reference_model() -> Net:
    torch.manual_seed(0)
    return Net(RefMoE())


def global_name(name: str, ep_rank: int) -> str:
    """A rank's parameter name with its local expert index made global (DeepSpeed's expert-parallel rank is the
    rank modulo ``EP`` without model parallelism)."""
    if not name.startswith(PREFIX + "."):
        return name
    local, rest = name[len(PREFIX) + 1 :].split(".", 1)
    return f"{PREFIX}.{ep_rank * (EXPERTS // EP) + int(local)}.{rest}"


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3000 + step)
    tokens = torch.randint(0, VOCAB, (MICRO * ACCUM * dist.get_world_size(), SEQ), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def options(name: str, strategy: str | None) -> dict:
    kw = dict(OPTIONS[name])
    if strategy is not None:
        kw["matrix_ops"] = {"strategy": strategy}
    return kw


def reference(name: str, strategy: str | None, steps: int) -> dict[str, torch.Tensor]:
    model = reference_model()
    opt = shardopt.create_optimizer(model, name, **options(name, strategy))
    for s in range(steps):
        tokens, labels = global_batch(s)
        opt.zero_grad()
        model(tokens, labels).backward()
        for p in model.parameters():  # an expert no token chose: DeepSpeed steps it with a zero gradient
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def engine(name: str, strategy: str | None, stage: int):
    from deepspeed.moe.layer import MoE

    ref = dict(reference_model().named_parameters())
    torch.manual_seed(0)
    model = Net(
        MoE(DIM, expert(), num_experts=EXPERTS, ep_size=EP, k=1, drop_tokens=False, use_rts=False, min_capacity=0)
    )
    with torch.no_grad():  # DeepSpeed copies one expert module: give each expert its reference weights
        for n, p in model.named_parameters():
            p.copy_(ref[global_name(n, dist.get_rank() % EP)])
    kw = options(name, strategy)
    config = {
        "train_batch_size": MICRO * ACCUM * dist.get_world_size(),
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "shardopt": {
            "optimizer": name,
            "params": {k: v for k, v in kw.items() if k != "routing"},
            "routing": kw.get("routing", {}),
        },
    }
    eng, _, _, _ = shardopt.deepspeed.initialize(model=model, config=config)
    return eng


def train(eng, first: int, steps: int) -> None:
    rank, per = dist.get_rank(), MICRO * ACCUM
    for s in range(first, first + steps):
        tokens, labels = global_batch(s)
        mine = slice(rank * per, (rank + 1) * per)
        for t, y in zip(tokens[mine].chunk(ACCUM), labels[mine].chunk(ACCUM)):
            eng.backward(eng(t, y))
            eng.step()


def diff(eng, want: dict[str, torch.Tensor]) -> float:
    """Largest difference over this rank's parameters (its experts by global index), the most over all ranks."""
    ep_rank = dist.get_rank() % EP
    worst = max(
        float((p.detach().float() - want[global_name(n, ep_rank)]).abs().max())
        for n, p in eng.module.named_parameters()
    )
    t = torch.tensor(worst, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def case(name: str, strategy: str | None, stage: int, ckpt_root: str) -> dict:
    eng = engine(name, strategy, stage)
    opt = eng.basic_optimizer if hasattr(eng, "basic_optimizer") else eng.optimizer
    expert_groups = sum(1 for g in opt.param_groups if g.get("moe"))
    train(eng, 0, STEPS)
    out = {"max_abs_diff": diff(eng, reference(name, strategy, STEPS)), "expert_groups": expert_groups}
    eng.save_checkpoint(ckpt_root, tag="moe")
    resumed = engine(name, strategy, stage)
    resumed.load_checkpoint(ckpt_root, tag="moe")
    train(resumed, STEPS, STEPS)
    want = reference(name, strategy, 2 * STEPS)
    out["resume_max_abs_diff"] = diff(resumed, want)
    # another ZeRO stage cannot use DeepSpeed's files: shardopt's logical state (experts by global index) loads
    other = RESHARD[stage]
    resharded = engine(name, strategy, other)
    resharded.load_checkpoint(ckpt_root, tag="moe")
    train(resharded, STEPS, STEPS)
    out["reshard_max_abs_diff"] = diff(resharded, want)
    out["reshard_engine"] = f"zero{other}_ep{EP}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default=None, help="comma-separated optimizer[:strategy] (default: all)")
    ap.add_argument("--stages", default="0,1,2")
    args = ap.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    import deepspeed

    deepspeed.init_distributed("gloo", timeout=timedelta(seconds=180))
    cases = CASES if args.cases is None else [(c.split(":") + [None])[:2] for c in args.cases.split(",")]
    records = []
    for name, strategy in cases:
        for stage in (int(s) for s in args.stages.split(",")):
            rec = {
                "optimizer": name,
                "strategy": strategy,
                "engine": f"zero{stage}_ep{EP}",
                "world_size": dist.get_world_size(),
            }
            root = [tempfile.mkdtemp(prefix="shardopt_moe_") if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(root, src=0)
            record_case(records, rec, partial(case, name, strategy, stage, root[0]))
    finish_worker(records, args.out)


if __name__ == "__main__":
    from launch import settle_heap

    settle_heap()
    main()
