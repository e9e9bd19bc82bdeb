"""The role table and the build record in one process (issue 52, item 5; the engines: tests_dist/
test_rules_everywhere.py): ``describe()`` says where each role came from, ``shardopt.describe`` finds the optimizer
inside a front door's objects, and building an optimizer logs one record on rank 0 (logger ``shardopt``)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from tiny_model import Tiny
from torch import nn

import shardopt
from shardopt.optim import build_log
from shardopt.optim.describe import describe_roles, expose_describe
from shardopt.optim.routing import COLUMNS, ROLE_SOURCES


def rows(table: str) -> dict[str, list[str]]:
    """The table's rows by parameter name (the rule, last, may hold spaces)."""
    lines = table.splitlines()
    assert lines[0].split() == list(COLUMNS), lines[0]
    return {line.split()[0]: line.split(maxsplit=4)[1:] for line in lines[1:]}


def build_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "shardopt" and "built over" in r.getMessage()]


def test_table_says_where_each_role_came_from() -> None:
    model = Tiny()
    opt = shardopt.create_optimizer(model, "scale", routing={"proj.bias": "adamw"})
    table = rows(opt.describe())
    assert list(table) != [] and set(table) == {n for n, _ in model.named_parameters()}
    assert table["embed.weight"][:3] == ["11x6", "embedding", "type"]
    assert table["proj.weight"][:3] == ["7x6", "matrix", "type"]
    assert table["lm_head.weight"][:3] == ["11x7", "lm_head", "guessed"]  # Tiny states no head
    assert table["proj.bias"][1:] == ["adamw", "routing", "adamw"]
    assert {r[2] for r in table.values()} <= set(ROLE_SOURCES)


def test_declared_roles_are_marked_declared() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=40,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=8,
        tie_word_embeddings=False,
    )
    table = rows(shardopt.create_optimizer(transformers.LlamaForCausalLM(cfg), "scale").describe())
    assert table["lm_head.weight"][1:3] == ["lm_head", "declared"]
    assert table["model.embed_tokens.weight"][1:3] == ["embedding", "declared"]
    assert "guessed" not in {r[2] for r in table.values()}


def test_table_lists_logical_parameters_while_flat_partitions_are_stepped() -> None:
    """An engine that steps flat partitions (ZeRO-1/2, Megatron) replaces the groups' tensors: the table still
    lists every parameter as built, with its shape (it used to print the header alone)."""
    model = Tiny()
    opt = shardopt.create_optimizer(model, "racs")
    before = opt.describe()
    flat = torch.zeros(sum(p.numel() for p in model.parameters()))
    for g in opt.param_groups:
        g["params"] = [flat]
    opt._attached[id(flat)] = flat  # is_flat(flat)
    assert opt.describe() == before
    assert len(before.splitlines()) == 1 + len(list(model.parameters()))


def test_describe_finds_the_optimizer_inside_front_door_objects() -> None:
    model = Tiny()
    opt = shardopt.create_optimizer(model, "sumo")
    want = opt.describe()
    zero_wrapper = SimpleNamespace(optimizer=opt)  # DeepSpeed's ZeRO wrapper, accelerate's AcceleratedOptimizer
    engine = SimpleNamespace(optimizer=zero_wrapper, module=model)  # DeepSpeed's engine, the HF Trainer
    megatron = SimpleNamespace(shardopt=opt, optimizer=opt)
    chained = SimpleNamespace(chained_optimizers=[megatron])
    for obj in (opt, zero_wrapper, engine, megatron, chained):
        assert shardopt.describe(obj) == want
    expose_describe(zero_wrapper, engine, opt)
    assert zero_wrapper.describe() == engine.describe() == want
    assert shardopt.describe(model, "sumo") == describe_roles(model, "sumo") == want
    with pytest.raises(TypeError, match="trainer.create_optimizer"):
        shardopt.describe(SimpleNamespace(optimizer=None, create_optimizer=lambda: None))
    with pytest.raises(TypeError, match=r"shardopt.describe\(model, 'scale'\)"):
        shardopt.describe(model)
    with pytest.raises(ValueError, match="all_stages"):
        shardopt.describe(zero_wrapper, all_stages=True)  # a ZeRO wrapper cannot tell the pipeline's stages
    assert shardopt.describe(opt, all_stages=False) == want


def test_build_logs_one_record_with_counts_and_guesses(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="shardopt")
    model = Tiny()
    opt = shardopt.create_optimizer(model, "scale")
    assert len(opt.param_groups) > 2  # one record for the optimizer, not one per param group
    (record,) = build_records(caplog)
    assert record.levelno == logging.INFO
    table = rows(opt.describe())
    expected: dict[str, int] = {}
    for _shape, role, _source, rule in table.values():
        expected[f"{role} -> {rule}"] = expected.get(f"{role} -> {rule}", 0) + 1
    assert record.shardopt_roles == expected and sum(expected.values()) == len(table)
    assert record.shardopt_guessed == {"lm_head.weight": "lm_head"}
    message = record.getMessage()
    assert "SCALE built over 6 parameters" in message and "vector -> adamw: 3" in message
    assert "guessed roles" in message and "lm_head.weight -> lm_head" in message


def test_a_rebuild_over_the_same_parameters_logs_nothing_more(caplog: pytest.LogCaptureFixture) -> None:
    """``shardopt.param_groups`` builds the optimizer to resolve the groups; the sharder's inner optimizer (torch's
    ZeroRedundancyOptimizer, fairscale OSS) then builds again over a rank's part: one record in all."""
    caplog.set_level(logging.INFO, logger="shardopt")
    groups = shardopt.param_groups(Tiny(), "racs")
    shardopt.RACS(groups[:3])
    assert len(build_records(caplog)) == 1
    shardopt.create_optimizer(Tiny(), "racs")  # another model: its own record
    assert len(build_records(caplog)) == 2


def test_only_rank_zero_logs(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.INFO, logger="shardopt")
    monkeypatch.setattr(build_log, "_rank", lambda: 1)
    shardopt.create_optimizer(Tiny(), "muon")
    assert build_records(caplog) == []


def test_a_model_that_guesses_nothing_says_so(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="shardopt")
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    shardopt.create_optimizer(model, "scale")
    (record,) = build_records(caplog)
    assert record.shardopt_guessed == {} and "no role was guessed" in record.getMessage()
