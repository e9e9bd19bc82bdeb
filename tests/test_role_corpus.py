"""Every parameter's role on a corpus of real architectures (issue 52): the committed tables in
``tests/fixtures/roles/`` are asserted row by row, and models of families the corpus never built get the roles
their declarations state. ``SHARDOPT_WRITE_ROLE_TABLES=1`` rewrites the tables (review the diff before committing)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from role_corpus import CORPUS, build  # noqa: E402

from shardopt.optim.declared_roles import declared_roles  # noqa: E402
from shardopt.optim.routing import find_roles, logical_shape  # noqa: E402

TABLES = Path(__file__).parent / "fixtures" / "roles"
WRITE = os.environ.get("SHARDOPT_WRITE_ROLE_TABLES") == "1"


def table(name: str) -> str:
    model = build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = find_roles(model)
    shapes = {n: "x".join(map(str, logical_shape(p))) for n, p in model.named_parameters()}
    rows = [(n, shapes[n], found.roles[n], found.sources[n]) for n in shapes]
    widths = [max(len(r[c]) for r in rows) for c in range(4)]
    head = [f"# {' '.join(CORPUS[name].__doc__.split())}", "# parameter  shape  role  source"]
    head += [f"# warning: {w}" for w in found.warnings]
    return "\n".join(head + ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]) + "\n"


@pytest.mark.parametrize("name", list(CORPUS))
def test_roles_match_the_committed_table(name: str) -> None:
    path = TABLES / f"{name}.txt"
    got = table(name)
    if WRITE:
        path.write_text(got)
    assert path.exists(), f"no committed role table for {name}: run with SHARDOPT_WRITE_ROLE_TABLES=1 and review it"
    assert got == path.read_text(), f"roles of {name} differ from {path}"


@pytest.mark.parametrize("name", list(CORPUS))
def test_at_most_one_head_and_it_is_never_a_hidden_matrix(name: str) -> None:
    model = build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = find_roles(model)
    heads = [n for n, r in found.roles.items() if r == "lm_head"]
    assert len(heads) <= 1, heads
    hidden = ("mlp", "fc1", "fc2", "feed_forward", "attention", "attn", "self_attn", "intermediate", "dense_h_to_4h")
    for n in heads:
        module = n.rsplit(".", 1)[0]
        assert not any(part in hidden for part in module.split(".")), f"{n} is a hidden layer"


def test_functional_tied_head_guesses_no_linear_and_warns_once() -> None:
    from shardopt.optim import routing

    model = build("functional_tied")
    found = find_roles(model)
    assert "lm_head" not in found.roles.values()
    assert found.roles["blocks.1.fc2.weight"] == "matrix"
    assert found.roles["wpe.weight"] == "embedding"
    assert len(found.warnings) == 1 and "wte.weight" in found.warnings[0] and "lm_head" in found.warnings[0]
    routing._WARNED_GUESSES.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        routing.warn_guesses_once(found)
        routing.warn_guesses_once(found)
    assert len([w for w in caught if "wte.weight" in str(w.message)]) == 1


def test_position_tables_never_define_the_vocabulary() -> None:
    """A model that declares nothing, with an MLP as wide as the positions table and no head."""
    model = nn.Module()
    model.tok = nn.Embedding(50, 8)
    model.position_embeddings = nn.Embedding(16, 8)
    model.fc1, model.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
    roles = find_roles(model).roles
    assert roles["fc1.weight"] == roles["fc2.weight"] == "matrix"
    nested = nn.Module()  # the table's name read from its own module, not its parent's (``decoder.embed_positions``)
    nested.decoder = nn.Module()
    nested.decoder.embed_tokens, nested.decoder.embed_positions = nn.Embedding(50, 8), nn.Embedding(16, 8)
    nested.decoder.fc = nn.Linear(8, 16)
    assert find_roles(nested).roles["decoder.fc.weight"] == "matrix"


def test_a_user_routing_beats_a_declaration() -> None:
    import shardopt

    model = build("llama")
    model = model.to_empty(device="cpu")
    opt = shardopt.create_optimizer(model, "scale", routing={"lm_head.weight": "matrix"}, lr=1e-3)
    row = next(line for line in opt.describe().splitlines() if line.startswith("lm_head.weight"))
    assert " matrix " in f" {row} "


#: transformers families the corpus never built: their roles must follow their own declarations
UNSEEN = [
    ("StableLmConfig", "StableLmForCausalLM", {}),
    ("Starcoder2Config", "Starcoder2ForCausalLM", {}),
    ("CohereConfig", "CohereForCausalLM", {}),
    ("GraniteConfig", "GraniteForCausalLM", {}),
    ("Olmo2Config", "Olmo2ForCausalLM", {}),
    ("Phi3Config", "Phi3ForCausalLM", {}),
    ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 8}),
    ("GPTJConfig", "GPTJForCausalLM", {"n_embd": 16, "n_layer": 2, "n_head": 2, "rotary_dim": 4, "n_positions": 16}),
    (
        "CodeGenConfig",
        "CodeGenForCausalLM",
        {"n_embd": 16, "n_layer": 2, "n_head": 2, "rotary_dim": 4, "n_positions": 16},
    ),
    ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", {"n_embd": 16, "n_layer": 2, "n_head": 2, "n_positions": 16}),
    ("RobertaConfig", "RobertaForSequenceClassification", {"num_labels": 3}),
    (
        "DistilBertConfig",
        "DistilBertForTokenClassification",
        {"dim": 16, "hidden_dim": 32, "n_layers": 2, "n_heads": 2},
    ),
    ("LlamaConfig", "LlamaForSequenceClassification", {"num_labels": 2}),
]
_COMMON = dict(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=16,
    pad_token_id=0,
    bos_token_id=0,
    eos_token_id=0,
)


@pytest.mark.parametrize("config, cls, kw", UNSEEN, ids=[c for _, c, _ in UNSEEN])
def test_unseen_families_get_their_declared_roles(config: str, cls: str, kw: dict) -> None:
    import transformers

    if not hasattr(transformers, config) or not hasattr(transformers, cls):
        pytest.skip(f"transformers {transformers.__version__} has no {cls}")
    ctor = getattr(transformers, config)
    import inspect

    params = inspect.signature(ctor.__init__).parameters
    accepts = {k: v for k, v in _COMMON.items() if k in params or "kwargs" not in params}
    with torch.device("meta"):
        model = getattr(transformers, cls)(ctor(**{**accepts, **kw}))
    found = find_roles(model)
    names = {id(p): n for n, p in model.named_parameters()}
    declared = declared_roles(model)
    assert declared.states_head, f"{cls} states no head"
    heads = {names[i] for i in declared.heads if i in names}
    assert heads, f"{cls}: no output layer declared"
    assert {n for n, r in found.roles.items() if r == "lm_head"} == heads
    for i in declared.embeddings:
        if i in names:
            assert found.roles[names[i]] == "embedding"
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear) and id(m.weight) in names and names[id(m.weight)] not in heads:
            assert found.roles[names[id(m.weight)]] in ("matrix", "router"), (n, found.roles[names[id(m.weight)]])


MEGATRON = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[1])
    import megatron_cpu_shim
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from shardopt.optim.routing import find_roles
    ps.initialize_model_parallel(1, 1)
    megatron_cpu_shim.install()
    # learned absolute positions, hidden = max positions = 16, ffn = vocab = 64 (the issue's adversarial sizes)
    cfg = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=64,
                            use_cpu_initialization=True, add_bias_linear=False, bias_dropout_fusion=False,
                            masked_softmax_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
                            persist_layer_norm=False)
    out = {}
    for stage, (pre, post) in {"whole": (True, True), "first": (True, False), "last": (False, True)}.items():
        for tied in (False, True):
            m = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16, pre_process=pre,
                         post_process=post, share_embeddings_and_output_weights=tied)
            t = find_roles(m)
            out[f"{stage}{'-tied' if tied else ''}"] = {"roles": t.roles, "sources": t.sources, "warnings": t.warnings}
    print("JSON" + json.dumps(out))
""")


def test_megatron_gptmodel_stages_get_the_roles_one_process_gives() -> None:
    """Megatron GPTModel with learned positions, hidden = max positions and ffn = vocab: the whole model, its first
    stage (no output layer) and its last stage (no embedding), untied and tied."""
    pytest.importorskip("megatron.core")
    import json
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    here = Path(__file__).parent.parent / "tests_dist"
    proc = subprocess.run(
        [sys.executable, "-c", MEGATRON, str(here), str(port)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("JSON", 1)[1])
    for tied in ("", "-tied"):
        whole, first, last = (out[s + tied]["roles"] for s in ("whole", "first", "last"))
        for stage in (first, last):
            for n, r in stage.items():
                assert r == whole.get(n, r), (tied, n, r, whole.get(n))
        assert "lm_head" not in [r for n, r in first.items() if not n.startswith("embedding.word")]
        assert first["decoder.layers.0.mlp.linear_fc1.weight"] == "matrix"
        assert first["embedding.position_embeddings.weight"] == "embedding"
        assert out["first" + tied]["sources"]["embedding.word_embeddings.weight"] == "declared"
        assert not any(out[s + tied]["warnings"] for s in ("whole", "first", "last"))
    assert out["whole"]["roles"]["output_layer.weight"] == "lm_head"
    assert out["whole"]["roles"]["embedding.word_embeddings.weight"] == "embedding"
    assert out["first-tied"]["roles"]["embedding.word_embeddings.weight"] == "lm_head"
    assert out["last-tied"]["roles"]["output_layer.weight"] == "lm_head"


def test_torch_style_named_groups_record_where_roles_came_from() -> None:
    """``SCALE(model.named_parameters())`` (names only): embeddings and heads are guesses, matrices and vectors
    follow from shapes; no row is left without a source."""
    import shardopt

    model = build("llama").to_empty(device="cpu")
    rows = [line.split() for line in shardopt.SCALE(model.named_parameters(), lr=1e-3).describe().splitlines()[1:]]
    by_name = {r[0]: r[3] for r in rows}
    assert by_name["model.embed_tokens.weight"] == "guessed"
    assert by_name["lm_head.weight"] == "guessed"
    assert by_name["model.layers.0.self_attn.q_proj.weight"] == "type"
    assert "?" not in by_name.values()
