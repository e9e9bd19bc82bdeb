"""Which role and rule every parameter gets: ``describe_roles(model, "scale")`` and ``optimizer.describe()``.

A table with one row per trainable parameter: its name, logical shape, role (``embedding``, ``lm_head``,
``matrix``, ``matrix_transposed``, ``vector`` or ``adamw`` by a routing pattern) and the rule with the options
that distinguish it (``scale norm_dim=0`` is per column of the stored weight). ``shardopt roles`` prints it for
a Hugging Face model built from its config (no weights are read).
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

from torch import nn

__all__ = ["describe_roles", "describe_groups"]

#: group options that tell rules apart in the table (the rest are hyperparameters shared by the group)
_SHOWN = ("norm_dim", "momentum")


def _rule(group: Mapping[str, Any]) -> str:
    extra = " ".join(f"{k}={group[k]}" for k in _SHOWN if k in group and group["treatment"] != "adamw")
    return f"{group['treatment']} {extra}".strip()


def describe_groups(groups: Iterable[Mapping[str, Any]], names: Mapping[int, str] | None = None) -> str:
    """The table for param groups of real parameters (as routing built them, or an optimizer's)."""
    rows = [("parameter", "shape", "role", "rule")]
    for g in groups:
        for i, p in enumerate(g["params"]):
            name = (g.get("names") or g.get("param_names") or [None] * len(g["params"]))[i] \
                or (names or {}).get(id(p)) or getattr(p, "_shardopt_name", "?")
            shape = tuple(getattr(p, "ds_shape", None) or p.shape)
            rows.append((name, "x".join(str(s) for s in shape) or "scalar", getattr(p, "_shardopt_role", "?"),
                         _rule(g)))
    widths = [max(len(r[c]) for r in rows) for c in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def describe_roles(model: nn.Module, optimizer: str, routing: Mapping[str, str] | None = None,
                   **hyperparameters: Any) -> str:
    """The table for ``shardopt.create_optimizer(model, optimizer, routing, **hyperparameters)``, without
    building the optimizer (so also for a model on the meta device)."""
    from .registry import build_param_groups, validate_hyperparameters

    cfg = validate_hyperparameters(optimizer, hyperparameters, where="describe_roles")
    return describe_groups(build_param_groups(model, optimizer, cfg, routing))


