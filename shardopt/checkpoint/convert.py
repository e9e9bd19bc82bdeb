"""Read and write the checkpoint forms: shardopt's logical file, a DeepSpeed directory (shardopt's file
inside ``<dir>/<tag>/``), a PyTorch DCP directory (``{"model": ..., "optim": ...}`` as written by
``get_state_dict``) and, for reading, the reference trainer's DDP files. The logical file is the hub every
conversion goes through. Step counters travel in the metadata's ``extra`` (``global_steps``,
``lr_scheduler``), which a shardopt DeepSpeed engine resumes its schedule from."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ..sharding.batched import matrix_name
from .files import STATE_FILE, read_state_file, write_state_file
from .locate import Located, dcp_writer_ranks, locate
from .logical import PARAM_KEY, SEP, CheckpointError
from .safe_pickle import load_dcp_metadata, load_plain, read_dcp_state_dict
from .torch_state import counters, logical_from_state_dicts, read_ddp

__all__ = ["Checkpoint", "detect", "read", "read_any", "write_logical", "write_deepspeed", "write_dcp"]


@dataclass
class Checkpoint:
    """What an offline tool read: whole logical tensors, metadata, the kind found and how it was found."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    kind: str
    path: str
    notes: list[str] = field(default_factory=list)


def detect(path: str) -> str:
    """ "file", "deepspeed", "dcp" or "ddp" (see ``shardopt.checkpoint.locate``)."""
    return locate(path).kind


def _deepspeed_state(path: str) -> str:
    with open(os.path.join(path, "latest")) as f:
        tag = f.read().strip()
    target = os.path.join(path, tag, STATE_FILE)
    if not os.path.isfile(target):
        raise CheckpointError(
            f"{path}: DeepSpeed checkpoint tag {tag!r} has no {STATE_FILE}; it was not saved "
            "through shardopt.deepspeed.initialize's engine"
        )
    return target


def _deepspeed_module_entries(tag_dir: str, have: dict[str, torch.Tensor], notes: list[str]) -> dict[str, torch.Tensor]:
    """What DeepSpeed's model-states files of a tag hold beyond shardopt's file: frozen parameters and persistent
    buffers (ZeRO-0/1/2's module state dict; ZeRO-3's buffers and every rank's frozen fragments), as
    ``<name>::param`` entries, so a conversion carries the whole model. Read without full pickle; a tied weight's
    second name (DeepSpeed's ``shared_params``) is left out, as shardopt's file leaves it out."""
    import glob
    import re

    def rank_of(f: str) -> int:
        found = re.search(r"zero_pp_rank_(\d+)_", os.path.basename(f))
        assert found is not None  # the glob below matched this pattern
        return int(found.group(1))

    plain = os.path.join(tag_dir, "mp_rank_00_model_states.pt")
    ranked = sorted(glob.glob(os.path.join(tag_dir, "zero_pp_rank_*_mp_rank_00_model_states.pt")), key=rank_of)
    files = [plain] if os.path.isfile(plain) else ranked
    if not files:
        return {}
    try:
        states = [load_plain(f) for f in files]
    except Exception as err:  # noqa: BLE001 - a file the restricted reader refuses: the optimizer's part converts
        notes.append(
            f"DeepSpeed's model-states files of {tag_dir} not read ({err}); frozen parameters and buffers "
            "are not in the conversion"
        )
        return {}
    first = states[0]
    shared = set((first.get("shared_params") or {}).keys())
    out: dict[str, torch.Tensor] = {}
    for name, value in (first.get("module") or {}).items():
        key = f"{name}{SEP}{PARAM_KEY}"
        if key not in have and name not in shared and isinstance(value, torch.Tensor) and value.numel():
            out[key] = value.detach().float().clone()
    for name, shape in (first.get("frozen_param_shapes") or {}).items():  # ZeRO-3: padded partitions, in rank order
        frags = [s.get("frozen_param_fragments", {}).get(name) for s in states]
        key = f"{name}{SEP}{PARAM_KEY}"
        if files is ranked and key not in have and all(f is not None for f in frags):
            flat = torch.cat([f.reshape(-1).float() for f in frags])
            out[key] = flat[: torch.Size(shape).numel()].view(tuple(shape)).clone()
    return out


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
            raise CheckpointError(
                f"{path}: corrupt DCP checkpoint, shard file {rel!r} is truncated "
                f"({os.path.getsize(file)} of {size} bytes)"
            )


def _dcp_counters(path: str, sd: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
    """Step counters and world size of a DCP directory: the trainer's ``trainer_state.pt`` beside it, else
    top-level ``step`` / ``scheduler`` entries of the saved state dict; the world size from the shard files."""
    trainer = os.path.join(path, "trainer_state.pt")
    state = load_plain(trainer) if os.path.isfile(trainer) else sd
    if not isinstance(state, dict):
        raise CheckpointError(f"{trainer}: not the trainer's state (expected a dict with 'step' and 'scheduler')")
    world = state.get("world") if state is not sd else None
    return counters(state.get("step"), state.get("scheduler")), (
        int(world) if world else len(dcp_writer_ranks(path)) or None
    )


def _read_dcp(path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    _check_dcp_files(path)
    sd = read_dcp_state_dict(path)
    if "optim" not in sd or "model" not in sd:
        raise CheckpointError(f"{path}: DCP checkpoint lacks the 'model' and 'optim' entries of get_state_dict")
    extra, world = _dcp_counters(path, sd)
    tensors, meta = logical_from_state_dicts(sd["model"], sd["optim"], "dcp", world)
    meta["extra"] = extra
    return tensors, meta


def _infer_steps(ck: Checkpoint) -> None:
    """A checkpoint without a saved step (a DCP written by hand): the optimizer's own step counters say how
    many steps were taken; said in the notes, as is a missing LR-scheduler state."""
    extra = ck.meta.setdefault("extra", {})
    if extra.get("global_steps") is None:
        steps = [float(t.max()) for k, t in ck.tensors.items() if k.endswith(f"{SEP}step") and t.numel()]
        sched = extra.get("lr_scheduler") or {}
        if steps:
            extra["global_steps"] = int(max(steps))
            if sched.get("last_epoch") != extra["global_steps"]:  # a scheduler stepped with the optimizer agrees
                ck.notes.append(
                    f"no saved step counter; global step {extra['global_steps']} taken from the optimizer's step counts"
                )
    if not extra.get("lr_scheduler"):
        ck.notes.append(
            "no LR-scheduler state in the checkpoint: an engine loading it keeps its scheduler where "
            "it is (save scheduler.state_dict() as 'scheduler' next to 'model' and 'optim')"
        )


def read(path: str) -> Checkpoint:
    """The checkpoint ``path`` means (a file, a DeepSpeed, DCP or trainer run directory, a DDP rank file)."""
    found: Located = locate(path)
    notes = [found.note] if found.note else []
    if found.kind == "file":
        tensors, meta = read_state_file(found.path)
        if meta.get("engine") == "deepspeed":  # a tag directory of DeepSpeed's engine, named directly
            tensors.update(_deepspeed_module_entries(os.path.dirname(found.path), tensors, notes))
    elif found.kind == "deepspeed":
        state = _deepspeed_state(found.path)
        tensors, meta = read_state_file(state)
        tensors.update(_deepspeed_module_entries(os.path.dirname(state), tensors, notes))
    elif found.kind == "ddp":
        tensors, meta = read_ddp(found.path)
    else:
        tensors, meta = _read_dcp(found.path)
    ck = Checkpoint(tensors, meta, found.kind, found.path, notes)
    if found.kind in ("dcp", "ddp"):
        _infer_steps(ck)
    return ck


def read_any(path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any], str]:
    ck = read(path)
    return ck.tensors, ck.meta, ck.kind


def _shardopt_only(meta: dict[str, Any]) -> None:
    if meta.get("optimizer") is None:
        raise CheckpointError(
            "the checkpoint holds the state of an optimizer that is not shardopt's (no param group "
            "has a shardopt 'treatment'); only shardopt optimizers' checkpoints convert"
        )


def write_logical(path: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> str:
    _shardopt_only(meta)
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


def _matrix_of(name: str) -> tuple[str, int] | None:
    """``(parameter, index)`` of a batched parameter's matrix name ``<parameter>[e]``, else None."""
    if not name.endswith("]") or "[" not in name:
        return None
    base, _, index = name[:-1].rpartition("[")
    return (base, int(index)) if index.isdigit() else None


def _batched_params(meta: dict[str, Any]) -> set[str]:
    """Parameters of matrix-rule groups whose state is stored as their matrices' (``<name>[e]``)."""
    return {
        n
        for g in meta.get("param_groups", [])
        if g.get("treatment", "adamw") != "adamw"
        for n in g.get("params", [])
        if isinstance(n, str)
    }


def write_dcp(path: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> str:
    """A DCP directory in ``get_state_dict`` form, loadable with ``dcp.load`` + ``set_state_dict``."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    model: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}  # parameter -> key -> tensor (or "matrices" -> matrix -> key -> tensor)
    batched: dict[str, dict[int, dict[str, torch.Tensor]]] = {}  # parameter -> matrix -> key -> tensor
    stacked = _batched_params(meta)
    for k, v in tensors.items():
        name, key = k.split(SEP)
        found = _matrix_of(name)
        if found is not None and found[0] in stacked:
            batched.setdefault(found[0], {}).setdefault(found[1], {})[key] = v
        elif key == PARAM_KEY:
            model[name] = v
        else:
            state.setdefault(name, {})[key] = v
    kinds = meta.get("kinds", {})
    for name, matrices in batched.items():  # a batched parameter's matrices back into the one 3-D tensor
        order = [matrices[e] for e in sorted(matrices)]
        entries = state.setdefault(name, {})
        for key in order[0]:
            if key == PARAM_KEY:
                model[name] = torch.stack([m[key] for m in order])
            elif kinds.get(key) == "elements":
                entries[key] = torch.stack([m[key] for m in order])
            elif kinds.get(key, "tensor") == "tensor":
                entries[key] = order[0][key]
            else:
                for e in sorted(matrices):
                    entries.setdefault("matrices", {}).setdefault(matrix_name(name, e), {})[key] = matrices[e][key]
    _shardopt_only(meta)
    groups = [
        {k: (tuple(v) if isinstance(v, list) and k != "params" else v) for k, v in g.items()}
        for g in meta.get("param_groups", [])
    ]
    sd: dict[str, Any] = {"model": model, "optim": {"state": state, "param_groups": groups}}
    extra = meta.get("extra") or {}
    if extra.get("global_steps") is not None:  # the counters, where _dcp_counters reads them back
        sd["step"] = int(extra["global_steps"])
    if extra.get("lr_scheduler"):
        sd["scheduler"] = extra["lr_scheduler"]
    # written straight from memory (torch_save_to_dcp would round-trip a temporary file through full pickle)
    _save_state_dict(sd, storage_writer=FileSystemWriter(path), no_dist=True)
    return path
