"""Which checkpoint a path given to ``shardopt checkpoint`` means.

Users point the tool at whatever the project wrote: a shardopt file, a DeepSpeed directory, a DCP directory,
a trainer run (``runs/<run>``) or its ``checkpoints/`` folder, one step of it, or a trainer DDP file. This
module turns that path into one checkpoint to read, or a ``CheckpointError`` that names the path to give.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .errors import CheckpointError
from .files import STATE_FILE

__all__ = ["Located", "locate", "ddp_rank_files", "dcp_writer_ranks"]

_RANK_FILE = re.compile(r"^rank(\d+)\.pt$")
_DCP_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")
_STEP_DIR = re.compile(r"^(?:step_?|global_step)(\d+)$")
_DEEPSPEED_FILES = re.compile(r"^(mp_rank_\d+_model_states|zero_pp_rank_\d+_mp_rank_\d+_optim_states)\.pt$")

ACCEPTED = (
    "a shardopt file (*.safetensors, or a directory holding shardopt_state.safetensors), a DeepSpeed "
    "checkpoint directory (with 'latest'), a DCP directory (with .metadata), a trainer run directory "
    "(runs/<run> or runs/<run>/checkpoints, whose latest step is read), one of its step directories, "
    "or a trainer DDP file (rank<N>.pt)"
)


@dataclass
class Located:
    """``kind`` is "file", "deepspeed", "dcp" or "ddp"; ``path`` is what its reader opens (the shardopt
    file, the DeepSpeed directory, the DCP directory, the DDP rank file); ``note`` says how it was found."""

    kind: str
    path: str
    note: str = ""


def ddp_rank_files(directory: str) -> list[str]:
    """The trainer's DDP files in a step directory, by rank."""
    found = [(int(m.group(1)), name) for name in os.listdir(directory) if (m := _RANK_FILE.match(name))]
    return [os.path.join(directory, name) for _, name in sorted(found)]


def dcp_writer_ranks(directory: str) -> set[int]:
    """Ranks that wrote shard files of a DCP directory (``__<rank>_<n>.distcp``)."""
    return {int(m.group(1)) for name in os.listdir(directory) if (m := _DCP_FILE.match(name))}


def _step_dirs(directory: str) -> list[str]:
    found = [
        (int(m.group(1)), name)
        for name in os.listdir(directory)
        if (m := _STEP_DIR.match(name)) and os.path.isdir(os.path.join(directory, name))
    ]
    return [os.path.join(directory, name) for _, name in sorted(found)]


def _step(directory: str, note: str) -> Located | None:
    """One saved step (a DeepSpeed tag holding shardopt's file, a DCP step, a DDP step), or None."""
    if os.path.isfile(os.path.join(directory, STATE_FILE)):
        return Located("file", os.path.join(directory, STATE_FILE), note)
    if os.path.isfile(os.path.join(directory, ".metadata")):
        return Located("dcp", directory, note)
    ranks = ddp_rank_files(directory)
    if ranks:
        return Located("ddp", ranks[0], note)
    return None


def _latest(directory: str) -> Located:
    with open(os.path.join(directory, "latest")) as f:
        tag = f.read().strip()
    target = os.path.join(directory, tag)
    if not tag or not os.path.isdir(target):
        raise CheckpointError(
            f"{directory}: its 'latest' file names step {tag!r}, but {target} does not exist; "
            f"give one of: {', '.join(_step_dirs(directory)) or 'no step directory found'}"
        )
    if os.path.isfile(os.path.join(target, STATE_FILE)):
        return Located("deepspeed", directory, f"latest tag {tag!r}")
    found = _step(target, f"latest checkpoint of {directory}: {target}")
    if found is not None:
        return found
    if any(_DEEPSPEED_FILES.match(name) for name in os.listdir(target)):
        raise CheckpointError(
            f"{directory}: DeepSpeed checkpoint tag {tag!r} has no {STATE_FILE}; it was saved by a "
            "DeepSpeed engine without shardopt's optimizer (built by deepspeed.initialize, not "
            "shardopt.deepspeed.initialize, e.g. an AdamW baseline), so there is no shardopt "
            "state to read"
        )
    raise CheckpointError(
        f"{directory}: 'latest' names {target}, which holds no checkpoint the tool reads "
        f"(expected {STATE_FILE}, a DCP .metadata or rank<N>.pt files)"
    )


def locate(path: str) -> Located:
    """The checkpoint ``path`` means (see the module docstring); ``CheckpointError`` says what to give instead."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file or directory")
    if os.path.isfile(path):
        name = os.path.basename(path)
        if _RANK_FILE.match(name):
            return Located("ddp", path)
        if name in ("latest", ".metadata", "trainer_state.pt"):
            return locate(os.path.dirname(os.path.abspath(path)))
        return Located("file", path)  # any other file is read as shardopt's (safetensors; its reader says if not)
    found = _step(path, "")
    if found is not None:
        return found
    if os.path.isfile(os.path.join(path, "latest")):
        return _latest(path)
    if os.path.isdir(os.path.join(path, "checkpoints")):
        inner = locate(os.path.join(path, "checkpoints"))
        inner.note = inner.note or f"trainer run {path}"
        return inner
    steps = _step_dirs(path)
    if steps:
        raise CheckpointError(
            f"{path}: no 'latest' file says which step is complete (a save was interrupted?); "
            f"give one step directory: {', '.join(steps)}"
        )
    if os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(os.path.join(path, "metrics.jsonl")):
        raise CheckpointError(
            f"{path}: a trainer run directory without checkpoints (its config has "
            "checkpoint.every = 0); set checkpoint.every to save some"
        )
    raise CheckpointError(f"{path}: not a checkpoint the tool reads; give {ACCEPTED}")
