"""Which parameter gets which rule: roles found from module types, then the optimizer's table.

Roles: ``embedding`` (``nn.Embedding`` weights), ``lm_head`` (the output projection: a Linear whose weight
is tied to an embedding, or the last Linear whose ``out_features`` equals an embedding's vocabulary size),
``matrix`` (every other 2-D Linear weight), ``vector`` (everything else: norms, biases, >2-D tensors).
User patterns (``fnmatch`` on the parameter name, first match wins) override the role, or force
``"adamw"``. Each optimizer maps roles to param-group options (its ``ROLE_TABLE``).
"""
from __future__ import annotations

import fnmatch
from typing import Mapping

import torch
from torch import nn

__all__ = ["ROLES", "param_roles", "route", "RoutingError"]


class ConfigError(ValueError):
    """A shardopt configuration problem; the message names the key path."""


class RoutingError(ConfigError):
    """A routing rule that cannot apply (unknown role, no match, a non-matrix sent to a matrix rule)."""

ROLES = ("embedding", "lm_head", "matrix", "vector", "adamw")


def _is_embedding(m: nn.Module) -> bool:
    """``nn.Embedding`` and look-alikes (Megatron's ``VocabParallelEmbedding``)."""
    return isinstance(m, nn.Embedding) or (type(m).__name__.endswith("Embedding") and hasattr(m, "num_embeddings")
                                           and isinstance(getattr(m, "weight", None), torch.Tensor))


def _is_linear(m: nn.Module) -> bool:
    """``nn.Linear`` and look-alikes (Megatron's ``ColumnParallelLinear`` / ``RowParallelLinear``)."""
    if isinstance(m, nn.Linear):
        return True
    w = getattr(m, "weight", None)
    return "Linear" in type(m).__name__ and isinstance(w, torch.Tensor) and w.dim() == 2


def _out_features(m: nn.Module) -> int | None:
    return getattr(m, "out_features", getattr(m, "output_size", None))


def param_roles(model: nn.Module) -> dict[str, str]:
    """Default role of every trainable parameter, keyed by its name in ``model.named_parameters()``."""
    names = {id(p): n for n, p in model.named_parameters()}
    roles: dict[str, str] = {}
    embeddings = [m for m in model.modules() if _is_embedding(m)]
    vocab_sizes = {m.num_embeddings for m in embeddings}
    emb_ids = {id(m.weight) for m in embeddings}
    linears = [m for m in model.modules() if _is_linear(m)]
    head = None
    for m in linears:
        if id(m.weight) in emb_ids:
            head = m  # tied output projection
    if head is None:
        candidates = [m for m in linears if _out_features(m) in vocab_sizes]
        head = candidates[-1] if candidates else None
    for m in embeddings:
        roles[names[id(m.weight)]] = "embedding"
    for m in linears:
        if id(m.weight) in names and names[id(m.weight)] not in roles:
            roles[names[id(m.weight)]] = "matrix"
    if head is not None:
        roles[names[id(head.weight)]] = "lm_head"  # a tied weight's single name becomes the head
    for n, p in model.named_parameters():
        roles.setdefault(n, "vector")
    return roles


def route(
    model: nn.Module,
    role_table: Mapping[str, dict],
    overrides: Mapping[str, str] | None = None,
    optimizer_name: str = "optimizer",
) -> list[dict]:
    """Param groups (one per distinct option set, in a fixed order) for ``model``'s trainable parameters.

    ``role_table[role]`` gives the group options for that role (must contain ``treatment``). Raises a
    ``ValueError`` naming the parameter, its shape and the rule when a non-2-D tensor would reach a matrix rule.
    """
    roles = param_roles(model)
    overrides = dict(overrides or {})
    for pattern, role in overrides.items():
        if role not in ROLES:
            raise RoutingError(f"routing[{pattern!r}] = {role!r}: unknown role; use one of {list(ROLES)}")
    used = set()
    groups: dict[tuple, dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        role, why = roles[name], "default routing"
        for pattern, target in overrides.items():
            if fnmatch.fnmatchcase(name, pattern):
                role, why = target, f"routing pattern {pattern!r}"
                used.add(pattern)
                break
        options = dict(role_table["vector" if role == "adamw" else role])
        if role == "adamw":
            options = {"treatment": "adamw"}
        if options["treatment"] != "adamw" and p.dim() != 2:
            raise RoutingError(
                f"parameter {name!r} of shape {tuple(p.shape)} is routed to {optimizer_name}'s "
                f"{options['treatment']!r} rule by {why} (role {role!r}), which needs a 2-D matrix; "
                f"route it to AdamW with routing={{'{name}': 'adamw'}}"
            )
        key = tuple(sorted(options.items()))
        group = groups.setdefault(key, {**options, "params": [], "names": [], "roles": []})
        if role not in group["roles"]:
            group["roles"].append(role)
        group["params"].append(p)
        group["names"].append(name)
        p._shardopt_name = name  # the optimizer finds its name even if a wrapper drops "names"
    unused = [p for p in overrides if p not in used]
    if unused:
        raise RoutingError(f"routing patterns {unused} match no trainable parameter of the model")
    return list(groups.values())
