"""The on-disk form: one safetensors file, written atomically, read without unpickling anything.

``shardopt_state.safetensors`` holds ``"<param name>::<key>"`` tensors (fp32, logical shapes) and, in its
metadata, the JSON of ``{format, kinds, optimizer, param_groups, world_size, engine, extra}``.
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import torch

from .logical import CheckpointError

__all__ = ["STATE_FILE", "FORMAT", "write_state_file", "read_state_file", "read_metadata"]

STATE_FILE = "shardopt_state.safetensors"
FORMAT = "shardopt-logical-v1"


def write_state_file(path: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """Write atomically: a temporary file in the same directory, fsync, then rename over ``path``.

    A crash mid-save leaves the previous file (if any) intact and loadable.
    """
    from safetensors.torch import save_file

    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=directory)
    os.close(fd)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp,
                  metadata={"shardopt": json.dumps({"format": FORMAT, **meta})})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_metadata(path: str) -> dict[str, Any]:
    from safetensors import safe_open

    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no shardopt state file here (expected {STATE_FILE})")
    try:
        with safe_open(path, framework="pt") as f:
            raw = (f.metadata() or {}).get("shardopt")
    except Exception as err:  # safetensors raises its own error types for a bad header
        raise CheckpointError(f"{path}: corrupt or truncated shardopt state file ({err})") from None
    if raw is None:
        raise CheckpointError(f"{path}: not a shardopt state file (no 'shardopt' metadata)")
    meta = json.loads(raw)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: unsupported format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def read_state_file(path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors and metadata; a truncated or corrupt file raises ``CheckpointError``."""
    from safetensors.torch import load_file

    meta = read_metadata(path)
    try:
        tensors = load_file(path)
    except Exception as err:
        raise CheckpointError(f"{path}: corrupt or truncated shardopt state file ({err})") from None
    missing = [k for k in meta.get("keys", []) if k not in tensors]
    if missing:
        raise CheckpointError(f"{path}: incomplete, {len(missing)} tensors missing (e.g. {missing[0]!r})")
    return tensors, meta
