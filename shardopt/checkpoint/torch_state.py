"""Logical tensors from ``torch.optim``-style state dicts: a DCP checkpoint's ``{"model", "optim"}`` entries
(keyed by parameter name) and the trainer's DDP files (``rank<N>.pt``, keyed by position, with the names saved
beside them). Offline tools read both into the ``"<name>::<key>"`` form every conversion goes through."""

from __future__ import annotations

from typing import Any

import torch

from ..optim.base import ShardedOptimizer
from ..optim.registry import OPTIMIZERS
from ..sharding.batched import BATCHED_NDIM, matrix_name
from .errors import CheckpointError
from .logical import PARAM_KEY, SEP
from .safe_pickle import load_plain

__all__ = ["optimizer_class", "logical_from_state_dicts", "batched_names", "counters", "read_ddp"]


def optimizer_class(groups: list[dict]) -> type[ShardedOptimizer] | None:
    """The shardopt class whose param groups these are (None: not a shardopt optimizer's state)."""
    if not any("treatment" in g for g in groups):
        return None
    for g in groups:
        for cls in OPTIMIZERS.values():
            if g.get("treatment") in cls.matrix_treatments:
                return cls
    return OPTIMIZERS["scale"]  # only AdamW groups: every class stores them the same way


def counters(step: Any, scheduler: Any) -> dict[str, Any]:
    """The ``extra`` entries a DeepSpeed engine resumes its schedule from (``install_checkpoint_hooks``)."""
    extra: dict[str, Any] = {}
    if step is not None:
        extra["global_steps"] = int(step)
    if isinstance(scheduler, dict):
        extra["lr_scheduler"] = scheduler
    return extra


def batched_names(model: dict[str, Any], groups: list[dict]) -> set[str]:
    """Parameters that a shardopt optimizer steps as batches of matrices (``sharding.batched``): 3-D tensors in
    param groups whose rule is not AdamW (``params`` given by name)."""
    return {
        n
        for g in groups
        if g.get("treatment", "adamw") != "adamw"
        for n in g.get("params", [])
        if isinstance(n, str) and isinstance(model.get(n), torch.Tensor) and model[n].dim() == BATCHED_NDIM
    }


def _logical_entries(
    name: str, entries: dict[str, Any], batched: int | None, state_kinds: dict[str, str], renames: dict[str, str]
) -> dict[str, tuple[torch.Tensor, str]]:
    """One parameter's state entries as logical tensors ``"<matrix>::<key>" -> (tensor, kind)``; a batched
    parameter's (``batched`` matrices) are its matrices' (``<name>[e]``): element-wise entries sliced per matrix,
    per-tensor ones (``step``) for each, the per-matrix ones nested under ``"matrices"`` as they are."""
    out = {}
    for key, value in entries.items():
        if key == "matrices" and batched is not None and isinstance(value, dict):
            for matrix, per in value.items():
                for k, v in per.items():
                    k = renames.get(k, k)
                    out[f"{matrix}{SEP}{k}"] = (torch.as_tensor(v).float(), state_kinds.get(k, "tensor"))
            continue
        key = renames.get(key, key)  # an old file's keys under today's names
        if not isinstance(value, (torch.Tensor, int, float, bool)):
            continue
        kind = state_kinds.get(key, "tensor")
        value = torch.as_tensor(value).float()
        if batched is None:
            out[f"{name}{SEP}{key}"] = (value, kind)
        else:
            for e in range(batched):
                out[f"{matrix_name(name, e)}{SEP}{key}"] = (value[e] if kind == "elements" else value, kind)
    return out


def logical_from_state_dicts(
    model: dict[str, Any], optim: dict[str, Any], engine: str, world_size: int | None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``optim`` has ``state`` keyed by parameter name and ``param_groups`` whose ``params`` are names."""
    groups = optim.get("param_groups", [])
    cls = optimizer_class(groups)
    state_kinds = cls.state_kinds if cls is not None else {}
    renames = cls.state_key_renames if cls is not None else {}
    batched = batched_names(model, groups)
    tensors = {}
    for n, t in model.items():
        if isinstance(t, torch.Tensor):
            tensors.update(
                {f"{matrix_name(n, e)}{SEP}{PARAM_KEY}": t[e].float() for e in range(t.shape[0])}
                if n in batched
                else {f"{n}{SEP}{PARAM_KEY}": t.float()}
            )
    kinds = {PARAM_KEY: "elements"}
    for name, entries in optim.get("state", {}).items():
        count = model[name].shape[0] if name in batched else None
        for key, (value, kind) in _logical_entries(name, entries, count, state_kinds, renames).items():
            tensors[key] = value
            kinds[key.split(SEP)[1]] = kind
    meta = {
        "kinds": kinds,
        "optimizer": cls.__name__ if cls is not None else None,
        "param_groups": groups,
        "world_size": world_size,
        "engine": engine,
        "keys": sorted(tensors),
        "extra": {},
    }
    return tensors, meta


def read_ddp(path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A trainer DDP (or single-process) file ``rank<N>.pt``: every rank holds the whole state, so one file is
    the checkpoint. Read with ``weights_only`` (nothing in the file runs)."""
    ck = load_plain(path)
    if not isinstance(ck, dict) or "model" not in ck or "optim" not in ck:
        raise CheckpointError(
            f"{path}: not a trainer DDP checkpoint (expected the 'model' and 'optim' entries "
            "that shardopt.train writes)"
        )
    optim = ck["optim"]
    names = ck.get("param_names")
    groups = optim.get("param_groups", [])
    if names is None or len(names) != len(groups) or any(len(n) != len(g["params"]) for n, g in zip(names, groups)):
        raise CheckpointError(
            f"{path}: the file does not name the optimizer's parameters (written by a trainer "
            "older than the checkpoint tool); resume it with the same trainer instead, or save "
            "again with this version"
        )
    by_index = {i: n for g, ns in zip(groups, names) for i, n in zip(g["params"], ns)}
    named = {
        "state": {by_index[i]: v for i, v in optim.get("state", {}).items() if i in by_index},
        "param_groups": [{**g, "params": list(ns)} for g, ns in zip(groups, names)],
    }
    params = set(by_index.values())
    model = {n: t for n, t in ck["model"].items() if n in params}
    tensors, meta = logical_from_state_dicts(model, named, "ddp", ck.get("world"))
    meta["extra"] = counters(ck.get("step"), ck.get("scheduler"))
    return tensors, meta
