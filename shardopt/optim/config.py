"""Hyperparameter models shared by every optimizer: the common tail (AdamW for vectors, non-finite policy,
plan checks, whole-matrix strategy) and the machinery that turns keyword arguments into a validated model.

Each algorithm module subclasses ``OptimizerConfig`` (``scale.SCALEConfig``, ``sumo.SUMOConfig``, ...): the
model holds the defaults, the ranges, the docs and the role table (``roles``). The optimizer class points at it
(``Config``) and takes its keyword defaults from it (``Config.defaults()``), so a default is written once;
``create_optimizer``, the DeepSpeed ``"shardopt"`` section, the trainer and wrappers such as
ZeroRedundancyOptimizer all validate through the same model. Errors are ``ConfigError`` (a ``ValueError``)
whose message gives the full key path, e.g. ``shardopt.params.leading: 40 must be <= rank = 4 (got 40)``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Mapping, TypedDict, TypeVar, cast

import pydantic
import torch
from typing_extensions import Self

from .checks import check_hyperparameters, check_lr
from .routing import ConfigError
from .transposed import TRANSPOSED

__all__ = [
    "OptimizerConfig",
    "WholeMatrixConfig",
    "MatrixOpsConfig",
    "CommonOptions",
    "ConfigError",
    "format_errors",
    "check_betas",
]


class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", allow_inf_nan=False, strict=False)


_Betas = TypeVar("_Betas", bound=tuple[float, ...])


def check_betas(name: str, betas: _Betas) -> _Betas:
    """Each beta in [0, 1); the message names the index (for ``field_validator``s)."""
    for i, b in enumerate(betas):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"{name}[{i}] = {b} is outside [0, 1)")
    return betas


def format_errors(
    err: pydantic.ValidationError,
    where: str,
    names: Mapping[str, str] | None = None,
    unknown: str = "unknown hyperparameter",
) -> str:
    """One line per error: ``<where>.<key path>: <message> (got <value>)``; a literal choice reads
    ``<where>.<key> must be 'a' or 'b' (got 'c')``. ``names`` renames top-level fields (constructor names);
    ``unknown``: what a key the model does not have is called (a model of hyperparameters by default)."""
    lines = []
    for e in err.errors():
        loc = [(names or {}).get(str(x), str(x)) if i == 0 else str(x) for i, x in enumerate(e["loc"])]
        path = ".".join([where, *loc]) if where else ".".join(loc)
        got = f" (got {e['input']!r})" if "input" in e and not isinstance(e["input"], Mapping) else ""
        if e["type"] == "extra_forbidden":
            lines.append(f"{path}: {unknown}")
        elif e["type"] == "literal_error":
            lines.append(f"{path} must be {e['ctx']['expected']}{got}")
        else:
            lines.append(f"{path}: {e['msg'].removeprefix('Value error, ')}{got}")
    return "; ".join(lines)


class ProfileConfig(_Strict):
    """A hardware profile in numbers (``matrix_ops.profile``); missing keys come from ``base``."""

    base: Literal["gpu", "cpu"] = "gpu"
    matmul_tflops: float | None = pydantic.Field(None, gt=0, allow_inf_nan=False, description="fp32 products, TFLOP/s")
    factor_tflops: float | None = pydantic.Field(
        None, gt=0, allow_inf_nan=False, description="small factorizations (eigh, SVD, QR), TFLOP/s"
    )
    factor_latency_us: float | None = pydantic.Field(
        None, gt=0, allow_inf_nan=False, description="per factorization call, us"
    )
    bandwidth_gbs: float | None = pydantic.Field(
        None, gt=0, allow_inf_nan=False, description="collective bandwidth per rank, GB/s"
    )
    latency_us: float | None = pydantic.Field(None, gt=0, allow_inf_nan=False, description="per collective round, us")
    memory_gbs: float | None = pydantic.Field(None, gt=0, allow_inf_nan=False, description="device memory, GB/s")
    ranks_per_node: int | None = pydantic.Field(
        None, ge=0, description="ranks per node (default: LOCAL_WORLD_SIZE, else the base's; 0: one node)"
    )
    node_bandwidth_gbs: float | None = pydantic.Field(
        None, gt=0, allow_inf_nan=False, description="collective bandwidth per rank inside a node, GB/s"
    )
    node_latency_us: float | None = pydantic.Field(
        None, gt=0, allow_inf_nan=False, description="per collective round inside a node, us"
    )


class MatrixOpsConfig(_Strict):
    """How whole-matrix operations run on sharded matrices (shardopt.sharding.matrix_ops)."""

    strategy: Literal["auto", "gather", "distributed", "team"] = pydantic.Field(
        "auto",
        description="gather to owner ranks, compute from row blocks with reduced small matrices, on "
        "teams of ranks, or pick per matrix by the time model",
    )
    team_size: int | None = pydantic.Field(
        None,
        ge=2,
        description="ranks per matrix under strategy 'team' (null: per matrix, the size the time model finds fastest)",
    )
    bucket_mb: float = pydantic.Field(
        128.0,
        gt=0,
        description="bound on one bucket's whole-matrix transients (gathered small state, reduced sums), MiB",
    )
    profile: Any = pydantic.Field(
        "auto",
        description="hardware profile that turns the auto strategy's FLOPs, bytes and rounds into seconds "
        "(shardopt.sharding.time_model): 'auto' (cpu for CPU parameters, else gpu), 'gpu', "
        "'cpu', or numbers (ProfileConfig)",
    )

    @pydantic.field_validator("profile", mode="before")
    @classmethod
    def _profile(cls, v: Any) -> Any:
        """A name, or numbers checked by ``ProfileConfig`` (kept as a plain dict without the unset keys)."""
        if isinstance(v, str):
            if v not in ("auto", "gpu", "cpu"):
                raise ValueError(f"must be 'auto', 'gpu', 'cpu' or a mapping of {sorted(ProfileConfig.model_fields)}")
            return v
        if isinstance(v, ProfileConfig):
            return v.model_dump(exclude_none=True)
        if not isinstance(v, Mapping):
            raise ValueError("must be a profile name or a mapping of numbers")
        try:
            return ProfileConfig.model_validate(dict(v)).model_dump(exclude_none=True)
        except pydantic.ValidationError as err:
            raise ValueError(
                "; ".join(
                    f"{'.'.join(str(x) for x in e['loc'])}: "
                    + ("unknown key" if e["type"] == "extra_forbidden" else e["msg"])
                    + (f" (got {e['input']!r})" if e["type"] != "extra_forbidden" else "")
                    for e in err.errors()
                )
            ) from None

    precision: Literal["auto", "ieee", "tf32", "bf16"] = pydantic.Field(
        "auto",
        description="products of Newton-Schulz iterations: ieee (fp32), tf32 or bf16 (tensor cores; Muon "
        "only, the others keep ieee accuracy and refuse them), or auto: ieee on the CPU, bf16 "
        "for Muon on CUDA (shardopt.sharding.precision)",
    )
    memory_budget_mib: float | None = pydantic.Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="MiB of whole-matrix small state a rank may keep under auto; default: 1.15 x its even share + "
        "the largest matrix it owns + 4 MiB",
    )


class CommonOptions(TypedDict, total=False):
    """The keyword arguments every optimizer takes besides its own (``OptimizerConfig``'s fields)."""

    adam_lr: float | None
    adam_betas: tuple[float, float]
    adam_eps: float
    adam_weight_decay: float
    on_nonfinite: Literal["skip", "raise", "ignore"]
    debug_plan: bool | None
    matrix_ops: dict | MatrixOpsConfig


#: the fields of ``OptimizerConfig`` itself: not group hyperparameters of the matrix rule
_COMMON = ("adam_lr", "adam_betas", "adam_eps", "adam_weight_decay", "on_nonfinite", "debug_plan")


class OptimizerConfig(_Strict):
    """The hyperparameters every shardopt optimizer takes: AdamW for what is not a matrix, and the step policy.

    Subclasses add the matrix rule's fields; ``treatment`` names the rule (and the registry entry).
    """

    #: the matrix rule's treatment, also the optimizer's name in ``shardopt.optim.OPTIMIZERS``
    treatment: ClassVar[str] = ""
    #: fields only configs set (create_optimizer, JSON): no constructor keyword, not a group default
    config_only: ClassVar[tuple[str, ...]] = ()
    #: constructor keyword -> field, where the constructor keeps torch's name for another meaning
    constructor_names: ClassVar[dict[str, str]] = {}

    weight_decay: float = pydantic.Field(0.0, ge=0, description="decoupled weight decay of the matrix rule")
    adam_lr: float | None = pydantic.Field(None, ge=0, description="AdamW lr for vectors (None: lr)")
    adam_betas: tuple[float, float] = pydantic.Field((0.9, 0.999), description="AdamW betas for vectors")
    adam_eps: float = pydantic.Field(1e-8, ge=0, description="AdamW eps for vectors")
    adam_weight_decay: float = pydantic.Field(0.0, ge=0, description="AdamW decoupled weight decay for vectors")
    on_nonfinite: Literal["skip", "raise", "ignore"] = pydantic.Field(
        "skip", description="a step with inf/NaN gradients on any rank: skip it everywhere, raise, or no check"
    )
    debug_plan: bool | None = pydantic.Field(
        None, description="check every step that all ranks hold the same plan (None: SHARDOPT_DEBUG_PLAN=1)"
    )

    @pydantic.field_validator("adam_betas")
    @classmethod
    def _adam_betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        return check_betas("adam_betas", v)

    # ------------------------------------------------------------------ defaults and construction
    @classmethod
    def defaults(cls) -> Self:
        """The model with every field at its default (constructors read their keyword defaults from it)."""
        return cast(Self, cls.model_construct())

    @classmethod
    def from_arguments(cls, who: str, arguments: Mapping[str, Any], options: Mapping[str, Any]) -> Self:
        """Validate a constructor's keyword ``arguments`` (explicit ones) and ``**options`` into the model.

        ``constructor_names`` maps constructor names to fields where they differ. torch's checks (``lr``, ``betas``,
        ``eps``, ``weight_decay``, ``momentum``) run first so their messages are torch's; a tensor ``lr``
        (torch's convention) is validated as a number and kept as a tensor.
        """
        renames = cls.constructor_names
        allowed = set(cls.model_fields) - set(renames.values()) - set(cls.config_only) - set(arguments)
        for key in options:
            if key not in allowed:
                raise TypeError(f"{who}.__init__() got an unexpected keyword argument {key!r}")
        given = {**arguments, **options}
        check_hyperparameters(
            {k: given.get(k) for k in ("lr", "weight_decay", "eps", "betas", "momentum")}, f"{who} arguments"
        )
        check_hyperparameters(
            {
                "lr": given.get("adam_lr"),
                "betas": given.get("adam_betas"),
                "eps": given.get("adam_eps"),
                "weight_decay": given.get("adam_weight_decay"),
            },
            f"{who} AdamW arguments (adam_*)",
        )
        values = {renames.get(k, k): v for k, v in given.items()}
        tensor_lr = values.get("lr") if isinstance(values.get("lr"), torch.Tensor) else None
        if tensor_lr is not None:
            check_lr(tensor_lr)
            values["lr"] = float(tensor_lr)
        try:
            cfg = cls.model_validate(values)
        except pydantic.ValidationError as err:
            raise ConfigError(format_errors(err, who, {v: k for k, v in renames.items()})) from None
        return cfg.model_copy(update={"lr": tensor_lr}) if tensor_lr is not None else cfg

    # ------------------------------------------------------------------ what the optimizer reads
    def group_defaults(self) -> dict[str, Any]:
        """torch's ``defaults``: the matrix rule's hyperparameters (every field but the common ones)."""
        skip = set(_COMMON) | {"matrix_ops", "weight_decay"} | set(self.config_only)
        own = {k: getattr(self, k) for k in type(self).model_fields if k not in skip}
        return {**own, "weight_decay": self.weight_decay}

    def roles(self) -> dict[str, dict]:
        """Group options by parameter role (``shardopt.optim.routing``); the default: hidden matrices get the
        matrix rule, embedding, LM head and vectors AdamW; ``matrix_transposed`` (stored in x out: GPT-2's
        ``Conv1D``) the matrix rule on its logical out x in matrix (the group option ``transposed``,
        ``optim.transposed``)."""
        return {
            "matrix": {"treatment": self.treatment},
            "matrix_transposed": {"treatment": self.treatment, TRANSPOSED: True},
            "embedding": {"treatment": "adamw"},
            "lm_head": {"treatment": "adamw"},
            "router": {"treatment": "adamw"},
            "vector": {"treatment": "adamw"},
        }

    def adamw_group(self) -> dict[str, Any]:
        """The hyperparameters of an AdamW group, all explicit (wrappers that fill missing keys from their own
        defaults, like ZeroRedundancyOptimizer, would otherwise give them the matrix rule's)."""
        return {
            "lr": self.adam_lr if self.adam_lr is not None else self.lr,  # type: ignore[attr-defined]  # every rule's config has lr
            "betas": tuple(self.adam_betas),
            "eps": self.adam_eps,
            "weight_decay": self.adam_weight_decay,
        }

    def engine_options(self) -> dict[str, Any]:
        """What ``ShardedOptimizer.__init__`` takes besides the parameters and the group defaults."""
        out = dict(
            adam_lr=self.adam_lr,
            betas=tuple(self.adam_betas),
            eps=self.adam_eps,
            weight_decay=self.adam_weight_decay,
            on_nonfinite=self.on_nonfinite,
            debug_plan=self.debug_plan,
        )
        if "matrix_ops" in type(self).model_fields:
            out["matrix_ops"] = self.matrix_ops.model_dump()  # type: ignore[attr-defined]  # checked just above
        return out

    def constructor_kwargs(self) -> dict[str, Any]:
        """Keyword arguments that rebuild this config through the optimizer's constructor (for wrappers that
        construct it themselves: ZeroRedundancyOptimizer, fairscale OSS)."""
        fields = {v: k for k, v in self.constructor_names.items()}
        return {fields.get(k, k): v for k, v in self.model_dump().items() if k not in self.config_only}


class WholeMatrixConfig(OptimizerConfig):
    """Optimizers whose rule needs whole matrices (SWAN, ASGO, SUMO, Alice) also choose how those run."""

    matrix_ops: MatrixOpsConfig = pydantic.Field(
        default_factory=MatrixOpsConfig,
        description="how whole-matrix work meets sharding: strategy, teams, buckets, the time model's profile",
    )
    #: whether the rule has a low-precision route for ``matrix_ops.precision`` "tf32" / "bf16" (Muon's config says so)
    low_precision_routes: ClassVar[bool] = False

    @pydantic.model_validator(mode="after")
    def _precision_route(self) -> "WholeMatrixConfig":
        """tf32 / bf16 refused, by key, where the rule has no low-precision route (never ignored)."""
        if self.matrix_ops.precision in ("tf32", "bf16") and not type(self).low_precision_routes:
            raise ValueError(
                f"matrix_ops.precision={self.matrix_ops.precision!r}: {type(self).treatment} has no "
                "low-precision route (its whole-matrix results keep the ieee route's accuracy); use "
                "'auto' or 'ieee' (shardopt.sharding.precision)"
            )
        return self
