"""Param groups for whole-parameter sharders whose inner optimizer is a shardopt class.

torch's ``ZeroRedundancyOptimizer`` and fairscale's ``OSS`` give each rank a copy of every param group holding
only the parameters that rank owns. Names (which key seeded draws and checkpoints) must survive that split:
here every group holds one parameter and names it in torch's own ``param_names`` key, so a rank's copy either
holds the parameter with its name or neither. Each group also carries every hyperparameter of its rule, as the
shardopt optimizer resolves them, so the sharder's own defaults never fill a missing key.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from torch import nn

from .registry import OPTIMIZERS, build_param_groups, optimizer_kwargs, validate_hyperparameters

__all__ = ["param_groups"]


def param_groups(
    model: nn.Module | Iterable[Any], name: str, routing: Mapping[str, str] | None = None, **hyperparameters: Any
) -> list[dict]:
    """One param group per trainable parameter of ``model`` for optimizer ``name`` (as ``create_optimizer``
    routes and validates them), each with ``param_names`` and its rule's complete hyperparameters::

        groups = shardopt.param_groups(model, "scale", lr=1e-3)
        opt = ZeroRedundancyOptimizer(groups, optimizer_class=shardopt.SCALE)
        opt = OSS(groups, optim=shardopt.SCALE)

    Optimizer-wide options (``on_nonfinite``, ``debug_plan``) go to the sharder as keyword arguments, which it
    passes on to the inner optimizer."""
    cfg = validate_hyperparameters(name, hyperparameters, where="param_groups")
    cls = OPTIMIZERS[name.lower()]
    resolved = cls(build_param_groups(model, name, cfg, routing), **optimizer_kwargs(cfg))
    out = []
    for group in resolved.param_groups:
        options = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        for p in group["params"]:
            out.append({**options, "params": [p], "param_names": [resolved.param_names[id(p)]]})
    return out
