"""The trainer's JSON config, validated with pydantic: unknown keys and bad values raise
``TrainConfigError`` naming the key path (e.g. ``train.micro_batch_size``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import pydantic

from .model import PRESETS

__all__ = [
    "TrainConfig",
    "TrainConfigError",
    "load_train_config",
    "validate_deepspeed_config",
    "read_deepspeed_config",
    "apply_overrides",
    "resolve_path",
    "REPO_ROOT",
]

REPO_ROOT = Path(__file__).resolve().parents[2]


class TrainConfigError(ValueError):
    """A trainer configuration problem; the message names the key path."""


class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")


class ModelSection(_Strict):
    preset: str = pydantic.Field("tiny", description=f"one of {list(PRESETS)}")
    hidden_size: int | None = pydantic.Field(None, gt=0, description="model width (default: the preset's)")
    intermediate_size: int | None = pydantic.Field(None, gt=0, description="SwiGLU width (default: the preset's)")
    num_heads: int | None = pydantic.Field(None, gt=0, description="attention heads (default: the preset's)")
    num_layers: int | None = pydantic.Field(None, gt=0, description="decoder layers (default: the preset's)")
    rope_theta: float | None = pydantic.Field(None, gt=0, description="RoPE base (default: the preset's)")
    norm_eps: float | None = pydantic.Field(None, gt=0, description="RMSNorm epsilon (default: the preset's)")
    init_std: float | None = pydantic.Field(None, gt=0, description="std of the weight init (default: preset's)")
    tie_embeddings: bool = pydantic.Field(False, description="share the embedding with the LM head")

    @pydantic.field_validator("preset")
    @classmethod
    def _preset(cls, v: str) -> str:
        if v.lower() not in PRESETS:
            raise ValueError(f"unknown preset {v!r}; choose one of {list(PRESETS)}")
        return v.lower()


class DataSection(_Strict):
    source: Literal["shakespeare", "text", "tokens"] = pydantic.Field(
        "shakespeare", description="the bundled corpus, text files (a BPE is trained), or a token file"
    )
    path: str | None = pydantic.Field(None, description="text: a glob of files; tokens: a .npy or raw .bin file")
    val_path: str | None = pydantic.Field(None, description="optional separate validation glob / token file")
    seq_len: int | None = pydantic.Field(None, gt=0, description="default: the model preset's sequence length")
    vocab_size: int = pydantic.Field(4096, gt=256, description="BPE size to train, or the vocab of a token file")
    val_documents: int = pydantic.Field(4, ge=1, description="documents (plays/files) held out for validation")
    val_fraction: float = pydantic.Field(0.05, gt=0, lt=1, description="tail held out when not splitting by document")
    token_dtype: Literal["uint16", "uint32", "int32", "int64"] = pydantic.Field(
        "uint16", description="element type of a raw .bin token file"
    )
    cache_dir: str = pydantic.Field("runs/cache", description="where trained tokenizers and encoded data are kept")

    @pydantic.model_validator(mode="after")
    def _needs_path(self) -> "DataSection":
        if self.source in ("text", "tokens") and not self.path:
            raise ValueError(f"data.path is required when data.source is {self.source!r}")
        return self


class EngineSection(_Strict):
    name: Literal["deepspeed", "fsdp2", "ddp", "single"] = pydantic.Field(
        "single", description="the engine the model is wrapped in (single: one process)"
    )
    deepspeed_config: str | None = pydantic.Field(None, description="DeepSpeed JSON (engine deepspeed only)")
    device: Literal["auto", "cpu", "cuda"] = pydantic.Field("auto", description="auto: CUDA where available")
    quiet: bool = pydantic.Field(True, description="silence DeepSpeed's INFO logging")

    @pydantic.model_validator(mode="after")
    def _ds(self) -> "EngineSection":
        if self.name == "deepspeed" and not self.deepspeed_config:
            raise ValueError("engine.deepspeed_config is required when engine.name is 'deepspeed'")
        if self.name != "deepspeed" and self.deepspeed_config:
            raise ValueError(f"engine.deepspeed_config is only used by engine 'deepspeed', not {self.name!r}")
        return self


class AdamWParams(_Strict):
    """``optimizer.params`` when ``optimizer.name`` is ``adamw`` (torch.optim.AdamW, the baseline)."""

    lr: float = pydantic.Field(1e-3, ge=0, description="peak learning rate")
    betas: tuple[float, float] = pydantic.Field((0.9, 0.999), description="first and second moment EMA betas")
    eps: float = pydantic.Field(1e-8, ge=0, description="added to the second moment's square root")
    weight_decay: float = pydantic.Field(0.0, ge=0, description="decoupled weight decay")


class OptimizerSection(_Strict):
    name: str = pydantic.Field(description="a shardopt optimizer (shardopt.OPTIMIZERS) or adamw")
    params: dict[str, Any] = pydantic.Field(
        default_factory=dict, description="the optimizer's hyperparameters (its configuration reference)"
    )
    routing: dict[str, str] = pydantic.Field(default_factory=dict, description="name pattern -> role or adamw")
    #: ``params`` validated by the optimizer's model (``load_train_config``; None for adamw)
    _config: Any = pydantic.PrivateAttr(None)

    @property
    def config(self) -> Any:
        """The shardopt optimizer's validated hyperparameters (``shardopt.optim.config.OptimizerConfig``)."""
        if self._config is None:
            from ..optim.registry import validate_hyperparameters

            self._config = validate_hyperparameters(
                self.name, self.params, where="optimizer.params", name_key="optimizer.name"
            )
        return self._config


class TrainSection(_Strict):
    steps: int = pydantic.Field(300, gt=0, description="optimizer steps")
    micro_batch_size: int = pydantic.Field(8, gt=0, description="sequences per rank per micro-step")
    grad_accum: int = pydantic.Field(1, gt=0, description="micro-steps per optimizer step")
    warmup_fraction: float = pydantic.Field(0.1, ge=0, le=1, description="linear warmup, as a fraction of steps")
    min_lr_ratio: float = pydantic.Field(0.1, ge=0, le=1, description="cosine decay ends at this x peak lr")
    grad_clip: float = pydantic.Field(0.0, ge=0, description="0 disables clipping (as in the papers)")
    bf16: bool = pydantic.Field(False, description="bf16 compute (autocast, FSDP2 or DeepSpeed bf16); fp32 statistics")
    log_every: int = pydantic.Field(10, gt=0, description="steps between loss lines in the log")
    progress: bool = pydantic.Field(True, description="a tqdm progress bar on rank 0")


class EvalSection(_Strict):
    every: int = pydantic.Field(100, ge=0, description="0: only at start and end")
    max_sequences: int = pydantic.Field(256, ge=0, description="validation sequences per evaluation (0: all)")
    at_start: bool = pydantic.Field(True, description="evaluate before the first step")


class CheckpointSection(_Strict):
    every: int = pydantic.Field(0, ge=0, description="0: no checkpoints")
    dir: str | None = pydantic.Field(None, description="default: <run_dir>/checkpoints")
    at_end: bool = pydantic.Field(True, description="save after the last step")


class TrainConfig(_Strict):
    run_dir: str = pydantic.Field("runs/default", description="where logs, plots and checkpoints go")
    seed: int = pydantic.Field(0, description="seed of the model's init and the data order")
    model: ModelSection = pydantic.Field(ModelSection(), description="the LLaMA-style model")
    data: DataSection = pydantic.Field(DataSection(), description="training and validation data")
    engine: EngineSection = pydantic.Field(EngineSection(), description="how the model is distributed")
    optimizer: OptimizerSection | None = pydantic.Field(
        None, description="default: the DeepSpeed JSON's 'shardopt' section (engine deepspeed), else scale"
    )
    train: TrainSection = pydantic.Field(TrainSection(), description="the training loop and its LR schedule")
    eval: EvalSection = pydantic.Field(EvalSection(), description="validation loss and perplexity")
    checkpoint: CheckpointSection = pydantic.Field(CheckpointSection(), description="saving and resuming")
    _source: str | None = pydantic.PrivateAttr(None)  # the file the config was read from
    #: the DeepSpeed JSON as read and its "shardopt" section parsed (engine deepspeed; load_train_config)
    _deepspeed: tuple[dict[str, Any], Any] | None = pydantic.PrivateAttr(None)

    @property
    def source(self) -> str | None:
        return self._source

    @property
    def deepspeed(self) -> tuple[dict[str, Any], Any]:
        """``(json, section)``: the DeepSpeed JSON as read (``"shardopt"`` left in) and its ``"shardopt"``
        section parsed once (``shardopt.deepspeed.ShardoptSection``, None when absent)."""
        if self._deepspeed is None:
            if self.engine.deepspeed_config is None:
                raise TrainConfigError(
                    f"engine.deepspeed_config is not set (engine.name is {self.engine.name!r}); the DeepSpeed "
                    "JSON belongs to engine 'deepspeed' only"
                )
            self._deepspeed = read_deepspeed_config(
                self.engine.deepspeed_config, require_shardopt=self.optimizer is None
            )
        return self._deepspeed

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or os.path.join(self.run_dir, "checkpoints")


def _format(err: pydantic.ValidationError, where: str, prefix: str = "") -> str:
    lines = []
    for e in err.errors():
        path = prefix + ".".join(str(x) for x in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"{path}: unknown key")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(
                f"{path}: {msg}" + (f" (got {e['input']!r})" if path and not isinstance(e.get("input"), dict) else "")
            )
    return f"{where}: " + "; ".join(lines)


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """``key.path=value`` overrides (value parsed as JSON, else kept as a string)."""
    for item in overrides:
        if "=" not in item:
            raise TrainConfigError(f"--set {item!r}: expected key.path=value")
        key, value = item.split("=", 1)
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        node = raw
        parts = key.split(".")
        for p in parts[:-1]:
            if node.get(p) is None:
                node[p] = {}
            if not isinstance(node[p], dict):
                raise TrainConfigError(f"--set {item!r}: {p} is not a section")
            node = node[p]
        node[parts[-1]] = parsed
    return raw


def resolve_path(path: str, config_file: str | None = None) -> str:
    """``path`` as given if it exists, else relative to the config file's folder, else to the repo root."""
    if os.path.isabs(path) or os.path.exists(path):
        return path
    for base in ([Path(config_file).parent] if config_file else []) + [REPO_ROOT]:
        cand = base / path
        if cand.exists():
            return str(cand)
    return path


def read_deepspeed_config(
    path_or_dict: str | Mapping[str, Any], where: str = "deepspeed config", require_shardopt: bool = True
) -> tuple[dict[str, Any], Any]:
    """Load a DeepSpeed JSON and check what the trainer relies on. Returns the dict as read and its
    ``"shardopt"`` section parsed (``ShardoptSection``, None when absent and not required): the one parse on
    the trainer's path (``shardopt.deepspeed.initialize`` takes the parsed section as is)."""
    import copy

    from ..plugin.deepspeed_engine import parse_section

    if isinstance(path_or_dict, Mapping):
        cfg = copy.deepcopy(dict(path_or_dict))
    else:
        if not os.path.isfile(path_or_dict):
            raise TrainConfigError(f"{where}: file {path_or_dict!r} does not exist")
        with open(path_or_dict) as f:
            try:
                cfg = json.load(f)
            except json.JSONDecodeError as exc:
                raise TrainConfigError(f"{where}: invalid JSON: {exc}") from None
    if "optimizer" in cfg:
        raise TrainConfigError(
            f"{where}: optimizer: remove the 'optimizer' block; the optimizer comes from the "
            "'shardopt' section or the trainer config"
        )
    section = None
    if require_shardopt or "shardopt" in cfg:
        try:
            section, _ = parse_section(copy.deepcopy(cfg))
        except Exception as exc:  # ConfigError from shardopt names the key already
            raise TrainConfigError(f"{where}: {exc}") from None
    return cfg, section


def validate_deepspeed_config(
    path_or_dict: str | Mapping[str, Any], where: str = "deepspeed config", require_shardopt: bool = True
) -> dict[str, Any]:
    """Load a DeepSpeed JSON and check what the trainer relies on; returns the dict (unchanged)."""
    return read_deepspeed_config(path_or_dict, where, require_shardopt)[0]


def load_train_config(source: str | os.PathLike | Mapping[str, Any], overrides: Sequence[str] = ()) -> TrainConfig:
    """Read and validate a trainer config (path or dict), apply ``--set`` overrides, and check the
    optimizer hyperparameters and the DeepSpeed JSON it points to."""
    from ..optim.registry import OPTIMIZERS, validate_hyperparameters

    where = "train config"
    config_file = None
    if isinstance(source, Mapping):
        raw = json.loads(json.dumps(dict(source)))
    else:
        config_file = str(source)
        where = f"train config {config_file}"
        if not os.path.isfile(config_file):
            raise TrainConfigError(f"{where}: file does not exist")
        with open(config_file) as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as exc:
                raise TrainConfigError(f"{where}: invalid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise TrainConfigError(f"{where}: the top level must be a JSON object")
    raw = apply_overrides(raw, overrides)
    try:
        cfg = TrainConfig.model_validate(raw)
    except pydantic.ValidationError as err:
        raise TrainConfigError(_format(err, where)) from None
    cfg._source = config_file

    if cfg.optimizer is not None:
        name = cfg.optimizer.name.lower()
        cfg.optimizer.name = name
        if name == "adamw":
            if cfg.optimizer.routing:
                raise TrainConfigError(f"{where}: optimizer.routing: not used by adamw")
            try:
                AdamWParams.model_validate(cfg.optimizer.params)
            except pydantic.ValidationError as err:
                raise TrainConfigError(_format(err, where, prefix="optimizer.params.")) from None
        elif name in OPTIMIZERS:
            try:
                cfg.optimizer._config = validate_hyperparameters(
                    name, cfg.optimizer.params, where="optimizer.params", name_key="optimizer.name"
                )
            except ValueError as exc:
                raise TrainConfigError(f"{where}: {exc}") from None
        else:
            raise TrainConfigError(
                f"{where}: optimizer.name: unknown optimizer {cfg.optimizer.name!r}; choose one "
                f"of {sorted(OPTIMIZERS) + ['adamw']}"
            )
    if cfg.engine.name == "deepspeed":
        assert cfg.engine.deepspeed_config is not None  # EngineSection._ds requires it for deepspeed
        path = resolve_path(cfg.engine.deepspeed_config, config_file)
        cfg.engine.deepspeed_config = path
        cfg._deepspeed = read_deepspeed_config(
            path, where=f"{where}: engine.deepspeed_config {path}", require_shardopt=cfg.optimizer is None
        )
    return cfg
