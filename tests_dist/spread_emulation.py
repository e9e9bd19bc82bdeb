"""The bf16 spread harness in one process (issue 63): ``offload_worker.SpreadMLP``, 8 samples a step; each step's
gradient is computed in bf16 (a bf16 copy of the fp32 weights, as DeepSpeed bf16 and FSDP2 mixed precision
compute it) whole, as world size 1 has it, or as the fp32 mean of two 4-sample halves, as 2 ranks reduce it, or
in fp32. After ``--steps`` steps: the final loss on a fixed 256-sample batch (float64) and the parameters'
relative spread ``|W_a - W_b| / |W_a - W_0|``, world size 2 against 1 and bf16 against fp32, for each optimizer:
shardopt's (``--params``: JSON options), torch's AdamW (lr 1e-2, the engines' harness's yardstick), Muon's anchors
(``torch_muon``: torch.optim.Muon; ``ds_muon``: DeepSpeed's ``SingleDeviceMuon``; both at shardopt Muon's defaults
with AdamW lr 1e-3 on the vectors), and with ``--reference`` the float64 references of ``tests/references.py``
(``sumo``, ``alice``, ``alice0``: exact linear algebra, fed the same bf16-rounded gradients).

    python tests_dist/spread_emulation.py --optimizer adamw,sumo,alice --params '{"signal_rank": true}'
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]
warnings.filterwarnings("ignore")
import references  # noqa: E402
from offload_worker import SPREAD_SAMPLES, SpreadMLP  # noqa: E402

import shardopt  # noqa: E402
from shardopt.sharding.precision import record_arrival_dtypes  # noqa: E402

_EVAL = torch.Generator().manual_seed(99)
EVAL_X, EVAL_Y = torch.randn(256, 24, generator=_EVAL), torch.randn(256, 8, generator=_EVAL)
RUNS = {"ws1": (torch.bfloat16, 1), "ws2": (torch.bfloat16, 2), "fp32": (torch.float32, 1)}


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(SPREAD_SAMPLES, 24, generator=g), torch.randn(SPREAD_SAMPLES, 8, generator=g)


def gradients(model: torch.nn.Module, step: int, dtype: torch.dtype, parts: int) -> list[torch.Tensor]:
    """The step's gradients computed in ``dtype``, averaged in fp32 over ``parts`` equal micro-batches."""
    x, y = batch(step)
    per = SPREAD_SAMPLES // parts
    total: list[torch.Tensor] = []
    for k in range(parts):
        m = copy.deepcopy(model).to(dtype)
        part = slice(k * per, (k + 1) * per)
        torch.nn.functional.mse_loss(m(x[part].to(dtype)).float(), y[part]).backward()
        grads = [p.grad.float() for p in m.parameters()]
        total = grads if not total else [a + b for a, b in zip(total, grads)]
    return [t / parts for t in total]


def optimizers(name: str, model: torch.nn.Module, params: dict) -> list[torch.optim.Optimizer]:
    mats = [p for p in model.parameters() if p.dim() == 2]
    vecs = [p for p in model.parameters() if p.dim() != 2]
    if name == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=1e-2)]
    if name == "torch_muon":
        return [torch.optim.Muon(mats), torch.optim.AdamW(vecs, lr=1e-3, weight_decay=0.0)]
    if name == "ds_muon":
        from deepspeed.runtime.zero.muon.original_muon import SingleDeviceMuon

        return [SingleDeviceMuon(mats, lr=1e-3, weight_decay=0.1), torch.optim.AdamW(vecs, lr=1e-3, weight_decay=0.0)]
    opt = shardopt.create_optimizer(model, name, **params)
    return [opt]


def run(name: str, steps: int, dtype: torch.dtype, parts: int, params: dict) -> torch.nn.Module:
    model = SpreadMLP()
    opts = optimizers(name, model, params)
    if dtype == torch.bfloat16 and isinstance(opts[0], shardopt.ShardedOptimizer):  # what an engine records
        record_arrival_dtypes(opts[0], {n: torch.bfloat16 for n, _ in model.named_parameters()})
    for step in range(steps):
        for p, g in zip(model.parameters(), gradients(model, step, dtype, parts)):
            p.grad = g
        for opt in opts:
            opt.step()
    return model


def reference(name: str, steps: int, dtype: torch.dtype, parts: int, params: dict) -> torch.nn.Module:
    """The float64 reference of ``name`` on the matrices (the rule's defaults, ``params``' rank and leading),
    Adam (bias-corrected, lr as the rule's) on the vectors, fed this harness's gradients."""
    model = SpreadMLP()
    weights = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    state: dict = {n: {} for n in weights}
    lr = 0.01 if name == "sumo" else 0.02
    rank, leading = params.get("rank", 128), params.get("leading", 40)
    for step in range(steps):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(weights[n].float())
        for (n, _), g in zip(model.named_parameters(), gradients(model, step, dtype, parts)):
            g, w, st = g.double(), weights[n], state[n]
            if w.dim() != 2:
                st.setdefault("m", torch.zeros_like(w)).lerp_(g, 0.1)
                st.setdefault("v", torch.zeros_like(w)).lerp_(g * g, 0.001)
                m_hat, v_hat = st["m"] / (1 - 0.9 ** (step + 1)), st["v"] / (1 - 0.999 ** (step + 1))
                weights[n] = w - lr * m_hat / (v_hat.sqrt() + 1e-8)
            elif name == "sumo":
                weights[n] = references.sumo_step(w, g, st, lr, rank)
            else:
                weights[n] = references.alice_step(w, g, st, lr, rank, leading, tracking=name == "alice")
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n].float())
    return model


def final_loss(model: torch.nn.Module) -> float:
    with torch.no_grad():
        return torch.nn.functional.mse_loss(copy.deepcopy(model).double()(EVAL_X.double()), EVAL_Y.double()).item()


def spread(a: torch.nn.Module, b: torch.nn.Module) -> float:
    w0 = dict(SpreadMLP().named_parameters())
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    num = sum(((pa[k] - pb[k]).double() ** 2).sum() for k in pa).sqrt()
    den = sum(((pa[k] - w0[k]).double() ** 2).sum() for k in pa).sqrt()
    return (num / den).item()


def measure(name: str, steps: int, params: dict, use_reference: bool = False) -> dict[str, float]:
    """``ws`` / ``fp``: the parameters' spread, world size 2 against 1 / bf16 against fp32; ``ws_loss`` /
    ``fp_loss``: the same for the final loss (absolute differences); ``loss``: the fp32 run's final loss."""
    models = {k: (reference if use_reference else run)(name, steps, d, parts, params) for k, (d, parts) in RUNS.items()}
    loss = {k: final_loss(m) for k, m in models.items()}
    return {
        "ws": spread(models["ws1"], models["ws2"]),
        "fp": spread(models["fp32"], models["ws1"]),
        "ws_loss": abs(loss["ws2"] - loss["ws1"]),
        "fp_loss": abs(loss["ws1"] - loss["fp32"]),
        "loss": loss["fp32"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--optimizer", default="adamw,sumo,alice")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--params", default="{}", help="JSON options of shardopt's optimizers")
    ap.add_argument("--reference", action="store_true", help="the float64 references (sumo, alice, alice0)")
    args = ap.parse_args()
    params = json.loads(args.params)
    for name in args.optimizer.split(","):
        r = measure(name, args.steps, params, args.reference)
        print(json.dumps({"optimizer": name, "reference": args.reference, "params": params, **r}), flush=True)


if __name__ == "__main__":
    main()
