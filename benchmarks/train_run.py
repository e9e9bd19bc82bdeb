"""One run of shardopt's reference trainer with any optimizer (peers included), and what it cost.

The trainer builds AdamW and shardopt optimizers itself; ``BenchTrainer`` only adds the peers, on the
single-process engine. A peer's config names ``adamw`` so that the trainer's validation accepts it, and
the peer replaces that optimizer at build time.
"""

from __future__ import annotations

import json
import os
import resource
from typing import Any

import torch

from shardopt.train.config import TrainConfig, load_train_config
from shardopt.train.trainer import Trainer

from . import peers
from .probes import state_bytes

__all__ = ["BenchTrainer", "make_config", "train", "read_metrics"]


class BenchTrainer(Trainer):
    """The reference trainer, plus peer optimizers (``peer`` = a name from ``benchmarks.peers.PEERS``)."""

    def __init__(self, cfg: TrainConfig, peer: str | None = None, peer_multiplier: float = 1.0, **kw: Any) -> None:
        if peer is not None and cfg.engine.name != "single":
            raise ValueError(f"peer optimizer {peer!r} runs on engine 'single' only, not {cfg.engine.name!r}")
        self.peer, self.peer_multiplier = peer, peer_multiplier
        super().__init__(cfg, **kw)

    def _optimizer_name(self) -> str:
        return self.peer or super()._optimizer_name()

    def _make_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        if self.peer is None:
            return super()._make_optimizer(model)
        return peers.build(self.peer, model, self.peer_multiplier)


def make_config(base: str, optimizer: str, params: dict[str, Any], overrides: list[str]) -> TrainConfig:
    """``base`` (a trainer JSON) with ``optimizer`` + ``params`` and ``--set``-style ``overrides``.

    A peer is configured as ``adamw`` with no params (it brings its own recipe)."""
    name = "adamw" if optimizer in peers.PEERS else optimizer
    params = {} if optimizer in peers.PEERS else params
    sets = [f"optimizer={json.dumps({'name': name, 'params': params})}", "train.progress=false", *overrides]
    return load_train_config(base, sets)


def _innermost(opt: Any) -> Any:
    """The optimizer that owns the state tensors (DeepSpeed keeps the client optimizer as ``.optimizer``)."""
    while isinstance(getattr(opt, "optimizer", None), torch.optim.Optimizer):
        opt = opt.optimizer
    return opt


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    path = os.path.join(run_dir, "metrics.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def train(cfg: TrainConfig, peer: str | None = None, peer_multiplier: float = 1.0) -> dict[str, Any]:
    """Run ``cfg`` to the end; returns the trainer's summary plus this rank's optimizer state bytes and peak
    resident memory (``ru_maxrss``: the whole process's high-water mark since it started)."""
    trainer = BenchTrainer(cfg, peer=peer, peer_multiplier=peer_multiplier, log=lambda msg: None)
    summary = trainer.fit()
    summary["state_bytes"] = state_bytes(_innermost(trainer.optimizer))
    summary["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    summary["params"] = trainer.n_params
    return summary
