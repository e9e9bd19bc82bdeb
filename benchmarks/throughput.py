"""Training throughput: tokens/s of whole iterations (forward, backward, optimizer step) for every optimizer beside
fused AdamW, on LLaMA 130M and 350M shapes.

    python -m benchmarks.throughput --device cuda                 # 130m and 350m on a GPU (bf16 autocast, SDPA)
    python -m benchmarks.throughput --quick                       # tiny shapes on the CPU, seconds

What the papers report (SCALE: 44.7k tokens/s against Adam's 45.0k at 1B; RACS and Alice within 11% and 15% of
Adam) is the throughput of training, so this times training, not the step alone: random tokens (the data
pipeline is not what is measured), fp32 master weights, bf16 autocast on CUDA (fp32 on the CPU), the model's
``scaled_dot_product_attention`` (FlashAttention on the GPU), one micro-batch per iteration and no gradient
accumulation. Each optimizer trains a fresh copy of the same model (same initial weights): ``--warmup``
untimed iterations (state allocated, plans built, kernels loaded), then ``--iters`` timed ones, each with device
events around the optimizer step so the step's share of the iteration is known.

A real run steps once per global batch, not per micro-batch: GaLore's 130M/350M runs (whose shapes these are)
take 512 sequences of 256 tokens per step, 8 micro-batches of 64 with gradient accumulation on one GPU. The
``global batch`` columns derive that rate from the same measurements, ``A`` micro-batches of forward and
backward (iteration minus step) per step: ``A tokens / (A (iteration - step) + step)``; nothing overlaps the
step in one stream, so this is what accumulation would measure, without timing ``A`` times as many iterations.

On CUDA the whole-matrix rules also run as variants (``--variants``, default ``CUDA_VARIANTS``): Muon at
``matrix_ops.precision="ieee"`` beside its default (bf16 there), ASGO refreshing its roots every 10 steps.

Refresh-based optimizers (SUMO's and Alice's subspace every K steps) pay a refresh once per K steps. Timing K
iterations would hold exactly one, but K = 200 iterations per optimizer would not fit a short GPU lease, so the
rate is amortized: plain iterations (median) plus (refresh step - plain step) / K, the refresh step timed on a
copy of the optimizer that refreshes at every step (``refresh_interval=1``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
from typing import Any

import torch

from shardopt.sharding import iterative

from . import costmodel, optimizers
from .cli import parse_args
from .models import GALORE_VOCAB, build_llama, describe
from .results import fmt, markdown_table, write_results
from .timing import repeat_timing, sync

#: training throughput the papers report (tokens/s, optimizer / Adam), for the README's side-by-side table
PAPER_RATIOS = {
    "scale": ("44.7k vs Adam 45.0k tokens/s at 1B (arXiv:2506.16659)", 44.7 / 45.0),
    "racs": ("within 11% of Adam (arXiv:2502.07752)", 0.89),
    "alice": ("within 15% of Adam (arXiv:2502.07752)", 0.85),
}

#: issue 29's acceptance at 350M: tokens/s vs fused AdamW
TARGETS = {
    "scale": 0.99,
    "sinkgd": 0.99,
    "dasgo": 0.99,
    "racs": 0.97,
    "muon": 0.97,
    "swan": 0.97,
    "alice": 0.95,
    "alice0": 0.95,
    "sumo": 0.95,
    "asgo": 0.90,
}


class _Timer:
    """Wall time of an iteration and of its optimizer step: CUDA events on a GPU, the host clock on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, a: Any, b: Any) -> float:
        if self.cuda:
            return a.elapsed_time(b) / 1e3
        return b - a


def _batches(vocab: int, batch: int, seq: int, device: torch.device, count: int, seed: int = 0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    data = [torch.randint(0, vocab, (batch, seq + 1), generator=gen).to(device) for _ in range(min(count, 4))]
    for i in range(count):
        tokens = data[i % len(data)]
        yield tokens[:, :-1], tokens[:, 1:]


def _autocast(device: torch.device, args: argparse.Namespace):
    """bf16 autocast on CUDA (unless ``--fp32``); fp32 on a CPU."""
    if device.type == "cuda" and not args.fp32:
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_iterations(
    model: torch.nn.Module, opt: torch.optim.Optimizer, args: argparse.Namespace, device: torch.device, count: int
) -> tuple[list[float], list[float], float]:
    """(iteration seconds, step seconds, last loss) over ``count`` iterations."""
    timer = _Timer(device)
    marks = []
    loss = torch.zeros(())
    for x, y in _batches(model.config.vocab_size, args.batch, args.seq, device, count):
        start = timer.mark()
        with _autocast(device, args):
            loss = model(x, y)
        loss.backward()
        before_step = timer.mark()
        opt.step()
        opt.zero_grad(set_to_none=True)
        marks.append((start, before_step, timer.mark()))
    sync(device)
    iters = [timer.seconds(a, c) for a, _, c in marks]
    steps = [timer.seconds(b, c) for _, b, c in marks]
    return iters, steps, float(loss.detach())


#: variants timed beside the defaults on CUDA (issue 42): each whole-matrix rule's ieee route where its default
#: differs there (``matrix_ops.precision``), and ASGO refreshing its roots every 10 steps (its Algorithm 2's tau)
CUDA_VARIANTS = "muon@ieee,asgo:refresh_interval=10"


def parse_variant(name: str) -> tuple[str, dict[str, Any]]:
    """``"muon@ieee"`` -> ``("muon", {"matrix_ops": {"precision": "ieee"}})``; ``"asgo:refresh_interval=10"`` ->
    ``("asgo", {"refresh_interval": 10})``; a plain name -> ``(name, {})``."""
    base, _, precision = name.partition("@")
    base, *pairs = base.split(":")
    hp: dict[str, Any] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            hp[key] = int(value)
        except ValueError:
            hp[key] = float(value) if value.replace(".", "", 1).replace("e-", "", 1).isdigit() else value
    if precision:
        hp["matrix_ops"] = {"precision": precision}
    return base, hp


def refresh_step_seconds(
    name: str,
    model: torch.nn.Module,
    key: str,
    device: torch.device,
    repeats: int = 3,
    hyperparameters: dict[str, Any] | None = None,
) -> float:
    """Median seconds of an optimizer step that refreshes (``key = 1``), on the model's current gradients."""
    opt = optimizers.build(name, model, **{**(hyperparameters or {}), key: 1})
    times = repeat_timing(opt.step, device, repeats, warmup=1)  # the warm-up step allocates state
    del opt
    return statistics.median(times)


def run_optimizer(name: str, size: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    model = build_llama(size, args.vocab, device, seed=0)
    tokens = args.batch * args.seq
    rec: dict[str, Any] = {"size": size, "optimizer": name, "tokens_per_iteration": tokens}
    base, hp = parse_variant(name)
    iterative.fallback_counts(reset=True)
    try:
        opt = optimizers.build(base, model, on_nonfinite=args.on_nonfinite, **hp)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        train_iterations(model, opt, args, device, args.warmup)
        iters, steps, loss = train_iterations(model, opt, args, device, args.iters)
    except (RuntimeError, ValueError, TypeError) as exc:  # out of memory included: recorded, the rest go on
        del model
        return {**rec, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:200]}
    it, st = statistics.median(iters), statistics.median(steps)
    rec.update(
        iteration_s=it,
        step_s=st,
        loss=loss,
        iteration_times_s=iters,
        step_times_s=steps,
        fallbacks=iterative.fallback_counts(reset=True),
    )  # matrices the iterative routes left to eigh/svd/qr
    interval = costmodel.interval_of(opt)
    if device.type == "cuda":
        rec["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    del opt
    if interval is not None:
        key, k = interval
        # gradients for the refresh timing: one more backward on the trained model
        x, y = next(_batches(model.config.vocab_size, args.batch, args.seq, device, 1, seed=1))
        with _autocast(device, args):
            model(x, y).backward()
        refresh = refresh_step_seconds(base, model, key, device, hyperparameters=hp)
        rec.update(interval={"key": key, "steps": k}, refresh_step_s=refresh)
        it += max(0.0, refresh - st) / k
        st += max(0.0, refresh - st) / k
    rec.update(amortized_iteration_s=it, amortized_step_s=st, tokens_per_s=tokens / it, step_share=st / it)
    acc = max(1, args.global_batch // args.batch)
    rec.update(accumulation=acc, global_tokens_per_s=acc * tokens / (acc * (it - st) + st))
    del model
    return rec


def to_markdown(records: list[dict[str, Any]]) -> str:
    out = []
    for size in dict.fromkeys(r["size"] for r in records):
        rows = []
        for r in (r for r in records if r["size"] == size):
            if "error" in r:
                rows.append([r["optimizer"], r["error"]] + [""] * 9)
                continue
            target = TARGETS.get(r["optimizer"])
            verdict = (
                ""
                if target is None or r.get("vs_adamw_fused") is None
                else (f">= {target}: {'met' if r['vs_adamw_fused'] >= target else 'missed'}")
            )
            global_rate = r.get("global_tokens_per_s")
            paper = PAPER_RATIOS.get(r["optimizer"], ("", None))[0]
            label = r["optimizer"] + (" (again, last)" if r.get("repeat") else "")
            rows.append(
                [
                    label,
                    fmt(r["tokens_per_s"] / 1e3, ".1f"),
                    fmt(r.get("vs_adamw_fused"), ".3f"),
                    fmt(r["amortized_step_s"] * 1e3, ".2f"),
                    fmt(r["step_share"] * 100, ".1f"),
                    fmt(r.get("peak_memory_gib"), ".2f"),
                    verdict,
                    fmt(global_rate / 1e3 if global_rate else None, ".1f"),
                    fmt(r.get("vs_adamw_fused_global"), ".3f"),
                    paper,
                    str(sum(r.get("fallbacks", {}).values())),
                ]
            )
        out.append(
            f"\n## {size}\n\n"
            + markdown_table(
                [
                    "optimizer",
                    "k tokens/s",
                    "/ AdamW fused",
                    "step ms",
                    "step % of iteration",
                    "peak GiB",
                    "target (350m)",
                    "global batch: k tokens/s",
                    "/ AdamW fused",
                    "paper",
                    "fallbacks",
                ],
                rows,
            )
        )
    return "".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="130m,350m", help="model presets (shardopt.train.model.PRESETS)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--optimizers", default=None, help="comma list of shardopt names (default: all registered)")
    ap.add_argument("--batch", type=int, default=64, help="sequences per micro-batch")
    ap.add_argument("--seq", type=int, default=256, help="tokens per sequence (the presets' context, as GaLore's runs)")
    ap.add_argument(
        "--global-batch",
        type=int,
        default=512,
        help="sequences per optimizer step for the derived global-batch rate (GaLore's 130M/350M runs)",
    )
    ap.add_argument("--iters", type=int, default=10, help="timed iterations per optimizer (median reported)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed iterations first")
    ap.add_argument("--vocab", type=int, default=GALORE_VOCAB)
    ap.add_argument("--fp32", action="store_true", help="no bf16 autocast on CUDA")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    ap.add_argument(
        "--on-nonfinite",
        default=None,
        choices=["skip", "raise", "ignore"],
        help="shardopt's non-finite check (default: the optimizer's, skip); 'ignore' reads no device "
        "value per step, as torch's AdamW",
    )
    ap.add_argument(
        "--variants",
        default=None,
        help="extra runs, optimizer[:key=value...][@precision] (default on CUDA: " + CUDA_VARIANTS + ")",
    )
    ap.add_argument("--out", default=None, help="result stem (default throughput or throughput_cuda)")
    args = parse_args(ap, argv, dict(sizes="tiny", vocab=4096, batch=4, seq=64, iters=3, warmup=1, global_batch=32))
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible to torch")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    names = ["adamw_fused" if device.type == "cuda" else "adamw_foreach"]
    names += optimizers.select(args.optimizers, optimizers.registered())
    variants = CUDA_VARIANTS if args.variants is None and device.type == "cuda" else (args.variants or "")
    names += [
        v.strip()
        for v in variants.split(",")
        if v.strip()  # the default ones of the optimizers selected
        and (args.variants is not None or parse_variant(v.strip())[0] in names)
    ]
    records = []
    for size in args.sizes.split(","):
        size = size.strip()
        probe = build_llama(size, args.vocab, "meta")
        print(f"[{size}] {describe(probe)}; {args.batch} x {args.seq} tokens per iteration", flush=True)
        size_records = []
        # the baseline first and again last: the ratios are against the mean of both, so a drift of the
        # device's speed over the run (clocks, temperature) cancels to first order instead of landing on the
        # optimizers timed last; the two baseline rates are recorded
        for k, name in enumerate(names + names[:1]):
            rec = run_optimizer(name, size, args, device)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if k == len(names):
                rec["repeat"] = "baseline again, last"
            size_records.append(rec)
            print(
                f"  {name:12s} "
                + (
                    rec.get("error")
                    or f"{rec['tokens_per_s'] / 1e3:9.1f} k tokens/s  step "
                    f"{rec['amortized_step_s'] * 1e3:8.2f} ms ({rec['step_share']:.1%})  iteration "
                    f"{rec['amortized_iteration_s'] * 1e3:8.2f} ms  peak {rec.get('peak_memory_gib', 0):.2f} GiB  "
                    f"loss {rec['loss']:.3f}"
                ),
                flush=True,
            )
        bases = [r for r in (size_records[0], size_records[-1]) if "tokens_per_s" in r]
        if bases:
            base = statistics.fmean(r["tokens_per_s"] for r in bases)
            base_global = statistics.fmean(r["global_tokens_per_s"] for r in bases)
            for rec in size_records:
                if "tokens_per_s" in rec:
                    rec["vs_adamw_fused"] = rec["tokens_per_s"] / base
                    rec["vs_adamw_fused_global"] = rec["global_tokens_per_s"] / base_global
            drift = size_records[-1].get("tokens_per_s", base) / size_records[0].get("tokens_per_s", base) - 1
            print(f"  baseline drift over the run: {drift:+.1%}; ratios against the mean of both", flush=True)
        records += size_records
    notes = [
        f"global batch: {args.global_batch} sequences per optimizer step, derived (module docstring).",
        "tokens/s = tokens per iteration / median iteration time, amortized over the refresh interval where "
        "an optimizer has one (see the module docstring); '/ AdamW fused': against the mean of the baseline's "
        "two runs of the same size, the first and the last row (foreach AdamW on a CPU, which has no fused "
        "kernel), so that drift over the run cancels; their difference is the run's drift.",
        "step %: the optimizer step's share of the iteration (device events around step() and zero_grad).",
        "paper: the throughput the optimizer's paper reports, on its own hardware and model.",
        f"shardopt's non-finite check: on_nonfinite={args.on_nonfinite or 'skip'}"
        + (" (the default: one host read of a device flag per step)" if args.on_nonfinite in (None, "skip") else ""),
    ]
    stem = args.out or ("throughput" if args.device == "cpu" else "throughput_cuda")
    path = write_results(
        stem, vars(args), records, to_markdown(records), notes, device=args.device, out_dir=args.results_dir
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
