"""``accelerate``: one call, ``shardopt.integrations.accelerate.prepare(accelerator, model, optimizer, ...)``.

It is ``accelerator.prepare`` followed by what shardopt needs from the objects accelerate built:

* DeepSpeed plugin: the engine's ZeRO partitions are mapped to matrices (as ``shardopt.deepspeed.initialize``
  does) and ``engine.save_checkpoint`` / ``load_checkpoint`` (which ``accelerator.save_state`` / ``load_state``
  call) also write / read shardopt's logical state, so a run resumes at another world size or ZeRO stage.
* FSDP2: accelerate swaps the optimizer's parameters for the sharded DTensors; shardopt's parameter names
  (roles, seeded draws, checkpoints) move to the new tensors, position by position.
* Legacy FSDP (FSDP1, ``use_orig_params=True``): the optimizer keeps the model's parameters, which now hold 1-D
  views of flat shards; their shapes and pieces are read from the wrapped model (``plugin.fsdp1.adopt``).
  ``save_state`` / ``load_state`` write and read shardopt's logical state for it (``fsdp1_optimizer_io``): FSDP1's own
  optimizer state dict, which accelerate would call, reshapes state like flat shards and is refused.

A plain ``accelerator.prepare`` with DeepSpeed also works: the first step finds the engine on the call stack and
maps it (``shardopt.plugin.wrapped``); calling this function does it before any checkpoint is loaded.
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref
from typing import Any, Iterator

import torch

from ..optim.base import ShardedOptimizer
from ..optim.describe import expose_describe
from ..plugin.fsdp1 import adopt
from ..plugin.wrapped import engine_hooked, map_deepspeed, rekey_names
from ..sharding.precision import model_arrival_dtypes, record_arrival_dtypes

__all__ = [
    "prepare",
    "after_prepare",
    "keep_optimizer_under_offload",
    "patch_prepare",
    "patch_checkpoints",
    "unwrap_optimizer",
    "rekey_names",
    "fsdp1_optimizer_io",
    "FSDP1_OPTIMIZER_DIR",
]


#: accelerators whose ``prepare`` already maps shardopt optimizers (``patch_prepare``)
_PATCHED: "weakref.WeakSet[Any]" = weakref.WeakSet()


def unwrap_optimizer(obj: Any) -> ShardedOptimizer | None:
    """The shardopt optimizer inside accelerate's / DeepSpeed's wrappers, if any."""
    for _ in range(4):
        if isinstance(obj, ShardedOptimizer):
            return obj
        obj = getattr(obj, "optimizer", None)
    return None


def after_prepare(accelerator: Any, objects: Any) -> None:
    """Map what ``accelerator.prepare`` built around a shardopt optimizer (see the module docstring)."""
    objects = objects if isinstance(objects, (tuple, list)) else (objects,)
    # the prepared optimizer and (DeepSpeed) engine get describe(): the role table (optim.describe)
    expose_describe(*(obj for obj in objects if isinstance(obj, (torch.optim.Optimizer, torch.nn.Module))))
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    engine = getattr(wrapped, "engine", None)
    if engine is not None:
        opt = unwrap_optimizer(getattr(engine, "optimizer", None))
        if opt is not None and not engine_hooked(engine):
            map_deepspeed(opt, engine.optimizer, engine)
        return
    models = [obj for obj in objects if isinstance(obj, torch.nn.Module)]
    for obj in objects:
        opt = unwrap_optimizer(obj)
        if opt is not None:
            rekey_names(opt)
            adopt(models, opt)
            for model in models:  # FSDP2's mixed precision is known only now (numerical-zero cutoffs follow it)
                record_arrival_dtypes(opt, model_arrival_dtypes(model))


def _optimizer_from_section(accelerator: Any, args: tuple) -> tuple:
    """With a DeepSpeed plugin whose config has a ``"shardopt"`` section and no optimizer among ``args``: build
    the section's optimizer for the model and put it right after the model."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    config = getattr(getattr(plugin, "hf_ds_config", None), "config", None) or {}
    if "shardopt" not in config or any(isinstance(a, torch.optim.Optimizer) for a in args):
        return args
    from ..optim.registry import build_optimizer
    from ..plugin.deepspeed_engine import parse_section

    models = [i for i, a in enumerate(args) if isinstance(a, torch.nn.Module)]
    if len(models) != 1:
        raise ValueError(
            "shardopt.integrations.accelerate.prepare: the DeepSpeed config has a 'shardopt' section "
            f"and no optimizer was given, so exactly one model is needed (got {len(models)})"
        )
    section, hp = parse_section({k: v for k, v in config.items() if k in ("shardopt", "optimizer")})
    model = args[models[0]]
    opt = build_optimizer(model, hp, section.routing, section.optimizer)
    return args[: models[0] + 1] + (opt,) + args[models[0] + 1 :]


def keep_optimizer_under_offload(accelerator: Any, args: tuple) -> None:
    """With a DeepSpeed plugin whose config offloads the optimizer (``zero_optimization.offload_optimizer.device``
    ``"cpu"``) and a shardopt optimizer among ``args``: set ``"zero_force_ds_cpu_optimizer": false`` (and
    ``"zero_allow_untested_optimizer": true``) in that config, in place, before accelerate reads it. Left at its
    default (true), accelerate's ``prepare`` replaces any optimizer by ``DeepSpeedCPUAdam`` (its
    ``map_pytorch_optim_to_deepspeed``) and the shardopt optimizer is lost. NVMe offload is refused with the key
    named (``deepspeed_engine.offload_devices``)."""
    plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
    config = getattr(getattr(plugin, "hf_ds_config", None), "config", None)
    if not isinstance(config, dict) or not any(unwrap_optimizer(a) is not None for a in args):
        return
    from ..plugin.deepspeed_engine import apply_offload_keys

    apply_offload_keys(config, where="accelerate's DeepSpeed config (DeepSpeedPlugin(hf_ds_config=...))")


def prepare(accelerator: Any, *args: Any, **kwargs: Any) -> Any:
    """``accelerator.prepare(*args, **kwargs)``, then shardopt's mapping of the engine or the DTensors; returns
    what ``accelerator.prepare`` returns. With a DeepSpeed config holding a ``"shardopt"`` section and no
    optimizer in ``args``, the section's optimizer is built and returned after the model. With optimizer offload
    the keys that keep the shardopt optimizer are set (``keep_optimizer_under_offload``)."""
    args = _optimizer_from_section(accelerator, args)
    keep_optimizer_under_offload(accelerator, args)
    result = accelerator.prepare(*args, **kwargs)
    after_prepare(accelerator, result)
    patch_checkpoints(accelerator)
    return result


def patch_prepare(accelerator: Any) -> None:
    """Make this accelerator's own ``prepare`` do ``after_prepare`` (what ``transformers.enable`` uses, since
    ``Trainer`` calls ``accelerator.prepare`` itself), and its ``save_state`` / ``load_state`` keep a shardopt
    optimizer's state under legacy FSDP (``fsdp1_optimizer_io``)."""
    if accelerator in _PATCHED:
        return
    original = accelerator.prepare

    def prepare_and_map(*args: Any, **kwargs: Any) -> Any:
        keep_optimizer_under_offload(accelerator, args)
        result = original(*args, **kwargs)
        after_prepare(accelerator, result)
        return result

    accelerator.prepare = prepare_and_map
    _PATCHED.add(accelerator)
    patch_checkpoints(accelerator)


#: accelerators whose ``save_state`` / ``load_state`` keep shardopt's state under legacy FSDP (``patch_checkpoints``)
_CHECKPOINTS: "weakref.WeakSet[Any]" = weakref.WeakSet()


def patch_checkpoints(accelerator: Any) -> None:
    """Make this accelerator's ``save_state`` / ``load_state`` write and read a shardopt optimizer's logical state
    under legacy FSDP (``fsdp1_optimizer_io``); ``prepare`` and ``patch_prepare`` call it."""
    if accelerator in _CHECKPOINTS:
        return
    for method in ("save_state", "load_state"):
        setattr(accelerator, method, with_fsdp1_optimizer_io(getattr(accelerator, method), "accelerate.accelerator"))
    _CHECKPOINTS.add(accelerator)


#: the folder, inside a checkpoint directory, that holds a shardopt optimizer's logical state under legacy FSDP
#: (its name contains "optimizer", which the Trainer looks for before it resumes an optimizer)
FSDP1_OPTIMIZER_DIR = "shardopt_optimizer"


def _fsdp1_io(original: Any, write: bool) -> Any:
    """accelerate's ``save_fsdp_optimizer`` (``write``) or ``load_fsdp_optimizer``, writing / reading a shardopt
    optimizer's logical state under legacy FSDP and leaving everything else to ``original``."""

    def fsdp_optimizer_io(
        fsdp_plugin: Any, accelerator: Any, optimizer: Any, model: Any, *args: Any, **kwargs: Any
    ) -> None:
        opt = unwrap_optimizer(optimizer)
        if opt is None or getattr(fsdp_plugin, "fsdp_version", 1) != 1:
            return original(fsdp_plugin, accelerator, optimizer, model, *args, **kwargs)
        from ..checkpoint import load, save

        # accelerate's (output_dir | input_dir, optimizer_index=0, ...), by position or by name
        directory = args[0] if args else kwargs["output_dir" if write else "input_dir"]
        index = args[1] if len(args) > 1 else kwargs.get("optimizer_index", 0)
        path = os.path.join(directory, f"{FSDP1_OPTIMIZER_DIR}_{index}")
        if write:
            save(path, opt, engine="fsdp1")
        else:
            if hasattr(accelerator, "wait_for_everyone"):  # as accelerate's own load: every rank's files written
                accelerator.wait_for_everyone()
            load(path, opt)

    return fsdp_optimizer_io


@contextlib.contextmanager
def fsdp1_optimizer_io(module_name: str) -> Iterator[None]:
    """Within the block, module ``module_name``'s ``save_fsdp_optimizer`` / ``load_fsdp_optimizer`` (accelerate's,
    which ``accelerate.accelerator`` and ``transformers.trainer`` call) write and read a shardopt optimizer's logical
    state (``shardopt.checkpoint``: any world size, FSDP2 and DeepSpeed load it) under legacy FSDP, instead of
    FSDP1's optimizer state dict; everything else goes to accelerate's functions unchanged."""
    module: Any = sys.modules.get(module_name)  # accelerate's or transformers': its functions are patched below
    if module is None or not hasattr(module, "save_fsdp_optimizer"):
        yield
        return
    saved = module.save_fsdp_optimizer, module.load_fsdp_optimizer
    module.save_fsdp_optimizer, module.load_fsdp_optimizer = _fsdp1_io(saved[0], True), _fsdp1_io(saved[1], False)
    try:
        yield
    finally:
        module.save_fsdp_optimizer, module.load_fsdp_optimizer = saved


def with_fsdp1_optimizer_io(method: Any, module_name: str) -> Any:
    """``method`` (a bound ``save_state``-like method) run inside ``fsdp1_optimizer_io(module_name)``."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with fsdp1_optimizer_io(module_name):
            return method(*args, **kwargs)

    return wrapped
