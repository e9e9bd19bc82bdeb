"""Fused mixture-of-experts weights (issue 46): a 3-D ``(E, m, n)`` parameter is E matrices, each stepped exactly as
a separate ``m x n`` weight, and no expert reaches AdamW unless the routing says so.

The reference is the same MoE block with its experts unfused into E ``nn.Linear``s: after 3 steps every weight of
the fused block equals the unfused one (at most 1e-6) for every optimizer. Matrices are named alike in both runs
(``experts.gate_up_proj[e]``), since names key the seeded draws of SUMO and Alice.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardopt
from shardopt.optim.registry import OPTIMIZERS
from shardopt.optim.routing import RoutingError, param_roles
from shardopt.sharding.batched import box_fragments, split_flat
from shardopt.sharding.fragment import Fragment
from shardopt.sharding.layout import FlatPiece, MatrixLayout

E, H, I = 4, 12, 10  # experts, model dim, expert hidden dim
#: hyperparameters that make every rule do its whole-matrix work within 3 steps (SUMO refreshes, Alice switches)
OPTIONS = {
    "sumo": {"rank": 3, "refresh_interval": 2},
    "alice": {"rank": 3, "leading": 1, "refresh_interval": 2},
    "alice0": {"rank": 3, "leading": 1, "refresh_interval": 2},
    "asgo": {"refresh_interval": 2},
}


class FusedExperts(nn.Module):
    """transformers 5's layout (``MixtralExperts``): ``gate_up_proj (E, 2I, H)``, ``down_proj (E, H, I)``, each slice
    applied by ``F.linear``; ``is_transposed`` and ``num_experts`` as ``@use_experts_implementation`` sets them."""

    def __init__(self, transposed: bool = False):
        super().__init__()
        self.num_experts, self.is_transposed = E, transposed
        up, down = (E, 2 * I, H), (E, H, I)
        if transposed:
            up, down = (E, H, 2 * I), (E, I, H)
        self.gate_up_proj = nn.Parameter(torch.randn(*up) * 0.3)
        self.down_proj = nn.Parameter(torch.randn(*down) * 0.3)

    def weight(self, name: str, e: int) -> torch.Tensor:
        w = getattr(self, name)[e]
        return w.T if self.is_transposed else w

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = 0
        for e in range(E):
            gate, up = F.linear(x, self.weight("gate_up_proj", e)).chunk(2, dim=-1)
            out = out + weights[:, e : e + 1] * F.linear(F.silu(gate) * up, self.weight("down_proj", e))
        return out


class MoEBlock(nn.Module):
    """A router (a Linear scoring the experts) and the experts, fused or as E pairs of Linears."""

    def __init__(self, fused: bool, transposed: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.gate = nn.Linear(H, E, bias=False)
        self.fused = fused
        if fused:
            self.experts = FusedExperts(transposed)
        else:
            self.experts = nn.ModuleList(
                nn.ModuleDict(
                    {"gate_up_proj": nn.Linear(H, 2 * I, bias=False), "down_proj": nn.Linear(I, H, bias=False)}
                )
                for _ in range(E)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.gate(x).softmax(-1)
        if self.fused:
            return self.experts(x, weights)
        out = 0
        for e, ex in enumerate(self.experts):
            gate, up = ex["gate_up_proj"](x).chunk(2, dim=-1)
            out = out + weights[:, e : e + 1] * ex["down_proj"](F.silu(gate) * up)
        return out

    def copy_into(self, unfused: "MoEBlock") -> None:
        with torch.no_grad():
            unfused.gate.weight.copy_(self.gate.weight)
            for e, ex in enumerate(unfused.experts):
                for name in ("gate_up_proj", "down_proj"):
                    ex[name].weight.copy_(self.experts.weight(name, e))


def unfused_named(block: MoEBlock) -> list[tuple[str, torch.Tensor]]:
    """The unfused block's parameters under the fused matrices' names (names key seeded draws)."""
    named = [("gate.weight", block.gate.weight)]
    for name in ("gate_up_proj", "down_proj"):
        named += [(f"experts.{name}[{e}]", ex[name].weight) for e, ex in enumerate(block.experts)]
    return named


def run(opt: torch.optim.Optimizer, block: MoEBlock, steps: int = 3) -> None:
    torch.manual_seed(1)
    batches = [torch.randn(16, H) for _ in range(steps)]
    for x in batches:
        opt.zero_grad()
        block(x).pow(2).mean().backward()
        opt.step()


def fused_weights(block: MoEBlock) -> dict[str, torch.Tensor]:
    out = {"gate.weight": block.gate.weight.detach()}
    for name in ("gate_up_proj", "down_proj"):
        out.update({f"experts.{name}[{e}]": block.experts.weight(name, e).detach() for e in range(E)})
    return out


def fused_against_unfused(name: str, transposed: bool = False) -> tuple[MoEBlock, float]:
    """3 steps of ``name`` on the fused block and on the same block unfused: (the fused block, the largest difference
    of any weight)."""
    fused, unfused = MoEBlock(fused=True, transposed=transposed), MoEBlock(fused=False)
    fused.copy_into(unfused)
    kwargs = {"lr": 0.02, **OPTIONS.get(name, {})}
    opt_fused = shardopt.create_optimizer(fused, name, **kwargs)
    opt_unfused = shardopt.create_optimizer(unfused_named(unfused), name, routing={"gate.weight": "router"}, **kwargs)
    run(opt_fused, fused)
    run(opt_unfused, unfused)
    reference = dict(unfused_named(unfused))
    return fused, max((w - reference[n]).abs().max().item() for n, w in fused_weights(fused).items())


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fused_equals_unfused(name: str) -> None:
    fused, worst = fused_against_unfused(name)
    moved = (fused.experts.down_proj.detach() - MoEBlock(fused=True).experts.down_proj).abs().max().item()
    assert moved > 1e-3, "the experts did not train"
    assert worst <= 1e-6, f"{name}: fused experts {worst:.2e} from the unfused block"


def test_experts_get_the_matrix_rule_and_state_per_expert() -> None:
    block = MoEBlock(fused=True)
    roles = param_roles(block)
    assert roles["experts.gate_up_proj"] == roles["experts.down_proj"] == "matrix"
    opt = shardopt.create_optimizer(block, "racs", lr=0.01)
    rows = [line.split() for line in opt.describe().splitlines()]
    assert ["experts.gate_up_proj", "4x20x12", "matrix", "type", "racs"] in rows, rows
    run(opt, block, steps=1)
    matrices = opt.state[block.experts.gate_up_proj]["matrices"]
    assert sorted(matrices) == [f"experts.gate_up_proj[{e}]" for e in range(E)]
    # RACS keeps m + n + 1 values per expert, not AdamW's 2 m n
    assert {k: tuple(v.shape) for k, v in matrices["experts.gate_up_proj[2]"].items()} == {
        "q": (2 * I,),
        "s": (H,),
        "phi": (),
    }
    assert "exp_avg" not in opt.state[block.experts.gate_up_proj]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_transposed_experts_equal_unfused(name: str) -> None:
    """Experts stored in x out (GPT-OSS, ``is_transposed=True``): every rule steps each as its logical out x in
    matrix (``optim.transposed``); the result equals the unfused out x in block."""
    assert param_roles(MoEBlock(fused=True, transposed=True))["experts.down_proj"] == "matrix_transposed"
    _, worst = fused_against_unfused(name, transposed=True)
    # the rules work on the stored (transposed) matrix: the same result in another summation order
    assert worst <= 1e-5, f"{name}: transposed fused experts {worst:.2e} from the unfused block"


def test_names_only_warns_and_routing_declares() -> None:
    block = MoEBlock(fused=True)
    with pytest.warns(UserWarning, match=r"experts\.gate_up_proj \(name only\).*'matrix' \| 'matrix_transposed'"):
        opt = shardopt.create_optimizer(list(block.named_parameters()), "scale", lr=0.01)
    assert opt.param_groups[-1]["treatment"] == "adamw"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = shardopt.create_optimizer(
            list(block.named_parameters()), "scale", lr=0.01, routing={"experts.*": "matrix", "gate.weight": "router"}
        )
    assert {g["treatment"] for g in opt.param_groups if any(p is block.experts.down_proj for p in g["params"])} == {
        "scale"
    }


def test_unknown_3d_weights_are_named() -> None:
    """An experts module routing does not know is named (its matrices would otherwise be AdamW's silently); 3-D
    tensors that are no batch of matrices (a ViT's (1, N, D) position embedding, convolution kernels) are not."""

    class OddExperts(nn.Module):
        def __init__(self):
            super().__init__()
            self.num_experts = 3
            self.w = nn.Parameter(torch.randn(3, 4, 5))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = OddExperts()
            self.pos_embed = nn.Parameter(torch.randn(1, 4, 5))
            self.conv = nn.Conv1d(2, 2, 3)

    with pytest.warns(UserWarning, match=r"experts\.w \(OddExperts\)") as record:
        shardopt.create_optimizer(Model(), "scale", lr=0.01)
    message = str(record[0].message)
    assert "conv" not in message and "pos_embed" not in message
    with warnings.catch_warnings():  # by name only: the position embedding and the kernel are no experts either
        warnings.simplefilter("error")
        shardopt.create_optimizer(
            [(n, p) for n, p in Model().named_parameters() if not n.startswith("experts")], "scale", lr=0.01
        )


def test_4d_refused_for_matrix_rules() -> None:
    model = nn.Module()
    model.w = nn.Parameter(torch.randn(2, 3, 4, 5))
    with pytest.raises(RoutingError, match=r"'w' of shape \(2, 3, 4, 5\).*3-D"):
        shardopt.create_optimizer(model, "scale", lr=0.01, routing={"w": "matrix"})


# ---------------------------------------------------------------------------------------------- layouts
def test_split_flat_cuts_experts_from_flat_partitions() -> None:
    """ZeRO flat ranges that cut across experts and rows: each expert's pieces cover it exactly, and the local
    offsets point at the right elements of every rank's partition."""
    shape, world = (3, 4, 5), 4
    total = 60
    bounds = [0, 7, 29, 30, total]  # rank 2 holds one element, cuts fall mid-row and mid-expert
    values = torch.arange(total, dtype=torch.float32)
    for rank in range(world):
        pieces = [FlatPiece(bounds[r], bounds[r + 1]) for r in range(world)]
        frag = Fragment("w", MatrixLayout((3, 20), pieces, rank), offset=2, shape=shape)
        local = torch.cat([torch.full((2,), -1.0), values[bounds[rank] : bounds[rank + 1]]])
        for e, f in enumerate(split_flat(frag)):
            assert f.name == f"w[{e}]" and f.index == e and f.param == "w" and f.layout.shape == (4, 5)
            assert sum(p.numel for p in f.layout.pieces) == 20
            lo, hi = f.layout.pieces[rank].lo, f.layout.pieces[rank].hi
            torch.testing.assert_close(f.local(local), values[e * 20 + lo : e * 20 + hi])


def test_box_fragments_inside_experts() -> None:
    """Experts over 2 ranks x rows over 2 ranks (an ep x fsdp mesh): each expert is held by the 2 ranks of its ep
    coordinate, in row blocks."""
    shape = (4, 6, 3)
    boxes = [((0, 0, 0), (2, 3, 3)), ((0, 3, 0), (2, 3, 3)), ((2, 0, 0), (2, 3, 3)), ((2, 3, 0), (2, 3, 3))]
    frags = box_fragments("w", shape, boxes, rank=3)
    assert [f.layout.local_numel for f in frags] == [0, 0, 9, 9]
    assert [f.offset for f in frags[2:]] == [0, 9]
    assert frags[2].layout.pieces == (FlatPiece(0, 0), FlatPiece(0, 0), FlatPiece(0, 9), FlatPiece(9, 18))


# ---------------------------------------------------------------------------------------------- real layouts
def _moe_models():
    transformers = pytest.importorskip("transformers")
    common = dict(
        vocab_size=48,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    return {
        "mixtral": lambda: transformers.MixtralForCausalLM(
            transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
        ),
        "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(
            transformers.Qwen3MoeConfig(
                **common, moe_intermediate_size=12, num_experts=4, num_experts_per_tok=2, head_dim=8
            )
        ),
        "olmoe": lambda: transformers.OlmoeForCausalLM(
            transformers.OlmoeConfig(**common, num_experts=4, num_experts_per_tok=2)
        ),
    }


def _expert_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if ".experts." in n and p.dim() == 3}


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe"])
def test_transformers_moe_experts_train_on_the_rule(family: str) -> None:
    """transformers 5's fused experts reach the requested rule, silently or otherwise never AdamW; the routers
    (``*TopKRouter``, not Linears) are AdamW's by role, with no warning about unknown weights."""
    torch.manual_seed(0)
    model = _moe_models()[family]()
    experts = _expert_params(model)
    assert len(experts) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        opt = shardopt.create_optimizer(model, "racs", lr=0.01)
    rule = {id(p): g["treatment"] for g in opt.param_groups for p in g["params"]}
    assert all(rule[id(p)] == "racs" for p in experts.values())
    routers = [n for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
    assert routers and all(param_roles(model)[n] == "router" for n in routers)
    rows = [line.split() for line in opt.describe().splitlines()]
    for n, p in experts.items():
        assert [n, "x".join(map(str, p.shape)), "matrix", "type", "racs"] in rows, rows
    tokens = torch.randint(0, 48, (2, 8))
    before = {n: p.detach().clone() for n, p in experts.items()}
    for _ in range(2):
        opt.zero_grad()
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
    assert all(not torch.equal(before[n], p) for n, p in experts.items())
    names = set(opt.state[next(iter(experts.values()))]["matrices"])
    assert names == {f"{next(iter(experts))}[{e}]" for e in range(4)}


def test_trainer_moe_experts_on_the_rule(tmp_path) -> None:
    """The HF Trainer integration (``enable``) builds the optimizer from the model's roles: Mixtral's experts on
    SUMO, trained by ``trainer.train()``."""
    transformers = pytest.importorskip("transformers")
    from shardopt.integrations.transformers import enable

    torch.manual_seed(0)
    model = _moe_models()["mixtral"]()
    data = [{"input_ids": torch.randint(0, 48, (8,)), "labels": torch.randint(0, 48, (8,))} for _ in range(4)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        report_to="none",
        use_cpu=True,
        max_steps=2,
        per_device_train_batch_size=2,
        save_strategy="no",
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    enable(trainer, "sumo", lr=0.01, rank=2)
    experts = _expert_params(model)
    before = {n: p.detach().clone() for n, p in experts.items()}
    trainer.train()
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    rule = {id(p): g["treatment"] for g in opt.param_groups for p in g["params"]}
    assert all(rule[id(p)] == "sumo" for p in experts.values())
    assert all(not torch.equal(before[n], p) for n, p in experts.items())
    # the Trainer's (accelerate-wrapped) optimizer prints one process's role table (issue 52, item 5)
    table = shardopt.create_optimizer(_moe_models()["mixtral"](), "sumo", lr=0.01, rank=2).describe()
    assert trainer.optimizer.describe() == shardopt.describe(trainer) == table


class GroupedExperts(nn.Module):
    """torchtitan's ``GroupedExperts`` in its layouts: 0.3's ``w1_EFD`` / ``w2_EDF`` / ``w3_EFD`` (out x in, named
    so), later plain ``w1`` / ``w2`` / ``w3`` stored out x in, early releases' ``w1`` / ``w2`` / ``w3`` in x out."""

    def __init__(self, dim: int, hidden: int, num_experts: int, layout: str):
        super().__init__()
        self.num_experts = num_experts
        if layout == "titan03":
            self.w1_EFD = nn.Parameter(torch.randn(num_experts, hidden, dim))
            self.w2_EDF = nn.Parameter(torch.randn(num_experts, dim, hidden))
            self.w3_EFD = nn.Parameter(torch.randn(num_experts, hidden, dim))
        else:
            up, down = (
                ((num_experts, hidden, dim), (num_experts, dim, hidden))
                if layout == "out_in"
                else ((num_experts, dim, hidden), (num_experts, hidden, dim))
            )
            self.w1, self.w2, self.w3 = (nn.Parameter(torch.randn(*s)) for s in (up, down, up))


class TokenChoiceTopKRouter(nn.Module):
    def __init__(self, dim: int, num_experts: int):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)


class TitanMoE(nn.Module):
    def __init__(self, layout: str, dim: int = 8, hidden: int = 12):
        super().__init__()
        self.router = TokenChoiceTopKRouter(dim, 4)
        self.experts = GroupedExperts(dim, hidden, 4, layout)


@pytest.mark.parametrize("layout, role", [("titan03", "matrix"), ("out_in", "matrix"), ("in_out", "matrix_transposed")])
def test_torchtitan_grouped_experts_roles(layout: str, role: str) -> None:
    model = TitanMoE(layout)
    roles = param_roles(model)
    assert roles["router.gate.weight"] == "router"
    assert {r for n, r in roles.items() if n.startswith("experts.")} == {role}


def test_torchtitan_square_experts_are_named_not_guessed() -> None:
    """dim == hidden: the stored orientation cannot be told from the shapes, so the weights are named in a warning
    (AdamW until declared), never guessed."""
    with pytest.warns(UserWarning, match=r"experts\.w1 \(GroupedExperts\)"):
        opt = shardopt.create_optimizer(TitanMoE("in_out", dim=8, hidden=8), "sumo", lr=0.01)
    assert opt.param_groups[-1]["treatment"] == "adamw"


# ---------------------------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("name", ["racs", "asgo", "sumo"])
def test_checkpoint_forms_keep_each_expert(name: str, tmp_path) -> None:
    """shardopt's logical file keys each expert as a matrix (``experts.down_proj[e]::<key>``); a DCP checkpoint of
    the same optimizer (``get_state_dict``: the 3-D tensors, per-matrix state nested under ``matrices``) reads to the
    same logical tensors, and ``write_dcp`` turns them back into that form."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import shardopt.checkpoint as sckpt
    from shardopt.checkpoint import convert

    block = MoEBlock(fused=True)
    opt = shardopt.create_optimizer(block, name, lr=0.02, **OPTIONS.get(name, {}))
    run(opt, block, steps=3)
    sckpt.save(str(tmp_path / "logical"), opt)
    logical = convert.read(str(tmp_path / "logical")).tensors
    assert "experts.down_proj[3]::param" in logical and "experts.down_proj::param" not in logical
    msd, osd = get_state_dict(block, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    from_dcp = convert.read(str(tmp_path / "dcp")).tensors
    assert set(from_dcp) == set(logical)
    for key, value in logical.items():
        torch.testing.assert_close(from_dcp[key].reshape(value.shape), value, rtol=0, atol=0, msg=key)
    meta = convert.read(str(tmp_path / "logical")).meta
    convert.write_dcp(str(tmp_path / "converted"), logical, meta)
    again = convert.read(str(tmp_path / "converted")).tensors
    assert set(again) == set(logical)
    for key, value in logical.items():
        torch.testing.assert_close(again[key].reshape(value.shape), value, rtol=0, atol=0, msg=key)
