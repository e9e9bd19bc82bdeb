"""Never step a tensor whose matrices are unknown: find the engine wrapper that replaced the parameters, or fail.

A shardopt optimizer handed to DeepSpeed by someone else (Hugging Face ``Trainer``, ``accelerate``, a plain
``deepspeed.initialize(optimizer=opt)``) receives ZeRO's flat fp32 partitions instead of the parameters it was
built with. Stepping such a 1-D tensor as an ``(N, 1)`` matrix runs sign-SGD and the loss still falls, so
before every step ``check_stepped_tensors`` looks at each tensor of every matrix group:

* a tensor whose matrices were declared (``use_layouts(flat=...)``), or a real 2-D parameter: fine;
* anything else (a flat partition, a ZeRO-3 parameter whose data DeepSpeed replaced): the DeepSpeed ZeRO
  wrapper that is calling us is looked up on the call stack (it calls ``self.optimizer.step()`` itself, so it
  is the caller a few frames up, and the engine above it). Found: its partitions are mapped to matrices
  (``attach_zero_layouts``) and the engine's checkpoint hooks installed, exactly as
  ``shardopt.deepspeed.initialize`` does. Not found: ``UnmappedTensorError`` naming the tensor and the fix.

The decision depends only on the static structure every rank shares (same wrapper, same groups), so all ranks
map, or all raise, at the same step, before any collective.

The optimizers do not import this module (the engine boundary, ``tests/test_import_graph.py``): it registers
``check_stepped_tensors``, ``names_from_trainer`` and ``watch_model`` in ``shardopt.optim.hooks`` when imported,
and ``shardopt/__init__.py`` imports it, so the hooks are in place before any optimizer is built.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from types import FrameType, SimpleNamespace
from typing import Any

import torch

from ..optim import hooks
from ..optim.routing import declare_module_roles, find_roles, logical_shape, warn_unknown_matrices
from ..sharding.precision import model_arrival_dtypes, record_arrival_dtypes

__all__ = [
    "UnmappedTensorError",
    "check_stepped_tensors",
    "rekey_names",
    "find_deepspeed_caller",
    "map_deepspeed",
    "engine_hooked",
    "names_from_trainer",
    "watch_model",
]

#: DeepSpeed engines whose save/load_checkpoint already write/read shardopt's logical state (kept beside the
#: engines, not as attributes on them)
_HOOKED_ENGINES: "weakref.WeakSet[Any]" = weakref.WeakSet()


def engine_hooked(engine: Any) -> bool:
    """Whether ``map_deepspeed`` already installed shardopt's checkpoint hooks on ``engine``."""
    return engine in _HOOKED_ENGINES


#: how far up the stack the ZeRO wrapper and the engine are looked for (engine.step -> wrapper.step ->
#: wrapper._optimizer_step -> our step is 3-6 frames; accelerate adds 2)
_MAX_FRAMES = 40

_FIX = (
    "build the engine with shardopt.deepspeed.initialize(model=..., config=...), or call "
    "shardopt.deepspeed.attach_zero_layouts(engine, optimizer, names) right after deepspeed.initialize; "
    "with Hugging Face use shardopt.integrations.transformers.enable(trainer, ...) or "
    "shardopt.integrations.accelerate.prepare(accelerator, model, optimizer)"
)


class UnmappedTensorError(RuntimeError):
    """A matrix rule was asked to step a tensor whose matrices shardopt cannot map."""


def _needs_mapping(opt: Any, p: torch.Tensor) -> bool:
    if opt.is_flat(p):
        return False
    # a matrix or a batch of them (fused experts), also as a declared flattened view (legacy FSDP: plugin.fsdp1)
    return len(logical_shape(p)) not in (2, 3) or hasattr(p, "ds_id")


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
    frame: FrameType | None = sys._getframe(1)
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
    if engine is not None and not engine_hooked(engine):
        install_checkpoint_hooks(engine, opt, names)
        _HOOKED_ENGINES.add(engine)
    from ..optim.describe import expose_describe

    expose_describe(engine, wrapper)  # their describe(): the role table (optim.describe)


def _describe(opt: Any, p: torch.Tensor) -> str:
    if hasattr(p, "ds_id"):
        return (
            f"parameter {opt.param_names.get(id(p), '?')!r} whose data DeepSpeed ZeRO-3 replaced (logical "
            f"shape {tuple(getattr(p, 'ds_shape', ()))})"
        )
    return f"a {p.dim()}-D tensor of shape {tuple(p.shape)} that is none of the parameters it was built with"


def rekey_names(opt: Any) -> None:
    """After a wrapper replaced the tensors in ``opt.param_groups`` in place by DTensors (accelerate's FSDP2
    ``fsdp2_switch_optimizer_parameters``), give each new tensor the name of the one it replaced (names choose
    seeded draws and checkpoint keys, so ``param@<address>`` would make SUMO / Alice differ from one process)."""
    changed = False
    for group, names in zip(opt._groups(), opt.group_param_names):
        if len(group["params"]) != len(names):
            continue
        for p, name in zip(group["params"], names):
            if opt.param_names.get(id(p)) != name and hasattr(p, "placements") and not opt.is_flat(p):
                opt.param_names[id(p)] = name
                opt._fragments.pop(id(p), None)
                changed = True
    if changed:
        opt._forget_plans()


def check_stepped_tensors(opt: Any) -> None:
    """Before a step: every tensor of a matrix group must be a real matrix or a declared flat partition; map a
    DeepSpeed wrapper found on the call stack, else raise ``UnmappedTensorError``. DTensors a wrapper swapped in
    for the parameters get the replaced parameters' names."""
    stepped = [p for g in opt.param_groups for p in g["params"]]
    verified = opt.__dict__.get("_verified_tensors")
    if verified is not None and len(verified) == len(stepped) and all(a is b for a, b in zip(verified, stepped)):
        return  # the same tensors as at the last check, which passed (use_layouts drops this)
    if any(id(p) not in opt.param_names and hasattr(p, "placements") for p in stepped):
        rekey_names(opt)
    bad = [
        (g, p)
        for g in opt.param_groups
        if g.get("treatment", "adamw") != "adamw"
        for p in g["params"]
        if _needs_mapping(opt, p)
    ]
    if not bad:
        opt._verified_tensors = stepped
        return
    wrapper, engine = find_deepspeed_caller(opt)
    if wrapper is not None:
        map_deepspeed(opt, wrapper, engine)
        if engine is None:
            warnings.warn(
                f"{type(opt).__name__}: mapped DeepSpeed's {type(wrapper).__name__} partitions to "
                "matrices at the first step, but found no engine to hook checkpoints into; " + _FIX,
                RuntimeWarning,
                stacklevel=4,
            )
        bad = [(g, p) for g, p in bad if _needs_mapping(opt, p)]
        if not bad:
            return
    group, p = bad[0]
    holder = type(wrapper).__name__ if wrapper is not None else "a wrapper (DeepSpeed ZeRO or similar)"
    raise UnmappedTensorError(
        f"{type(opt).__name__} was asked to step {_describe(opt, p)} in its {group['treatment']!r} matrix group: "
        f"{holder} replaced the parameters and shardopt does not know which matrices this tensor holds "
        f"(stepping it would treat it as a ({p.numel()}, 1) matrix, i.e. sign-SGD). Fix: {_FIX}"
    )


# ------------------------------------------------------------------ Hugging Face Trainer's own optimizer paths
def _trainer_model(max_frames: int = 12) -> Any:
    """The model of a ``transformers.Trainer.create_optimizer`` that is constructing an optimizer right now
    (``optimizer_cls_and_kwargs=(SCALE, ...)``), else None."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(max_frames):
        if frame is None:
            return None
        if frame.f_code.co_name == "create_optimizer" and str(frame.f_globals.get("__name__", "")).startswith(
            "transformers."
        ):
            model = frame.f_locals.get("opt_model")
            return model if isinstance(model, torch.nn.Module) else None
        frame = frame.f_back
    return None


def names_from_trainer(params: Any, who: str) -> Any:
    """Hugging Face ``Trainer.create_optimizer`` passes decay / no-decay groups of unnamed tensors, which would
    lose shardopt's roles (embedding normalized per row, LM head without momentum, GPT-2's Conv1D on the wrong
    axis). Called from there, name every tensor from the Trainer's model and give it its role from the model's
    module types (``routing.find_roles``); any other call is returned unchanged."""
    if not isinstance(params, (list, tuple)) or not params or not all(isinstance(g, dict) for g in params):
        return params
    model = _trainer_model()
    if model is None:
        return params
    names = {id(p): n for n, p in model.named_parameters()}
    tensors = [t for g in params for t in (g["params"] if isinstance(g["params"], (list, tuple)) else [g["params"]])]
    if not all(isinstance(t, torch.Tensor) and id(t) in names for t in tensors):
        return params  # named already, or not the model's parameters: leave torch.optim's rules to apply
    table = find_roles(model)
    roles, sources = table.roles, table.sources
    warn_unknown_matrices(model, {}, who)
    out = []
    for g in params:
        group = dict(g)
        group["params"] = [(names[id(t)], t) for t in group["params"]]
        declare_module_roles(
            (t, roles[n], sources[n]) for n, t in group["params"]
        )  # groups.normalize_param_groups reads them
        out.append(group)
    return out


class _WatchEngine:
    """Forward pre-hook of a model given to ``shardopt.create_optimizer``: on the first training forward, if a
    DeepSpeed engine runs the model but steps no shardopt optimizer (``Trainer(optimizers=(opt, None))`` under
    DeepSpeed: the Trainer drops the given optimizer and builds torch AdamW), raise instead of training with
    AdamW in silence. Picklable (holds only the optimizer's class name)."""

    def __init__(self, who: str):
        self.who = who
        self.handle: Any = None

    def __getstate__(self) -> dict:
        return {"who": self.who, "handle": None}

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        if self.handle is not None:
            self.handle.remove()
        if "deepspeed" not in sys.modules:
            return
        from deepspeed.runtime.engine import DeepSpeedEngine

        frame: FrameType | None = sys._getframe(1)
        for _ in range(_MAX_FRAMES):
            if frame is None:
                return
            engine = frame.f_locals.get("self")
            if isinstance(engine, DeepSpeedEngine) and engine.module is module:
                break
            frame = frame.f_back
        else:
            return
        from ..optim.base import ShardedOptimizer

        inner = engine.optimizer
        for _ in range(4):
            if isinstance(inner, ShardedOptimizer):
                return
            inner = getattr(inner, "optimizer", None)
        client = type(getattr(engine, "basic_optimizer", None) or engine.optimizer).__name__
        if client.startswith("DeepSpeedCPU") and _offloads_optimizer(engine) and "accelerate" in sys.modules:
            raise UnmappedTensorError(
                f"a shardopt {self.who} optimizer was built for this model, but the DeepSpeed engine running it "
                f"steps {client}: accelerate's Accelerator.prepare (which the Hugging Face Trainer calls too) "
                "replaced it (accelerate.utils.map_pytorch_optim_to_deepspeed), because the DeepSpeed config "
                "offloads the optimizer (zero_optimization.offload_optimizer.device 'cpu') and leaves "
                '"zero_force_ds_cpu_optimizer" at its default, true. Fix: set "zero_force_ds_cpu_optimizer": false '
                "in the DeepSpeed config, or prepare with shardopt.integrations.accelerate.prepare(accelerator, "
                "model, optimizer) (with the Trainer: shardopt.integrations.transformers.enable(trainer, ...)), "
                "which sets it"
            )
        raise UnmappedTensorError(
            f"a shardopt {self.who} optimizer was built for this model, but the DeepSpeed engine running it steps "
            f"{client}: the wrapper that set DeepSpeed up dropped the shardopt optimizer (Hugging Face Trainer "
            "does so with Trainer(optimizers=(opt, None)) under DeepSpeed). Fix: with the Trainer call "
            "shardopt.integrations.transformers.enable(trainer, ...) and pass no optimizer; with DeepSpeed "
            "directly use shardopt.deepspeed.initialize(model=..., config=...)"
        )


def _offloads_optimizer(engine: Any) -> bool:
    """Whether a DeepSpeed engine's config offloads the optimizer (ZeRO-Offload, CPU or NVMe)."""
    try:
        return bool(engine.zero_use_cpu_optimizer())
    except Exception:  # noqa: BLE001 - an engine without that method or config: no offload to blame
        return False


def watch_model(model: torch.nn.Module, who: str) -> None:
    """Install ``_WatchEngine`` on ``model`` (removed after its first training forward)."""
    watch = _WatchEngine(who)
    watch.handle = model.register_forward_pre_hook(watch)


def _watch_created(model: Any, opt: Any) -> None:
    """``hooks.model_watchers`` entry: ``create_optimizer`` built ``opt`` for ``model``."""
    if isinstance(model, torch.nn.Module):
        watch_model(model, type(opt).__name__)
        # bf16/fp16 weights or FSDP2 mixed precision: the rules' numerical-zero cutoffs follow that precision
        record_arrival_dtypes(opt, model_arrival_dtypes(model))


hooks.register_pre_step_check(check_stepped_tensors)
hooks.register_param_source(names_from_trainer)
hooks.register_model_watcher(_watch_created)
