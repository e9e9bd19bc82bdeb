"""DeepSpeed's universal checkpoint: refused at ``initialize`` with the route that works (issue 55).

``"checkpoint": {"load_universal": true}`` made DeepSpeed's load fail later with a bare ``AssertionError``;
shardopt's own checkpoints reshard already. The refusal runs before DeepSpeed is initialized (no process group).
``ds_to_universal`` on a shardopt checkpoint: ``tests_dist/test_checkpoint_options.py``.
"""

from __future__ import annotations

import pytest
from torch import nn

pytest.importorskip("deepspeed")

import shardopt  # noqa: E402
from shardopt.optim.registry import ConfigError  # noqa: E402


def test_load_universal_is_refused_naming_shardopts_route() -> None:
    config = {
        "train_batch_size": 2,
        "checkpoint": {"load_universal": True},
        "shardopt": {"optimizer": "scale", "params": {"lr": 1e-3}},
    }
    with pytest.raises(ConfigError) as err:
        shardopt.deepspeed.initialize(model=nn.Linear(4, 4), config=config)
    msg = str(err.value)
    assert msg.startswith("checkpoint.load_universal = true")
    assert "engine.load_checkpoint" in msg and "shardopt checkpoint convert" in msg and "shardopt.checkpoint" in msg


def test_load_universal_false_is_not_refused() -> None:
    from shardopt.plugin.deepspeed_checkpoint import refuse_load_universal

    refuse_load_universal({"checkpoint": {"load_universal": False}})
    refuse_load_universal({})
