"""Optimizer step time on LLaMA-60M/130M shapes, every optimizer next to ``torch.optim.AdamW`` in one run.

    python -m benchmarks.step_time                       # 60m and 130m on the CPU
    python -m benchmarks.step_time --device cuda         # the same figures on a GPU
    python -m benchmarks.step_time --quick               # tiny shapes, seconds

Single process, no forward pass: the real module (so routing sends embedding, LM head and norm gains where
the optimizer's paper does) with random gradients; ``optimizer.step()`` is timed after warm-up steps that
allocate state. Each step is also compared with its floor: the fewest bytes it must move (read G, read and
write W and the state, ``benchmarks.costmodel``) at the measured streaming bandwidth, or its matrix-product
FLOPs at the measured matmul rate, whichever is larger. A refresh-based optimizer (an interval hyperparameter K)
is timed over K consecutive steps, which hold exactly one refresh whatever the phase, and reported per step.
"""

from __future__ import annotations

import argparse
import gc
import statistics
from typing import Any

import torch

from . import costmodel, optimizers, targets
from .cli import parse_args
from .models import GALORE_VOCAB, build_llama, describe, random_grads
from .results import fmt, markdown_table, write_results
from .timing import matmul_flops, paired_timing, stream_bandwidth, time_call


def step_floor(name: str, opt: torch.optim.Optimizer) -> tuple[float | None, float]:
    """(compulsory bytes, matrix FLOPs) of one step; bytes ``None`` when a rule has no formula."""
    traffic, flops = 0.0, 0.0
    for group in opt.param_groups:
        rule = "adamw" if name.startswith("adamw") or group.get("treatment") == "adamw" else name
        for p in group["params"]:
            m, n = costmodel.matrix_view(p)
            moved = costmodel.traffic_elements(rule, m, n, group)
            if moved is None:
                return None, flops
            traffic += moved * p.element_size()
            flops += costmodel.matrix_flops(rule, m, n, group)
    return traffic, flops


def _paired(
    fn, reference, device: torch.device, args: argparse.Namespace, per_round: int = 1, warmup: int = 0
) -> dict[str, Any]:
    """Rounds of (one AdamW foreach step, ``per_round`` steps of ``fn``): medians and the median round ratio."""
    times, refs = paired_timing(
        fn,
        reference,
        device,
        max(1, args.repeats // per_round),
        per_round=per_round,
        warmup=warmup,
        max_seconds=args.max_seconds,
    )
    ratios = [t / r for t, r in zip(times, refs)]
    return {
        "median_s": statistics.median(times),
        "times_s": times,
        "adamw_foreach_paired_s": refs,
        "vs_adamw_foreach": statistics.median(ratios),
    }


def time_steps(
    name: str, model: torch.nn.Module, reference: torch.optim.Optimizer, device: torch.device, args: argparse.Namespace
) -> dict[str, Any]:
    """Build ``name`` on ``model``, time its steps in rounds paired with ``reference`` steps, return one record."""
    rec: dict[str, Any] = {"optimizer": name}
    try:
        opt = optimizers.build(name, model, on_nonfinite=args.on_nonfinite)
        first = time_call(opt.step, device)  # allocates state, builds plans; never timed
    except (RuntimeError, ValueError, TypeError) as exc:
        return {**rec, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:200]}
    warmup = 0 if first > args.max_seconds / 4 else 1  # a second warm-up only where it is cheap
    interval = costmodel.interval_of(opt)
    if interval is None:
        rec.update(method="per step", **_paired(opt.step, reference.step, device, args, warmup=warmup))
    else:
        key, k = interval
        rec["interval"] = {"key": key, "steps": k}
        if k <= args.max_interval:  # any k consecutive steps hold exactly one refresh
            rec.update(
                method=f"whole interval of {k} steps", **_paired(opt.step, reference.step, device, args, per_round=k)
            )
        else:
            rec.update(_two_part_estimate(name, opt, key, k, model, reference, device, args))
    rec["traffic_bytes"], rec["flops"] = step_floor(name, opt)
    return rec


def _two_part_estimate(
    name: str,
    opt: torch.optim.Optimizer,
    key: str,
    k: int,
    model: torch.nn.Module,
    reference: torch.optim.Optimizer,
    device: torch.device,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """For intervals too long to time whole here: plain steps, plus the same optimizer refreshing every step
    (each paired with AdamW steps); amortized = (refresh + (k - 1) * plain) / k, times and ratios alike."""
    plain = _paired(opt.step, reference.step, device, args, warmup=1)
    try:
        every = optimizers.build(name, model, **{key: 1})
        time_call(every.step, device)
        refresh = _paired(every.step, reference.step, device, args, warmup=1)
        del every
    except (RuntimeError, ValueError, TypeError) as exc:
        return {**plain, "method": f"plain steps only (refresh not timed: {exc})"}
    amortized = {f: (refresh[f] + (k - 1) * plain[f]) / k for f in ("median_s", "vs_adamw_foreach")}
    return {
        "method": f"estimate: ({key}=1 step + {k - 1} plain steps) / {k}",
        **amortized,
        "plain_s": plain["median_s"],
        "refresh_step_s": refresh["median_s"],
        "times_s": plain["times_s"] + refresh["times_s"],
        "adamw_foreach_paired_s": plain["adamw_foreach_paired_s"] + refresh["adamw_foreach_paired_s"],
    }


def run_size(
    size: str, names: list[str], device: torch.device, args: argparse.Namespace, roofline: dict[str, float]
) -> list[dict[str, Any]]:
    """Every optimizer on preset ``size``, each timed in rounds that alternate with AdamW (foreach) steps on the
    same parameters; the ratio is the median over rounds, so a shared machine's drifting load cancels."""
    model = build_llama(size, args.vocab, device, num_layers=args.layers)
    random_grads(model, seed=0)
    print(f"[{size}] {describe(model)}", flush=True)
    reference = optimizers.build("adamw_foreach", model)
    time_call(reference.step, device)
    records = []
    for name in names:
        rec = {"size": size, **time_steps(name, model, reference, device, args)}
        gc.collect()  # the optimizer and its state are gone; give the memory back before the next one
        if device.type == "cuda":
            torch.cuda.empty_cache()
        records.append(rec)
        print(
            f"  {name:14s} "
            + (
                rec.get("error")
                or f"{rec['median_s'] * 1e3:9.2f} ms  "
                f"{rec['vs_adamw_foreach']:.2f}x AdamW foreach (paired median "
                f"{statistics.median(rec['adamw_foreach_paired_s']) * 1e3:.2f} ms; "
                f"{rec['method']})"
            ),
            flush=True,
        )
    fused = next((r.get("median_s") for r in records if r["optimizer"] == "adamw_fused"), None)
    for rec in records:
        t = rec.get("median_s")
        if t is None:
            continue
        rec["vs_adamw_fused"] = t / fused if fused else None
        floor = max((rec["traffic_bytes"] or 0) / roofline["bandwidth"], rec["flops"] / roofline["flops"])
        rec["floor_s"] = floor if rec["traffic_bytes"] is not None else None
        rec["time_over_floor"] = t / floor if rec["floor_s"] else None
        rec["target"] = targets.STEP_TIME_VS_ADAMW.get(rec["optimizer"])
        rec["verdict"] = targets.step_time_verdict(rec["optimizer"], rec.get("vs_adamw_foreach"))
    del model, reference
    gc.collect()
    return records


def to_markdown(records: list[dict[str, Any]], roofline: dict[str, float]) -> str:
    streams = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in roofline["streams"].items() if k != "best")
    out = [
        f"Streaming bandwidth {roofline['bandwidth'] / 1e9:.1f} GB/s (best of {streams} GB/s), fp32 matmul "
        f"{roofline['flops'] / 1e9:.1f} GFLOP/s, measured in this run. Floor = max(compulsory bytes / "
        "bandwidth, matrix FLOPs / matmul rate); compulsory bytes = read G, read and write W and every state "
        "tensor once. Below ~50 MB of traffic (tiny shapes) data stays in cache and the floor is not binding.\n"
    ]
    for size in dict.fromkeys(r["size"] for r in records):
        rows = []
        for r in (r for r in records if r["size"] == size):
            if "error" in r:
                rows.append([r["optimizer"], r["error"]] + [""] * 7)
                continue
            rows.append(
                [
                    r["optimizer"],
                    fmt(r["median_s"] * 1e3, ".2f"),
                    fmt(r.get("vs_adamw_foreach"), ".2f"),
                    fmt(r.get("vs_adamw_fused"), ".2f"),
                    fmt(r["traffic_bytes"] / 1e9 if r["traffic_bytes"] is not None else None, ".3f"),
                    fmt(r["flops"] / 1e9, ".1f"),
                    fmt(r["floor_s"] * 1e3 if r["floor_s"] else None, ".2f"),
                    fmt(r["time_over_floor"], ".1f"),
                    f"<= {r['target']}x: {r['verdict']}" if r["target"] else r["verdict"],
                ]
            )
        out.append(
            f"\n## {size}\n\n"
            + markdown_table(
                [
                    "optimizer",
                    "step ms",
                    "/ AdamW foreach",
                    "/ AdamW fused",
                    "floor GB",
                    "GFLOP",
                    "floor ms",
                    "time / floor",
                    "target",
                ],
                rows,
            )
        )
    return "".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="60m,130m", help="model presets (shardopt.train.model.PRESETS)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--optimizers", default=None, help="comma list of shardopt names (default: all registered)")
    ap.add_argument("--repeats", type=int, default=10, help="timed steps per optimizer (median reported)")
    ap.add_argument("--max-seconds", type=float, default=30.0, help="stop repeating after this much timed work")
    ap.add_argument(
        "--max-interval",
        type=int,
        default=50,
        help="time refresh intervals up to this many steps whole; estimate longer ones",
    )
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads)")
    ap.add_argument("--vocab", type=int, default=GALORE_VOCAB)
    ap.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    ap.add_argument(
        "--on-nonfinite",
        default=None,
        choices=["skip", "raise", "ignore"],
        help="shardopt's non-finite check (default: the optimizer's, skip); 'ignore' reads no device "
        "value per step, as torch's AdamW",
    )
    ap.add_argument(
        "--out", default=None, help="result file stem under benchmarks/results/ (default step_time, or step_time_cuda)"
    )
    args = parse_args(ap, argv, dict(sizes="tiny", vocab=4096, repeats=3, max_seconds=2.0, max_interval=5))
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible to torch")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    names = list(optimizers.ADAMW_VARIANTS) + optimizers.select(args.optimizers, optimizers.registered())
    streams = stream_bandwidth(device)
    roofline = {"bandwidth": streams["best"], "flops": matmul_flops(device), "streams": streams}
    print(
        f"device {device}: "
        + ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in streams.items())
        + f", matmul {roofline['flops'] / 1e9:.1f} GFLOP/s"
    )
    records = []
    for size in args.sizes.split(","):
        records += run_size(size.strip(), names, device, args, roofline)
    notes = [
        "'/ AdamW foreach': median over rounds of (this optimizer's step / an AdamW(foreach) step over every "
        "parameter of the same model, timed back to back in the same round), so drifting machine load cancels; "
        "the adamw_foreach row is AdamW against itself (the noise floor). '/ AdamW fused': against the fused "
        "AdamW's median in this run.",
        "Refresh-based optimizers: time per step over a whole refresh interval (see 'method' in the JSON).",
        f"shardopt's non-finite check: on_nonfinite={args.on_nonfinite or 'skip'}"
        + (" (the default: one host read of a device flag per step)" if args.on_nonfinite in (None, "skip") else ""),
    ]
    config = {k: v for k, v in vars(args).items()} | {"roofline": roofline}
    stem = args.out or ("step_time" if args.device == "cpu" else "step_time_cuda")
    path = write_results(
        stem, config, records, to_markdown(records, roofline), notes, device=args.device, out_dir=args.results_dir
    )
    print(f"wrote {path} and {path.with_suffix('.md')}")


if __name__ == "__main__":
    main()
