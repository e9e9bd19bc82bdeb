"""Worker for tests_dist/test_hf_integration.py: a tiny Hugging Face LLaMA trained by ``transformers.Trainer``
(DeepSpeed ZeRO-2/3 or FSDP2) or ``accelerate`` (DeepSpeed ZeRO-2) with a shardopt optimizer; rank 0 writes
every parameter (whole, fp32) to ``--out``. ``--reference`` instead runs the single-process loop on the same
global batches (one process, ``shardopt.create_optimizer``), which the sharded runs are compared with.

The data are fixed token ids read in order (``train_sampling_strategy="sequential"``), so a world-size-2 step
with per-device batch B sees the same 2B sequences as a world-size-1 step with batch 2B.
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")
SEQ, VOCAB, SAMPLES = 8, 64, 64
HP = {
    "scale": {"lr": 1e-2, "adam_lr": 1e-2},
    "racs": {"lr": 1e-2},
    "sumo": {"lr": 1e-2, "rank": 4, "refresh_interval": 2},
    "alice": {"lr": 1e-2, "rank": 4, "leading": 2, "refresh_interval": 2},
    # the other optimizers, for the full tier's from_pretrained (ZeRO-3 partitioned at load) run
    "sinkgd": {"lr": 1e-2},
    "muon": {"lr": 1e-2},
    "swan": {"lr": 1e-2},
    "dasgo": {"lr": 1e-2},
    "asgo": {"lr": 1e-2, "refresh_interval": 2},
    "alice0": {"lr": 1e-2, "rank": 4, "leading": 2, "refresh_interval": 2},
}


META: dict = {}


def describe_engine(wrapped: torch.nn.Module, opt: object) -> dict:
    """What actually ran: the engine, its ZeRO stage, the optimizer DeepSpeed steps and how its tensors map."""
    from shardopt.integrations.accelerate import unwrap_optimizer

    inner = unwrap_optimizer(opt) or unwrap_optimizer(getattr(wrapped, "optimizer", None))
    stage = wrapped.zero_optimization_stage() if hasattr(wrapped, "zero_optimization_stage") else None
    dtensors = sum(1 for p in wrapped.parameters() if hasattr(p, "placements"))
    stepped = [p for g in inner.param_groups for p in g["params"]] if inner is not None else []
    rules = (
        {n: g["treatment"] for g, names in zip(inner._groups(), inner.group_param_names) for n in names}
        if inner is not None
        else {}
    )
    return {
        "engine": type(wrapped).__name__,
        "zero_stage": stage,
        "optimizer": type(inner).__name__,
        "flat_tensors_mapped": len(inner._attached) if inner is not None else 0,
        "dtensor_params": dtensors,
        "flat_views": sum(1 for p in stepped if p.dim() == 1 and getattr(p, "_fsdp_flattened", True)),
        "rules": rules,
        "options": rule_options(inner),
    }


def rule_options(opt: object) -> dict[str, list]:
    """Per parameter, the options that say on which axes its rule works: treatment, ``transposed`` (a weight stored
    in x out stepped as its logical matrix, ``optim.transposed``), SCALE's ``norm_dim``."""
    if opt is None:
        return {}
    return {
        n.removeprefix("_orig_mod."): [g["treatment"], bool(g.get("transposed")), g.get("norm_dim")]
        for g, names in zip(opt._groups(), opt.group_param_names)
        for n in names
    }


def logical_state(opt: object) -> dict[str, torch.Tensor]:
    """The optimizer state as whole logical tensors (``shardopt.checkpoint.export_state``, collective; rank 0's),
    without the parameters: what a checkpoint of it means, whatever the engine."""
    from shardopt.checkpoint import export_state

    full, _ = export_state(opt, include_params=False)
    return {k.removeprefix("_orig_mod."): v for k, v in full.items()}


#: the decoder layer class of each tiny model (legacy FSDP wraps one unit per layer)
DECODER_LAYER = {"llama": "LlamaDecoderLayer", "gpt2": "GPT2Block"}


def tiny_model(kind: str = "llama") -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = GPT2Config(
            vocab_size=VOCAB,
            n_positions=SEQ,
            n_embd=16,
            n_layer=2,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        return GPT2LMHeadModel(cfg)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg)


def pretrained(kind: str, path: str) -> torch.nn.Module:
    """``tiny_model`` saved by rank 0 and loaded back with ``from_pretrained`` by every rank (weights from disk, as
    a user loads a checkpoint; under an active ZeRO-3 config each parameter is partitioned as it is created)."""
    from transformers import AutoModelForCausalLM

    if dist.get_rank() == 0:
        tiny_model(kind).save_pretrained(path)
    dist.barrier()
    return AutoModelForCausalLM.from_pretrained(path)


def samples() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def ds_config(stage: int, optimizer: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage, "overlap_comm": False},
        "shardopt": {"optimizer": optimizer, "params": HP[optimizer]},
    }


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole on every rank (ZeRO-3 gathered, FSDP2 DTensors assembled, FSDP1 by its full state
    dict)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if any(isinstance(m, FSDP) for m in model.modules()):
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType

        root = model if isinstance(model, FSDP) else next(m for m in model.modules() if isinstance(m, FSDP))
        with FSDP.state_dict_type(root, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
            return {k.removeprefix("_orig_mod."): v.detach().float().clone() for k, v in root.state_dict().items()}
    out = {}
    for name, p in model.named_parameters():
        if hasattr(p, "ds_id"):
            import deepspeed

            with deepspeed.zero.GatheredParameters([p]):
                out[name] = p.detach().float().clone()
        elif hasattr(p, "full_tensor"):
            out[name] = p.full_tensor().detach().float().clone()
        else:
            out[name] = p.detach().float().clone()
    return {k.removeprefix("_orig_mod."): v for k, v in out.items()}


def fsdp_on_cpu() -> None:
    """accelerate enables FSDP only for accelerator devices (``AcceleratorState`` keeps ``MULTI_CPU`` on CPU):
    give a CPU Accelerator built with an FSDP plugin what it would have on GPUs (distributed type FSDP and the
    plugin), so the Trainer's own FSDP2 path (``fully_shard`` on a gloo mesh, DCP checkpoints) and its legacy FSDP
    path (``FullyShardedDataParallel``, given ``device("cpu")`` as its device) run here."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    if getattr(Accelerator, "_wt_fsdp_cpu", False):
        return
    init = Accelerator.__init__

    def patched(self, *a, **kw):
        init(self, *a, **kw)
        plugin = kw.get("fsdp_plugin")
        if plugin is not None and self.state.distributed_type == DistributedType.MULTI_CPU:
            self.state.distributed_type = DistributedType.FSDP
            self.state.fsdp_plugin = plugin
            if plugin.fsdp_version == 1:  # legacy FSDP compares its device_id with torch.device("cpu")
                self.state.device = torch.device("cpu")

    Accelerator.__init__ = patched
    Accelerator._wt_fsdp_cpu = True


def reference(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    import shardopt

    model = tiny_model(args.model)
    opt = shardopt.create_optimizer(model, args.optimizer, **HP[args.optimizer])
    data = samples()
    batch = args.batch * 2
    for step in range(args.steps):
        chunk = data[step * batch : (step + 1) * batch]
        ids = torch.stack([c["input_ids"] for c in chunk])
        # --trainer-loss: the Trainer's normalization, by the label count before the shift (7/8 of the mean here)
        extra = {"num_items_in_batch": ids.numel()} if args.trainer_loss else {}
        loss = model(input_ids=ids, labels=ids, **extra).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    out = full_params(model)
    out["__meta__"] = {"options": rule_options(opt)}
    if args.state:
        out["__state__"] = logical_state(opt)
    return out


def trainer_run(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    from transformers import Trainer, TrainingArguments

    import shardopt.integrations.transformers as hf

    extra: dict = {}
    if args.engine.startswith("zero"):
        extra["deepspeed"] = ds_config(int(args.engine[-1]), args.optimizer)
    elif args.engine == "fsdp2":
        extra.update(
            fsdp=True,
            fsdp_config={"fsdp_version": 2, "reshard_after_forward": True, "state_dict_type": "SHARDED_STATE_DICT"},
        )
        fsdp_on_cpu()
    elif args.engine.startswith("fsdp1"):  # legacy FSDP, a unit per decoder layer; "fsdp1_flat": use_orig_params=False
        extra.update(
            fsdp="full_shard",
            fsdp_config={
                "fsdp_version": 1,
                "use_orig_params": args.engine == "fsdp1",
                "transformer_layer_cls_to_wrap": [DECODER_LAYER[args.model]],
                "sync_module_states": False,
            },
        )  # (it asks for an accelerator)
        fsdp_on_cpu()
    targs = TrainingArguments(
        output_dir=args.dir,
        per_device_train_batch_size=args.batch,
        max_steps=args.steps,
        report_to="none",
        max_grad_norm=0.0,
        train_sampling_strategy="sequential",
        lr_scheduler_type=args.schedule,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        logging_steps=1000,
        dataloader_drop_last=True,
        seed=0,
        disable_tqdm=True,
        use_cpu=True,
        **extra,
    )
    from transformers import TrainerCallback

    class CountSteps(TrainerCallback):
        """How many optimizer steps this process ran (a resumed run must run only the remaining ones)."""

        def on_step_end(self, *a, **kw):
            META["steps_run"] = META.get("steps_run", 0) + 1

    if args.pretrained:  # HF's ZeRO-3 path: TrainingArguments first, so from_pretrained partitions at load (zero.Init)
        model = pretrained(args.model, os.path.join(args.dir, "pretrained"))
        META["partitioned_at_load"] = all(tuple(p.shape) == (0,) and hasattr(p, "ds_shape") for p in model.parameters())
    else:
        model = tiny_model(args.model)
    trainer = Trainer(model=model, args=targs, train_dataset=samples(), callbacks=[CountSteps()])
    if args.engine.startswith("zero"):
        hf.enable(trainer)  # optimizer and hyperparameters from the config's "shardopt" section
    else:
        hf.enable(trainer, args.optimizer, **HP[args.optimizer])
    if os.environ.get("WT17_DEBUG"):
        print("fsdp", trainer.is_fsdp_enabled, trainer.accelerator.distributed_type)
    trainer.train(resume_from_checkpoint=args.resume)
    META.update(describe_engine(trainer.model_wrapped, trainer.optimizer), global_step=trainer.state.global_step)
    if args.state:
        from shardopt.integrations.accelerate import unwrap_optimizer

        META["state"] = logical_state(unwrap_optimizer(trainer.optimizer))
    if args.engine.startswith("fsdp1"):  # the root FSDP unit's full state dict
        return full_params(trainer.model_wrapped)
    return full_params(trainer.model_wrapped.module if hasattr(trainer.model_wrapped, "module") else trainer.model)


def accelerate_run(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    import shardopt
    import shardopt.integrations.accelerate as acc

    cfg = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {
            "stage": int(args.engine[-1]) if args.engine.startswith("zero") else 0,
            "overlap_comm": False,
        },
    }
    if args.engine == "fsdp2":
        from accelerate.utils import FullyShardedDataParallelPlugin

        fsdp_on_cpu()
        accelerator = Accelerator(
            cpu=True,
            fsdp_plugin=FullyShardedDataParallelPlugin(
                fsdp_version=2, reshard_after_forward=True, state_dict_type="SHARDED_STATE_DICT"
            ),
        )
    elif args.engine.startswith("fsdp1"):
        from accelerate.utils import FullyShardedDataParallelPlugin

        fsdp_on_cpu()
        accelerator = Accelerator(
            cpu=True,
            fsdp_plugin=FullyShardedDataParallelPlugin(
                fsdp_version=1,
                use_orig_params=args.engine == "fsdp1",
                auto_wrap_policy="transformer_based_wrap",
                transformer_cls_names_to_wrap=[DECODER_LAYER[args.model]],
                sync_module_states=False,
            ),
        )
    else:
        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg))
    model = tiny_model(args.model)
    opt = shardopt.create_optimizer(model, args.optimizer, **HP[args.optimizer])
    if args.auto:  # a plain accelerator.prepare: the first step maps the engine itself
        model, opt = accelerator.prepare(model, opt)
    else:
        model, opt = acc.prepare(accelerator, model, opt)
    data, rank = samples(), dist.get_rank()
    start = 0
    if args.resume:
        accelerator.load_state(args.resume)
        start = int(open(os.path.join(args.resume, "step")).read())
    for step in range(start, args.steps):
        lo = (2 * step + rank) * args.batch
        ids = torch.stack([c["input_ids"] for c in data[lo : lo + args.batch]])
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        if args.save_steps and step + 1 == args.save_steps:
            path = os.path.join(args.dir, "state")
            accelerator.save_state(path)
            if rank == 0:
                open(os.path.join(path, "step"), "w").write(str(step + 1))
    META.update(describe_engine(model, opt))
    return full_params(model if args.engine.startswith("fsdp1") else getattr(model, "module", model))


def scenario(args: argparse.Namespace, name: str) -> dict[str, torch.Tensor]:
    """The ways a user plugs shardopt into Trainer / accelerate without the integration's helpers (issue 17's
    table); each must train exactly like the single-process run, or raise (the test checks which)."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin
    from transformers import Trainer, TrainingArguments

    import shardopt

    hp = HP["scale"]
    ds = ds_config(2, "scale")
    targs = dict(
        output_dir=os.path.join(args.dir, name),
        per_device_train_batch_size=args.batch,
        max_steps=1,
        report_to="none",
        max_grad_norm=0.0,
        train_sampling_strategy="sequential",
        save_strategy="no",
        use_cpu=True,
        dataloader_drop_last=True,
        seed=0,
        disable_tqdm=True,
    )
    if name == "trainer_cls_kwargs":  # optimizer_cls_and_kwargs=(SCALE, ...) under DeepSpeed
        ds.pop("shardopt")
        trainer = Trainer(
            model=tiny_model(),
            args=TrainingArguments(deepspeed=ds, **targs),
            train_dataset=samples(),
            optimizer_cls_and_kwargs=(shardopt.SCALE, dict(hp)),
        )
    elif name == "trainer_cls_kwargs_ddp":  # the same without DeepSpeed: HF's unnamed decay groups
        trainer = Trainer(
            model=tiny_model(),
            args=TrainingArguments(**targs),
            train_dataset=samples(),
            optimizer_cls_and_kwargs=(shardopt.SCALE, dict(hp)),
        )
    elif name == "trainer_subclass":  # HF's documented route: override create_optimizer
        ds.pop("shardopt")

        class MyTrainer(Trainer):
            def create_optimizer(self, model=None):
                if self.optimizer is None:
                    self.optimizer = shardopt.create_optimizer(self.model, "scale", **hp)
                return self.optimizer

        trainer = MyTrainer(model=tiny_model(), args=TrainingArguments(deepspeed=ds, **targs), train_dataset=samples())
    elif name == "trainer_optimizers_arg":  # Trainer(optimizers=(opt, None)) under DeepSpeed: dropped by HF
        ds.pop("shardopt")
        model = tiny_model()
        trainer = Trainer(
            model=model,
            args=TrainingArguments(deepspeed=ds, **targs),
            train_dataset=samples(),
            optimizers=(shardopt.create_optimizer(model, "scale", **hp), None),
        )
    elif name == "accelerate_section":  # a "shardopt" section in the DeepSpeed config given to accelerate
        import shardopt.integrations.accelerate as acc

        ds.update(train_micro_batch_size_per_gpu=args.batch, gradient_accumulation_steps=1, gradient_clipping=0.0)
        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds))
        model, opt = acc.prepare(accelerator, tiny_model())
        lo = dist.get_rank() * args.batch
        ids = torch.stack([c["input_ids"] for c in samples()[lo : lo + args.batch]])
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        META.update(describe_engine(model, opt))
        return full_params(model.module)
    else:
        raise ValueError(name)
    trainer.train()
    META.update(describe_engine(trainer.model_wrapped, trainer.optimizer))
    model = trainer.model_wrapped
    return full_params(model.module if hasattr(model, "module") else model)


def reset_accelerate() -> None:
    """Forget accelerate's process-wide state so the next Trainer / Accelerator in this process starts afresh."""
    import gc

    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    gc.collect()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--api", choices=("trainer", "accelerate", "reference", "scenario"), default="trainer")
    ap.add_argument("--engine", default="zero2")
    ap.add_argument("--optimizer", default="scale", help="comma-separated optimizers (with --api scenario: scenarios)")
    ap.add_argument("--model", default="llama")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--batch", type=int, default=2, help="per-device batch at world size 2")
    ap.add_argument("--save-steps", type=int, default=0)
    ap.add_argument("--resume", default=None, help="checkpoint to resume from; {opt} is the optimizer's name")
    ap.add_argument("--schedule", default="linear")
    ap.add_argument("--auto", action="store_true")
    ap.add_argument(
        "--pretrained",
        action="store_true",
        help="load the model with from_pretrained after the TrainingArguments (ZeRO-3: partitioned at load)",
    )
    ap.add_argument("--state", action="store_true", help="also return the optimizer state as logical tensors")
    ap.add_argument(
        "--trainer-loss",
        action="store_true",
        help="reference: the loss normalized as the Trainer does (num_items_in_batch), not the mean",
    )
    ap.add_argument("--dir", default="/tmp/wt17_hf")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if args.api == "reference":
        torch.save(
            {
                name: reference(argparse.Namespace(**{**vars(args), "optimizer": name}))
                for name in args.optimizer.split(",")
            },
            args.out,
        )
        return
    results = {}
    for name in args.optimizer.split(","):
        run = argparse.Namespace(
            **{
                **vars(args),
                "optimizer": name,
                "dir": os.path.join(args.dir, name),
                "resume": args.resume.format(opt=name) if args.resume else None,
            }
        )
        META.clear()
        if args.api == "scenario":
            try:
                results[name] = scenario(run, name)
            except Exception as err:  # noqa: BLE001 - the test checks the type and message
                results[name] = {}
                META["error"] = f"{type(err).__name__}: {err}"
        else:
            results[name] = trainer_run(run) if args.api == "trainer" else accelerate_run(run)
        results[name]["__meta__"] = dict(META)
        if "state" in META:
            results[name]["__state__"] = results[name]["__meta__"].pop("state")
        reset_accelerate()
    if dist.get_rank() == 0:
        torch.save(results, args.out)
    dist.barrier()


if __name__ == "__main__":
    from launch import settle_heap

    settle_heap()
    main()
