"""Worker for tests_dist/test_offload.py (issue 56): a tiny Hugging Face LLaMA trained with a shardopt optimizer
under DeepSpeed ZeRO-Offload through each front door, and the bf16 spread runs.

``--mode offload``: ``--api initialize`` (``shardopt.deepspeed.initialize``), ``trainer``
(``transformers.Trainer`` + ``shardopt.integrations.transformers.enable``) or ``accelerate``
(``shardopt.integrations.accelerate.prepare``), ``--engine`` ``zero2`` / ``zero3`` (``offload_optimizer`` cpu) or
``zero3p`` (and ``offload_param`` cpu). Rank 0 writes every parameter (whole, fp32) per optimizer, plus what ran
(the optimizer DeepSpeed steps, the partitions' device), for comparison with ``hf_worker.py --api reference``.

``--mode spread``: ``--engine`` ``zero2_bf16`` / ``zero3_bf16`` (DeepSpeed ``bf16``) or ``fsdp2_bf16`` (FSDP2
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``), each optimizer and torch's AdamW in the same
harness: 3 steps of 8 samples split over the ranks; rank 0 writes the initial and final parameters. ``--model``
``mlp`` (default): ``SpreadMLP``, matrices with more columns than a step's 8 samples, so every gradient and the
first moments are rank-deficient (the small-batch fine-tuning case where SUMO's exact polar factor met bf16
rounding: 80% before the precision-aware cutoff); each rule at its defaults (SUMO's rank 128, clamped to the
matrix). ``llama``: the tiny LLaMA with ``hf_worker.HP`` (64 tokens a step: full-rank gradients).
``--steps`` (3) steps; ``<engine>_fp32`` (``zero2_fp32``, ``zero3_fp32``, ``fsdp2_fp32``) runs the same harness in
fp32 (bf16 against fp32); besides shardopt's optimizers and ``adamw``, Muon's anchors ``ds_muon`` (DeepSpeed's Muon,
DeepSpeed engines) and ``torch_muon`` (``torch.optim.Muon``, FSDP2) (issue 63).
``--no-cutoff`` runs SUMO, SWAN's exact root and ASGO's pseudo-inverse with their fp32 cutoffs whatever the
gradients' precision (to show what the cutoff does); ``--params`` (JSON) overrides a rule's defaults (SWAN's exact
root: ``{"center": true}`` or ``{"whitening": "svd"}``; ASGO's pseudo-inverse: ``{"eps": 0}``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
warnings.filterwarnings("ignore")
from hf_worker import HP, describe_engine, full_params, reset_accelerate, samples, tiny_model  # noqa: E402

SPREAD_SAMPLES = 8


class SpreadMLP(torch.nn.Module):
    """24-40-40-8 tanh MLP (``ckpt_options_worker.Net``'s widths, no frozen or tied parts), MSE against random
    targets: with 8 samples a step each weight's gradient has rank <= 8 < its columns."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.fc3 = torch.nn.Linear(24, 40), torch.nn.Linear(40, 40), torch.nn.Linear(40, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def spread_batch(step: int, lo: int, hi: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    x, y = torch.randn(SPREAD_SAMPLES, 24, generator=g), torch.randn(SPREAD_SAMPLES, 8, generator=g)
    return x[lo:hi].to(DEVICE, dtype), y[lo:hi].to(DEVICE, dtype)


#: where the model computes: the CPU (gloo, the tests), or each rank's GPU with ``--backend nccl``
#: (benchmarks/gpu_checks.sh: the optimizer's partitions in CPU memory, its collectives on NCCL)
DEVICE = torch.device("cpu")


def offload_config(engine: str, batch: int) -> dict:
    zero: dict = {
        "stage": 3 if engine.startswith("zero3") else 2,
        "overlap_comm": False,
        "offload_optimizer": {"device": "cpu"},
    }
    if engine == "zero3p":
        zero["offload_param"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
    }


def _partition_device(opt: object) -> str:
    from shardopt.integrations.accelerate import unwrap_optimizer

    inner = unwrap_optimizer(opt)
    tensors = (
        [t for t, _ in getattr(inner, "_attached", {}).values()]
        if isinstance(getattr(inner, "_attached", None), dict)
        else []
    )
    if not tensors:
        tensors = [p for g in inner.param_groups for p in g["params"]] if inner is not None else []
    return ",".join(sorted({t.device.type for t in tensors})) or "?"


def offload_run(args: argparse.Namespace, meta: dict) -> dict[str, torch.Tensor]:
    import shardopt

    cfg = offload_config(args.engine, args.batch)
    data, rank, world = samples(), dist.get_rank(), dist.get_world_size()

    def train(model, step_fn, backward) -> None:
        for step in range(args.steps):
            lo = (step * world + rank) * args.batch
            ids = torch.stack([c["input_ids"] for c in data[lo : lo + args.batch]]).to(DEVICE)
            backward(model(input_ids=ids, labels=ids).loss)
            step_fn()

    if args.api == "initialize":
        import shardopt.deepspeed

        cfg["shardopt"] = {"optimizer": args.optimizer, "params": HP[args.optimizer]}
        engine, opt, _, _ = shardopt.deepspeed.initialize(model=tiny_model(), config=cfg)
        train(engine, engine.step, engine.backward)
        meta.update(
            describe_engine(engine, opt),
            stepped=type(engine.optimizer.optimizer).__name__,
            force_key=engine._config.zero_force_ds_cpu_optimizer,
        )
        return full_params(engine.module)
    if args.api == "accelerate":
        from accelerate import Accelerator
        from accelerate.utils import DeepSpeedPlugin

        import shardopt.integrations.accelerate as acc

        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg))
        model = tiny_model()
        opt = shardopt.create_optimizer(model, args.optimizer, **HP[args.optimizer])
        model, opt = acc.prepare(accelerator, model, opt)

        def step() -> None:
            opt.step()
            opt.zero_grad()

        train(model, step, accelerator.backward)
        meta.update(describe_engine(model, opt), stepped=type(model.optimizer.optimizer).__name__)
        return full_params(model.module)
    from transformers import Trainer, TrainingArguments

    import shardopt.integrations.transformers as hf

    cfg = {
        **cfg,
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "shardopt": {"optimizer": args.optimizer, "params": HP[args.optimizer]},
    }
    targs = TrainingArguments(
        output_dir=os.path.join(args.dir, args.optimizer),
        per_device_train_batch_size=args.batch,
        max_steps=args.steps,
        report_to="none",
        max_grad_norm=0.0,
        train_sampling_strategy="sequential",
        lr_scheduler_type="constant",
        save_strategy="no",
        logging_steps=1000,
        dataloader_drop_last=True,
        seed=0,
        disable_tqdm=True,
        use_cpu=True,
        deepspeed=cfg,
    )
    trainer = Trainer(model=tiny_model(), args=targs, train_dataset=samples())
    hf.enable(trainer)
    trainer.train()
    wrapped = trainer.model_wrapped
    meta.update(describe_engine(wrapped, trainer.optimizer), stepped=type(wrapped.optimizer.optimizer).__name__)
    return full_params(wrapped.module)


def reference(name: str, steps: int, batch: int) -> dict[str, torch.Tensor]:
    """One process, no engine: ``steps`` steps of ``batch`` sequences, the global batches of the offload runs."""
    import shardopt

    model = tiny_model()
    opt = shardopt.create_optimizer(model, name, **HP[name])
    data = samples()
    for step in range(steps):
        ids = torch.stack([c["input_ids"] for c in data[step * batch : (step + 1) * batch]])
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


#: spread mode's optimizers that are not shardopt's: torch's AdamW (the yardstick), and Muon's anchors (issue 63):
#: ``torch_muon`` (torch.optim.Muon on the matrices + AdamW on the rest, under FSDP2: DeepSpeed's ZeRO hands a
#: client optimizer flat partitions, which Muon refuses) and ``ds_muon`` (DeepSpeed's Muon, DeepSpeed engines)
ANCHORS = ("adamw", "torch_muon", "ds_muon")


def anchor_optimizers(name: str, model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """torch's AdamW (lr 1e-2), or torch.optim.Muon at its defaults (lr 1e-3, weight decay 0.1: shardopt's Muon's)
    on the 2-D parameters with AdamW (lr 1e-3) on the others, as shardopt's Muon leaves them to AdamW."""
    if name == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=1e-2)]
    if name == "torch_muon":
        mats = [p for p in model.parameters() if p.ndim == 2]
        rest = [p for p in model.parameters() if p.ndim != 2]
        return [torch.optim.Muon(mats), torch.optim.AdamW(rest, lr=1e-3, weight_decay=0.0)]
    raise ValueError(f"spread mode: {name!r} runs on DeepSpeed engines only (ds_muon)")


def spread_run(args: argparse.Namespace, meta: dict) -> dict[str, torch.Tensor]:
    """3 steps of ``SPREAD_SAMPLES`` samples in bf16, this rank's share of each; the initial parameters under
    ``init.<name>``."""
    import shardopt

    ws, rank = dist.get_world_size(), dist.get_rank()
    micro = SPREAD_SAMPLES // ws
    data = samples()
    mlp = args.model == "mlp"
    model = SpreadMLP() if mlp else tiny_model()
    adamw = args.optimizer in ANCHORS
    hp = {**({} if mlp or adamw else HP.get(args.optimizer, {})), **({} if adamw else json.loads(args.params))}
    init = {f"init.{n}": p.detach().float().clone() for n, p in model.named_parameters()}
    if args.no_cutoff:
        import shardopt.optim.asgo as asgo
        import shardopt.optim.sumo as sumo
        import shardopt.optim.swan as swan

        sumo.noise_rtol = lambda dtype, shape, fp32_rtol: fp32_rtol
        swan.noise_eig_rtol = asgo.noise_eig_rtol = lambda dtype, k, fp32_rtol: fp32_rtol
    fsdp = args.engine.startswith("fsdp2")
    bf16 = not args.engine.endswith("_fp32")  # "<engine>_fp32": the same harness in fp32 (bf16 against fp32)
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kw: dict = {"mesh": init_device_mesh("cpu", (ws,))}
        if bf16:
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in [model.fc1, model.fc2] if mlp else model.model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        opts = (
            anchor_optimizers(args.optimizer, model)
            if adamw
            else [shardopt.create_optimizer(model, args.optimizer, **hp)]
        )
        engine, backward = model, lambda loss: loss.backward()

        def step() -> None:
            for opt in opts:
                opt.step()
                opt.zero_grad()
    else:
        cfg = {
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "bf16": {"enabled": bf16},
            "zero_optimization": {"stage": int(args.engine[4]), "overlap_comm": False},
        }
        if args.optimizer == "ds_muon":  # DeepSpeed's own Muon (deepspeed.runtime.zero.muon), its defaults
            import deepspeed

            for p in model.parameters():
                p.use_muon = p.ndim >= 2
            ds_opt = {"type": "Muon", "params": {"lr": 1e-3, "momentum": 0.95, "weight_decay": 0.1}}
            cfg["zero_optimization"]["reduce_scatter"] = False  # ZeRO-3 refuses Muon with it
            engine, opt, _, _ = deepspeed.initialize(
                model=model, model_parameters=model.parameters(), config={**cfg, "optimizer": ds_opt}
            )
        elif adamw:
            import deepspeed

            engine, opt, _, _ = deepspeed.initialize(
                model=model,
                optimizer=anchor_optimizers(args.optimizer, model)[0],
                config={**cfg, "zero_allow_untested_optimizer": True},
            )
        else:
            import shardopt.deepspeed

            cfg["shardopt"] = {"optimizer": args.optimizer, "params": hp}
            engine, opt, _, _ = shardopt.deepspeed.initialize(model=model, config=cfg)
        backward, step = engine.backward, engine.step
    for s in range(args.steps):
        if mlp:  # FSDP2 casts the inputs to its param_dtype; DeepSpeed bf16 takes them in bf16
            x, y = spread_batch(
                s, rank * micro, (rank + 1) * micro, torch.bfloat16 if bf16 and not fsdp else torch.float32
            )
            out = engine(x)
            loss = torch.nn.functional.mse_loss(out.float(), y.float())
        else:
            lo = s * SPREAD_SAMPLES + rank * micro
            ids = torch.stack([c["input_ids"] for c in data[lo : lo + micro]])
            loss = engine(input_ids=ids, labels=ids).loss
        backward(loss)
        step()
    if args.engine.startswith("fsdp2"):
        final = full_params(model)
    elif int(args.engine[4]) == 3:
        final = full_params(engine.module)
    else:  # bf16 ZeRO-1/2: the fp32 masters live in the flat partitions
        from deepspeed.utils import safe_get_full_fp32_param

        final = {n: safe_get_full_fp32_param(p).float().clone() for n, p in engine.module.named_parameters()}
    return {**final, **init}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("offload", "spread"), default="offload")
    ap.add_argument("--api", choices=("initialize", "trainer", "accelerate"), default="initialize")
    ap.add_argument("--engine", default="zero2")
    ap.add_argument("--optimizer", default="scale", help="comma-separated optimizers")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2, help="per-device batch (offload mode)")
    ap.add_argument(
        "--reference",
        action="store_true",
        help="rank 0 also runs the single-process reference of each "
        "optimizer (offload mode; hf_worker.reference: the same global batches), under 'reference.<name>'",
    )
    ap.add_argument("--model", choices=("mlp", "llama"), default="mlp", help="spread mode's model")
    ap.add_argument(
        "--no-cutoff", action="store_true", help="spread mode: SUMO, SWAN, ASGO keep their fp32 cutoffs in bf16"
    )
    ap.add_argument("--params", default="{}", help="spread mode: JSON overriding each rule's defaults")
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    ap.add_argument("--dir", default="/tmp/shardopt_offload")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    global DEVICE
    if args.backend == "nccl":
        DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(DEVICE)
    if not dist.is_initialized():
        dist.init_process_group(args.backend)
    results = {}
    for name in args.optimizer.split(","):
        run = argparse.Namespace(**{**vars(args), "optimizer": name})
        meta: dict = {}
        results[name] = offload_run(run, meta) if args.mode == "offload" else spread_run(run, meta)
        results[name]["__meta__"] = meta
        reset_accelerate()
    if args.reference:  # in this process (no second interpreter to start: CI time), on every rank: the optimizer's
        for name in args.optimizer.split(","):  # checks issue world collectives, which every rank must meet
            results[f"reference.{name}"] = reference(name, args.steps, dist.get_world_size() * args.batch)
    if dist.get_rank() == 0:
        torch.save(results, args.out)
    dist.barrier()


if __name__ == "__main__":
    from launch import settle_heap

    settle_heap()
    main()
