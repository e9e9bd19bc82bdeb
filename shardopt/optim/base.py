"""``ShardedOptimizer``: torch.optim plumbing shared by every shardopt algorithm.

Each param group carries a ``treatment`` (``"adamw"`` or an algorithm's matrix rule) and that rule's
hyperparameters, so LR schedulers, ``state_dict`` and DeepSpeed's per-group stepping work as usual. The
tensors in a group are whatever the engine steps: real parameters (plain or DTensor shards) or flat
partitions that hold pieces of many matrices. ``fragments(p)`` tells an algorithm which matrices a stepped
tensor holds and how each one is laid out across ranks; the algorithm never asks which engine it runs under.

The engine boundary is ``use_layouts``: an engine adapter (``shardopt.plugin``) hands the optimizer a layout
resolver for tensors that are one parameter each and the fragments of its flat partitions; nothing here
imports an engine. Per-matrix state is found by fragment name through ``matrix_state`` alone.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from collections import defaultdict
from itertools import chain
from typing import Any, Callable, Iterable, Iterator, Literal, Sequence, overload

import torch

from ..sharding.batched import BATCHED_NDIM, split_flat
from ..sharding.comm import Round, collective_counter
from ..sharding.discover import align_grads, batched_fragments, global_shape, layout_of, shard_mesh
from ..sharding.fragment import Fragment, local_flat, local_tensor
from ..sharding.iterative import iterative_device
from ..sharding.layout import MatrixLayout
from ..sharding.matrix_ops import BUCKET_ELEMENTS, STRATEGIES, MatrixOps, OpCost
from ..sharding.plan import check_same_plan
from ..sharding.precision import PRECISIONS, resolve_precision
from ..sharding.state_split import (
    Placement,
    StateSpec,
    dtensors_to_shares,
    keep_share,
    share_numel,
    share_shape,
    shares_to_dtensors,
)
from ..sharding.teams import create_team_groups
from ..sharding.time_model import resolve_profile
from .adamw import adamw_gates_on_device, adamw_group_step
from .build_log import log_build
from .checks import check_hyperparameters
from .config import OptimizerConfig
from .contiguous import contiguous_steps
from .groups import normalize_param_groups
from .hooks import apply_param_sources, run_pre_step_checks, run_zero_grad_hooks
from .items import MatrixItem, apply_items
from .nonfinite import _PendingSkip, end_gate, gate_step, nonfinite_grads, settle_device_skip
from .routing import (
    TRANSPOSE_SYMMETRIC,
    RoutingError,
    describe_row,
    format_table,
    logical_dim,
    logical_shape,
    role_of,
    role_source,
)
from .transposed import TRANSPOSED, is_transposed
from .whole_matrix import run_buckets

__all__ = ["ShardedOptimizer", "MatrixItem", "LayoutResolver", "apply_items"]

#: the layout of a stepped tensor that is one parameter (default: ``sharding.discover.layout_of``)
LayoutResolver = Callable[[torch.Tensor], MatrixLayout]


def _float_lr(group: dict) -> dict:
    """The group as the rules see it: a tensor ``lr`` read as a float (torch's tensor-lr convention)."""
    lr = group.get("lr")
    return {**group, "lr": float(lr)} if isinstance(lr, torch.Tensor) else group


def _state_for_param(value: Any, device: torch.device, key: Any = None) -> Any:
    """One loaded state entry: tensors on the parameter's device, floating ones in fp32 (statistics are fp32
    whatever the parameter dtype, so a bf16 model's state must not pass through bf16), ``step`` as a float32
    tensor on the CPU (older state dicts hold a Python number)."""
    if key == "step":
        return value if isinstance(value, torch.Tensor) else torch.tensor(float(value), dtype=torch.float32)
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=torch.float32 if value.is_floating_point() else value.dtype)
    if isinstance(value, dict):
        return {k: _state_for_param(v, device, k) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_state_for_param(v, device) for v in value)
    return value


def _logical_shape(p: torch.Tensor) -> tuple[int, ...]:
    """A parameter's unsharded shape: what its engine says where the tensor holds a flattened piece (ZeRO-3's
    ``ds_shape``, legacy FSDP's declared shapes: ``routing.logical_shape``), else the (DTensor's global,
    Megatron's unsplit) shape."""
    shape = logical_shape(p)
    return shape if shape != tuple(p.shape) else tuple(global_shape(p))


def _is_dtensor(p: torch.Tensor) -> bool:
    """FSDP2 / DTensor parameters: their optimizer state goes to DCP, which needs sharded entries described."""
    return hasattr(p, "device_mesh") and hasattr(p, "placements")


class ShardedOptimizer(torch.optim.Optimizer):
    """Base class: param groups with a ``treatment``, fragment discovery, AdamW for vectors.

    Subclasses implement ``_step_<treatment>(group, items)`` for their matrix rules and set
    ``matrix_treatments``. Groups without a ``treatment`` get one from the tensor's rank: 2-D -> the
    subclass's default matrix treatment, anything else -> ``"adamw"``.
    """

    matrix_treatments: tuple[str, ...] = ()
    #: whether the matrix rule needs whole-matrix operations (then ``whole_matrix_transpose``/``_cost`` and
    #: ``matrix_state_spec`` describe it, and steps run through ``_run_whole_matrix``)
    whole_matrix_work: bool = False
    #: the step counters a device-side skip may undo (``nonfinite.gate_step`` sets it; step counts add to it)
    _pending_skip: _PendingSkip
    #: the factorizations (``torch.linalg`` ``eigh``/``svd``/``qr``) a step that refreshes a subspace runs on the
    #: iterative route (CUDA's), per stack of same-shape matrices: what the paper prescribes there. Between
    #: refreshes, and for every other rule, a step runs none; a matrix an iteration cannot settle falls back to
    #: the factorization it replaces, counted by ``sharding.iterative.fallback_counts``
    refresh_factorizations: dict[str, int] = {}
    #: How each state entry relates to its parameter, for checkpoints that reshard (shardopt.checkpoint):
    #: "elements" follows the parameter's elements, "rows"/"cols" is one value per row/column of the
    #: matrix view, "tensor" is one value per stepped tensor (step counters), "scalar" one per matrix,
    #: "matrix" a small per-matrix tensor (k x k factor, low-rank basis) with one logical value; under the
    #: gather strategy only the owner rank keeps it current and ``sync_state`` replicates it.
    state_kinds: dict[str, str] = {"exp_avg": "elements", "exp_avg_sq": "elements", "step": "tensor"}
    #: state keys of older releases -> today's (named after the algorithm's symbols, docs/algorithms/): both
    #: loaders, ``load_state_dict`` and ``shardopt.checkpoint``, rename them, so old checkpoints keep loading
    state_key_renames: dict[str, str] = {}
    #: set by an engine adapter whose engine skips steps with non-finite gradients on every rank before it
    #: calls ``step`` (DeepSpeed's overflow / global-norm check): then ``on_nonfinite`` has nothing left to check
    engine_skips_nonfinite: bool = False
    #: where ``on_nonfinite="skip"`` decides a step's skip: "auto" (on the device for CUDA gradients when every
    #: group's rule gates its writes, ``skips_on_device``; else one host read of the flag), True (on the device
    #: wherever the rules allow, any device: tests), False (always the host read). See ``nonfinite.gate_step``.
    nonfinite_on_device: bool | str = "auto"
    _step_gate: torch.Tensor | None = None
    _step_found_inf: torch.Tensor | None = None
    adamw_defaults = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, eps_mode="torch")
    #: group options by parameter role for groups given without a ``treatment`` (``model.named_parameters()``
    #: or a flat list; create_optimizer's routing): no ``treatment`` means the default matrix rule
    role_table: dict[str, dict] = {
        "matrix": {},
        "embedding": {"treatment": "adamw"},
        "lm_head": {"treatment": "adamw"},
        "router": {"treatment": "adamw"},
        "vector": {"treatment": "adamw"},
    }
    #: the hyperparameter model (defaults, ranges, docs, roles); each algorithm module defines its own
    Config: type[OptimizerConfig] = OptimizerConfig

    @classmethod
    def from_config(cls, params: Iterable[Any], config: OptimizerConfig) -> "ShardedOptimizer":
        """The optimizer for an already validated ``config`` (``create_optimizer``, the DeepSpeed section, the
        trainer): what the constructor builds from its keyword arguments, without validating twice."""
        if not isinstance(config, cls.Config):
            raise TypeError(f"{cls.__name__} takes a {cls.Config.__name__}, got {type(config).__name__}")
        self = cls.__new__(cls)
        self._init_from_config(params, config)
        return self

    def _init_from_config(self, params: Iterable[Any], config: OptimizerConfig) -> None:
        """Every subclass constructor ends here: it only turns its keyword arguments into ``config``."""
        #: the validated hyperparameters this optimizer was built from
        self.config = config
        self.role_table = config.roles()
        ShardedOptimizer.__init__(self, params, config.group_defaults(), **config.engine_options())

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        adam_lr: float | None = None,
        on_nonfinite: str = "skip",
        debug_plan: bool | None = None,
        matrix_ops: dict | None = None,
        **adam: Any,
    ):
        if on_nonfinite not in ("skip", "raise", "ignore"):
            raise ValueError(f"on_nonfinite must be 'skip', 'raise' or 'ignore', got {on_nonfinite!r}")
        check_hyperparameters(defaults, f"{type(self).__name__} defaults")
        check_hyperparameters({**adam, "lr": adam_lr}, f"{type(self).__name__} AdamW defaults (adam_*)")
        # names key seeded draws and checkpoints, so they must not depend on the process: a name given with
        # the tensor (torch's pairs or param_names, create_optimizer's names), else the tensor's position
        # (groups.tensor_names; wrappers that re-split param groups keep names with shardopt.param_groups);
        # registered param sources first (hooks.param_sources: the HF Trainer's unnamed groups get names and roles)
        params = apply_param_sources(params, type(self).__name__)
        groups, names = normalize_param_groups(params, self._role_options, type(self).__name__, stacklevel=4)
        self._adam_group_defaults = {**self.adamw_defaults, **{k: v for k, v in adam.items() if v is not None}}
        self._adam_lr = adam_lr
        for g in groups:
            self._resolve_treatment(g, names)
        super().__init__(groups, defaults)
        self.param_names: dict[int, str] = names
        self._group_list: list[dict] = list(self.param_groups)  # see _groups
        #: parameter names of each group as built (engines may later replace group tensors by flat partitions)
        self.group_param_names: list[list[str]] = [[names.get(id(p), "") for p in g["params"]] for g in groups]
        #: their logical shapes, as built (which 3-D parameters are batches of matrices, after an engine flattened them)
        self.group_param_shapes: list[list[tuple[int, ...]]] = [
            [_logical_shape(p) for p in g["params"]] for g in groups
        ]
        #: the role that chose each one's rule and where it came from (``routing.ROLE_SOURCES``), as built: the
        #: table (``describe``) lists logical parameters also while the engine steps flat partitions
        self.group_param_roles: list[list[tuple[str, str]]] = [
            [(role_of(p), role_source(p)) for p in g["params"]] for g in groups
        ]
        self._fragments: dict[int, list[Fragment]] = {}
        self._attached: dict[int, torch.Tensor] = {}
        self._layout_resolver: LayoutResolver = layout_of
        #: "skip" (default): a step whose gradients hold inf/NaN on any rank changes nothing, on every rank;
        #: "raise": FloatingPointError on every rank; "ignore": no check (and no collective for it).
        self.on_nonfinite = on_nonfinite
        self._skipped_steps = 0
        #: check every step that all ranks hold the same step plan (also with SHARDOPT_DEBUG_PLAN=1)
        self.debug_plan = bool(int(os.environ.get("SHARDOPT_DEBUG_PLAN", "0"))) if debug_plan is None else debug_plan
        #: whole-matrix strategy: "auto" | "gather" | "distributed" | "team" (shardopt.sharding.matrix_ops)
        self.matrix_strategy = str((matrix_ops or {}).get("strategy", "auto"))
        #: ranks per team under strategy="team" (None: per matrix, the size the time model finds fastest)
        self.matrix_team_size = (matrix_ops or {}).get("team_size")
        #: bound on one bucket's whole-matrix transients (gathered state, reduced sums, owners' whole matrices)
        self.matrix_bucket_elements = (
            float((matrix_ops or {}).get("bucket_mb", BUCKET_ELEMENTS * 4 / 2**20)) * 2**20 / 4
        )
        if self.matrix_strategy not in STRATEGIES:
            raise ValueError(f"matrix_ops.strategy must be one of {STRATEGIES}, got {self.matrix_strategy!r}")
        #: the time model's hardware profile and the auto strategy's memory budget (shardopt.sharding.time_model)
        self.matrix_profile = (matrix_ops or {}).get("profile", "auto")
        #: precision of whole-matrix iterations (shardopt.sharding.precision; "auto" resolved per rule and device)
        self.matrix_precision = str((matrix_ops or {}).get("precision", "auto"))
        if self.matrix_precision not in PRECISIONS:
            raise ValueError(f"matrix_ops.precision must be one of {PRECISIONS}, got {self.matrix_precision!r}")
        self.matrix_memory_budget_mib = (matrix_ops or {}).get("memory_budget_mib")
        if isinstance(self.matrix_profile, dict):
            self.matrix_profile = {k: v for k, v in self.matrix_profile.items() if v is not None}
        resolve_profile(self.matrix_profile)  # a bad profile fails here, not at the first step
        self._comm_stats: dict[str, dict[str, float]] = {}
        #: CPU seconds this process spent inside whole-matrix work (``_run_whole_matrix``), summed over steps
        self.whole_matrix_cpu_s = 0.0
        self._ops_cache: dict[int, MatrixOps | None] = {}
        #: group rank that keeps each matrix's "matrix"-kind state current (gather strategy); see sync_state
        self._matrix_owner: dict[str, tuple[int, MatrixLayout]] = {}
        #: param group and row plan of every whole-matrix matrix (where its small state rests)
        self._matrix_plans: dict[str, tuple[int, tuple[int, int], Placement]] = {}
        # one record on rank 0 (logger "shardopt"): every front door builds its optimizer here
        log_build(type(self).__name__, self.describe_rows(), [p for g in groups for p in g["params"]])

    # ------------------------------------------------------------------ groups
    def _role_options(self, role: str) -> dict:
        if role not in self.role_table:  # a table of its own (a subclass's) without matrix_transposed
            if role != "matrix_transposed" or self.matrix_treatments[0] not in TRANSPOSE_SYMMETRIC:
                raise RoutingError(
                    f"{type(self).__name__} has no rule for role {role!r} (a weight stored in x out) "
                    "in its role_table; give it a 'matrix_transposed' entry (optim.transposed), or "
                    "route such weights explicitly, e.g. to 'adamw'"
                )
            options = {**self.role_table["matrix"], TRANSPOSED: True}  # it orients by shape (optim.transposed)
            return {"treatment": self.matrix_treatments[0], **options}
        options = dict(self.role_table[role])
        options.setdefault("treatment", self.matrix_treatments[0])
        return options

    def _resolve_treatment(self, group: dict, names: dict[int, str]) -> None:
        if "treatment" not in group:
            dims = {logical_dim(p) for p in group["params"]}
            group["treatment"] = self.matrix_treatments[0] if dims == {2} else "adamw"
        first = names.get(id(group["params"][0]), "<unnamed>") if group["params"] else "<empty>"
        check_hyperparameters(group, f"the {group['treatment']!r} param group of {first!r}")
        for p in group["params"]:
            if p.is_complex():
                name = names.get(id(p), "<unnamed>")
                raise ValueError(
                    f"parameter {name!r} is complex ({p.dtype}); {type(self).__name__} steps real "
                    f"tensors (its {group['treatment']!r} rule included): optimize "
                    "torch.view_as_real(p) instead"
                )
        t = group["treatment"]
        if t == "adamw":
            for k, v in self._adam_group_defaults.items():
                group.setdefault(k, v)
            if self._adam_lr is not None:
                group.setdefault("lr", self._adam_lr)
        elif t not in self.matrix_treatments:
            raise ValueError(
                f"param group treatment {t!r} is not known to {type(self).__name__}; "
                f"use one of {sorted(self.matrix_treatments + ('adamw',))}"
            )
        else:
            for p in group["params"]:
                if logical_dim(p) not in (2, BATCHED_NDIM) and not self.is_flat(p):
                    name = names.get(id(p), "<unnamed>")
                    raise ValueError(
                        f"parameter {name!r} of shape {logical_shape(p)} is in a {t!r} group, but {t} needs 2-D "
                        f"matrices (or a 3-D batch of them, e.g. fused MoE experts); route it to 'adamw' "
                        f"(routing={{'{name}': 'adamw'}})"
                    )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group`` after the constructor's preprocessing: a group without ``treatment`` is
        split by role, and its tensors are named by position after the existing ones (never by address)."""
        if not hasattr(self, "param_names"):  # torch's __init__ adding the groups prepared in ours
            super().add_param_group(param_group)
            return
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {torch.typename(param_group)}")
        start = sum(len(n) for n in self.group_param_names)
        groups, names = normalize_param_groups(
            [param_group], self._role_options, type(self).__name__, start=start, stacklevel=2
        )
        named = any("param_names" in g for g in self.param_groups)
        for group in groups:
            self._resolve_treatment(group, {**self.param_names, **names})
            if named and "param_names" not in group:  # torch refuses unnamed groups beside named ones
                group["param_names"] = [names[id(p)] for p in group["params"]]
            super().add_param_group(group)
            for p in group["params"]:
                self.param_names.setdefault(id(p), names[id(p)])
            self.group_param_names.append([self.param_names[id(p)] for p in group["params"]])
            self.group_param_shapes.append([_logical_shape(p) for p in group["params"]])
            self.group_param_roles.append([(role_of(p), role_source(p)) for p in group["params"]])
        self._groups()  # the stable group list follows (see _groups)
        self._forget_plans()

    def describe(self) -> str:
        """A table of every parameter's name, logical shape, role, where the role came from (``declared``,
        ``type``, ``guessed``, ``routing``) and rule (``shardopt.optim.describe``); the same under any engine as in
        one process, also while the engine steps flat partitions (it lists the parameters as built)."""
        return format_table(self.describe_rows())

    def describe_rows(self) -> list[tuple[str, ...]]:
        """``describe``'s rows (``routing.describe_row``), in param-group order."""
        roles = self.__dict__.get("group_param_roles") or [[("?", "?")] * len(n) for n in self.group_param_names]
        return [
            describe_row(name, shape, role, source, group)
            for group, names, shapes, group_roles in zip(
                self._groups(), self.group_param_names, self.group_param_shapes, roles
            )
            for name, shape, (role, source) in zip(names, shapes, group_roles)
        ]

    def describe_plan(self) -> str:
        """Every param group's whole-matrix plan (``MatrixOps.describe``): strategy, owner and modeled seconds
        per matrix, and this rank's modeled step; call it after the engine has set the layouts (the first
        ``step`` or ``use_layouts``)."""
        parts = []
        for g in range(len(self._groups())):
            ops = self.matrix_plan(g)
            if ops is not None:
                parts.append(
                    f"param group {g} ({self._groups()[g].get('treatment')}, strategy "
                    f"{self.matrix_strategy}):\n{ops.describe()}"
                )
        return "\n\n".join(parts) or "no whole-matrix work"

    # ------------------------------------------------------------------ layouts (the engine boundary)
    def use_layouts(
        self, resolver: LayoutResolver | None = None, flat: Iterable[tuple[torch.Tensor, Sequence[Fragment]]] = ()
    ) -> None:
        """What an engine tells the optimizer about the tensors it steps, in one call that replaces any earlier:

        ``resolver`` maps a stepped tensor that is one parameter to its ``MatrixLayout`` (default
        ``sharding.discover.layout_of``: DTensor placements, Megatron tensor-parallel attributes, else whole);
        ``flat`` lists the engine's flat partitions (DeepSpeed ZeRO) with the matrix fragments each holds. From
        then on those partitions are what the optimizer steps (``stepped_tensors``) and their per-matrix state
        nests under the fragment names (``matrix_state``)."""
        self._layout_resolver = resolver if resolver is not None else layout_of
        self._fragments.clear()
        self._attached.clear()
        batched = self._batched_names()
        for tensor, fragments in flat:
            self._fragments[id(tensor)] = [m for f in fragments for m in (split_flat(f) if f.name in batched else (f,))]
            self._attached[id(tensor)] = tensor
        self._forget_plans()

    def _batched_names(self) -> set[str]:
        """Names of the 3-D parameters that matrix rules step as batches of matrices (``sharding.batched``): those
        of groups whose treatment is not AdamW."""
        out: set[str] = set()
        shapes = self.__dict__.get("group_param_shapes") or [[] for _ in self.group_param_names]
        for group, names, group_shapes in zip(self._groups(), self.group_param_names, shapes):
            if group.get("treatment", "adamw") != "adamw":
                out.update(n for n, shape in zip(names, group_shapes) if len(shape) == BATCHED_NDIM)
        return out

    def _is_batched(self, p: torch.Tensor) -> bool:
        """Whether real parameter ``p`` is a batch of matrices (``_batched_names``)."""
        return len(_logical_shape(p)) == BATCHED_NDIM and self.param_names.get(id(p)) in self._batched_names()

    def _make_team_groups(self) -> None:
        """Before the first step on new plans, every rank makes the process groups of every rank's teams
        (``teams.create_team_groups``, collective over the default group), so that a team's reductions run on
        groups all its members know, whatever teams each of them is in."""
        if not self.whole_matrix_work or self.__dict__.get("_team_groups_made"):
            return
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            teams = [
                t
                for g in range(len(self._groups()))
                if (ops := self.matrix_plan(g)) is not None
                for t in ops.team_sets()
            ]
            create_team_groups(teams)
        self._team_groups_made = True

    def _forget_plans(self) -> None:
        """Layouts changed (an engine attached its partitions): whole-matrix plans are rebuilt on next use."""
        self.__dict__.pop("_team_groups_made", None)
        self._ops_cache.clear()
        self._matrix_plans.clear()
        self._matrix_owner.clear()
        self.__dict__.get("_grouped_plans", {}).clear()
        self.__dict__.pop("_verified_tensors", None)  # plugin.wrapped's pre-step check runs again

    # ------------------------------------------------------------------ copy / pickle
    #: attributes keyed by ``id(tensor)``: copied as (tensor, value) pairs so they follow the copied tensors
    _BY_TENSOR_ID = ("param_names", "_fragments", "_attached")
    #: caches keyed by object identity, rebuilt on the next step
    _IDENTITY_CACHES: tuple[str, ...] = (
        "_ops_cache",
        "_matrix_plans",
        "_matrix_owner",
        "_grouped_plans",
        "_verified_tensors",
    )

    def __getstate__(self) -> dict[str, Any]:
        """Everything but hooks (as torch) and identity caches, so ``copy.deepcopy`` and pickle give an
        optimizer that steps identically."""
        settle_device_skip(self)  # a device-decided skip is on the host before anything is copied
        state = {
            k: v for k, v in self.__dict__.items() if not k.startswith("_optimizer_") and k != "_zero_grad_profile_name"
        }
        tensors = {
            id(t): t
            for t in chain(
                (p for g in self.param_groups for p in g["params"]), self.__dict__.get("_attached", {}).values()
            )
        }
        for key in self._BY_TENSOR_ID:  # entries of tensors the optimizer does not hold cannot follow a copy
            if key in state:
                state[key] = [(tensors[i], v) for i, v in state[key].items() if i in tensors]
        for key in self._IDENTITY_CACHES:
            if key in state:
                state[key] = type(state[key])()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        if "skipped_steps" in state:  # pickled before it became a property (nonfinite.settle_device_skip)
            state["_skipped_steps"] = state.pop("skipped_steps")
        for key in self._BY_TENSOR_ID:
            if isinstance(state.get(key), list):
                state[key] = {id(t): v for t, v in state[key]}
        super().__setstate__(state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``torch.optim`` loading (pre/post hooks, group checks, ``param_names``) with shardopt's state policy.

        torch casts floating state to each parameter's dtype; shardopt's statistics are fp32 whatever the
        parameter dtype, so here tensors only move to the parameter's device and floating ones are (or stay)
        fp32: a bf16 model's state survives ``load_state_dict(state_dict())`` bit-exactly. A number ``step``
        (older state dicts) becomes a tensor; entries not keyed by a parameter (a hook's flags) are kept as
        they are. ``param_names`` in the loaded groups also rename the parameters here, so seeded draws (SUMO,
        Alice) go on with the saved names; a state dict without names keeps this optimizer's names (torch's
        rule), so its later draws follow those.
        """
        settle_device_skip(self)  # the last step's host counters as they are, before they are replaced
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        state_dict = self._renamed_state_keys(state_dict)
        groups = self.param_groups
        saved_groups = copy.deepcopy(state_dict["param_groups"])
        if len(groups) != len(saved_groups):
            raise ValueError(
                f"loaded state dict has a different number of parameter groups ({len(saved_groups)}, "
                f"this optimizer has {len(groups)}); build the optimizer with the same parameters "
                "and routing (named and unnamed parameters can route differently)"
            )
        for i, (g, saved) in enumerate(zip(groups, saved_groups)):
            if len(g["params"]) != len(saved["params"]):
                raise ValueError(
                    "loaded state dict contains a parameter group that doesn't match the size of "
                    f"optimizer's group (group {i}: {len(saved['params'])} saved, {len(g['params'])} here)"
                )
        id_map = dict(
            zip(
                chain.from_iterable(g["params"] for g in saved_groups), chain.from_iterable(g["params"] for g in groups)
            )
        )
        state_dict = self._local_state_entries(state_dict, id_map)  # small-state shares as this rank keeps them
        state: defaultdict[Any, Any] = defaultdict(dict)
        for k, v in state_dict["state"].items():
            if k in id_map:
                p = id_map[k]
                state[p] = _state_for_param(v, p.device)
            else:
                state[k] = v
        for g, saved in zip(groups, saved_groups):
            saved["params"] = g["params"]
            if "param_names" in g and "param_names" not in saved:
                saved["param_names"] = g["param_names"]
        self.state = state
        self.param_groups = saved_groups
        self._group_list = list(self.param_groups)  # new group dicts: plans are rebuilt from them
        self._forget_plans()
        self._adopt_param_names()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _renamed_state_keys(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``state_dict`` with the old state keys of ``state_key_renames`` under their new names (also inside
        the per-matrix ``"matrices"`` entries of engine flat partitions)."""
        renames = self.state_key_renames
        if not renames:
            return state_dict

        def rename(entries: Any) -> Any:
            if not isinstance(entries, dict):
                return entries
            out = {renames.get(k, k) if isinstance(k, str) else k: v for k, v in entries.items()}
            if isinstance(out.get("matrices"), dict):
                out["matrices"] = {n: rename(m) for n, m in out["matrices"].items()}
            return out

        return {**state_dict, "state": {k: rename(v) for k, v in state_dict.get("state", {}).items()}}

    def _adopt_param_names(self) -> None:
        """Take the groups' ``param_names`` as the parameters' names (fragments are rebuilt with them)."""
        renamed = False
        for i, g in enumerate(self.param_groups):
            names = g.get("param_names")
            if not names or len(names) != len(g["params"]):
                continue
            for p, name in zip(g["params"], names):
                if self.param_names.get(id(p)) != name and not self.is_flat(p):
                    self.param_names[id(p)] = name
                    self._fragments.pop(id(p), None)
                    renamed = True
            if i < len(self.group_param_names):
                self.group_param_names[i] = list(names)
        if renamed and hasattr(self, "_ops_cache"):
            self._forget_plans()

    def stepped_tensors(self) -> list[torch.Tensor]:
        """Every tensor this optimizer steps, in a rank-independent order (engine flat partitions when an
        engine attached them, since DeepSpeed ZeRO-3 empties ``param_groups`` between steps)."""
        if self._attached:
            return list(self._attached.values())
        return [p for g in self.param_groups for p in g["params"]]

    def is_flat(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is an engine's flat partition holding pieces of several parameters (``use_layouts``)."""
        return id(p) in self.__dict__.get("_attached", {})

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim`` state dict whose per-row/per-column statistics are complete on every rank.

        Sharded steps keep such vectors valid only where a rank needs them; here one bucketed all-reduce of
        the owner-counted values makes them truly identical on all ranks, so DCP (which takes plain tensors
        as replicated) and any later world size see the whole vector. Call it on every rank together.
        """
        settle_device_skip(self)  # step counts of a step skipped on the device are taken back first
        self.sync_state()
        sd = super().state_dict()
        rnd = Round()
        even: list[tuple[dict, str, tuple]] = []  # FSDP2: small-state shares -> even DTensor chunks for DCP
        packed = sd["state"]
        by_index = dict(enumerate(p for g in self.param_groups for p in g["params"]))
        for idx, entries in list(packed.items()):
            p = by_index.get(idx)
            if p is None:
                continue
            new = self._copy_entries(p, entries)
            for frag in self.fragments(p):
                target = self.matrix_state(p, frag, new, create=False)
                if target is None:
                    continue
                for key, value in list(target.items()):
                    kind = self.state_kinds.get(key)
                    if kind == "matrix" and value.dim() and frag.layout.group is not None and _is_dtensor(p):
                        even.append((target, key, self._even_entry(p, frag.name, key, value)))
                    if kind in ("rows", "cols") and frag.layout.group is not None:
                        owned = frag.layout.axis_plan(self.line_axis(frag, kind)).owned
                        full = torch.zeros_like(value)
                        full[owned] = value[owned]
                        rnd.add_full(frag.layout, full)
                        target[key] = full
            packed[idx] = new
        rnd.run()
        for (target, key, _), dt in zip(even, shares_to_dtensors([e for _, _, e in even])):
            target[key] = dt
        return sd

    def _even_entry(self, p: torch.Tensor, name: str, key: str, value: torch.Tensor) -> tuple:
        """What ``shares_to_dtensors`` needs to give a "matrix"-kind share the parameter's mesh: DCP then
        writes each element once (no replicated copy) and reshards it like any DTensor."""
        share = self.matrix_state_share(name)
        assert share is not None, name  # callers pass matrices with "matrix"-kind state
        plan, spec = share
        shape, dim = spec[key]
        mesh, mesh_dim = shard_mesh(p)
        return plan, value, tuple(shape), dim, mesh, mesh_dim

    def _local_state_entries(self, state_dict: dict[str, Any], id_map: dict[Any, torch.Tensor]) -> dict[str, Any]:
        """Give every "matrix"-kind entry the shape this rank keeps: even DTensor chunks (a DCP load) are
        redistributed to this rank's share (one all-to-all per group; collective, as ``set_state_dict`` is),
        a whole tensor (a per-rank state dict from before shares) is cut to it."""
        state: dict[Any, Any] = {}
        pending: list[tuple[dict, str, Any]] = []  # (target, key, a dtensors_to_shares entry)
        for idx, entries in state_dict.get("state", {}).items():
            p = id_map.get(idx)  # saved keys: indices, or names (DCP's get_state_dict)
            if p is None or not isinstance(entries, dict):
                state[idx] = entries
                continue
            entries = self._copy_entries(p, entries)
            for name, target in self.matrix_states(p, entries):
                for key, value in list(target.items()):
                    found = self.matrix_state_share(name) if self.state_kinds.get(key) == "matrix" else None
                    if found is None or key not in found[1] or found[1][key][1] is None:
                        continue
                    plan, (shape, dim) = found[0], found[1][key]
                    if _is_dtensor(value):
                        pending.append((target, key, (plan, value.to_local(), tuple(shape), dim)))
                    elif tuple(value.shape) == tuple(shape) and share_shape(plan, shape, dim) != tuple(shape):
                        target[key] = keep_share(plan, value, dim)
            state[idx] = entries
        for (target, key, _), share in zip(pending, dtensors_to_shares([e for _, _, e in pending])):
            target[key] = share
        return {**state_dict, "state": state}

    def fragments(self, p: torch.Tensor) -> list[Fragment]:
        """The matrices stepped tensor ``p`` holds: the fragments an engine declared (``use_layouts``), else one
        whole parameter laid out by the resolver."""
        frags = self._fragments.get(id(p))
        if frags is None:
            name = self.param_names.get(id(p), f"param@{id(p):x}")
            if self._is_batched(p):  # fused experts: one fragment per matrix (sharding.batched)
                frags = batched_fragments(p, name, self._layout_resolver)
            else:
                frags = [Fragment(name, self._layout_resolver(p), 0, _logical_shape(p))]
            self._fragments[id(p)] = frags
        return frags

    def nests(self, p: torch.Tensor) -> bool:
        """Whether stepped tensor ``p`` keeps per-matrix state under ``state[p]["matrices"][name]``: an engine's
        flat partition, or a batched parameter (several matrices in one tensor); else its state is its own."""
        if self.is_flat(p):
            return True
        frags = self.fragments(p)
        return not frags or frags[0].index is not None

    # ------------------------------------------------------------------ per-matrix state
    # The one place that knows how per-matrix state nests: a tensor that is one parameter keeps it in its own
    # entries (``state[p]``, as torch.optim), an engine's flat partition under ``state[p]["matrices"][name]``
    # next to its tensor-level entries (element-wise moments, ``step``). Checkpoints of either engine use this.
    MATRICES = "matrices"

    @overload
    def matrix_state(
        self, p: torch.Tensor, frag: Fragment, entries: dict | None = None, create: Literal[True] = True
    ) -> dict: ...

    @overload
    def matrix_state(
        self, p: torch.Tensor, frag: Fragment, entries: dict | None = None, *, create: bool
    ) -> dict | None: ...

    def matrix_state(
        self, p: torch.Tensor, frag: Fragment, entries: dict | None = None, create: bool = True
    ) -> dict | None:
        """Matrix ``frag``'s state inside ``entries`` (default ``self.state[p]``); None if ``create`` is false
        and a flat partition holds none for it yet."""
        st = self.state[p] if entries is None else entries
        if not self.nests(p):
            return st
        if create:
            return st.setdefault(self.MATRICES, {}).setdefault(frag.name, {})
        return st.get(self.MATRICES, {}).get(frag.name)

    def matrix_states(self, p: torch.Tensor, entries: dict) -> list[tuple[str, dict]]:
        """``(matrix name, its state)`` for every matrix with state in ``entries`` (``p``'s state entries)."""
        if not self.nests(p):
            return [(self.fragments(p)[0].name, entries)]
        return list(entries.get(self.MATRICES, {}).items())

    def tensor_entries(self, p: torch.Tensor, entries: dict) -> dict:
        """``entries`` without the per-matrix ones: what belongs to the stepped tensor as a whole."""
        return {k: v for k, v in entries.items() if not (k == self.MATRICES and self.nests(p))}

    def _copy_entries(self, p: torch.Tensor, entries: dict) -> dict:
        """A copy of ``p``'s state entries whose per-matrix dicts may be replaced without touching the state."""
        new = dict(entries)
        if self.nests(p):
            new[self.MATRICES] = {n: dict(m) for n, m in (entries.get(self.MATRICES) or {}).items()}
        return new

    def _matrix_items(
        self, group: dict, source: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    ) -> list[MatrixItem]:
        """Every matrix of ``group`` with its fp32 local gradient (zeros when missing; all ranks list the same
        matrices in the same order, so collectives match even with empty shards or missing grads)."""
        items = []
        for p in group["params"]:
            has_grad = p.grad is not None
            src = None
            if has_grad:
                src = p.grad if source is None else source(p, p.grad)
            for frag in self.fragments(p):
                if src is not None:
                    g = frag.local(src)
                    g = g if g.dtype is torch.float32 else g.float()
                else:
                    g = torch.zeros(frag.numel, dtype=torch.float32, device=local_flat(p).device)
                items.append(MatrixItem(frag, p, g, self.matrix_state(p, frag), has_grad))
        return items

    def _step_count(self, p: torch.Tensor, only_with_grad: bool = False) -> int:
        """``p``'s step count including this step.

        ``only_with_grad`` (AdamW): it advances only when ``p`` has a gradient, as in ``torch.optim.AdamW``, so
        a grad-less step or a frozen layer leaves the bias correction where it was. Matrix rules count every
        step: their refresh schedules drive collectives, and a rank may lack a gradient that another has.
        """
        st = self.state[p]
        step = st.get("step", 0)
        if not isinstance(step, torch.Tensor):  # a new parameter, or a number from an older state dict
            step = st["step"] = torch.tensor(float(step), dtype=torch.float32)
        if p.grad is not None or not only_with_grad:
            step += 1
        return int(step.item())

    def _step_counts(self, params: Sequence[torch.Tensor]) -> dict[int, int]:
        """``{id(p): _step_count(p)}`` (every step counts) for many tensors: one foreach increment and one read
        when the counters are CPU float32 0-d tensors (as ``_step_count`` makes them), else one by one. In a step
        whose skip the device decides, the counters go back if it skips (``nonfinite.settle_device_skip``)."""
        counters = []
        for p in params:
            st = self.state[p]
            step = st.get("step", 0)
            if not isinstance(step, torch.Tensor):  # a new parameter, or a number from an older state dict
                step = st["step"] = torch.tensor(float(step), dtype=torch.float32)
            counters.append(step)
        if counters and all(c.dtype == torch.float32 and c.is_cpu and c.dim() == 0 for c in counters):
            # the tensor-list overload: the scalar one converts the scalar once per tensor on a CPU
            torch._foreach_add_(counters, [counters[0].new_ones(())] * len(counters))
            out = {id(p): int(v) for p, v in zip(params, torch.stack(counters).tolist())}
        else:
            out = {id(p): self._step_count(p) for p in params}
        if self._step_gate is not None:
            self._pending_skip.counts += [self.state[p]["step"] for p in params]
        return out

    def iteration_precision(self, group: dict) -> str:
        """The precision of ``group``'s whole-matrix iterations: ``matrix_ops.precision`` with ``"auto"`` resolved
        for this rule and the device its tensors live on (``sharding.precision``)."""
        return resolve_precision(self.matrix_precision, group.get("treatment", ""), self._device_type(group) or "cpu")

    # ------------------------------------------------------------------ stepping
    def zero_grad(self, set_to_none: bool = True) -> None:
        """``torch.optim.Optimizer.zero_grad``, then the adapters' hooks (``hooks.zero_grad_hooks``): where the
        stepped tensors stand in for an engine's own (legacy FSDP's flat parameters), those gradients clear too."""
        super().zero_grad(set_to_none)
        run_zero_grad_hooks(self, set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        driver = self.__dict__.get("_optimizer_step_driver")  # optim.in_backward: stepping in backward, bf16 rounding
        if driver is not None:
            return driver.step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        settle_device_skip(self)  # the last step's skip, if the device decided it
        run_pre_step_checks(self)  # hooks.pre_step_checks: a wrapper's flat partitions mapped (DeepSpeed) or refused
        params = [p for g in self.param_groups for p in g["params"]]
        align_grads(params, self.param_names)  # DTensor gradients laid out otherwise than their parameters
        with contiguous_steps(params), collective_counter.capture(self._comm_stats):
            if self.debug_plan:
                check_same_plan(self)
            self._make_team_groups()
            if self.on_nonfinite != "ignore" and not self.engine_skips_nonfinite:
                if self._gates_on_device():
                    gate_step(self)
                elif self._nonfinite_grads():
                    return loss
            try:
                for group in self.param_groups:
                    getattr(self, f"_step_{group['treatment']}")(_float_lr(group))
            finally:
                end_gate(self)
        return loss

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for non-finite gradients (a skip decided on the device is counted from here on)."""
        settle_device_skip(self)
        return self._skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skipped_steps = value

    def skips_on_device(self, group: dict) -> bool:
        """Whether ``group``'s rule gates every write of its step by ``self._step_gate`` / ``_step_found_inf``
        (a skipped step then writes nothing with no host read; ``nonfinite.gate_step``). AdamW does with its fused
        kernel; a matrix rule says so by overriding this."""
        return group.get("treatment", "adamw") == "adamw" and adamw_gates_on_device(group)

    def _gates_on_device(self) -> bool:
        """Whether this step's skip is decided on the device (``nonfinite_on_device``)."""
        mode = self.nonfinite_on_device
        if self.on_nonfinite != "skip" or mode is False:
            return False
        stepped = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not stepped or (mode == "auto" and not local_tensor(stepped[0].grad).is_cuda):
            return False
        # fp32 weights only (mixed precision's master weights): a gated decay factor, a device tensor, would be
        # rounded to a bf16 weight's dtype where the host's float is not
        if any(p.dtype != torch.float32 for p in stepped):
            return False
        return all(self.skips_on_device(g) for g in self.param_groups)

    def comm_stats(self, reset: bool = False) -> dict[str, dict[str, float]]:
        """This rank's collectives since the last reset, by kind: ``{"stats" | "gather" | "realign" |
        "distributed" | "local": {"calls", "bytes", "flops"}}`` (bytes sent; FLOPs estimated for whole-matrix
        work, by the strategy that ran it)."""
        out = {k: dict(v) for k, v in self._comm_stats.items()}
        if reset:
            self._comm_stats.clear()
        return out

    # ------------------------------------------------------------------ whole-matrix work
    # Optimizers with whole-matrix work (Gram matrices, projections, factorizations) describe it per param
    # group with three static functions of the matrix shape; the base class builds one plan for all matrices
    # of the group, runs steps in buckets and keeps the small state split over the ranks between steps.
    def whole_matrix_transpose(self, group: dict, shape: tuple[int, int]) -> bool:
        """Whether the algorithm works on ``A = G^T`` (else ``A = G``) for an ``m x n`` matrix."""
        raise NotImplementedError

    def a_transpose(self, group: dict, shape: tuple[int, int]) -> bool:
        """``whole_matrix_transpose`` decided on the logical matrix: a weight stored in x out (``optim.transposed``)
        takes the other orientation of its stored ``shape``, so ``A`` is the same matrix as for its out x in twin
        (on a square one too, where the rule's tie would otherwise pick the other side)."""
        if is_transposed(group):
            return not self.whole_matrix_transpose(group, (shape[1], shape[0]))
        return self.whole_matrix_transpose(group, shape)

    def line_axis(self, frag: Fragment, kind: str) -> int:
        """The stored axis of matrix ``frag``'s per-line state of ``kind`` ("rows" or "cols", logical): a weight
        stored in x out keeps its per-row state along its stored columns (``optim.transposed``)."""
        axis = 0 if kind == "rows" else 1
        names = self.transposed_params()
        return 1 - axis if frag.name in names or frag.param in names else axis

    def transposed_params(self) -> frozenset[str]:
        """Names of the parameters stored in x out that their rule steps as the transpose (param groups with
        ``transposed``), as built."""
        groups = self._groups()
        cached = self.__dict__.get("_transposed_params")
        if cached is None or cached[0] != len(groups):
            names = frozenset(n for g, ns in zip(groups, self.group_param_names) if is_transposed(g) for n in ns)
            cached = self.__dict__["_transposed_params"] = (len(groups), names)
        return cached[1]

    def whole_matrix_cost(self, group: dict, a_shape: tuple[int, int], parts: int = 1) -> OpCost:
        """Estimated work, reduced elements and small-state size for the oriented ``A`` (rows x cols) when its
        rows are computed on ``parts`` ranks (1: whole on one rank; an algorithm may compute otherwise when
        they are spread, as Muon does), on the routes ``iterative_routes`` says the group takes."""
        raise NotImplementedError

    def iterative_routes(self, group: dict) -> bool:
        """Whether ``group``'s small factorizations run as batched products (``sharding.iterative``: CUDA, or
        forced): then its costs count products between refreshes. Meta tensors (``benchmarks.scale``) model a
        GPU, and take them too."""
        device = self._device_type(group) or "cpu"
        return iterative_device(torch.device("cuda" if device == "meta" else device))

    def matrix_state_spec(self, group: dict, a_shape: tuple[int, int]) -> StateSpec:
        """``{key: (logical shape, split dim or None)}`` of one matrix's small ("matrix"-kind) state."""
        return {}

    def _groups(self) -> list[dict]:
        """The param groups as built (DeepSpeed ZeRO-1/2 replace ``param_groups`` by a one-group list while
        they step it; the group dicts themselves stay the same objects)."""
        known = self.__dict__.setdefault("_group_list", [])
        for g in self.param_groups:
            if not any(g is k for k in known):
                known.append(g)
        return known

    def _group_index(self, group: dict) -> int:
        """Index of ``group`` in ``_groups()``; a rule may see a copy of its group (a tensor ``lr`` read as a
        float), which still holds the same ``params`` list."""
        return next(i for i, g in enumerate(self._groups()) if g is group or g["params"] is group["params"])

    def _fragments_by_group(self, all_groups: bool = False) -> dict[int, list[Fragment]]:
        """Every matrix of every whole-matrix group, in a rank-independent order. Flat engine partitions hold
        matrices of several groups (ZeRO-3 sub-groups hold part of one), so a matrix belongs to the group
        whose parameter names list it."""
        owner: dict[str, int] = {}
        for g, names in enumerate(self.group_param_names):
            for n in names:
                owner.setdefault(n, g)
        groups = self._groups()
        for g, group in enumerate(groups):
            for p in group["params"]:
                for frag in self.fragments(p):
                    owner.setdefault(frag.name, g)
        out: dict[int, list[Fragment]] = {}
        for p in self.stepped_tensors():
            for frag in self.fragments(p):
                gi = owner.get(frag.name, owner.get(frag.param))
                if (
                    gi is not None
                    and gi < len(groups)
                    and (all_groups or groups[gi].get("treatment", "adamw") != "adamw")
                ):
                    out.setdefault(gi, []).append(frag)
        return out

    def matrix_plan(self, g: int) -> MatrixOps | None:
        """The static whole-matrix plan of param group ``g`` (strategies, owners, row plans, state shares),
        built once from the layouts of all its matrices; None for groups without whole-matrix work."""
        if g in self._ops_cache:
            return self._ops_cache[g]
        group = self._groups()[g]
        frags = self._fragments_by_group().get(g, [])
        ops = None
        if self.whole_matrix_work and group.get("treatment", "adamw") in self.matrix_treatments and frags:
            transposes = [self.a_transpose(group, f.layout.shape) for f in frags]
            ops = MatrixOps(
                [f.layout for f in frags],
                [f.name for f in frags],
                transposes,
                self.matrix_strategy,
                lambda a_shape, parts=1: self.whole_matrix_cost(group, a_shape, parts),
                resolve_profile(self.matrix_profile, self._device_type(group)),
                self.matrix_memory_budget_mib,
                self.matrix_team_size,
            )
            for f, kind, owner, plan, place in zip(frags, ops.kinds, ops.owners, ops.plans, ops.placements):
                self._matrix_plans[f.name] = (g, plan.a_shape, place)
                if kind in ("gather", "team"):  # a team's members compute identical 0-d state: one of them wins
                    self._matrix_owner[f.name] = (owner, f.layout)
                else:
                    self._matrix_owner.pop(f.name, None)
        self._ops_cache[g] = ops
        return ops

    def _device_type(self, group: dict) -> str | None:
        """Where a group's tensors live (``matrix_ops.profile="auto"`` picks the CPU profile for CPU tensors);
        the same on every rank."""
        for p in list(group.get("params", [])) + list(self.stepped_tensors()):
            if isinstance(p, torch.Tensor):
                return p.device.type
        return None

    def matrix_state_share(self, name: str) -> tuple[Placement, StateSpec] | None:
        """Where matrix ``name``'s small state rests and its spec (None for matrices without such state)."""
        entry = self._matrix_plans.get(name)
        if entry is None:
            for g in range(len(self._groups())):
                self.matrix_plan(g)
            entry = self._matrix_plans.get(name)
        if entry is None:
            return None
        g, a_shape, place = entry
        return place, self.matrix_state_spec(self._groups()[g], a_shape)

    # ------------------------------------------------------------------ memory plan
    def elementwise_state_copies(self, group: dict) -> int:
        """fp32 tensors shaped like the parameter that a group's rule keeps (AdamW: its two moments)."""
        return 2 if group.get("treatment", "adamw") == "adamw" else 0

    def vector_state(self, group: dict, shape: tuple[int, int]) -> int:
        """Per-row/per-column statistics (kinds "rows", "cols", "scalar") one matrix keeps on every rank."""
        return 0

    def planned_state_elements(self, rank: int | None = None) -> dict[str, int]:
        """fp32 elements of optimizer state that ``rank`` of the layouts' groups (default: this rank) keeps
        after a step, by kind ("elements", "vectors", "matrix"), computed from the static plans alone, so one
        process can tell every rank's memory (benchmarks.scale); a test checks it against real allocations."""
        out = {"elements": 0, "vectors": 0, "matrix": 0}
        groups = self._groups()
        plans = {g: self.matrix_plan(g) for g in range(len(groups))}
        frags_by_group = self._fragments_by_group(all_groups=True)
        for g, frags in frags_by_group.items():
            group = groups[g]
            copies = self.elementwise_state_copies(group)
            ops = plans.get(g)
            index = {n: i for i, n in enumerate(ops.names)} if ops is not None else {}
            for f in frags:
                lay = f.layout
                r = lay.rank if rank is None else rank
                out["elements"] += copies * lay._piece_numel(lay.pieces[r])
                out["vectors"] += self.vector_state(group, lay.shape)
                if f.name in index:
                    assert ops is not None  # index is empty without a plan
                    i = index[f.name]
                    out["matrix"] += share_numel(
                        ops.placements[i], self.matrix_state_spec(group, ops.plans[i].a_shape), r
                    )
        return out

    def planned_transient_elements(self, rank: int | None = None) -> float:
        """fp32 elements of whole-matrix transients ``rank`` holds at most at once during a step (one bucket)."""
        limit = self.matrix_bucket_elements
        plans = [self.matrix_plan(g) for g in range(len(self._groups()))]
        return max((ops.peak_transient(limit, rank) for ops in plans if ops is not None), default=0.0)

    def _whole_here_items(
        self, group: dict, items: list["MatrixItem"]
    ) -> tuple[list["MatrixItem"], list["MatrixItem"]]:
        """``items`` as (held whole by this rank, shared with other ranks) by the group's plan
        (``MatrixOps.here``); the matrices another rank holds whole are in neither: nothing of them is here."""
        plan = self.matrix_plan(self._group_index(group))
        if plan is None or plan.all_here:
            return list(items), []
        by_name = {it.frag.name: it for it in items}
        here, shared = (
            [by_name[plan.names[i]] for i in part if plan.names[i] in by_name] for part in plan.here_and_shared()
        )
        return here, shared

    def _run_whole_matrix(
        self, group: dict, items: list["MatrixItem"], body: Callable[[list["MatrixItem"], MatrixOps], None]
    ) -> None:
        """``_whole_matrix_buckets``, timed by ``whole_matrix_timing``."""
        with self.whole_matrix_timing():
            self._whole_matrix_buckets(group, items, body)

    @contextlib.contextmanager
    def whole_matrix_timing(self) -> Iterator[None]:
        """Adds the CPU time of this thread inside the block to ``whole_matrix_cpu_s`` (issue 27: the work that
        divides over the ranks, measured per rank; a rank blocked in a collective spends no CPU time)."""
        t0 = time.thread_time()
        try:
            yield
        finally:
            self.whole_matrix_cpu_s = getattr(self, "whole_matrix_cpu_s", 0.0) + time.thread_time() - t0

    def _whole_matrix_buckets(
        self, group: dict, items: list["MatrixItem"], body: Callable[[list["MatrixItem"], MatrixOps], None]
    ) -> None:
        """``body(items, ops)`` bucket by bucket, with the buckets' split state gathered
        (``whole_matrix.run_buckets``)."""
        run_buckets(self, group, items, body)

    def sync_state(self) -> None:
        """Make every 0-d "matrix"-kind entry (counters, limiter norms) identical on all ranks: under the gather
        strategy the owner's value wins (one bucketed all-reduce). Larger small state is never replicated: it
        stays split over the ranks (``matrix_state_spec``). Collective; ``state_dict`` and checkpoints call it."""
        rnd = Round()
        for p in self.stepped_tensors():
            for frag in self.fragments(p):
                owner = self._matrix_owner.get(frag.name)
                if owner is None:
                    continue
                rank, layout = owner
                target = self.matrix_state(p, frag, self.state.get(p, {}), create=False) or {}
                for key in sorted(target):
                    if self.state_kinds.get(key) == "matrix" and target[key].dim() == 0:
                        if layout.rank != rank:
                            target[key].zero_()
                        rnd.add_full(layout, target[key].view(1))
        rnd.run()

    def _nonfinite_grads(self) -> bool:
        """Whether any rank has a non-finite gradient in this step (``nonfinite.nonfinite_grads``)."""
        return nonfinite_grads(self)

    def _step_adamw(self, group: dict) -> None:
        """AdamW on the group's tensors that have a gradient (``adamw.adamw_group_step``)."""
        adamw_group_step(self, group)
