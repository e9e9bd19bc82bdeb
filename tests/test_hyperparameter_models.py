"""Each optimizer's hyperparameters are defined once, in the model beside the algorithm (``cls.Config``).

Guards against the split this replaced: defaults and ranges written twice (the pydantic models in the registry
and the constructor signatures, with different meanings), a DeepSpeed ``"shardopt"`` section parsed four times
on the trainer path, and cross-field errors reported with an empty key path
(``create_optimizer.: Value error, leading = 40 must be <= rank = 4``).
"""

from __future__ import annotations

import copy
import inspect
import os
import types

import pytest
import torch
from tiny_model import Tiny
from torch import nn

import shardopt
from shardopt import ConfigError
from shardopt.optim import OPTIMIZERS
from shardopt.optim.config import CommonOptions, OptimizerConfig
from shardopt.optim.registry import build_param_groups, optimizer_kwargs, validate_hyperparameters

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLASSES = [pytest.param(cls, id=name) for name, cls in sorted(OPTIMIZERS.items())]

pytestmark = pytest.mark.filterwarnings("ignore:.*exceeds min.*:RuntimeWarning")


def constructor_defaults(cls) -> dict[str, object]:
    """The constructor's keyword defaults, by the model field each one sets."""
    sig = inspect.signature(cls.__init__)
    return {
        cls.Config.constructor_names.get(n, n): p.default
        for n, p in sig.parameters.items()
        if p.default is not inspect.Parameter.empty
    }


@pytest.mark.parametrize("cls", CLASSES)
def test_constructor_defaults_are_the_models(cls):
    fields = cls.Config.model_fields
    got = constructor_defaults(cls)
    assert got, cls
    for field, default in got.items():
        assert field in fields, f"{cls.__name__}({field}=...) is not a field of {cls.Config.__name__}"
        assert default == fields[field].get_default(call_default_factory=True), (cls.__name__, field)


@pytest.mark.parametrize("cls", CLASSES)
def test_every_field_is_a_constructor_keyword_or_an_option(cls):
    """What the constructor does not name explicitly it takes as ``**options`` (the common tail and a few
    rarely set fields), except the config-only ones (resolved when a config is validated)."""
    explicit = set(constructor_defaults(cls))
    options = set(cls.Config.model_fields) - explicit - set(cls.Config.config_only)
    assert set(CommonOptions.__annotations__) - {"matrix_ops"} <= options | explicit
    model = nn.Linear(4, 3)
    for field in sorted(options - set(CommonOptions.__annotations__)):
        value = getattr(cls.Config.defaults(), field)
        assert getattr(cls(model.parameters(), **{field: value}).config, field) == value
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        cls(model.parameters(), bogus=1)


@pytest.mark.parametrize("cls", CLASSES)
def test_constructor_and_create_optimizer_share_one_config(cls):
    name = cls.Config.treatment
    by_name = shardopt.create_optimizer(Tiny(), name)
    by_class = cls(Tiny().named_parameters())
    assert by_name.config == by_class.config == validate_hyperparameters(name, {})
    assert by_name.defaults == by_class.defaults
    assert type(by_name.config) is cls.Config


@pytest.mark.parametrize("cls", CLASSES)
def test_wrapper_keywords_rebuild_the_config(cls):
    """``optimizer_kwargs`` (ZeroRedundancyOptimizer, OSS) rebuilds what the config gives the constructor."""
    name = cls.Config.treatment
    hp = {"lr": 0.005, "adam_lr": 0.002, "on_nonfinite": "raise"}
    cfg = validate_hyperparameters(name, hp)
    groups = [{k: v for k, v in g.items() if k != "names"} for g in build_param_groups(Tiny(), name, cfg)]
    opt = cls(groups, **optimizer_kwargs(cfg))
    keep = set(type(cfg).model_fields) - set(cfg.config_only)
    assert opt.config.model_dump(include=keep) == cfg.model_dump(include=keep)
    assert opt.defaults == shardopt.create_optimizer(Tiny(), name, **hp).defaults
    assert [g["lr"] for g in opt.param_groups] == [
        0.005 if g["treatment"] != "adamw" else 0.002 for g in opt.param_groups
    ]


def test_scale_momentum_one_model_two_entry_points():
    """``create_optimizer``/JSON ``momentum`` is the LM head's beta (0.9); the constructor keeps torch's meaning
    for its ``momentum`` keyword (``matrix_momentum``: groups that set none, 0 by default), so both behave as
    documented and read their defaults from ``SCALEConfig``."""

    def momenta(opt):
        return {
            opt.param_names[id(p)]: g["momentum"]
            for g in opt.param_groups
            if g["treatment"] == "scale"
            for p in g["params"]
        }

    by_name = momenta(shardopt.create_optimizer(Tiny(), "scale"))
    assert by_name == {"embed.weight": 0.0, "proj.weight": 0.0, "lm_head.weight": 0.9}
    assert momenta(shardopt.SCALE(Tiny().named_parameters())) == by_name
    assert momenta(shardopt.create_optimizer(Tiny(), "scale", momentum=0.5)) == {
        k: (0.5 if v == 0.9 else v) for k, v in by_name.items()
    }
    named = momenta(shardopt.SCALE(Tiny().named_parameters(), momentum=0.5))  # as before: the group default
    assert named == {k: (v if v == 0.9 else 0.5) for k, v in by_name.items()}
    lin = nn.Linear(4, 3)
    assert momenta(shardopt.SCALE(lin.parameters())) == {"param_0": 0.0}
    assert momenta(shardopt.SCALE(lin.parameters(), momentum=0.9)) == {"param_0": 0.9}


# ------------------------------------------------------------------------------------------ error key paths
ERROR_CASES = [
    ("alice", {"rank": 4}, "create_optimizer.leading: 40 must be <= rank = 4 (got 40)"),
    ("alice0", {"rank": 2, "leading": 3}, "create_optimizer.leading: 3 must be <= rank = 2 (got 3)"),
    ("asgo", {"eps": 0.0, "refresh_interval": 2}, "create_optimizer.refresh_interval: eps = 0 needs"),
    ("asgo", {"betas": (0.9, 1.0)}, "create_optimizer.betas: betas[1] = 1.0 is outside [0, 1)"),
    ("dasgo", {"betas": (0.9, 1.5)}, "create_optimizer.betas: betas[1] = 1.5 is outside [0, 1)"),
    ("scale", {"norm": "l3"}, "create_optimizer.norm must be 'rms' or 'l2' (got 'l3')"),
    ("swan", {"matrix_ops": {"strategy": "owner"}}, "create_optimizer.matrix_ops.strategy must be"),
]


@pytest.mark.parametrize("name,hp,message", ERROR_CASES)
def test_errors_give_the_full_key_path(name, hp, message):
    with pytest.raises(ConfigError) as err:
        shardopt.create_optimizer(Tiny(), name, **hp)
    assert str(err.value).startswith(message)
    assert ".:" not in str(err.value) and "Value error" not in str(err.value)


def test_deepspeed_section_errors_give_the_full_key_path():
    from shardopt.deepspeed import parse_section

    cfg = {"zero_optimization": {"stage": 2}, "shardopt": {"optimizer": "sumo", "params": {"rank": 0}}}
    with pytest.raises(ConfigError, match=r"^shardopt\.params\.rank: Input should be greater than or equal to 1"):
        parse_section(cfg)
    cfg = {"zero_optimization": {"stage": 2}, "shardopt": {"optimizer": "alice", "params": {"rank": 4}}}
    with pytest.raises(ConfigError, match=r"^shardopt\.params\.leading: 40 must be <= rank = 4"):
        parse_section(cfg)


def test_constructor_errors_name_the_class_and_keyword():
    p = [nn.Parameter(torch.randn(3, 4))]
    with pytest.raises(ConfigError, match=r"^Alice\.leading: 3 must be <= rank = 2 \(got 3\)$"):
        shardopt.optim.alice.Alice(p, rank=2, leading=3)
    with pytest.raises(ConfigError, match=r"^SUMO\.side must be 'auto', 'left' or 'right' \(got 'up'\)$"):
        shardopt.optim.sumo.SUMO(p, side="up")


# ---------------------------------------------------------------------------------- one parse on the trainer path
def test_trainer_parses_the_deepspeed_section_once(monkeypatch):
    """``load_train_config`` parses the ``"shardopt"`` section; the trainer hands the parsed section to
    ``shardopt.deepspeed.initialize``, which takes it as is (no second validation)."""
    from shardopt.plugin import deepspeed_engine
    from shardopt.train import load_train_config
    from shardopt.train.trainer import Trainer

    calls = []
    real = deepspeed_engine.validate_hyperparameters
    monkeypatch.setattr(deepspeed_engine, "validate_hyperparameters", lambda *a, **k: calls.append(a) or real(*a, **k))
    path = os.path.join(ROOT, "configs", "deepspeed", "zero2_sumo.json")
    cfg = load_train_config({"engine": {"name": "deepspeed", "deepspeed_config": path}})
    assert len(calls) == 1
    trainer = types.SimpleNamespace(cfg=cfg, log=lambda m: None, engine_name="deepspeed")
    assert Trainer._optimizer_name(trainer) == "sumo"
    ds = Trainer._deepspeed_config(trainer)
    section, hp = deepspeed_engine.parse_section(deepspeed_engine.load_config(ds))
    assert len(calls) == 1 and section.optimizer == "sumo" and hp == cfg.deepspeed[1].config

    # the trainer's own optimizer section replaces the JSON's, validated once by load_train_config too
    cfg = load_train_config(
        {
            "engine": {"name": "deepspeed", "deepspeed_config": path},
            "optimizer": {"name": "scale", "params": {"momentum": 0.5}},
        }
    )
    calls.clear()
    ds = Trainer._deepspeed_config(types.SimpleNamespace(cfg=cfg, log=lambda m: None, engine_name="deepspeed"))
    section, hp = deepspeed_engine.parse_section(copy.deepcopy(ds))
    assert calls == [] and section.optimizer == "scale" and hp == cfg.optimizer.config and hp.momentum == 0.5
    assert isinstance(hp, OptimizerConfig)
