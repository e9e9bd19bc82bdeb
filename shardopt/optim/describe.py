"""Which role and rule every parameter gets: ``describe_roles(model, "scale")`` and ``optimizer.describe()``.

A table with one row per trainable parameter: its name, logical shape, role (``embedding``, ``lm_head``,
``matrix``, ``matrix_transposed``, ``vector`` or ``adamw`` by a routing pattern) and the rule with the options
that distinguish it (``scale norm_dim=0`` is per column of the stored weight). ``shardopt roles`` prints it for
a Hugging Face model built from its config (no weights are read). ``describe_groups`` (the table itself) lives
in ``routing`` so that ``ShardedOptimizer.describe`` needs no import of the registry (no import cycle).
"""
from __future__ import annotations

from typing import Any, Mapping

from torch import nn

from .registry import build_param_groups, validate_hyperparameters
from .routing import describe_groups

__all__ = ["describe_roles", "describe_groups"]


def describe_roles(model: nn.Module, optimizer: str, routing: Mapping[str, str] | None = None,
                   **hyperparameters: Any) -> str:
    """The table for ``shardopt.create_optimizer(model, optimizer, routing, **hyperparameters)``, without
    building the optimizer (so also for a model on the meta device)."""
    cfg = validate_hyperparameters(optimizer, hyperparameters, where="describe_roles")
    return describe_groups(build_param_groups(model, optimizer, cfg, routing))
