"""Which rule each parameter gets, on every engine (issue 47: never a silent substitution).

Real Hugging Face layouts (a tiny Llama, GPT-2 with its in x out ``Conv1D`` weights and tied head, Mixtral with fused
3-D experts and a router) are built on each engine the way its users build them, and the optimizer each engine's
front door makes is read back: the rule of every parameter, by name. One process on the unwrapped model is the
reference: an engine that hides shapes (FSDP1's flat parameters, ZeRO-3's partitions, ``zero.Init``) must give every
parameter the same rule, and where one process refuses a layout (a rule that is not transpose-symmetric on
``Conv1D``) the engine must refuse it too, with the same error type. A user's routing to AdamW is honoured alike.
Each record also holds the role tables (``describe()``) of what the front door handed the user: the optimizer (for
DeepSpeed the ZeRO wrapper ``initialize`` returns, and ``shardopt.describe(engine)``), which must print one process's
table. Nothing is stepped: this is about routing, the parity suites check the numbers.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import shardopt  # noqa: E402
from launch import finish_worker, record_case  # noqa: E402

ENGINES = ("ddp", "fsdp2", "fsdp1", "fsdp1_flat", "zero1", "zero2", "zero3", "zero3_init")
MODELS = ("llama", "gpt2", "mixtral")
#: a user routing one matrix to AdamW: the engine must honour it like one process
USER_ROUTING = {"model.layers.0.self_attn.q_proj.weight": "adamw"}


#: architectures of the role corpus (``tests/role_corpus.py``) that the full tier also builds on every engine
CORPUS_MODELS = ("gemma", "opt", "bert_cls", "vit_cls", "t5", "qwen3_moe", "torchtitan_llama", "functional_tied")


def build_model(kind: str) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    if kind in CORPUS_MODELS:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
        from role_corpus import CORPUS

        return CORPUS[kind]()
    common = dict(
        vocab_size=48,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    if kind == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=48, n_positions=16, n_embd=16, n_layer=2, n_head=2))
    if kind == "mixtral":
        return tf.MixtralForCausalLM(
            tf.MixtralConfig(**common, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
        )
    return tf.LlamaForCausalLM(tf.LlamaConfig(**common, intermediate_size=40, tie_word_embeddings=False))


def _weights_loaded_later(kind: str):
    """What ``from_pretrained`` does under ``zero.Init``: no initialization of the partitioned weights (they are
    loaded afterwards). Building a corpus model's class directly would initialize them, and transformers' padding-row
    initialization indexes a partitioned (empty) embedding."""
    import contextlib

    if kind not in CORPUS_MODELS:
        return contextlib.nullcontext()
    from transformers.initialization import no_init_weights

    return no_init_weights()


def layers_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks an FSDP user wraps: the entries of the model's first list of two or more modules (the
    decoder layers; T5's encoder and decoder blocks alike, being of one type, through the auto-wrap policy)."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList | torch.nn.ModuleDict) and len(m) > 1]
    return list(lists[0].values() if isinstance(lists[0], torch.nn.ModuleDict) else lists[0])


def rules_of(opt) -> dict[str, str]:
    return {n: g["treatment"] for g, names in zip(opt._groups(), opt.group_param_names) for n in names}


def _ds_config(name: str, stage: int, routing: dict) -> dict:
    return {
        "train_batch_size": 2 * dist.get_world_size(),
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "shardopt": {"optimizer": name, "params": {"lr": 1e-3}, "routing": routing},
    }


def engine_rules(engine: str, kind: str, name: str, routing: dict) -> tuple[dict[str, str], dict[str, str]]:
    """The optimizer ``engine``'s front door builds for model ``kind``: its rules by parameter name, and the role
    tables of the objects the front door returned."""
    if engine.startswith("zero"):
        stage = int(engine[4])
        cfg = _ds_config(name, stage, routing)
        if engine == "zero3_init":  # what from_pretrained does under a ZeRO-3 config
            from deepspeed import zero

            with zero.Init(config_dict_or_path=cfg), _weights_loaded_later(kind):
                model = build_model(kind)
            if kind in CORPUS_MODELS and hasattr(model, "tie_weights"):
                model.tie_weights()  # as from_pretrained does once the weights are loaded
        else:
            model = build_model(kind)
        eng, returned, _, _ = shardopt.deepspeed.initialize(model=model, config=cfg)
        inner = eng.optimizer.optimizer if hasattr(eng.optimizer, "optimizer") else eng.optimizer
        return rules_of(inner), {
            "optimizer": returned.describe(),
            "engine": eng.describe(),
            "shardopt.describe(engine)": shardopt.describe(eng),
        }
    model = build_model(kind)
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
        opt = shardopt.create_optimizer(model.module, name, routing=routing, lr=1e-3)
    elif engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in layers_of(model):
            fully_shard(layer)
        fully_shard(model)
        opt = shardopt.create_optimizer(model, name, routing=routing, lr=1e-3)
    else:  # legacy FSDP, one unit per decoder layer (an auto-wrap policy, as accelerate and the Trainer do)
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FSDP(
            model,
            device_id=torch.device("cpu"),
            use_orig_params=engine == "fsdp1",
            auto_wrap_policy=ModuleWrapPolicy({type(layer) for layer in layers_of(model)}),
        )
        opt = shardopt.create_optimizer(model, name, routing=routing, lr=1e-3)
    return rules_of(opt), {"optimizer": opt.describe()}


def one_process(kind: str, name: str, routing: dict) -> tuple[dict[str, str], dict[str, str]]:
    opt = shardopt.create_optimizer(build_model(kind), name, routing=routing, lr=1e-3)
    return rules_of(opt), {"optimizer": opt.describe()}


def outcome(build) -> dict:
    """``{"rules": ..., "tables": ...}`` or ``{"refused": error type}``: a refusal is an answer (the same as one
    process's)."""
    try:
        rules, tables = build()
        return {"rules": rules, "tables": tables}
    except (ValueError, NotImplementedError) as err:
        return {"refused": type(err).__name__, "message": str(err)[:300]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", required=True, help="model:optimizer[:routed],... (routed: USER_ROUTING applied)")
    ap.add_argument("--engines", default=",".join(ENGINES))
    args = ap.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed("gloo", timeout=timedelta(seconds=180))
    records: list = []
    for spec in args.cases.split(","):
        kind, name, *flags = spec.split(":")
        routing = USER_ROUTING if "routed" in flags else {}
        record_case(
            records,
            {"case": spec, "engine": "one process"},
            partial(outcome, partial(one_process, kind, name, routing)),
        )
        for engine in args.engines.split(","):
            record_case(
                records,
                {"case": spec, "engine": engine},
                partial(outcome, partial(engine_rules, engine, kind, name, routing)),
            )
    finish_worker(records, args.out)


if __name__ == "__main__":
    from launch import settle_heap

    settle_heap()
    main()
