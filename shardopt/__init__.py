"""shardopt: memory-efficient, matrix-aware optimizers that stay exact on sharded parameters.

``shardopt.create_optimizer(model, "scale" | "sinkgd" | "racs", **hyperparameters)`` for single process,
DDP and FSDP2; ``shardopt.deepspeed.initialize(model=..., config=...)`` for DeepSpeed ZeRO 0-3.
"""
from .optim import RACS, SCALE, SWAN, ConfigError, Muon, SinkGD, ShardedOptimizer, create_optimizer

__version__ = "0.1.0"
__all__ = ["create_optimizer", "SCALE", "SinkGD", "RACS", "Muon", "SWAN", "ShardedOptimizer", "ConfigError", "__version__"]


def __getattr__(name: str):
    # ``shardopt.deepspeed`` imports DeepSpeed, which is an optional extra: load it on first use only.
    if name == "deepspeed":
        import importlib

        return importlib.import_module(".deepspeed", __name__)
    raise AttributeError(f"module 'shardopt' has no attribute {name!r}")
