"""Which parameter gets which rule: roles the model declares, then module types, then the optimizer's table.

Roles: ``embedding`` (``nn.Embedding`` weights), ``lm_head`` (the output layer: the one the model declares, an
LM's vocabulary projection or a classifier, ``declared_roles``; where nothing is declared, a Linear whose weight is
tied to an embedding, or the model's last 2-D layer when it is as wide as a token vocabulary: ``find_roles``),
``router`` (the Linear that scores experts in a mixture-of-experts layer: DeepSpeed's ``TopKGate.wg``, the
``gate`` / ``router`` Linear of a Hugging Face MoE block; AdamW by default, like the other small routing weights),
``matrix`` (every other 2-D Linear weight), ``matrix_transposed`` (a 2-D weight stored ``in x out``, as
``transformers.pytorch_utils.Conv1D`` in GPT-2: every rule steps it as its logical out x in matrix),
``vector`` (everything else: norms, biases, convolution kernels, and 2-D or 3-D weights of module types routing
does not know, which ``route`` names in a warning).
Fused mixture-of-experts weights are 3-D ``(E, m, n)`` batches of matrices (``sharding.batched``): the 3-D weights
of a transformers 5 experts module (``@use_experts_implementation``: ``matrix``, or ``matrix_transposed`` where it
says ``is_transposed``) and of torchtitan's ``GroupedExperts`` (``matrix`` for its ``w1_EFD``-style names and for
``w1``/``w2``/``w3`` stored out x in; ``matrix_transposed`` for older releases that store them in x out).
User patterns (``fnmatch`` on the parameter name, first match wins) override the role, or force
``"adamw"``. Each optimizer maps roles to param-group options (its config's ``roles()``).

Without the model (``named_parameters()`` passed to an optimizer or to ``create_optimizer``) roles come from
the names alone (``roles_from_names``); without names every 2-D tensor is a ``matrix`` (``unnamed_roles``).
"""

from __future__ import annotations

import fnmatch
import re
import warnings
from typing import AbstractSet, Any, Iterable, Mapping, NamedTuple, Sequence

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from .hooks import apply_param_sources

__all__ = [
    "ROLES",
    "ROLE_SOURCES",
    "RoleTable",
    "find_roles",
    "role_source",
    "param_roles",
    "StandIn",
    "declare_stand_ins",
    "forget_stand_ins",
    "model_parameters",
    "own_parameters",
    "unknown_matrices",
    "roles_from_names",
    "unnamed_roles",
    "named_or_unnamed",
    "route",
    "RoutingError",
    "record_role",
    "role_of",
    "declare_module_roles",
    "module_role",
    "describe_groups",
]


class ConfigError(ValueError):
    """A shardopt configuration problem; the message names the key path."""


class RoutingError(ConfigError):
    """A routing rule that cannot apply (unknown role, no match, a non-matrix sent to a matrix rule)."""


#: matrix rules whose update of W^T is the transpose of their update of W on non-square matrices (they orient by
#: shape; tests/test_hf_roles.py checks it). Every rule steps a weight stored in x out (``matrix_transposed``) as its
#: logical matrix through its role table's ``transposed`` option (``optim.transposed``: square ones too); a role table
#: of one's own without that entry gets the matrix options with ``transposed`` for these rules only
TRANSPOSE_SYMMETRIC = ("asgo", "sumo", "swan", "alice", "alice0")

ROLES = ("embedding", "lm_head", "router", "matrix", "matrix_transposed", "vector", "adamw")

# Roles kept beside the tensors, never on them (no ``_shardopt_*`` attributes; tests/test_import_graph.py): maps
# keyed by tensor identity that do not keep a tensor alive.
#: the role that chose each routed tensor's rule (``route`` and ``groups.normalize_param_groups`` record it;
#: ``describe`` reads it)
_ROLE_OF: WeakIdKeyDictionary = WeakIdKeyDictionary()
#: where each routed tensor's role came from (``ROLE_SOURCES``), for ``describe`` and the build log
_ROLE_SOURCE: WeakIdKeyDictionary = WeakIdKeyDictionary()

#: where a role comes from: the model's own statement (``declared``: transformers' input/output embeddings and
#: classification heads, Megatron's embedding and output layer, torchtitan's ``tok_embeddings`` / ``output``, a
#: pipeline's layer specs), the module's type (``type``: ``nn.Embedding``, ``nn.Linear``, ``Conv1D``, routers, fused
#: experts), a guess from shapes, positions or names (``guessed``), or a user's routing pattern (``routing``)
ROLE_SOURCES = ("declared", "type", "guessed", "routing")
#: roles declared from a model's module types for tensors that reach an optimizer unnamed by the model (the
#: Hugging Face Trainer's decay / no-decay groups); they win over roles guessed from the names
_MODULE_ROLES: WeakIdKeyDictionary = WeakIdKeyDictionary()


#: logical shapes that engine adapters declare for tensors whose own shape is a flattened piece (legacy FSDP's
#: ``use_orig_params`` views: ``shardopt.plugin.fsdp1``)
_LOGICAL_SHAPES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def declare_logical_shape(tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    """Declare the shape the model gives ``tensor`` (an engine holds a flattened piece of it)."""
    _LOGICAL_SHAPES[tensor] = tuple(int(s) for s in shape)


def logical_shape(t: torch.Tensor) -> tuple[int, ...]:
    """A parameter's shape as the model defines it: DeepSpeed ZeRO-3 partitions a parameter's data (also while the
    model is built, under ``deepspeed.zero.Init``: ``p.shape`` is ``(0,)``) and keeps the shape in ``ds_shape``;
    legacy FSDP's flattened views have theirs declared (``declare_logical_shape``)."""
    ds_shape = getattr(t, "ds_shape", None)
    if ds_shape is not None:
        return tuple(int(s) for s in ds_shape)
    return _LOGICAL_SHAPES.get(t) or tuple(t.shape)


#: an engine adapter's stand-ins for the parameters of a model whose own parameters are not what the optimizer can
#: step as matrices (legacy FSDP's ``use_orig_params=False``: each ``FlatParameter`` holds pieces of several
#: original parameters): model -> {id(replaced parameter): [StandIn, ...]}
_STAND_INS: WeakIdKeyDictionary = WeakIdKeyDictionary()


class StandIn(NamedTuple):
    """One original parameter as routing sees it: ``name`` (its path in ``model.named_parameters()`` style),
    ``module`` and ``attr`` (where the model keeps it), ``seen`` (the tensor there when declared, for roles by module
    type; None if absent) and ``stepped`` (the tensor the optimizer steps in its place)."""

    name: str
    module: nn.Module
    attr: str
    seen: torch.Tensor | None
    stepped: torch.Tensor


def declare_stand_ins(model: nn.Module, replaced: torch.Tensor, stand_ins: Sequence[StandIn]) -> None:
    """Route ``stand_ins`` instead of ``model``'s parameter ``replaced``: roles come from their modules and names,
    groups hold their ``stepped`` tensors."""
    _STAND_INS.setdefault(model, {})[id(replaced)] = list(stand_ins)


def forget_stand_ins(model: nn.Module) -> None:
    """Drop ``model``'s declared stand-ins once its parameters are routed: they hold its modules, which must not
    outlive it."""
    _STAND_INS.pop(model, None)


def model_parameters(model: nn.Module) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(name, tensor its module holds, tensor the optimizer steps)`` for every parameter of ``model``, declared
    stand-ins (``declare_stand_ins``) in place of the parameters they replace."""
    declared = _STAND_INS.get(model)
    if not declared:
        return [(n, p, p) for n, p in model.named_parameters()]
    # in the model's own order (module by module), as without the engine: groups, and so checkpoints, list
    # parameters alike whichever way the engine holds them
    rank = {id(m): i for i, m in enumerate(model.modules())}
    owner = {id(p): rank[id(m)] for m in model.modules() for p in m.parameters(recurse=False)}
    out: list[tuple[int, tuple[str, torch.Tensor, torch.Tensor]]] = []
    for n, p in model.named_parameters():
        if id(p) in declared:
            out += [
                (rank.get(id(s.module), -1), (s.name, s.seen if s.seen is not None else s.stepped, s.stepped))
                for s in declared[id(p)]
            ]
        else:
            out.append((owner.get(id(p), -1), (n, p, p)))
    return [entry for _, entry in sorted(out, key=lambda item: item[0])]


def own_parameters(model: nn.Module, module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``module``'s own parameters (``named_parameters(recurse=False)``) and the stand-ins declared for it."""
    own: list[tuple[str, torch.Tensor]] = list(module.named_parameters(recurse=False))
    for stand_ins in _STAND_INS.get(model, {}).values():
        own += [(s.attr, s.seen) for s in stand_ins if s.module is module and s.seen is not None]
    return own


def clean_name(name: str) -> str:
    """A parameter's name without the prefixes module wrappers add (legacy FSDP's ``_fsdp_wrapped_module.``,
    activation checkpointing's ``_checkpoint_wrapped_module.``): the model's own name, which keys state and
    checkpoints whatever the engine."""
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


def logical_dim(t: torch.Tensor) -> int:
    return len(logical_shape(t))


def record_role(tensor: torch.Tensor, role: str, source: str | None = None) -> None:
    """Remember the role that chose ``tensor``'s rule (what ``role_of`` returns) and, when known, where it came
    from (one of ``ROLE_SOURCES``; what ``role_source`` returns)."""
    _ROLE_OF[tensor] = role
    if source is not None:
        _ROLE_SOURCE[tensor] = source


def role_source(tensor: torch.Tensor, default: str = "?") -> str:
    """Where the role recorded for ``tensor`` came from (``ROLE_SOURCES``), else ``default``."""
    return _ROLE_SOURCE.get(tensor, default)


def role_of(tensor: torch.Tensor, default: str = "?") -> str:
    """The role recorded for ``tensor`` when it was last routed, else ``default``."""
    return _ROLE_OF.get(tensor, default)


def declare_module_roles(roles: Iterable[tuple[torch.Tensor, str] | tuple[torch.Tensor, str, str]]) -> None:
    """Declare roles found from the model (``find_roles``), optionally with their source, for tensors that will
    reach an optimizer by name only (``shardopt.plugin.wrapped.names_from_trainer``)."""
    for tensor, role, *source in roles:
        _MODULE_ROLES[tensor] = (role, source[0] if source else "type")


def module_role(tensor: torch.Tensor) -> str | None:
    """The role declared for ``tensor`` by ``declare_module_roles``, if any."""
    found = _MODULE_ROLES.get(tensor)
    return found[0] if found else None


def module_role_source(tensor: torch.Tensor) -> str | None:
    """The source of the role declared for ``tensor`` by ``declare_module_roles``, if any."""
    found = _MODULE_ROLES.get(tensor)
    return found[1] if found else None


def _is_embedding(m: nn.Module) -> bool:
    """``nn.Embedding`` and look-alikes (Megatron's ``VocabParallelEmbedding``)."""
    return isinstance(m, nn.Embedding) or (
        type(m).__name__.endswith("Embedding")
        and hasattr(m, "num_embeddings")
        and isinstance(getattr(m, "weight", None), torch.Tensor)
    )


def _is_linear(m: nn.Module) -> bool:
    """``nn.Linear`` and look-alikes (Megatron's ``ColumnParallelLinear`` / ``RowParallelLinear``)."""
    if isinstance(m, nn.Linear):
        return True
    w = getattr(m, "weight", None)
    return "Linear" in type(m).__name__ and isinstance(w, torch.Tensor) and logical_dim(w) == 2


def _is_conv1d(m: nn.Module) -> bool:
    """``transformers.pytorch_utils.Conv1D`` (GPT-2's projections): a Linear whose weight is stored ``in x out``
    (``nf`` output features), so its matrix view is the transpose of a Linear's."""
    w = getattr(m, "weight", None)
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf") and isinstance(w, torch.Tensor) and logical_dim(w) == 2


def _is_conv(m: nn.Module) -> bool:
    """Convolutions (``nn.Conv1d/2d/3d`` and their transposes): their kernels are AdamW's by design."""
    return isinstance(m, nn.modules.conv._ConvNd)


def _router_modules(model: nn.Module) -> set[int]:
    """Ids of the 2-D ``weight`` of router modules that are not Linears (transformers 5's ``MixtralTopKRouter``,
    ``Qwen3MoeTopKRouter``, ...: a module whose type names a router and that scores experts with ``F.linear``)."""
    return {
        id(w)
        for m in model.modules()
        if "Router" in type(m).__name__
        and isinstance(w := getattr(m, "weight", None), torch.Tensor)
        and logical_dim(w) == 2
    }


def _grouped_experts_role(parent: nn.Module, experts: nn.Module, name: str, p: torch.Tensor) -> str | None:
    """torchtitan's ``GroupedExperts``: ``w1_EFD`` / ``w2_EDF`` / ``w3_EFD`` (0.3 and later) name their layout,
    (E, out, in); plain ``w1`` / ``w2`` / ``w3`` were stored in x out by early releases and out x in by later ones,
    told apart by the model dimension (the input size of the router's gate, a sibling Linear scoring
    ``num_experts``). None when the layout cannot be told."""
    if name.endswith(("_EFD", "_EDF")):
        return "matrix"
    count = getattr(experts, "num_experts", None)
    dims = {m.in_features for m in parent.modules() if isinstance(m, nn.Linear) and m.out_features == count}
    w1 = getattr(experts, "w1", None)
    if len(dims) != 1 or not isinstance(w1, torch.Tensor) or logical_dim(w1) != 3:
        return None
    (dim,) = dims
    shape = logical_shape(w1)
    if shape[2] == dim != shape[1]:
        return "matrix"
    if shape[1] == dim != shape[2]:
        return "matrix_transposed"
    return None


def expert_roles(model: nn.Module) -> dict[int, str]:
    """Ids of fused-expert 3-D weights (``(E, m, n)``, ``E`` the module's ``num_experts``) -> their role:
    ``matrix`` (each slice out x in, applied as ``F.linear(x, W[e])``) or ``matrix_transposed`` (in x out)."""
    out: dict[int, str] = {}
    for parent in model.modules():
        for experts in parent.children():
            count = getattr(experts, "num_experts", None)
            batched = [
                (n, p)
                for n, p in own_parameters(model, experts)
                if logical_dim(p) == 3 and isinstance(count, int) and logical_shape(p)[0] == count
            ]
            if not batched:
                continue
            transposed = getattr(experts, "is_transposed", None)
            for n, p in batched:
                if isinstance(transposed, bool):  # transformers 5: @use_experts_implementation(is_transposed=...)
                    out[id(p)] = "matrix_transposed" if transposed else "matrix"
                elif type(experts).__name__ == "GroupedExperts":
                    role = _grouped_experts_role(parent, experts, n, p)
                    if role is not None:
                        out[id(p)] = role
    return out


def _looks_batched(name: str, module: nn.Module | None, shape: tuple[int, ...]) -> bool:
    """A 3-D weight that is probably a batch of matrices (experts): its module counts experts or its name says so,
    and the batch has more than one matrix (a ``(1, N, D)`` position embedding or class token is not one)."""
    named = "expert" in name.lower() or isinstance(getattr(module, "num_experts", None), int)
    return len(shape) == 3 and shape[0] > 1 and named


def unknown_matrices(model: nn.Module) -> dict[str, str]:
    """2-D parameters, and 3-D ones that look like batches of matrices (experts), that get the ``vector`` role
    (AdamW) only because routing does not know their module type: ``{name: module type}`` (a module's own
    parameters, not those of a known Embedding/Linear/Conv1D, router, fused experts or convolution)."""
    known = {id(m.weight) for m in model.modules() if _is_embedding(m) or _is_linear(m) or _is_conv1d(m)}
    known |= _router_modules(model) | set(expert_roles(model))
    out: dict[str, str] = {}
    for mod_name, m in model.named_modules():
        if _is_conv(m):
            continue
        for p_name, p in own_parameters(model, m):
            name = clean_name(f"{mod_name}.{p_name}" if mod_name else p_name)
            if id(p) in known or not p.requires_grad:
                continue
            if logical_dim(p) == 2 or _looks_batched(name, m, logical_shape(p)):
                out[name] = type(m).__name__
    return out


def _routers(model: nn.Module) -> set[int]:
    """Ids of the expert-scoring Linear weights of mixture-of-experts layers: a Linear held by a module whose type
    is a gate or router (DeepSpeed's ``TopKGate.wg``), or a Linear attribute named ``gate`` / ``router`` of a
    module whose type names an MoE block (Mixtral's ``MixtralSparseMoeBlock.gate``)."""
    out: set[int] = set()
    for parent in model.modules():
        kind = type(parent).__name__
        for attr, child in parent.named_children():
            if not _is_linear(child):
                continue
            if kind.endswith(("Gate", "Router")) or (attr in ("gate", "router") and "moe" in kind.lower()):
                out.add(id(child.weight))
    return out


def _out_features(m: nn.Module) -> int | None:
    """Output width of a Linear, Megatron's parallel Linear (``output_size``) or GPT-2's ``Conv1D`` (``nf``)."""
    for attr in ("out_features", "output_size", "nf"):
        if isinstance(getattr(m, attr, None), int):
            return getattr(m, attr)
    return None


#: words of an embedding module's name that mark a table of positions, token types or segments: such a table never
#: defines the vocabulary (a Linear as wide as the positions is not an LM head)
_NOT_VOCAB_WORDS = {
    "pos",
    "position",
    "positions",
    "positional",
    "wpe",
    "type",
    "types",
    "token_type",
    "segment",
    "segments",
    "rel",
    "relative",
    "time",
    "patch",
    "bias",
}


def _is_vocab_table(module_name: str) -> bool:
    """A token embedding by its module's name (``embed_tokens``, ``wte``, ``word_embeddings``), not a positions or
    token-type table (``wpe``, ``embed_positions``, ``token_type_embeddings``); wrappers' prefixes aside."""
    last = clean_name(module_name + ".").rstrip(".").rsplit(".", 1)[-1]
    return not set(re.split(r"[_\-]", last.lower())) & _NOT_VOCAB_WORDS


class RoleTable(NamedTuple):
    """Every trainable parameter's default role (``roles``) and where it came from (``sources``, one of
    ``ROLE_SOURCES``), keyed by name; ``guessed`` lists the warnings of ambiguous guesses, if any."""

    roles: dict[str, str]
    sources: dict[str, str]
    warnings: list[str]


_WARNED_GUESSES: set[str] = set()


def warn_guesses_once(table: RoleTable, stacklevel: int = 3) -> None:
    """One warning per distinct ambiguous guess, per process (every rank warns once)."""
    fresh = [w for w in table.warnings if w not in _WARNED_GUESSES]
    _WARNED_GUESSES.update(fresh)
    if fresh:
        warnings.warn("shardopt routing: " + " ".join(fresh), UserWarning, stacklevel=stacklevel + 1)


def find_roles(model: nn.Module) -> RoleTable:
    """Default roles of ``model``'s parameters: what the model declares first (``declared_roles``: transformers,
    Megatron-core, torchtitan), then module types, and guesses only where nothing is declared.

    The LM head is, in that order: a declared output layer (or none, where the model states it holds none: a
    pipeline stage without ``post_process``, a base model, a classifier whose head is declared); a Linear whose
    weight is an embedding's (tied); else the last 2-D layer of the model when its output width equals a token
    embedding's vocabulary. Only token embeddings define the vocabulary (never positions or token types), a model
    has at most one guessed head, and a Linear followed by other layers is never guessed to be the head (logits
    computed from the embedding's weight, ``F.linear(x, wte.weight)``, leave no Linear as the head). Ambiguous
    structures are described in ``RoleTable.warnings`` (``route`` warns once per process)."""
    from .declared_roles import declared_roles

    params = model_parameters(model)
    names = {id(seen): n for n, seen, _ in params}
    roles: dict[str, str] = {}
    sources: dict[str, str] = {}
    notes: list[str] = []

    def give(tensor_id: int, role: str, source: str) -> None:
        if tensor_id in names:
            roles[names[tensor_id]], sources[names[tensor_id]] = role, source

    declared = declared_roles(model, logical_dim)
    embeddings = [m for m in model.modules() if _is_embedding(m)]
    emb_ids = {id(m.weight) for m in embeddings}
    module_names = {id(m): n for n, m in model.named_modules()}
    linears = [m for m in model.modules() if _is_linear(m)]
    matrices = [m for m in model.modules() if _is_linear(m) or _is_conv1d(m)]
    for m in embeddings:
        give(id(m.weight), "embedding", "declared" if id(m.weight) in declared.embeddings | declared.others else "type")
    routers = _routers(model) | _router_modules(model)
    for m in model.modules():
        w = getattr(m, "weight", None)
        if isinstance(w, torch.Tensor) and id(w) in routers and id(w) in names and names[id(w)] not in roles:
            give(id(w), "router", "type")
    for pid, role in expert_roles(model).items():
        give(pid, role, "type")
    for m in linears:
        if id(m.weight) in names and names[id(m.weight)] not in roles:
            give(id(m.weight), "router" if id(m.weight) in routers else "matrix", "type")
    for m in model.modules():
        if _is_conv1d(m) and id(m.weight) in names and names[id(m.weight)] not in roles:
            give(id(m.weight), "matrix_transposed", "type")
    if declared.states_head:
        for pid in declared.heads:
            give(pid, "lm_head", "declared")
    else:
        tied = [m for m in linears if id(m.weight) in emb_ids]
        if tied:
            give(id(tied[-1].weight), "lm_head", "type")  # a tied weight's single name becomes the head
        else:
            _guess_head(model, embeddings, matrices, routers, module_names, names, give, notes)
    for n, _, _ in params:
        if n not in roles:
            roles[n], sources[n] = "vector", "type"
    return RoleTable(roles, sources, notes)


def _guess_head(
    model: nn.Module,
    embeddings: list[nn.Module],
    matrices: list[nn.Module],
    routers: set[int],
    module_names: Mapping[int, str],
    names: Mapping[int, str],
    give: Any,
    notes: list[str],
) -> None:
    """The LM head of a model that declares none: the last 2-D layer, when it is as wide as a token vocabulary."""
    vocab = {m.num_embeddings for m in embeddings if _is_vocab_table(module_names.get(id(m), ""))}
    layers = [m for m in matrices if id(m.weight) not in routers and id(m.weight) in names]
    wide = [m for m in layers if _out_features(m) in vocab]
    if layers and wide and wide[-1] is layers[-1]:
        give(id(layers[-1].weight), "lm_head", "guessed")
        return
    if wide:
        last = wide[-1]
        name = names[id(last.weight)]
        notes.append(
            f"{name!r} is as wide as the vocabulary ({_out_features(last)}) but other layers follow it, so "
            f"it keeps the role 'matrix' rather than 'lm_head'; if it produces the logits, declare "
            f"routing={{'{name}': 'lm_head'}}."
        )
    tables = [m for m in embeddings if _is_vocab_table(module_names.get(id(m), "")) and id(m.weight) in names]
    if tables and not wide:
        first = names[id(tables[0].weight)]
        notes.append(
            f"no layer produces logits as wide as the vocabulary of {first!r} "
            f"({tables[0].num_embeddings}); if the logits are computed from that embedding's weight (a tied "
            f"head), declare routing={{'{first}': 'lm_head'}}, else nothing gets the LM head's rule."
        )


def param_roles(model: nn.Module) -> dict[str, str]:
    """Default role of every trainable parameter, keyed by its name in ``model.named_parameters()`` (or a declared
    stand-in's, ``model_parameters``): ``find_roles(model).roles``."""
    return find_roles(model).roles


#: module names (the component before ``.weight``) that mark an embedding: ``embed_tokens``, ``wte``, ...
_EMBEDDING_WORDS = {"wte", "wpe", "emb", "embed", "embeds", "embedding", "embeddings"}


def _module_words(name: str) -> set[str]:
    parts = name.split(".")
    module = parts[-2] if len(parts) > 1 else parts[-1]
    return set(re.split(r"[_\-]", module.lower()))


def _is_router_name(name: str, expert_prefixes: AbstractSet[str] = frozenset()) -> bool:
    """A router's weight by name: ``...router.weight``, DeepSpeed's ``...gate.wg.weight``, or ``...gate.weight``
    inside a module path that names an MoE block (``block_sparse_moe.gate.weight``) or beside an ``experts``
    module (``mlp.gate.weight`` next to ``mlp.experts.*``: ``expert_prefixes`` holds those ``mlp.`` prefixes)."""
    parts = name.split(".")
    if len(parts) < 2:
        return False
    module = parts[-2]
    return (
        module == "router"
        or (module == "wg" and parts[-3:-2] == ["gate"])
        or (
            module == "gate"
            and (any("moe" in part.lower() for part in parts[:-2]) or ".".join(parts[:-2]) in expert_prefixes)
        )
    )


def roles_from_names(named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """Default roles from parameter names and shapes alone (``model.named_parameters()`` without the model).

    The name-based counterpart of ``param_roles``: a 2-D weight whose module name is an embedding word
    (``embed_tokens``, ``tok_embeddings``, ``wte``, ``wpe``, ...) is an ``embedding``; the LM head is the 2-D
    weight of a module named ``lm_head``, else the last other 2-D weight whose first dimension equals an
    embedding's vocabulary size; other 2-D tensors are ``matrix``, the rest ``vector``. Tied weights are not
    visible in names (``named_parameters()`` lists them once, as the embedding): pass the model to
    ``create_optimizer`` for a tied head.
    """
    roles: dict[str, str] = {}
    vocab = set()
    for name, p in named:
        if logical_dim(p) == 2 and _module_words(name) & _EMBEDDING_WORDS:
            roles[name] = "embedding"
            vocab.add(logical_shape(p)[0])
    expert_prefixes = {name.split(".experts.")[0] for name, _ in named if ".experts." in name}
    for name, p in named:
        if logical_dim(p) == 2 and _is_router_name(name, expert_prefixes):
            roles[name] = "router"
    matrices = [(name, p) for name, p in named if logical_dim(p) == 2 and name not in roles]
    heads = [name for name, _ in matrices if "lm_head" in name.split(".")[-2:-1]]
    if not heads:
        heads = [name for name, p in matrices if logical_shape(p)[0] in vocab]
    for name, _ in matrices:
        roles[name] = "matrix"
    if heads:
        roles[heads[-1]] = "lm_head"
    for name, _ in named:
        roles.setdefault(name, "vector")
    return roles


def unnamed_roles(tensors: Sequence[torch.Tensor]) -> list[str]:
    """Roles of tensors passed without names: ``matrix`` for 2-D, ``vector`` otherwise (no embedding or LM
    head can be told apart without names)."""
    return ["matrix" if logical_dim(t) == 2 else "vector" for t in tensors]


_SET_ERROR = (
    "optimizer parameters need to be organized in ordered collections, but the ordering of tensors "
    "in sets will change between runs. Please use a list instead."
)


def named_or_unnamed(items: Any, where: str = "params") -> tuple[list[torch.Tensor], list[str] | None]:
    """Split torch.optim's parameter forms: tensors, or ``(name, tensor)`` pairs as ``named_parameters()``
    yields them (all or none named). Returns the tensors and their names (``None`` when unnamed), raising
    torch's ``TypeError`` / ``ValueError`` for a set, a bare tensor or a mix."""
    if isinstance(items, torch.Tensor):
        raise TypeError(
            "params argument given to the optimizer should be an iterable of Tensors or dicts, but got "
            + torch.typename(items)
        )
    if isinstance(items, (set, frozenset)):
        raise TypeError(_SET_ERROR)
    tensors: list[torch.Tensor] = []
    names: list[str] = []
    for item in items:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            names.append(item[0])
            item = item[1]
        if not isinstance(item, torch.Tensor):
            raise TypeError(f"optimizer can only optimize Tensors, but one of the {where} is " + torch.typename(item))
        tensors.append(item)
    if names and len(names) != len(tensors):
        raise ValueError("all optimizer params should be with/without names. Some param names are missing")
    return tensors, (names if names else None)


_WARNED: set[str] = set()


def warn_unnamed_once(who: str, treatment: str, stacklevel: int = 2) -> None:
    """Warn once per optimizer that parameters without names cannot get embedding / LM-head roles."""
    if who in _WARNED:
        return
    _WARNED.add(who)
    warnings.warn(
        f"{who}: parameters were given without names, so every 2-D tensor gets the {treatment!r} rule "
        "and everything else AdamW; embedding and LM-head roles need names: pass "
        "model.named_parameters() or the model to shardopt.create_optimizer, or call "
        "shardopt.register_model(model) before the optimizers are built (configs that pass bare tensors, one "
        "optimizer per parameter: docs/guides/trainers.md)",
        UserWarning,
        stacklevel=stacklevel + 1,
    )


def name_sources(roles: Mapping[str, str]) -> dict[str, str]:
    """Sources of roles found from names alone: embeddings, heads and routers are guesses; matrices and vectors
    follow from the shapes."""
    return {n: "guessed" if r in ("embedding", "lm_head", "router") else "type" for n, r in roles.items()}


def _named_params_and_roles(model: Any, optimizer_name: str) -> tuple[list[tuple[str, torch.Tensor]], RoleTable, str]:
    """``(name, tensor)`` pairs, their roles and sources, and where the names come from: ``"module"``, ``"torch"``
    (the user's ``named_parameters()``, kept as torch's ``param_names``) or ``"position"``."""
    if isinstance(model, nn.Module):
        table = find_roles(model)
        table = RoleTable(
            {clean_name(n): r for n, r in table.roles.items()},
            {clean_name(n): r for n, r in table.sources.items()},
            table.warnings,
        )
        return [(clean_name(n), stepped) for n, _, stepped in model_parameters(model)], table, "module"
    # bare tensors of a known model get its names and declared roles (hooks.param_sources: shardopt.register_model)
    tensors, names = named_or_unnamed(apply_param_sources(model, optimizer_name))
    if not tensors:
        raise ValueError("optimizer got an empty parameter list")
    if names is not None:
        named = list(zip(names, tensors))
        roles = roles_from_names(named)
        sources = name_sources(roles)
        for n, t in named:
            declared = _MODULE_ROLES.get(t)
            if declared is not None:
                roles[n], sources[n] = declared
        return named, RoleTable(roles, sources, []), "torch"
    named = [(f"param_{i}", t) for i, t in enumerate(tensors)]
    if len({logical_dim(t) == 2 for t in tensors}) > 1:  # a model's list (matrices and vectors), not a list of matrices
        warn_unnamed_once(optimizer_name, "matrix", stacklevel=5)  # the caller of create_optimizer
    roles = {n: r for (n, _), r in zip(named, unnamed_roles(tensors))}
    return named, RoleTable(roles, {n: "type" for n in roles}, []), "position"


def warn_unknown_matrices(model: nn.Module, overrides: Mapping[str, str], optimizer_name: str) -> None:
    """Warn, naming each, about 2-D and 3-D parameters sent to AdamW only because their module type is unknown (a
    routing pattern that matches one is a declaration, so it is not named)."""
    unknown = {
        n: t for n, t in unknown_matrices(model).items() if not any(fnmatch.fnmatchcase(n, pat) for pat in overrides)
    }
    _warn_unknown(unknown, optimizer_name, stacklevel=5)


def warn_unknown_batches(
    named: Sequence[tuple[str, torch.Tensor]],
    roles: Mapping[str, str],
    overrides: Mapping[str, str],
    optimizer_name: str,
    stacklevel: int = 4,
) -> None:
    """Without the model (names only), a 3-D parameter's layout cannot be told (transformers' fused experts are
    stored out x in, GPT-OSS's in x out): warn, naming each that goes to AdamW for that reason."""
    unknown = {
        n: "name only"
        for n, p in named
        if _looks_batched(n, None, logical_shape(p))
        and p.requires_grad
        and roles.get(n) == "vector"
        and not any(fnmatch.fnmatchcase(n, pat) for pat in overrides)
    }
    _warn_unknown(unknown, optimizer_name, stacklevel=stacklevel + 1)


def _warn_unknown(unknown: Mapping[str, str], optimizer_name: str, stacklevel: int) -> None:
    if unknown:
        listed = ", ".join(f"{n} ({t})" for n, t in unknown.items())
        warnings.warn(
            f"{optimizer_name}: these parameters go to AdamW only because shardopt's routing does not know "
            f"their layout: {listed}; declare each with routing={{pattern: 'matrix' | "
            "'matrix_transposed' | 'adamw'}} ('matrix' for out x in storage, 'matrix_transposed' for "
            "in x out; a 3-D (E, m, n) weight is E such matrices, e.g. fused MoE experts)",
            UserWarning,
            stacklevel=stacklevel,
        )


def route(
    model: nn.Module | Iterable[Any],
    role_table: Mapping[str, dict],
    overrides: Mapping[str, str] | None = None,
    optimizer_name: str = "optimizer",
    unused: list[str] | None = None,
    roles: Mapping[str, str] | RoleTable | None = None,
) -> list[dict]:
    """Param groups (one per distinct option set, in a fixed order) for ``model``'s trainable parameters.

    ``unused``: a list that receives the routing patterns no parameter matched, instead of the error (a
    pipeline stage holds part of the model: a pattern must match on some stage, not on each). ``roles``: default
    roles found elsewhere, by parameter name, over those found from ``model`` (a pipeline stage's parameters get
    the roles they have in the whole model, ``plugin.deepspeed_engine.pipeline_roles``).

    ``model`` is a module (groups carry its parameter names as torch's ``param_names``), or what torch.optim
    takes: ``model.named_parameters()`` (roles from names; groups keep torch's ``param_names``) or a flat list of
    tensors (2-D -> ``matrix``, else ``vector``; a registered model's get its names, ``shardopt.register_model``).
    ``role_table[role]`` gives the group options for that role (must contain ``treatment``). Raises a
    ``ValueError`` naming the parameter, its shape and the rule when a non-2-D tensor would reach a matrix rule.
    """
    named, found, source = _named_params_and_roles(model, optimizer_name)
    given = roles if isinstance(roles, RoleTable) else RoleTable(dict(roles or {}), {}, [])
    sources = {**found.sources, **{n: given.sources.get(n, "declared") for n in given.roles if n in found.roles}}
    roles = {**found.roles, **{n: r for n, r in given.roles.items() if n in found.roles}}
    # an engine's roles of the whole model (a pipeline stage's) come with the whole model's warnings
    warn_guesses_once(given if given.roles else found, stacklevel=2)
    overrides = dict(overrides or {})
    for pattern, role in overrides.items():
        if role not in ROLES:
            raise RoutingError(f"routing[{pattern!r}] = {role!r}: unknown role; use one of {list(ROLES)}")
    if isinstance(model, nn.Module):
        warn_unknown_matrices(model, overrides, optimizer_name)
    else:
        warn_unknown_batches(named, roles, overrides, optimizer_name)
    used = set()
    groups: dict[tuple, dict] = {}
    for name, p in named:
        if not p.requires_grad:
            continue
        role, why, origin = roles[name], "default routing", sources.get(name, "type")
        for pattern, target in overrides.items():
            if fnmatch.fnmatchcase(name, pattern):
                role, why, origin = target, f"routing pattern {pattern!r}", "routing"
                used.add(pattern)
                break
        if role == "adamw":
            options = {"treatment": "adamw"}
        elif role not in role_table:  # a role table of one's own without matrix_transposed (built-in ones have it)
            raise RoutingError(
                f"parameter {name!r} of shape {logical_shape(p)} is stored in x out (role {role!r}, by {why}), and "
                f"{optimizer_name}'s role table has no 'matrix_transposed' entry (the built-in ones give the matrix "
                f"rule with 'transposed': True, shardopt.optim.transposed); add one, or route it explicitly: "
                f"routing={{'{name}': 'adamw'}}"
            )
        else:
            options = dict(role_table[role])
        if options["treatment"] != "adamw" and logical_dim(p) not in (2, 3):
            raise RoutingError(
                f"parameter {name!r} of shape {logical_shape(p)} is routed to {optimizer_name}'s "
                f"{options['treatment']!r} rule by {why} (role {role!r}), which needs a 2-D matrix (or a 3-D "
                f"(E, m, n) batch of E matrices); route it to AdamW with routing={{'{name}': 'adamw'}}"
            )
        key = tuple(sorted(options.items()))
        group = groups.setdefault(key, {**options, "params": [], "names": [], "roles": []})
        if role not in group["roles"]:
            group["roles"].append(role)
        group["params"].append(p)
        group["names"].append(name)
        if source != "position":  # names a user or the model gave: torch's key, so state dicts carry them
            group.setdefault("param_names", []).append(name)  # (FQN-keyed flat state: torchtitan, DCP)
        record_role(p, role, origin)  # for describe(): the role that chose this parameter's rule, and its source
    missing = [p for p in overrides if p not in used]
    if unused is not None:
        unused.extend(missing)
    elif missing:
        raise RoutingError(f"routing patterns {missing} match no trainable parameter of the model")
    return list(groups.values())


#: group options that tell rules apart in the table (the rest are hyperparameters shared by the group)
_SHOWN = ("norm_dim", "momentum")


def _rule(group: Mapping[str, Any]) -> str:
    extra = " ".join(f"{k}={group[k]}" for k in _SHOWN if k in group and group["treatment"] != "adamw")
    return f"{group['treatment']} {extra}".strip()


#: the table's columns; ``from`` is where the role came from (``ROLE_SOURCES``; ``?`` where nothing recorded it)
COLUMNS = ("parameter", "shape", "role", "from", "rule")


def describe_row(name: str, shape: Sequence[int], role: str, source: str, group: Mapping[str, Any]) -> tuple[str, ...]:
    """One row of the table: a parameter's logical shape, role, the role's source and its group's rule."""
    return (name, "x".join(str(s) for s in shape) or "scalar", role, source, _rule(group))


def format_table(rows: Iterable[Sequence[str]]) -> str:
    """``COLUMNS`` over ``rows``, each column padded to its widest cell (whitespace-separated: the rule, last,
    may hold spaces)."""
    rows = [tuple(COLUMNS), *(tuple(r) for r in rows)]
    widths = [max(len(r[c]) for r in rows) for c in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def describe_groups(groups: Iterable[Mapping[str, Any]], names: Mapping[int, str] | None = None) -> str:
    """The table for param groups of real parameters (as routing built them, or an optimizer's)."""
    rows = []
    for g in groups:
        for i, p in enumerate(g["params"]):
            name = (
                (g.get("names") or g.get("param_names") or [None] * len(g["params"]))[i]
                or (names or {}).get(id(p))
                or "?"
            )
            rows.append(describe_row(name, logical_shape(p), role_of(p), role_source(p), g))
    return format_table(rows)
