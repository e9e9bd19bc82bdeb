"""The reference LLaMA trainer: one loop for DeepSpeed ZeRO, FSDP2, DDP and a single process.

``torchrun --nproc_per_node 2 -m shardopt.train --config configs/train/demo.json``

Per step: ``train.grad_accum`` micro-batches of ``train.micro_batch_size`` sequences on every rank, one
optimizer step, one LR-scheduler step (linear warmup over ``warmup_fraction`` of the steps from 0, then
cosine to ``min_lr_ratio`` x peak, applied to every param group's own peak lr). Rank 0 shows a tqdm bar
and writes ``<run_dir>/metrics.jsonl``, ``<run_dir>/loss.png`` and ``<run_dir>/summary.json``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import math
import os
import socket
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from .config import AdamWParams, TrainConfig
from .data import PackedSequences, StepSampler, TokenData, prepare_data, validation_indices
from .model import Llama, count_str, model_config
from .process_group import init_default_group

__all__ = ["Trainer", "lr_lambda", "make_lr_lambda"]


def lr_lambda(step: int, total_steps: int, warmup_fraction: float = 0.1, min_lr_ratio: float = 0.1) -> float:
    """Multiplier of the peak lr after ``step`` optimizer steps: linear from 0 over the warmup, then
    cosine from 1 down to ``min_lr_ratio`` at ``total_steps`` (held there afterwards)."""
    warmup = int(round(warmup_fraction * total_steps))
    if step < warmup:
        return step / max(1, warmup)
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_lr_lambda(total_steps: int, warmup_fraction: float, min_lr_ratio: float) -> Callable[[int], float]:
    return lambda step: lr_lambda(step, total_steps, warmup_fraction, min_lr_ratio)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Trainer:
    # set by _build_<engine>: the model as each engine drives it (the module, DDP, an FSDP2 module or DeepSpeed's
    # engine), called through the engine's own methods (no_sync, backward, save_checkpoint, ...)
    model: Any

    def __init__(self, cfg: TrainConfig, resume: bool = False, log: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.resume = resume
        self.engine_name = cfg.engine.name
        self._log_fn = log
        self._setup_distributed()
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self.val_history: list[tuple[int, float]] = []

    # ------------------------------------------------------------------------------------------ setup
    def _setup_distributed(self) -> None:
        cfg = self.cfg
        world_env = int(os.environ.get("WORLD_SIZE", "1"))
        use_cuda = cfg.engine.device == "cuda" or (
            cfg.engine.device == "auto" and torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR") != "cpu"
        )
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = torch.device(f"cuda:{self.local_rank}" if use_cuda else "cpu")
        if use_cuda:
            torch.cuda.set_device(self.device)
        if self.engine_name == "single":
            if world_env > 1:
                raise RuntimeError("engine 'single' runs in one process; use ddp, fsdp2 or deepspeed under torchrun")
            self.rank, self.world = 0, 1
            return
        # torchrun sets these; a plain ``python -m shardopt.train`` gets a one-process group
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        backend = "nccl" if use_cuda else "gloo"
        timeout = None  # torch's default for the backend
        if self.engine_name == "deepspeed":
            if not use_cuda:
                os.environ.setdefault("DS_ACCELERATOR", "cpu")
            import deepspeed
            from deepspeed.constants import default_pg_timeout

            if cfg.engine.quiet:
                from deepspeed.utils import logger as ds_logger

                ds_logger.setLevel(logging.WARNING)
            timeout = default_pg_timeout  # what DeepSpeed's own group would get (DEEPSPEED_TIMEOUT)
        if not dist.is_initialized():
            # every engine on one default group, restart-safe under torchrun (process_group.py)
            init_default_group(backend, self.device, timeout)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.engine_name == "deepspeed":
            if not use_cuda:
                self.log(
                    f"starting DeepSpeed on cpu, {self.world} processes (the first run on a machine builds "
                    "DeepSpeed's CPU communication op: 1-2 minutes)"
                )
            deepspeed.init_distributed(dist_backend=backend)  # takes the default group as it is

    def log(self, msg: str) -> None:
        if self.rank != 0:
            return
        if self._log_fn is not None:
            self._log_fn(msg)
        elif (bar := getattr(self, "bar", None)) is not None:
            bar.write(msg)
        else:
            print(msg, flush=True)

    def _barrier(self) -> None:
        if self.world > 1 or dist.is_initialized():
            dist.barrier()

    def _build(self) -> None:
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        self.data: TokenData = prepare_data(
            source=cfg.data.source,
            path=cfg.data.path,
            val_path=cfg.data.val_path,
            vocab_size=cfg.data.vocab_size,
            val_documents=cfg.data.val_documents,
            val_fraction=cfg.data.val_fraction,
            token_dtype=cfg.data.token_dtype,
            cache_dir=cfg.data.cache_dir,
            log=self.log,
        )
        m = cfg.model
        mcfg = model_config(
            m.preset,
            self.data.vocab_size,
            hidden_size=m.hidden_size,
            intermediate_size=m.intermediate_size,
            num_heads=m.num_heads,
            num_layers=m.num_layers,
            rope_theta=m.rope_theta,
            norm_eps=m.norm_eps,
            init_std=m.init_std,
            tie_embeddings=m.tie_embeddings,
        )
        if cfg.data.seq_len is not None:
            mcfg = dataclasses.replace(mcfg, max_seq_len=cfg.data.seq_len)
        self.model_cfg = mcfg
        self.seq_len = mcfg.max_seq_len
        torch.manual_seed(cfg.seed)
        model = Llama(mcfg)
        self.n_params = model.num_parameters()
        self.train_set = PackedSequences(self.data.train, self.seq_len)
        self.val_set = PackedSequences(self.data.val, self.seq_len)
        t = cfg.train
        self.sampler = StepSampler(
            len(self.train_set), t.micro_batch_size, t.grad_accum, self.world, self.rank, cfg.seed
        )
        self.tokens_per_step = t.micro_batch_size * t.grad_accum * self.world * self.seq_len
        self.lr_fn = make_lr_lambda(t.steps, t.warmup_fraction, t.min_lr_ratio)
        self.opt_name = self._optimizer_name()
        getattr(self, f"_build_{self.engine_name}")(model)
        self.log(
            f"model {m.preset}: {count_str(self.n_params)} params (hidden {mcfg.hidden_size}, "
            f"{mcfg.num_layers} layers, {mcfg.num_heads} heads, vocab {mcfg.vocab_size}, seq {self.seq_len})"
        )
        self.log(f"data {self.data.description}")
        self.log(
            f"engine {self.engine_name} x {self.world} ranks on {self.device}, optimizer {self.opt_name}, "
            f"{self.tokens_per_step:,} tokens/step ({t.micro_batch_size} seq x {t.grad_accum} accum x "
            f"{self.world} ranks), {t.steps} steps = {t.steps * self.tokens_per_step / 1e6:.2f}M tokens, "
            f"{self.sampler.epoch(t.steps):.2f} epochs, bf16 {t.bf16}"
        )

    def _optimizer_name(self) -> str:
        if self.cfg.optimizer is not None:
            return self.cfg.optimizer.name
        if self.engine_name == "deepspeed":
            return self.cfg.deepspeed[1].optimizer.lower()
        return "scale"

    def _make_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        from ..optim.registry import build_optimizer, validate_hyperparameters

        oc = self.cfg.optimizer
        if self.opt_name == "adamw":
            assert oc is not None  # "adamw" comes from optimizer.name (a "shardopt" section names shardopt's only)
            adam = AdamWParams.model_validate(oc.params)
            return torch.optim.AdamW(
                model.parameters(), lr=adam.lr, betas=adam.betas, eps=adam.eps, weight_decay=adam.weight_decay
            )
        hp = oc.config if oc else validate_hyperparameters(self.opt_name, {})
        return build_optimizer(model, hp, (oc.routing if oc else None) or None, self.opt_name)

    def _autocast(self):
        if self.cfg.train.bf16 and self.engine_name in ("single", "ddp"):
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _build_single(self, model: torch.nn.Module) -> None:
        self.module = self.model = model.to(self.device)
        self.optimizer = self._make_optimizer(model)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.lr_fn)

    def _build_ddp(self, model: torch.nn.Module) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.module = model.to(self.device)
        self.model = DDP(self.module, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        self.optimizer = self._make_optimizer(self.module)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.lr_fn)

    def _build_fsdp2(self, model: Llama) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model = model.to(self.device)
        mesh = init_device_mesh(self.device.type, (self.world,))
        kw: dict[str, Any] = {"mesh": mesh}
        if self.cfg.train.bf16:
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        self.module = self.model = model
        self.optimizer = self._make_optimizer(model)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.lr_fn)

    def _deepspeed_config(self) -> dict[str, Any]:
        cfg, t = self.cfg, self.cfg.train
        ds, section = copy.deepcopy(cfg.deepspeed)
        for key, value in (
            ("train_micro_batch_size_per_gpu", t.micro_batch_size),
            ("gradient_accumulation_steps", t.grad_accum),
            ("gradient_clipping", t.grad_clip),
        ):
            if key in ds and ds[key] != value:
                self.log(
                    f"note: {key} = {ds[key]} in {cfg.engine.deepspeed_config} is replaced by the trainer's {value}"
                )
            ds[key] = value
        ds.pop("train_batch_size", None)  # derived by DeepSpeed from micro batch x accumulation x world size
        ds["bf16"] = {**ds.get("bf16", {}), "enabled": bool(t.bf16)}
        if ds.get("fp16", {}).get("enabled"):
            raise ValueError(f"{cfg.engine.deepspeed_config}: fp16 is not supported by the trainer; use train.bf16")
        ds.setdefault("steps_per_print", 10**9)
        ds.setdefault("wall_clock_breakdown", False)
        oc = cfg.optimizer
        if oc is None:
            ds["shardopt"] = section  # parsed by load_train_config; shardopt.deepspeed.initialize takes it as is
        elif oc.name != "adamw":
            from ..plugin.deepspeed_engine import ShardoptSection

            ds["shardopt"] = ShardoptSection.from_config(oc.config, oc.routing)
        else:
            ds.pop("shardopt", None)
            ds["zero_allow_untested_optimizer"] = True
        return ds

    def _build_deepspeed(self, model: torch.nn.Module) -> None:
        import deepspeed

        import shardopt.deepspeed as sds

        ds = self._deepspeed_config()
        self.ds_config = ds
        sched = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, self.lr_fn)  # noqa: E731
        if self.opt_name == "adamw":
            opt = self._make_optimizer(model)
            engine, optimizer, _, scheduler = deepspeed.initialize(
                model=model, optimizer=opt, config=ds, lr_scheduler=sched
            )
        else:
            engine, optimizer, _, scheduler = sds.initialize(model=model, config=ds, lr_scheduler=sched)
        self.model = engine
        self.module = engine.module
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.device = engine.device

    # ------------------------------------------------------------------------------------- step/eval
    def _micro_context(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        if self.engine_name == "ddp" and not last:
            return self.model.no_sync()
        if self.engine_name == "fsdp2" and self.cfg.train.grad_accum > 1:
            self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def train_step(self) -> float:
        """One optimizer step; returns this rank's mean micro-batch loss."""
        t = self.cfg.train
        self.model.train()
        total = 0.0
        for micro in range(t.grad_accum):
            x, y = self.train_set.batch(self.sampler.indices(self.step, micro))
            x, y = x.to(self.device), y.to(self.device)
            if self.engine_name == "deepspeed":
                loss = self.model(x, y)
                self.model.backward(loss)
                self.model.step()
            else:
                with self._micro_context(micro == t.grad_accum - 1), self._autocast():
                    loss = self.model(x, y)
                (loss / t.grad_accum).backward()
            total += loss.detach().float().item()
        if self.engine_name != "deepspeed":
            if t.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.module.parameters(), t.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return total / t.grad_accum

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation cross-entropy over a fixed set of sequences, averaged over all ranks."""
        self.model.eval()
        limit = self.cfg.eval.max_sequences
        n = len(self.val_set)
        k = min(n, limit) if limit > 0 else n
        k = max(self.world, (k // self.world) * self.world)  # equal work per rank (FSDP2/ZeRO-3 collectives)
        idx = validation_indices(n, k, self.rank, self.world) if n else []
        sums = torch.zeros(2, dtype=torch.float64)
        b = self.cfg.train.micro_batch_size
        n_batches = math.ceil(math.ceil(k / self.world) / b)
        for i in range(n_batches):
            chunk = idx[i * b : (i + 1) * b] or idx[:1]  # a short rank repeats a sequence but does not count it
            x, y = self.val_set.batch(chunk)
            with self._autocast():
                loss = self.model(x.to(self.device), y.to(self.device))
            if idx[i * b : (i + 1) * b]:
                sums[0] += loss.float().item() * y.numel()
                sums[1] += y.numel()
        if dist.is_initialized():
            dist.all_reduce(sums)
        self.model.train()
        return float(sums[0] / sums[1]) if sums[1] > 0 else float("nan")

    # ------------------------------------------------------------------------------------ checkpoints
    def _save(self) -> None:
        from ..checkpoint import commit

        root = self.cfg.checkpoint_dir
        tag = f"step_{self.step}"
        os.makedirs(root, exist_ok=True)
        if self.engine_name == "deepspeed":
            self.model.save_checkpoint(root, tag=tag, client_state={"step": self.step})
        elif self.engine_name == "fsdp2":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(root, tag))
            if self.rank == 0:
                torch.save(
                    {"step": self.step, "scheduler": self.scheduler.state_dict(), "world": self.world},
                    os.path.join(root, tag, "trainer_state.pt"),
                )
        else:
            os.makedirs(os.path.join(root, tag), exist_ok=True)
            # param_names: the optimizer's state is keyed by position; the names let offline tools
            # (shardopt checkpoint inspect/convert) tell which parameter each entry belongs to
            names = {id(p): n for n, p in self.module.named_parameters()}
            torch.save(
                {
                    "step": self.step,
                    "model": self.module.state_dict(),
                    "optim": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(),
                    "world": self.world,
                    "param_names": [[names.get(id(p), "") for p in g["params"]] for g in self.optimizer.param_groups],
                },
                os.path.join(root, tag, f"rank{self.rank}.pt"),
            )
        if self.engine_name != "deepspeed":  # DeepSpeed's save commits its tag itself (plugin.deepspeed_engine)
            commit.fsync_dir(os.path.join(root, tag))  # every rank's files on disk before the pointer names them
        self._barrier()
        if self.rank == 0 and self.engine_name != "deepspeed":
            commit.write_atomic(os.path.join(root, "latest"), tag)  # a crash leaves the old pointer, never half
            commit.clean(root)  # leftovers of interrupted saves
        self._barrier()
        self.log(f"checkpoint step {self.step} -> {os.path.join(root, tag)}")

    def _load(self) -> bool:
        from ..checkpoint.safe_pickle import load_plain  # never full pickle on files from disk

        root = self.cfg.checkpoint_dir
        latest = os.path.join(root, "latest")
        if not os.path.isfile(latest):
            self.log(f"--resume: no checkpoint under {root}; starting from step 0")
            return False
        tag = open(latest).read().strip()
        if self.engine_name == "deepspeed":
            path, client = self.model.load_checkpoint(root, tag=tag)
            if path is None:
                raise RuntimeError(f"DeepSpeed could not load checkpoint {root}/{tag}")
            # a checkpoint converted by `shardopt checkpoint convert` has no client state: the engine's own
            # global step (restored from the converted file) is the step
            self.step = int((client or {}).get("step", self.model.global_steps))
        elif self.engine_name == "fsdp2":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            from ..checkpoint.safe_pickle import SafeFileSystemReader, SafeLoadPlanner

            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
            # DCP's default reader and planner unpickle .metadata and non-tensor values with full pickle
            dcp.load(state, storage_reader=SafeFileSystemReader(os.path.join(root, tag)), planner=SafeLoadPlanner())
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
            extra = load_plain(os.path.join(root, tag, "trainer_state.pt"))
            self.scheduler.load_state_dict(extra["scheduler"])
            self.step = int(extra["step"])
        else:
            path = os.path.join(root, tag, f"rank{self.rank}.pt")
            ck = load_plain(path, map_location=self.device)
            if ck.get("world", 1) != self.world:
                raise RuntimeError(
                    f"{path} was written by {ck.get('world')} ranks, this run has {self.world}: resume "
                    "with the same world size, or convert the run (shardopt checkpoint convert "
                    f"{root} <out> --to deepspeed|dcp) for an engine that reshards"
                )
            self.module.load_state_dict(ck["model"])
            self.optimizer.load_state_dict(ck["optim"])
            self.scheduler.load_state_dict(ck["scheduler"])
            self.step = int(ck["step"])
        self.log(f"resumed from {root}/{tag} at step {self.step}")
        return True

    # ------------------------------------------------------------------------------------------- loop
    def _write_metrics(self, record: dict[str, Any]) -> None:
        if self.rank == 0:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            writer = self._tensorboard()
            if writer is not None:
                for key, value in record.items():
                    if key not in ("step", "time") and isinstance(value, (int, float)):
                        writer.add_scalar(key, value, record.get("step", self.step))
                writer.flush()

    def _drop_metrics_after(self, step: int) -> None:
        """Forget the records of steps past the checkpoint resumed from: an interrupted attempt logged them, and
        this run logs those steps again (one record per step in ``metrics.jsonl`` and the loss curve)."""
        if not os.path.isfile(self.metrics_path):
            return
        with open(self.metrics_path) as f:
            lines = f.readlines()
        keep = [line for line in lines if _record_step(line) <= step]
        if len(keep) != len(lines):
            from ..checkpoint import commit

            commit.write_atomic(self.metrics_path, "".join(keep))

    def _tensorboard(self):
        """A TensorBoard writer under ``<run_dir>/tensorboard`` when the ``tensorboard`` package is installed."""
        if not hasattr(self, "_tb"):
            self._tb = None
            try:
                import tensorboard  # noqa: F401
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                return None
            self._tb = SummaryWriter(os.path.join(self.cfg.run_dir, "tensorboard"))
        return self._tb

    def _validate(self) -> float:
        t0 = time.perf_counter()
        loss = self.evaluate()
        ppl = math.exp(min(loss, 50.0))
        self.val_history.append((self.step, loss))
        self._write_metrics({"step": self.step, "val_loss": loss, "val_ppl": ppl, "time": time.time()})
        self.log(
            f"validation step {self.step}: loss {loss:.4f}, perplexity {ppl:.2f} ({time.perf_counter() - t0:.1f}s)"
        )
        return loss

    def _current_lr(self) -> float:
        groups = self.optimizer.param_groups
        return float(groups[0]["lr"]) if groups else float("nan")

    def fit(self) -> dict[str, Any]:
        cfg, t = self.cfg, self.cfg.train
        self.bar = None
        os.makedirs(cfg.run_dir, exist_ok=True)
        self.metrics_path = os.path.join(cfg.run_dir, "metrics.jsonl")
        self._build()
        resumed = self._load() if self.resume else False
        if self.rank == 0:
            if resumed:
                self._drop_metrics_after(self.step)
            else:
                open(self.metrics_path, "w").close()
                with open(os.path.join(cfg.run_dir, "config.json"), "w") as f:
                    json.dump(cfg.model_dump(mode="json"), f, indent=2)
            self.log(f"metrics -> {self.metrics_path}")
        start_step = self.step
        start_val = None
        if cfg.eval.at_start and not resumed:
            start_val = self._validate()
        if self.rank == 0 and t.progress:
            from tqdm.auto import tqdm

            tty = sys.stderr.isatty()
            self.bar = tqdm(
                total=t.steps,
                initial=self.step,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                mininterval=1.0 if tty else 15.0,
                file=sys.stderr,
            )
        window_loss, window_steps, t_window = 0.0, 0, time.perf_counter()
        t_start = time.perf_counter()
        while self.step < t.steps:
            loss = self.train_step()
            if not math.isfinite(loss):
                raise FloatingPointError(f"rank {self.rank}: loss is {loss} at step {self.step}")
            window_loss += loss
            window_steps += 1
            if self.bar is not None:
                self.bar.update(1)
            if self.step % t.log_every == 0 or self.step == t.steps:
                stats = torch.tensor([window_loss, window_steps], dtype=torch.float64)
                if dist.is_initialized():
                    dist.all_reduce(stats)
                elapsed = time.perf_counter() - t_window
                mean_loss = float(stats[0] / stats[1])
                tok_s = window_steps * self.tokens_per_step / max(elapsed, 1e-9)
                rec = {
                    "step": self.step,
                    "loss": mean_loss,
                    "lr": self._current_lr(),
                    "tokens_per_s": tok_s,
                    "tokens": self.step * self.tokens_per_step,
                    "time": time.time(),
                }
                self.history.append(rec)
                self._write_metrics(rec)
                if self.bar is not None:
                    self.bar.set_postfix(loss=f"{mean_loss:.3f}", tok_s=f"{tok_s:,.0f}", lr=f"{rec['lr']:.2e}")
                self.log(
                    f"step {self.step}/{t.steps} | loss {mean_loss:.4f} | lr {rec['lr']:.2e} | {tok_s:,.0f} tokens/s"
                )
                window_loss, window_steps, t_window = 0.0, 0, time.perf_counter()
            if cfg.eval.every and self.step % cfg.eval.every == 0 and self.step != t.steps:
                self._validate()
            if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0 and self.step != t.steps:
                self._save()
        train_time = time.perf_counter() - t_start
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        end_val = self._validate()
        if cfg.checkpoint.at_end and cfg.checkpoint.every and self.step > start_step:
            self._save()
        summary = {
            "steps": self.step,
            "start_step": start_step,
            "world_size": self.world,
            "engine": self.engine_name,
            "optimizer": self.opt_name,
            "params": self.n_params,
            "tokens_per_step": self.tokens_per_step,
            "train_seconds": train_time,
            "tokens_per_s": (self.step - start_step) * self.tokens_per_step / max(train_time, 1e-9),
            "start_val_loss": start_val,
            "start_val_ppl": math.exp(start_val) if start_val is not None else None,
            "end_val_loss": end_val,
            "end_val_ppl": math.exp(min(end_val, 50.0)),
        }
        if self.rank == 0:
            with open(os.path.join(cfg.run_dir, "summary.json"), "w") as f:
                json.dump(summary, f, indent=2)
            try:
                plot = plot_metrics(
                    self.metrics_path,
                    os.path.join(cfg.run_dir, "loss.png"),
                    title=f"{cfg.model.preset} / {self.engine_name} / {self.opt_name}",
                )
                self.log(f"loss curve -> {plot}")
            except Exception as exc:  # matplotlib missing or broken must not fail a finished run
                self.log(f"could not plot the loss curve: {exc!r}")
            if start_val is not None:
                self.log(
                    f"validation perplexity: {math.exp(start_val):.2f} at start -> "
                    f"{summary['end_val_ppl']:.2f} at step {self.step}"
                )
            self.log(
                f"done: {self.step - start_step} steps in {train_time:.1f}s ({summary['tokens_per_s']:,.0f} tokens/s)"
            )
        self._barrier()
        return summary

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _record_step(line: str) -> float:
    """The step of a ``metrics.jsonl`` line; a line cut short by a killed rank 0 counts as past every step."""
    try:
        return float(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return math.inf


def plot_metrics(metrics_path: str, out_path: str, title: str = "") -> str:
    """Training loss and validation loss against steps, from a metrics JSONL, as a PNG (Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, val = [], []
    with open(metrics_path) as f:
        for line in f:
            rec = json.loads(line)
            if "loss" in rec:
                train.append((rec["step"], rec["loss"]))
            if "val_loss" in rec:
                val.append((rec["step"], rec["val_loss"]))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    if val:
        ax.set_title(f"{title}  (val ppl {math.exp(val[0][1]):.0f} -> {math.exp(val[-1][1]):.1f})")
    else:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path
