"""torch.optim's ways of passing parameters, turned into shardopt param groups.

torch takes tensors, ``(name, tensor)`` pairs (``model.named_parameters()``), or group dicts holding either;
a shardopt group also needs a ``treatment``. A group that sets none is split the way ``create_optimizer``
routes: by role when its parameters are named (roles from names, ``routing.roles_from_names``), else 2-D
tensors to the matrix rule and everything else to AdamW (warning once that embedding and LM-head roles need
names, for a model's mixed list and for a one-matrix optimizer; ``shardopt.register_model`` names them).
Named groups keep torch's ``param_names`` key, so state dicts carry it as torch >= 2.5 does.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from .routing import (
    module_role,
    module_role_source,
    name_sources,
    named_or_unnamed,
    record_role,
    roles_from_names,
    unnamed_roles,
    warn_unknown_batches,
    warn_unnamed_once,
)

__all__ = ["normalize_param_groups", "tensor_names"]

RoleOptions = Callable[[str], dict]


def _as_groups(params: Any) -> list[dict]:
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "params argument given to the optimizer should be an iterable of Tensors or dicts, but got "
            + torch.typename(params)
        )
    if isinstance(params, (set, frozenset)):
        named_or_unnamed(params)  # torch's TypeError for unordered parameters
    items = list(params)
    if not items:
        raise ValueError("optimizer got an empty parameter list")
    if not isinstance(items[0], dict):
        return [{"params": items}]
    for g in items:
        if not isinstance(g, dict):
            raise TypeError(f"param_group must be a dict, but got {torch.typename(g)}")
    return [dict(g) for g in items]


def _split_by_role(
    group: dict,
    tensors: list[torch.Tensor],
    roles: list[str],
    named: bool,
    role_options: RoleOptions,
    sources: list[str],
) -> list[dict]:
    """One group per distinct role option set, in order of first appearance; the user's own group keys
    (``lr``, ``weight_decay``, ...) apply to every part."""
    user = {k: v for k, v in group.items() if k not in ("params", "param_names")}
    names = group.get("param_names") or [None] * len(tensors)
    parts: dict[tuple, dict] = {}
    for p, name, role, source in zip(tensors, names, roles, sources):
        options = role_options(role)
        part = parts.setdefault(
            tuple(sorted(options.items(), key=lambda kv: kv[0])),
            {**options, **user, "params": [], **({"param_names": []} if named else {}), "roles": []},
        )
        part["params"].append(p)
        record_role(p, role, source)  # for describe()
        if named:
            part["param_names"].append(name)
        if role not in part["roles"]:
            part["roles"].append(role)
    return list(parts.values())


def tensor_names(
    group: dict, tensors: list[torch.Tensor], pair_names: list[str] | None, start: int
) -> tuple[list[str] | None, list[str]]:
    """Every way a name reaches the optimizer, in one place: ``(torch's names for the group or None, a name
    for each tensor)``. First found wins: ``(name, tensor)`` pairs and a group's ``param_names`` (torch's own
    channels, kept as ``param_names``), then the ``names`` key that ``create_optimizer`` passes (shardopt's,
    removed from the group), else the tensor's position in the input (``param_<start + i>``), so seeded draws
    and checkpoints never depend on memory addresses.

    A whole-parameter sharder (ZeroRedundancyOptimizer, fairscale OSS) hands each rank a copy of every group
    with only the parameters that rank owns; ``shardopt.param_groups`` makes those one-parameter groups, so a
    copy's ``param_names`` either match or the copy is empty (its names become ``[]``, keeping torch's rule
    that all groups are with or without names). Names that no longer match are dropped."""
    names = pair_names
    given = group.get("param_names")
    if names is None and given is not None:
        if len(given) == len(tensors):
            names = list(given)
        elif not tensors:
            group["param_names"] = []
        else:
            group.pop("param_names")
    legacy = group.pop("names", None)
    if legacy is not None and len(legacy) != len(tensors):
        legacy = None
    chosen = names or legacy
    return names, [chosen[i] if chosen and chosen[i] else f"param_{start + i}" for i in range(len(tensors))]


def normalize_param_groups(
    params: Iterable[Any] | dict, role_options: RoleOptions, who: str, start: int = 0, stacklevel: int = 2
) -> tuple[list[dict], dict[int, str]]:
    """Param groups with a ``treatment`` each, and a name for every tensor (keyed by ``id``).

    Names come from ``tensor_names``. ``role_options(role)`` gives the group options for a role (with
    ``treatment``).
    """
    groups = _as_groups(params)
    per_group = []
    position = start
    for g in groups:
        tensors, pairs = named_or_unnamed(g["params"] if not isinstance(g["params"], torch.Tensor) else [g["params"]])
        names, each = tensor_names(g, tensors, pairs, position)
        position += len(tensors)
        per_group.append((tensors, names, each))
    named_all = [(n, t) for tensors, names, _ in per_group if names for n, t in zip(names, tensors)]
    roles_by_name = roles_from_names(named_all) if named_all else {}
    sources_by_name = name_sources(roles_by_name)
    for n, t in named_all:  # roles found from the model's module types (HF Trainer's groups) beat the names
        role = module_role(t)  # routing.declare_module_roles (shardopt.plugin.wrapped.names_from_trainer)
        if role is not None:
            roles_by_name[n], sources_by_name[n] = role, module_role_source(t) or "type"
    routed = [
        (n, t)
        for g, (tensors, names, _) in zip(groups, per_group)
        if names and "treatment" not in g
        for n, t in zip(names, tensors)
    ]
    warn_unknown_batches(routed, roles_by_name, {}, who, stacklevel=stacklevel + 1)

    out: list[dict] = []
    ids: dict[int, str] = {}
    for g, (tensors, names, each) in zip(groups, per_group):
        g["params"] = tensors
        if names is not None:
            g["param_names"] = names
        for t, name in zip(tensors, each):
            ids.setdefault(id(t), name)
        if "treatment" in g or not tensors:
            out.append(g if "treatment" in g else {**role_options("vector"), **g})
            continue
        roles = [roles_by_name[n] for n in names] if names else unnamed_roles(tensors)
        sources = [sources_by_name[n] for n in names] if names else ["type"] * len(tensors)
        parts = _split_by_role(g, tensors, roles, names is not None, role_options, sources)
        # a model's list (matrices and vectors), or one matrix alone (one optimizer per parameter, torchtune's
        # optimizer_in_bwd), not a list of matrices: its embedding and head would get the matrix rule unnoticed
        alone = start == 0 and roles == ["matrix"] and sum(len(t) for t, _, _ in per_group) == 1
        if names is None and (len(parts) > 1 or alone):
            warn_unnamed_once(who, role_options("matrix")["treatment"], stacklevel=stacklevel + 1)
        out.extend(parts)
    return out, ids
