"""Never step a tensor whose matrices are unknown: find the engine wrapper that replaced the parameters, or fail.

A shardopt optimizer handed to DeepSpeed by someone else (Hugging Face ``Trainer``, ``accelerate``, a plain
``deepspeed.initialize(optimizer=opt)``) receives ZeRO's flat fp32 partitions instead of the parameters it was
built with. Stepping such a 1-D tensor as an ``(N, 1)`` matrix runs sign-SGD and the loss still falls, so
before every step ``check_stepped_tensors`` looks at each tensor of every matrix group:

* a tensor whose matrices were declared (``attach_fragments``), or a real 2-D parameter: fine;
* anything else (a flat partition, a ZeRO-3 parameter whose data DeepSpeed replaced): the DeepSpeed ZeRO
  wrapper that is calling us is looked up on the call stack (it calls ``self.optimizer.step()`` itself, so it
  is the caller a few frames up, and the engine above it). Found: its partitions are mapped to matrices
  (``attach_zero_layouts``) and the engine's checkpoint hooks installed, exactly as
  ``shardopt.deepspeed.initialize`` does. Not found: ``UnmappedTensorError`` naming the tensor and the fix.

The decision depends only on the static structure every rank shares (same wrapper, same groups), so all ranks
map, or all raise, at the same step, before any collective.
"""
from __future__ import annotations

import sys
import warnings
from types import SimpleNamespace
from typing import Any

import torch

__all__ = ["UnmappedTensorError", "check_stepped_tensors", "find_deepspeed_caller", "map_deepspeed"]

#: how far up the stack the ZeRO wrapper and the engine are looked for (engine.step -> wrapper.step ->
#: wrapper._optimizer_step -> our step is 3-6 frames; accelerate adds 2)
_MAX_FRAMES = 40

_FIX = ("build the engine with shardopt.deepspeed.initialize(model=..., config=...), or call "
        "shardopt.deepspeed.attach_zero_layouts(engine, optimizer, names) right after deepspeed.initialize; "
        "with Hugging Face use shardopt.integrations.transformers.enable(trainer, ...) or "
        "shardopt.integrations.accelerate.prepare(accelerator, model, optimizer)")


class UnmappedTensorError(RuntimeError):
    """A matrix rule was asked to step a tensor whose matrices shardopt cannot map."""


def _needs_mapping(opt: Any, p: torch.Tensor) -> bool:
    if opt.is_flat(p):
        return False
    return p.dim() != 2 or hasattr(p, "ds_id")


def _zero_wrapper_types() -> tuple[type, ...]:
    if "deepspeed" not in sys.modules:  # DeepSpeed never imported: no wrapper can be calling us
        return ()
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3, BF16_Optimizer)


def find_deepspeed_caller(opt: Any) -> tuple[Any, Any]:
    """``(wrapper, engine)``: the DeepSpeed ZeRO wrapper on the call stack whose client optimizer is ``opt``, and
    the engine above it (``None`` for what is not found)."""
    types = _zero_wrapper_types()
    if not types:
        return None, None
    from deepspeed.runtime.engine import DeepSpeedEngine

    wrapper = engine = None
    frame = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if wrapper is None and isinstance(owner, types) and getattr(owner, "optimizer", None) is opt:
            wrapper = owner
        elif wrapper is not None and isinstance(owner, DeepSpeedEngine) and owner.optimizer is wrapper:
            engine = owner
            break
        frame = frame.f_back
    return wrapper, engine


def map_deepspeed(opt: Any, wrapper: Any, engine: Any = None) -> None:
    """Map ``wrapper``'s flat partitions to ``opt``'s matrices and, given the engine, install the checkpoint
    hooks (``engine.save_checkpoint`` / ``load_checkpoint`` also write / read shardopt's logical state)."""
    from .deepspeed_engine import attach_zero_layouts, install_checkpoint_hooks

    names = dict(opt.param_names)
    attach_zero_layouts(engine if engine is not None else SimpleNamespace(optimizer=wrapper), opt, names)
    if engine is not None and not getattr(engine, "_shardopt_hooks", False):
        install_checkpoint_hooks(engine, opt, names)
        engine._shardopt_hooks = True


def _describe(opt: Any, p: torch.Tensor) -> str:
    if hasattr(p, "ds_id"):
        return (f"parameter {opt.param_names.get(id(p), '?')!r} whose data DeepSpeed ZeRO-3 replaced (logical "
                f"shape {tuple(getattr(p, 'ds_shape', ()))})")
    return f"a {p.dim()}-D tensor of shape {tuple(p.shape)} that is none of the parameters it was built with"


def check_stepped_tensors(opt: Any) -> None:
    """Before a step: every tensor of a matrix group must be a real matrix or a declared flat partition; map a
    DeepSpeed wrapper found on the call stack, else raise ``UnmappedTensorError``."""
    bad = [(g, p) for g in opt.param_groups if g.get("treatment", "adamw") != "adamw"
           for p in g["params"] if _needs_mapping(opt, p)]
    if not bad:
        return
    wrapper, engine = find_deepspeed_caller(opt)
    if wrapper is not None:
        map_deepspeed(opt, wrapper, engine)
        if engine is None:
            warnings.warn(f"{type(opt).__name__}: mapped DeepSpeed's {type(wrapper).__name__} partitions to "
                          "matrices at the first step, but found no engine to hook checkpoints into; "
                          + _FIX, RuntimeWarning, stacklevel=4)
        bad = [(g, p) for g, p in bad if _needs_mapping(opt, p)]
        if not bad:
            return
    group, p = bad[0]
    holder = type(wrapper).__name__ if wrapper is not None else "a wrapper (DeepSpeed ZeRO or similar)"
    raise UnmappedTensorError(
        f"{type(opt).__name__} was asked to step {_describe(opt, p)} in its {group['treatment']!r} matrix group: "
        f"{holder} replaced the parameters and shardopt does not know which matrices this tensor holds "
        f"(stepping it would treat it as a ({p.numel()}, 1) matrix, i.e. sign-SGD). Fix: {_FIX}")

