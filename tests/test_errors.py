"""Bad input gets one clear error that names the problem and where it is."""

from __future__ import annotations

import glob
import os

import pytest
import torch
from tiny_model import Tiny
from torch import nn

import shardopt
from shardopt import SCALE, ConfigError
from shardopt.plugin.deepspeed_engine import load_config, parse_section

ROOT = os.path.dirname(os.path.dirname(__file__))


CREATE_CASES = [
    (dict(name="adam9"), ConfigError, r"unknown optimizer 'adam9'.*scale"),
    (dict(name="scale", foo=1), ConfigError, r"create_optimizer\.foo: unknown hyperparameter"),
    (dict(name="racs", lr=-1.0), ConfigError, r"create_optimizer\.lr"),
    (dict(name="scale", adam_betas=(0.9, 1.5)), ConfigError, r"adam_betas\[1\] = 1.5 is outside \[0, 1\)"),
    (
        dict(name="sinkgd", routing={"norm.weight": "matrix"}),
        ValueError,
        r"'norm.weight' of shape \(7,\).*needs a 2-D matrix.*routing=\{'norm.weight': 'adamw'\}",
    ),
    (dict(name="scale", routing={"proj.*": "lm_hed"}), ValueError, r"routing\['proj.\*'\] = 'lm_hed': unknown role"),
    (dict(name="scale", routing={"decoder.*": "adamw"}), ValueError, r"match no trainable parameter"),
]


@pytest.mark.parametrize("kwargs,exc,pattern", CREATE_CASES)
def test_create_optimizer_errors(kwargs, exc, pattern):
    kwargs = dict(kwargs)
    name = kwargs.pop("name")
    with pytest.raises(exc, match=pattern):
        shardopt.create_optimizer(Tiny(), name, **kwargs)


def test_optimizer_class_refuses_non_matrix_in_matrix_group():
    bias = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"'b' of shape \(3,\) is in a 'scale' group"):
        SCALE([{"params": [("b", bias)], "treatment": "scale"}])


BASE = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}
DS_CASES = [
    ({**BASE, "optimizer": {"type": "AdamW"}, "shardopt": {"optimizer": "scale"}}, r"both an 'optimizer' block"),
    (BASE, r"no 'shardopt' section"),
    (
        {**BASE, "shardopt": {"optimizer": "scale", "lrr": 1}},
        r"shardopt\.lrr: unknown key of the shardopt section \(it takes optimizer, params, routing\)",
    ),
    (
        {**BASE, "shardopt": {"optimizer": "scale", "params": {"bogus": 1}}},
        r"shardopt\.params\.bogus: unknown hyperparameter",
    ),
    ({**BASE, "shardopt": {"optimizer": "muon9"}}, r"shardopt\.optimizer: unknown optimizer 'muon9'"),
    # CPU offload is supported (issue 56); NVMe offload is refused naming CPU offload
    (
        {
            **BASE,
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}},
            "shardopt": {"optimizer": "scale"},
        },
        r"zero_optimization\.offload_optimizer\.device = 'nvme'.*use CPU offload",
    ),
    (
        {
            **BASE,
            "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}},
            "shardopt": {"optimizer": "scale"},
        },
        r"offload_optimizer\.device = 'cpu' needs zero_optimization\.stage 1, 2",
    ),
]


@pytest.mark.parametrize("config,pattern", DS_CASES)
def test_deepspeed_section_errors(config, pattern):
    with pytest.raises(ConfigError, match=pattern):
        parse_section(load_config(config))


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "deepspeed", "*.json"))))
def test_shipped_deepspeed_configs_validate(path):
    cfg = load_config(path)
    section, hp = parse_section(cfg)
    assert section.optimizer in shardopt.optim.OPTIMIZERS
    assert "shardopt" not in cfg and "optimizer" not in cfg


# DeepSpeed keys are DeepSpeed's (issue 65): shardopt validates its "shardopt" section and the settings it refuses
# or rewrites (an "optimizer" block, offload); everything else reaches deepspeed.initialize as written
PASS_THROUGH = [
    {"stage": 2, "some_future_key": 1},  # a newer DeepSpeed's key
    {"stage": 3, "mics_shard_size": 2},  # removed in DeepSpeed 0.19.8: DeepSpeed has its own message
    {"stage": 2, "reduce_bucket_size": "not a number"},
]


@pytest.mark.parametrize("zero", PASS_THROUGH)
def test_deepspeed_keys_pass_through_parse_section(zero):
    cfg = load_config({**BASE, "zero_optimization": zero, "shardopt": {"optimizer": "scale"}})
    parse_section(cfg)
    assert cfg["zero_optimization"] == zero and "shardopt" not in cfg


def test_deepspeed_keys_reach_deepspeed_and_get_its_own_message(monkeypatch):
    """``shardopt.deepspeed.initialize`` hands the keys to ``deepspeed.initialize`` unchanged; DeepSpeed's own
    config (what its initialize builds first) then answers: its ZeRO model for an unknown key, its removed-feature
    message for MiCS. (The same through real 2-rank groups: tests_dist/test_refusals.py.)"""
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
    from pydantic import ValidationError

    import shardopt.deepspeed as sds

    seen = []

    def ds_initialize(model, model_parameters, config, optimizer, **kwargs):
        seen.append(config["zero_optimization"])
        DeepSpeedConfig(config)

    monkeypatch.setattr(deepspeed, "initialize", ds_initialize)
    config = {**BASE, "shardopt": {"optimizer": "scale"}}
    with pytest.raises(ValidationError, match=r"some_future_key\n  Extra inputs are not permitted"):
        sds.initialize(model=nn.Linear(4, 4), config={**config, "zero_optimization": PASS_THROUGH[0]})
    with pytest.raises(DeepSpeedConfigError, match=r"^MiCS ZeRO-3 sharding has been removed; 'zero_optimization\."):
        sds.initialize(model=nn.Linear(4, 4), config={**config, "zero_optimization": PASS_THROUGH[1]})
    assert seen == PASS_THROUGH[:2]
