"""Optimizer names -> classes, and ``create_optimizer``.

Each class carries its hyperparameter model (``cls.Config``, defined beside the algorithm: defaults, ranges,
docs and role table); everything here only looks it up. ``validate_hyperparameters`` turns a name and a
mapping (``create_optimizer``'s keywords, a DeepSpeed ``"shardopt"`` section, the trainer's ``optimizer``) into
that model, ``build_param_groups`` routes a model's parameters with its roles, and ``cls.from_config`` builds
the optimizer from it, so every entry point goes through the same object.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import pydantic
import torch
from torch import nn

from .alice import Alice, Alice0
from .asgo import ASGO, DASGO
from .base import ShardedOptimizer
from .config import ConfigError, OptimizerConfig, format_errors
from .hooks import inspect_model, watch_model
from .in_backward import StepDriver, check_in_backward_options, split_groups_by_layer
from .muon import Muon
from .racs import RACS
from .routing import RoleTable, forget_stand_ins, route
from .scale import SCALE
from .sinkgd import SinkGD
from .sumo import SUMO
from .swan import SWAN

__all__ = [
    "OPTIMIZERS",
    "ConfigError",
    "create_optimizer",
    "validate_hyperparameters",
    "build_param_groups",
    "build_optimizer",
    "optimizer_class",
    "optimizer_kwargs",
]

#: name -> optimizer class; the name is the class's matrix treatment (``cls.Config.treatment``)
OPTIMIZERS: dict[str, type[ShardedOptimizer]] = {
    cls.Config.treatment: cls for cls in (SCALE, SinkGD, RACS, Muon, SWAN, ASGO, DASGO, SUMO, Alice, Alice0)
}


def optimizer_class(name: Any, key: str = "optimizer") -> type[ShardedOptimizer]:
    """The class registered as ``name`` (any case); ``ConfigError`` at ``key`` listing the names otherwise."""
    cls = OPTIMIZERS.get(name.lower()) if isinstance(name, str) else None
    if cls is None:
        raise ConfigError(f"{key}: unknown optimizer {name!r}; choose one of {sorted(OPTIMIZERS)}")
    return cls


def validate_hyperparameters(
    name: str, hyperparameters: Mapping[str, Any], where: str = "shardopt", name_key: str | None = None
) -> OptimizerConfig:
    """The optimizer's config model from ``hyperparameters``; ``ConfigError`` naming each bad key as
    ``<where>.<key>`` (an unknown name at ``name_key``, default ``<where>.optimizer``)."""
    schema = optimizer_class(name, name_key or f"{where}.optimizer").Config
    try:
        return schema.model_validate(dict(hyperparameters))
    except pydantic.ValidationError as err:
        valid = ", ".join(sorted(schema.model_fields, key=lambda k: k in OptimizerConfig.model_fields))
        raise ConfigError(f"{format_errors(err, where)} [optimizer {schema.treatment!r} accepts: {valid}]") from None


def build_param_groups(
    model: nn.Module | Iterable[Any],
    name: str,
    cfg: OptimizerConfig,
    routing: Mapping[str, str] | None = None,
    unused: list[str] | None = None,
    roles: Mapping[str, str] | RoleTable | None = None,
) -> list[dict]:
    """Param groups routed by ``cfg.roles()``; AdamW groups carry every hyperparameter explicitly (wrappers that
    fill missing group keys from their own defaults, like ZeroRedundancyOptimizer and fairscale OSS, would
    otherwise give them the matrix rule's values). ``unused``, ``roles``: see ``routing.route``."""
    cls = optimizer_class(name)
    if isinstance(model, nn.Module):
        inspect_model(model)  # hooks.model_inspectors: engine adapters declare shapes (plugin.fsdp1)
    try:
        groups = route(model, cfg.roles(), routing, optimizer_name=name, unused=unused, roles=roles)
    finally:
        if isinstance(model, nn.Module):
            forget_stand_ins(model)  # an engine's stand-ins serve routing only (plugin.fsdp1)
    for g in groups:
        if g["treatment"] == "adamw":
            g.update(cfg.adamw_group(), eps_mode=cls.adamw_defaults["eps_mode"])
    return groups


def build_optimizer(
    model: nn.Module | Iterable[Any],
    cfg: OptimizerConfig,
    routing: Mapping[str, str] | None = None,
    name: str | None = None,
    *,
    step_in_backward: bool = False,
    bf16_updates: str = "nearest",
    bf16_seed: int = 0,
    clip_grad_per_param: float | None = None,
) -> ShardedOptimizer:
    """The optimizer for a validated ``cfg`` (see ``create_optimizer``, also for the keyword options); ``name`` as
    the user spelled it."""
    name = name or type(cfg).treatment
    # DDP in backward: routed by the wrapped module's names, hooked on the wrapper (its communication hook)
    inner = model.module if step_in_backward and isinstance(model, nn.parallel.DistributedDataParallel) else model
    groups = build_param_groups(inner, name, cfg, routing)
    if step_in_backward:
        if not isinstance(inner, nn.Module):
            raise ConfigError(
                "create_optimizer: step_in_backward=True needs the model (an nn.Module, or the DDP wrapper) to hook "
                f"its parameters, got {type(model).__name__}"
            )
        groups = split_groups_by_layer(groups, {id(p): n for n, p in inner.named_parameters()})
    opt = optimizer_class(name).from_config(groups, cfg)
    if isinstance(inner, nn.Module):  # hooks.model_watchers: an engine's layouts (legacy FSDP), and a DeepSpeed engine
        watch_model(inner, opt)  # that later runs the model with another optimizer raises (plugin.wrapped)
    if step_in_backward or bf16_updates != "nearest" or clip_grad_per_param is not None:
        StepDriver(opt, model, step_in_backward, bf16_updates, bf16_seed, clip_grad_per_param)
    return opt


def optimizer_kwargs(cfg: OptimizerConfig) -> dict[str, Any]:
    """Constructor keywords for wrappers that build the optimizer themselves (ZeroRedundancyOptimizer, OSS)."""
    return cfg.constructor_kwargs()


def create_optimizer(
    model: nn.Module | Iterable[Any],
    name: str,
    routing: Mapping[str, str] | None = None,
    *,
    step_in_backward: bool = False,
    bf16_updates: str = "nearest",
    bf16_seed: int = 0,
    clip_grad_per_param: float | None = None,
    **hyperparameters: Any,
) -> torch.optim.Optimizer:
    """Build shardopt optimizer ``name`` (a key of ``OPTIMIZERS``) for ``model``.

    Call it after ``fully_shard`` (FSDP2) or on the plain/DDP model; parameters are routed by role
    (see ``shardopt.optim.routing``); ``routing`` maps name patterns to roles or ``"adamw"``. As torch.optim,
    it also takes ``model.named_parameters()`` (roles from the names; state dicts carry ``param_names``) or a
    flat list of tensors (2-D tensors get the matrix rule, the rest AdamW).

    ``step_in_backward``: step each layer's param groups from backward as their gradients complete and free them
    (``shardopt.optim.in_backward``; one process, DDP, FSDP2; ``model`` must be the module backward runs through,
    e.g. the DDP wrapper). ``bf16_updates="stochastic"``: bf16 weights without an fp32 master copy take their
    updates with stochastic rounding seeded by ``bf16_seed``. ``clip_grad_per_param``: clip each parameter's
    gradient to this norm before its step (the in-backward stand-in for clipping by the global norm).
    """
    if step_in_backward:
        check_in_backward_options(hyperparameters)
    cfg = validate_hyperparameters(name, hyperparameters, where="create_optimizer")
    return build_optimizer(
        model,
        cfg,
        routing,
        name,
        step_in_backward=step_in_backward,
        bf16_updates=bf16_updates,
        bf16_seed=bf16_seed,
        clip_grad_per_param=clip_grad_per_param,
    )
