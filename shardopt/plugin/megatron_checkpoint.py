"""shardopt's state in Megatron-core's distributed checkpoints, in model space.

Megatron's ``dist_checkpointing`` stores tensors on regular grids (each rank's chunk a block of a grid over the
global tensor), which a distributed optimizer's flat pieces are not. So, as Megatron's own ``fully_reshardable``
format does for Adam, a parameter's element-wise state (and its fp32 main values) is saved as the parameter's
tensor-parallel shard: the data-parallel peers' pieces are gathered (one metadata and one data all-gather per data-
parallel group, not per parameter) and the result takes the model's own sharded key and replica id
(``optimizer.shardopt.<entry>.<model key>``), so one replica writes it and any data-parallel size reads it. Per-row,
per-column and small per-matrix state is whole after ``local_records``' reduction (``optimizer.shardopt.whole.
<name>::<entry>``, written by one rank). Loading reads them back through a ``checkpoint.logical`` source, so every
state kind lands exactly as ``shardopt.checkpoint.load`` would place it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint.logical import PARAM_KEY, SEP, import_from, local_records
from ..sharding.layout import Piece, put_piece, take_piece

__all__ = ["model_space_state", "load_model_space", "PREFIX"]

PREFIX = "optimizer.shardopt"


def _tp_origin(p: torch.Tensor, view: tuple[int, int]) -> tuple[int, int, tuple[int, int]]:
    """Where parameter ``p``'s tensor-parallel shard starts in the logical 2-D ``view`` and its own 2-D view."""
    m, n = view
    if not getattr(p, "tensor_model_parallel", False):
        return 0, 0, (m, n)
    from megatron.core import parallel_state as ps

    t, world = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    if int(p.partition_dim) == 0 or p.dim() == 1:  # type: ignore[attr-defined]  # set by Megatron's TP layers
        rows = m // world
        return t * rows, 0, (rows, n)
    cols = n // world
    return 0, t * cols, (m, cols)


def _materialize(wrapper: Any) -> None:
    """Give a fresh optimizer its state entries (what a load fills): one step with zero gradients at lr 0, which
    changes no parameter (zero gradients make no NaN, and ``p - 0 * u`` is ``p``)."""
    opt = wrapper.optimizer
    fresh = torch.tensor(
        [0.0 if any(opt.state.get(t) for t in opt.stepped_tensors()) else 1.0], device=_device_of(wrapper)
    )
    dist.all_reduce(fresh, op=dist.ReduceOp.MAX)  # every rank takes the step, or none (it is collective)
    if not fresh.item():
        return
    saved = []
    for t in opt.stepped_tensors():
        saved.append((t, t.grad))
        t.grad = torch.zeros_like(t)
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    try:
        opt.step()
    finally:
        for g, lr in zip(opt.param_groups, lrs):
            g["lr"] = lr
        for t, grad in saved:
            t.grad = grad


def _dp_group(wrapper: Any, param: torch.Tensor) -> Any:
    gbuf, _, _ = wrapper.model_param_gbuf_map[param] if param in wrapper.model_param_gbuf_map else (None, None, None)
    if gbuf is not None:
        return wrapper.buffers[gbuf].data_parallel_group
    return wrapper.buffers[0].data_parallel_group


def _model_keys(model_sharded_state_dict: dict) -> dict[int, Any]:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    tensors, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    return {id(sh.data): sh for sh in nested_values(tensors)}


def _entries(wrapper: Any, with_data: bool) -> tuple[list, list]:
    """This rank's element entries ``[(key, tensor-parallel shard)]`` and whole entries ``[(key, replica id, shape,
    tensor)]`` (replica id 0 on the one rank that writes it)."""
    opt = wrapper.optimizer
    records = local_records(opt, include_params=True)
    elements = [r for r in records if r.kind == "elements"]
    whole = [r for r in records if r.kind != "elements"]
    # split small state (a share of a per-matrix tensor): whole again, from every rank's shares (small by design)
    split = [
        (r.key, r.kind, r.shape, r.view, r.piece, r.data.detach().float().cpu())
        for r in whole
        if r.kind == "matrix" and tuple(r.data.shape) != () and r.data.numel() != math.prod(r.shape or (1,))
    ]
    # and who holds which whole entry: the lowest global rank holding one writes it (per-matrix state may live on
    # its owner rank only)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (split, sorted({r.key for r in whole})))
    writer: dict[str, int] = {}
    for rank, (_, keys) in enumerate(gathered):
        for key in keys:
            writer.setdefault(key, rank)
    assembled: dict[str, torch.Tensor] = {}
    for part, _ in gathered:
        for key, _, _shape, view, piece, data in part:
            put_piece(assembled.setdefault(key, torch.zeros(view)), piece, data, view)
    whole_out = []
    seen = set()
    for r in whole:
        if r.key in seen:
            continue
        seen.add(r.key)
        data = assembled[r.key].view(r.shape) if r.key in assembled else r.data.detach().float().cpu().view(r.shape)
        whole_out.append((r.key, 0 if writer[r.key] == dist.get_rank() else 1, tuple(r.shape), data))
    # element-wise entries: each parameter's tensor-parallel shard from its data-parallel peers' pieces
    by_group: dict[int, tuple[Any, list]] = {}
    for r in elements:
        p = wrapper.param_of[r.key.split(SEP)[0]]
        group = _dp_group(wrapper, p)
        by_group.setdefault(id(group), (group, []))[1].append(r)
    for buf in wrapper.buffers:  # every data-parallel group takes part, also where this rank holds no piece
        by_group.setdefault(id(buf.data_parallel_group), (buf.data_parallel_group, []))
    element_out = []
    for _, (group, recs) in sorted(by_group.items(), key=lambda kv: _group_order(wrapper, kv[1][0])):
        meta = [(r.key, r.shape, r.view, r.piece, r.data.numel()) for r in recs]
        peers: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(peers, meta, group=group)
        sizes = [sum(x[4] for x in m) for m in peers]
        flat = torch.zeros(max(sizes + [1]), device=_device_of(wrapper))  # NCCL groups take device tensors
        if with_data and recs:
            mine = torch.cat([r.data.detach().float().reshape(-1) for r in recs])
            flat[: mine.numel()] = mine.to(flat.device)
        datas = [torch.empty_like(flat) for _ in peers]
        dist.all_gather(datas, flat, group=group)
        datas = [d.cpu() for d in datas]
        shards: dict[str, torch.Tensor] = {}
        for m, data in zip(peers, datas):
            pos = 0
            for key, _shape, view, piece, numel in m:
                p = wrapper.param_of[key.split(SEP)[0]]
                r0, c0, local_view = _tp_origin(p, tuple(view))
                put_piece(
                    shards.setdefault(key, torch.zeros(local_view)), piece, data[pos : pos + numel], view, (r0, c0)
                )
                pos += numel
        for key, tensor in shards.items():
            p = wrapper.param_of[key.split(SEP)[0]]
            element_out.append((key, tensor.view(p.shape)))
    return element_out, whole_out


def _device_of(wrapper: Any) -> torch.device:
    """Where Megatron's grad buffers live: the device of the data-parallel collectives."""
    return wrapper.buffers[0].grad_data.device if wrapper.buffers else torch.device("cpu")


def _group_order(wrapper: Any, group: Any) -> int:
    """The same order of data-parallel groups on every rank: by the buffers' order."""
    for i, buf in enumerate(wrapper.buffers):
        if buf.data_parallel_group is group:
            return i
    return len(wrapper.buffers)


def model_space_state(wrapper: Any, model_sharded_state_dict: dict, is_loading: bool) -> dict:
    """The ``sharded_state_dict`` of a ``ShardoptDistributedOptimizer`` (see the module docstring)."""
    from dataclasses import replace

    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if is_loading:
        _materialize(wrapper)
    model_keys = _model_keys(model_sharded_state_dict)
    elements, whole = _entries(wrapper, with_data=not is_loading)
    state: dict[str, Any] = {}
    for key, tensor in elements:
        name, entry = key.split(SEP)
        p = wrapper.param_of[name]
        sh = model_keys.get(id(p))
        if sh is None:
            raise KeyError(
                f"shardopt.megatron: parameter {name!r} is not in the model's sharded state dict; build it "
                "with model.sharded_state_dict() (parameters kept as variables)"
            )
        data = torch.zeros_like(tensor) if is_loading else tensor
        kwargs = dict(key=f"{PREFIX}.{entry}.{sh.key}", data=data)
        if not isinstance(sh, ShardedTensorFactory):
            kwargs["dtype"] = data.dtype
        state[f"elements{SEP}{key}"] = replace(sh, **kwargs)
    for key, replica, shape, data in whole:
        data = torch.zeros(shape) if is_loading else data.contiguous()
        state[f"whole{SEP}{key}"] = ShardedTensor.from_rank_offsets(f"{PREFIX}.whole.{key}", data, replica_id=replica)
    return {"shardopt_param_state": state, "param_state": "shardopt"}


class _ModelSpace:
    """A ``checkpoint.logical`` source over loaded model-space tensors: element entries hold this rank's
    tensor-parallel shard, whole entries the whole tensor."""

    def __init__(self, wrapper: Any, loaded: dict):
        self.wrapper = wrapper
        self.index: dict[str, dict] = {}
        self.data: dict[str, tuple[torch.Tensor, int, int]] = {}
        layouts = wrapper.layout_of
        for k, sh in loaded.items():
            where, key = k.split(SEP, 1)
            tensor = sh.data if hasattr(sh, "data") else sh
            name = key.split(SEP)[0]
            if where == "elements":
                layout = layouts[name]
                view = layout.shape
                r0, c0, local_view = _tp_origin(wrapper.param_of[name], view)
                self.index[key] = {"shape": list(wrapper.logical_of[name]), "view": list(view)}
                self.data[key] = (tensor.reshape(local_view).float(), r0, c0)
            else:
                shape = list(tensor.shape)
                view = [shape[0], math.prod(shape[1:])] if len(shape) > 1 else [1, max(tensor.numel(), 1)]
                self.index[key] = {"shape": shape, "view": view}
                self.data[key] = (tensor.reshape(view).float(), 0, 0)

    def fill(self, key: str, target: Piece, out: torch.Tensor) -> None:
        local, r0, c0 = self.data[key]
        take_piece(local, target, out, tuple(self.index[key]["view"]), (r0, c0))

    def check_files(self, keys: Any) -> None:
        return None


def load_model_space(wrapper: Any, state_dict: dict) -> None:
    """Load what ``dist_checkpointing.load`` returned for ``model_space_state``'s request: the state, and the fp32
    main values, copied to the model and all-gathered as after a step."""
    opt = wrapper.optimizer
    source = _ModelSpace(wrapper, state_dict["shardopt_param_state"])
    kinds = dict(getattr(opt, "state_kinds", {}))
    kinds[PARAM_KEY] = "elements"
    import_from(opt, source, kinds, load_params=True)
    wrapper.main_params_changed()
