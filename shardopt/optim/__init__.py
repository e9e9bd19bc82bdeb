"""shardopt's optimizer algorithms, each written once against the sharded-matrix primitives."""

from .alice import Alice, Alice0
from .asgo import ASGO, DASGO
from .base import ShardedOptimizer
from .muon import Muon
from .racs import RACS
from .registry import OPTIMIZERS, ConfigError, create_optimizer, validate_hyperparameters
from .scale import SCALE
from .sharder_groups import param_groups
from .sinkgd import SinkGD
from .sumo import SUMO
from .swan import SWAN

__all__ = [
    "ShardedOptimizer",
    "SCALE",
    "SinkGD",
    "RACS",
    "SWAN",
    "ASGO",
    "DASGO",
    "SUMO",
    "Alice",
    "Alice0",
    "Muon",
    "OPTIMIZERS",
    "ConfigError",
    "create_optimizer",
    "param_groups",
    "validate_hyperparameters",
]
