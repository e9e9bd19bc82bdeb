"""``shardopt.megatron.get_megatron_optimizer``: shardopt's rules in Megatron-core's DistributedOptimizer (needs
``megatron-core``; see ``shardopt.plugin.megatron_engine``)."""

from .plugin.megatron_engine import (
    MegatronError,
    get_megatron_optimizer,
    global_named_parameters,
    megatron_roles,
    unwrap,
)

__all__ = ["get_megatron_optimizer", "MegatronError", "global_named_parameters", "megatron_roles", "unwrap"]
