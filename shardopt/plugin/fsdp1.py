"""Legacy FSDP (``torch.distributed.fsdp.FullyShardedDataParallel``, "FSDP1") adapter.

With ``use_orig_params=True`` (the setting of accelerate's and the Hugging Face Trainer's FSDP1 paths) each original
parameter stays the module's ``nn.Parameter`` but holds a 1-D view of its elements in this rank's shard of a
``FlatParameter``: the parameters of a wrapped module concatenated (each padded to FSDP's alignment), the whole
padded to a multiple of the shard group's size and cut into equal chunks, one per rank. That is the ZeRO-3 layout
shardopt already reads: a parameter's piece on rank ``r`` is the part of its range that falls in chunk ``r``
(``zero_layouts.flat_pieces``), so every statistic is exact and state keeps its logical meaning. Nothing is
gathered: the handle's metadata (``_numels_with_padding``, ``_is_padding_mask``, ``_shapes``) says it all.

``inspect_model`` (a ``hooks.model_inspectors`` entry, run before routing) declares each original parameter's shape
(``routing.declare_logical_shape``) and layout; ``watch_model`` (a ``hooks.model_watchers`` entry) hands the
optimizer the resolver. Sharding strategies: FULL_SHARD and SHARD_GRAD_OP (shard group: FSDP's process group),
HYBRID_SHARD and _HYBRID_SHARD_ZERO2 (the intra-node shard group; replicas reduce apart, as HSDP's), NO_SHARD (whole).

``use_orig_params=False`` (FSDP1's default) hands an optimizer ``FlatParameter``s that mix matrices, vectors and
embeddings in one tensor, which no single rule can step. The adapter stands one view in for each original parameter
(``routing.declare_stand_ins``): a 1-D ``nn.Parameter`` aliasing that parameter's elements in this rank's flat shard
(its real shape under NO_SHARD), laid out like a ``use_orig_params=True`` view. Routing reads roles from the original
modules and names, so each view gets its own rule; before every step a view's gradient is the matching slice of the
flat gradient (``sync_flat_views``), and ``zero_grad`` clears the flat gradients too (``clear_flat_grads``), as for
the tensors the user sees. Checkpoints carry the original names, so either setting resumes the other's.
Parameters of an FSDP1 model that reach an optimizer without the model (``model.parameters()``) are refused, since
their shapes are gone.
"""

from __future__ import annotations

import math
import sys
import weakref
from types import FrameType
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

if TYPE_CHECKING:
    from torch.distributed.fsdp._flat_param import FlatParameter

from ..optim.hooks import (
    register_model_inspector,
    register_model_watcher,
    register_param_source,
    register_pre_step_check,
    register_zero_grad_hook,
)
from ..optim.routing import StandIn, declare_logical_shape, declare_stand_ins, forget_stand_ins
from ..sharding.discover import layout_of, matrix_shape
from ..sharding.layout import MatrixLayout
from .zero_layouts import flat_pieces

__all__ = [
    "inspect_model",
    "watch_model",
    "adopt",
    "fsdp1_layout",
    "refuse_unknown_flattened",
    "sync_flat_views",
    "clear_flat_grads",
    "ensure_layouts",
    "drop_view_grads",
    "refuse_fsdp1_optim_state_dict",
    "FSDP1Error",
]

#: each original parameter of an FSDP1 module that ``inspect_model`` described -> its layout
_LAYOUTS: WeakIdKeyDictionary = WeakIdKeyDictionary()
#: ... -> (a weak reference to its flat parameter, its index among the flat parameter's original parameters); weak,
#: since the flat parameter holds the original (``_params``): a strong one would keep both alive for ever
_FLAT_OF: WeakIdKeyDictionary = WeakIdKeyDictionary()
#: each view standing in for an original parameter under use_orig_params=False -> _FlatView
_VIEWS: WeakIdKeyDictionary = WeakIdKeyDictionary()
#: a flat parameter (use_orig_params=False) -> its views, so that inspecting a model again reuses them
_VIEWS_OF: WeakIdKeyDictionary = WeakIdKeyDictionary()


class _FlatView(NamedTuple):
    """Where a stand-in view lives: the local shard ``[lo, hi)`` of the flat parameter ``ref`` refers to (weakly: the
    flat parameter keys ``_VIEWS_OF``, whose value holds the view), viewed as ``shape`` (None: 1-D)."""

    ref: Any
    lo: int
    hi: int
    shape: tuple[int, ...] | None

    @property
    def flat(self) -> torch.Tensor | None:
        return self.ref()

    def of(self, t: torch.Tensor) -> torch.Tensor:
        piece = t[self.lo : self.hi]
        return piece.view(self.shape) if self.shape is not None else piece


class FSDP1Error(NotImplementedError):
    """A legacy FSDP layout shardopt cannot describe (flat parameters, or parameters without their model)."""


_FIX = (
    "wrap with FullyShardedDataParallel(..., use_orig_params=True) (accelerate: fsdp_use_orig_params: true; HF "
    "Trainer: fsdp_config={'use_orig_params': True}) and pass the wrapped model to shardopt.create_optimizer, or "
    "use FSDP2 (torch.distributed.fsdp.fully_shard)"
)


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:  # pragma: no cover - torch without distributed
        return []
    return [m for m in model.modules() if isinstance(m, FSDP)]


def _shard_group(handle: Any) -> tuple[int, int, Any]:
    """(world, rank, group) the handle's flat parameter is sharded over (1, 0, None without sharding)."""
    if not handle.uses_sharded_strategy:
        return 1, 0, None
    return handle.world_size, handle.rank, handle.process_group


def _originals(flat: FlatParameter, world: int, chunk: int) -> list[tuple[tuple[int, ...], int, list | None]]:
    """``(shape, offset, pieces)`` of each original parameter of ``flat``, in its order: where it starts in the
    unsharded flat parameter (padding skipped) and every rank's piece of it (``flat_pieces``; None unsharded)."""
    out, offset, real = [], 0, 0
    for numel, padding in zip(flat._numels_with_padding, flat._is_padding_mask):
        numel = int(numel)
        if not padding:
            out.append(
                (tuple(flat._shapes[real]), offset, flat_pieces(offset, numel, chunk, world) if world > 1 else None)
            )
            real += 1
        offset += numel
    return out


def inspect_model(model: nn.Module) -> None:
    """Declare the shape and layout of every original parameter of ``model``'s FSDP1 modules; under
    ``use_orig_params=False`` stand a view in for each (``_flat_views``)."""
    prefixes = {id(m): n for n, m in model.named_modules()}
    for module in _fsdp_modules(model):
        handle = getattr(module, "_handle", None)
        if handle is None:  # a wrapper without parameters of its own
            continue
        flat = handle.flat_param
        world, rank, group = _shard_group(handle)
        chunk = -(-sum(int(n) for n in flat._numels_with_padding) // world)
        originals = _originals(flat, world, chunk)
        views = None if handle._use_orig_params else _flat_views(model, module, prefixes, flat, originals, rank, chunk)
        for index, (shape, _, pieces) in enumerate(originals):
            param = flat._params[index] if views is None else views[index]
            declare_logical_shape(param, shape)
            _LAYOUTS[param] = (
                MatrixLayout(matrix_shape(shape), pieces, rank, group)
                if pieces is not None
                else MatrixLayout.whole(matrix_shape(shape))
            )
            _FLAT_OF[param] = (weakref.ref(flat), index)


def _flat_views(
    model: nn.Module,
    module: nn.Module,
    prefixes: dict[int, str],
    flat: FlatParameter,
    originals: list,
    rank: int,
    chunk: int,
) -> list[torch.Tensor]:
    """One view per original parameter of ``flat`` (use_orig_params=False), declared to routing as stand-ins: a
    1-D ``nn.Parameter`` aliasing its elements in this rank's shard (its piece of the layout, empty where the rank
    holds none), or the whole parameter in its shape when the flat parameter is not sharded."""
    views = _VIEWS_OF.get(flat)
    if views is None:
        views = []
        for shape, offset, pieces in originals:
            if pieces is None:
                where = _FlatView(weakref.ref(flat), offset, offset + math.prod(shape), shape)
            else:  # the layout's piece, moved into this rank's shard
                start = offset - rank * chunk
                where = _FlatView(
                    weakref.ref(flat),
                    min(max(start + pieces[rank].lo, 0), chunk),
                    min(max(start + pieces[rank].hi, 0), chunk),
                    None,
                )
            view = nn.Parameter(where.of(flat.data), requires_grad=flat.requires_grad)
            _VIEWS[view] = where
            views.append(view)
        _VIEWS_OF[flat] = views
    prefix = prefixes[id(module)]
    stand_ins = [
        StandIn(
            f"{prefix}.{fqn}" if prefix else fqn,
            info.module,
            info.param_name,
            getattr(info.module, info.param_name, None),
            view,
        )
        for fqn, info, view in zip(flat._fqns, flat._param_infos, views)
    ]
    declare_stand_ins(model, flat, stand_ins)
    return views


def fsdp1_layout(p: torch.Tensor) -> MatrixLayout:
    """The layout of an FSDP1 original parameter, else ``sharding.discover.layout_of``'s."""
    layout = _LAYOUTS.get(p)
    return layout if layout is not None else layout_of(p)


def watch_model(model: Any, optimizer: Any) -> None:
    """After ``create_optimizer`` built ``optimizer`` for an FSDP1 model: the optimizer reads its layouts."""
    if isinstance(model, nn.Module) and _fsdp_modules(model) and hasattr(optimizer, "use_layouts"):
        optimizer.use_layouts(resolver=fsdp1_layout)
        if not getattr(optimizer, "_fsdp1_hooked", False):
            optimizer.register_state_dict_pre_hook(refuse_fsdp1_optim_state_dict)
            if any(p in _VIEWS for g in optimizer.param_groups for p in g["params"]):
                optimizer.register_step_post_hook(drop_view_grads)
            optimizer._fsdp1_hooked = True


def adopt(models: Any, optimizer: Any) -> None:
    """An optimizer built on the models before FSDP1 wrapped them (accelerate's ``prepare(model, ..., optimizer)``).
    Under ``use_orig_params=True`` it steps the same ``nn.Parameter`` objects, which now hold 1-D views of flat shards:
    their shapes and layouts are declared and the optimizer reads them. Under ``use_orig_params=False`` it holds
    parameters no prepared model uses any more (FSDP replaced them by flat parameters): refused on every rank, naming
    the fix. ``models``: every model prepared with the optimizer (one may be another's teacher)."""
    models = [m for m in (models if isinstance(models, (list, tuple)) else [models]) if isinstance(m, nn.Module)]
    wrapped = [m for m in models if _fsdp_modules(m)]
    if not wrapped or not hasattr(optimizer, "use_layouts"):
        return
    for model in wrapped:
        inspect_model(model)
        forget_stand_ins(model)  # nothing is routed here
    known = {id(p) for m in models for p in m.parameters()}
    stepped = [p for g in optimizer.param_groups for p in g["params"]]
    for p in stepped:
        if id(p) not in known and p not in _VIEWS:
            raise FSDP1Error(
                f"shardopt: {type(optimizer).__name__} holds a tensor of shape {tuple(p.shape)} that is not a "
                f"parameter of the models prepared with it: with use_orig_params=False FullyShardedDataParallel "
                f"replaces the model's parameters by flat parameters mixing matrices and vectors, so an optimizer "
                f"built before wrapping steps tensors the model no longer uses. Build the optimizer after wrapping, "
                f"from the wrapped model: shardopt.create_optimizer(fsdp_model, ...). Or: {_FIX}"
            )
    ids = {id(p) for p in stepped}
    for model in wrapped:
        if any(id(p) in ids for p in model.parameters()):
            watch_model(model, optimizer)


def drop_view_grads(optimizer: Any, args: Any = None, kwargs: Any = None) -> None:
    """After a step (a ``register_step_post_hook``): the stand-in views' gradients, slices of the flat gradients
    taken before the step, are dropped, so that nothing reads a stale one (the Trainer zeroes the model's flat
    gradients, not the optimizer's) and no old flat gradient stays alive through the next backward."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p in _VIEWS:
                p.grad = None


#: where legacy FSDP's optimizer state dict API runs: ``FSDP.optim_state_dict`` and DCP's ``get_state_dict`` (which
#: calls it for FSDP1 modules)
_FSDP1_STATE_DICT_CALLERS = (
    ("fsdp/fully_sharded_data_parallel.py", "optim_state_dict"),
    ("checkpoint/state_dict.py", "_get_optim_state_dict"),
)


def refuse_fsdp1_optim_state_dict(optimizer: Any) -> None:
    """``optimizer.state_dict()`` pre-hook: legacy FSDP's optimizer state dict API (``FSDP.optim_state_dict``,
    ``FSDP.state_dict_type`` checkpoints, DCP ``get_state_dict``) reshapes every state tensor like its parameter's
    flat shard, which shardopt's row, column and low-rank state is not: it would fail deep inside FSDP or write a
    wrong file. Refuse it by name, pointing at shardopt's logical checkpoints (which reshard to FSDP2 and ZeRO)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if any(
            code.co_filename.replace("\\", "/").endswith(f) and code.co_name == fn
            for f, fn in _FSDP1_STATE_DICT_CALLERS
        ):
            raise FSDP1Error(
                f"shardopt: {code.co_name} (legacy FSDP's optimizer state dict, also under FSDP.state_dict_type and "
                f"torch.distributed.checkpoint's get_state_dict) reshapes optimizer state like flat parameter shards, "
                f"which {type(optimizer).__name__}'s matrix state is not. Save the optimizer with "
                f"shardopt.checkpoint.save(path, optimizer, engine='fsdp1') and load it with "
                f"shardopt.checkpoint.load(path, optimizer) (any world size; FSDP2 and DeepSpeed load it too); save "
                f"the model with FSDP.state_dict_type as before"
            )
        frame = frame.f_back


def fill_empty_grads(optimizer: Any) -> None:
    """Before a step: an original parameter of which this rank holds no element has a ``None`` gradient under FSDP1
    (its holders have one), so a rule would skip the statistics every other engine's ranks update alike (FSDP2 and
    ZeRO hand empty shards empty gradients), and a checkpoint could record the stale values of the rank that owns
    a split index. Such a parameter gets an empty zero gradient where its flat parameter has a gradient and FSDP
    did not mark the original's gradient as absent (``_is_grad_none_mask``)."""
    if not _FLAT_OF:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            found = _FLAT_OF.get(p) if p.grad is None and p.numel() == 0 else None
            if found is None:
                continue
            flat, index = found[0](), found[1]
            if flat is None:
                continue
            absent = getattr(flat, "_is_grad_none_mask", None)
            if flat.grad is not None and not (absent and absent[index]):
                p.grad = torch.zeros_like(p)


def ensure_layouts(optimizer: Any) -> None:
    """Before a step: an optimizer stepping FSDP1's views whose layouts it was not given (built by a path that did
    not pass through ``watch_model``) reads them now, rather than normalizing each rank's piece as if it were the
    matrix."""
    if (
        not _LAYOUTS
        or getattr(optimizer, "_layout_resolver", fsdp1_layout) is fsdp1_layout
        or not hasattr(optimizer, "use_layouts")
    ):
        return
    if any(p in _LAYOUTS for g in optimizer.param_groups for p in g["params"]):
        optimizer.use_layouts(resolver=fsdp1_layout)


def sync_flat_views(optimizer: Any) -> None:
    """Before a step: each stand-in view (use_orig_params=False) aliases its elements of the flat parameter's
    current local shard (FSDP may give the flat parameter new storage, e.g. when it reloads a state dict) and its
    gradient is the matching slice of the flat gradient (None where the flat parameter has none)."""
    if not _VIEWS:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            where = _VIEWS.get(p)
            flat = where.flat if where is not None else None
            if flat is None:
                continue
            data = where.of(flat.data)
            if p.data.data_ptr() != data.data_ptr() or p.data.shape != data.shape:
                p.data = data
            if flat.grad is None:
                p.grad = None
            else:
                if flat.grad.numel() != flat.numel():
                    raise FSDP1Error(
                        f"shardopt: a step inside FullyShardedDataParallel.no_sync() (the flat gradient "
                        f"holds {flat.grad.numel()} elements, the shard {flat.numel()}): step after the "
                        "synchronizing backward"
                    )
                grad = where.of(flat.grad)
                p.grad = grad if grad.dtype == p.dtype else grad.to(p.dtype)  # keep_low_precision_grads


def clear_flat_grads(optimizer: Any, set_to_none: bool) -> None:
    """``optimizer.zero_grad()`` also clears the gradients of the flat parameters its views stand in for: FSDP
    accumulates a backward into a flat gradient left in place."""
    if not _VIEWS:
        return
    flats = {
        id(f): f
        for g in optimizer.param_groups
        for p in g["params"]
        if (w := _VIEWS.get(p)) is not None and (f := w.flat) is not None
    }
    for flat in flats.values():
        if flat.grad is None:
            continue
        if set_to_none:
            flat.grad = None
        else:
            flat.grad.zero_()


def refuse_unknown_flattened(params: Any, who: str) -> Any:
    """A constructor given FSDP1's flattened tensors without the model (``model.parameters()``): their matrices'
    shapes are gone, so they would be stepped as vectors (AdamW) silently; refuse, naming the fix."""
    if hasattr(params, "__next__"):  # a generator (model.parameters()) is read once: hand the constructor a list
        params = list(params)
    if not isinstance(params, (list, tuple)):  # a set, a tensor, ...: the constructor's own errors apply
        return params
    items = params
    for item in items:
        tensors = item.get("params", []) if isinstance(item, dict) else [item]
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        for t in tensors:
            t = t[1] if isinstance(t, tuple) and len(t) == 2 else t
            if isinstance(t, torch.Tensor) and getattr(t, "_fsdp_flattened", False) and t not in _LAYOUTS:
                raise FSDP1Error(
                    f"{who}: given a parameter flattened by FullyShardedDataParallel (shape "
                    f"{tuple(t.shape)}) without its model, so its matrix shape is unknown. Pass the "
                    f"wrapped model: shardopt.create_optimizer(fsdp_model, ...). Or: {_FIX}"
                )
    return params


register_model_inspector(inspect_model)
register_model_watcher(watch_model)
register_param_source(refuse_unknown_flattened)
register_pre_step_check(ensure_layouts)
register_pre_step_check(sync_flat_views)
register_pre_step_check(fill_empty_grads)
register_zero_grad_hook(clear_flat_grads)
