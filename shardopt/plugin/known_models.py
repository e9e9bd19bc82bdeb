"""Names and roles for optimizers built from bare tensors, from the model those tensors belong to.

Trainers whose configs can only pass tensors lose the embedding and LM-head roles: torchtune instantiates
``_component_: shardopt.SCALE`` with ``model.parameters()``, and under ``optimizer_in_bwd`` builds one optimizer
per parameter (``[param]``). ``names_from_known_models`` (a ``hooks.param_sources`` entry) names such tensors from
their model, and declares each one's role from the model (``routing.find_roles``: the declared embedding and
output layer first), exactly as ``shardopt.create_optimizer(model)`` would. The model is found:

* from ``register_model(model)``, called once before the optimizers are built (any trainer; held weakly);
* on the call stack under torchtune's ``config.instantiate``: the recipe's ``self._model`` (or a local ``model``)
  in a frame above it, so a torchtune config needs no code.

Parameters are looked up when an optimizer is built, so the model may be sharded (``fully_shard`` replaces its
parameters) after it was registered. Tensors of no known model are left alone (``groups.normalize_param_groups``
then warns once that their roles cannot be known).
"""

from __future__ import annotations

import sys
import weakref
from types import FrameType
from typing import Any

import torch
from torch import nn

from ..optim import hooks
from ..optim.routing import clean_name, declare_module_roles, find_roles, model_parameters

__all__ = ["register_model", "names_from_known_models"]

_REGISTERED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
#: model -> (ids of its stepped tensors, {id: (name, role, source)}): find_roles once per parameter set, not once
#: per optimizer (optimizer_in_bwd builds one per parameter)
_TABLES: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[int, ...], dict[int, tuple[str, str, str]]]] = (
    weakref.WeakKeyDictionary()
)


def register_model(model: nn.Module) -> nn.Module:
    """Let optimizers later built from ``model``'s bare tensors (``SCALE(model.parameters())``, one optimizer per
    parameter) name them and give them their roles (embedding, LM head, ...) as ``create_optimizer(model)`` does.
    Call it on each rank before the optimizers are built (before or after sharding); returns ``model``. The model
    is held weakly."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"shardopt.register_model takes an nn.Module, got {type(model).__name__}")
    _REGISTERED.add(model)
    return model


def _table(model: nn.Module) -> dict[int, tuple[str, str, str]]:
    params = model_parameters(model)
    key = tuple(id(stepped) for _, _, stepped in params)
    cached = _TABLES.get(model)
    if cached is not None and cached[0] == key:
        return cached[1]
    roles = find_roles(model)
    table = {id(stepped): (clean_name(n), roles.roles[n], roles.sources[n]) for n, _, stepped in params}
    _TABLES[model] = (key, table)
    return table


def _torchtune_model(max_frames: int = 30) -> nn.Module | None:
    """The model of the torchtune recipe whose ``config.instantiate`` builds an optimizer now: ``self._model``
    (torchtune's recipes) or a local ``model`` in a frame above ``instantiate``."""
    frame: FrameType | None = sys._getframe(2)
    inside = False
    for _ in range(max_frames):
        if frame is None:
            return None
        if str(frame.f_globals.get("__name__", "")).startswith("torchtune.config"):
            inside = True
        elif inside:
            owner = frame.f_locals.get("self")
            for found in (getattr(owner, "_model", None), frame.f_locals.get("model")):
                if isinstance(found, nn.Module):
                    return found
        frame = frame.f_back
    return None


def _tensors(params: list) -> list[torch.Tensor] | None:
    """The tensors of a flat list or of groups of tensors; None when anything is named or not a tensor."""
    out: list[torch.Tensor] = []
    for item in params:
        group = item.get("params") if isinstance(item, dict) else [item]
        if isinstance(item, dict) and "param_names" in item:
            return None
        group = [group] if isinstance(group, torch.Tensor) else group
        if not isinstance(group, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in group):
            return None
        out.extend(group)
    return out


def names_from_known_models(params: Any, who: str) -> Any:
    """``params`` with every tensor named from a registered model or torchtune's, and its role declared; the
    parameters unchanged (a consumed iterator as a list) when they are named already or belong to no known model."""
    if isinstance(params, (torch.Tensor, dict, set, frozenset)):
        return params
    params = list(params)
    tensors = _tensors(params)
    if not tensors:
        return params
    candidates = list(_REGISTERED)
    found = _torchtune_model()
    if found is not None:
        candidates.insert(0, found)
    for model in candidates:
        table = _table(model)
        if all(id(t) in table for t in tensors):
            declare_module_roles((t, table[id(t)][1], table[id(t)][2]) for t in tensors)
            if not isinstance(params[0], dict):
                return [(table[id(t)][0], t) for t in params]
            return [{**g, "params": [(table[id(t)][0], t) for t in _tensors([g]) or []]} for g in params]
    return params


hooks.register_param_source(names_from_known_models)
