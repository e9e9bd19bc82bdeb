"""torch.optim's checks of hyperparameter values, shared by the optimizer base and the config models."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_lr", "check_hyperparameters"]


def check_lr(lr: Any, where: str = "lr") -> None:
    """torch's rule for a tensor learning rate: one element (it is read as a number at each step)."""
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError(f"Tensor lr must be 1-element ({where} has shape {tuple(lr.shape)})")


def check_hyperparameters(options: dict, where: str) -> None:
    """torch's checks of the hyperparameters every group may hold (``lr``, ``weight_decay``, ``eps``,
    ``betas``, ``momentum``), as ``ValueError``s that say which value and where."""
    lr = options.get("lr")
    check_lr(lr, f"{where} lr")
    if lr is not None and not lr >= 0:
        raise ValueError(f"Invalid learning rate: {float(lr)} ({where}; must be >= 0)")
    for key in ("weight_decay", "eps"):
        if options.get(key) is not None and not options[key] >= 0:
            raise ValueError(f"Invalid {key} value: {options[key]} ({where}; must be >= 0)")
    for i, beta in enumerate(options.get("betas") or ()):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {beta} ({where}; must be in [0, 1))")
    momentum = options.get("momentum")
    if momentum is not None and not 0.0 <= momentum < 1.0:
        raise ValueError(f"Invalid momentum value: {momentum} ({where}; must be in [0, 1))")
