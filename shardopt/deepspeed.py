"""``shardopt.deepspeed.initialize``: DeepSpeed with a shardopt optimizer from the JSON ``"shardopt"`` section."""

from .plugin.deepspeed_engine import (
    ShardoptSection,
    attach_zero_layouts,
    initialize,
    load_config,
    parse_section,
    parse_shardopt_section,
)

__all__ = [
    "initialize",
    "ShardoptSection",
    "attach_zero_layouts",
    "load_config",
    "parse_section",
    "parse_shardopt_section",
]
