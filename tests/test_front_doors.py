"""What trainers need from the optimizer object in one process (issue 64): ``param_names`` in every param group
whenever shardopt knows the names (torchtitan's FQN-keyed flat state), roles for bare tensors of a registered
model (torchtune's ``_component_`` configs and per-parameter optimizers) or one warning that names the fix,
``shardopt.checkpoint`` reachable from ``import shardopt``, one warning for clamped SUMO/Alice ranks, and
shardopt's words in DeepSpeed's universal-checkpoint refusal. The trainers themselves: tests_dist/test_trainers.py.
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from hf_models import tiny_hf_llama
from tiny_model import Tiny
from torch import nn

import shardopt
from shardopt.optim import routing
from shardopt.optim.registry import OPTIMIZERS

transformers = pytest.importorskip("transformers")


def tiny_llama() -> nn.Module:
    return tiny_hf_llama()


def rules(opt: torch.optim.Optimizer) -> dict[str, tuple]:
    """Each parameter's role and group options that choose its rule, by name."""
    keys = ("treatment", "norm_dim", "momentum")
    return {
        row[0]: (row[2], *(g.get(k) for k in keys))
        for g, names in zip(opt.param_groups, opt.group_param_names)
        for row in opt.describe_rows()
        if row[0] in names
    }


def train(opt: torch.optim.Optimizer, model: nn.Module, steps: int = 2) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


# ------------------------------------------------------------------------------------------------ param_names
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_from_a_model_carries_param_names(name):
    """create_optimizer(model): every group names its parameters as torch's named optimizers do, so torchtitan's
    FQN re-keying (``_optim_state_dict_to_fqn_keys``) finds them; a state dict loads back with them."""
    model = Tiny()
    small = {"sumo": {"rank": 2}, "alice": {"rank": 2, "leading": 1}, "alice0": {"rank": 2, "leading": 1}}
    opt = shardopt.create_optimizer(model, name, **small.get(name, {}))
    assert sorted(n for g in opt.param_groups for n in g["param_names"]) == sorted(
        n for n, _ in model.named_parameters()
    )
    for g in opt.param_groups:
        assert [opt.param_names[id(p)] for p in g["params"]] == g["param_names"]
    train(opt, model)
    sd = opt.state_dict()
    assert all(len(g["param_names"]) == len(g["params"]) for g in sd["param_groups"])
    opt.load_state_dict(sd)


def test_torchtitans_flat_state_dict_round_trips():
    titan = pytest.importorskip("torchtitan.components.optimizer.utils")
    model = Tiny()
    opt = shardopt.create_optimizer(model, "racs")
    train(opt, model)
    flat = titan.get_flat_optim_state_dict(opt)
    fresh = shardopt.create_optimizer(model, "racs")
    train(fresh, model, 1)  # state exists (torchtitan's init_optim_state)
    titan.load_flat_optim_state_dict(fresh, flat)
    for p in model.parameters():
        for k, v in opt.state[p].items():
            assert torch.equal(torch.as_tensor(fresh.state[p][k]), torch.as_tensor(v)), k


def test_an_unnamed_group_joins_a_named_optimizer_by_position():
    """torch refuses unnamed groups beside named ones; shardopt names the added ones by position."""
    model = Tiny()
    opt = shardopt.create_optimizer(model, "scale")
    extra = nn.Parameter(torch.randn(3, 5))
    opt.add_param_group({"params": [extra]})
    assert opt.param_groups[-1]["param_names"] == [f"param_{len(list(model.parameters()))}"]


# ------------------------------------------------------------------------------------ roles for bare tensors
@pytest.mark.parametrize("name", ["scale", "racs", "muon", "sumo"])
def test_registered_model_gives_bare_tensors_their_roles(name, monkeypatch):
    """``SCALE(model.parameters())`` and one optimizer per parameter on a transformers LLaMA: after
    ``shardopt.register_model(model)`` each parameter gets the role and rule ``create_optimizer(model)`` gives it,
    without a warning."""
    monkeypatch.setattr(routing, "_WARNED", set())
    model = tiny_llama()
    want = rules(shardopt.create_optimizer(model, name))
    assert want["model.embed_tokens.weight"][0] == "embedding" and want["lm_head.weight"][0] == "lm_head"
    cls = OPTIMIZERS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        shardopt.register_model(model)
        whole = cls(model.parameters())
        each = {n: cls([p]) for n, p in model.named_parameters()}
    assert rules(whole) == want
    for n, opt in each.items():
        assert rules(opt) == {n: want[n]}, n
        assert opt.state_dict()["param_groups"][0]["param_names"] == [n]


def test_registration_survives_replaced_parameters():
    """Parameters are looked up when the optimizer is built: registering before sharding (fully_shard replaces
    every parameter) still names the new ones."""
    model = tiny_llama()
    shardopt.register_model(model)
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    opt = shardopt.SCALE([model.lm_head.weight])
    assert rules(opt)["lm_head.weight"][:1] == ("lm_head",)


def test_bare_tensors_of_no_known_model_warn_once(monkeypatch):
    """A model's mixed list and a one-matrix optimizer (torchtune's optimizer_in_bwd) warn once per process,
    naming shardopt.register_model; a list of matrices alone is someone's explicit choice and does not."""
    monkeypatch.setattr(routing, "_WARNED", set())
    model = tiny_llama()
    with pytest.warns(UserWarning, match=r"shardopt.register_model\(model\)") as caught:
        for p in model.parameters():
            shardopt.SCALE([p])
        shardopt.SCALE(model.parameters())
    assert sum("without names" in str(w.message) for w in caught) == 1
    monkeypatch.setattr(routing, "_WARNED", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        shardopt.SCALE([nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(5, 4))])


# ----------------------------------------------------------------------------------------------- submodules
def test_documented_submodules_are_attributes_of_the_package():
    """``import shardopt; shardopt.checkpoint.save(...)`` as the docs write it, loaded on first use only."""
    code = (
        "import sys, shardopt\n"
        "assert 'shardopt.checkpoint' not in sys.modules\n"
        "assert callable(shardopt.checkpoint.save) and callable(shardopt.checkpoint.load)\n"
        "assert shardopt.sharding.__name__ == 'shardopt.sharding' and shardopt.train.__name__ == 'shardopt.train'\n"
        "assert 'checkpoint' in dir(shardopt)\n"
        "try:\n    shardopt.nope\nexcept AttributeError as e:\n    assert 'nope' in str(e)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------------- one warning
@pytest.mark.parametrize("name", ["sumo", "alice"])
def test_clamped_ranks_warn_once_with_a_summary(name):
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 8), nn.Linear(8, 8), nn.Linear(8, 12))
    kwargs = {"rank": 12} if name == "sumo" else {"rank": 12, "leading": 2}
    opt = OPTIMIZERS[name](model.named_parameters(), **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(opt, model, 3)
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1, msgs
    assert "rank 12 exceeds min(m, n) of 4 matrices" in msgs[0] and "the largest rank used: 8" in msgs[0]


# ---------------------------------------------------------------------------------- universal checkpoint
def test_universal_refusal_reads_in_shardopts_words():
    pytest.importorskip("deepspeed")
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
    from deepspeed.checkpoint.ds_to_universal import _validate_autotp_conversion_support

    from shardopt.plugin.deepspeed_checkpoint import UNIVERSAL_ROUTE, mark_not_universal

    info = mark_not_universal({})[UNIVERSAL_CHECKPOINT_INFO]
    with pytest.raises(ValueError) as err:
        _validate_autotp_conversion_support(info)
    assert f"not supported for shardopt's checkpoints: {UNIVERSAL_ROUTE}" in str(err.value)
    assert ".*" not in str(err.value)
