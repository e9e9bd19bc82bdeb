"""The reference LLaMA trainer: ``python -m shardopt.train --config configs/train/demo.json``.

Heavy imports (DeepSpeed, tokenizers, matplotlib) happen only when a run needs them.
"""

from typing import Any

from .config import TrainConfig, TrainConfigError, load_train_config
from .model import PRESETS, Llama, LlamaConfig, model_config

__all__ = [
    "TrainConfig",
    "TrainConfigError",
    "load_train_config",
    "Llama",
    "LlamaConfig",
    "PRESETS",
    "model_config",
    "Trainer",
    "lr_lambda",
]


def __getattr__(name: str) -> Any:
    if name in ("Trainer", "lr_lambda"):
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'shardopt.train' has no attribute {name!r}")
