"""Hugging Face models and Trainer paths in one process (issue 17): GPT-2's ``Conv1D`` (weights stored in x out)
gets the matrix rule on the right axis, 2-D weights of unknown module types are named when they fall to AdamW,
Trainer's unnamed decay groups keep shardopt's roles, and a tensor no layout describes is never stepped."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from hf_models import tiny_hf_llama  # noqa: E402

import shardopt  # noqa: E402
from shardopt.optim.describe import describe_roles  # noqa: E402
from shardopt.optim.registry import OPTIMIZERS  # noqa: E402
from shardopt.optim.routing import TRANSPOSE_SYMMETRIC, param_roles  # noqa: E402
from shardopt.plugin.wrapped import UnmappedTensorError  # noqa: E402


def tiny_gpt2() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=64, n_positions=8, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    return transformers.GPT2LMHeadModel(cfg)


def tiny_llama() -> nn.Module:
    return tiny_hf_llama()


def conv1d_weights(model: nn.Module) -> list[str]:
    from transformers.pytorch_utils import Conv1D

    return [f"{n}.weight" for n, m in model.named_modules() if isinstance(m, Conv1D)]


def scale_reference(g: torch.Tensor, lr: float, eps: float = 1e-8) -> torch.Tensor:
    """SCALE's matrix rule (docs/algorithms/scale.md) in float64 on an out x in gradient: each output unit (row) divided
    by its RMS; the update is ``-lr`` times that."""
    g = g.double()
    rms = g.pow(2).mean(dim=1, keepdim=True).sqrt().clamp_min(eps)
    return -lr * g / rms


def test_gpt2_conv1d_roles() -> None:
    model = tiny_gpt2()
    roles = param_roles(model)
    conv = conv1d_weights(model)
    assert len(conv) == 8
    assert all(roles[n] == "matrix_transposed" for n in conv)
    assert roles["transformer.wte.weight"] == "lm_head"  # tied to lm_head: the single name is the head
    assert roles["transformer.wpe.weight"] == "embedding"


def test_gpt2_scale_normalizes_each_output_unit() -> None:
    """Every hidden matrix of GPT-2 gets SCALE's matrix rule per output unit: the update of the stored in x out
    weight W equals the float64 reference of the rule on W^T (out x in), transposed back."""
    model = tiny_gpt2()
    lr = 1e-2
    opt = shardopt.create_optimizer(model, "scale", lr=lr)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    after = dict(model.named_parameters())
    for name in conv1d_weights(model):
        expected = scale_reference(grads[name].T, lr).T  # rule on the out x in view, back to in x out
        got = (after[name].detach() - before[name]).double()
        assert torch.allclose(got, expected, atol=1e-7, rtol=0), name
        wrong_axis = scale_reference(grads[name], lr)  # what plain "matrix" routing would have done
        assert not torch.allclose(got, wrong_axis, atol=1e-6), name


def test_describe_lists_every_parameter() -> None:
    model = tiny_gpt2()
    table = describe_roles(model, "scale")
    for name in conv1d_weights(model):
        assert any(
            line.startswith(name) and "matrix_transposed" in line and "norm_dim=0" in line
            for line in table.splitlines()
        ), table
    opt = shardopt.create_optimizer(tiny_llama(), "scale")
    text = opt.describe()
    assert "model.embed_tokens.weight" in text and "embedding" in text and "lm_head" in text
    assert len(text.splitlines()) == 1 + sum(1 for _ in tiny_llama().parameters())


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_transposed_weights_per_rule(name: str) -> None:
    """Rules in TRANSPOSE_SYMMETRIC orient by shape: stepping W^T as a plain matrix gives the transposed update of
    stepping W (on non-square matrices). Every rule steps GPT-2's Conv1D weights (role matrix_transposed) as their
    logical out x in matrix, none refuses them (tests/test_transposed_rules.py checks the updates)."""
    model = tiny_gpt2()
    opt = shardopt.create_optimizer(model, name)  # no rule refuses GPT-2
    params = dict(model.named_parameters())
    for conv in conv1d_weights(model):
        group = next(g for g in opt.param_groups if any(p is params[conv] for p in g["params"]))
        assert group["treatment"] == name and (group.get("transposed") or group.get("norm_dim") == 0), conv
    kw = {"rank": 4, "leading": 2} if name.startswith("alice") else {"rank": 4} if name == "sumo" else {}
    torch.manual_seed(1)
    w0 = torch.randn(12, 20)
    grads = [torch.randn(12, 20) for _ in range(3)]
    out = []
    for transposed in (False, True):
        w = nn.Parameter((w0.T if transposed else w0).clone().contiguous())
        opt = shardopt.create_optimizer([w], name, **kw)
        for g in grads:
            w.grad = (g.T if transposed else g).clone().contiguous()
            opt.step()
        out.append(w.detach().T if transposed else w.detach())
    if name in TRANSPOSE_SYMMETRIC:
        assert (out[0] - out[1]).abs().max() <= 1e-6


class Gate(nn.Module):
    """A module type routing does not know, with its own 2-D weight."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Parameter(torch.randn(4, 6))
        self.bias = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.proj.T + self.bias


def test_unknown_module_matrices_are_named() -> None:
    model = nn.Sequential(nn.Linear(6, 6), Gate())
    with pytest.warns(UserWarning, match=r"1\.proj \(Gate\)"):
        opt = shardopt.create_optimizer(model, "scale")
    assert any(g["treatment"] == "adamw" and any(p is model[1].proj for p in g["params"]) for g in opt.param_groups)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a declaration silences the warning and routes it
        opt = shardopt.create_optimizer(model, "scale", routing={"1.proj": "matrix"})
    assert any(g["treatment"] == "scale" and any(p is model[1].proj for p in g["params"]) for g in opt.param_groups)
    opt = shardopt.create_optimizer(model, "scale", routing={"1.proj": "matrix_transposed"})
    group = next(g for g in opt.param_groups if any(p is model[1].proj for p in g["params"]))
    assert group["norm_dim"] == 0


def test_unmapped_flat_tensor_raises() -> None:
    """A wrapper that replaced a matrix group's parameters by a flat partition (and is not a DeepSpeed wrapper
    shardopt can find): stepping it would be sign-SGD, so the step raises and names the fix."""
    w = nn.Parameter(torch.randn(5, 7))
    opt = shardopt.SCALE([w])
    flat = nn.Parameter(torch.randn(35))
    flat.grad = torch.randn(35)
    opt.param_groups[0]["params"] = [flat]
    before = flat.detach().clone()
    with pytest.raises(UnmappedTensorError, match=r"sign-SGD.*shardopt.deepspeed.initialize"):
        opt.step()
    assert torch.equal(flat.detach(), before)  # nothing stepped: the error comes before any update


def test_trainer_cls_and_kwargs_keeps_roles(tmp_path) -> None:
    """``Trainer(optimizer_cls_and_kwargs=(SCALE, ...))`` hands SCALE HF's unnamed decay / no-decay groups; the
    roles still come from the model (embedding per column, LM head with momentum), as create_optimizer's."""
    model = tiny_llama()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    trainer = transformers.Trainer(model=model, args=args, optimizer_cls_and_kwargs=(shardopt.SCALE, {"lr": 1e-2}))
    opt = trainer.create_optimizer()
    by_param = {id(p): g for g in opt.param_groups for p in g["params"]}
    assert by_param[id(model.model.embed_tokens.weight)]["norm_dim"] == 0
    assert by_param[id(model.lm_head.weight)]["momentum"] == 0.9
    assert by_param[id(model.model.layers[0].mlp.up_proj.weight)]["treatment"] == "scale"
    assert opt.param_names[id(model.lm_head.weight)] == "lm_head.weight"


def fake_trainer(ds_config: dict | None, **args) -> object:
    """What ``enable`` reads from a Trainer: the DeepSpeed config accelerate holds and the TrainingArguments."""
    from types import SimpleNamespace

    targs = SimpleNamespace(
        learning_rate=3e-3, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.9, adam_epsilon=1e-6, **args
    )
    plugin = SimpleNamespace(hf_ds_config=SimpleNamespace(config=ds_config)) if ds_config is not None else None
    return SimpleNamespace(
        is_deepspeed_enabled=ds_config is not None,
        args=targs,
        optimizer=None,
        accelerator=SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin)),
    )


def test_enable_reads_the_section_and_auto_values() -> None:
    from shardopt.integrations.transformers import resolve_settings

    ds = {
        "zero_optimization": {"stage": 2},
        "shardopt": {
            "optimizer": "scale",
            "params": {"lr": "auto", "adam_betas": "auto", "momentum": 0.5},
            "routing": {"lm_head.weight": "adamw"},
        },
    }
    name, cfg, routing = resolve_settings(fake_trainer(ds), None, {"x*": "adamw"}, {"eps": 1e-7})
    assert name == "scale" and cfg.lr == 3e-3 and cfg.adam_betas == (0.8, 0.9) and cfg.momentum == 0.5
    assert cfg.eps == 1e-7 and routing == {"lm_head.weight": "adamw", "x*": "adamw"}
    assert ds["shardopt"]["params"]["lr"] == 3e-3  # filled in place: accelerate refuses any "auto" left over
    name, cfg, _ = resolve_settings(fake_trainer(None), "racs", None, {"lr": "auto"})  # no DeepSpeed: keywords
    assert name == "racs" and cfg.lr == 3e-3


@pytest.mark.parametrize(
    "ds,optimizer,hp,match",
    [
        ({"optimizer": {"type": "AdamW"}, "shardopt": {"optimizer": "scale"}}, None, {}, "both an 'optimizer' block"),
        ({"optimizer": {"type": "AdamW"}}, "scale", {}, "has an 'optimizer' block"),
        ({}, None, {}, "name the optimizer"),
        (
            {"shardopt": {"optimizer": "scale", "params": {"momentum": "auto"}}},
            None,
            {},
            r"shardopt.params.momentum = 'auto'",
        ),
        ({"shardopt": {"optimizer": "scale", "params": {"lr": -1}}}, None, {}, r"shardopt.params.lr"),
        ({"shardopt": {"optimizer": "scale", "extra": 1}}, None, {}, r"shardopt.extra"),
        (None, "nope", {}, "unknown optimizer"),
    ],
)
def test_enable_config_errors_name_the_key(ds, optimizer, hp, match) -> None:
    from shardopt.integrations.transformers import resolve_settings

    with pytest.raises(shardopt.ConfigError, match=match):
        resolve_settings(fake_trainer(ds), optimizer, None, hp)


def test_enable_refuses_a_given_optimizer() -> None:
    from shardopt.integrations.transformers import enable

    trainer = fake_trainer(None)
    trainer.optimizer = object()
    with pytest.raises(shardopt.ConfigError, match=r"optimizers=\(None, None\)"):
        enable(trainer, "scale")
