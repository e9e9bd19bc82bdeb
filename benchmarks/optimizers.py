"""Which optimizers a benchmark runs and how each is built.

Every name in shardopt's registry (so optimizers added later appear without touching the benchmarks) plus
the ``torch.optim.AdamW`` baselines. ``--optimizers`` takes a comma list or ``all``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["registered", "select", "build", "default_lr", "sweep_hyperparameters", "shardopt_of", "ADAMW_VARIANTS"]

#: torch.optim.AdamW implementations compared in the step-time benchmark
ADAMW_VARIANTS = ("adamw_foreach", "adamw_fused")


def registered() -> list[str]:
    """shardopt's optimizer names in registry order."""
    from shardopt.optim.registry import OPTIMIZERS

    return list(OPTIMIZERS)


def select(arg: str | None, available: Sequence[str]) -> list[str]:
    """Names from a ``--optimizers`` value (``None``/``"all"``: every available name, in order)."""
    if arg is None or arg == "all":
        return list(available)
    names = [n.strip().lower() for n in arg.split(",") if n.strip()]
    unknown = [n for n in names if n not in available]
    if unknown:
        raise SystemExit(f"--optimizers: unknown {unknown}; choose from {list(available)} or 'all'")
    return names


def build(
    name: str, model: torch.nn.Module, on_nonfinite: str | None = None, **hyperparameters: Any
) -> torch.optim.Optimizer:
    """``adamw`` / ``adamw_foreach`` / ``adamw_fused`` (torch, over every parameter) or a shardopt optimizer;
    ``on_nonfinite`` (None: the optimizer's default) goes to shardopt's optimizers only (torch's AdamW checks
    nothing).

    Raises ``RuntimeError`` when a fused AdamW does not exist for the device (the caller reports it)."""
    if name.startswith("adamw"):
        kw: dict[str, Any] = {"lr": hyperparameters.pop("lr", 1e-3), **hyperparameters}
        if name == "adamw_fused":
            kw["fused"] = True
        elif name == "adamw_foreach":
            kw["foreach"] = True
        return torch.optim.AdamW(model.parameters(), **kw)
    import shardopt

    if on_nonfinite is not None:
        hyperparameters["on_nonfinite"] = on_nonfinite
    return shardopt.create_optimizer(model, name, **hyperparameters)


def default_lr(name: str) -> tuple[float, float | None]:
    """(lr, adam_lr) defaults of a shardopt optimizer (``adam_lr`` None means "same as lr")."""
    from shardopt.optim.registry import OPTIMIZERS

    fields = OPTIMIZERS[name].Config.model_fields
    adam = fields["adam_lr"].default if "adam_lr" in fields else None
    return float(fields["lr"].default), (float(adam) if adam is not None else None)


def sweep_hyperparameters(name: str, multiplier: float) -> dict[str, float]:
    """The defaults with every learning rate scaled by ``multiplier`` (matrix rule and AdamW part); ``adamw`` is
    the trainer's AdamW."""
    if name == "adamw":
        from shardopt.train.config import AdamWParams

        return {"lr": AdamWParams.model_fields["lr"].default * multiplier}
    lr, adam_lr = default_lr(name)
    out = {"lr": lr * multiplier}
    if adam_lr is not None:
        out["adam_lr"] = adam_lr * multiplier
    return out


def shardopt_of(optimizer: Any) -> Any | None:
    """The shardopt optimizer inside an engine's wrapper (DeepSpeed ZeRO keeps it as ``.optimizer``)."""
    from shardopt.optim.base import ShardedOptimizer

    seen = 0
    while optimizer is not None and seen < 8:
        if isinstance(optimizer, ShardedOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
        seen += 1
    return None
