"""DeepSpeed's ``load_checkpoint`` on shardopt's resharding path (another data-parallel size or ZeRO stage, or a
checkpoint converted from another engine), with DeepSpeed's options meaning what they mean on its own path.

The optimizer's parameters and state come from shardopt's logical file (exact fp32, any layout). What the
optimizer does not step, frozen parameters and persistent buffers, comes from DeepSpeed's own model-states files
in the tag directory (the module state dict of ZeRO-0/1/2, ZeRO-3's per-rank frozen fragments), or from the
logical file where a conversion put it there. Those files are read with DeepSpeed's checkpoint engine, as its own
load does (full pickle: trusted files only). ``load_checkpoint`` returns what DeepSpeed returns: the model-states
file read and the checkpoint's entries that are not DeepSpeed's own.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from ..optim.base import ShardedOptimizer

__all__ = [
    "load_resharded",
    "module_extras",
    "read_model_states",
    "refuse_load_universal",
    "mark_not_universal",
    "UNIVERSAL_ROUTE",
]

#: what DeepSpeed's universal-checkpoint route would give, and where shardopt gives it
UNIVERSAL_ROUTE = (
    "shardopt's optimizer state (row/column statistics, bases, whole-matrix state) is not Adam's exp_avg/exp_avg_sq, "
    "which is all DeepSpeed's universal checkpoint holds; shardopt's own checkpoints are universal already: "
    "engine.load_checkpoint(<dir>) loads them at any world size and ZeRO stage (shardopt.checkpoint), and "
    "`shardopt checkpoint convert <dir> <out> --to dcp|file|deepspeed` converts them for FSDP2 or one file "
    "(docs/checkpoints.md)"
)

_PLAIN = "mp_rank_00_model_states.pt"
_ZERO3 = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt$")


def read_model_states(engine: Any, tag_dir: str) -> tuple[str | None, dict | None, list[dict]]:
    """DeepSpeed's model-states file(s) of a tag: (the path DeepSpeed's own load would return for this rank, its
    contents, every ZeRO-3 rank's contents in rank order); ``(None, None, [])`` where DeepSpeed wrote none (a
    converted checkpoint)."""
    load = engine.checkpoint_engine.load
    plain = os.path.join(tag_dir, _PLAIN)
    if os.path.isfile(plain):
        return plain, load(plain, map_location=torch.device("cpu")), []
    found = sorted((int(m.group(1)), name) for name in os.listdir(tag_dir) if (m := _ZERO3.match(name)))
    if not found:
        return None, None, []
    ranks = [load(os.path.join(tag_dir, name), map_location=torch.device("cpu")) for _, name in found]
    mine = min(dist.get_rank(), len(found) - 1) if dist.is_initialized() else 0
    return os.path.join(tag_dir, found[mine][1]), ranks[mine], ranks


def _zero3_frozen(ranks: list[dict], name: str) -> torch.Tensor | None:
    """A frozen parameter of a ZeRO-3 checkpoint: every rank's padded partition, concatenated and cut to shape."""
    shapes = ranks[0].get("frozen_param_shapes") or {}
    if name not in shapes or any(name not in (r.get("frozen_param_fragments") or {}) for r in ranks):
        return None
    shape = torch.Size(shapes[name])
    flat = torch.cat([r["frozen_param_fragments"][name].reshape(-1) for r in ranks])
    return flat[: shape.numel()].view(shape)


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``module.state_dict`` holds (non-persistent ones are rebuilt by the model, never saved)."""
    out: dict[str, torch.Tensor] = {}
    for prefix, mod in module.named_modules():
        for name, buf in mod.named_buffers(recurse=False):
            if buf is not None and name not in mod._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out


def module_extras(
    module: nn.Module,
    checkpoint: dict | None,
    zero3_ranks: list[dict],
    reader: Any,
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], list[str], list[str]]:
    """What the optimizer does not step: ``{name: (target tensor, saved value)}`` for the module's frozen
    parameters and persistent buffers, the names the checkpoint lacks, and the checkpoint's module entries
    that the module does not have (``load_module_strict``)."""
    from ..checkpoint.logical import PARAM_KEY, SEP

    saved = (checkpoint or {}).get("module") or {}
    targets: dict[str, torch.Tensor] = {n: p for n, p in module.named_parameters() if not p.requires_grad}
    targets.update(persistent_buffers(module))
    found: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    missing: list[str] = []
    for name, target in targets.items():
        numel = int(getattr(target, "ds_numel", target.numel()))
        value = _zero3_frozen(zero3_ranks, name) if zero3_ranks else None
        if value is None and name in saved and saved[name].numel() == numel:
            value = saved[name]
        if value is None and reader is not None and f"{name}{SEP}{PARAM_KEY}" in reader.index:
            value = reader.whole(f"{name}{SEP}{PARAM_KEY}")
        if value is None or value.numel() != numel:
            missing.append(name)
        else:
            found[name] = (target, value)
    known = {n for n, _ in module.named_parameters(remove_duplicate=False)} | set(persistent_buffers(module))
    unexpected = sorted(k for k in saved if k not in known)
    return found, missing, unexpected


def _copy_into(target: torch.Tensor, value: torch.Tensor) -> None:
    """``value`` (the whole tensor) into ``target``: this rank's ZeRO-3 partition, or the whole tensor."""
    with torch.no_grad():
        flat = value.reshape(-1)
        if hasattr(target, "ds_tensor"):
            part = target.ds_tensor.numel()
            group = getattr(target, "ds_process_group", None)
            rank = dist.get_rank(group=group)
            lo, hi = min(rank * part, flat.numel()), min((rank + 1) * part, flat.numel())
            target.ds_tensor.data.zero_()
            target.ds_tensor.data[: hi - lo].copy_(flat[lo:hi].to(target.ds_tensor.dtype))
        else:
            target.data.copy_(flat.view_as(target.data).to(target.dtype))


def _full_state_dict(
    module: nn.Module, reader: Any, extras: Mapping[str, tuple], names: Mapping[int, str]
) -> dict[str, torch.Tensor]:
    """The whole module state dict from the checkpoint (what ``custom_load_fn`` gets as ``src``, as DeepSpeed
    hands it the saved module): trained parameters from shardopt's fp32 values, the rest from ``extras``."""
    from ..checkpoint.logical import fill_param_range

    out: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        shape = tuple(getattr(p, "ds_shape", p.shape))
        buf = torch.empty(int(torch.Size(shape).numel()), dtype=torch.float32)
        key = names.get(id(p), name)
        if p.requires_grad and fill_param_range(reader, key, 0, buf.numel(), buf):
            out[name] = buf.view(shape).to(p.dtype)
    out.update({n: v.view(tuple(getattr(t, "ds_shape", t.shape))).to(t.dtype) for n, (t, v) in extras.items()})
    return out


def _restore_masters_from_module(engine: Any) -> None:
    """fp32 masters from the module's weights after ``custom_load_fn`` changed them (DeepSpeed's own step)."""
    restore = getattr(engine.optimizer, "_restore_from_bit16_weights", None)
    if restore is not None:
        restore()


def load_resharded(
    engine: Any,
    opt: ShardedOptimizer,
    names: Mapping[int, str],
    load_dir: str,
    tag: str,
    *,
    load_module_strict: bool,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    load_module_only: bool,
    custom_load_fn: Callable | None,
    sync_bit16: Callable[[Any, Any, Mapping[int, str]], None],
) -> tuple[str, dict]:
    """``engine.load_checkpoint`` from shardopt's file at ``<load_dir>/<tag>``. Collective (every rank)."""
    from .. import checkpoint as ckpt

    tag_dir = os.path.join(load_dir, tag)
    ours = ckpt.state_path(tag_dir)
    extra = ckpt.read_metadata(ours).get("extra") or {}
    load_path, checkpoint, zero3_ranks = read_model_states(engine, tag_dir)
    full = load_optimizer_states and not load_module_only
    pipeline = hasattr(engine.module, "load_state_dir") and checkpoint is not None and checkpoint.get("module") is None
    with ckpt.StateReader(ours) as reader:
        # everything checked before anything changes (ckpt.load checks its own part the same way)
        extras, missing, unexpected = (
            ({}, [], []) if pipeline else module_extras(engine.module, checkpoint, zero3_ranks, reader)
        )
        if load_module_strict and (missing or unexpected):
            raise RuntimeError(
                f"{tag_dir}: the checkpoint does not match the model (load_module_strict=True): missing "
                f"{missing or 'nothing'}, unexpected {unexpected or 'nothing'}; a checkpoint saved with "
                "exclude_frozen_parameters=True has no frozen parameters: pass load_module_strict=False to keep "
                "the model's own values for what is missing"
            )
        if pipeline:  # a PipelineModule keeps its layers in files of their own, readable at any layout
            engine.module.load_state_dir(tag_dir, checkpoint_engine=engine.checkpoint_engine, strict=load_module_strict)
        if custom_load_fn is not None:
            src = _full_state_dict(engine.module, reader, extras, names)
            from deepspeed import zero

            fetch = [p for p in engine.module.parameters() if hasattr(p, "ds_id")]
            with zero.GatheredParameters(fetch, modifier_rank=0):
                custom_load_fn(src=src, dst=engine.module)
            _restore_masters_from_module(engine)
        else:
            for target, value in extras.values():
                _copy_into(target, value)
        if custom_load_fn is None or full:  # DeepSpeed's full load takes the fp32 values over custom_load_fn's
            ckpt.load(ours, opt, load_params=True, load_state=full)
            sync_bit16(engine, reader, names)
    if not load_module_only:
        saved = (checkpoint if checkpoint is not None else extra).get("lr_scheduler")
        if load_lr_scheduler_states and saved and engine.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(saved)
        source = checkpoint if checkpoint is not None else extra
        if source.get("global_steps") is not None:
            engine.global_steps = source["global_steps"]
            engine.global_samples = source.get("global_samples", engine.global_steps * engine.train_batch_size())
            engine.skipped_steps = source.get("skipped_steps", engine.skipped_steps)
    if checkpoint is None:  # converted: no DeepSpeed files, the client state travelled in shardopt's metadata
        return ours, dict(extra.get("client_state") or {})
    engine.loaded_checkpoint_dp_world_size = checkpoint.get("dp_world_size")
    assert load_path is not None  # read_model_states gives both or neither
    return load_path, client_state(checkpoint, load_optimizer_states, load_lr_scheduler_states, load_module_only)


def client_state(
    checkpoint: dict, load_optimizer_states: bool, load_lr_scheduler_states: bool, load_module_only: bool
) -> dict:
    """What DeepSpeed's ``_load_checkpoint`` returns as the client state: the entries it did not consume."""
    consumed = (
        ["module"]
        if load_module_only
        else ["module", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size", "data_sampler", "random_ltd"]
    )
    if load_lr_scheduler_states:
        consumed.append("lr_scheduler")
    if load_optimizer_states:
        consumed.append("optimizer")
    return {k: v for k, v in checkpoint.items() if k not in consumed}


def refuse_load_universal(cfg: Mapping[str, Any]) -> None:
    """``"checkpoint": {"load_universal": true}`` refused at ``initialize`` (DeepSpeed's own load would fail later
    with a bare assertion), with the route that works."""
    from ..optim.registry import ConfigError

    section = cfg.get("checkpoint") or {}
    if isinstance(section, Mapping) and section.get("load_universal"):
        raise ConfigError(
            f"checkpoint.load_universal = true: {UNIVERSAL_ROUTE}. Remove checkpoint.load_universal "
            "and call engine.load_checkpoint on the directory shardopt's engine saved"
        )


#: DeepSpeed's key for AutoEP layer metadata, which ``ds_to_universal`` validates first on a ZeRO-3 checkpoint
_AUTOEP_LAYERS = "ds_autoep_layers"


def _zero3_stop(message: str) -> list[dict]:
    """Two AutoEP layer entries with the same ``moe_layer_id``: ``ds_to_universal`` validates them before it
    reads any ZeRO-3 optimizer file and stops with ``RuntimeError: ds_autoep_layers metadata has duplicate
    moe_layer_id: <message>``. Nothing else reads them on a model without MoE layers (DeepSpeed's load reads them
    only for MoE layers, ``zero_to_fp32`` only entries of the partitioned format, which these are not)."""
    entry = {
        "moe_layer_id": message,
        "module_path": "",
        "num_experts": 1,
        "num_local_experts": 1,
        "ep_size": 1,
        "expert_key_prefix": "",
    }
    return [entry, {**entry, "expert_key_prefix": "-"}]


def mark_not_universal(client_state: Mapping[str, Any], engine: Any = None) -> dict[str, Any]:
    """The client state DeepSpeed saves, marked so that ``ds_to_universal`` stops at once with
    ``UNIVERSAL_ROUTE`` before it reads any optimizer state (which would fail with ``KeyError: 'exp_avg'``):
    on ZeRO-1/2 a ``universal_checkpoint_info`` whose unsupported-parameter check runs first, on ZeRO-3 AutoEP
    metadata that its first validation refuses (``_zero3_stop``). An engine with DeepSpeed MoE layers is left
    unmarked: its save reserves both keys for DeepSpeed's own metadata."""
    from deepspeed.checkpoint.constants import (
        AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS,
        UNIVERSAL_CHECKPOINT_INFO,
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    )

    if engine is not None and getattr(engine, "has_moe_layers", False):
        return dict(client_state)
    info = dict(client_state.get(UNIVERSAL_CHECKPOINT_INFO) or {})
    info.setdefault(UNIVERSAL_CHECKPOINT_VERSION_KEY, UNIVERSAL_CHECKPOINT_VERSION_VALUE)
    # DeepSpeed prints "... conversion is not supported for <key>: <value>": the key finishes its sentence in
    # shardopt's words (it is only ever printed), where a pattern (".*") would read as noise before them
    info[AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS] = {"shardopt's checkpoints": UNIVERSAL_ROUTE}
    marked = {**client_state, UNIVERSAL_CHECKPOINT_INFO: info}
    if engine is not None and engine.zero_optimization_stage() == 3 and _AUTOEP_LAYERS not in client_state:
        marked[_AUTOEP_LAYERS] = _zero3_stop(f"not convertible, shardopt's checkpoint: {UNIVERSAL_ROUTE}")
    return marked
