"""Optimizer names, their hyperparameter schemas (pydantic) and role tables; ``create_optimizer``."""
from __future__ import annotations

from typing import Any, Callable, Literal, Mapping

import pydantic
import torch
from torch import nn

from .racs import RACS
from . import routing as _routing
from .routing import route
from .muon import Muon
from .scale import SCALE
from .sinkgd import SinkGD
from .swan import SWAN

__all__ = ["OPTIMIZERS", "create_optimizer", "validate_hyperparameters"]


class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", allow_inf_nan=False, strict=False)


class _AdamFields(_Strict):
    on_nonfinite: Literal["skip", "raise", "ignore"] = pydantic.Field(
        "skip", description="a step with inf/NaN gradients on any rank: skip it everywhere, raise, or no check")
    debug_plan: bool = pydantic.Field(False, description="check every step that all ranks hold the same plan")
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = pydantic.Field(1e-8, ge=0)
    adam_weight_decay: float = pydantic.Field(0.0, ge=0)

    @pydantic.field_validator("adam_betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        for i, b in enumerate(v):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"adam_betas[{i}] = {b} is outside [0, 1)")
        return v


class SCALEConfig(_AdamFields):
    """specs/scale.md: matrix lr 1e-3, LM-head momentum 0.9, RMS clamp 1e-8, AdamW 1e-3 for vectors."""

    lr: float = pydantic.Field(1e-3, ge=0)
    momentum: float = pydantic.Field(0.9, ge=0, lt=1, description="EMA beta of the LM-head momentum")
    eps: float = pydantic.Field(1e-8, gt=0)
    norm: Literal["rms", "l2"] = "rms"
    weight_decay: float = pydantic.Field(0.0, ge=0)
    adam_lr: float = pydantic.Field(1e-3, ge=0)
    embedding_momentum: float = pydantic.Field(0.0, ge=0, lt=1, description="Tab. 8 'mmt-(first+last)' variant")


class SinkGDConfig(_AdamFields):
    """specs/sinkgd.md: global lr 0.02, matrix lr scale 0.05, L = 5; AdamW at the global lr."""

    lr: float = pydantic.Field(0.02, ge=0)
    lr_scale: float = pydantic.Field(0.05, ge=0)
    iterations: int = pydantic.Field(5, ge=1)
    weight_decay: float = pydantic.Field(0.0, ge=0)
    adam_lr: float | None = pydantic.Field(None, ge=0, description="default: lr")


class RACSConfig(_AdamFields):
    """specs/racs_alice.md: lambda 0.02, beta 0.9, alpha 0.05, gamma 1.01, 5 fixed-point steps."""

    lr: float = pydantic.Field(0.02, ge=0)
    beta: float = pydantic.Field(0.9, ge=0, lt=1)
    alpha: float = pydantic.Field(0.05, ge=0)
    gamma: float = pydantic.Field(1.01, ge=1)
    iterations: int = pydantic.Field(5, ge=1)
    weight_decay: float = pydantic.Field(0.0, ge=0)
    adam_lr: float | None = pydantic.Field(None, ge=0, description="default: lr")


class MuonConfig(_AdamFields):
    """torch.optim.Muon's defaults: lr 1e-3, momentum 0.95 (Nesterov), wd 0.1, 5 quintic NS steps."""

    lr: float = pydantic.Field(1e-3, ge=0)
    momentum: float = pydantic.Field(0.95, ge=0, lt=1)
    nesterov: bool = True
    weight_decay: float = pydantic.Field(0.1, ge=0)
    ns_steps: int = pydantic.Field(5, ge=1, lt=100)
    eps: float = pydantic.Field(1e-7, gt=0)
    adjust_lr_fn: Literal["original", "match_rms_adamw"] | None = None
    ns_dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    adam_lr: float | None = pydantic.Field(None, ge=0, description="default: lr")


class SWANConfig(_AdamFields):
    """specs/sinkgd.md 1.4: SWAN-dagger lr 0.02 x 0.05, one normalize+whiten sweep, no centering."""

    lr: float = pydantic.Field(0.02, ge=0)
    lr_scale: float = pydantic.Field(0.05, ge=0)
    iterations: int = pydantic.Field(1, ge=1)
    center: bool = False
    whitening: Literal["newton_schulz", "svd"] = "newton_schulz"
    ns_steps: int = pydantic.Field(12, ge=1, lt=100, description="coupled Newton-Schulz steps (converges)")
    weight_decay: float = pydantic.Field(0.0, ge=0)
    adam_lr: float | None = pydantic.Field(None, ge=0, description="default: lr")


def _scale_roles(cfg: SCALEConfig) -> dict[str, dict]:
    return {
        "matrix": {"treatment": "scale", "norm_dim": 1, "momentum": 0.0},
        "embedding": {"treatment": "scale", "norm_dim": 0, "momentum": cfg.embedding_momentum},
        "lm_head": {"treatment": "scale", "norm_dim": 1, "momentum": cfg.momentum},
        "vector": {"treatment": "adamw"},
    }


def _matrix_only_roles(treatment: str) -> Callable[[Any], dict[str, dict]]:
    def table(cfg: Any) -> dict[str, dict]:
        return {
            "matrix": {"treatment": treatment},
            "embedding": {"treatment": "adamw"},
            "lm_head": {"treatment": "adamw"},
            "vector": {"treatment": "adamw"},
        }

    return table


# name -> (class, config schema, role table, constructor kwargs from config)
OPTIMIZERS: dict[str, tuple[type, type[pydantic.BaseModel], Callable[[Any], dict[str, dict]]]] = {
    "scale": (SCALE, SCALEConfig, _scale_roles),
    "sinkgd": (SinkGD, SinkGDConfig, _matrix_only_roles("sinkgd")),
    "racs": (RACS, RACSConfig, _matrix_only_roles("racs")),
    "muon": (Muon, MuonConfig, _matrix_only_roles("muon")),
    "swan": (SWAN, SWANConfig, _matrix_only_roles("swan")),
}


ConfigError = _routing.ConfigError


def _format_errors(err: pydantic.ValidationError, where: str) -> str:
    lines = []
    for e in err.errors():
        path = ".".join(str(x) for x in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"{where}.{path}: unknown hyperparameter")
        else:
            lines.append(f"{where}.{path}: {e['msg']} (got {e.get('input')!r})")
    return "; ".join(lines)


def validate_hyperparameters(name: str, hyperparameters: Mapping[str, Any], where: str = "shardopt",
                             name_key: str | None = None) -> pydantic.BaseModel:
    """Check an optimizer name and its hyperparameters; raise ``ConfigError`` naming the bad key."""
    key = name.lower() if isinstance(name, str) else name
    if key not in OPTIMIZERS:
        raise ConfigError(f"{name_key or where + '.optimizer'}: unknown optimizer {name!r}; "
                          f"choose one of {sorted(OPTIMIZERS)}")
    schema = OPTIMIZERS[key][1]
    try:
        return schema(**dict(hyperparameters))
    except pydantic.ValidationError as err:
        valid = ", ".join(schema.model_fields)
        raise ConfigError(f"{_format_errors(err, where)} [optimizer {key!r} accepts: {valid}]") from None


def build_param_groups(model: nn.Module, name: str, cfg: pydantic.BaseModel,
                       routing: Mapping[str, str] | None = None) -> list[dict]:
    cls, _, roles = OPTIMIZERS[name.lower()]
    groups = route(model, roles(cfg), routing, optimizer_name=name)
    # AdamW groups carry every hyperparameter explicitly: wrappers that fill missing group keys from their own
    # defaults (ZeroRedundancyOptimizer, fairscale OSS) would otherwise give them the matrix rule's values.
    adam_lr = getattr(cfg, "adam_lr", None)
    for g in groups:
        if g["treatment"] == "adamw":
            g.update(lr=adam_lr if adam_lr is not None else cfg.lr, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps,
                     weight_decay=cfg.adam_weight_decay, eps_mode=cls.adamw_defaults["eps_mode"])
    return groups


def optimizer_kwargs(cfg: pydantic.BaseModel) -> dict[str, Any]:
    kw = cfg.model_dump()
    kw.pop("embedding_momentum", None)
    return kw


def create_optimizer(model: nn.Module, name: str, routing: Mapping[str, str] | None = None,
                     **hyperparameters: Any) -> torch.optim.Optimizer:
    """Build shardopt optimizer ``name`` ("scale" | "sinkgd" | "racs") for ``model``.

    Call it after ``fully_shard`` (FSDP2) or on the plain/DDP model; parameters are routed by role
    (see ``shardopt.optim.routing``); ``routing`` maps name patterns to roles or ``"adamw"``.
    """
    cfg = validate_hyperparameters(name, hyperparameters, where="create_optimizer")
    groups = build_param_groups(model, name, cfg, routing)
    cls = OPTIMIZERS[name.lower()][0]
    return cls(groups, **optimizer_kwargs(cfg))
