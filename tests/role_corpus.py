"""A corpus of real architectures, built tiny from their configs on the meta device (no download, no memory), for
the role tables of ``tests/test_role_corpus.py`` and the engines of ``tests_dist/test_rules_everywhere.py``.

Each entry is the model a user brings: transformers' own classes with small configs that keep each family's
structure (tied or untied heads, learned positions as wide as the hidden size, fused experts, classifier heads), a
torchtitan-shaped llama, and a functional tied head (logits from the embedding's weight) with an MLP as wide as the
vocabulary.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

#: shared tiny sizes: vocabulary, hidden width, MLP width, layers, heads
V, H, FF, L, NH = 64, 16, 32, 2, 2


def _hf(config: str, model: str, **kw) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        cfg = getattr(transformers, config)(**kw)
        return getattr(transformers, model)(cfg)

    build.__doc__ = f"transformers {model}({config}({', '.join(f'{k}={v!r}' for k, v in kw.items())}))"
    return build


_LLAMA = dict(
    vocab_size=V,
    hidden_size=H,
    intermediate_size=FF,
    num_hidden_layers=L,
    num_attention_heads=NH,
    num_key_value_heads=1,
    max_position_embeddings=H,
)
_MOE = dict(_LLAMA, num_local_experts=4, num_experts_per_tok=2)


class TitanBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(H)
        self.attention = nn.ModuleDict({w: nn.Linear(H, H, bias=False) for w in ("wq", "wk", "wv", "wo")})
        self.ffn_norm = nn.RMSNorm(H)
        self.feed_forward = nn.ModuleDict(
            {"w1": nn.Linear(H, V, bias=False), "w2": nn.Linear(V, H, bias=False), "w3": nn.Linear(H, V, bias=False)}
        )


class TitanLlama(nn.Module):
    """torchtitan's llama layout (``tok_embeddings``, ``layers``, ``norm``, ``output``), with an MLP as wide as the
    vocabulary: its ``w1``/``w3`` must stay matrices."""

    def __init__(self, with_head: bool = True) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(V, H)
        self.layers = nn.ModuleDict({str(i): TitanBlock() for i in range(L)})
        self.norm = nn.RMSNorm(H)
        self.output = nn.Linear(H, V, bias=False) if with_head else None


class TiedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(16), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class FunctionalTiedLM(nn.Module):
    """The issue's functional tied head: token embedding 50 x 16, learned positions 16 x 16, two MLP blocks, logits
    ``F.linear(x, wte.weight)``. No Linear is the head (the last ``fc2`` used to be taken for it)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(50, 16)
        self.wpe = nn.Embedding(16, 16)
        self.blocks = nn.ModuleList(TiedBlock() for _ in range(2))
        self.ln_f = nn.LayerNorm(16)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return F.linear(self.ln_f(x), self.wte.weight)


#: name -> builder; each builder's docstring says what it builds (written into the table's header)
CORPUS: dict[str, Callable[[], nn.Module]] = {
    "llama": _hf("LlamaConfig", "LlamaForCausalLM", **_LLAMA),
    "mistral": _hf("MistralConfig", "MistralForCausalLM", **_LLAMA),
    "qwen2": _hf("Qwen2Config", "Qwen2ForCausalLM", **_LLAMA),
    "qwen3": _hf("Qwen3Config", "Qwen3ForCausalLM", **_LLAMA, head_dim=8),
    "gemma": _hf("GemmaConfig", "GemmaForCausalLM", **_LLAMA, head_dim=8),  # tied
    # GPT-2: Conv1D (stored in x out), tied head, learned positions as many as the hidden width
    "gpt2": _hf("GPT2Config", "GPT2LMHeadModel", vocab_size=V, n_embd=H, n_layer=L, n_head=NH, n_positions=H),
    "gpt_neox": _hf(
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        vocab_size=V,
        hidden_size=H,
        intermediate_size=V,
        num_hidden_layers=L,
        num_attention_heads=NH,
        max_position_embeddings=H,
    ),
    # OPT: learned positions (offset 2), ffn as wide as the vocabulary
    "opt": _hf(
        "OPTConfig",
        "OPTForCausalLM",
        vocab_size=V,
        hidden_size=H,
        ffn_dim=V,
        num_hidden_layers=L,
        num_attention_heads=NH,
        max_position_embeddings=H,
        word_embed_proj_dim=H,
    ),
    "bloom": _hf("BloomConfig", "BloomForCausalLM", vocab_size=V, hidden_size=H, n_layer=L, n_head=NH),
    "phi": _hf(
        "PhiConfig",
        "PhiForCausalLM",
        vocab_size=V,
        hidden_size=H,
        intermediate_size=FF,
        num_hidden_layers=L,
        num_attention_heads=NH,
        max_position_embeddings=H,
    ),
    "falcon": _hf(
        "FalconConfig", "FalconForCausalLM", vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=NH
    ),
    "mixtral": _hf("MixtralConfig", "MixtralForCausalLM", **_MOE),
    "qwen3_moe": _hf(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        vocab_size=V,
        hidden_size=H,
        intermediate_size=FF,
        moe_intermediate_size=8,
        num_hidden_layers=L,
        num_attention_heads=NH,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
        head_dim=8,
    ),
    "olmoe": _hf(
        "OlmoeConfig",
        "OlmoeForCausalLM",
        vocab_size=V,
        hidden_size=H,
        intermediate_size=8,
        num_hidden_layers=L,
        num_attention_heads=NH,
        num_experts=4,
        num_experts_per_tok=2,
    ),
    "t5": _hf(
        "T5Config", "T5ForConditionalGeneration", vocab_size=V, d_model=H, d_kv=8, d_ff=V, num_layers=L, num_heads=NH
    ),
    "bert_mlm": _hf(
        "BertConfig",
        "BertForMaskedLM",
        vocab_size=V,
        hidden_size=H,
        intermediate_size=V,
        num_hidden_layers=L,
        num_attention_heads=NH,
        max_position_embeddings=H,
    ),
    # two labels, and a token-type table of two rows: the classifier is the head by declaration, not by the table
    "bert_cls": _hf(
        "BertConfig",
        "BertForSequenceClassification",
        vocab_size=V,
        hidden_size=H,
        intermediate_size=FF,
        num_hidden_layers=L,
        num_attention_heads=NH,
        max_position_embeddings=H,
        num_labels=2,
    ),
    "vit_cls": _hf(
        "ViTConfig",
        "ViTForImageClassification",
        hidden_size=H,
        intermediate_size=FF,
        num_hidden_layers=L,
        num_attention_heads=NH,
        image_size=8,
        patch_size=4,
        num_labels=3,
    ),
    "torchtitan_llama": TitanLlama,
    "functional_tied": FunctionalTiedLM,
}


def build(name: str) -> nn.Module:
    """``CORPUS[name]`` on the meta device (shapes only)."""
    with torch.device("meta"):
        return CORPUS[name]()
