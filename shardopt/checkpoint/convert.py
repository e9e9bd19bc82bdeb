"""Read and write the three checkpoint forms: shardopt's logical file, a DeepSpeed directory (shardopt's
file inside ``<dir>/<tag>/``), and a PyTorch DCP directory (``{"model": ..., "optim": ...}`` as written by
``get_state_dict``). The logical file is the hub every conversion goes through."""
from __future__ import annotations

import os
from typing import Any

import torch

from ..optim.registry import OPTIMIZERS
from .files import STATE_FILE, read_state_file, write_state_file
from .logical import PARAM_KEY, SEP, CheckpointError
from .safe_pickle import load_dcp_metadata, read_dcp_state_dict

__all__ = ["detect", "read_any", "write_logical", "write_deepspeed", "write_dcp"]


def detect(path: str) -> str:
    if os.path.isfile(path):
        return "file"
    if os.path.isfile(os.path.join(path, STATE_FILE)):
        return "file"
    if os.path.isfile(os.path.join(path, ".metadata")):
        return "dcp"
    if os.path.isfile(os.path.join(path, "latest")):
        return "deepspeed"
    raise CheckpointError(f"{path}: not a shardopt file, DeepSpeed checkpoint directory or DCP directory")


def _deepspeed_state(path: str) -> str:
    with open(os.path.join(path, "latest")) as f:
        tag = f.read().strip()
    target = os.path.join(path, tag, STATE_FILE)
    if not os.path.isfile(target):
        raise CheckpointError(f"{path}: DeepSpeed checkpoint tag {tag!r} has no {STATE_FILE}; it was not saved "
                              "through shardopt.deepspeed.initialize's engine")
    return target


def _treatment_class(groups: list[dict]) -> type:
    for g in groups:
        for name, (cls, _, _) in OPTIMIZERS.items():
            if g.get("treatment") in cls.matrix_treatments:
                return cls
    return OPTIMIZERS["scale"][0]


def _check_dcp_files(path: str) -> None:
    """Name a missing or truncated shard file before DCP fails deep inside its reader (the metadata is read
    by the restricted unpickler: nothing in a crafted file runs)."""
    storage = load_dcp_metadata(os.path.join(path, ".metadata")).storage_data or {}
    need: dict[str, int] = {}
    for info in storage.values():
        rel = getattr(info, "relative_path", None)
        if rel is not None:
            need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
    for rel, size in sorted(need.items()):
        file = os.path.join(path, rel)
        if not os.path.isfile(file):
            raise CheckpointError(f"{path}: incomplete DCP checkpoint, shard file {rel!r} is missing")
        if os.path.getsize(file) < size:
            raise CheckpointError(f"{path}: corrupt DCP checkpoint, shard file {rel!r} is truncated "
                                  f"({os.path.getsize(file)} of {size} bytes)")


def _read_dcp(path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    _check_dcp_files(path)
    sd = read_dcp_state_dict(path)
    if "optim" not in sd or "model" not in sd:
        raise CheckpointError(f"{path}: DCP checkpoint lacks the 'model' and 'optim' entries of get_state_dict")
    groups = sd["optim"].get("param_groups", [])
    cls = _treatment_class(groups)
    tensors = {f"{n}{SEP}{PARAM_KEY}": t.float() for n, t in sd["model"].items() if isinstance(t, torch.Tensor)}
    kinds = {PARAM_KEY: "elements"}
    for name, entries in sd["optim"].get("state", {}).items():
        for key, value in entries.items():
            tensors[f"{name}{SEP}{key}"] = torch.as_tensor(value).float()
            kinds[key] = cls.state_kinds.get(key, "tensor")
    meta = {"kinds": kinds, "optimizer": cls.__name__, "param_groups": groups, "world_size": None,
            "engine": "dcp", "keys": sorted(tensors), "extra": {}}
    return tensors, meta


def read_any(path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any], str]:
    kind = detect(path)
    if kind == "file":
        target = path if os.path.isfile(path) else os.path.join(path, STATE_FILE)
        return (*read_state_file(target), kind)
    if kind == "deepspeed":
        return (*read_state_file(_deepspeed_state(path)), kind)
    return (*_read_dcp(path), kind)


def write_logical(path: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> str:
    target = path if path.endswith(".safetensors") else os.path.join(path, STATE_FILE)
    meta = {k: v for k, v in meta.items() if k != "format"}
    meta["keys"] = sorted(tensors)
    write_state_file(target, tensors, meta)
    return target


def write_deepspeed(path: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any], tag: str = "converted") -> str:
    """A directory that ``engine.load_checkpoint(path)`` of a shardopt DeepSpeed engine loads at any world size."""
    meta = {**meta, "engine": f"converted-from-{meta.get('engine')}"}
    target = write_logical(os.path.join(path, tag), tensors, meta)
    tmp = os.path.join(path, ".latest.tmp")
    with open(tmp, "w") as f:
        f.write(tag)
    os.replace(tmp, os.path.join(path, "latest"))
    return target


def write_dcp(path: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> str:
    """A DCP directory in ``get_state_dict`` form, loadable with ``dcp.load`` + ``set_state_dict``."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    model, state = {}, {}
    for k, v in tensors.items():
        name, key = k.split(SEP)
        if key == PARAM_KEY:
            model[name] = v
        else:
            state.setdefault(name, {})[key] = v
    groups = [{k: (tuple(v) if isinstance(v, list) and k != "params" else v) for k, v in g.items()}
              for g in meta.get("param_groups", [])]
    # written straight from memory (torch_save_to_dcp would round-trip a temporary file through full pickle)
    _save_state_dict({"model": model, "optim": {"state": state, "param_groups": groups}},
                     storage_writer=FileSystemWriter(path), no_dist=True)
    return path
