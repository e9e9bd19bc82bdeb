"""Optimizer step time and whole-matrix work per rank at world sizes 1, 2 and 4 (FSDP2 row shards).

    python -m benchmarks.scaling                 # 20m preset, every registered optimizer
    python -m benchmarks.scaling --quick         # tiny preset, muon and swan, ws 1 and 2

Whole-matrix optimizers (Newton-Schulz, eigh, QR on whole matrices) give each matrix to one owner rank, so
the work per rank should shrink about 1/P. "Owner work" is the FLOPs each rank reports for its whole-matrix
operations (``optimizer.comm_stats()``, estimated by the library's cost model); an optimizer reporting none
is element-wise and is listed for comparison. Step time is the shardopt ``step()`` alone (no forward or
backward), median over steps, on the slowest rank. On a machine with fewer cores than ranks the ranks share
cores, so wall time cannot shrink there; the FLOPs column still shows the split.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

from . import optimizers
from .cli import parse_args
from .launch import finish_worker, gather, init_worker, run_workers
from .results import fmt, markdown_table, write_results


def measure(name: str, args: argparse.Namespace, world: int) -> dict[str, Any]:
    from .engines import prepare, random_batch
    from .models import build_llama
    from .probes import CommProbe

    model = build_llama(args.preset, args.vocab, "cpu")
    run = prepare("single" if world == 1 else args.layout, model, name, micro_batch=args.batch)
    probe = CommProbe(run.optimizer)
    seconds, flops, kinds = [], [], {}
    for step in range(args.steps + 1):  # step 0 builds plans and state; not timed
        run.forward_backward(*random_batch(step, args.batch, args.seq, args.vocab))
        probe.start()
        t = run.timed_step()
        counts = probe.stop()
        if step:
            seconds.append(t)
            flops.append(counts["flops"])
            kinds = {k: v.get("flops", 0) for k, v in counts["by_kind"].items() if v.get("flops")}
    return {"optimizer": name, "step_s": statistics.median(seconds), "flops": flops[-1], "flops_by_kind": kinds}


def worker(args: argparse.Namespace) -> None:
    rank, world = init_worker()
    records = []
    for name in args.optimizers.split(","):
        try:
            rec = measure(name, args, world)
        except Exception as exc:  # report and go on; every rank raises together for a plan problem
            rec = {"optimizer": name, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
        per_rank = gather(rec)
        if rank == 0:
            errors = [r["error"] for r in per_rank if "error" in r]
            out: dict[str, Any] = {"optimizer": name, "world_size": world}
            if errors:
                out["error"] = errors[0]
            else:
                out |= {
                    "step_s_per_rank": [r["step_s"] for r in per_rank],
                    "flops_per_rank": [r["flops"] for r in per_rank],
                    "strategies": sorted({k for r in per_rank for k in r["flops_by_kind"]}),
                }
            records.append(out)
            print(
                f"ws{world} {name}: "
                + (
                    out.get("error")
                    or f"step {max(out['step_s_per_rank']) * 1e3:.1f} ms, owner FLOPs per rank {out['flops_per_rank']}"
                ),
                flush=True,
            )
    finish_worker(records, args.out)


def table(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per optimizer and world size: slowest-rank step time, busiest-rank owner FLOPs, both relative to ws 1."""
    rows = []
    base: dict[str, dict[str, float]] = {}
    for r in sorted(records, key=lambda r: (r["optimizer"], r["world_size"])):
        row = {"optimizer": r["optimizer"], "world_size": r["world_size"]}
        if "error" in r:
            rows.append(row | {"error": r["error"]})
            continue
        step = max(r["step_s_per_rank"])
        flops = [f or 0.0 for f in r["flops_per_rank"]]
        row |= {
            "step_s": step,
            "owner_flops_max": max(flops),
            "owner_flops_mean": sum(flops) / len(flops),
            "whole_matrix": max(flops) > 0,
            "strategies": r["strategies"],
        }
        if r["world_size"] == 1:
            base[r["optimizer"]] = {"step_s": step, "flops": max(flops)}
        ref = base.get(r["optimizer"])
        if ref:
            row["step_vs_ws1"] = step / ref["step_s"]
            row["owner_flops_vs_ws1"] = max(flops) / ref["flops"] if ref["flops"] else None
            row["ideal"] = 1.0 / r["world_size"]
        rows.append(row)
    return rows


def to_markdown(rows: list[dict[str, Any]]) -> str:
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["optimizer"], str(r["world_size"]), r["error"][:80], "", "", "", "", ""])
            continue
        body.append(
            [
                r["optimizer"] + ("" if r["whole_matrix"] else " (element-wise)"),
                str(r["world_size"]),
                fmt(r["step_s"] * 1e3, ".1f"),
                fmt(r.get("step_vs_ws1"), ".2f"),
                fmt(r["owner_flops_max"] / 1e9, ".3f"),
                fmt(r.get("owner_flops_vs_ws1"), ".2f"),
                fmt(r.get("ideal"), ".2f"),
                ", ".join(r["strategies"]) or "-",
            ]
        )
    return markdown_table(
        [
            "optimizer",
            "ws",
            "step ms (slowest rank)",
            "step / ws1",
            "owner GFLOP (busiest rank)",
            "owner work / ws1",
            "ideal 1/P",
            "whole-matrix strategy",
        ],
        body,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-sizes", default="1,2,4")
    ap.add_argument("--layout", default="fsdp2", choices=["fsdp2", "zero1", "zero2", "zero3"])
    ap.add_argument("--optimizers", default=None, help="comma list (default: all registered)")
    ap.add_argument("--preset", default="20m")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3, help="timed steps after one untimed step")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--out", default="scaling")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parse_args(ap, argv, dict(world_sizes="1,2", preset="tiny", steps=2, optimizers="muon,swan"))
    if args.worker:
        return worker(args)
    args.optimizers = ",".join(optimizers.select(args.optimizers, optimizers.registered()))
    passed = [
        "--layout",
        args.layout,
        "--optimizers",
        args.optimizers,
        "--preset",
        args.preset,
        "--vocab",
        str(args.vocab),
        "--steps",
        str(args.steps),
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
    ]
    records: list[dict[str, Any]] = []
    for ws in (int(w) for w in args.world_sizes.split(",")):
        print(f"== world size {ws} ==", flush=True)
        records += run_workers("benchmarks.scaling", ws, passed)
    rows = table(records)
    cores = os.cpu_count() or 1
    notes = [
        f"{cores} CPU core(s) on this machine: world sizes above {cores} share cores, so their wall time "
        "shows contention, not the split; the owner-FLOPs column shows the split.",
        "Owner FLOPs come from optimizer.comm_stats() (the library's estimate of its whole-matrix work).",
    ]
    config = {k: v for k, v in vars(args).items() if k != "worker"}
    path = write_results(args.out, config, rows, to_markdown(rows), notes, raw=records, out_dir=args.results_dir)
    print(f"wrote {path} and {path.with_suffix('.md')}")


if __name__ == "__main__":
    main()
