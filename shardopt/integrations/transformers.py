"""Hugging Face ``Trainer``: one line, ``shardopt.integrations.transformers.enable(trainer, "scale", lr=1e-3)``.

Call it after building the ``Trainer`` and before ``trainer.train()``. It replaces the Trainer's optimizer
factory (``create_optimizer``) by shardopt's, routed by shardopt's roles on the Trainer's model (embedding, LM
head, hidden matrices, GPT-2's ``Conv1D`` stored in x out, vectors to AdamW), and makes the Trainer's
``accelerator.prepare`` map the result (``shardopt.integrations.accelerate``):

* DeepSpeed ZeRO 1-3 (``args.deepspeed``: a dict or a JSON path, HF's ``"auto"`` values welcome): the
  optimizer and its hyperparameters can come from a ``"shardopt"`` section of that config (then ``enable(trainer)``
  needs no arguments; keyword arguments override the section); ZeRO's flat partitions are mapped to matrices and
  ``save_steps`` / ``resume_from_checkpoint`` save and restore shardopt's state through DeepSpeed's checkpoint
  directory, resumable at another world size or ZeRO stage. ZeRO-Offload (``offload_optimizer`` / ``offload_param``
  device ``"cpu"``) is supported: ``enable`` sets ``"zero_force_ds_cpu_optimizer": false`` for it, without which
  accelerate would replace the optimizer by ``DeepSpeedCPUAdam``; NVMe offload is refused.
* FSDP2 (``fsdp_config={"fsdp_version": 2}``): DTensor shards, checkpoints through the Trainer's own DCP path.
* Legacy FSDP (``fsdp="full_shard"``, ``fsdp_version`` 1, either ``use_orig_params``): the wrapped model's layouts
  (``shardopt.plugin.fsdp1``); ``save_steps`` / ``resume_from_checkpoint`` keep shardopt's logical state in the
  checkpoint directory (``integrations.accelerate.fsdp1_optimizer_io``) beside the Trainer's model files.
* DDP / one process: the plain optimizer.

An optimizer name with the suffix ``_layerwise`` (``enable(trainer, "scale_layerwise")``, as transformers names
``galore_adamw_layerwise``) steps each layer inside backward and frees its gradients
(``shardopt.optim.in_backward``), with the roles and one optimizer object as usual; one process and FSDP2
(DDP's wrapper is made after the optimizer, so its averaged gradients cannot reach the hooks: refused at the first
step's build, as DeepSpeed, ``gradient_accumulation_steps > 1`` and ``max_grad_norm > 0`` are at ``enable``).

The Trainer's LR scheduler scales every group's own learning rate (matrix ``lr`` and ``adam_lr``).
Hyperparameters set to ``"auto"`` take the ``TrainingArguments`` value (``lr``/``adam_lr``: ``learning_rate``,
``weight_decay``/``adam_weight_decay``: ``weight_decay``, ``adam_betas``: ``(adam_beta1, adam_beta2)``,
``adam_eps``: ``adam_epsilon``); keys not given keep shardopt's defaults for the optimizer.
"""

from __future__ import annotations

from typing import Any, Mapping

import pydantic

from ..optim.config import OptimizerConfig, format_errors
from ..optim.in_backward import check_in_backward_options
from ..optim.registry import OPTIMIZERS, ConfigError, build_optimizer, validate_hyperparameters
from ..plugin.deepspeed_engine import SECTION_UNKNOWN_KEY, ShardoptSection, apply_offload_keys
from .accelerate import patch_prepare, with_fsdp1_optimizer_io

__all__ = ["enable", "resolve_settings", "LAYERWISE"]

#: an optimizer name ending in this steps in backward (``step_in_backward=True``; transformers' GaLore spelling)
LAYERWISE = "_layerwise"

#: "auto" hyperparameters and the TrainingArguments they come from
_AUTO = {
    "lr": lambda a: a.learning_rate,
    "adam_lr": lambda a: a.learning_rate,
    "weight_decay": lambda a: a.weight_decay,
    "adam_weight_decay": lambda a: a.weight_decay,
    "adam_betas": lambda a: (a.adam_beta1, a.adam_beta2),
    "adam_eps": lambda a: a.adam_epsilon,
}


def _deepspeed_config(trainer: Any) -> dict[str, Any] | None:
    if not getattr(trainer, "is_deepspeed_enabled", False):
        return None
    plugin = trainer.accelerator.state.deepspeed_plugin
    return plugin.hf_ds_config.config


def resolve_settings(
    trainer: Any, optimizer: str | None, routing: Mapping[str, str] | None, hyperparameters: Mapping[str, Any]
) -> tuple[str, OptimizerConfig, dict[str, str]]:
    """The optimizer name, validated hyperparameters and routing: keyword arguments over the DeepSpeed config's
    ``"shardopt"`` section, ``"auto"`` values from ``trainer.args``."""
    section = ShardoptSection(optimizer=optimizer or "", params={}, routing={})
    where = "enable(...)"
    ds = _deepspeed_config(trainer)
    if ds is not None and "shardopt" in ds:
        if "optimizer" in ds:
            raise ConfigError(
                "DeepSpeed config has both an 'optimizer' block and a 'shardopt' section; remove the "
                "'optimizer' block (shardopt supplies the optimizer; keep 'scheduler' if you use one)"
            )
        try:
            section = ShardoptSection.model_validate(ds["shardopt"])
        except pydantic.ValidationError as err:
            raise ConfigError(format_errors(err, "shardopt", unknown=SECTION_UNKNOWN_KEY)) from None
        where = "shardopt.params"
    elif ds is not None and "optimizer" in ds:
        raise ConfigError(
            "the DeepSpeed config given to the Trainer has an 'optimizer' block, so DeepSpeed (not "
            "shardopt) would build the optimizer; remove it (shardopt.integrations.transformers.enable "
            "supplies the optimizer)"
        )
    name = optimizer or section.optimizer
    if not name:
        raise ConfigError(
            "shardopt.integrations.transformers.enable: name the optimizer, e.g. "
            "enable(trainer, 'scale', lr=1e-3), or add a 'shardopt' section to the DeepSpeed config"
        )
    if name.lower() not in OPTIMIZERS:
        raise ConfigError(f"enable(trainer, {name!r}): unknown optimizer; choose one of {sorted(OPTIMIZERS)}")
    params = {**section.params, **hyperparameters}
    for key, value in list(params.items()):
        if isinstance(value, str) and value == "auto":
            if key not in _AUTO and _own_auto(name, key):  # the optimizer's own "auto" (Muon's ns_dtype), not HF's
                section_params = (ds or {}).get("shardopt", {}).get("params")  # placeholder; accelerate refuses
                if isinstance(section_params, dict) and section_params.get(key) == "auto":  # any "auto" left in
                    del section_params[key]  # the config: it is the default, so the config says the same without it
                continue
            if key not in _AUTO:
                raise ConfigError(f"{where}.{key} = 'auto': only {sorted(_AUTO)} can be 'auto'")
            params[key] = _AUTO[key](trainer.args)
            if (
                ds is not None
                and isinstance(ds.get("shardopt", {}).get("params"), dict)
                and ds["shardopt"]["params"].get(key) == "auto"
            ):
                # fill it in the config too, as HF does with its own "auto" values: accelerate refuses any "auto"
                # left in the DeepSpeed config when it starts the engine
                ds["shardopt"]["params"][key] = list(params[key]) if isinstance(params[key], tuple) else params[key]
    cfg = validate_hyperparameters(name, params, where=where)
    return name.lower(), cfg, {**section.routing, **dict(routing or {})}


def _own_auto(name: str, key: str) -> bool:
    """Whether optimizer ``name``'s key ``key`` takes "auto" as a value of its own (and it is the default)."""
    import typing

    field = OPTIMIZERS[name.lower()].Config.model_fields.get(key)
    return field is not None and "auto" in typing.get_args(field.annotation) and field.default == "auto"


def _check_layerwise(trainer: Any, name: str) -> None:
    """What stepping in backward cannot do under the Trainer, refused with the setting that fixes it."""
    args = trainer.args
    where = f"enable(trainer, {name + LAYERWISE!r})"
    if _deepspeed_config(trainer) is not None:
        raise ConfigError(
            f"{where}: stepping in backward is not supported under DeepSpeed (ZeRO owns the gradient buffers and "
            f"steps after backward); use {name!r} with DeepSpeed, or FSDP2 / one process for {name + LAYERWISE!r}"
        )
    if getattr(args, "gradient_accumulation_steps", 1) > 1:
        raise ConfigError(
            f"{where}: TrainingArguments.gradient_accumulation_steps = {args.gradient_accumulation_steps}; stepping "
            "in backward steps every micro-batch: set gradient_accumulation_steps=1 (a larger per-device batch), "
            f"or use {name!r}"
        )
    if (getattr(args, "max_grad_norm", 0) or 0) > 0:
        raise ConfigError(
            f"{where}: TrainingArguments.max_grad_norm = {args.max_grad_norm} clips by the global norm, which is "
            "known only after every gradient, when the layers have been stepped already: set max_grad_norm=0 and, "
            "to bound updates, clip_grad_per_param=<norm> through shardopt.create_optimizer(..., "
            f"step_in_backward=True) (docs/guides/memory.md), or use {name!r}"
        )


def enable(
    trainer: Any, optimizer: str | None = None, routing: Mapping[str, str] | None = None, **hyperparameters: Any
) -> Any:
    """Make ``trainer`` train with shardopt optimizer ``optimizer`` (default: the DeepSpeed config's
    ``"shardopt"`` section); returns the trainer. See the module docstring."""
    if getattr(trainer, "optimizer", None) is not None:
        raise ConfigError(
            "the Trainer already has an optimizer (Trainer(optimizers=(opt, ...))); with "
            "shardopt.integrations.transformers.enable pass optimizers=(None, None) and let enable "
            "build it (under DeepSpeed the Trainer would drop a given optimizer anyway)"
        )
    layerwise = isinstance(optimizer, str) and optimizer.lower().endswith(LAYERWISE)
    if layerwise:
        assert optimizer is not None
        optimizer = optimizer[: -len(LAYERWISE)]
        _check_layerwise(trainer, optimizer)
        hyperparameters = dict(hyperparameters)
        check_in_backward_options(hyperparameters)
    name, cfg, route = resolve_settings(trainer, optimizer, routing, hyperparameters)
    ds = _deepspeed_config(trainer)
    if ds is not None:  # ZeRO-Offload: the keys that keep this optimizer (accelerate would swap in DeepSpeedCPUAdam)
        apply_offload_keys(ds, where="the Trainer's DeepSpeed config (TrainingArguments(deepspeed=...))")

    def create_optimizer(model: Any = None) -> Any:
        """shardopt's optimizer for the Trainer's model (``Trainer.create_optimizer``'s contract: build once)."""
        if trainer.optimizer is None:
            opt_model = trainer.model if model is None else model
            trainer.optimizer = build_optimizer(opt_model, cfg, route, name, step_in_backward=layerwise)
        return trainer.optimizer

    trainer.create_optimizer = create_optimizer
    trainer._shardopt = (name, cfg, route)
    patch_prepare(trainer.accelerator)
    for method in ("_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler"):  # legacy FSDP checkpoints
        setattr(trainer, method, with_fsdp1_optimizer_io(getattr(trainer, method), "transformers.trainer"))
    return trainer
