"""What CUDA graphs would give the optimizer step: each optimizer's step captured whole, replayed, and compared.

    python -m benchmarks.cuda_graphs --device cuda [--sizes 350m] [--optimizers scale,sinkgd]

A GPU step of the element-wise rules is bound by the host (about 240 kernel launches from Python per step at
350M, against 1.2 ms of compulsory traffic), which a captured graph replays without. For each optimizer this
captures ``step()`` after warm-up steps (on a side stream, as torch's recipe does), replays it beside the same
optimizer stepping eagerly on an identical model with the same gradients, and reports: whether the capture
succeeds (a step that reads a device value on the host cannot be captured), eager and replayed step times
against the step's floor (``benchmarks.step_time``), and how far the replayed weights drift from the eager ones
per role (a value the Python code computes per step, e.g. a bias correction, is frozen at capture). The
non-finite check reads a device value on the host, so it is off (``on_nonfinite="ignore"``) in both copies.

Each optimizer runs in a process of its own: a capture that fails can leave the CUDA context unusable.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

import torch

from . import optimizers
from .cli import parse_args
from .models import build_llama, random_grads
from .results import fmt, markdown_table, write_results
from .step_time import step_floor
from .timing import matmul_flops, repeat_timing, stream_bandwidth

DEFAULT_OPTIMIZERS = "adamw_fused,scale,sinkgd,racs,dasgo,muon,alice,sumo,asgo"


def _build(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name.startswith("adamw"):
        return optimizers.build(name, model, capturable=True)
    return optimizers.build(name, model, on_nonfinite="ignore")


def _drift(a: torch.nn.Module, b: torch.nn.Module, start: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per role (matrices, vectors): max |W_eager - W_graph| / max |W_eager - W_start|."""
    out: dict[str, list[float]] = {"matrices": [0.0, 0.0], "vectors": [0.0, 0.0]}
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        role = out["matrices" if pa.dim() >= 2 else "vectors"]
        role[0] = max(role[0], float((pa - pb).abs().max()))
        role[1] = max(role[1], float((pa - start[name]).abs().max()))
    return {k: (d / m if m else 0.0) for k, (d, m) in out.items()}


def probe(name: str, size: str, steps: int, repeats: int) -> dict[str, Any]:
    """Capture ``name``'s step on ``size``, replay it ``steps`` times beside eager steps; one record."""
    dev = torch.device("cuda")
    eager_model, graph_model = build_llama(size, device=dev, seed=0), build_llama(size, device=dev, seed=0)
    random_grads(eager_model, seed=1)
    for pa, pb in zip(eager_model.parameters(), graph_model.parameters()):
        pb.grad = pa.grad.clone()
    eager, graphed = _build(name, eager_model), _build(name, graph_model)
    rec: dict[str, Any] = {"optimizer": name, "size": size}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: state, plans and the allocator's blocks exist before the capture
        for _ in range(3):
            graphed.step()
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(3):
        eager.step()
    start = {n: p.detach().clone() for n, p in eager_model.named_parameters()}
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            graphed.step()
    except Exception as exc:  # noqa: BLE001 - what stops a capture is the finding
        rec["captured"] = False
        rec["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        return rec
    rec["captured"] = True
    for _ in range(steps):
        eager.step()
        graph.replay()
    torch.cuda.synchronize()
    rec["drift"] = _drift(eager_model, graph_model, start)
    del start
    rec["eager_ms"] = 1e3 * statistics.median(repeat_timing(eager.step, dev, repeats, warmup=1))
    rec["graph_ms"] = 1e3 * statistics.median(repeat_timing(graph.replay, dev, repeats, warmup=1))
    inner = optimizers.shardopt_of(eager) or eager
    rec["floor_bytes"], rec["flops"] = step_floor(name, inner)
    return rec


def run_one(name: str, size: str, steps: int, repeats: int, timeout: float) -> dict[str, Any]:
    """``probe`` in a child process (a failed capture may poison the CUDA context)."""
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.cuda_graphs",
        "--child",
        name,
        "--sizes",
        size,
        "--steps",
        str(steps),
        "--repeats",
        str(repeats),
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=os.environ.copy())
    except subprocess.TimeoutExpired:
        return {"optimizer": name, "size": size, "captured": None, "error": f"timed out after {timeout:.0f} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {
        "optimizer": name,
        "size": size,
        "captured": None,
        "error": f"exit {done.returncode}: " + (done.stderr.strip().splitlines() or ["no output"])[-1][:300],
    }


def _over_floor(ms: float | None, floor_ms: float | None) -> str:
    """A time as a multiple of the roofline floor; blank where either is missing."""
    return fmt(ms / floor_ms) if floor_ms and ms else ""


def to_markdown(records: list[dict[str, Any]], roofline: dict[str, float]) -> str:
    rows = []
    for r in records:
        floor_ms = None
        if r.get("floor_bytes") is not None:
            floor_ms = 1e3 * max(r["floor_bytes"] / roofline["bandwidth"], (r.get("flops") or 0.0) / roofline["flops"])
        drift = r.get("drift") or {}
        rows.append(
            [
                r["size"],
                r["optimizer"],
                {True: "yes", False: "no", None: "?"}[r.get("captured")],
                fmt(r.get("eager_ms")),
                fmt(r.get("graph_ms")),
                fmt(floor_ms),
                _over_floor(r.get("eager_ms"), floor_ms),
                _over_floor(r.get("graph_ms"), floor_ms),
                fmt(drift.get("matrices")),
                fmt(drift.get("vectors")),
                r.get("error", ""),
            ]
        )
    return markdown_table(
        [
            "size",
            "optimizer",
            "captured",
            "eager ms",
            "graph ms",
            "floor ms",
            "eager / floor",
            "graph / floor",
            "drift matrices",
            "drift vectors",
            "why not",
        ],
        rows,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda"])
    ap.add_argument("--sizes", default="350m")
    ap.add_argument("--optimizers", default=DEFAULT_OPTIMIZERS)
    ap.add_argument("--steps", type=int, default=5, help="replays compared with eager steps")
    ap.add_argument("--repeats", type=int, default=20, help="timed steps and replays (median reported)")
    ap.add_argument("--timeout", type=float, default=90.0, help="seconds per optimizer and size")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parse_args(ap, argv, dict(sizes="tiny", repeats=3, steps=2))
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.cuda_graphs needs a CUDA device (CUDA graphs exist only there)")
    if args.child:
        print(json.dumps(probe(args.child, args.sizes, args.steps, args.repeats)), flush=True)
        return
    dev = torch.device("cuda")
    streams = stream_bandwidth(dev)
    roofline = {"bandwidth": streams["best"], "flops": matmul_flops(dev)}
    records = []
    for size in args.sizes.split(","):
        for name in args.optimizers.split(","):
            rec = run_one(name.strip(), size.strip(), args.steps, args.repeats, args.timeout)
            print(json.dumps(rec), flush=True)
            records.append(rec)
    notes = [
        "Single process, random gradients held at the same addresses; both copies take the same warm-up steps.",
        "drift: max |W_eager - W_graph| / max |W_eager - W_start| over the compared steps, per role; a "
        "replay repeats the captured kernels with the values the Python code had at capture (a step count, "
        "a refresh decision), so a rule whose kernels take such values drifts.",
        "floor: benchmarks.step_time's (compulsory bytes at the measured bandwidth, or matrix FLOPs at the "
        "measured fp32 matmul rate).",
    ]
    path = write_results(
        "cuda_graphs_cuda",
        vars(args) | {"roofline": roofline},
        records,
        to_markdown(records, roofline),
        notes,
        device="cuda",
        out_dir=args.results_dir,
    )
    print(f"wrote {path} and {path.with_suffix('.md')}")


if __name__ == "__main__":
    main()
