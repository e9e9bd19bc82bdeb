"""Property test: random and mutated configs end in success or a shardopt ConfigError, never a traceback from
inside pydantic, DeepSpeed or torch."""

from __future__ import annotations

import copy

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_model import Tiny

import shardopt
from shardopt import ConfigError
from shardopt.plugin.deepspeed_engine import parse_section

KEYS = [
    "lr",
    "momentum",
    "eps",
    "norm",
    "weight_decay",
    "adam_lr",
    "adam_betas",
    "adam_eps",
    "lr_scale",
    "iterations",
    "beta",
    "alpha",
    "gamma",
    "on_nonfinite",
    "embedding_momentum",
    "bogus",
]
values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 10),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
    st.lists(st.floats(-2, 2), max_size=3),
    st.sampled_from(["rms", "l2", "skip", "raise"]),
)
params = st.dictionaries(st.sampled_from(KEYS), values, max_size=5)
names = st.sampled_from(["scale", "sinkgd", "racs", "SCALE", "adam", "", "muon"])
routing = st.dictionaries(
    st.sampled_from(["*.bias", "proj.weight", "nothing.*", "norm.weight"]),
    st.sampled_from(["adamw", "matrix", "lm_head", "embedding", "vector", "bad"]),
    max_size=2,
)
zero = st.one_of(
    st.none(),
    st.integers(),
    st.text(max_size=3),
    st.fixed_dictionaries(
        {},
        optional={
            "stage": st.one_of(st.integers(-1, 4), st.text(max_size=2), st.none()),
            "round_robin_gradients": st.one_of(st.booleans(), st.text(max_size=2)),
            "offload_optimizer": st.one_of(
                st.none(), st.fixed_dictionaries({"device": st.sampled_from(["cpu", "none", "nvme"])})
            ),
            "sub_group_size": st.one_of(st.integers(-3, 10**6), st.floats()),
            "bogus_key": st.integers(),
        },
    ),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=names, hp=params, route=routing)
def test_create_optimizer_fuzz(name, hp, route):
    try:
        shardopt.create_optimizer(Tiny(), name, routing=route, **hp)
    except ConfigError:
        pass


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=names,
    hp=params,
    route=routing,
    z=zero,
    extra=st.dictionaries(
        st.sampled_from(["optimizer", "gradient_clipping", "train_micro_batch_size_per_gpu", "unknown_top"]),
        values,
        max_size=2,
    ),
    section_extra=st.dictionaries(st.sampled_from(["lr", "routing_", "strategy"]), values, max_size=1),
)
def test_deepspeed_section_fuzz(name, hp, route, z, extra, section_extra):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": z,
        **copy.deepcopy(extra),
        "shardopt": {"optimizer": name, "params": hp, "routing": route, **section_extra},
    }
    try:
        parse_section(cfg)
    except ConfigError:
        pass
