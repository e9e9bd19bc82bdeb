"""shardopt's optimizer algorithms, each written once against the sharded-matrix primitives."""
from .base import ShardedOptimizer
from .muon import Muon
from .swan import SWAN
from .racs import RACS
from .registry import OPTIMIZERS, ConfigError, create_optimizer, validate_hyperparameters
from .scale import SCALE
from .sinkgd import SinkGD

__all__ = ["ShardedOptimizer", "SCALE", "SinkGD", "RACS", "Muon", "SWAN", "OPTIMIZERS", "ConfigError", "create_optimizer",
           "validate_hyperparameters"]
