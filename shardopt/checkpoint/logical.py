"""Optimizer state (and the fp32 parameters it steps) with logical, unsharded meaning.

``export_state`` gathers every rank's pieces to rank 0 and assembles, for every parameter name, the full
tensors: element-wise state and the parameter itself in the parameter's shape, per-row/per-column
statistics as whole vectors, scalars once. ``import_state`` does the inverse on any engine and world size:
each rank cuts its own pieces out of the full tensors. How an entry relates to its parameter comes from the
optimizer's ``state_kinds``; the layout of each piece comes from the fragments the engine adapters build,
so nothing here knows about DeepSpeed or FSDP.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..optim.base import ShardedOptimizer
from ..sharding.fragment import Fragment
from ..sharding.layout import MatrixLayout

__all__ = ["export_state", "import_state", "CheckpointError", "PARAM_KEY", "SEP"]

PARAM_KEY = "param"  # the fp32 values the optimizer steps (master weights under mixed precision)
SEP = "::"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, truncated or does not match the model; nothing was loaded."""


def _entries(opt: ShardedOptimizer, p: torch.Tensor, frag: Fragment) -> dict[str, torch.Tensor]:
    """State entries of one fragment: tensor-level ones plus its per-matrix ones."""
    st = opt.state.get(p, {})
    out = {k: v for k, v in st.items() if k != "matrices"}
    out.update(st.get("matrices", {}).get(frag.name, {}))
    return out


def _local_records(opt: ShardedOptimizer, include_params: bool) -> list[tuple]:
    records = []
    for p in opt.stepped_tensors():
        for frag in opt.fragments(p):
            lay = frag.layout
            meta = (frag.name, lay.shape, frag.logical_shape, lay.pieces, lay.rank)
            items = dict(_entries(opt, p, frag))
            if include_params:
                items[PARAM_KEY] = p
            for key, value in items.items():
                kind = "elements" if key == PARAM_KEY else opt.state_kinds.get(key)
                if kind is None:
                    raise CheckpointError(f"state entry {key!r} of {frag.name!r} has no declared kind in "
                                          f"{type(opt).__name__}.state_kinds")
                if kind == "elements":
                    data = frag.local(value).detach().float().cpu().clone()
                elif kind in ("rows", "cols"):
                    owned = lay.axis_plan(0 if kind == "rows" else 1).owned
                    data = torch.zeros_like(value, dtype=torch.float32, device="cpu")
                    data[owned] = value.detach().float().cpu()[owned]
                else:
                    data = value.detach().float().cpu().clone() if isinstance(value, torch.Tensor) \
                        else torch.tensor(float(value))
                records.append((meta, key, kind, data))
    return records


def export_state(opt: ShardedOptimizer, include_params: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Full logical tensors ``{"<name>::<key>": tensor}`` and ``{key: kind}``, on rank 0 (others get ``{}``).

    Collective when ``torch.distributed`` is initialized: every rank must call it.
    """
    opt.sync_state()
    records = _local_records(opt, include_params)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(records, gathered, dst=0)
        if dist.get_rank() != 0:
            return {}, {}
        all_records = [r for part in gathered for r in part]
    else:
        all_records = records
    kinds: dict[str, str] = {}
    full: dict[str, torch.Tensor] = {}
    seen: set[tuple] = set()
    logical_shapes: dict[str, tuple] = {}
    for (name, shape2d, logical, pieces, rank), key, kind, data in all_records:
        logical_shapes.setdefault(name, logical)
        ident = (name, key, rank)
        if ident in seen:
            continue  # replicas (DDP, HSDP) hold the same piece
        seen.add(ident)
        kinds[key] = kind
        k = f"{name}{SEP}{key}"
        if kind == "elements":
            if k not in full:
                full[k] = torch.zeros(shape2d, dtype=torch.float32)
            lay = MatrixLayout(shape2d, pieces, rank)
            for b, view in lay.views(data):
                full[k][b.row: b.row + b.height, b.col: b.col + b.width] = view
        elif kind in ("rows", "cols"):
            full[k] = full[k] + data if k in full else data.clone()
        elif k not in full:
            full[k] = data
    for k, v in list(full.items()):
        name, key = k.split(SEP)
        if kinds[key] == "elements":
            full[k] = v.reshape(logical_shapes[name]).contiguous()
    return full, kinds


def _piece(full: torch.Tensor, frag: Fragment) -> torch.Tensor:
    full2d = full.reshape(frag.layout.shape)
    local = torch.empty(frag.numel, dtype=torch.float32)
    for b, view in frag.layout.views(local):
        view.copy_(full2d[b.row: b.row + b.height, b.col: b.col + b.width])
    return local


def import_state(opt: ShardedOptimizer, full: dict[str, torch.Tensor], kinds: dict[str, str],
                 load_params: bool = True) -> None:
    """Rebuild this rank's optimizer state (and stepped parameters) from full logical tensors.

    Everything is checked and built first; the optimizer is changed only if every entry is present and has
    the right shape, so a bad checkpoint leaves nothing half-loaded.
    """
    new_state: dict[torch.Tensor, dict] = {}
    param_writes: list[tuple[torch.Tensor, torch.Tensor]] = []
    names_in_file = {k.split(SEP)[0] for k in full}
    for p in opt.stepped_tensors():
        frags = opt.fragments(p)
        st: dict[str, Any] = {}
        for frag in frags:
            if frag.name not in names_in_file:
                raise CheckpointError(f"checkpoint has no entries for parameter {frag.name!r}; it was saved from "
                                      "another model or is incomplete")
            for k in [k for k in full if k.split(SEP)[0] == frag.name]:
                key = k.split(SEP)[1]
                kind, value = kinds.get(key), full[k]
                numel = 1
                for s in frag.logical_shape:
                    numel *= s
                if kind == "elements" and value.numel() != numel:
                    raise CheckpointError(f"{k}: checkpoint shape {tuple(value.shape)} does not match the "
                                          f"parameter's {frag.logical_shape}")
                if key == PARAM_KEY:
                    if load_params:
                        param_writes.append((frag.local(p), _piece(value, frag)))
                    continue
                if kind == "elements":
                    if key not in st:
                        st[key] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
                    param_writes.append((frag.local(st[key]), _piece(value, frag)))
                elif kind == "tensor":
                    st[key] = value.clone()
                elif kind in ("rows", "cols", "scalar", "matrix"):
                    target = st.setdefault("matrices", {}).setdefault(frag.name, {}) if opt.is_flat(p) else st
                    target[key] = value.clone().to(frag.local(p).device)
                else:
                    raise CheckpointError(f"{k}: unknown kind {kind!r}")
        new_state[p] = st
    with torch.no_grad():
        for dst, src in param_writes:
            dst.copy_(src.to(dst.dtype))
    opt.state.clear()
    for p, st in new_state.items():
        if st:
            opt.state[p] = st
