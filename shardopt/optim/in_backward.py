"""Stepping inside backward: each param group is stepped as soon as its gradients are complete, and freed.

A step's peak holds the weights, every gradient and the optimizer state. The matrix rules keep little state, so
the full gradient buffer is the next largest term; stepping each group from its parameters' post-accumulate-grad
hooks (GaLore's "per-layer weight updates", torchtune's ``optimizer_in_bwd``) frees each gradient right after
its group stepped, so at most one group's gradients are alive at once.

``create_optimizer(model, name, step_in_backward=True)`` builds the usual optimizer object (roles, one state
dict, LR schedulers) with its param groups split per layer (``split_groups_by_layer``: a group is the unit of
stepping, so per-group plans, caches and collectives stay what the ordinary step uses) and attaches a
``StepDriver``. ``ShardedOptimizer.step`` hands over to the driver, which then steps only what backward left
(groups whose parameters got no gradient) and closes the step.

Where the gradients are complete depends on the engine:

* one process, and FSDP2 (which calls the hooks of its sharded parameters after their reduce-scatter): the
  parameters' ``register_post_accumulate_grad_hook``;
* DDP: its post-accumulate-grad hooks fire before the all-reduce, so the driver registers a DDP communication
  hook instead that all-reduces each DDP bucket (the default hook's average) and marks its parameters complete;
* DeepSpeed: refused (its ZeRO stages own the gradient buffers and step flat partitions after its own
  reduction; no hook hands a finished gradient to the optimizer).

Every rank sees its groups complete in the same order (the backward graph is the same on every rank, and FSDP2
and DDP call back in a fixed order), so the collectives a group's step issues match across ranks.

What a whole step needs before anything is stepped cannot work here and is refused when the mode is chosen
(``check_in_backward_options``) or when it happens: accumulating gradients over micro-batches (a second backward
before ``step``/``zero_grad`` raises), clipping by the global gradient norm (use ``clip_grad_per_param``), and the
whole-step non-finite check (``on_nonfinite`` other than ``"ignore"``).

bf16 weights without an fp32 master copy (``bf16_updates="stochastic"``, any mode): a bf16 parameter's group is
stepped on an fp32 copy of its local elements, which is then rounded stochastically to bf16
(``sharding.stochastic_round``: the random bits follow the element's logical index in the unsharded parameter,
the step and a seed, never the rank, so any sharding rounds alike).
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from ..sharding.comm import collective_counter
from ..sharding.discover import align_grads
from ..sharding.fragment import local_tensor
from ..sharding.host_heap import release_free_heap
from ..sharding.plan import check_same_plan
from ..sharding.stochastic_round import logical_index_offsets, stochastic_round_
from .config import ConfigError
from .contiguous import contiguous_steps
from .hooks import register_zero_grad_hook, run_pre_step_checks

if TYPE_CHECKING:
    from .base import ShardedOptimizer

__all__ = [
    "StepDriver",
    "split_groups_by_layer",
    "layer_key",
    "check_in_backward_options",
    "driver_of",
    "BF16_UPDATES",
    "DRIVER_ATTR",
]

#: how a bf16 parameter takes its update: "nearest" (torch's rounding; the ordinary step), "stochastic"
BF16_UPDATES = ("nearest", "stochastic")

#: the optimizer attribute that holds the driver: torch's ``_optimizer_`` prefix keeps it (and its hooks) out of
#: pickles and deep copies (``ShardedOptimizer.__getstate__``), as torch's own hook dictionaries
DRIVER_ATTR = "_optimizer_step_driver"

#: the param-group key counting a group's stochastically rounded steps (the hash's step)
ROUND_STEP = "bf16_round_step"

ACCUMULATION_FIX = (
    "gradient accumulation across micro-batches is not possible with step_in_backward=True: each group is "
    "stepped as its gradient completes in backward, so a second backward before optimizer.step() (or "
    "zero_grad()) would step again on one micro-batch's gradient. Use one backward per step (a larger "
    "micro-batch), or build the optimizer without step_in_backward"
)


def layer_key(name: str) -> str:
    """The unit a parameter is stepped with in backward: its name up to the first numeric part (the layer:
    ``model.layers.3``), else the whole name (embeddings, the final norm, the LM head each on their own)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return name


def split_groups_by_layer(groups: list[dict], names: dict[int, str] | None = None) -> list[dict]:
    """Each param group split into one group per layer (``layer_key``), in order, keeping the group's options
    and its per-tensor name lists (torch's ``param_names``, ``create_optimizer``'s ``names``): the driver steps a
    group once all its gradients are complete, so a layer's gradients are freed with it. A tensor's name is the
    group's own, else ``names[id(tensor)]``."""
    lists = ("param_names", "names")
    out: list[dict] = []
    for g in groups:
        parts: dict[str, dict] = {}
        per_tensor = {k: g[k] for k in lists if isinstance(g.get(k), list) and len(g[k]) == len(g["params"])}
        for i, p in enumerate(g["params"]):
            name = next((v[i] for v in per_tensor.values() if v[i]), None) or (names or {}).get(id(p), "")
            key = layer_key(name)
            part = parts.get(key)
            if part is None:
                part = parts[key] = {k: v for k, v in g.items() if k != "params" and k not in per_tensor}
                part["params"] = []
                for k in per_tensor:
                    part[k] = []
            part["params"].append(p)
            for k, v in per_tensor.items():
                part[k].append(v[i])
        out.extend(parts.values())
    return out


def check_in_backward_options(hyperparameters: dict[str, Any]) -> None:
    """Refuse what needs the whole step before anything is stepped (see the module docstring); sets the
    non-finite policy the mode implies (``"ignore"``) where none was given."""
    chosen = hyperparameters.get("on_nonfinite")
    if chosen not in (None, "ignore"):
        raise ConfigError(
            f"create_optimizer.on_nonfinite: {chosen!r} checks every gradient of the step before any is applied, "
            "which step_in_backward=True cannot wait for (groups are stepped as their gradients complete); "
            "use on_nonfinite='ignore' (the mode's default), or step_in_backward=False"
        )
    hyperparameters["on_nonfinite"] = "ignore"


def driver_of(opt: Any) -> "StepDriver | None":
    """The step driver attached to ``opt`` (None: the ordinary step)."""
    return getattr(opt, "__dict__", {}).get(DRIVER_ATTR)


def _engine_of(model: Any) -> str:
    """``"ddp"``, or ``"hooks"`` (one process, FSDP2); DeepSpeed engines refused."""
    if type(model).__name__ == "DeepSpeedEngine" or hasattr(model, "zero_optimization_stage"):
        raise ConfigError(
            "step_in_backward=True is not supported under DeepSpeed: ZeRO reduces gradients into its own flat "
            "buffers and steps its partitions after backward, and no hook hands a finished gradient to the "
            "optimizer; use FSDP2, DDP or one process for this mode, or step_in_backward=False with DeepSpeed"
        )
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return "ddp"
    plain = not any(hasattr(p, "placements") for p in model.parameters())
    if plain and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ConfigError(
            "step_in_backward=True got a model of plain (not DTensor) parameters in a process group of "
            f"{dist.get_world_size()} ranks: under DDP pass the DistributedDataParallel wrapper itself "
            "(create_optimizer(ddp_model, ...)), whose communication hook hands over the averaged gradients; "
            "a parameter's own hooks run before DDP's all-reduce and would step on this rank's gradient alone"
        )
    return "hooks"


def _float_lr(group: dict) -> dict:
    lr = group.get("lr")
    return {**group, "lr": float(lr)} if isinstance(lr, torch.Tensor) else group


class StepDriver:
    """Steps ``opt``'s param groups from backward (``in_backward``) and/or through fp32 copies of bf16 weights
    rounded stochastically (``bf16_updates="stochastic"``); ``ShardedOptimizer.step`` hands over to it."""

    def __init__(
        self,
        opt: ShardedOptimizer,
        model: Any = None,
        in_backward: bool = False,
        bf16_updates: str = "nearest",
        seed: int = 0,
        clip_grad_per_param: float | None = None,
    ):
        if bf16_updates not in BF16_UPDATES:
            raise ConfigError(f"create_optimizer.bf16_updates: {bf16_updates!r} is not one of {BF16_UPDATES}")
        if clip_grad_per_param is not None and not clip_grad_per_param > 0:
            raise ConfigError(f"create_optimizer.clip_grad_per_param: must be > 0, got {clip_grad_per_param!r}")
        self.opt = opt
        self.in_backward = in_backward
        self.stochastic = bf16_updates == "stochastic"
        self.seed = int(seed)
        self.clip = clip_grad_per_param
        #: group index of every parameter (the tensors stay the same objects when state dicts load)
        self._group_of: dict[int, int] = {id(p): gi for gi, g in enumerate(opt.param_groups) for p in g["params"]}
        #: per group the parameters whose gradient it waits for
        self._expected: dict[int, set[int]] = defaultdict(set)
        for gi, g in enumerate(opt.param_groups):
            self._expected[gi] = {id(p) for p in g["params"] if p.requires_grad}
        self._ready: dict[int, set[int]] = defaultdict(set)
        #: groups stepped since the last ``step``/``zero_grad`` (a second completion is accumulation)
        self._stepped: set[int] = set()
        self._handles: list[Any] = []
        #: whether this backward returned the C heap's free pages already (``_release_heap``)
        self._heap_released = False
        self.engine = "none"
        #: DDP's process group (the world, or a subgroup of data parallelism beside model parallelism)
        self.ddp_group: Any = None
        if in_backward:
            self.engine = _engine_of(model)
            if self.engine == "ddp":
                self.ddp_group = model.process_group
                model.register_comm_hook(self, _ddp_comm_hook)
            else:
                for g in opt.param_groups:
                    for p in g["params"]:
                        if p.requires_grad:
                            self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        #: groups stepped at the end of backward instead of when complete (``_deferred_groups``)
        self._defer = self._deferred_groups()
        self._deferred: list[int] = []
        setattr(opt, DRIVER_ATTR, self)

    def _deferred_groups(self) -> set[int]:
        """One process with bf16 weights stepped through fp32 copies: the groups outside the layers (embedding,
        final norm, LM head) are stepped at the end of backward, not when their gradient completes. The LM head's
        completes first, while every activation is alive, and its step's transient (the fp32 copies of a
        vocabulary x hidden matrix and its gradient) would sit on top of them: the step's peak. Its bf16
        gradient (a quarter of that) waits instead. Under FSDP2 those parameters complete at the end anyway."""
        if not (self.in_backward and self.stochastic and self.engine == "hooks"):
            return set()
        out = set()
        for gi, g in enumerate(self.opt.param_groups):
            params = g["params"]
            if any(hasattr(p, "placements") for p in params) or not any(p.dtype == torch.bfloat16 for p in params):
                continue
            names = [self.opt.param_names.get(id(p), "") for p in params]
            if all(layer_key(n) == n for n in names):
                out.add(gi)
        return out

    # ------------------------------------------------------------------ backward
    def _on_grad(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook (one process, FSDP2's sharded parameters after their reduce-scatter)."""
        gi = self._group_of.get(id(p))
        if gi is not None:
            self._mark(gi, p)

    def _mark(self, gi: int, p: torch.Tensor) -> None:
        if gi in self._stepped:
            raise RuntimeError(f"{type(self.opt).__name__}: {ACCUMULATION_FIX}")
        ready = self._ready[gi]
        ready.add(id(p))
        if ready >= self._expected[gi]:
            self._ready.pop(gi, None)
            self._stepped.add(gi)
            if gi in self._defer:
                if not self._deferred:
                    torch.autograd.Variable._execution_engine.queue_callback(self._step_deferred)
                self._deferred.append(gi)
                return
            if not self._heap_released:  # the first layer this backward steps
                self._release_heap([gi])
            self._step_groups([gi], free=True)

    def _release_heap(self, indices: list[int]) -> None:
        """In backward with bf16 weights rounded stochastically (the mode chosen where memory is tightest), on a
        CPU: return the C heap's free pages to the system (``host_heap``) before the first layer of a backward and
        before the deferred groups are stepped. glibc keeps what the forward, the previous step and backward freed
        for reuse, and the step's fp32 copies stacked on it. LLaMA-350M, SCALE, one process: peak RSS 1.94-2.04 GB
        with no trim, 1.78-1.81 GB trimming before the deferred step alone, 1.71-1.79 GB with both (seven runs);
        trimming before every layer too (1.71 GB) made steps about a third slower in one interleaved run, each
        trim's pages faulted in again by the next layer."""
        self._heap_released = True
        if self.stochastic and any(p.device.type == "cpu" for i in indices for p in self.opt.param_groups[i]["params"]):
            release_free_heap()

    def _step_deferred(self) -> None:
        """At the end of backward: the groups ``_deferred_groups`` held back, in the order they completed."""
        indices, self._deferred = self._deferred, []
        self._release_heap(indices)
        self._step_groups(indices, free=True)

    def mark_ready(self, params: Iterable[torch.Tensor]) -> None:
        """Engines that learn of finished gradients otherwise (DDP's comm hook) call this, in the same order on
        every rank."""
        for p in params:
            gi = self._group_of.get(id(p))
            if gi is not None:
                self._mark(gi, p)

    # ------------------------------------------------------------------ stepping
    @torch.no_grad()
    def _step_groups(self, indices: list[int], free: bool) -> None:
        """``ShardedOptimizer.step``'s body for the groups ``indices`` (no whole-step non-finite gate: the mode
        refuses it); ``free``: their gradients are released afterwards."""
        opt = self.opt
        run_pre_step_checks(opt)
        groups = [opt.param_groups[i] for i in indices]
        params = [p for g in groups for p in g["params"]]
        align_grads(params, opt.param_names)
        if self.clip is not None:
            self._clip(params)
        with contiguous_steps(params), collective_counter.capture(opt._comm_stats):
            if opt.debug_plan:
                check_same_plan(opt)
            opt._make_team_groups()
            for group in groups:
                if self.stochastic and any(p.dtype == torch.bfloat16 for p in group["params"]):
                    self._step_shadowed(group, free)
                else:
                    getattr(opt, f"_step_{group['treatment']}")(_float_lr(group))
        if free:
            for p in params:
                p.grad = None

    def _clip(self, params: list[torch.Tensor]) -> None:
        """Each parameter's gradient scaled to norm at most ``clip`` (its own, logical norm: a DTensor's norm is
        computed over every shard); the per-parameter alternative to clipping by the global norm."""
        assert self.clip is not None
        for p in params:
            if p.grad is None:
                continue
            norm = p.grad.float().norm()
            if hasattr(norm, "full_tensor"):
                norm = norm.full_tensor()
            factor = torch.clamp(self.clip / (norm + 1e-6), max=1.0)
            local_tensor(p.grad).mul_(factor.to(local_tensor(p.grad).dtype))

    def _step_shadowed(self, group: dict, free: bool) -> None:
        """Step ``group`` with each bf16 parameter's local elements as an fp32 copy (its state, fragments and name
        moved over for the step), then round the copies into the bf16 parameters stochastically. ``free``: the
        bf16 gradient goes as soon as its fp32 copy exists (the step's transient is the two fp32 copies: at 350M
        the LM head's, 2 x 131 MB; converting the gradient first and dropping its copy before the rounding keeps
        the bf16 gradient and the rounding's chunks off that peak)."""
        opt = self.opt
        originals = list(group["params"])
        shadows: list[torch.Tensor] = []
        for p in originals:
            if p.dtype != torch.bfloat16:
                shadows.append(p)
                continue
            grad = None if p.grad is None else local_tensor(p.grad).float()
            if free and grad is not None:
                p.grad = None  # before the weight's copy is made: the bf16 gradient and both copies never coexist
            s = local_tensor(p).detach().float()
            s.grad = grad
            del grad
            opt._fragments[id(s)] = opt.fragments(p)
            opt.param_names[id(s)] = opt.param_names.get(id(p), "")
            if p in opt.state:
                opt.state[s] = opt.state.pop(p)
            shadows.append(s)
        # the step the random bits follow: a count of this group's rounded steps, kept in the group (state dicts
        # carry it, every rank counts alike; rules without state, SCALE's hidden matrices, keep no "step" of theirs)
        step = group[ROUND_STEP] = int(group.get(ROUND_STEP, 0)) + 1
        group["params"] = shadows
        try:
            getattr(opt, f"_step_{group['treatment']}")(_float_lr(group))
        finally:
            group["params"] = originals
            opt.__dict__.get("_grouped_plans", {}).pop(tuple(map(id, shadows)), None)
            for p, s in zip(originals, shadows):
                if s is p:
                    continue
                if s in opt.state:
                    opt.state[p] = opt.state.pop(s)
                opt._fragments.pop(id(s), None)
                opt.param_names.pop(id(s), None)
                s.grad = None  # the gradient's copy goes before the rounding's transients come
                stochastic_round_(local_tensor(p), s, logical_index_offsets(p), step, self.seed)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """What ``optimizer.step()`` does under the driver: run the closure (its backward steps the groups),
        step the groups backward did not complete (no gradient reached them, as the ordinary step would), and
        close the step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        n = len(self.opt.param_groups)
        left = [i for i in range(n) if i not in self._stepped] if self.in_backward else list(range(n))
        if left:
            self._step_groups(left, free=False)
        if self.in_backward:  # nothing outlives the step (DDP's finalize writes its averaged gradients back)
            for g in self.opt.param_groups:
                for p in g["params"]:
                    p.grad = None
        self.reset()
        return loss

    def reset(self) -> None:
        """A new step begins: nothing stepped, nothing ready."""
        self._stepped.clear()
        self._ready.clear()
        self._heap_released = False

    def remove(self) -> None:
        """Detach: remove the hooks and hand ``step`` back to the ordinary one."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.opt.__dict__.pop(DRIVER_ATTR, None)


def _ddp_comm_hook(driver: StepDriver, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default all-reduce (the average over the ranks of DDP's process group) done at once, then the
    bucket's parameters marked complete with their reduced gradients, so their groups step on the averaged
    gradient. Synchronous: the step must not overlap the reduction it needs."""
    tensor = bucket.buffer()
    tensor.div_(dist.get_world_size(driver.ddp_group))
    dist.all_reduce(tensor, group=driver.ddp_group)
    params = list(bucket.parameters())
    for p, g in zip(params, bucket.gradients()):
        p.grad = g
    driver.mark_ready(params)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(tensor)
    return fut


# DDP checks the annotations themselves (not their strings, which ``from __future__ import annotations`` makes)
_ddp_comm_hook.__annotations__ = {
    "driver": StepDriver,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def _reset_on_zero_grad(opt: Any, set_to_none: bool) -> None:
    driver = driver_of(opt)
    if driver is not None:
        driver.reset()


register_zero_grad_hook(_reset_on_zero_grad)
