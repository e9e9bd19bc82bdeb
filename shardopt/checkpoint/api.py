"""Save and load a shardopt optimizer (with the parameters it steps) in logical form, for any engine.

The files reshard: a checkpoint written at one world size and engine loads at another, because every
tensor is stored whole and each rank cuts out its own piece on load.
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist

from ..optim.base import ShardedOptimizer
from .files import STATE_FILE, read_state_file, write_state_file
from .logical import CheckpointError, export_state, import_state

__all__ = ["save", "load", "state_path"]


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def state_path(path: str) -> str:
    """``path`` itself if it names a file, else the state file inside the directory ``path``."""
    return path if path.endswith(".safetensors") else os.path.join(path, STATE_FILE)


def _json_safe(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return None


def save(path: str, optimizer: ShardedOptimizer, *, engine: str = "torch", extra: dict | None = None) -> str:
    """Write ``optimizer``'s logical state and stepped parameters to ``path`` (a directory or a
    ``.safetensors`` file). Collective: call on every rank. Returns the file written (on every rank)."""
    tensors, kinds = export_state(optimizer)
    target = state_path(path)
    if not _dist() or dist.get_rank() == 0:
        groups = [{**{k: _json_safe(v) for k, v in g.items() if k != "params"}, "params": names}
                  for g, names in zip(optimizer.param_groups, optimizer.group_param_names)]
        meta = {
            "kinds": kinds,
            "optimizer": type(optimizer).__name__,
            "param_groups": groups,
            "world_size": dist.get_world_size() if _dist() else 1,
            "engine": engine,
            "keys": sorted(tensors),
            "extra": {k: _json_safe(v) for k, v in (extra or {}).items()},
        }
        write_state_file(target, tensors, meta)
    if _dist():
        dist.barrier()
    return target


def load(path: str, optimizer: ShardedOptimizer, *, load_params: bool = True) -> dict[str, Any]:
    """Load a logical checkpoint into ``optimizer`` on this rank (every rank reads the file and keeps only
    its pieces). Restores param-group hyperparameters (``lr`` etc.). Returns the checkpoint's metadata."""
    tensors, meta = read_state_file(state_path(path))
    if meta["optimizer"] != type(optimizer).__name__:
        raise CheckpointError(f"{path}: saved by {meta['optimizer']}, cannot load into {type(optimizer).__name__}")
    if len(meta["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(f"{path}: {len(meta['param_groups'])} param groups saved, optimizer has "
                              f"{len(optimizer.param_groups)}; build it with the same routing")
    import_state(optimizer, tensors, meta["kinds"], load_params=load_params)
    for group, saved in zip(optimizer.param_groups, meta["param_groups"]):
        for k, v in saved.items():
            if v is not None and k in group and k != "params":
                group[k] = tuple(v) if isinstance(group[k], tuple) else v
    return meta
