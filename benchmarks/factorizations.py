"""The small factorizations the whole-matrix optimizers need, timed as batches of same-shape matrices: which
routine a device runs well, in which precision.

    python -m benchmarks.factorizations --device cuda
    python -m benchmarks.factorizations --quick

Shapes are LLaMA-130M/350M's (ASGO's k x k roots, SUMO's and Alice's rank-r Grams and tall QR, the range
finder's sketches), the batch the number of matrices of that shape in the model. The products in fp32, fp64,
TF32 and bf16 give the time model's rates (``shardopt.sharding.time_model``), the factorizations their rates and
per-call latencies, the iterative rows what CUDA runs in their place. Each case is timed as the median of a few calls
after one warm-up call; the ``per matrix`` column divides by the batch.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Callable

import torch

from .cli import parse_args
from .results import fmt, markdown_table, write_results
from .timing import repeat_timing


def _spd(batch: int, k: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    g = torch.randn(batch, k, 2 * k, generator=gen).to(device)
    v = g @ g.mT / (2 * k) + 1e-3 * torch.eye(k, device=device)
    return v.to(dtype)


def cases(device: torch.device, scale: int) -> list[tuple[str, tuple[int, ...], Callable[[], Any]]]:
    from shardopt.sharding.iterative import cholesky_qr2_checked, inverse_sqrt_checked, polar_from_gram_checked
    from shardopt.sharding.matfun import coupled_inverse_sqrt, inverse_root, polar_factor
    from shardopt.sharding.precision import matmul_in

    gen = torch.Generator().manual_seed(0)
    out = []
    for batch, k in ((84 // scale, 768 // scale), (168 // scale, 1024 // scale)):
        for dtype in (torch.float64, torch.float32):
            a = _spd(batch, k, dtype, device, gen)
            tag = "fp64" if dtype == torch.float64 else "fp32"
            out.append((f"eigh {tag}", (batch, k, k), lambda a=a: torch.linalg.eigh(a)))
            out.append((f"cholesky {tag}", (batch, k, k), lambda a=a: torch.linalg.cholesky_ex(a)))
        a32 = _spd(batch, k, torch.float32, device, gen)
        for steps in (8, 20):
            out.append(
                (
                    f"coupled NS root fp32, {steps} steps",
                    (batch, k, k),
                    lambda a=a32, s=steps: coupled_inverse_sqrt(a, s, 1e-30),
                )
            )
        out.append(("one fp32 product", (batch, k, k), lambda a=a32: a @ a))
        tf32 = matmul_in("tf32")
        out.append(("one tf32 product", (batch, k, k), lambda a=a32, mm=tf32: mm(a, a)))
        a16 = a32.bfloat16()
        out.append(("one bf16 product", (batch, k, k), lambda a=a16: a @ a))
        a64 = a32.double()
        out.append(("one fp64 product", (batch, k, k), lambda a=a64: a @ a))
        out.append(("checked fp64 NS root (iterative)", (batch, k, k), lambda a=a64: inverse_sqrt_checked(a, 1e-6)))
        out.append(("ASGO root, auto route", (batch, k, k), lambda a=a32: inverse_root(a, 1e-6, "auto")))
    for batch, r, m in ((84 // scale, 128 // scale, 2048 // scale), (168 // scale, 256 // scale, 2736 // scale)):
        for dtype in (torch.float64, torch.float32):
            tag = "fp64" if dtype == torch.float64 else "fp32"
            x = torch.randn(batch, m, r, generator=gen).to(device, dtype)
            s = x.mT @ x
            out.append((f"eigh r x r {tag}", (batch, r, r), lambda s=s: torch.linalg.eigh(s)))
            out.append((f"svd r x m {tag}", (batch, r, m), lambda x=x: torch.linalg.svd(x.mT, full_matrices=False)))
            out.append((f"qr m x r {tag}", (batch, m, r), lambda x=x: torch.linalg.qr(x)))
            out.append((f"cholesky r x r {tag}", (batch, r, r), lambda s=s: torch.linalg.cholesky_ex(s)))
        moment = torch.randn(batch, r, m, generator=gen).to(device)
        tol = m * torch.finfo(torch.float32).eps
        moment64 = moment.double()
        out.append(
            (
                "checked fp64 polar (iterative)",
                (batch, r, m),
                lambda x=moment64, t=tol: polar_from_gram_checked(x, t),
            )
        )
        out.append(("SUMO polar, auto route", (batch, r, m), lambda x=moment, t=tol: polar_factor(x, rtol=t)))
        sketch = torch.randn(batch, m, r + 10, generator=gen).to(device, torch.float64)
        out.append(
            ("Cholesky-QR2 m x w fp64 (iterative)", (batch, m, r + 10), lambda x=sketch: cholesky_qr2_checked(x))
        )
        out.append(("qr m x w fp64", (batch, m, r + 10), lambda x=sketch: torch.linalg.qr(x)))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scale", type=int, default=1, help="divide every size by this (CPU smoke runs)")
    ap.add_argument("--out", default=None)
    args = parse_args(ap, argv, dict(scale=8, repeats=2))
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    records = []
    for name, shape, fn in cases(device, args.scale):
        t = statistics.median(repeat_timing(fn, device, args.repeats, warmup=1))
        records.append({"case": name, "shape": list(shape), "ms": t * 1e3, "ms_per_matrix": t * 1e3 / shape[0]})
        print(
            f"  {name:34s} {str(tuple(shape)):20s} {t * 1e3:10.2f} ms  {t * 1e3 / shape[0]:8.3f} ms/matrix", flush=True
        )
    md = markdown_table(
        ["case", "batch x shape", "ms", "ms per matrix"],
        [
            [r["case"], " x ".join(map(str, r["shape"])), fmt(r["ms"], ".2f"), fmt(r["ms_per_matrix"], ".3f")]
            for r in records
        ],
    )
    stem = args.out or ("factorizations" if args.device == "cpu" else "factorizations_cuda")
    path = write_results(stem, vars(args), records, md, device=args.device, out_dir=args.results_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
