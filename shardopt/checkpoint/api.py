"""Save and load a shardopt optimizer (with the parameters it steps) in logical form, for any engine.

The files reshard: a checkpoint written at one world size and engine loads at another, because every
stored piece says which part of which logical tensor it is, and each rank reads only what it needs. No rank
assembles the whole state when saving or loading (``shardopt.checkpoint.logical``).
"""

from __future__ import annotations

import json
from typing import Any

import torch.distributed as dist

from ..optim.base import ShardedOptimizer
from .files import STATE_FILE, StateReader, read_metadata
from .logical import CheckpointError, import_from, save_sharded

__all__ = ["save", "load", "state_path"]


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def state_path(path: str) -> str:
    """``path`` itself if it names a file, else the state file inside the directory ``path``."""
    import os

    return path if path.endswith(".safetensors") else os.path.join(path, STATE_FILE)


def _json_safe(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return None


def _inner(optimizer: Any) -> ShardedOptimizer:
    """The shardopt optimizer of an engine's wrapper that holds one (``shardopt.megatron``'s), else ``optimizer``."""
    inner = getattr(optimizer, "shardopt", None)
    return inner if isinstance(inner, ShardedOptimizer) else optimizer


def save(
    path: str, optimizer: ShardedOptimizer, *, engine: str = "torch", extra: dict | None = None, model: Any = None
) -> str:
    """Write ``optimizer``'s logical state and stepped parameters to ``path`` (a directory or a
    ``.safetensors`` file; several ranks add part files beside it). Collective: call on every rank. Returns
    the main file written (on every rank). ``optimizer`` may also be ``shardopt.megatron``'s optimizer.
    ``model``: also its frozen parameters and persistent buffers (what the optimizer does not step), so that
    ``load(..., model=model)`` restores the whole model (``shardopt.checkpoint.module_state``)."""
    from .module_state import module_records

    optimizer = _inner(optimizer)
    groups = [
        {**{k: _json_safe(v) for k, v in g.items() if k != "params"}, "params": names}
        for g, names in zip(optimizer.param_groups, optimizer.group_param_names)
    ]
    meta = {
        "optimizer": type(optimizer).__name__,
        "param_groups": groups,
        "engine": engine,
        "extra": {k: _json_safe(v) for k, v in (extra or {}).items()},
    }
    records = module_records(model) if model is not None else None
    if records is not None:
        meta["module_entries"] = sorted(r.key for r in records)
    return save_sharded(state_path(path), optimizer, meta, extra=records)


def load(
    path: str,
    optimizer: ShardedOptimizer,
    *,
    load_params: bool = True,
    load_state: bool = True,
    model: Any = None,
    strict: bool = True,
) -> dict[str, Any]:
    """Load a logical checkpoint into ``optimizer`` on this rank (each rank reads only the slices that overlap
    its pieces). Restores param-group hyperparameters (``lr`` etc.). Returns the checkpoint's metadata.
    ``load_state=False`` loads the parameters only: the optimizer's state and hyperparameters stay as they are
    (a warm start with a fresh optimizer). ``model``: also its frozen parameters and persistent buffers, saved
    with ``save(..., model=model)``; ``strict=False`` keeps the model's own values where the checkpoint has
    none (``strict=True`` refuses before anything loads). ``shardopt.megatron``'s optimizer also gets its model
    parameters from the loaded fp32 values (all ranks)."""
    wrapper, optimizer = optimizer, _inner(optimizer)
    if model is not None:  # checked before anything loads: a refusal changes nothing
        from .module_state import check_module_state, missing_message

        with StateReader(state_path(path)) as reader:
            missing = check_module_state(reader, model)
        if missing and strict:
            raise CheckpointError(missing_message(path, missing))
    meta = _load(path, optimizer, load_params, load_state)
    if model is not None:
        from .module_state import load_module_state

        with StateReader(state_path(path), meta) as reader:
            load_module_state(reader, model, strict=False)
    if load_params and wrapper is not optimizer and hasattr(wrapper, "main_params_changed"):
        wrapper.main_params_changed()
    return meta


def _load(path: str, optimizer: ShardedOptimizer, load_params: bool, load_state: bool = True) -> dict[str, Any]:
    target = state_path(path)
    meta = read_metadata(target)
    if meta["optimizer"] != type(optimizer).__name__:
        raise CheckpointError(f"{path}: saved by {meta['optimizer']}, cannot load into {type(optimizer).__name__}")
    if len(meta["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(
            f"{path}: {len(meta['param_groups'])} param groups saved, optimizer has "
            f"{len(optimizer.param_groups)}; build it with the same routing"
        )
    missing = [k for k in meta.get("keys", []) if k not in meta["index"]]
    if missing:
        raise CheckpointError(f"{path}: incomplete, {len(missing)} tensors missing (e.g. {missing[0]!r})")
    matched = _saved_groups(path, optimizer, meta["param_groups"])  # before anything loads: a mismatch loads nothing
    with StateReader(target, meta) as reader:
        import_from(optimizer, reader, meta["kinds"], load_params=load_params, load_state=load_state)
    if not load_state:
        return meta
    for group, saved in zip(optimizer.param_groups, matched):
        for k, v in saved.items():
            if v is not None and k in group and k not in _STRUCTURE:
                group[k] = tuple(v) if isinstance(group[k], tuple) else v
    return meta


#: group keys that say what a group is (its tensors and rule), not how it steps: never restored from a file
_STRUCTURE = ("params", "names", "roles", "param_names", "treatment")


def _saved_groups(path: str, optimizer: ShardedOptimizer, saved: list[dict]) -> list[dict]:
    """The saved group of each of ``optimizer``'s groups, matched by parameter names (engines list parameters, and
    so groups, in different orders: legacy FSDP's flat parameters, pipeline stages), so that a group never takes
    another's hyperparameters; a saved group with another rule for the same parameters is an error."""
    owner = {name: i for i, g in enumerate(saved) for name in (g.get("params") or [])}
    out = []
    for i, (group, names) in enumerate(zip(optimizer.param_groups, optimizer.group_param_names)):
        found = {owner[n] for n in names if n and n in owner}
        match = saved[min(found)] if len(found) == 1 else saved[i] if not found else None  # unnamed: by position
        if match is None:
            raise CheckpointError(
                f"{path}: the parameters of the optimizer's {group.get('treatment')!r} group "
                f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) were saved in "
                f"several groups; build it with the same routing"
            )
        if match.get("treatment", group.get("treatment")) != group.get("treatment"):
            what = repr(names[0]) if names else f"param group {i}"
            raise CheckpointError(
                f"{path}: {what} was saved with rule {match['treatment']!r}, the optimizer "
                f"steps it with {group.get('treatment')!r}; build it with the same routing"
            )
        out.append(match)
    return out
