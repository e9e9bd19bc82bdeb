"""What a model holds that its optimizer does not step: frozen parameters and persistent buffers, in the same
logical form as the optimizer's (``"<name>::param"``, each rank writing only its piece).

``shardopt.checkpoint.save(path, opt, model=model)`` writes them beside the optimizer's state, so that one
shardopt checkpoint restores the whole model at any world size and engine (``load(path, opt, model=model)``),
and conversions to DCP or DeepSpeed carry them (``convert`` reads every ``::param`` entry as a module entry).
A frozen FSDP2 parameter is written as its ``Shard(0)`` rows and read back as the rows this rank holds now; a
plain or replicated tensor is written once (by the first rank holding it) and read whole.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

from ..sharding.layout import FlatPiece
from .errors import CheckpointError
from .files import _natural_view
from .logical import PARAM_KEY, SEP, Record

__all__ = ["check_module_state", "load_module_state", "missing_message", "module_records", "module_tensors"]


def module_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Frozen parameters (a tied one once, under its first name) and persistent buffers, by state-dict name.
    ZeRO-3's partitioned parameters are refused: its engine's checkpoints keep them (``engine.save_checkpoint``)."""
    out: dict[str, torch.Tensor] = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    zero3 = [n for n, p in model.named_parameters() if hasattr(p, "ds_id")]
    if zero3:
        raise CheckpointError(
            f"model= of shardopt.checkpoint: {zero3[0]!r} is a ZeRO-3 partitioned parameter; "
            "save and load a DeepSpeed engine with engine.save_checkpoint / load_checkpoint, "
            "which restore frozen parameters and buffers at any world size and stage"
        )
    for prefix, mod in model.named_modules():
        for name, buf in mod.named_buffers(recurse=False):
            if buf is not None and name not in mod._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, int, int] | None:
    """A DTensor sharded on dim 0 over one mesh dimension: (local tensor, first global row, global rows)."""
    placements = getattr(t, "placements", None)
    if placements is None:
        return None
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    dt = cast("DTensor", t)  # it has placements
    if all(isinstance(pl, Replicate) for pl in placements):
        return dt.to_local(), 0, t.shape[0] if t.dim() else 1
    if len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0:
        return None
    shape, offset = compute_local_shape_and_global_offset(t.shape, dt.device_mesh, dt.placements)
    return dt.to_local(), int(offset[0]), int(shape[0])


def module_records(model: nn.Module) -> list[Record]:
    """This rank's pieces of ``module_tensors(model)``. Collective only where a DTensor is neither replicated
    nor row-sharded (then gathered whole, every rank in the same order)."""
    records: list[Record] = []
    for name, t in module_tensors(model).items():
        shape = tuple(t.shape)
        view_rows, view_cols = _natural_view(shape)
        view = (view_rows, view_cols)
        key = f"{name}{SEP}{PARAM_KEY}"
        rows = _rows(t)
        if rows is not None and rows[2] != (shape[0] if shape else 1) and shape:  # a row shard
            local, lo, n = rows
            width = math.prod(shape[1:])
            if n:
                records.append(
                    Record(
                        key,
                        "elements",
                        shape,
                        view,
                        FlatPiece(lo * width, (lo + n) * width),
                        local.detach().reshape(-1),
                    )
                )
            continue
        whole = rows[0] if rows is not None else (t.full_tensor() if hasattr(t, "full_tensor") else t)
        records.append(Record(key, "elements", shape, view, FlatPiece(0, math.prod(shape)), whole.detach().reshape(-1)))
    return records


def missing_message(path: str, missing: list[str]) -> str:
    """The refusal of a strict load that lacks ``missing``, with the ways out."""
    return (
        f"{path}: the checkpoint has no saved value for {missing}: it was saved without model= "
        "(shardopt.checkpoint.save(path, optimizer, model=model)), from another model, or by DeepSpeed's "
        "engine, whose files beside it hold them (`shardopt checkpoint convert <dir> <out> --to file` puts them "
        "in one file); pass strict=False to keep the model's own values for them"
    )


def check_module_state(reader: Any, model: nn.Module) -> list[str]:
    """The names of ``module_tensors(model)`` the checkpoint lacks or holds with another number of elements."""
    missing = []
    for name, t in module_tensors(model).items():
        entry = reader.index.get(f"{name}{SEP}{PARAM_KEY}")
        if entry is None or math.prod(entry["shape"]) != t.numel():
            missing.append(name)
    return missing


def load_module_state(reader: Any, model: nn.Module, strict: bool = True) -> list[str]:
    """Frozen parameters and persistent buffers from the checkpoint into ``model``, each rank reading its rows.
    Everything is checked first: with ``strict`` a missing entry raises and nothing changes; otherwise what is
    missing keeps the model's own value. Returns the names not loaded."""
    missing = check_module_state(reader, model)
    if missing and strict:
        raise CheckpointError(missing_message(reader.path, missing))
    todo = {n: t for n, t in module_tensors(model).items() if n not in missing}
    reader.check_files([f"{n}{SEP}{PARAM_KEY}" for n in todo])
    with torch.no_grad():
        for name, t in todo.items():
            key = f"{name}{SEP}{PARAM_KEY}"
            rows = _rows(t)
            shape = tuple(t.shape)
            if rows is not None and shape and rows[2] != shape[0]:
                local, lo, n = rows
                width = math.prod(shape[1:])
                buf = torch.empty(n * width, dtype=torch.float32)
                if n:
                    reader.fill(key, FlatPiece(lo * width, (lo + n) * width), buf)
                    local.copy_(buf.view_as(local).to(local.dtype))
                continue
            target = rows[0] if rows is not None else t
            if hasattr(target, "full_tensor"):  # another placement: the whole tensor set through DTensor
                whole = reader.whole(key).to(t.dtype)
                from torch.distributed.tensor import distribute_tensor

                dt = cast("DTensor", t)  # it has full_tensor
                t.copy_(distribute_tensor(whole.view(shape), dt.device_mesh, dt.placements))
                continue
            buf = torch.empty(target.numel(), dtype=torch.float32)
            reader.fill(key, FlatPiece(0, target.numel()), buf)
            target.copy_(buf.view_as(target).to(target.dtype))
    return missing
