"""Hugging Face ``Trainer`` with a shardopt optimizer under DeepSpeed ZeRO: one line, ``enable(trainer)``, takes
the optimizer from the DeepSpeed config's ``"shardopt"`` section (HF's ``"auto"`` values welcome); the Trainer's
LR scheduler, ``save_steps`` and ``resume_from_checkpoint`` work as usual (resumable at another world size).
A tiny LLaMA built from its config on synthetic tokens, so it runs in seconds on a CPU (DS_ACCELERATOR=cpu, gloo).

    torchrun --nproc_per_node 2 examples/hf_trainer.py --steps 4 --out runs/hf_trainer
    torchrun --nproc_per_node 1 examples/hf_trainer.py --steps 6 --out runs/hf_trainer --resume --batch 8

The Trainer snippets of README.md and docs/guides/hf-trainer.md are excerpts of this file (tests_dist/test_readme.py
checks that they are).
"""

from __future__ import annotations

import argparse
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported

from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import shardopt.integrations.accelerate
import shardopt.integrations.transformers


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=256,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=32,
        )
    )


def token_dataset(n: int = 256, seq: int = 32) -> list[dict]:
    """Learnable synthetic sequences (each token is the previous one plus a per-sequence stride)."""
    g = torch.Generator().manual_seed(0)
    start, stride = torch.randint(0, 256, (n, 1), generator=g), torch.randint(1, 4, (n, 1), generator=g)
    ids = (start + stride * torch.arange(seq)) % 256
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4, help="train until this many optimizer steps in all")
    ap.add_argument("--batch", type=int, default=4, help="per-device batch")
    ap.add_argument("--stage", type=int, default=2, help="ZeRO stage (1, 2 or 3)")
    ap.add_argument("--out", default="runs/hf_trainer", help="output_dir: checkpoint-<step> every 2 steps")
    ap.add_argument("--resume", action="store_true", help="resume_from_checkpoint: the latest in --out")
    args = ap.parse_args()

    model = tiny_llama()
    deepspeed_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": args.stage},
        "shardopt": {"optimizer": "scale", "params": {"lr": "auto", "adam_lr": "auto"}},
    }
    training_args = TrainingArguments(
        output_dir=args.out,
        deepspeed=deepspeed_config,
        learning_rate=1e-2,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        save_steps=2,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=token_dataset())
    shardopt.integrations.transformers.enable(trainer)  # the one line: shardopt from the "shardopt" section
    trainer.train(resume_from_checkpoint=args.resume or None)
    if trainer.is_world_process_zero():
        opt = shardopt.integrations.accelerate.unwrap_optimizer(trainer.optimizer)
        print(
            f"trained to step {trainer.state.global_step} with {type(opt).__name__} under ZeRO-{args.stage} on "
            f"{trainer.args.world_size} ranks; loss {trainer.state.log_history[-2]['loss']:.4f}"
        )
    # An orderly shutdown: ranks leave together and gloo's threads are joined before the interpreter exits (left
    # to exit handlers, a rank can abort with "terminate called without an active exception" after its work is done).
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # docs/reliability.md: the last gather's tensors released before anyone exits
    trainer.accelerator.end_training()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
