"""Where one optimizer step spends its time: the top kernels and operators, launches and host syncs per step.

    python -m benchmarks.step_profile --device cuda --sizes 130m        # every optimizer on a GPU
    python -m benchmarks.step_profile --quick                           # tiny shapes on the CPU

Single process, random gradients (as ``benchmarks.step_time``). After warm-up steps, ``torch.profiler`` records
``--steps`` steps; per optimizer the record holds the wall time per step, kernel launches and device-to-host
synchronizations per step (``cudaStreamSynchronize``/``cudaDeviceSynchronize`` runtime calls on CUDA; ``cudaMemcpy*``
calls are counted apart, since device-to-device copies do not wait), and the operators with the most self device time
(self CPU time on a CPU). What it is for: deciding what to change next in the GPU step (issue 29), with the figures
recorded beside the code that produced them.
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from . import optimizers
from .cli import parse_args
from .models import GALORE_VOCAB, build_llama, describe, random_grads
from .results import fmt, markdown_table, write_results
from .timing import sync

#: CUDA runtime calls that make the host wait for the device
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
#: copies: device-to-host ones wait for the device, device-to-device ones (``unbind_copy`` into state tensors)
#: do not; the profiler's runtime events do not say which, so they are counted apart
MEMCPY_CALLS = ("cudaMemcpy", "cudaMemcpyAsync")
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def _device_time_us(evt: Any) -> float:
    return float(getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0))


def profile_steps(name: str, model: torch.nn.Module, device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    rec: dict[str, Any] = {"optimizer": name}
    try:
        opt = optimizers.build(name, model, **({"foreach": True} if name == "adamw" else {}))
        for _ in range(args.warmup):
            opt.step()
        sync(device)
    except (RuntimeError, ValueError, TypeError) as exc:
        return {**rec, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:200]}
    t0 = time.perf_counter()
    for _ in range(args.steps):
        opt.step()
    sync(device)
    rec["step_ms"] = (time.perf_counter() - t0) / args.steps * 1e3
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            opt.step()
        sync(device)
    events = prof.key_averages()
    per = 1.0 / args.steps
    rec["syncs_per_step"] = sum(e.count for e in events if e.key in SYNC_CALLS) * per
    rec["memcpy_per_step"] = sum(e.count for e in events if e.key in MEMCPY_CALLS) * per
    rec["launches_per_step"] = sum(e.count for e in events if e.key in LAUNCH_CALLS) * per
    on_device = device.type == "cuda"
    key = _device_time_us if on_device else (lambda e: float(e.self_cpu_time_total))
    ops = sorted((e for e in events if key(e) > 0 and not e.key.startswith("cuda")), key=key, reverse=True)
    total = sum(key(e) for e in ops) or 1.0
    rec["busy_ms"] = total * per / 1e3
    rec["top"] = [
        {"op": e.key[:90], "ms_per_step": key(e) * per / 1e3, "share": key(e) / total, "calls_per_step": e.count * per}
        for e in ops[: args.top]
    ]
    del opt
    return rec


def to_markdown(records: list[dict[str, Any]], device: str) -> str:
    busy = "device-busy ms" if device == "cuda" else "CPU-busy ms"
    out = []
    for size in dict.fromkeys(r["size"] for r in records):
        rows = [
            [
                r["optimizer"],
                r.get("error") or fmt(r["step_ms"], ".2f"),
                fmt(r.get("busy_ms"), ".2f"),
                fmt(r.get("launches_per_step"), ".0f"),
                fmt(r.get("syncs_per_step"), ".0f"),
                fmt(r.get("memcpy_per_step"), ".0f"),
                "; ".join(f"{t['op']} {t['ms_per_step']:.2f}" for t in r.get("top", [])[:3]),
            ]
            for r in records
            if r["size"] == size
        ]
        out.append(
            f"\n## {size}\n\n"
            + markdown_table(
                [
                    "optimizer",
                    "wall ms / step",
                    busy,
                    "launches / step",
                    "syncs / step",
                    "memcpy / step",
                    "top 3 ops (ms / step)",
                ],
                rows,
            )
        )
    return "".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="130m")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--optimizers", default=None, help="comma list (default: adamw and every registered name)")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps (and unprofiled timed steps)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--top", type=int, default=12, help="operators recorded per optimizer")
    ap.add_argument("--vocab", type=int, default=GALORE_VOCAB)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--out", default=None, help="result stem (default step_profile or step_profile_cuda)")
    args = parse_args(ap, argv, dict(sizes="tiny", vocab=4096, steps=2, warmup=1))
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible to torch")
    device = torch.device(args.device)
    names = ["adamw"] + optimizers.select(args.optimizers, optimizers.registered())
    records = []
    for size in args.sizes.split(","):
        model = build_llama(size.strip(), args.vocab, device, num_layers=args.layers)
        random_grads(model)
        print(f"[{size}] {describe(model)}", flush=True)
        for name in names:
            rec = {"size": size, **profile_steps(name, model, device, args)}
            records.append(rec)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if "error" in rec:
                print(f"  {name:8s} {rec['error']}", flush=True)
                continue
            print(
                f"  {name:8s} {rec['step_ms']:9.2f} ms  busy {rec['busy_ms']:8.2f} ms  "
                f"launches {rec['launches_per_step']:6.0f}  syncs {rec['syncs_per_step']:4.0f}  "
                f"memcpy {rec['memcpy_per_step']:4.0f}",
                flush=True,
            )
            for t in rec["top"][:6]:
                print(
                    f"      {t['ms_per_step']:8.2f} ms {t['share']:5.1%} x{t['calls_per_step']:5.0f}  {t['op']}",
                    flush=True,
                )
        del model
        gc.collect()
    stem = args.out or ("step_profile" if args.device == "cpu" else "step_profile_cuda")
    notes = [
        "Per step, averaged over the profiled steps. 'syncs': stream/device/event synchronize calls; "
        "'memcpy': cudaMemcpy(Async) calls, device-to-host (a wait) and device-to-device (no wait) alike; "
        "'launches': kernel launches. Device-busy time sums the "
        "operators' self device time (overlap counted once per operator)."
    ]
    path = write_results(
        stem,
        vars(args),
        records,
        to_markdown(records, args.device),
        notes,
        device=args.device,
        out_dir=args.results_dir,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
