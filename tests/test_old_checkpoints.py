"""Checkpoints written before issue 18 renamed state keys load with today's code and continue identically.

The fixtures (``tests/fixtures/old_checkpoints/``, written by its ``generate.py`` with the code of commit
e5cf985) hold, per optimizer whose keys were renamed, the state after 3 steps of a tiny model in both forms
(a shardopt checkpoint and ``opt.state_dict()``) and the parameters of the uninterrupted run 1 and 2 steps
later. Loading either form must rename the old keys (``state_key_renames``) and give those parameters (to fp32
rounding, 1e-6 relative: issue 19's grouped steps sum in another order than the code that wrote them). RACS's
state is also there as an FSDP2 trainer's DCP checkpoint, which the trainer's ``SafeLoadPlanner`` reads into
today's keys. Alice's continuation is today's rule from the old state (``continue_alice.py``): issue 63 pinned the
sign of each basis vector at a switch, which the old code took from rounding.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from tiny_model import Tiny

import shardopt
import shardopt.checkpoint as ckpt

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "old_checkpoints")
NAMES = ["racs", "alice", "sumo", "asgo", "dasgo"]  # Alice-0's keys are Alice's without Q_tilde


def _fixture(name):
    with open(os.path.join(HERE, name, "state_dict.json")) as f:
        meta = json.load(f)
    return (
        meta,
        load_file(os.path.join(HERE, name, "state_dict.safetensors")),
        load_file(os.path.join(HERE, name, "continued.safetensors")),
    )


def _continue_and_compare(model, opt, continued):
    x = torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(3))
    for s in range(2):
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        for k, p in model.named_parameters():
            # fp32 rounding of ``p - lr u`` is an ulp of the operands, not of the result: an element that
            # cancels to ~4e-5 from ~0.02 differs by 2^-29 between CPUs whose kernels sum in another order
            # (AVX2 vs AVX-512); the absolute floor is 1e-6 of the tensor's scale, as rtol is of each element
            want = continued[f"{s}/{k}"]
            torch.testing.assert_close(
                p.detach(),
                want,
                rtol=1e-6,
                atol=max(1e-9, 1e-6 * float(want.abs().max())),
                msg=lambda m, s=s, k=k: f"step {s + 1} after the load, {k}: {m}",
            )


def _no_old_keys(opt, name):
    renames = getattr(type(opt), "state_key_renames", {})
    for st in opt.state.values():
        assert not set(st) & set(renames), (name, sorted(st))


@pytest.mark.parametrize("name", NAMES)
def test_old_shardopt_checkpoint_loads_and_continues(name):
    meta, _, continued = _fixture(name)
    model = Tiny()
    opt = shardopt.create_optimizer(model, name, **meta["hyperparameters"])
    ckpt.load(os.path.join(HERE, name), opt)  # parameters and state
    _no_old_keys(opt, name)
    _continue_and_compare(model, opt, continued)


@pytest.mark.parametrize("name", NAMES)
def test_old_state_dict_loads_and_continues(name):
    meta, tensors, continued = _fixture(name)
    model = Tiny()
    model.load_state_dict({k[len("model/") :]: v for k, v in tensors.items() if k.startswith("model/")})
    opt = shardopt.create_optimizer(model, name, **meta["hyperparameters"])
    state: dict = {}
    for k, v in tensors.items():
        if not k.startswith("model/"):
            idx, key = k.split("/")
            state.setdefault(int(idx), {})[key] = v
    for idx, entries in meta["state"].items():
        state.setdefault(int(idx), {}).update(entries)
    groups = []
    for g, saved in zip(opt.param_groups, meta["param_groups"]):  # JSON has lists where the groups hold tuples
        groups.append({k: tuple(v) if isinstance(g.get(k), tuple) else v for k, v in saved.items()})
    opt.load_state_dict({"state": state, "param_groups": groups})
    _no_old_keys(opt, name)
    _continue_and_compare(model, opt, continued)


def test_old_dcp_checkpoint_loads_into_todays_keys_and_continues():
    """The FSDP2 trainer's resume path (``shardopt.train.trainer``): a DCP template of today's keys filled from a
    checkpoint that holds ``row_scale``/``col_scale``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from shardopt.checkpoint.safe_pickle import SafeFileSystemReader, SafeLoadPlanner

    _, _, continued = _fixture("racs")
    model = Tiny()
    opt = shardopt.create_optimizer(model, "racs")
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(
        sd,
        storage_reader=SafeFileSystemReader(os.path.join(HERE, "racs", "dcp")),
        planner=SafeLoadPlanner(),
        no_dist=True,
    )
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    _no_old_keys(opt, "racs")
    assert any("q" in st for st in opt.state.values())
    _continue_and_compare(model, opt, continued)


def test_renames_reach_the_per_matrix_entries_of_flat_partitions():
    """A DeepSpeed ZeRO flat partition keeps each matrix's small state under ``state[i]["matrices"][name]``."""
    from shardopt.optim.alice import Alice

    opt = Alice([torch.nn.Parameter(torch.zeros(4, 6))], rank=2, leading=1)
    old = {
        "state": {0: {"exp_avg": 1, "matrices": {"a.weight": {"basis": 2, "col_energy": 3, "phi": 4}}}},
        "param_groups": [],
    }
    new = opt._renamed_state_keys(old)
    assert new["state"][0] == {"exp_avg": 1, "matrices": {"a.weight": {"U": 2, "p": 3, "phi": 4}}}
    assert "basis" in old["state"][0]["matrices"]["a.weight"]  # the caller's dict is left as it was
