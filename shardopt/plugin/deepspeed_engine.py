"""DeepSpeed adapter: read the ``"shardopt"`` JSON section, hand our optimizer to DeepSpeed, and map ZeRO's
flat fp32 partitions back to matrices.

Under ZeRO the client optimizer steps one flat fp32 tensor per param group (stage 1/2, and the bf16
ZeRO-1 wrapper) or per sub-group (stage 3). For each such tensor we list every matrix it holds, on every
rank in the same order (ranks holding nothing of a matrix included), with the global pieces from
DeepSpeed's partitioning rules (``shared/notes/engines.md`` section 4). The table is built from
``round_robin_bit16_groups`` and its recorded offsets, never from ``_hp_mapping``, which is wrong under
``round_robin_gradients`` in DeepSpeed 0.19.8.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any, Callable, Mapping, Sequence

import pydantic
import torch
import torch.distributed as dist
from torch import nn

from ..optim.base import ShardedOptimizer
from ..optim.config import OptimizerConfig, format_errors
from ..optim.describe import expose_describe
from ..optim.registry import ConfigError, build_param_groups, optimizer_class, validate_hyperparameters
from ..optim.routing import RoleTable
from ..sharding.fragment import Fragment
from ..sharding.precision import LOW_PRECISION, record_arrival_dtypes
from .zero_layouts import flat_fragments, zero3_fragments

__all__ = [
    "initialize",
    "ShardoptSection",
    "load_config",
    "parse_section",
    "parse_shardopt_section",
    "attach_zero_layouts",
    "OFFLOAD_KEYS",
    "offload_devices",
    "apply_offload_keys",
]


class ShardoptSection(pydantic.BaseModel):
    """The ``"shardopt"`` section of a DeepSpeed JSON config; ``config`` is ``params`` validated by the
    optimizer's own model (``shardopt.optim.<algorithm>.<Name>Config``)."""

    model_config = pydantic.ConfigDict(extra="forbid")
    optimizer: str = pydantic.Field(description="a shardopt optimizer name (shardopt.optim.registry.OPTIMIZERS)")
    params: dict[str, Any] = pydantic.Field(default_factory=dict, description="hyperparameters of the optimizer")
    routing: dict[str, str] = pydantic.Field(default_factory=dict, description="name pattern -> role or 'adamw'")
    _config: OptimizerConfig | None = pydantic.PrivateAttr(None)

    @property
    def config(self) -> OptimizerConfig:
        """The validated hyperparameters (set by ``parse_shardopt_section`` or ``from_config``)."""
        if self._config is None:
            raise RuntimeError("ShardoptSection was not validated; use parse_shardopt_section")
        return self._config

    @classmethod
    def from_config(cls, config: OptimizerConfig, routing: Mapping[str, str] | None = None) -> "ShardoptSection":
        """A section for hyperparameters validated elsewhere (the trainer's ``optimizer``), so DeepSpeed's
        ``initialize`` does not parse them again."""
        section = cls(
            optimizer=type(config).treatment, params=config.model_dump(exclude_unset=True), routing=dict(routing or {})
        )
        section._config = config
        return section


#: what a key of the ``"shardopt"`` section that shardopt does not know is called in errors
SECTION_UNKNOWN_KEY = "unknown key of the shardopt section (it takes optimizer, params, routing)"


def parse_shardopt_section(raw: Any, where: str = "shardopt") -> ShardoptSection:
    """The ``"shardopt"`` section validated once: its keys, the optimizer name and the hyperparameters (every
    error names its key path, ``<where>.params.<key>``). A section parsed already is returned as is."""
    if isinstance(raw, ShardoptSection) and raw._config is not None:
        return raw
    try:
        section = ShardoptSection(**raw) if isinstance(raw, Mapping) else ShardoptSection.model_validate(raw)
    except pydantic.ValidationError as err:
        raise ConfigError(format_errors(err, where, unknown=SECTION_UNKNOWN_KEY)) from None
    section._config = validate_hyperparameters(
        section.optimizer, section.params, where=f"{where}.params", name_key=f"{where}.optimizer"
    )
    return section


def load_config(config: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """A DeepSpeed config from a JSON path or a dict (deep-copied; the caller's dict is not changed)."""
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            return json.load(f)
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    raise ConfigError(f"config must be a JSON file path or a dict, got {type(config).__name__}")


def parse_section(cfg: dict[str, Any]) -> tuple[ShardoptSection, OptimizerConfig]:
    """Pop and validate the ``"shardopt"`` section (a ``ShardoptSection`` parsed already, as the trainer passes,
    is not parsed again) and check the DeepSpeed settings shardopt must refuse or rewrite: an ``"optimizer"``
    block (shardopt supplies the optimizer) and the offload settings (``apply_offload_keys``). Every other
    DeepSpeed key, ``zero_optimization``'s included, is DeepSpeed's: it passes through to DeepSpeed's own
    validation in ``deepspeed.initialize``, so a newer DeepSpeed's keys need no shardopt release and a removed
    key gets DeepSpeed's own message."""
    if "shardopt" not in cfg:
        raise ConfigError(
            "DeepSpeed config has no 'shardopt' section; add e.g. "
            '"shardopt": {"optimizer": "scale", "params": {"lr": 1e-3}}'
        )
    if "optimizer" in cfg:
        raise ConfigError(
            "DeepSpeed config has both an 'optimizer' block and a 'shardopt' section; remove the "
            "'optimizer' block (shardopt supplies the optimizer; keep 'scheduler' if you use one)"
        )
    section = parse_shardopt_section(cfg.pop("shardopt"))
    apply_offload_keys(cfg)  # before DeepSpeed reads them: its messages would not name the fix
    return section, section.config


# ------------------------------------------------------------------------------------------------- offload
#: the top-level DeepSpeed keys a client optimizer needs under ZeRO-Offload; DeepSpeed's (and accelerate's)
#: messages name them one at a time: the first refuses an untested optimizer under ZeRO, the second makes
#: DeepSpeed refuse (and accelerate silently replace by DeepSpeedCPUAdam) any optimizer with optimizer offload
OFFLOAD_KEYS = {"zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}


def offload_devices(cfg: Mapping[str, Any]) -> dict[str, str]:
    """``{"offload_optimizer": device, "offload_param": device}`` of a DeepSpeed config (``"none"`` or ``"cpu"``),
    refusing what shardopt does not run: NVMe offload (DeepSpeed's swapper moves the state tensors it knows,
    keyed by its flat partitions; shardopt's per-matrix state keyed by parameter name would stay in memory, or be
    swapped out from under it), optimizer offload at stage 0 and parameter offload below stage 3 (DeepSpeed does
    not offload there, so the setting would be silently ignored). Every error names its key and the fix."""
    zero = cfg.get("zero_optimization", {}) or {}
    stage = zero.get("stage", 0) if isinstance(zero, Mapping) else 0
    devices: dict[str, str] = {}
    for key in ("offload_optimizer", "offload_param"):
        off = zero.get(key) if isinstance(zero, Mapping) else None
        if off is not None and not isinstance(off, Mapping):
            raise ConfigError(f'zero_optimization.{key}: expected an object such as {{"device": "cpu"}}, got {off!r}')
        raw = (off or {}).get("device", "none")
        device = str(getattr(raw, "value", raw) or "none").lower()
        if device == "nvme":
            raise ConfigError(
                f"zero_optimization.{key}.device = 'nvme': shardopt does not run with NVMe offload (DeepSpeed's "
                "swapper moves the optimizer state it knows, keyed by its flat partitions, not shardopt's per-matrix "
                f'state); use CPU offload instead: "{key}": {{"device": "cpu"}}'
            )
        if device not in ("none", "cpu"):
            raise ConfigError(f"zero_optimization.{key}.device = {raw!r}: expected 'none' or 'cpu'")
        devices[key] = device
    if devices["offload_optimizer"] == "cpu" and stage not in (1, 2, 3):
        raise ConfigError(
            f"zero_optimization.offload_optimizer.device = 'cpu' needs zero_optimization.stage 1, 2 "
            f"or 3 (got stage {stage!r}, where DeepSpeed offloads nothing); set the stage or remove "
            "the offload"
        )
    if devices["offload_param"] == "cpu" and stage != 3:
        raise ConfigError(
            f"zero_optimization.offload_param.device = 'cpu' needs zero_optimization.stage 3 (got "
            f"stage {stage!r}, where DeepSpeed keeps every parameter on the device); set stage 3, "
            "or use offload_optimizer alone"
        )
    return devices


def apply_offload_keys(cfg: dict[str, Any], where: str = "the DeepSpeed config") -> dict[str, str]:
    """Check ``cfg``'s offload settings (``offload_devices``) and set, in place, the keys a shardopt optimizer
    needs with them (``OFFLOAD_KEYS``); a key the user set the other way is refused with its name, since DeepSpeed
    would refuse the optimizer (or accelerate replace it by ``DeepSpeedCPUAdam``). Returns the devices."""
    devices = offload_devices(cfg)
    if devices["offload_optimizer"] != "none":
        for key, value in OFFLOAD_KEYS.items():
            if key == "zero_force_ds_cpu_optimizer" and key in cfg and cfg[key] != value:
                raise ConfigError(
                    f"{key} = {cfg[key]!r} in {where}: with zero_optimization.offload_optimizer.device 'cpu' a "
                    f'shardopt optimizer needs "{key}": {str(value).lower()} (with true DeepSpeed refuses it, '
                    "and accelerate swaps in DeepSpeedCPUAdam); remove the key or set it so"
                )
            cfg[key] = value
    return devices


def _flat_layouts(
    order: list[torch.nn.Parameter],
    offsets: list[int],
    partition: int,
    rank: int,
    world: int,
    group: Any,
    names: Mapping[int, str],
    shape_of: Callable[[torch.Tensor], Sequence[int]],
) -> list[Fragment]:
    """Fragments of parameters concatenated at ``offsets`` into a flat buffer cut into ``world`` parts of
    ``partition`` elements (ZeRO-1/2 and the bf16 ZeRO-1 wrapper; ``zero_layouts.flat_fragments``)."""
    return flat_fragments(
        [names[id(p)] for p in order], [shape_of(p) for p in order], offsets, partition, world, rank, group
    )


def expert_layers(model: nn.Module | None) -> list[tuple[str, Any]]:
    """The ``deepspeed.moe.layer.MoE`` layers of ``model``, with their module names (``Any``: DeepSpeed is untyped,
    and its attributes, ``deepspeed_moe.experts...``, are no ``nn.Module`` attributes to mypy)."""
    try:
        from deepspeed.moe.layer import MoE
    except ImportError:  # pragma: no cover - deepspeed without its moe package
        return []
    return [] if model is None else [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]


def refuse_unsupported(model: nn.Module | None) -> None:
    """One clear error for the DeepSpeed parallelism the adapter cannot express yet, raised on every rank alike
    (it reads only the model) before any collective. Expert parallelism is supported
    (``split_expert_groups``); its tensor-parallel experts are not."""
    for name, layer in expert_layers(model):
        if getattr(layer, "enable_expert_tensor_parallelism", False):
            raise NotImplementedError(
                f"deepspeed.moe.layer.MoE at {name!r}: enable_expert_tensor_parallelism=True splits each expert "
                "over the tensor-parallel group, which shardopt's DeepSpeed adapter does not map; build the MoE "
                "layer with enable_expert_tensor_parallelism=False"
            )


def global_expert_names(model: nn.Module, names: dict[int, str]) -> None:
    """Name each expert's parameters by its global expert index, in place (``names``: id -> name).

    DeepSpeed numbers a rank's experts ``0 .. num_local_experts - 1``, so the same name means different experts on
    the ranks of an expert-parallel group. shardopt keys state, seeded draws and checkpoints by name, so it uses
    the global index ``ep_rank * num_local_experts + local`` (as DeepSpeed's own expert checkpoint files do):
    ranks holding the same expert share its name, and a checkpoint reloads at another expert-parallel size."""
    from deepspeed.utils import groups as ds_groups

    for layer_name, layer in expert_layers(model):
        ep_rank = ds_groups._get_expert_parallel_rank(layer.expert_group_name)
        prefix = (
            f"{layer_name}.deepspeed_moe.experts.deepspeed_experts"
            if layer_name
            else "deepspeed_moe.experts.deepspeed_experts"
        )
        for local, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            index = ep_rank * layer.num_local_experts + local
            for pname, p in expert.named_parameters():
                names[id(p)] = f"{prefix}.{index}.{pname}"


def split_expert_groups(groups: list[dict]) -> list[dict]:
    """Param groups with expert parameters in groups of their own, as DeepSpeed's ZeRO requires of MoE models:
    each rule's group splits into its dense parameters and one group per expert group name (``moe: True``,
    ``name``: the expert-parallel group). ZeRO then partitions and reduces an expert group over its expert
    data-parallel group (``real_dp_process_group``), which the adapter reads like any other group, so every
    statistic, owner and team of an expert matrix stays inside the ranks that hold that expert. Empty groups
    are left out (DeepSpeed drops them, and an empty group hangs ZeRO's step)."""
    from deepspeed.moe.utils import is_moe_param

    out: list[dict] = []
    for g in groups:
        names = g.get("names") or [None] * len(g["params"])
        dense = [(p, n) for p, n in zip(g["params"], names) if not is_moe_param(p)]
        experts: dict[str, list] = {}
        for p, n in zip(g["params"], names):
            if is_moe_param(p):
                experts.setdefault(p.group_name, []).append((p, n))
        for extra, members in [({}, dense)] + [({"moe": True, "name": k}, v) for k, v in experts.items()]:
            if members:
                part = {**g, **extra, "params": [p for p, _ in members]}
                if "names" in g:
                    part["names"] = [n for _, n in members]
                    if "param_names" in g:  # torch's names of the part, not the whole group's (copied by DeepSpeed's
                        part["param_names"] = list(part["names"])  # MoE split, they would no longer match)
                out.append(part)
    return out


def pipeline_stage(model: nn.Module | None) -> int | None:
    """The pipeline stage of this rank when ``model`` is a ``deepspeed.pipe.PipelineModule``, else None."""
    try:
        from deepspeed.pipe import PipelineModule
    except ImportError:  # pragma: no cover - deepspeed without its pipe package
        return None
    return int(model.stage_id) if isinstance(model, PipelineModule) else None


def pipeline_roles(model: nn.Module) -> RoleTable | None:
    """The roles of a ``PipelineModule``'s parameters in the whole model, keyed by the names this stage gives them.

    A stage holds part of the model: the last stage sees an LM head but no embedding, so roles found from it alone
    would call the head a plain matrix, which one process does not. Every rank can read the whole model's layer
    specs: they are built here on the meta device (no memory, no initialization) under the names the stages give
    them (``<layer index>.<param>``, tied modules ``tied_modules.<key>.<param>``), and roles are found on that. A
    tied module used by several layers (an embedding tied to the head) is the head, as one process names a tied
    weight. None when a spec cannot be built on the meta device: then each stage's own roles apply, with a warning."""
    import warnings

    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    from ..optim.routing import find_roles

    if not isinstance(model, PipelineModule):
        return None
    whole = nn.Module()
    tied = nn.ModuleDict()
    uses: dict[str, int] = {}
    attrs: dict[str, Any] = {}
    try:
        with torch.device("meta"):
            for idx, spec in enumerate(model._layer_specs):
                if isinstance(spec, TiedLayerSpec):
                    uses[spec.key] = uses.get(spec.key, 0) + 1
                    attrs.setdefault(spec.key, spec.tied_weight_attr)
                    if spec.key not in tied:
                        tied[spec.key] = spec.build()
                elif isinstance(spec, LayerSpec):
                    whole.add_module(str(idx), spec.build())
                elif isinstance(spec, nn.Module):
                    whole.add_module(str(idx), spec)
    except Exception as err:  # a spec that needs real memory or devices to build
        heads = _head_candidates(model)
        named = f"; on this stage {heads} would be the LM head by shape and position" if heads else ""
        warnings.warn(
            f"shardopt: the pipeline's layer specs could not be built on the meta device ({err}); each "
            "stage's parameters get the roles found on that stage alone, so an LM head on a stage without "
            "the embedding is a plain matrix" + named + ": declare it with routing={'<name>': 'lm_head'} "
            "(and 'embedding' for an embedding that is not an nn.Embedding)",
            UserWarning,
            stacklevel=3,
        )
        return None
    whole.tied_modules = tied
    table = find_roles(whole)
    for key, count in uses.items():
        for attr in [attrs[key]] if isinstance(attrs[key], str) else attrs[key] or []:
            name = f"tied_modules.{key}.{attr}"
            if count > 1 and table.roles.get(name) == "embedding":
                # the embedding tied to the output projection: one process's head
                table.roles[name], table.sources[name] = "lm_head", "declared"
    return table


def _head_candidates(model: nn.Module) -> list[str]:
    """On the last pipeline stage, the last Linear weight that widens (more outputs than inputs, as a vocabulary
    projection does): what would be the LM head by shape and position when the whole model cannot be seen."""
    if getattr(model, "stage_id", 0) != getattr(model, "num_stages", 1) - 1:
        return []
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and m.out_features > m.in_features]
    return [f"{linears[-1][0]}.weight"] if linears else []


def check_pipeline_stages(stage: int, groups: list[dict], unused: list[str]) -> None:
    """Pipeline parallelism (``deepspeed.pipe.PipelineModule``): each stage's optimizer holds that stage's
    parameters only, and its ZeRO partitions reduce over the stage's data-parallel group, so every statistic
    and owner stays inside the stage. Checked here on every rank at once (one ``all_gather_object`` over the
    world): a routing pattern must match a parameter on some stage. Stages may form different numbers of param
    groups (``balance_stage_norms``)."""
    mine = {"stage": stage, "groups": [_group_label(g) for g in groups], "unused": sorted(unused)}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    never = sorted(set.intersection(*(set(e["unused"]) for e in everyone)))
    if never:
        raise ConfigError(f"shardopt.routing: patterns {never} match no trainable parameter on any pipeline stage")


def balance_stage_norms(engine: Any) -> None:
    """Pipeline stages whose DeepSpeed wrappers hold different numbers of param groups: the gradient norm stays
    DeepSpeed's, with no mismatched collectives.

    DeepSpeed's ZeRO-1/2 computes the gradient norm group by group (``scaled_global_norm``), each group's sum of
    squares all-reduced over the data-parallel group and then over the model-parallel group, which spans the
    pipeline stages: stages with different numbers of groups would pair mismatched collectives and hang. A stage
    with ``k`` fewer groups (counted in the wrapper, after DeepSpeed split MoE groups) issues ``k`` more such
    all-reduces of zeros; each pairs with another stage's extra group and returns that group's global sum of
    squares, which this stage adds to its own, so every stage gets the same global norm (clipping, overflow). An
    invalid norm stays invalid. Other wrappers take one norm over all groups (ZeRO-0's fp32 engine, the bf16 ZeRO-1
    wrapper); any other with unequal counts is refused on every rank. Collective (one ``all_gather_object``)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.utils import is_invalid_grad_norm
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    wrapper = engine.optimizer
    mine = len(wrapper.bit16_groups) if isinstance(wrapper, DeepSpeedZeroOptimizer) else len(wrapper.param_groups)
    counts: list = [None] * dist.get_world_size()
    dist.all_gather_object(counts, mine)
    missing = max(counts) - mine
    if len(set(counts)) == 1 or isinstance(wrapper, (ShardedOptimizer, BF16_Optimizer)):
        return
    if not isinstance(wrapper, DeepSpeedZeroOptimizer):  # the same type on every rank: refused everywhere
        raise NotImplementedError(
            f"pipeline stages form different numbers of param groups ({sorted(set(counts))}) under DeepSpeed's "
            f"{type(wrapper).__name__}, which computes one gradient-norm collective per group across the stages; "
            "shardopt pads those of ZeRO-1 (zero_optimization.stage 1) and needs none for fp32/bf16 ZeRO-0 "
            "(stage 0 without fp16)"
        )
    if missing <= 0:
        return
    original = wrapper.scaled_global_norm

    def scaled_global_norm(norm_type: int = 2) -> torch.Tensor | float:
        norm = original(norm_type)
        from deepspeed.accelerator import get_accelerator

        extra = torch.zeros((), dtype=torch.float32, device=get_accelerator().current_device_name())
        for _ in range(missing):
            pad = torch.zeros_like(extra)
            dist.all_reduce(pad, op=dist.ReduceOp.SUM, group=wrapper.dp_process_group)
            wrapper._model_parallel_all_reduce(tensor=pad, op=dist.ReduceOp.SUM)
            extra += pad
        if is_invalid_grad_norm(norm) or not bool(torch.isfinite(extra)):
            return torch.full_like(norm, float("inf")) if torch.is_tensor(norm) else float("inf")
        return (
            (norm.float() ** 2 + extra.to(norm.device)).sqrt().to(norm.dtype)
            if torch.is_tensor(norm)
            else float((norm**2 + float(extra)) ** 0.5)
        )

    wrapper.scaled_global_norm = scaled_global_norm


def _group_label(group: dict) -> str:
    roles = "+".join(str(r) for r in group.get("roles", [])) or "-"
    return f"{group['treatment']}({roles}, {len(group['params'])} tensors)"


def attach_zero_layouts(engine: Any, opt: ShardedOptimizer, names: Mapping[int, str]) -> None:
    """Tell ``opt`` which matrices each flat fp32 tensor of DeepSpeed's wrapper holds."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    refuse_unsupported(getattr(engine, "module", None))
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    wrapper = engine.optimizer
    if wrapper is opt:
        return  # stage 0 without a wrapper: real parameters, whole matrices
    flat: list[tuple[torch.Tensor, list[Fragment]]] = []
    bit16: list[torch.Tensor] = []  # the model's weights, whose dtype the gradients arrive in
    if isinstance(wrapper, DeepSpeedZeroOptimizer):
        for g, partition in enumerate(wrapper.single_partition_of_fp32_groups):
            pg = wrapper.real_dp_process_group[g]
            world = dist.get_world_size(group=pg)
            frags = _flat_layouts(
                wrapper.round_robin_bit16_groups[g],
                wrapper.round_robin_bit16_offsets[g],
                wrapper.bit16_groups_flat[g].numel() // world,
                dist.get_rank(group=pg),
                world,
                pg,
                names,
                lambda p: tuple(p.shape),
            )
            flat.append((partition, frags))
            bit16.extend(wrapper.round_robin_bit16_groups[g])
    elif isinstance(wrapper, BF16_Optimizer):
        for g, partition in enumerate(wrapper.fp32_groups_flat_partition):
            pg = wrapper.real_dp_process_group[g]
            world = dist.get_world_size(group=pg)
            order = wrapper.bf16_groups[g]
            offsets = [sum(p.numel() for p in order[:i]) for i in range(len(order))]
            frags = _flat_layouts(
                order,
                offsets,
                wrapper.bf16_groups_flat[g].numel() // world,
                dist.get_rank(group=pg),
                world,
                pg,
                names,
                lambda p: tuple(p.shape),
            )
            flat.append((partition, frags))
            bit16.extend(order)
    elif isinstance(wrapper, DeepSpeedZeroOptimizer_Stage3):
        for sg, partition in enumerate(wrapper.fp32_partitioned_groups_flat):
            pg = (
                wrapper.sub_group_process_groups[sg]
                if hasattr(wrapper, "sub_group_process_groups")
                else wrapper.dp_process_group
            )
            world = dist.get_world_size(group=pg)
            rank = dist.get_rank(group=pg)
            params = wrapper.fp16_groups[sg]
            frags, _ = zero3_fragments(
                [names[id(p)] for p in params],
                [tuple(p.ds_shape) for p in params],
                world,
                rank,
                pg,
                partition_numels=[p.partition_numel() for p in params],
            )
            flat.append((partition, frags))
            bit16.extend(params)
    else:
        raise NotImplementedError(
            f"DeepSpeed wrapped the optimizer in {type(wrapper).__name__}, which shardopt cannot map to "
            "matrices; use zero_optimization.stage 1, 2 or 3 (or stage 0 with fp32)"
        )
    opt.use_layouts(flat=flat)
    opt.engine_skips_nonfinite = _skips_nonfinite_steps(wrapper)
    # bf16/fp16 weights: the rules' numerical-zero cutoffs follow that precision, not the fp32 partitions'
    record_arrival_dtypes(opt, {names[id(p)]: p.dtype for p in bit16 if id(p) in names and p.dtype in LOW_PRECISION})


def _skips_nonfinite_steps(wrapper: Any) -> bool:
    """Whether DeepSpeed's wrapper skips a step whose gradients hold inf or NaN before it calls the optimizer,
    on every rank (one collective of its own): ZeRO-3 and the bf16 ZeRO-1 wrapper always (an invalid global
    gradient norm); ZeRO-1/2 with fp16 (its overflow check), or with the global norm computed
    (``compute_grad_norm``, the default) for weights that are not bf16. shardopt's own check would repeat that
    decision with one more collective per call, and ZeRO-1/2 call the optimizer once per param group."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if isinstance(wrapper, (BF16_Optimizer, DeepSpeedZeroOptimizer_Stage3)):
        return True
    if isinstance(wrapper, DeepSpeedZeroOptimizer):
        return bool(getattr(wrapper, "check_grad_overflow", False)) or (
            bool(getattr(wrapper, "compute_grad_norm", False)) and getattr(wrapper, "dtype", None) != torch.bfloat16
        )
    return False


def initialize(
    model: nn.Module, config: str | os.PathLike | Mapping[str, Any], **kwargs: Any
) -> tuple[Any, Any, Any, Any]:
    """``deepspeed.initialize`` with the optimizer from the config's ``"shardopt"`` section.

    Returns what ``deepspeed.initialize`` returns: ``(engine, optimizer, dataloader, lr_scheduler)``.
    ``model_parameters`` and ``optimizer`` must not be passed: shardopt builds both from the model.
    """
    import deepspeed

    for key in ("optimizer", "model_parameters"):
        if key in kwargs:
            raise TypeError(f"shardopt.deepspeed.initialize builds {key!r} itself; do not pass it")
    refuse_unsupported(model)
    cfg = load_config(config)
    section, hp = parse_section(cfg)
    from .deepspeed_checkpoint import refuse_load_universal

    refuse_load_universal(cfg)
    cfg["zero_allow_untested_optimizer"] = True
    names = {id(p): n for n, p in model.named_parameters()}
    stage = pipeline_stage(model)
    unused: list[str] | None = None if stage is None else []
    groups = build_param_groups(
        model,
        section.optimizer,
        hp,
        section.routing,
        unused=unused,
        roles=pipeline_roles(model) if stage is not None else None,
    )
    if stage is not None:
        assert unused is not None  # a list whenever there is a stage
        check_pipeline_stages(stage, groups, unused)
    cls = optimizer_class(section.optimizer)
    built: dict[str, ShardedOptimizer] = {}

    def factory(params: Any) -> ShardedOptimizer:
        if expert_layers(model):  # DeepSpeed has created the expert groups by now
            global_expert_names(model, names)
            params = split_expert_groups([{**g, "names": [names[id(p)] for p in g["params"]]} for g in params])
        built["opt"] = cls.from_config(params, hp)
        return built["opt"]

    result = deepspeed.initialize(model=model, model_parameters=groups, config=cfg, optimizer=factory, **kwargs)
    engine = result[0]
    opt = built["opt"]
    opt.param_names.update(names)
    attach_zero_layouts(engine, opt, names)
    install_checkpoint_hooks(engine, opt, names)
    expose_describe(engine, result[1])  # engine.describe(), optimizer.describe(): the role table (optim.describe)
    if stage is not None:
        balance_stage_norms(engine)
    return result


# ---------------------------------------------------------------------------------------------- checkpoints
def _latest_tag(load_dir: str) -> str | None:
    path = os.path.join(load_dir, "latest")
    if os.path.isfile(path):
        with open(path) as f:
            return f.read().strip()
    return None


def _sync_bit16_params(engine: Any, reader: Any, names: Mapping[int, str]) -> None:
    """After the fp32 masters were loaded, give the module's (bit16) parameters the same values, reading from
    the checkpoint only what this rank's module holds (its ZeRO-3 partition, or the replicated weights of
    ZeRO-1/2), one parameter at a time."""
    from ..checkpoint.logical import fill_param_range

    with torch.no_grad():
        for p in engine.module.parameters():
            name = names.get(id(p))
            if name is None:  # not a parameter the checkpoint names: fill_param_range would find nothing for it
                continue
            numel = int(getattr(p, "ds_numel", p.numel()))
            if hasattr(p, "ds_tensor"):  # ZeRO-3: this rank's padded partition of the flat parameter
                part = p.ds_tensor.numel()
                rank = dist.get_rank(group=p.ds_process_group) if hasattr(p, "ds_process_group") else dist.get_rank()
                lo, hi = min(rank * part, numel), min((rank + 1) * part, numel)
                buf = torch.empty(hi - lo, dtype=torch.float32)
                if fill_param_range(reader, name, lo, hi, buf):
                    p.ds_tensor.data.zero_()
                    p.ds_tensor.data[: hi - lo].copy_(buf.to(p.ds_tensor.dtype))
            else:
                buf = torch.empty(numel, dtype=torch.float32)
                if fill_param_range(reader, name, 0, numel, buf):
                    p.data.copy_(buf.view_as(p.data).to(p.dtype))


def _committed_save(engine: Any, save_dir: str, tag: str, save_latest: bool, ds_save: Any, ours: Any) -> Any:
    """A DeepSpeed save that is complete or invisible (``shardopt.checkpoint.commit``): DeepSpeed's files (without
    its ``latest``, which it writes before the ranks meet) and shardopt's, fsynced on every rank; after the ranks
    agree, rank 0 writes the tag's marker, then ``latest``, atomically, and removes interrupted saves' leftovers.
    A rank killed anywhere before the marker leaves ``latest`` naming the previous checkpoint."""
    from ..checkpoint import commit
    from ..checkpoint.errors import CheckpointError

    tag_dir = os.path.join(save_dir, tag)
    rank = dist.get_rank()
    if rank == 0 and os.path.isdir(tag_dir):
        commit.remove_marker(tag_dir)  # a tag saved again is incomplete until its new marker
    dist.barrier()
    result = ds_save()
    ours(tag_dir)
    error = None
    try:
        commit.fsync_dir(tag_dir)
    except OSError as err:
        error = f"rank {rank} could not flush its files ({err})"
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [e for e in errors if e]
    if failed:
        raise CheckpointError(f"{tag_dir}: not saved, {failed[0]}; 'latest' still names the previous checkpoint")
    outcome: list = [None]
    if rank == 0:  # its failure is every rank's (shared below), so no rank waits in a collective rank 0 skipped
        try:
            commit.write_marker(tag_dir, {"global_steps": int(engine.global_steps), "tag": tag})
            if save_latest:
                commit.write_atomic(os.path.join(save_dir, "latest"), tag)
        except OSError as err:
            outcome[0] = f"{tag_dir}: not committed, rank 0 could not write its marker or 'latest' ({err})"
        else:
            try:
                commit.clean(save_dir)
            except OSError:
                pass  # leftovers stay for the next save or `shardopt checkpoint clean`
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise CheckpointError(outcome[0])
    return result


def _incomplete(load_dir: str, tag: str | None, module_only: bool) -> str | None:
    """Why tag ``tag`` of ``load_dir`` must not load (``commit.incomplete``), or None. A module-only load also
    takes a DeepSpeed checkpoint written without shardopt (no shardopt file, no marker)."""
    from ..checkpoint import commit

    if tag is None:  # no 'latest': DeepSpeed's own load says so
        return None
    return commit.incomplete(load_dir, tag, needs_shardopt=not module_only)


def install_checkpoint_hooks(engine: Any, opt: ShardedOptimizer, names: Mapping[int, str]) -> None:
    """Make ``engine.save_checkpoint`` also write shardopt's logical state into ``<dir>/<tag>/`` and commit the tag
    only when every rank's files are in place (``_committed_save``), and ``engine.load_checkpoint`` refuse an
    incomplete tag on every rank and fall back to it when DeepSpeed's own files cannot be used (another data-parallel
    size or ZeRO stage, or a checkpoint converted from FSDP2), with DeepSpeed's load options and return value
    (``deepspeed_checkpoint.load_resharded``)."""
    from .. import checkpoint as ckpt
    from .deepspeed_checkpoint import mark_not_universal

    ds_save, ds_load = engine.save_checkpoint, engine.load_checkpoint

    def save_checkpoint(save_dir, tag=None, client_state={}, save_latest=True, **kwargs):  # noqa: B006
        tag = tag if tag is not None else f"global_step{engine.global_steps}"

        def ours(tag_dir: str) -> None:
            extra = {
                "global_steps": engine.global_steps,
                "global_samples": engine.global_samples,
                "zero_stage": engine.zero_optimization_stage(),
                "client_state": client_state,
                "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
                "commit": "marker",
            }  # complete only with the tag's marker (checkpoint.commit)
            ckpt.save(tag_dir, opt, engine="deepspeed", extra=extra)

        marked = mark_not_universal(client_state, engine)  # ds_to_universal stops at once, naming shardopt's route
        return _committed_save(
            engine,
            str(save_dir),
            str(tag),
            save_latest,
            lambda: ds_save(save_dir, tag=tag, client_state=marked, save_latest=False, **kwargs),
            ours,
        )

    def load_checkpoint(
        load_dir,
        tag=None,
        load_module_strict=True,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
        load_module_only=False,
        custom_load_fn=None,
        **kwargs,
    ):
        options = dict(
            load_module_strict=load_module_strict,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
            custom_load_fn=custom_load_fn,
        )

        # Decide on rank 0 and share it: the two paths issue different collectives, so a rank that sees the
        # files differently (node-local disk, a lagging shared filesystem) must not choose on its own.
        decision: list[Any] = [None, None, None]  # tag, use_ours, problem
        if dist.get_rank() == 0:
            t, use_ours = tag, False
            try:
                t = tag if tag is not None else _latest_tag(str(load_dir))
                # an incomplete checkpoint (a save interrupted, a file lost or cut) is refused on every rank alike
                problem = _incomplete(str(load_dir), t, load_module_only)
                ours = ckpt.state_path(os.path.join(str(load_dir), str(t))) if t is not None else None
                use_ours = False
                if problem is None and ours is not None and os.path.isfile(ours):
                    meta = ckpt.read_metadata(ours)
                    extra = meta.get("extra") or {}
                    use_ours = not (
                        meta.get("engine") == "deepspeed"
                        and meta.get("world_size") == dist.get_world_size()
                        and extra.get("zero_stage") == engine.zero_optimization_stage()
                    )
                    if not use_ours:  # DeepSpeed's files load, but a damaged tag is refused now, not at a reshard
                        with ckpt.StateReader(ours, meta) as reader:
                            if reader.verify:
                                reader.check_files(meta["index"])
            except (ckpt.CheckpointError, OSError, ValueError) as err:  # raised below on every rank, not here alone
                problem = str(err) if isinstance(err, ckpt.CheckpointError) else f"{load_dir}: {err}"
            decision = [t, use_ours, problem]
        dist.broadcast_object_list(decision, src=0)
        tag, use_ours, problem = decision
        if problem is not None:
            raise ckpt.CheckpointError(problem)
        if not use_ours:
            return ds_load(load_dir, tag=tag, **options, **kwargs)
        if kwargs:
            raise TypeError(
                f"engine.load_checkpoint: {sorted(kwargs)} are not DeepSpeed's load options, which "
                "shardopt's resharding load takes (another world size or ZeRO stage)"
            )
        from .deepspeed_checkpoint import load_resharded

        return load_resharded(engine, opt, names, str(load_dir), str(tag), sync_bit16=_sync_bit16_params, **options)

    engine.save_checkpoint = save_checkpoint
    engine.load_checkpoint = load_checkpoint
