"""Megatron-core as the engine: a GPTModel under Megatron's DistributedDataParallel + DistributedOptimizer (flat
buffer shards that cut rows anywhere), tensor, pipeline and virtual (interleaved) pipeline parallelism through
Megatron's own schedules with two micro-batches, against one process training the whole model on the whole batch.

The model is the one that used to mislead role guessing (issue 52): learned absolute positions (GPTModel's default),
hidden size = max positions (a position table as wide as the hidden matrices) and ffn = vocabulary (``linear_fc1``
as wide as the logits), so a pipeline stage without the output layer had a hidden matrix taken for the LM head.

Runs on the CPU through the test-only ``megatron_cpu_shim``. Each case: every rank first trains the reference (the
whole GPTModel, tensor and pipeline size 1, shardopt.create_optimizer, the global batch's mean loss), then the
parallel model starting from the same weights; it reports the largest difference of any parameter after ``STEPS``
steps, each parameter's role and rule on both sides, and how many matrices the buffers cut mid-row.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from functools import partial

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import megatron_cpu_shim  # noqa: E402
from parity_worker import OPTIMIZERS  # noqa: E402

import shardopt  # noqa: E402
from launch import finish_worker, record_case  # noqa: E402

STEPS = 3
MICRO = 2  # micro-batches per step (gradient accumulation through the schedule)
GLOBAL = 24  # sequences per step, whatever the data-parallel size (a checkpoint reloads at another one)
#: hidden = max positions and ffn = vocab (see the module docstring); 4 heads of 3. Megatron's buffers start each
#: parameter at a multiple of 64 elements and cut them at multiples of 64, so rows of 16 or 64 are never cut mid-row:
#: 12 and 48 give every topology here a mid-row cut (64 gave TP 2 x DP 2 and DP 2 none)
SEQ, VOCAB, HEADS = 12, 48, 4
HIDDEN, FFN = SEQ, VOCAB
#: decoder layers: 2, or one per virtual stage of every pipeline stage (``main`` raises it for --vpp)
_layers = 2
EMBED, HEAD = "embedding.word_embeddings.weight", "output_layer.weight"
#: --edge: a frozen matrix and vector, and a matrix the forward never uses (Megatron's buffers give it a zero
#: gradient, as ZeRO's flat partitions do: the reference steps it with zeros too)
EDGE = {"frozen": ("embedding.position_embeddings.weight", "decoder.final_layernorm.bias"), "unused": "unused_proj"}
_edge = False
#: --device cuda: Megatron's real CUDA path (no shim) at world size 1, against the CPU reference
_device = "cpu"


def hyperparameters(name: str) -> tuple[dict, dict | None]:
    hp = dict(OPTIMIZERS[name])
    routing = hp.pop("routing", None)
    if routing is not None:  # the parity suite's routing, in GPTModel's names: embedding and head on the matrix rule
        routing = {EMBED: "matrix", HEAD: "matrix"}
    if _edge:  # the parameter without a gradient on the matrix rule
        routing = {**(routing or {}), EDGE["unused"]: "matrix"}
    return hp, routing


def build(tp: int, pp: int, bf16: bool = False, vpp: int | None = None):
    """The model's chunks on this rank: one GPTModel, or one per virtual stage (``vpp``), each with the embedding
    (``pre_process``) and output layer (``post_process``) only where the whole pipeline's first and last chunk is."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(
        num_layers=_layers,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=FFN,
        use_cpu_initialization=True,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        add_bias_linear=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
    )
    chunks = []
    for stage in range(vpp) if vpp else (None,):
        model = GPTModel(
            cfg,
            get_gpt_layer_local_spec(),
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            share_embeddings_and_output_weights=False,
            **({} if stage is None else {"vp_stage": stage}),
        )
        assert model.position_embedding_type == "learned_absolute" and cfg.hidden_size == SEQ and FFN == VOCAB
        if _edge:
            if model.pre_process:
                model.register_parameter(EDGE["unused"], torch.nn.Parameter(torch.randn(6, 5, dtype=cfg.params_dtype)))
            for n, p in model.named_parameters():
                if n in EDGE["frozen"]:
                    p.requires_grad_(False)
        chunks.append(model)
    if _device == "cpu":
        megatron_cpu_shim.install()
    return cfg, chunks


def global_named(chunks) -> list:
    """Every parameter of this rank's chunks under its name in the whole model (decoder layers by their global
    ``layer_number``, as the adapter names them: a stage, and each virtual stage, numbers its own from 0)."""
    from shardopt.megatron import global_named_parameters

    return global_named_parameters(chunks)


def tp_slice(full: torch.Tensor, p: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    if not getattr(p, "tensor_model_parallel", False):
        return full
    return full.chunk(tp, dim=int(p.partition_dim))[tp_rank]


def batch(step: int) -> torch.Tensor:
    """The global batch of a step (the reference sees all of it; a data-parallel rank its slice)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=g)


def forward_step(data_iterator, model):
    tokens = next(data_iterator)
    pos = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    out = model(tokens, pos, None, labels=torch.roll(tokens, -1, 1))
    return out, lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})


def reference(opt_name: str, dp: int):
    """The whole model on one process's view: (initial weights, final weights, role and rule by name, role sources)."""
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(1, 1)
    try:
        torch.manual_seed(0)
        _, (model,) = build(1, 1)
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        hp, routing = hyperparameters(opt_name)
        opt = shardopt.create_optimizer(model, opt_name, routing=routing, **hp)
        params = [p for p in model.parameters()]
        mbs = GLOBAL // (dp * MICRO)
        for s in range(STEPS):
            x = batch(s)
            # the gradient as Megatron forms it: each data-parallel rank sums its micro-batches' loss / MICRO in
            # fp32, scales the sum by 1 / dp, and the ranks' results are summed (the reduce-scatter)
            total = [torch.zeros_like(p) for p in params]
            for d in range(dp):
                for p in params:
                    p.grad = None
                for k in range(MICRO):
                    mb = x[(d * MICRO + k) * mbs : (d * MICRO + k + 1) * mbs]
                    pos = torch.arange(SEQ).unsqueeze(0).expand_as(mb)
                    (model(mb, pos, None, labels=torch.roll(mb, -1, 1)).float().mean() / MICRO).backward()
                for t, p in zip(total, params):
                    if p.grad is not None:
                        t.add_(p.grad * (1.0 / dp))
            for t, p in zip(total, params):
                p.grad = t if p.requires_grad else None  # a trainable parameter the forward skipped: zeros
            opt.step()
        return (init, {n: p.detach().clone() for n, p in model.named_parameters()}, rule_table(opt), role_sources(opt))
    finally:
        ps.destroy_model_parallel()


def rule_table(opt) -> dict[str, str]:
    """Each parameter's role and rule, as ``describe()`` lists them: the role (``lm_head``, ``embedding``,
    ``matrix``, ...) and the group's distinguishing options (``routing._rule``: SCALE's LM head and a hidden matrix
    share the treatment "scale" and differ in momentum), so a parameter given another role fails the comparison
    even where both roles take the same treatment."""
    return {row[0]: f"{row[2]}: {row[4]}" for row in opt.describe_rows()}


def role_sources(opt) -> dict[str, str]:
    """Where each parameter's role came from (``declared``, ``type``, ``guessed``, ``routing``)."""
    return {row[0]: row[3] for row in opt.describe_rows()}


def mid_row_cuts(opt) -> int:
    """Matrices whose pieces start or end inside a row on some rank (counted once, by the rank holding the cut)."""
    count = 0
    for t in opt.stepped_tensors():
        for frag in opt.fragments(t):
            m, n = frag.layout.shape
            if m < 2 or n < 2:
                continue
            piece = frag.layout.pieces[frag.layout.rank]
            lo = getattr(piece, "lo", 0)
            if 0 < lo < m * n and lo % n:
                count += 1
    return count


def setup(opt_name: str, tp: int, pp: int, init: dict, bf16: bool = False, vpp: int | None = None):
    """The (tp, pp, vpp) model from ``init`` under Megatron's DDP with the distributed optimizer (one DDP per
    chunk, as Megatron-LM wraps virtual stages), and shardopt's optimizer over every chunk of the stage."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig

    from shardopt.megatron import get_megatron_optimizer

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp
        )
    torch.manual_seed(0)
    cfg, chunks = build(tp, pp, bf16, vpp)
    tp_rank = ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for n, p in global_named(chunks):
            p.copy_(tp_slice(init[n], p, tp, tp_rank))
    if _device != "cpu":
        chunks = [c.to(_device) for c in chunks]
    if bf16:
        from megatron.core.transformer.module import Float16Module

        chunks = [Float16Module(cfg, c) for c in chunks]
    ddps = [
        DistributedDataParallel(
            cfg,
            DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True),
            c,
            disable_bucketing=i > 0,
        )
        for i, c in enumerate(chunks)
    ]
    # what Megatron's training loop sets: the data-parallel gradient reduction after the last micro-batch
    cfg.finalize_model_grads_func = finalize_model_grads
    cfg.no_sync_func = [d.no_sync for d in ddps] if len(ddps) > 1 else ddps[0].no_sync
    hp, routing = hyperparameters(opt_name)
    ocfg = OptimizerConfig(
        optimizer="adam",
        lr=hp.get("lr", 1e-3),
        use_distributed_optimizer=True,
        clip_grad=0.0,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
    )
    opt = get_megatron_optimizer(ocfg, ddps, opt_name, routing=routing, **hp)
    return ddps, opt


def train(ddps, opt, steps) -> None:
    """``steps`` through Megatron's schedule (the interleaved one with virtual stages): each chunk reads the same
    micro-batches (the first uses the tokens, the last the labels)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mbs = GLOBAL // (dp * MICRO)
    fb = get_forward_backward_func()  # the interleaved schedule when there are virtual stages
    for s in steps:
        x = batch(s)
        per = MICRO * mbs
        mine = x[dp_rank * per : (dp_rank + 1) * per]
        data = [mine[k * mbs : (k + 1) * mbs].to(_device) for k in range(MICRO)]
        for d in ddps:
            d.zero_grad_buffer()
        opt.zero_grad()
        fb(
            forward_step_func=forward_step,
            data_iterator=[iter(data) for _ in ddps],
            model=ddps,
            num_microbatches=MICRO,
            seq_length=SEQ,
            micro_batch_size=mbs,
            forward_only=False,
        )
        ok, _, _ = opt.step()
        assert ok


def weights(ddps) -> dict:
    """This rank's parameters by global name: (values, tensor-parallel dimension or None)."""
    return {
        n: (
            p.detach().float().cpu().clone(),
            int(p.partition_dim) if getattr(p, "tensor_model_parallel", False) else None,
        )
        for n, p in global_named(ddps)
    }


def parallel(opt_name: str, tp: int, pp: int, init: dict, bf16: bool = False, vpp: int | None = None):
    """Train the (tp, pp, vpp) model from ``init`` through Megatron's schedule; final local weights and rules."""
    from megatron.core import parallel_state as ps

    ddps, opt = setup(opt_name, tp, pp, init, bf16, vpp)
    train(ddps, opt, range(STEPS))
    rules = rule_table(opt.shardopt)  # global names already (layers numbered as in one process)
    parallel.sources = role_sources(opt.shardopt)
    parallel.heads = [unwrap(d).post_process for d in ddps]  # which chunks hold the output layer
    cuts = mid_row_cuts(opt.shardopt)
    parallel.stand_ins = len(opt._stand_ins)  # parameters this rank holds no piece of
    parallel.main_pieces = all(
        any(t is m for g in (opt.shard_fp32_groups + opt.shard_fp32_from_float16_groups) for m in g)
        for t in opt.shardopt.stepped_tensors()
        if t.numel()
    )
    parallel.fp32_state = all(
        v.dtype == torch.float32 for st in opt.shardopt.state.values() for v in _tensors(st) if v.is_floating_point()
    )
    return weights(ddps), rules, cuts, (ps.get_tensor_model_parallel_rank(), tp)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def dist_save(ddps, opt, path: str) -> None:
    from megatron.core import dist_checkpointing

    (ddp,) = ddps  # the checkpoint cases run without virtual stages
    model_sd = unwrap(ddp).sharded_state_dict()
    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save({"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd)}, path)


def dist_load(ddps, opt, path: str) -> None:
    from megatron.core import dist_checkpointing

    (ddp,) = ddps
    model = unwrap(ddp)
    model_sd = model.sharded_state_dict()
    loaded = dist_checkpointing.load(
        {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=True)}, path
    )
    model.load_state_dict(loaded["model"], strict=False)
    opt.load_state_dict(loaded["optimizer"])


def compare(final: dict, ref: dict, tp_rank: int, tp_world: int) -> float:
    diff = 0.0
    for n, (p, dim) in final.items():
        want = ref[n] if dim is None else ref[n].chunk(tp_world, dim=dim)[tp_rank]
        diff = max(diff, (p - want).abs().max().item())
    t = torch.tensor([diff])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def checkpoint_case(
    opt_name: str, tp: int, pp: int, save: str | None, load: str | None, fmt: str, bf16: bool = False
) -> dict:
    """``save``: train STEPS - 1 steps, write Megatron's distributed checkpoint and shardopt's file, train on; then a
    fresh model and optimizer load the distributed checkpoint and take the last step. ``load``: a fresh model and
    optimizer (any data-parallel size) load ``fmt`` ("dist", "shardopt" or "both", one after the other) from ``load``
    and take the last step. Both against one process."""
    from megatron.core import parallel_state as ps

    import shardopt.checkpoint as ckpt

    dp = dist.get_world_size() // (tp * pp)
    init, ref, _, _ = reference(opt_name, dp)
    out: dict = {}
    try:
        if save:
            ddps, opt = setup(opt_name, tp, pp, init, bf16)
            train(ddps, opt, range(STEPS - 1))
            dist_save(ddps, opt, os.path.join(save, f"{opt_name}-dist"))
            ckpt.save(os.path.join(save, f"{opt_name}-shardopt"), opt)
            import copy

            rank_state = copy.deepcopy(opt.state_dict())  # this rank's pieces: the same topology only
            train(ddps, opt, range(STEPS - 1, STEPS))
            continuous = weights(ddps)
            out["continuous_diff"] = compare(continuous, ref, ps.get_tensor_model_parallel_rank(), tp)
            load, fmt = save, "dist"
        for f in ("dist", "shardopt") if fmt == "both" else (fmt,):
            ddps, opt = setup(opt_name, tp, pp, init, bf16)
            if f == "dist":
                dist_load(ddps, opt, os.path.join(load, f"{opt_name}-dist"))
            else:
                ckpt.load(os.path.join(load, f"{opt_name}-shardopt"), opt)
            train(ddps, opt, range(STEPS - 1, STEPS))
            resumed = weights(ddps)
            out[f"max_abs_diff_{f}"] = compare(resumed, ref, ps.get_tensor_model_parallel_rank(), tp)
            if not save:
                ps.destroy_model_parallel()
        if save:
            out["resume_vs_continuous"] = compare(resumed, {n: p for n, (p, _) in continuous.items()}, 0, 1)
            ddps, opt = setup(opt_name, tp, pp, init, bf16)  # Megatron-LM's order: optimizer built, then loaded
            opt.load_state_dict(rank_state)
            train(ddps, opt, range(STEPS - 1, STEPS))
            out["state_dict_resume_vs_continuous"] = compare(
                weights(ddps), {n: p for n, (p, _) in continuous.items()}, 0, 1
            )
        return out
    finally:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()


def unwrap(ddp):
    from shardopt.plugin.megatron_engine import unwrap as unwrap_

    return unwrap_(ddp)


def case(opt_name: str, tp: int, pp: int, bf16: bool = False, vpp: int | None = None) -> dict:
    from megatron.core import parallel_state as ps

    init, ref, ref_rules, ref_sources = reference(opt_name, dist.get_world_size() // (tp * pp))
    try:
        final, rules, cuts, (tp_rank, tp_world) = parallel(opt_name, tp, pp, init, bf16, vpp)
        diff = compare(final, ref, tp_rank, tp_world)
        wrong = sorted(n for n, r in rules.items() if ref_rules.get(n) != r)
        wrong_sources = sorted(n for n, r in parallel.sources.items() if ref_sources.get(n) != r)
        # chunks holding decoder layers but not the output layer: where a head used to be guessed
        headless = sum(not h for h in parallel.heads)
        stats = torch.tensor(
            [
                diff,
                float(cuts),
                float(len(wrong)),
                float(parallel.stand_ins),
                float(not parallel.main_pieces),
                float(not parallel.fp32_state),
                float(len(wrong_sources)),
                float(headless),
                float(len(rules)),
            ]
        )
        dist.all_reduce(stats[1:], op=dist.ReduceOp.SUM)
        seen = [None] * dist.get_world_size()
        dist.all_gather_object(seen, (rules, wrong, wrong_sources))
        covered = sorted(set().union(*(set(r) for r, _, _ in seen)))
        # every rank holding a parameter (tensor-parallel and data-parallel peers alike) gave it one role and rule
        agree = all(r[n] == other[n] for r, _, _ in seen for other, _, _ in seen for n in set(r) & set(other))
        return {
            "max_abs_diff": stats[0].item(),
            "mid_row_cuts": int(stats[1].item()),
            "wrong_rules": sorted({n: (ref_rules.get(n), r[n]) for r, w, _ in seen for n in w}.items()),
            "n_wrong_rules": int(stats[2].item()),
            "covered": covered == sorted(ref_rules),
            "stand_ins": int(stats[3].item()),
            "second_copies": int(stats[4].item()),
            "non_fp32_state": int(stats[5].item()),
            "wrong_sources": sorted({n for _, _, ws in seen for n in ws}),
            "n_wrong_sources": int(stats[6].item()),
            "headless_chunks": int(stats[7].item()),
            "roles_compared": int(stats[8].item()),
            "ranks_agree": agree,
            "reference_roles": ref_rules,
            "reference_sources": ref_sources,
            "rules": sorted(set(ref_rules.values())),
        }
    finally:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per pipeline stage (interleaved)")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--save", help="checkpoint mode: save here, then resume from it")
    ap.add_argument("--load", help="checkpoint mode: resume from a checkpoint saved at another size")
    ap.add_argument("--format", default="dist", choices=("dist", "shardopt", "both"))
    ap.add_argument("--edge", action="store_true", help="frozen and unused parameters (EDGE)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = ap.parse_args()
    global _edge, _device, _layers
    _edge, _device = args.edge, args.device
    _layers = max(_layers, args.pp * (args.vpp or 1))
    warnings.simplefilter("ignore")
    import logging

    logging.disable(logging.WARNING)
    if _device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if _device == "cuda" else "gloo")
    if os.environ.get("SHARDOPT_TRACEBACK_AFTER"):  # debugging a hang: every rank's stack after that many seconds
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["SHARDOPT_TRACEBACK_AFTER"]), exit=True)
    records = []
    for name in args.optimizers.split(","):
        rec = {
            "optimizer": name,
            "tp": args.tp,
            "pp": args.pp,
            "vpp": args.vpp,
            "layers": _layers,
            "bf16": args.bf16,
            "edge": args.edge,
            "world_size": dist.get_world_size(),
        }
        if args.save or args.load:
            rec["format"] = args.format
            record_case(
                records,
                rec,
                partial(checkpoint_case, name, args.tp, args.pp, args.save, args.load, args.format, args.bf16),
            )
        else:
            record_case(records, rec, partial(case, name, args.tp, args.pp, args.bf16, args.vpp))
    finish_worker(records, args.out)


if __name__ == "__main__":
    main()
