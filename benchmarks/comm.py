"""Communication per optimizer step per rank under ZeRO-1/2/3 and FSDP2 at world sizes 2 and 4.

    python -m benchmarks.comm                  # tiny LLaMA, every registered optimizer, ws 2 and 4
    python -m benchmarks.comm --quick          # scale,sinkgd,racs at ws 2, two layouts

Counts what shardopt itself sends during ``step()`` (``optimizer.comm_stats()``, else the global collective
counter): bytes this rank puts into its collectives (all-reduce buffers, all-to-all sends) and the number
of calls. The engine's own traffic (ZeRO's gradient reduce-scatter and parameter all-gather, FSDP2's) is
the same for every optimizer and is not counted. Two reference sizes, per rank, same payload convention:
the gradient (4 bytes x every parameter: what a DDP gradient all-reduce puts in) and gathering every full
matrix that the optimizer's matrix rule handles (4 bytes x sum of m n: the output of an all-gather). The
step is repeated with two layer counts: a call count that does not change shows it is independent of the
number of matrices (3 and 5 layers by default: odd counts put ZeRO partition boundaries inside matrices,
as in real models).
"""

from __future__ import annotations

import argparse
from typing import Any

from . import optimizers, targets
from .cli import parse_args
from .launch import finish_worker, gather, init_worker, run_workers
from .results import fmt, markdown_table, write_results

ZERO_AND_FSDP = ("zero1", "zero2", "zero3", "fsdp2")


def routed_matrix_elements(model: Any, name: str) -> int:
    """Elements of the matrices ``name``'s matrix rule steps (embedding/LM head only where it routes them)."""
    from shardopt.optim.registry import build_param_groups, validate_hyperparameters

    groups = build_param_groups(model, name, validate_hyperparameters(name, {}))
    return sum(p.numel() for g in groups if g["treatment"] != "adamw" for p in g["params"])


def measure_case(layout: str, name: str, layers: int, args: argparse.Namespace) -> dict[str, Any]:
    """This rank's collectives per step for one (layout, optimizer, layer count)."""
    from .engines import prepare, random_batch
    from .models import build_llama
    from .probes import CommProbe

    model = build_llama(args.preset, args.vocab, "cpu", num_layers=layers)
    sizes = {"params": sum(p.numel() for p in model.parameters()), "matrix": routed_matrix_elements(model, name)}
    run = prepare(layout, model, name, micro_batch=args.batch)
    probe = CommProbe(run.optimizer)
    per_step = []
    for step in range(args.steps + 1):  # step 0 builds the plans and state; not counted
        run.forward_backward(*random_batch(step, args.batch, args.seq, args.vocab))
        probe.start()
        run.step()
        counts = probe.stop()
        if step:
            per_step.append(counts)
    last = per_step[-1]
    steady = all((c["calls"], c["bytes"]) == (last["calls"], last["bytes"]) for c in per_step)
    return {
        "layout": layout,
        "optimizer": name,
        "layers": layers,
        "calls": last["calls"],
        "bytes": last["bytes"],
        "flops": last["flops"],
        "by_kind": last["by_kind"],
        "steady": steady,
        "grad_bytes": 4 * sizes["params"],
        "gather_bytes": 4 * sizes["matrix"],
    }


def worker(args: argparse.Namespace) -> None:
    rank, world = init_worker()
    records = []
    for layout in args.layouts.split(","):
        for name in args.optimizers.split(","):
            for layers in (int(x) for x in args.layers.split(",")):
                try:
                    rec = measure_case(layout, name, layers, args)
                except Exception as exc:  # one broken case must not hide the others; ranks fail together
                    rec = {
                        "layout": layout,
                        "optimizer": name,
                        "layers": layers,
                        "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300],
                    }
                per_rank = gather(rec)
                if rank == 0:
                    records.append(combine(per_rank, world))
                    print(_line(records[-1]), flush=True)
    finish_worker(records, args.out)


def combine(per_rank: list[dict[str, Any]], world: int) -> dict[str, Any]:
    """One record from every rank's: the busiest rank's bytes, the call count (the same on all ranks)."""
    first = per_rank[0]
    errors = [r["error"] for r in per_rank if "error" in r]
    out = {k: first[k] for k in ("layout", "optimizer", "layers")} | {"world_size": world}
    if errors:
        return out | {"error": errors[0]}
    out |= {
        "calls": max(r["calls"] for r in per_rank),
        "calls_equal_on_ranks": len({r["calls"] for r in per_rank}) == 1,
        "bytes_max": max(r["bytes"] for r in per_rank),
        "bytes_per_rank": [r["bytes"] for r in per_rank],
        "flops_per_rank": [r["flops"] for r in per_rank],
        "by_kind_rank0": first["by_kind"],
        "steady": all(r["steady"] for r in per_rank),
        "grad_bytes": first["grad_bytes"],
        "gather_bytes": first["gather_bytes"],
    }
    out["fraction_of_grad"] = out["bytes_max"] / out["grad_bytes"]
    out["fraction_of_gather"] = out["bytes_max"] / out["gather_bytes"] if out["gather_bytes"] else None
    return out


def _line(r: dict[str, Any]) -> str:
    head = f"ws{r['world_size']} {r['layout']:6s} {r['optimizer']:8s} L={r['layers']}"
    if "error" in r:
        return f"{head}  ERROR {r['error']}"
    return f"{head}  {r['calls']:3d} calls  {r['bytes_max']:>10,d} B  ({100 * r['fraction_of_grad']:.3f}% of grad)"


def summarize(records: list[dict[str, Any]], layer_counts: list[int]) -> list[dict[str, Any]]:
    """One row per (world size, layout, optimizer): figures at the largest layer count, and whether the call
    count stayed the same across layer counts."""
    rows = []
    keys = dict.fromkeys((r["world_size"], r["layout"], r["optimizer"]) for r in records)
    for ws, layout, name in keys:
        case = {r["layers"]: r for r in records if (r["world_size"], r["layout"], r["optimizer"]) == (ws, layout, name)}
        big = case.get(max(layer_counts))
        row = {"world_size": ws, "layout": layout, "optimizer": name}
        bad = [r for r in case.values() if "error" in r]
        if bad or big is None:
            rows.append(row | {"error": bad[0]["error"] if bad else "missing"})
            continue
        calls = {layers: r["calls"] for layers, r in case.items()}
        row |= {
            k: big[k]
            for k in ("calls", "bytes_max", "grad_bytes", "gather_bytes", "fraction_of_grad", "fraction_of_gather")
        }
        row["calls_by_layers"] = calls
        row["calls_independent"] = len(set(calls.values())) == 1
        if name in targets.COMM_TARGET_OPTIMIZERS:
            row["target_met"] = row["fraction_of_grad"] <= targets.COMM_FRACTION_OF_GRAD and row["calls_independent"]
        rows.append(row)
    return rows


def to_markdown(rows: list[dict[str, Any]]) -> str:
    table = []
    for r in rows:
        if "error" in r:
            table.append([str(r["world_size"]), r["layout"], r["optimizer"], r["error"][:80], "", "", "", "", ""])
            continue
        calls = " / ".join(str(c) for _, c in sorted(r["calls_by_layers"].items()))
        target = "" if "target_met" not in r else ("met" if r["target_met"] else "missed")
        table.append(
            [
                str(r["world_size"]),
                r["layout"],
                r["optimizer"],
                f"{r['bytes_max']:,}",
                fmt(100 * r["fraction_of_grad"], ".3f"),
                fmt(100 * r["fraction_of_gather"] if r["fraction_of_gather"] is not None else None, ".2f"),
                calls,
                fmt(r["calls_independent"]),
                target,
            ]
        )
    layers = sorted(next((r["calls_by_layers"] for r in rows if "calls_by_layers" in r), {}))
    return markdown_table(
        [
            "ws",
            "layout",
            "optimizer",
            "bytes/step/rank",
            "% of gradient",
            "% of full-matrix gather",
            f"calls/step ({' / '.join(f'{n} layers' for n in layers)})",
            "calls independent of #matrices",
            f"target (<= {100 * targets.COMM_FRACTION_OF_GRAD:g}% of grad)",
        ],
        table,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-sizes", default="2,4")
    ap.add_argument("--layouts", default=",".join(ZERO_AND_FSDP))
    ap.add_argument("--optimizers", default=None, help="comma list (default: all registered)")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument(
        "--layers",
        default="3,5",
        help="two layer counts for the call-count check (odd: with even counts the tiny model's ZeRO "
        "partitions can end exactly between matrices, which hides the boundary traffic)",
    )
    ap.add_argument("--steps", type=int, default=2, help="counted steps after one uncounted step")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--out", default="comm")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parse_args(ap, argv, dict(world_sizes="2", layouts="zero2,fsdp2", steps=1, optimizers="scale,sinkgd,racs"))
    if args.worker:
        return worker(args)
    args.optimizers = ",".join(optimizers.select(args.optimizers, optimizers.registered()))
    passed = [
        "--layouts",
        args.layouts,
        "--optimizers",
        args.optimizers,
        "--preset",
        args.preset,
        "--vocab",
        str(args.vocab),
        "--layers",
        args.layers,
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
        got = run_workers("benchmarks.comm", ws, passed)
        for r in got:
            print(_line(r))
        records += got
    rows = summarize(records, [int(x) for x in args.layers.split(",")])
    notes = [
        "bytes: what this rank puts into shardopt's collectives in one optimizer step (the busiest rank); "
        "gradient: 4 B x all parameters; full-matrix gather: 4 B x sum of m*n over the matrices the rule steps.",
        "The engine's own collectives (ZeRO reduce-scatter / all-gather, FSDP2) are not counted; they are the "
        "same for every optimizer, AdamW included.",
        "ZeRO-3 calls step() once per sub-group; counts are per engine step (all sub-groups).",
    ]
    config = {k: v for k, v in vars(args).items() if k != "worker"}
    path = write_results(args.out, config, rows, to_markdown(rows), notes, raw=records, out_dir=args.results_dir)
    print(f"wrote {path} and {path.with_suffix('.md')}")


if __name__ == "__main__":
    main()
