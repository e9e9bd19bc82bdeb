"""The optimizer step on CPU-resident partitions (ZeRO-Offload), the whole model, every rule next to
``DeepSpeedCPUAdam`` in one run.

    python -m benchmarks.offload_step                 # the acceptance run: whole LLaMA-350M, threads = the cores
    python -m benchmarks.offload_step --whole-matrix  # also Muon, SWAN, ASGO (minutes per step each on a CPU)
    python -m benchmarks.offload_step --quick         # the tiny preset, seconds

Under optimizer offload each rank steps its fp32 partition in CPU memory: the CPU's time is the step's time.
One process (ZeRO-Offload's world-size-1 partition: whole matrices in CPU memory), random gradients, no forward
pass, the whole model stepped (no extrapolation from cut models). Every optimizer gets a fresh model; the step
is the median of ``--steps`` steps after one warm-up step (state allocation, the first basis of SUMO and Alice).
``DeepSpeedCPUAdam`` (vectorized C++, OpenMP: ``OMP_NUM_THREADS`` is set to the same thread count before it is
built) runs first and last: the base of the ratios is the mean of the two, and their spread says how steady the
machine was. Refresh-based rules (Alice, Alice-0, SUMO) report their steady step, one refresh step (the next step
made a refresh by shortening its interval for that step) and the amortized step at their default interval.

Every row also has its bytes floor: the DRAM traffic the rule's element-wise passes need at the fewest passes
its math allows (fp32: 4 bytes an element a pass; ``FLOOR_BYTES``), divided by the machine's bandwidth measured in
the same run (``a += b`` over 2 x 256 MiB). Low-rank rules (Alice, SUMO) are bound by their products, not bytes:
their column ``flop floor`` counts ``4 r m n`` per matrix (``U^T A`` and the back-projection) at the machine's
measured fp32 GEMM rate.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from typing import Any

import torch

from .models import build_llama, random_grads
from .results import QUICK_DIR, fmt, markdown_table, write_results

#: element-wise rules, the default run (bytes-bound: a few passes over the partition)
ELEMENTWISE = ("scale", "dasgo", "racs", "sinkgd", "alice", "sumo")
#: whole-matrix rules (an orthogonalization, whitening or root of every matrix every step): ``--whole-matrix``
WHOLE_MATRIX = ("muon", "swan", "asgo", "alice0")
#: DRAM bytes per element of the fewest passes each treatment's math allows (fp32, 4 bytes a read or write).
#: Adam reads p, g, m, v and writes p, m, v (28). SCALE per row: the row statistic and the update share one read
#: of g (``row_passes``), then p is read and written (12); per column (the embedding) the statistic needs every row
#: first (16); momentum groups add the EMA's read of m and g and write of m (12). DASGO: the EMA (12) with the
#: column energies of g read in the same pass, then m and p read, p written (24). SinkGD: one read of G per sweep
#: (row sums, reciprocal and column sums of cache-sized row blocks) and the update (4 L + 12). RACS: one read per
#: fixed-point step plus its first column pass, the update (4 (L + 1) + 12).
FLOOR_BYTES = {
    "adamw": lambda g: 28,
    "scale": lambda g: (12 if g.get("norm_dim", 1) == 1 else 16) + (12 if g.get("momentum") else 0),
    "dasgo": lambda g: 24,
    "sinkgd": lambda g: 4 * g.get("iterations", 5) + 12,
    "racs": lambda g: 4 * (g.get("iterations", 5) + 1) + 12,
}
#: shardopt's default non-finite check (``on_nonfinite="skip"``) reads every gradient once more per step
CHECK_BYTES = 4
REFRESH_RULES = {"alice": "alice", "alice0": "alice", "sumo": "sumo"}


def _build(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name == "ds_cpu_adam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(model.parameters(), lr=1e-3, adamw_mode=True)
    if name == "torch_adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # no foreach temporaries (+1.5 GB at 350M)
    import shardopt

    return shardopt.create_optimizer(model, name)


def _timed(opt: torch.optim.Optimizer) -> float:
    t0 = time.perf_counter()
    opt.step()
    return time.perf_counter() - t0


def _force_refresh(opt: torch.optim.Optimizer, kind: str) -> list[tuple[dict, int]]:
    """Shorten each group's refresh interval so the next step refreshes (Alice: the upcoming count c refreshes
    where c % K == 0; SUMO: where (c - 1) % K == 0); returns what to restore."""
    saved = []
    for group in opt.param_groups:
        if "refresh_interval" not in group or not group["params"]:
            continue
        done = max(int(opt.state[p].get("step", 0)) for p in group["params"])
        saved.append((group, group["refresh_interval"]))
        group["refresh_interval"] = done + 1 if kind == "alice" else max(done, 1)
    return saved


def floor_bytes(opt: torch.optim.Optimizer) -> int | None:
    """The step's DRAM bytes at the fewest passes its math allows (``FLOOR_BYTES``) plus the non-finite check's
    read (``CHECK_BYTES``); None where a treatment has none listed (products, not bytes, bound it)."""
    total = 0
    for group in opt.param_groups:
        treatment = group.get("treatment", "adamw")
        rule = FLOOR_BYTES.get(treatment)
        if rule is None:
            return None
        total += (rule(group) + CHECK_BYTES) * sum(p.numel() for p in group["params"])
    return total


def flop_floor(opt: torch.optim.Optimizer) -> float:
    """``4 r m n`` per low-rank matrix (``sigma = U^T A`` and the back-projection ``U w``), 0 for the rest."""
    total = 0.0
    for group in opt.param_groups:
        r = group.get("rank")
        if not r or group.get("treatment", "adamw") == "adamw":
            continue
        for p in group["params"]:
            if p.dim() >= 2:
                m, n = p.shape[-2], p.shape[-1]
                total += 4.0 * min(int(r), m, n) * m * n * (p.numel() // (m * n))
    return total


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One optimizer on a fresh whole model: warm-up, the median of ``args.steps`` steps, and for refresh-based
    rules one refresh step."""
    model = build_llama(args.preset, vocab_size=args.vocab, num_layers=args.layers)
    random_grads(model)
    opt = _build(name, model)
    rec: dict[str, Any] = {"optimizer": name}
    rec["warmup_s"] = _timed(opt)
    times = [_timed(opt) for _ in range(args.steps)]
    rec["steps_s"] = times
    rec["step_s"] = statistics.median(times)
    kind = REFRESH_RULES.get(name)
    if kind is not None:
        saved = _force_refresh(opt, kind)
        rec["refresh_s"] = _timed(opt)
        for group, interval in saved:
            group["refresh_interval"] = interval
        every = saved[0][1] if saved else 1
        rec["refresh_interval"] = every
        rec["amortized_s"] = rec["step_s"] + (rec["refresh_s"] - rec["step_s"]) / every
    if name not in ("ds_cpu_adam", "torch_adamw"):
        rec["floor_bytes"] = floor_bytes(opt)
        rec["flop_floor"] = flop_floor(opt) or None
    else:
        rec["floor_bytes"] = 28 * sum(p.numel() for p in model.parameters())
        rec["flop_floor"] = None
    rec["params"] = sum(p.numel() for p in model.parameters())
    del opt, model
    gc.collect()
    return rec


def bandwidth(elements: int = 1 << 26, repeats: int = 5) -> float:
    """Bytes per second of ``a += b`` (two reads, one write of fp32) over two tensors, the best of ``repeats``."""
    a, b = torch.ones(elements), torch.ones(elements)
    best = min(_time_op(lambda: a.add_(b)) for _ in range(repeats))
    return 12 * elements / best


def gemm_rate(n: int = 2048, repeats: int = 3) -> float:
    """FLOP per second of an fp32 ``n x n`` matrix product, the best of ``repeats``."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = min(_time_op(lambda: a @ b) for _ in range(repeats))
    return 2.0 * n**3 / best


def _time_op(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="350m")
    ap.add_argument("--layers", type=int, default=None, help="cut the model to this many layers (default: all)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per optimizer (the median is reported)")
    ap.add_argument("--optimizers", default=None, help="comma-separated (default: Adam baselines + element-wise)")
    ap.add_argument("--whole-matrix", action="store_true", help=f"also {', '.join(WHOLE_MATRIX)} (minutes each)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="default: the cores given")
    ap.add_argument("--quick", action="store_true", help="the tiny preset, vocab 1000, 2 steps")
    ap.add_argument("--name", default="offload_step")
    args = ap.parse_args()
    if args.quick:
        args.preset, args.vocab, args.steps = "tiny", 1000, 2
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # DeepSpeedCPUAdam's OpenMP, read when its op loads
    rules = args.optimizers.split(",") if args.optimizers else list(ELEMENTWISE)
    if args.whole_matrix:
        rules += [r for r in WHOLE_MATRIX if r not in rules]
    order = ["ds_cpu_adam", "torch_adamw"] + [r for r in rules if r not in ("ds_cpu_adam", "torch_adamw")]
    order.append("ds_cpu_adam")  # again at the end: the base is the mean of both runs
    bw = bandwidth()
    flops = gemm_rate()
    print(f"bandwidth (a += b): {bw / 1e9:.1f} GB/s; fp32 GEMM: {flops / 1e9:.0f} GFLOP/s", flush=True)
    records = []
    for name in order:
        rec = measure(name, args)
        records.append(rec)
        extra = ""
        if "refresh_s" in rec:
            extra = f", refresh {rec['refresh_s']:.3f} s, amortized {rec['amortized_s']:.3f} s"
        print(f"{name}: step {rec['step_s']:.3f} s (steps {[round(t, 3) for t in rec['steps_s']]}){extra}", flush=True)
    ds = [r["step_s"] for r in records if r["optimizer"] == "ds_cpu_adam"]
    base = sum(ds) / len(ds)
    rows = []
    for k, r in enumerate(records):
        r["x_cpu_adam"] = r["step_s"] / base
        floor_s = r["floor_bytes"] / bw if r["floor_bytes"] else None
        if r["flop_floor"]:
            floor_s = max(floor_s or 0.0, r["flop_floor"] / flops)
        r["floor_s"] = floor_s
        label = r["optimizer"] + (" (first)" if k == 0 else " (last)" if r["optimizer"] == "ds_cpu_adam" else "")
        rows.append(
            [
                label,
                fmt(r["step_s"]),
                fmt(r["x_cpu_adam"]),
                fmt(r.get("refresh_s")),
                fmt(r.get("amortized_s")),
                fmt(r["amortized_s"] / base) if "amortized_s" in r else "n/a",
                fmt(r["floor_bytes"] / r["params"]) if r["floor_bytes"] else "n/a",
                fmt(floor_s),
                fmt(r["step_s"] / floor_s) if floor_s else "n/a",
            ]
        )
    md = markdown_table(
        [
            "optimizer",
            "step (s)",
            "x DeepSpeedCPUAdam",
            "refresh step (s)",
            "amortized (s)",
            "amortized x CPUAdam",
            "floor bytes / param",
            "floor (s)",
            "step / floor",
        ],
        rows,
    )
    model_params = records[0]["params"]
    notes = [
        f"LLaMA-{args.preset} ({model_params / 1e6:.0f}M parameters, vocab {args.vocab}), the whole model stepped, "
        f"one process, {args.threads} thread(s) (torch and DeepSpeedCPUAdam's OpenMP), fp32 in CPU memory "
        "(ZeRO-Offload's world-size-1 partition; P ranks each step about 1/P of it)",
        f"median of {args.steps} steps after one warm-up step; x DeepSpeedCPUAdam against the mean of its first and "
        f"last run ({ds[0]:.3f} s and {ds[-1]:.3f} s)",
        f"measured bandwidth (a += b, 12 bytes an element): {bw / 1e9:.1f} GB/s; fp32 GEMM {flops / 1e9:.0f} GFLOP/s; "
        "floor = the bytes of the fewest passes the rule's math allows, plus shardopt's non-finite check (one read of "
        "every gradient), / bandwidth (benchmarks/offload_step.py FLOOR_BYTES, CHECK_BYTES); for low-rank rules "
        "4 r m n FLOPs per matrix / the GEMM rate",
        "refresh step: the next step made a basis refresh (its interval shortened for that step); amortized = "
        "steady + (refresh - steady) / K at the rule's default K",
        "ds_cpu_adam: deepspeed.ops.adam.DeepSpeedCPUAdam (adamw_mode); torch_adamw: torch.optim.AdamW(fused=True)",
    ]
    write_results(args.name, vars(args), records, md, notes, out_dir=QUICK_DIR if args.quick else None)
    print(md)
    if args.preset != "350m" or args.layers is not None:
        print(f"(LLaMA-{args.preset}, not the whole 350M: no acceptance verdict)")
        return
    print("acceptance (x DeepSpeedCPUAdam; targets SCALE, DASGO <= 0.8, RACS <= 1.0, SinkGD, Alice steady <= 2.0):")
    targets = {"scale": 0.8, "dasgo": 0.8, "racs": 1.0, "sinkgd": 2.0, "alice": 2.0}
    for r in records:
        if r["optimizer"] in targets:
            t = targets[r["optimizer"]]
            verdict = "holds" if r["x_cpu_adam"] <= t else "fails"
            print(f"  {r['optimizer']}: {r['x_cpu_adam']:.2f}x (target <= {t}): {verdict}")


if __name__ == "__main__":
    main()
