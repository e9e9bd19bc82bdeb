"""Which role and rule every parameter gets: ``shardopt.describe(obj)``, ``optimizer.describe()`` and
``describe_roles(model, "scale")``.

A table with one row per trainable parameter: its name, logical (unsharded) shape, role (``embedding``,
``lm_head``, ``router``, ``matrix``, ``matrix_transposed``, ``vector`` or ``adamw`` by a routing pattern), where the
role came from (``declared`` by the model, the module's ``type``, ``guessed``, or the user's ``routing``) and the rule
with the options that distinguish it (``scale norm_dim=0`` is per column of the stored weight). ``shardopt roles``
prints it for a Hugging Face model built from its config (no weights are read). The table itself
(``describe_groups``, ``ShardedOptimizer.describe``) lives in ``routing`` and ``base`` so that the optimizer needs no
import of the registry (no import cycle).

``describe(obj)`` takes whatever a front door hands the user and finds the shardopt optimizer inside: the optimizer
or engine of ``shardopt.deepspeed.initialize`` (ZeRO 0-3, pipelines), Megatron's wrapper
(``shardopt.megatron.get_megatron_optimizer``), the Hugging Face Trainer, accelerate's ``AcceleratedOptimizer`` or
``Accelerator``, or the optimizer itself (DDP, FSDP2, FSDP1). Engines that step flat partitions still list every
logical parameter, with the model's names and shapes: the same table as one process.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Mapping

from torch import nn

from .base import ShardedOptimizer
from .registry import build_param_groups, validate_hyperparameters
from .routing import describe_groups, format_table

__all__ = ["describe", "describe_roles", "describe_groups", "find_optimizers", "expose_describe"]

#: where front doors keep what they wrap: DeepSpeed's engine and ZeRO / bf16 wrappers, accelerate's optimizer and
#: the Trainer (``optimizer``), accelerate's DeepSpeed wrapper (``engine``), shardopt's Megatron wrapper
#: (``shardopt``), Megatron's ``ChainedOptimizer`` (``chained_optimizers``), an ``Accelerator`` (``_optimizers``)
_INNER = ("shardopt", "optimizer", "engine", "chained_optimizers", "_optimizers")


def find_optimizers(obj: Any, _depth: int = 0) -> list[ShardedOptimizer]:
    """The shardopt optimizers inside ``obj`` (a front door's optimizer, engine, trainer...), each once."""
    if isinstance(obj, ShardedOptimizer):
        return [obj]
    if obj is None or _depth > 6:
        return []
    if isinstance(obj, (list, tuple)):
        found = [o for item in obj for o in find_optimizers(item, _depth + 1)]
    else:
        found = []
        for attr in _INNER:
            try:
                inner = getattr(obj, attr, None)
            except Exception:  # noqa: BLE001  a wrapper's __getattr__ that raises something else
                continue
            if inner is not None and inner is not obj:
                found += find_optimizers(inner, _depth + 1)
    unique: dict[int, ShardedOptimizer] = {}
    for opt in found:
        unique.setdefault(id(opt), opt)
    return list(unique.values())


def _pipeline_group(obj: Any) -> Any:
    """The process group of ``obj``'s pipeline stages (None for one stage): a DeepSpeed engine's grid, or Megatron's
    pipeline group where Megatron's model parallelism is initialized. Refuses objects that cannot tell (a ZeRO
    wrapper does not know its engine)."""
    grid = getattr(obj, "grid", None)
    if grid is not None and hasattr(grid, "get_pipe_parallel_group"):
        return grid.get_pipe_parallel_group() if grid.get_pipe_parallel_world_size() > 1 else None
    ps = sys.modules.get("megatron.core.parallel_state")  # not imported: Megatron's parallelism is not set up
    if ps is not None and ps.model_parallel_is_initialized():
        return ps.get_pipeline_model_parallel_group() if ps.get_pipeline_model_parallel_world_size() > 1 else None
    if hasattr(obj, "zero_optimization_stage"):  # a DeepSpeed engine without pipeline: one stage
        return None
    raise ValueError(
        f"shardopt.describe(all_stages=True) got {type(obj).__name__}, which does not say which pipeline "
        "stages exist; pass the engine shardopt.deepspeed.initialize returned (or, under Megatron, call "
        "it after Megatron's parallel state is initialized)"
    )


def _gather_stages(rows: list[tuple[str, ...]], group: Any) -> list[tuple[str, ...]]:
    """Every stage's rows, stage by stage; a parameter two stages hold (tied layers) listed once."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size(group=group)
    dist.all_gather_object(gathered, rows, group=group)
    out: dict[str, tuple[str, ...]] = {}
    for stage_rows in gathered:
        for row in stage_rows:
            out.setdefault(row[0], tuple(row))
    return list(out.values())


def describe(
    obj: Any,
    optimizer: str | None = None,
    routing: Mapping[str, str] | None = None,
    *,
    all_stages: bool = False,
    **hyperparameters: Any,
) -> str:
    """The role table of the shardopt optimizer that ``obj`` is or holds (``find_optimizers``), as one process
    prints it; for a model without an optimizer (``obj`` an ``nn.Module`` and ``optimizer`` a name), the table
    ``create_optimizer(obj, optimizer, routing, **hyperparameters)`` would build (``describe_roles``).

    A pipeline stage's optimizer holds that stage's parameters, so its table lists those. ``all_stages=True``
    gathers every stage's rows (DeepSpeed ``PipelineEngine`` or Megatron pipeline parallelism) into one table,
    stage by stage, on every rank: a collective, so call it on every rank of the stages' group."""
    if optimizer is not None:
        if not isinstance(obj, nn.Module):
            raise TypeError(
                f"shardopt.describe(obj, {optimizer!r}): obj must be the model (an nn.Module) when an "
                f"optimizer name is given, got {type(obj).__name__}; pass the optimizer alone instead"
            )
        return describe_roles(obj, optimizer, routing, **hyperparameters)
    found = find_optimizers(obj)
    if not found:
        hint = (
            " (the Trainer builds its optimizer in train(): call trainer.create_optimizer() first)"
            if hasattr(obj, "create_optimizer") and getattr(obj, "optimizer", 0) is None
            else ""
        )
        raise TypeError(
            f"shardopt.describe: found no shardopt optimizer in {type(obj).__name__}{hint}; pass what "
            "a front door returned (the optimizer or the DeepSpeed engine), or a model with an optimizer "
            "name: shardopt.describe(model, 'scale')"
        )
    rows = [row for opt in found for row in opt.describe_rows()]
    group = _pipeline_group(obj) if all_stages else None
    return format_table(_gather_stages(rows, group) if group is not None else rows)


def expose_describe(*holders: Any) -> None:
    """Give each front door's object that holds a shardopt optimizer and has no ``describe`` of its own (DeepSpeed's
    engine and ZeRO wrapper, accelerate's ``AcceleratedOptimizer``) a ``describe(**kwargs)``: ``shardopt.describe``
    of that object, so ``optimizer.describe()`` works on whatever the front door returned."""
    for holder in holders:
        if holder is None or isinstance(holder, ShardedOptimizer):
            continue
        if getattr(type(holder), "describe", None) is not None or "describe" in vars(holder):
            continue
        if find_optimizers(holder):
            holder.describe = functools.partial(describe, holder)


def describe_roles(
    model: nn.Module, optimizer: str, routing: Mapping[str, str] | None = None, **hyperparameters: Any
) -> str:
    """The table for ``shardopt.create_optimizer(model, optimizer, routing, **hyperparameters)``, without
    building the optimizer (so also for a model on the meta device)."""
    cfg = validate_hyperparameters(optimizer, hyperparameters, where="describe_roles")
    defaults = cfg.group_defaults()  # what the optimizer's groups take from its defaults (SUMO's momentum)
    return describe_groups(
        [
            g if g["treatment"] == "adamw" else {**defaults, **g}
            for g in build_param_groups(model, optimizer, cfg, routing)
        ]
    )
