"""Megatron-core adapter: shardopt's rules inside Megatron's DistributedDataParallel + DistributedOptimizer.

Megatron's ``DistributedOptimizer`` (ZeRO-1 over flat grad buffers) hands its inner optimizer one fp32 "main" tensor per
parameter piece this data-parallel rank owns: elements ``[start, end)`` of the parameter's (tensor-parallel shard's)
row-major flattening, cut wherever the buffer's equal per-rank shards fall, mid-row included. Which piece every rank
holds follows from public buffer metadata alone (``buffer.param_index_map`` and each bucket's offset and size), so
the adapter describes each parameter as a ``MatrixLayout`` over its data-parallel group, or over the tensor x data
parallel group for a tensor-parallel weight (a ``RowParallelLinear`` shard cut flat is a ``ColFlatPiece``), and the
rules run exactly as on DeepSpeed ZeRO's flat partitions: row and column statistics reduced over those groups,
whole-matrix work through ``matrix_ops``, vectors on AdamW.

``get_megatron_optimizer`` builds Megatron's own ``DistributedOptimizer`` (grad copies, loss scale, clipping, the
parameter all-gather, the ``step() -> (ok, grad_norm, zeros)`` contract) around a placeholder Adam, then puts the
shardopt optimizer in its place over the very same main tensors: no second fp32 copy. A rank that holds no piece of
a parameter steps a 0-element stand-in for it, so every rank walks the same matrices and issues the same collectives.
Checkpoints: ``state_dict``/``load_state_dict`` (same topology), ``sharded_state_dict`` for
``megatron.core.dist_checkpointing`` (model space: each parameter's state as its tensor-parallel shard, under the
model's own sharded keys, so it reloads at another data-parallel size), and ``shardopt.checkpoint.save/load``.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..optim.base import ShardedOptimizer
from ..optim.registry import build_param_groups, optimizer_class, validate_hyperparameters
from ..optim.routing import ConfigError, RoleTable
from ..sharding.discover import matrix_shape
from ..sharding.fragment import Fragment
from ..sharding.layout import ColFlatPiece, FlatPiece, MatrixLayout, Piece
from .zero_layouts import flat_pieces

__all__ = [
    "get_megatron_optimizer",
    "MegatronError",
    "megatron_roles",
    "megatron_layouts",
    "unwrap",
    "global_named_parameters",
]


class MegatronError(ConfigError):
    """A Megatron-core setting shardopt cannot serve; raised on every rank before any collective."""


def unwrap(chunk: nn.Module) -> nn.Module:
    """The model inside Megatron's wrappers (``DistributedDataParallel``, ``Float16Module``)."""
    while isinstance(inner := getattr(chunk, "module", None), nn.Module):
        chunk = inner
    return chunk


def _config_error(setting: str, why: str, fix: str) -> MegatronError:
    return MegatronError(f"shardopt.megatron: {setting}: {why}; {fix}")


def refuse_unsupported(config: Any, model_chunks: Sequence[nn.Module]) -> None:
    """Every setting shardopt cannot serve, named, before anything collective runs (the same on every rank)."""
    if not model_chunks:
        raise _config_error("model_chunks", "empty", "pass the list of Megatron DistributedDataParallel model chunks")
    for i, chunk in enumerate(model_chunks):
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is None or not hasattr(chunk, "buffers"):
            raise _config_error(
                f"model_chunks[{i}]",
                f"is a {type(chunk).__name__}, not Megatron's DistributedDataParallel",
                "wrap each chunk in megatron.core.distributed."
                "DistributedDataParallel(config, ddp_config, module) first",
            )
        if not ddp_config.use_distributed_optimizer:
            raise _config_error(
                "DistributedDataParallelConfig.use_distributed_optimizer",
                "False",
                "set it to True (shardopt steps the distributed optimizer's pieces of Megatron's grad buffers)",
            )
        if getattr(ddp_config, "use_megatron_fsdp", False):
            raise _config_error(
                "DistributedDataParallelConfig.use_megatron_fsdp",
                "Megatron FSDP is not supported",
                "use the distributed optimizer (use_megatron_fsdp=False)",
            )
        if getattr(ddp_config, "num_distributed_optimizer_instances", 1) != 1:
            raise _config_error(
                "DistributedDataParallelConfig.num_distributed_optimizer_instances",
                f"{ddp_config.num_distributed_optimizer_instances} instances are not supported",
                "use 1",
            )
        if getattr(chunk, "expert_parallel_buffers", None):
            raise _config_error(
                "expert-parallel parameters",
                "Megatron's expert-parallel buffers are not supported yet",
                "train MoE experts without expert parallelism (expert_model_parallel_size=1)",
            )
    if not config.use_distributed_optimizer:
        raise _config_error("OptimizerConfig.use_distributed_optimizer", "False", "set it to True")
    if _pipeline_size() > 1 and any(
        getattr(unwrap(c), "share_embeddings_and_output_weights", False) for c in model_chunks
    ):
        raise _config_error(
            "share_embeddings_and_output_weights with pipeline parallelism",
            "the first stage's embedding and the last stage's copy would be stepped apart (flat "
            "pieces cut differently, seeded draws under two names)",
            "untie them (share_embeddings_and_output_weights=False) or use one pipeline stage",
        )
    for key, fix in (
        ("fp16", "use bf16=True (bf16 params, fp32 main params) or fp32"),
        ("use_precision_aware_optimizer", "set it to False: shardopt keeps fp32 statistics itself"),
        ("optimizer_cpu_offload", "set it to False"),
        ("overlap_param_gather_with_optimizer_step", "set it to False"),
        ("reuse_grad_buf_for_mxfp8_param_ag", "set it to False"),
    ):
        if getattr(config, key, False):
            raise _config_error(f"OptimizerConfig.{key}", "True is not supported", fix)
    if any(getattr(getattr(unwrap(c), "config", None), "fp8_param", False) for c in model_chunks):
        raise _config_error(
            "TransformerConfig.fp8_param", "fp8 parameters are not supported", "keep bf16 or fp32 parameters"
        )


# ---------------------------------------------------------------------------------------------- names and roles
_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")


def global_named_parameters(model_chunks: Sequence[nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """Every parameter under the name one process gives it: Megatron's wrappers stripped, decoder layers numbered by
    their global ``layer_number`` (a pipeline stage numbers its own layers from 0; so do the chunks of a virtual
    pipeline). Seeded draws and checkpoints key on these names, so every topology agrees."""
    out: list[tuple[str, torch.Tensor]] = []
    for chunk in model_chunks:
        model = unwrap(chunk)
        prefix = ""
        layer_of = {}
        for name, m in model.named_modules():
            number = getattr(m, "layer_number", None)
            found = list(_LAYER.finditer(name + "."))
            if isinstance(number, int) and found and found[-1].end() == len(name) + 1:
                layer_of[name + "."] = name[: found[-1].start(2)] + f"{number - 1}."
        for name, p in model.named_parameters():
            for local, global_ in layer_of.items():
                if name.startswith(local):
                    name = global_ + name[len(local) :]
                    break
            out.append((prefix + name, p))
    taken: dict[str, int] = {}
    for name, _ in out:
        taken[name] = taken.get(name, 0) + 1
    twice = sorted(n for n, c in taken.items() if c > 1)
    if twice:
        raise MegatronError(
            f"shardopt.megatron: parameters {twice[:3]} have the same name in several model chunks "
            "(layers without a global layer_number?); shardopt names state by parameter name"
        )
    return out


def megatron_roles(model_chunks: Sequence[nn.Module], names: Mapping[int, str]) -> RoleTable:
    """Every parameter's role and its source, keyed by ``names`` (``id(param) -> name``), found on each chunk as on
    one process (``routing.find_roles``). Megatron's language models state their word embedding, position table
    and output layer (``optim.declared_roles``), whatever part of the model a pipeline stage holds, so no stage
    guesses a head: a stage without ``post_process`` holds none, and a hidden matrix as wide as the vocabulary or
    the positions stays a matrix."""
    from ..optim.routing import find_roles

    roles: dict[str, str] = {}
    sources: dict[str, str] = {}
    notes: list[str] = []
    for chunk in model_chunks:
        model = unwrap(chunk)
        local = dict(model.named_parameters())
        table = find_roles(model)
        for n, r in table.roles.items():
            if n in local and id(local[n]) in names:
                roles[names[id(local[n])]] = r
                sources[names[id(local[n])]] = table.sources[n]
        notes += [w for w in table.warnings if w not in notes]
    return RoleTable(roles, sources, notes)


# ---------------------------------------------------------------------------------------------- layouts
def _tp_and_dp(p: torch.Tensor, dp_group: Any, cache: dict) -> tuple[Any, list[tuple[int, int]], int] | None:
    """For a tensor-parallel parameter: the tensor x data-parallel group, each of its ranks' (tp rank, dp rank), and
    this rank's index in it (one all-gather per data-parallel group, kept in ``cache``); None otherwise."""
    if not getattr(p, "tensor_model_parallel", False):
        return None
    if id(dp_group) in cache:
        return cache[id(dp_group)]
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_and_data_parallel_group(
        with_context_parallel=dist.get_world_size(dp_group) != ps.get_data_parallel_world_size()
    )
    coords: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(coords, (ps.get_tensor_model_parallel_rank(), dist.get_rank(dp_group)), group=group)
    tp, dp = ps.get_tensor_model_parallel_world_size(), dist.get_world_size(dp_group)
    if sorted(coords) != [(t, d) for t in range(tp) for d in range(dp)]:
        raise MegatronError(
            "shardopt.megatron: the tensor x data-parallel group is not the product of the "
            f"tensor-parallel ({tp}) and the buffers' data-parallel ({dp}) groups; shardopt reads "
            "tensor-parallel weights only over Megatron's tensor_and_data_parallel group"
        )
    cache[id(dp_group)] = (group, [tuple(c) for c in coords], dist.get_rank(group))
    return cache[id(dp_group)]


def _tp_pieces(
    dp_pieces: list[FlatPiece],
    coords: list[tuple[int, int]],
    dim: int,
    local: tuple[int, int],
) -> list[Piece]:
    """Every tensor x data-parallel rank's piece of the logical matrix: this rank's tensor-parallel shard (rows
    ``dim == 0``, columns ``dim == 1`` of the logical ``(m, n)``) cut flat as the data-parallel pieces say."""
    m_loc, n_loc = local
    out: list[Piece] = []
    for t, d in coords:
        piece = dp_pieces[d]
        if dim == 0:
            base = t * m_loc * n_loc
            out.append(FlatPiece(base + piece.lo, base + piece.hi))
        else:
            out.append(ColFlatPiece(t * n_loc, (t + 1) * n_loc, piece.lo, piece.hi))
    return out


def megatron_layouts(buffers: Sequence[Any], names: Mapping[int, str]) -> dict[int, tuple[MatrixLayout, tuple]]:
    """``id(model param) -> (layout, logical shape)`` for every parameter of Megatron's grad ``buffers``."""
    out: dict[int, tuple[MatrixLayout, tuple]] = {}
    groups: dict[int, tuple[Any, list[tuple[int, int]], int]] = {}  # _tp_and_dp's cache
    for buf in buffers:
        dp_group = buf.data_parallel_group
        dp, dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        for p, (start, end, bucket_id) in buf.param_index_map.items():
            bucket = buf.buckets[bucket_id]
            numel = end - start
            local = tuple(p.shape)
            pieces = flat_pieces(start - bucket.offset, numel, bucket.grad_data.numel() // dp, dp)
            tp = _tp_and_dp(p, dp_group, groups)
            if tp is None:
                out[id(p)] = (MatrixLayout(matrix_shape(local), pieces, dp_rank, dp_group if dp > 1 else None), local)
                continue
            group, coords, rank = tp
            dim = int(p.partition_dim) if p.dim() == 2 else 0  # vectors (column-parallel biases): their elements
            logical = list(local)
            logical[dim] *= max(t for t, _ in coords) + 1
            layout = MatrixLayout(
                matrix_shape(tuple(logical)), _tp_pieces(pieces, coords, dim, matrix_shape(local)), rank, group
            )
            out[id(p)] = (layout, tuple(logical))
    return out


# ---------------------------------------------------------------------------------------------- the optimizer
def _defaults_from(config: Any, hyperparameters: Mapping[str, Any]) -> dict[str, Any]:
    """Megatron's own settings as shardopt's defaults where the user gave none: ``lr`` and the AdamW part's betas and
    eps (weight decay stays shardopt's default, 0: pass ``weight_decay`` / ``adam_weight_decay``)."""
    hp = dict(hyperparameters)
    hp.setdefault("lr", config.lr)
    hp.setdefault("adam_betas", (config.adam_beta1, config.adam_beta2))
    hp.setdefault("adam_eps", config.adam_eps)
    return hp


def get_megatron_optimizer(
    config: Any,
    model_chunks: Sequence[nn.Module],
    optimizer: str = "racs",
    routing: Mapping[str, str] | None = None,
    *,
    use_gloo_process_groups: bool = True,
    pg_collection: Any = None,
    **hyperparameters: Any,
) -> Any:
    """Megatron's ``DistributedOptimizer`` stepping shardopt optimizer ``optimizer`` (``megatron.core.optimizer.
    get_megatron_optimizer``'s shape): Megatron's training loop drives it unchanged (``step() -> (update_successful,
    grad_norm, num_zeros_in_grad)``, ``zero_grad``, ``get_loss_scale``, ``reload_model_params``, ``state_dict`` and
    ``sharded_state_dict`` for ``megatron.core.dist_checkpointing``).

    ``config``: Megatron's ``OptimizerConfig`` (``use_distributed_optimizer=True``; its ``lr``, ``adam_beta1/2`` and
    ``adam_eps`` are the defaults of ``lr`` and the AdamW part; ``clip_grad`` clips as in Megatron); ``model_chunks``:
    the ``DistributedDataParallel``-wrapped chunks of this pipeline stage; ``routing`` and ``hyperparameters`` as in
    ``shardopt.create_optimizer``. Megatron's LR scheduler (``OptimizerParamScheduler``) schedules every group from its
    own starting lr (each group's ``max_lr``; ``min_lr`` in the same ratio as the config's).
    """
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler
    from megatron.core.process_groups_config import ProcessGroupCollection

    refuse_unsupported(config, model_chunks)
    cfg = validate_hyperparameters(
        optimizer, _defaults_from(config, hyperparameters), where="shardopt.megatron.get_megatron_optimizer"
    )
    named = global_named_parameters(model_chunks)
    names = {id(p): n for n, p in named}
    pipelined = _pipeline_size() > 1
    unused: list[str] | None = [] if pipelined else None
    failure: Exception | None = None
    try:
        groups = build_param_groups(
            named, optimizer, cfg, routing, unused=unused, roles=megatron_roles(model_chunks, names)
        )
    except ConfigError as err:  # raised on this stage's parameters only: every stage must learn of it
        if not pipelined:
            raise
        failure = err
    if pipelined:  # one collective on every rank: a routing pattern must match on some stage, an error stops all
        seen: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(seen, (sorted(unused or []), None if failure is None else str(failure)))
        errors = [e for _, e in seen if e]
        if failure is not None:
            raise failure
        if errors:
            raise ConfigError(f"shardopt.megatron: another pipeline stage refused its parameters: {errors[0]}")
        nowhere = sorted(set.intersection(*(set(u) for u, _ in seen)))
        if nowhere:
            raise ConfigError(
                f"shardopt.megatron: routing patterns {nowhere} match no trainable parameter on any "
                "pipeline stage (names as one process gives them: decoder layers by global number)"
            )
    for g in groups:
        g.pop("param_names", None)  # names travel in "names"; torch's param_names would ask for them on load
    opt = optimizer_class(optimizer).from_config(groups, cfg)
    opt.param_names.update(names)
    model_params = [list(g["params"]) for g in opt.param_groups]

    pgs = ProcessGroupCollection.setup_process_groups_for_optimizer(
        pg_collection, list(model_chunks), use_gloo_process_groups
    )
    # Megatron's DistributedOptimizer takes only Adam: it is built around a placeholder over the same groups (Adam
    # keeps no state before its first step) and shardopt's optimizer then takes its place over the main tensors
    holder = torch.optim.AdamW([{"params": ps} for ps in model_params], lr=0.0)
    scaler = ConstantGradScaler(config.loss_scale) if config.loss_scale else None
    wrapper = ShardoptDistributedOptimizer(
        holder,
        config,
        scaler,
        None,
        model_chunks=list(model_chunks),
        per_model_buffers={i: c.buffers for i, c in enumerate(model_chunks)},
        data_parallel_group=pgs["intra_dp_cp_group"],
        data_parallel_group_gloo=pgs["intra_dp_cp_group_gloo"],
        data_parallel_group_idx=dist.get_rank(pgs["mp_group"]),
        distributed_optimizer_instance_id=0,
    )
    wrapper.grad_stats_parallel_group = pgs["intra_dist_opt_group"]
    from megatron.core import parallel_state as ps

    wrapper.tp_group = getattr(pg_collection, "tp", None) or ps.get_tensor_model_parallel_group()
    wrapper.adopt(opt, model_params, names, config)
    return wrapper


def _pipeline_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def _make_wrapper_class():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    class ShardoptDistributedOptimizer(DistributedOptimizer):
        """Megatron's ``DistributedOptimizer`` whose inner optimizer is a shardopt optimizer over its main tensors."""

        def adopt(
            self, opt: ShardedOptimizer, model_params: list[list[torch.Tensor]], names: Mapping[int, str], config: Any
        ) -> None:
            """Put ``opt`` in the placeholder's place: each group's tensors become this rank's main pieces (0-element
            stand-ins for parameters it holds none of), described by their layouts."""
            main_of = {}
            for model_groups, main_groups in (
                (self.model_float16_groups, self.shard_fp32_from_float16_groups),
                (self.model_fp32_groups, self.shard_fp32_groups),
            ):
                for mg, sg in zip(model_groups, main_groups):
                    main_of.update({id(p): s for p, s in zip(mg, sg)})
            layouts = megatron_layouts(self.buffers, names)
            flat = []
            ratio = (config.min_lr / config.lr) if config.lr and config.min_lr else 0.0
            self._stand_ins: list[torch.Tensor] = []
            #: parameter name -> the model parameter, its layout and logical shape (checkpoints)
            self.param_of = {names[id(p)]: p for params in model_params for p in params}
            self.layout_of = {n: layouts[id(p)][0] for n, p in self.param_of.items()}
            self.logical_of = {n: tuple(layouts[id(p)][1]) for n, p in self.param_of.items()}
            for group, params in zip(opt.param_groups, model_params):
                tensors = []
                for p in params:
                    name = names[id(p)]
                    layout, logical = layouts[id(p)]
                    t = main_of.get(id(p))
                    if t is None:
                        t = nn.Parameter(torch.zeros(0, dtype=torch.float32, device=p.device), requires_grad=False)
                        t.grad = torch.zeros(0, dtype=torch.float32, device=p.device)
                        self._stand_ins.append(t)
                    if t.numel() != layout.local_numel:
                        raise MegatronError(
                            f"shardopt.megatron: {name}: this rank's main piece has {t.numel()} "
                            f"elements, the buffer layout says {layout.local_numel} (an unsupported "
                            "Megatron buffer layout)"
                        )
                    opt.param_names[id(t)] = name
                    flat.append((t, [Fragment(name, layout, 0, tuple(logical))]))
                    tensors.append(t)
                group["params"] = tensors
                # Megatron's OptimizerParamScheduler sets each group's lr from max_lr/min_lr and its weight decay
                # from start_wd/end_wd: each group keeps its own
                group.setdefault("default_config", True)  # Megatron's lr logging reads such a group's lr
                group.setdefault("max_lr", float(group["lr"]))
                group.setdefault("min_lr", float(group["lr"]) * ratio)
                group.setdefault("start_wd", float(group.get("weight_decay", 0.0)))
                group.setdefault("end_wd", float(group.get("weight_decay", 0.0)))
            opt.use_layouts(flat=flat)
            self.optimizer = opt
            self.shardopt = opt

        def describe(self, all_stages: bool = False) -> str:
            """The role table of this stage's parameters as one process prints it (``shardopt.describe``);
            ``all_stages=True`` gathers every pipeline stage's rows (a collective over the pipeline group)."""
            from ..optim.describe import describe

            return describe(self.shardopt, all_stages=all_stages)

        # ---------------------------------------------------------------- Megatron's views of the inner groups
        def get_parameters(self) -> list:
            """The main pieces, without the 0-element stand-ins (grad norm, clipping, zero counts: Megatron's
            multi-tensor kernels are not meant for empty tensors, and Megatron never passes them one)."""
            return [p for p in super().get_parameters() if p.numel()]

        def _collect_main_grad_data_for_unscaling(self):
            return [p.grad.data for p in self.get_parameters() if p.grad is not None]

        def main_params_changed(self) -> None:
            """The fp32 main pieces were loaded: the model's parameters follow, on every rank, as after a step."""
            self._copy_main_params_to_model_params()
            for chunk in self.model_chunks:
                chunk.start_param_sync(force_sync=True)

        # ---------------------------------------------------------------- checkpoints
        def state_dict(self):
            """This rank's pieces: shardopt's state dict, the fp32 main values it steps, and the loss scale (the same
            topology only; for another data-parallel size use ``sharded_state_dict`` or ``shardopt.checkpoint``)."""
            out = {
                "shardopt": self.optimizer.state_dict(),
                "main_pieces": [t.detach().clone() for t in self.optimizer.stepped_tensors()],
            }
            if self.grad_scaler is not None:
                out["grad_scaler"] = self.grad_scaler.state_dict()
            return out

        def load_state_dict(self, state_dict):
            if "param_state" in state_dict:  # a dist-checkpointing load (sharded_state_dict)
                from .megatron_checkpoint import load_model_space

                load_model_space(self, state_dict)
                return
            if "shardopt" not in state_dict:
                raise MegatronError(
                    "shardopt.megatron: load_state_dict: not a shardopt state dict (Megatron's own "
                    "optimizer formats hold Adam's state); load what this optimizer's state_dict() or "
                    "sharded_state_dict() saved, or use shardopt.checkpoint.load"
                )
            self.optimizer.load_state_dict(state_dict["shardopt"])
            pieces = state_dict.get("main_pieces")
            if pieces is not None:
                with torch.no_grad():
                    for t, saved in zip(self.optimizer.stepped_tensors(), pieces):
                        t.copy_(saved)
                self.main_params_changed()
            if self.grad_scaler is not None and "grad_scaler" in state_dict:
                self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

        def _unsupported_format(self, *args, **kwargs):
            raise MegatronError(
                "shardopt.megatron: Megatron's flat-buffer optimizer state formats (save_parameter_"
                "state, the torch/dp_zero checkpoint formats) hold Adam's state; save with "
                "sharded_state_dict (megatron.core.dist_checkpointing, --ckpt-format torch_dist) or "
                "shardopt.checkpoint.save"
            )

        save_parameter_state = load_parameter_state = _unsupported_format
        get_parameter_state_dp_zero = get_parameter_state_dp_reshardable = _unsupported_format
        load_parameter_state_from_dp_zero = load_parameter_state_from_dp_reshardable = _unsupported_format

        def sharded_state_dict(
            self,
            model_sharded_state_dict: dict | None = None,
            is_loading: bool = False,
            sharding_type: str | None = None,
            metadata: dict | None = None,
        ) -> dict:
            """shardopt's state for ``megatron.core.dist_checkpointing`` in model space: every parameter's element-wise
            state (and fp32 main values) as its tensor-parallel shard under the model's sharded key, other state whole;
            data-parallel size free on reload."""
            from .megatron_checkpoint import model_space_state

            return model_space_state(self, model_sharded_state_dict or {}, is_loading)

    return ShardoptDistributedOptimizer


class _LazyClass:
    """The wrapper class is made on first use, so importing this module needs no Megatron-core."""

    cls: type | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _LazyClass.cls is None:
            _LazyClass.cls = _make_wrapper_class()
        return _LazyClass.cls(*args, **kwargs)


ShardoptDistributedOptimizer = _LazyClass()
