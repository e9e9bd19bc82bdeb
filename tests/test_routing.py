"""Default roles by module type, tied embeddings, and user overrides."""

from __future__ import annotations

from torch import nn

import shardopt
from shardopt.optim.routing import param_roles


class LM(nn.Module):
    def __init__(self, tied: bool = False):
        super().__init__()
        self.wte = nn.Embedding(50, 8)  # a name the reference code's "embed_tokens" test would miss
        self.attn = nn.Linear(8, 8)
        self.mlp = nn.Linear(8, 16)
        self.ln = nn.LayerNorm(8)
        self.out = nn.Linear(8, 50, bias=False)
        if tied:
            self.out.weight = self.wte.weight


def test_roles_by_module_type():
    roles = param_roles(LM())
    assert roles == {
        "wte.weight": "embedding",
        "attn.weight": "matrix",
        "attn.bias": "vector",
        "mlp.weight": "matrix",
        "mlp.bias": "vector",
        "ln.weight": "vector",
        "ln.bias": "vector",
        "out.weight": "lm_head",
    }


def test_tied_embedding_is_the_lm_head():
    roles = param_roles(LM(tied=True))
    assert roles["wte.weight"] == "lm_head" and "out.weight" not in roles


def groups_by_name(opt):
    return {n: g for g in opt.param_groups for p in g["params"] for n in [opt.param_names[id(p)]]}


def test_scale_default_routing_and_override():
    opt = shardopt.create_optimizer(LM(), "scale")
    g = groups_by_name(opt)
    assert g["wte.weight"]["treatment"] == "scale" and g["wte.weight"]["norm_dim"] == 0
    assert g["out.weight"]["momentum"] == 0.9 and g["out.weight"]["norm_dim"] == 1
    assert g["attn.weight"]["momentum"] == 0.0
    assert g["ln.weight"]["treatment"] == "adamw"
    opt = shardopt.create_optimizer(LM(), "scale", routing={"mlp.*": "adamw"})
    assert groups_by_name(opt)["mlp.weight"]["treatment"] == "adamw"


def test_sinkgd_and_racs_keep_embedding_and_head_on_adamw():
    for name in ("sinkgd", "racs"):
        g = groups_by_name(shardopt.create_optimizer(LM(), name))
        assert g["attn.weight"]["treatment"] == name
        assert g["wte.weight"]["treatment"] == g["out.weight"]["treatment"] == "adamw"
        g = groups_by_name(shardopt.create_optimizer(LM(), name, routing={"out.weight": "matrix"}))
        assert g["out.weight"]["treatment"] == name


class TopKGate(nn.Module):
    """Shaped like DeepSpeed's ``deepspeed.moe.sharded_moe.TopKGate``: the expert scores are its ``wg`` Linear."""

    def __init__(self):
        super().__init__()
        self.wg = nn.Linear(8, 4, bias=False)


class SparseMoeBlock(nn.Module):
    """Shaped like Mixtral's ``MixtralSparseMoeBlock``: a ``gate`` Linear beside the experts."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 4, bias=False)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))


class MoELM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.router_block = TopKGate()
        self.block_sparse_moe = SparseMoeBlock()
        self.gate_proj = nn.Linear(8, 8)  # a gated MLP's projection is a matrix, not a router
        self.lm_head = nn.Linear(8, 50, bias=False)


def test_mixture_of_experts_routers_default_to_adamw():
    """A router scores experts; like the other small routing weights it stays on AdamW by default (issue 28),
    found from the module types and, without the model, from the names; the experts get the matrix rule."""
    model = MoELM()
    roles = param_roles(model)
    assert roles["router_block.wg.weight"] == roles["block_sparse_moe.gate.weight"] == "router"
    assert roles["gate_proj.weight"] == roles["block_sparse_moe.experts.0.weight"] == "matrix"
    by_name = shardopt.optim.routing.roles_from_names(list(model.named_parameters()))
    assert {n: r for n, r in by_name.items() if r == "router"} == {"block_sparse_moe.gate.weight": "router"}
    deepspeed_name = "moe.deepspeed_moe.gate.wg.weight"
    assert shardopt.optim.routing.roles_from_names([(deepspeed_name, model.router_block.wg.weight)]) == {
        deepspeed_name: "router"
    }
    for name in ("scale", "sumo", "alice"):
        g = groups_by_name(shardopt.create_optimizer(model, name))
        assert g["router_block.wg.weight"]["treatment"] == g["block_sparse_moe.gate.weight"]["treatment"] == "adamw"
        assert g["block_sparse_moe.experts.0.weight"]["treatment"] == name
    g = groups_by_name(shardopt.create_optimizer(model, "sumo", routing={"*.gate.weight": "matrix"}))
    assert g["block_sparse_moe.gate.weight"]["treatment"] == "sumo"  # a routing pattern overrides the default
