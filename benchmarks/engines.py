"""One model + one shardopt optimizer on a chosen engine layout, with the optimizer step timed apart.

Layouts: ``single`` (one process), ``ddp``, ``fsdp2`` (row shards, one ``fully_shard`` per block and the
root, as the trainer does) and ``zero1`` / ``zero2`` / ``zero3`` (DeepSpeed through
``shardopt.deepspeed.initialize``). The benchmarks need three things from each: a forward/backward, the
engine's optimizer step, and the shardopt optimizer inside it (whose own ``step`` time is measured by
wrapping it, so ZeRO's parameter all-gather after the step is not charged to the optimizer).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from .optimizers import shardopt_of

__all__ = ["LAYOUTS", "EngineRun", "prepare", "random_batch"]

LAYOUTS = ("single", "ddp", "fsdp2", "zero1", "zero2", "zero3")


@dataclass
class EngineRun:
    """What a benchmark drives: ``forward_backward(x, y)``, ``step()``, and the shardopt optimizer."""

    forward_backward: Callable[[torch.Tensor, torch.Tensor], float]
    step: Callable[[], None]
    optimizer: Any
    optimizer_seconds: list[float] = field(default_factory=list)

    def timed_step(self) -> float:
        """One engine step; returns the seconds spent inside the shardopt optimizer's own ``step``
        (summed over ZeRO-3 sub-groups)."""
        before = len(self.optimizer_seconds)
        self.step()
        return sum(self.optimizer_seconds[before:])


def random_batch(step: int, batch: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token labels, different on every rank and step, reproducible."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    gen = torch.Generator().manual_seed(10_000 * step + rank)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _time_inner_steps(run: EngineRun) -> None:
    opt = run.optimizer
    inner = opt.step

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        run.optimizer_seconds.append(time.perf_counter() - t0)
        return out

    opt.step = timed


def _plain(model: torch.nn.Module, wrapped: torch.nn.Module, name: str, hp: dict[str, Any]) -> EngineRun:
    import shardopt

    opt = shardopt.create_optimizer(model, name, **hp)

    def forward_backward(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = wrapped(x, y)
        loss.backward()
        return float(loss.detach())

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    return EngineRun(forward_backward, step, opt)


def _fsdp2(model: torch.nn.Module, name: str, hp: dict[str, Any]) -> EngineRun:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _plain(model, model, name, hp)


def _zero(model: torch.nn.Module, stage: int, name: str, hp: dict[str, Any], micro_batch: int) -> EngineRun:
    import shardopt.deepspeed as sds

    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": stage},
        "shardopt": {"optimizer": name, "params": dict(hp)},
    }
    engine, _, _, _ = sds.initialize(model=model, config=config)

    def forward_backward(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = engine(x, y)
        engine.backward(loss)
        return float(loss.detach())

    return EngineRun(forward_backward, engine.step, shardopt_of(engine.optimizer))


def prepare(
    layout: str, model: torch.nn.Module, name: str, hp: dict[str, Any] | None = None, micro_batch: int = 2
) -> EngineRun:
    """``model`` (plain, on CPU) wrapped by ``layout`` with shardopt optimizer ``name``."""
    hp = dict(hp or {})
    if layout == "single":
        run = _plain(model, model, name, hp)
    elif layout == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        run = _plain(model, DDP(model), name, hp)
    elif layout == "fsdp2":
        run = _fsdp2(model, name, hp)
    elif layout in ("zero1", "zero2", "zero3"):
        run = _zero(model, int(layout[-1]), name, hp, micro_batch)
    else:
        raise ValueError(f"unknown layout {layout!r}; choose from {LAYOUTS}")
    _time_inner_steps(run)
    return run
