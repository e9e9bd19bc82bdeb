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
    assert roles == {"wte.weight": "embedding", "attn.weight": "matrix", "attn.bias": "vector",
                     "mlp.weight": "matrix", "mlp.bias": "vector", "ln.weight": "vector", "ln.bias": "vector",
                     "out.weight": "lm_head"}


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
