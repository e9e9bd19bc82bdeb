"""What a model states about its own embeddings and output layer, read before anything is guessed.

Libraries that build language models say which module embeds tokens and which produces the logits; routing
(``routing.param_roles``) takes that statement over any guess from shapes or positions:

- transformers: ``get_input_embeddings()`` (the token embedding, the only table that defines the vocabulary),
  ``get_output_embeddings()`` (the LM head, possibly tied to the embedding; ``None`` states that there is none), and
  the classification heads of ``*For{Sequence,Token,Image,Audio}Classification``, ``*ForQuestionAnswering`` and
  ``*ForMultipleChoice`` (``score``, ``classifier``, ``qa_outputs``: the last Linear inside when the head is a
  small module of its own, like RoBERTa's ``classifier.out_proj``);
- Megatron-core language models (modules with ``pre_process`` / ``post_process``): ``embedding.word_embeddings``,
  ``embedding.position_embeddings`` and ``output_layer``, on whichever pipeline stage holds them; a stage with
  ``post_process=False`` states that it holds no head, and a word embedding shared with the output layer is the head
  (as one process names a tied weight);
- torchtitan-shaped models: a module holding ``tok_embeddings`` and ``output`` attributes (either may be ``None`` on
  a pipeline stage, which then states that it holds no head);
- DeepSpeed ``PipelineModule``: the whole model's layer specs (``plugin.deepspeed_engine.pipeline_roles``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

__all__ = ["Declaration", "declared_roles", "HEAD_CLASS_PATTERN"]

#: transformers task models whose output layer is a classifier (the head's treatment, docs/guides/roles.md)
HEAD_CLASS_PATTERN = re.compile(
    r"For(Sequence|Token|Image|Audio|Video)Classification|ForQuestionAnswering|ForMultipleChoice|"
    r"ForImageClassificationWithTeacher"
)
#: attributes of such models that hold the classifier
_HEAD_ATTRS = ("score", "classifier", "qa_outputs", "cls_classifier")


@dataclass
class Declaration:
    """What the model stated. ``embeddings``: ids of token-embedding weights (they define the vocabulary).
    ``heads``: ids of output-layer weights. ``others``: ids of other declared embedding tables (positions, token
    types). ``states_head``: the model said whether it holds a head (so no head is guessed, even where it holds
    none). ``who``: which statement was read (for messages)."""

    embeddings: set[int] = field(default_factory=set)
    heads: set[int] = field(default_factory=set)
    others: set[int] = field(default_factory=set)
    states_head: bool = False
    who: list[str] = field(default_factory=list)


def _weight(m: object) -> torch.Tensor | None:
    w = getattr(m, "weight", None)
    return w if isinstance(w, torch.Tensor) else None


def _last_linear(m: nn.Module, dim_of: Callable[[torch.Tensor], int]) -> nn.Module | None:
    """``m`` itself if it holds a 2-D weight, else its last descendant that does (a classification head that is a
    small module: dense, activation, dropout, output projection)."""

    def is_matrix(c: nn.Module) -> bool:
        w = _weight(c)
        return w is not None and dim_of(w) == 2 and not isinstance(c, nn.Embedding)

    if is_matrix(m):
        return m
    found = [c for c in m.modules() if c is not m and is_matrix(c)]
    return found[-1] if found else None


def _transformers(model: nn.Module, out: Declaration, dim_of: Callable[[torch.Tensor], int]) -> None:
    for m in model.modules():
        get_in, get_out = getattr(m, "get_input_embeddings", None), getattr(m, "get_output_embeddings", None)
        if not (callable(get_in) and callable(get_out) and hasattr(m, "config")):
            continue
        try:
            emb, head = get_in(), get_out()
        except (NotImplementedError, AttributeError, TypeError):
            continue
        stated = False
        if isinstance(emb, nn.Module) and _weight(emb) is not None:
            out.embeddings.add(id(_weight(emb)))
            stated = True
        if isinstance(head, nn.Module) and _weight(head) is not None:
            out.heads.add(id(_weight(head)))
            stated = True
        elif head is None:
            stated = True
        if HEAD_CLASS_PATTERN.search(type(m).__name__):
            for attr in _HEAD_ATTRS:
                holder = getattr(m, attr, None)
                last = _last_linear(holder, dim_of) if isinstance(holder, nn.Module) else None
                if last is not None:
                    out.heads.add(id(_weight(last)))
                    break
        if stated:
            out.states_head = True
            out.who.append(f"transformers {type(m).__name__}")


def _megatron(model: nn.Module, out: Declaration, dim_of: Callable[[torch.Tensor], int]) -> None:
    for m in model.modules():
        if not (hasattr(m, "pre_process") and hasattr(m, "post_process")):
            continue
        embedding = getattr(m, "embedding", None)
        words = _weight(getattr(embedding, "word_embeddings", None))
        positions = _weight(getattr(embedding, "position_embeddings", None))
        tied = bool(getattr(m, "share_embeddings_and_output_weights", False))
        if m.pre_process and words is not None:
            # shared with the output layer (the last stage's copy on a pipeline): the head, as one process names a
            # tied weight
            (out.heads if tied else out.embeddings).add(id(words))
        if m.pre_process and positions is not None:
            out.others.add(id(positions))
        head = _weight(getattr(m, "output_layer", None))
        if m.post_process and head is not None:
            out.heads.add(id(head))
        out.states_head = True
        out.who.append(f"Megatron {type(m).__name__}")


def _torchtitan(model: nn.Module, out: Declaration, dim_of: Callable[[torch.Tensor], int]) -> None:
    for m in model.modules():
        if not (hasattr(m, "tok_embeddings") and hasattr(m, "output")):
            continue
        emb, head = m.tok_embeddings, m.output
        if not (emb is None or isinstance(emb, nn.Module)) or not (head is None or isinstance(head, nn.Module)):
            continue
        if emb is not None and _weight(emb) is not None:
            out.embeddings.add(id(_weight(emb)))
        if head is not None and _weight(head) is not None:
            out.heads.add(id(_weight(head)))
        out.states_head = True
        out.who.append(f"torchtitan-style {type(m).__name__} (tok_embeddings / output)")


def declared_roles(model: nn.Module, dim_of: Callable[[torch.Tensor], int] = torch.Tensor.dim) -> Declaration:
    """Everything ``model`` (and the models inside it) state about embeddings and output layers. ``dim_of``: a
    tensor's number of dimensions as the model defines it (``routing.logical_dim``: engines flatten or partition
    parameters)."""
    out = Declaration()
    for reader in (_transformers, _megatron, _torchtitan):
        reader(model, out, dim_of)
    out.embeddings -= out.heads  # a tied weight is the head, as one process names it
    return out
