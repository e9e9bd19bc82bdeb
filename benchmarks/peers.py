"""Peer optimizers from outside shardopt, set up as their authors run them on LLaMA.

* ``torch_muon``: ``torch.optim.Muon`` for the hidden matrices and ``torch.optim.AdamW`` for the rest, with
  torch's defaults (the same defaults as shardopt's ``muon``, so the two should track each other).
* ``galore``: ``galore_torch.GaLoreAdamW`` (pip ``galore-torch``), GaLore's LLaMA-60M recipe: lr 0.01, rank
  hidden/4, projection refreshed every 200 steps, scale 0.25.
* ``apollo``: ``apollo_torch.APOLLOAdamW`` (pip ``apollo-torch``), APOLLO's recipe: random projection, rank
  hidden/4, channel-wise scaling, scale 1, refreshed every 200 steps, lr 0.01.

Hidden matrices are the parameters shardopt's routing calls ``matrix`` (embedding, LM head and norm gains go
to AdamW, as in those papers). A peer that cannot be imported is reported with the reason, never replaced.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import torch

__all__ = ["PEERS", "available", "build", "recipe"]

PEERS = ("torch_muon", "galore", "apollo")

# the pip package each peer needs (GaLore and APOLLO also import transformers and bitsandbytes at import time)
_MODULES = {"torch_muon": "torch.optim", "galore": "galore_torch", "apollo": "apollo_torch"}


def available(name: str) -> tuple[bool, str]:
    """Whether peer ``name`` can be built here, and why not."""
    try:
        mod = importlib.import_module(_MODULES[name])
    except Exception as exc:  # an ImportError, or a dependency failing inside the package's own imports
        return False, f"import {_MODULES[name]} failed: {type(exc).__name__}: {exc}".splitlines()[0]
    if name == "torch_muon" and not hasattr(mod, "Muon"):
        return False, f"torch {torch.__version__} has no torch.optim.Muon"
    return True, ""


def _split(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    from shardopt.optim.routing import param_roles

    roles = param_roles(model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [p for n, p in named if roles[n] == "matrix"], [p for n, p in named if roles[n] != "matrix"]


class Hybrid(torch.optim.Optimizer):
    """Several optimizers stepped as one, so an LR scheduler and ``zero_grad`` see one object; the param
    group dicts are the inner optimizers' own, so scheduled learning rates reach them."""

    def __init__(self, parts: list[torch.optim.Optimizer]) -> None:
        self.parts = parts
        super().__init__([g for opt in parts for g in opt.param_groups], {})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.parts:
            opt.step()
        return loss


def recipe(name: str, hidden_size: int, multiplier: float = 1.0) -> dict[str, Any]:
    """The hyperparameters peer ``name`` runs with on a model of ``hidden_size`` (lrs scaled by ``multiplier``)."""
    if name == "torch_muon":
        return {"lr": 1e-3 * multiplier, "weight_decay": 0.1, "momentum": 0.95, "adam_lr": 1e-3 * multiplier}
    low_rank = {"lr": 0.01 * multiplier, "rank": max(1, hidden_size // 4), "update_proj_gap": 200, "proj_type": "std"}
    if name == "galore":
        return low_rank | {"scale": 0.25}
    if name == "apollo":
        return low_rank | {"scale": 1.0, "proj": "random", "scale_type": "channel"}
    raise ValueError(f"unknown peer {name!r}; choose from {PEERS}")


def build(name: str, model: torch.nn.Module, multiplier: float = 1.0) -> torch.optim.Optimizer:
    """Peer ``name`` over a LLaMA ``model`` (it needs ``model.config.hidden_size``) with its recipe."""
    ok, why = available(name)
    if not ok:
        raise RuntimeError(why)
    hp = recipe(name, model.config.hidden_size, multiplier)
    matrices, rest = _split(model)
    if name == "torch_muon":
        muon = torch.optim.Muon(matrices, lr=hp["lr"], weight_decay=hp["weight_decay"], momentum=hp["momentum"])
        return Hybrid([muon, torch.optim.AdamW(rest, lr=hp["adam_lr"], weight_decay=0.0)])
    low = {k: v for k, v in hp.items() if k != "lr"}
    groups = [{"params": rest}, {"params": matrices, **low}]
    if name == "galore":
        from galore_torch import GaLoreAdamW

        return GaLoreAdamW(groups, lr=hp["lr"], no_deprecation_warning=True)
    from apollo_torch import APOLLOAdamW

    return APOLLOAdamW(groups, lr=hp["lr"])
