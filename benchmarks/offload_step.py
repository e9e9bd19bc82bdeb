"""The optimizer step on CPU-resident partitions (ZeRO-Offload), every rule next to ``DeepSpeedCPUAdam`` in one run.

    python -m benchmarks.offload_step                 # LLaMA-350M shapes, every rule, 1 thread
    python -m benchmarks.offload_step --quick         # the tiny preset, seconds

Under optimizer offload each rank steps its fp32 partition in CPU memory: the CPU's time is the step's time.
Single process (a world size 1 partition: whole matrices in CPU memory), random gradients, no forward pass. The
350M model is timed per shape, not whole (its 24 layers x 7 matrices at once take minutes per step for the
whole-matrix rules on this benchmark's 2-core machine): the step of the model cut to 1 layer and to 2 layers (each
with the embedding, LM head and norms) is timed, and the 24-layer step is ``t1 + 23 (t2 - t1)``, every layer
having the same shapes. Steps are timed after one warm-up step (state allocation and the first refresh of SUMO,
Alice and ASGO): refresh-based rules are reported at their steady step; their refresh (every ``refresh_interval``
steps, default 200 for SUMO) is one more range finder per matrix.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from .models import build_llama, random_grads
from .results import fmt, markdown_table, write_results

RULES = ("scale", "sinkgd", "racs", "muon", "swan", "asgo", "dasgo", "sumo", "alice", "alice0")


def _build(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name == "ds_cpu_adam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(model.parameters(), lr=1e-3, adamw_mode=True)
    if name == "torch_adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    import shardopt

    return shardopt.create_optimizer(model, name)


def step_seconds(name: str, preset: str, layers: int, steps: int, vocab: int) -> float:
    """Mean seconds of ``steps`` optimizer steps after one warm-up step, ``preset`` cut to ``layers`` layers."""
    model = build_llama(preset, vocab_size=vocab, num_layers=layers)
    random_grads(model)
    opt = _build(name, model)
    opt.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    out = (time.perf_counter() - t0) / steps
    del opt, model
    gc.collect()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="350m")
    ap.add_argument("--layers", type=int, default=24, help="the full model's layer count (350m: 24)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--optimizers", default=",".join(("ds_cpu_adam", "torch_adamw") + RULES))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="the tiny preset (4 layers), vocab 1000")
    ap.add_argument("--name", default="offload_step")
    args = ap.parse_args()
    if args.quick:
        args.preset, args.layers, args.vocab = "tiny", 4, 1000
    torch.set_num_threads(args.threads)
    records = []
    for name in args.optimizers.split(","):
        t1 = step_seconds(name, args.preset, 1, args.steps, args.vocab)
        t2 = step_seconds(name, args.preset, 2, args.steps, args.vocab)
        layer = max(t2 - t1, 0.0)
        total = t1 + (args.layers - 1) * layer
        records.append(
            {"optimizer": name, "one_layer_s": t1, "two_layers_s": t2, "per_layer_s": layer, "model_step_s": total}
        )
        print(f"{name}: 1 layer {t1:.3f} s, 2 layers {t2:.3f} s -> {args.layers} layers {total:.2f} s", flush=True)
    base = next((r["model_step_s"] for r in records if r["optimizer"] == "ds_cpu_adam"), None)
    rows = [
        [
            r["optimizer"],
            fmt(r["one_layer_s"]),
            fmt(r["per_layer_s"]),
            fmt(r["model_step_s"]),
            fmt(r["model_step_s"] / base) if base else "-",
        ]
        for r in records
    ]
    md = markdown_table(
        [
            "optimizer",
            "embedding + head + 1 layer (s)",
            "per layer (s)",
            f"{args.preset} step, {args.layers} layers (s)",
            "x DeepSpeedCPUAdam",
        ],
        rows,
    )
    notes = [
        f"LLaMA-{args.preset} shapes (vocab {args.vocab}), one process, {args.threads} CPU thread(s), fp32 "
        "partitions in CPU memory (ZeRO-Offload's world-size-1 partition; P ranks each step about 1/P of it)",
        f"the {args.layers}-layer step is t(1 layer) + {args.layers - 1} x (t(2 layers) - t(1 layer)); "
        f"mean of {args.steps} steps after one warm-up step (refreshes excluded: steady steps)",
        "ds_cpu_adam: deepspeed.ops.adam.DeepSpeedCPUAdam (adamw_mode), the optimizer DeepSpeed runs under "
        "offload; torch_adamw: torch.optim.AdamW(foreach=True)",
    ]
    write_results(args.name, vars(args), records, md, notes)


if __name__ == "__main__":
    main()
