"""Worker for tests_dist/test_trainers.py (issue 64): shardopt driven through the trainers users already run, on
CPU ranks (gloo), against the same run in one process. Rank 0 writes ``--out`` (``torch.save``): every parameter
whole (fp32) by name under ``params``, and what ran under ``meta`` (each parameter's describe() row).

``--trainer``:

* ``titan``: torchtitan's ``CheckpointManager`` (``--async-mode disabled|async``) with a shardopt optimizer built
  the README's way, ``shardopt.create_optimizer(model, ...)``, inside torchtitan's ``OptimizersContainer`` (a
  subclass that holds it), FSDP2 (``fully_shard`` per decoder layer and the root). ``--phase save``: 4 steps,
  saving at step 2 (the uninterrupted run); ``--phase resume``: load step 2 (FSDP2 at world size 2, a plain
  model at world size 1: a resharded load) and run steps 3-4.
* ``tune``: a torchtune config's ``_component_: shardopt.<Name>`` instantiated as torchtune's
  ``full_finetune_distributed`` recipe does (``config.instantiate(cfg.optimizer, self._model.parameters())``, or
  one optimizer per parameter stepped in backward with ``--in-bwd``, ``training.register_optim_in_bwd_hooks``),
  the model sharded by ``training.shard_model`` (FSDP2), torchtune's llama3 builder.
* ``lightning``: ``configure_optimizers`` returns ``shardopt.create_optimizer(self, ...)``; ``--strategy ddp`` or
  ``fsdp2`` (``ModelParallelStrategy``, ``fully_shard`` in ``configure_model``); 2 steps, a checkpoint, and
  ``fit(ckpt_path=...)`` to step 4 in a new Trainer (``--phase resume``) or 4 steps straight (``--phase full``).
* ``trl``: TRL's ``SFTTrainer`` on pre-tokenized data under DeepSpeed ZeRO-2 (a ``"shardopt"`` section in its
  config and ``shardopt.integrations.transformers.enable(trainer)``), 4 steps.

The one-process run (the same steps on the global batches, ``shardopt.create_optimizer(model)``) goes to ``reference``
in rank 0's output (but for ``titan``, which compares with its uninterrupted run).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
warnings.filterwarnings("ignore")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SEQ, VOCAB, SAMPLES = 8, 64, 32
BATCH = 4  # sequences per global step
STEPS = 4
EPOCH = 2  # Lightning's epoch: its resume starts the next epoch, so both runs read batches 0, 1, 0, 1
HP = {
    "scale": {"lr": 1e-2, "adam_lr": 1e-2},
    "racs": {"lr": 1e-2},
    "muon": {"lr": 1e-2},
    "sumo": {"lr": 1e-2, "rank": 4, "refresh_interval": 2},
}


def world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)


def batch(step: int, whole: bool = False) -> torch.Tensor:
    """This rank's share of global step ``step``'s sequences (the whole batch in one process, or ``whole``)."""
    rank, size = (0, 1) if whole else world()
    share = BATCH // size
    return tokens()[step * BATCH + rank * share : step * BATCH + (rank + 1) * share]


def hf_llama() -> torch.nn.Module:
    from hf_worker import tiny_model

    return tiny_model()


class Block(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = torch.nn.RMSNorm(dim)
        self.w1 = torch.nn.Linear(dim, 2 * dim, bias=False)
        self.w2 = torch.nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.nn.functional.silu(self.w1(self.norm(x))))


class TitanLM(torch.nn.Module):
    """A torchtitan-shaped language model (``tok_embeddings``, ``layers``, ``norm``, ``output``: the attributes
    torchtitan's models declare their embedding and head with), without transformers' import time."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok_embeddings = torch.nn.Embedding(VOCAB, dim)
        self.layers = torch.nn.ModuleList([Block(dim) for _ in range(2)])
        self.norm = torch.nn.RMSNorm(dim)
        self.output = torch.nn.Linear(dim, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(ids)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def tune_llama() -> torch.nn.Module:
    from torchtune.models.llama3 import llama3

    torch.manual_seed(0)
    return llama3(
        vocab_size=VOCAB, num_layers=2, num_heads=2, num_kv_heads=2, embed_dim=16, max_seq_len=SEQ, intermediate_dim=40
    )


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.replace("_checkpoint_wrapped_module.", "").removeprefix("model.model.").removeprefix("model.")] = (
            t.detach().float().clone()
        )
    return out


def describe(opts: list) -> dict[str, list[str]]:
    from shardopt.integrations.accelerate import unwrap_optimizer

    rows = {}
    for opt in opts:
        inner = unwrap_optimizer(opt) or opt
        rows.update({r[0].removeprefix("model."): list(r[2:]) for r in inner.describe_rows()})
    return rows


def lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, mean over this rank's tokens (equal counts on every rank: FSDP2's and DDP's
    gradient average is the global mean)."""
    out = model(ids)
    logits = out.logits if hasattr(out, "logits") else out
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))


# ---------------------------------------------------------------------------------------------- reference
def reference(args: argparse.Namespace) -> dict:
    import shardopt

    model = {"tune": tune_llama, "titan": TitanLM, "lightning": TitanLM}.get(args.trainer, hf_llama)()
    opt = shardopt.create_optimizer(model, args.optimizer, **HP[args.optimizer])
    for step in range(STEPS):
        lm_loss(model, batch(step % EPOCH if args.trainer == "lightning" else step, whole=True)).backward()
        opt.step()
        opt.zero_grad()
    return {"params": full_params(model), "meta": describe([opt])}


# ---------------------------------------------------------------------------------------------- torchtitan
def titan(args: argparse.Namespace) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import OptimizersContainer

    import shardopt

    class ShardoptOptimizers(OptimizersContainer):
        """torchtitan's container (flat FQN-keyed state, DCP Stateful) holding one shardopt optimizer per model
        part, built the README's way."""

        def __init__(self, model_parts: list, name: str, **hp: object) -> None:
            self.model_parts = model_parts
            self.optimizers = [shardopt.create_optimizer(m, name, **hp) for m in model_parts]
            self._post_init([p for m in model_parts for p in m.parameters() if p.requires_grad])

    class Schedulers:  # the CheckpointManager's lr_schedulers: none here (a constant lr)
        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state: dict) -> None:
            pass

    size = world()[1]
    model = TitanLM()
    if args.phase == "save" or size > 1:
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    opts = ShardoptOptimizers([model], args.optimizer, **HP[args.optimizer])
    config = CheckpointManager.Config(enable=True, folder="ckpt", interval=2, async_mode=args.async_mode)
    manager = CheckpointManager(
        config,
        dataloader=None,
        model_parts=[model],
        optimizers=opts,
        lr_schedulers=Schedulers(),  # type: ignore[arg-type]
        states={},
        sd_adapter=None,
        base_folder=args.dir,
    )
    first = 0
    if args.phase == "resume":
        assert manager.load(step=2), "no checkpoint at step 2"
        first = 2
    for step in range(first, STEPS):
        lm_loss(model, batch(step)).backward()
        opts.step()
        opts.zero_grad()
        if args.phase == "save":
            manager.save(curr_step=step + 1)
    manager.maybe_wait_for_saving()  # an async save's last write
    manager.close()
    return {"params": full_params(model), "meta": describe(opts.optimizers)}


# ---------------------------------------------------------------------------------------------- torchtune
def tune(args: argparse.Namespace) -> dict:
    from omegaconf import OmegaConf
    from torchtune import config, training
    from torchtune.modules import TransformerSelfAttentionLayer

    cfg = OmegaConf.load(os.path.join(ROOT, "configs", "torchtune", "optimizer_scale.yaml"))
    cfg.optimizer = {"_component_": f"shardopt.{OPTIMIZER_CLASSES[args.optimizer]}", **HP[args.optimizer]}
    assert args.optimizer != "scale" or cfg == OmegaConf.load(
        os.path.join(ROOT, "configs", "torchtune", "optimizer_scale.yaml")
    )

    class Recipe:
        """The part of torchtune's full_finetune_distributed recipe that builds the model and the optimizer."""

        def __init__(self) -> None:
            self._model = tune_llama()
            if world()[1] > 1:
                training.shard_model(
                    self._model,
                    [lambda n, m: isinstance(m, TransformerSelfAttentionLayer)],
                    cpu_offload=False,
                    reshard_after_forward=True,
                )
            self._optimizer = self._setup_optimizer(cfg.optimizer, args.in_bwd)

        def _setup_optimizer(self, cfg_optimizer, optimizer_in_bwd: bool):  # torchtune's, without its checkpoint
            if optimizer_in_bwd:
                optim_dict = {param: config.instantiate(cfg_optimizer, [param]) for param in self._model.parameters()}
                training.register_optim_in_bwd_hooks(model=self._model, optim_dict=optim_dict)
                self._optim_ckpt_wrapper = training.create_optim_in_bwd_wrapper(
                    model=self._model, optim_dict=optim_dict
                )
                self.opts = list(optim_dict.values())
                return None
            optimizer = config.instantiate(cfg_optimizer, self._model.parameters())
            self.opts = [optimizer]
            return optimizer

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recipe = Recipe()
    unnamed = [str(w.message) for w in caught if "without names" in str(w.message)]
    for step in range(STEPS):
        lm_loss(recipe._model, batch(step)).backward()
        if recipe._optimizer is not None:
            recipe._optimizer.step()
            recipe._optimizer.zero_grad()
    meta = describe(recipe.opts)
    out = {"params": full_params(recipe._model), "meta": meta, "unnamed_warnings": unnamed}
    if recipe._optimizer is not None and world()[1] > 1:  # torchtune's full optimizer state dict, and back
        full = [training.get_full_optimizer_state_dict(recipe._model, recipe._optimizer, world()[0] == 0)]
        dist.broadcast_object_list(full, src=0)  # the recipe reads the saved file on every rank
        before = recipe._optimizer.state_dict()
        training.load_from_full_optimizer_state_dict(recipe._model, recipe._optimizer, full[0], torch.device("cpu"))
        after = recipe._optimizer.state_dict()
        out["state_round_trip"] = max_state_diff(before, after)
    return out


OPTIMIZER_CLASSES = {"scale": "SCALE", "racs": "RACS", "muon": "Muon", "sumo": "SUMO"}


def max_state_diff(a: dict, b: dict) -> float:
    worst = 0.0

    def walk(x, y):
        nonlocal worst
        if isinstance(x, dict):
            for k in x:
                walk(x[k], y[k])
        elif isinstance(x, torch.Tensor):
            xs = x.full_tensor() if hasattr(x, "full_tensor") else x
            ys = y.full_tensor() if hasattr(y, "full_tensor") else y
            if xs.numel():
                worst = max(worst, (xs.float() - ys.float()).abs().max().item())

    walk(a["state"], b["state"])
    return worst


# ---------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer", required=True, choices=["titan", "tune", "lightning", "trl"])
    parser.add_argument("--optimizer", default="scale")
    parser.add_argument("--phase", default="full")
    parser.add_argument("--async-mode", default="disabled")
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--accelerator", default="cpu", help="Lightning: cpu, or gpu (benchmarks/gpu_checks.sh)")
    parser.add_argument("--in-bwd", action="store_true")
    parser.add_argument("--dir", default="")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.trainer == "tune":  # torchtune 0.6 needs a torchao that peft refuses: kept apart (Makefile)
        sys.path.insert(0, os.path.join(sys.prefix, "torchtune-torchao"))
    # the one-process run, on rank 0 before any process group exists (shardopt's steps would use one): one launch
    # fewer per case; the others wait for it at the group's rendezvous
    ref = reference(args) if args.trainer != "titan" and os.environ.get("RANK", "0") == "0" else None
    if "RANK" in os.environ and args.trainer in ("titan", "tune"):
        dist.init_process_group("gloo")
    out = {"titan": titan, "tune": tune, "lightning": lightning, "trl": trl}[args.trainer](args)
    if ref is not None:
        out["reference"] = ref
    if world()[0] == 0:
        torch.save(out, args.out)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def lightning(args: argparse.Namespace) -> dict:
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    import shardopt

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = TitanLM()

        def configure_model(self) -> None:  # ModelParallelStrategy: FSDP2 on its data-parallel mesh
            if args.strategy == "fsdp2":
                from torch.distributed.fsdp import fully_shard

                mesh = self.device_mesh["data_parallel"]
                for layer in self.model.layers:
                    fully_shard(layer, mesh=mesh)
                fully_shard(self.model, mesh=mesh)

        def training_step(self, ids: torch.Tensor, index: int) -> torch.Tensor:
            return lm_loss(self.model, ids)

        def train_dataloader(self) -> torch.utils.data.DataLoader:  # an epoch: EPOCH of this rank's batches
            return torch.utils.data.DataLoader([batch(step) for step in range(EPOCH)], batch_size=None)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return shardopt.create_optimizer(self, args.optimizer, **HP[args.optimizer])

    size = int(os.environ.get("WORLD_SIZE", "1"))

    def trainer(epochs: int) -> L.Trainer:
        strategy = ModelParallelStrategy(data_parallel_size=size, tensor_parallel_size=1)
        return L.Trainer(
            accelerator=args.accelerator,
            devices=size,
            # ddp | fsdp2 (ModelParallelStrategy) on CPU; Lightning's GPU-only ones (fsdp, deepspeed_stage_2, ...)
            # by name: benchmarks/gpu_checks.sh
            strategy=strategy if args.strategy == "fsdp2" else args.strategy,
            max_epochs=epochs,  # a checkpoint at an epoch's end: max_steps would stop it "mid-epoch"
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
        )

    lm = LM()
    if args.phase == "resume":  # 2 steps, a checkpoint, then a new Trainer and module resume from it
        first = trainer(1)
        first.fit(lm)
        path = os.path.join(args.dir, "lightning.ckpt")
        first.save_checkpoint(path)
        lm = LM()
        trainer(STEPS // EPOCH).fit(lm, ckpt_path=path)
    else:
        trainer(STEPS // EPOCH).fit(lm)
    return {"params": full_params(lm.model), "meta": describe([lm.trainer.optimizers[0]])}


def trl(args: argparse.Namespace) -> dict:
    """SFTTrainer on pre-tokenized sequences under DeepSpeed ZeRO-2, the optimizer from the config's ``"shardopt"``
    section (``enable(trainer)``)."""
    from datasets import Dataset
    from hf_worker import ds_config
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    import shardopt.integrations.transformers as hf

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")), pad_token="t0", eos_token="t1"
    )
    data = Dataset.from_dict({"input_ids": tokens()[: STEPS * BATCH].tolist()})
    size = int(os.environ.get("WORLD_SIZE", "1"))
    ds = {**ds_config(2, args.optimizer), "shardopt": {"optimizer": args.optimizer, "params": HP[args.optimizer]}}
    config = SFTConfig(
        output_dir=os.path.join(args.dir, "trl"),
        per_device_train_batch_size=BATCH // size,
        max_steps=STEPS,
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
        dataset_kwargs={"skip_prepare_dataset": True},
        bf16=False,  # SFTConfig's default is bf16 autocast: fp32 here, so the runs compare at fp32
        gradient_checkpointing=False,
        deepspeed=ds,
    )
    trainer = SFTTrainer(model=hf_llama(), args=config, train_dataset=data, processing_class=tokenizer)
    hf.enable(trainer)
    trainer.train()
    model = trainer.model_wrapped.module if hasattr(trainer.model_wrapped, "module") else trainer.model
    return {"params": full_params(model), "meta": describe([trainer.optimizer])}


if __name__ == "__main__":
    main()
