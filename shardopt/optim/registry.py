"""Optimizer names, their hyperparameter schemas (pydantic) and role tables; ``create_optimizer``."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Literal, Mapping

import pydantic
import torch
from torch import nn

from .alice import Alice, Alice0
from .asgo import ASGO, DASGO
from .racs import RACS
from .sumo import SUMO
from . import routing as _routing
from .routing import TRANSPOSE_SYMMETRIC, route
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


class MatrixOpsConfig(_Strict):
    """How whole-matrix operations run on sharded matrices (shardopt.sharding.matrix_ops)."""

    strategy: Literal["auto", "gather", "distributed"] = pydantic.Field(
        "auto", description="gather to owner ranks, compute from row blocks with reduced small matrices, or "
                            "pick per matrix by the cost model")
    bucket_mb: float = pydantic.Field(128.0, gt=0, description="bound on one bucket's whole-matrix transients "
                                                               "(gathered small state, reduced sums), MiB")


class _WholeMatrixFields(_AdamFields):
    matrix_ops: MatrixOpsConfig = pydantic.Field(default_factory=MatrixOpsConfig)


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


class SWANConfig(_WholeMatrixFields):
    """specs/sinkgd.md 1.4: SWAN-dagger lr 0.02 x 0.05, one normalize+whiten sweep, no centering."""

    lr: float = pydantic.Field(0.02, ge=0)
    lr_scale: float = pydantic.Field(0.05, ge=0)
    iterations: int = pydantic.Field(1, ge=1)
    center: bool = False
    whitening: Literal["newton_schulz", "svd"] = "newton_schulz"
    ns_steps: int = pydantic.Field(12, ge=1, lt=100, description="coupled Newton-Schulz steps (converges)")
    weight_decay: float = pydantic.Field(0.0, ge=0)
    adam_lr: float | None = pydantic.Field(None, ge=0, description="default: lr")


ASGO_PRESETS: dict[str, dict[str, Any]] = {
    # specs/asgo.md 1.6 and 6.1: the GPT-2 run's text: direct SVD/eigh, eps = 0 (pseudo-inverse), tau = 1
    "paper_gpt2": dict(lr=0.1, betas=(0.9, 0.95), eps=0.0, refresh_interval=1, root="eigh"),
    # the authors' released code: beta2 0.8, wd 0.1, coupled Newton-Schulz root, RMS-0.2 graft, tau = 1
    "released_code": dict(lr=0.01, betas=(0.9, 0.8), eps=1e-10, refresh_interval=1, root="newton_schulz",
                          ns_steps=10, update_rms=0.2, weight_decay=0.1),
}


class ASGOConfig(_WholeMatrixFields):
    """specs/asgo.md Alg. 2: betas (0.9, 0.95) and eps 1e-6 (Table 4), tau 1, eigh root, smaller side."""

    preset: Literal["paper_gpt2", "released_code"] | None = pydantic.Field(
        None, description="defaults of the paper's GPT-2 run or of the released code; explicit keys win")
    lr: float = pydantic.Field(0.01, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = pydantic.Field(1e-6, ge=0, description="damping inside the root: (V + eps I)^-1/2")
    refresh_interval: int = pydantic.Field(1, ge=1, description="tau: steps between root recomputations")
    side: Literal["auto", "left", "right"] = "auto"
    root: Literal["eigh", "newton_schulz"] = "eigh"
    ns_steps: int = pydantic.Field(50, ge=1, le=200)
    statistic: Literal["gradient", "momentum"] = "gradient"
    update_rms: float | None = pydantic.Field(None, gt=0)
    weight_decay: float = pydantic.Field(0.0, ge=0)
    adam_lr: float | None = pydantic.Field(None, ge=0, description="default: lr")

    @pydantic.model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("preset") in ASGO_PRESETS:
            data = {**ASGO_PRESETS[data["preset"]], **data}
        return data

    @pydantic.model_validator(mode="after")
    def _check(self) -> "ASGOConfig":
        for i, b in enumerate(self.betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"betas[{i}] = {b} is outside [0, 1)")
        if self.eps == 0 and self.refresh_interval > 1:
            raise ValueError("eps = 0 needs refresh_interval = 1 (a stale pseudo-inverse root amplifies new "
                             "directions); set eps > 0")
        return self


class DASGOConfig(_AdamFields):
    """specs/asgo.md Alg. 3: Table 4's betas (0.9, 0.99), eps 1e-6."""

    lr: float = pydantic.Field(0.01, ge=0)
    betas: tuple[float, float] = (0.9, 0.99)
    eps: float = pydantic.Field(1e-6, gt=0)
    weight_decay: float = pydantic.Field(0.0, ge=0)
    adam_lr: float | None = pydantic.Field(None, ge=0, description="default: lr")


class SUMOConfig(_WholeMatrixFields):
    """specs/sumo.md 1.3 defaults: GaLore's C4 recipe (lr 0.01, alpha 0.25, K 200), mu 0.9, gamma 1.1."""

    lr: float = pydantic.Field(0.01, ge=0)
    rank: int = pydantic.Field(128, ge=1)
    alpha: float = pydantic.Field(0.25, ge=0)
    momentum: float = pydantic.Field(0.9, ge=0, lt=1)
    refresh_interval: int = pydantic.Field(200, ge=1)
    gamma: float | None = pydantic.Field(1.1, ge=1, description="norm-growth limiter; null disables it")
    step_scale: Literal["none", "sqrt_max", "moonlight", "muon"] = "sqrt_max"
    side: Literal["auto", "left", "right"] = "auto"
    oversample: int = pydantic.Field(10, ge=0)
    power_iters: int = pydantic.Field(2, ge=0, le=20)
    seed: int = 0
    weight_decay: float = pydantic.Field(0.0, ge=0)
    adam_lr: float | None = pydantic.Field(None, ge=0, description="default: lr")


class AliceConfig(_WholeMatrixFields):
    """specs/racs_alice.md Table 7-11 (60M-350M): lr 0.02, alpha 0.3, alpha_c 0.4, betas (0.9, 0.9, 0.999),
    K 200, r 128, l 40, gamma 1.01."""

    lr: float = pydantic.Field(0.02, ge=0)
    alpha: float = pydantic.Field(0.3, ge=0)
    alpha_c: float = pydantic.Field(0.4, ge=0)
    betas: tuple[float, float, float] = (0.9, 0.9, 0.999)
    rank: int = pydantic.Field(128, ge=1)
    leading: int = pydantic.Field(40, ge=0)
    refresh_interval: int = pydantic.Field(200, ge=1)
    gamma: float = pydantic.Field(1.01, ge=1)
    eps: float = pydantic.Field(1e-8, ge=0)
    reproject: bool = pydantic.Field(True, description="rotate the tracking state into the new basis at a switch")
    seed: int = 0
    oversample: int = pydantic.Field(10, ge=0)
    power_iters: int = pydantic.Field(2, ge=0, le=20)
    weight_decay: float = pydantic.Field(0.0, ge=0)
    adam_lr: float | None = pydantic.Field(None, ge=0, description="default: lr")

    @pydantic.model_validator(mode="after")
    def _check(self) -> "AliceConfig":
        for i, b in enumerate(self.betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"betas[{i}] = {b} is outside [0, 1)")
        if self.leading > self.rank:
            raise ValueError(f"leading = {self.leading} must be <= rank = {self.rank}")
        return self


def _alice_roles(treatment: str) -> Callable[[Any], dict[str, dict]]:
    """Alice's main results train the LM head with the low-rank method; embeddings and vectors use Adam."""
    def table(cfg: Any) -> dict[str, dict]:
        return {"matrix": {"treatment": treatment}, "lm_head": {"treatment": treatment},
                "matrix_transposed": {"treatment": treatment},  # symmetric under transposition (tested)
                "embedding": {"treatment": "adamw"}, "vector": {"treatment": "adamw"}}

    return table


def _scale_roles(cfg: SCALEConfig) -> dict[str, dict]:
    return {
        "matrix": {"treatment": "scale", "norm_dim": 1, "momentum": 0.0},
        # stored in x out (GPT-2's Conv1D): per output unit is per column of the stored weight
        "matrix_transposed": {"treatment": "scale", "norm_dim": 0, "momentum": 0.0},
        "embedding": {"treatment": "scale", "norm_dim": 0, "momentum": cfg.embedding_momentum},
        "lm_head": {"treatment": "scale", "norm_dim": 1, "momentum": cfg.momentum},
        "vector": {"treatment": "adamw"},
    }


def _matrix_only_roles(treatment: str) -> Callable[[Any], dict[str, dict]]:
    def table(cfg: Any) -> dict[str, dict]:
        out = {
            "matrix": {"treatment": treatment},
            "embedding": {"treatment": "adamw"},
            "lm_head": {"treatment": "adamw"},
            "vector": {"treatment": "adamw"},
        }
        if treatment in TRANSPOSE_SYMMETRIC:
            out["matrix_transposed"] = {"treatment": treatment}
        return out

    return table


# name -> (class, config schema, role table, constructor kwargs from config)
OPTIMIZERS: dict[str, tuple[type, type[pydantic.BaseModel], Callable[[Any], dict[str, dict]]]] = {
    "scale": (SCALE, SCALEConfig, _scale_roles),
    "sinkgd": (SinkGD, SinkGDConfig, _matrix_only_roles("sinkgd")),
    "racs": (RACS, RACSConfig, _matrix_only_roles("racs")),
    "muon": (Muon, MuonConfig, _matrix_only_roles("muon")),
    "swan": (SWAN, SWANConfig, _matrix_only_roles("swan")),
    # released ASGO code: embeddings, LM head and vectors on Adam; hidden matrices on ASGO / DASGO
    "asgo": (ASGO, ASGOConfig, _matrix_only_roles("asgo")),
    "dasgo": (DASGO, DASGOConfig, _matrix_only_roles("dasgo")),
    "sumo": (SUMO, SUMOConfig, _matrix_only_roles("sumo")),
    "alice": (Alice, AliceConfig, _alice_roles("alice")),
    "alice0": (Alice0, AliceConfig, _alice_roles("alice0")),
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


def build_param_groups(model: nn.Module | Iterable[Any], name: str, cfg: pydantic.BaseModel,
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
    kw.pop("preset", None)
    return kw


def create_optimizer(model: nn.Module | Iterable[Any], name: str, routing: Mapping[str, str] | None = None,
                     **hyperparameters: Any) -> torch.optim.Optimizer:
    """Build shardopt optimizer ``name`` (a key of ``OPTIMIZERS``) for ``model``.

    Call it after ``fully_shard`` (FSDP2) or on the plain/DDP model; parameters are routed by role
    (see ``shardopt.optim.routing``); ``routing`` maps name patterns to roles or ``"adamw"``. As torch.optim,
    it also takes ``model.named_parameters()`` (roles from the names; state dicts carry ``param_names``) or a
    flat list of tensors (2-D tensors get the matrix rule, the rest AdamW).
    """
    cfg = validate_hyperparameters(name, hyperparameters, where="create_optimizer")
    groups = build_param_groups(model, name, cfg, routing)
    cls = OPTIMIZERS[name.lower()][0]
    opt = cls(groups, **optimizer_kwargs(cfg))
    if isinstance(model, nn.Module):  # raise if a DeepSpeed engine later runs the model with another optimizer
        from ..plugin.wrapped import watch_model

        watch_model(model, cls.__name__)
    return opt
