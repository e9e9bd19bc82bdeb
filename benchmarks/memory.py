"""Optimizer memory: state bytes against AdamW and the formulas of docs/algorithms/, and peak memory of the demo job.

    python -m benchmarks.memory               # state on 60m/130m shapes; demo job (ZeRO-2, 2 ranks) per optimizer
    python -m benchmarks.memory --quick       # tiny shapes, scale+sinkgd, 3 demo steps

1. State: one step on the real module with random gradients creates every state tensor; each parameter's
   state elements (step counters left out) are compared with the documented formula for the rule that steps it
   (``benchmarks.costmodel``: SCALE 0 or mn on the LM head, RACS m+n+1, AdamW 2mn for routed vectors...).
2. Demo job: ``configs/train/demo.json`` (tiny LLaMA, DeepSpeed ZeRO-2, 2 processes) for a few steps with
   each optimizer; every rank reports its optimizer state bytes (from the state tensors it holds) and its
   peak resident memory (``ru_maxrss``, which includes Python, torch, DeepSpeed and the data).
"""

from __future__ import annotations

import argparse
import gc
import tempfile
from typing import Any

import torch

from . import costmodel, optimizers
from .cli import parse_args
from .launch import finish_worker, gather, init_worker, run_workers
from .results import fmt, markdown_table, write_results

DEMO_CONFIG = "configs/train/demo.json"
#: per-tensor scalars (a limiter norm, a previous norm, a switch counter) that the documented formulas leave out
SCALAR_SLACK = 4


def state_vs_formula(name: str, size: str, vocab: int) -> dict[str, Any]:
    """Measured state elements of ``name`` on preset ``size`` against the formulas, per parameter and total."""
    from .models import build_llama, random_grads
    from .probes import state_bytes, state_elements_by_param

    model = build_llama(size, vocab)
    random_grads(model)
    opt = optimizers.build("adamw_foreach" if name == "adamw" else name, model)
    opt.step()
    measured = state_elements_by_param(opt)
    names = {id(p): n for n, p in model.named_parameters()}
    total_measured, total_formula, mismatches = 0, 0.0, []
    known = True
    for group in opt.param_groups:
        rule = "adamw" if name == "adamw" or group.get("treatment") == "adamw" else name
        for p in group["params"]:
            m, n = costmodel.matrix_view(p)
            expect = costmodel.state_elements(rule, m, n, group)
            got = measured.get(id(p), 0)
            total_measured += got
            if expect is None:
                known = False
                continue
            total_formula += expect
            if got != expect:
                mismatches.append(
                    {"param": names.get(id(p), "?"), "shape": [m, n], "rule": rule, "measured": got, "formula": expect}
                )
    scalars_only = all(0 < x["measured"] - x["formula"] <= SCALAR_SLACK for x in mismatches)
    n_params = sum(p.numel() for p in model.parameters())
    rec = {
        "optimizer": name,
        "size": size,
        "params": n_params,
        "state_bytes": state_bytes(opt),
        "state_bytes_no_counters": state_bytes(opt, include_counters=False),
        "measured_elements": total_measured,
        "formula_elements": total_formula if known else None,
        "adamw_elements": 2 * n_params,
        "mismatches": mismatches[:20],
        "n_mismatches": len(mismatches),
        "match": ("exact" if not mismatches else "scalars" if scalars_only else "no") if known else "no formula",
        "max_extra_scalars": max((x["measured"] - x["formula"] for x in mismatches), default=0),
    }
    rec["vs_adamw"] = total_measured / rec["adamw_elements"]
    del opt, model
    gc.collect()
    return rec


def demo_worker(args: argparse.Namespace) -> None:
    """Inside torchrun: the demo job with ``args.optimizer``; rank 0 writes every rank's numbers."""
    from .train_run import make_config, train

    init_worker()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = make_config(
            DEMO_CONFIG,
            args.optimizer,
            {},
            [
                f"train.steps={args.steps}",
                "eval.every=0",
                "eval.at_start=false",
                "eval.max_sequences=16",
                f"run_dir={tmp}/run",
                "checkpoint.every=0",
            ],
        )
        summary = train(cfg)
    per_rank = gather({k: summary[k] for k in ("state_bytes", "peak_rss_bytes", "params")})
    finish_worker(
        [{"optimizer": args.optimizer, "per_rank": per_rank, "tokens_per_s": summary["tokens_per_s"]}], args.out
    )


def demo_runs(names: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for name in names:
        try:
            rec = run_workers("benchmarks.memory", args.nproc, ["--optimizer", name, "--steps", str(args.steps)])[0]
        except RuntimeError as exc:
            rec = {"optimizer": name, "error": str(exc).splitlines()[0]}
        if "per_rank" in rec:
            rec["peak_rss_max"] = max(r["peak_rss_bytes"] for r in rec["per_rank"])
            rec["state_bytes_per_rank"] = [r["state_bytes"] for r in rec["per_rank"]]
        print(
            f"demo {name}: "
            + (
                rec.get("error")
                or f"peak RSS {rec['peak_rss_max'] / 2**20:.0f} MiB, state {rec['state_bytes_per_rank']} B"
            ),
            flush=True,
        )
        out.append(rec)
    return out


def _match_cell(r: dict[str, Any]) -> str:
    if r["match"] == "scalars":
        return f"yes, + {r['max_extra_scalars']} scalar(s) per tensor on {r['n_mismatches']} tensors"
    if r["match"] == "no":
        return f"NO: {r['n_mismatches']} tensors differ (see JSON)"
    return {"exact": "yes", "no formula": "no formula"}[r["match"]]


def to_markdown(states: list[dict[str, Any]], demos: list[dict[str, Any]], nproc: int) -> str:
    rows = [
        [
            r["size"],
            r["optimizer"],
            fmt(r["state_bytes"] / 2**20, ".2f"),
            fmt(r["vs_adamw"], ".3f"),
            fmt(r["measured_elements"], ",d"),
            fmt(int(r["formula_elements"]) if r["formula_elements"] is not None else None, ",d"),
            _match_cell(r),
        ]
        for r in states
    ]
    out = "## Optimizer state, single process (one step on the real module)\n\n" + markdown_table(
        ["size", "optimizer", "state MiB", "state / AdamW state", "state elements", "card formula", "matches formula"],
        rows,
    )
    if not demos:
        return out
    base = next((d for d in demos if d["optimizer"] == "adamw" and "peak_rss_max" in d), None)
    drows = []
    for d in demos:
        if "error" in d:
            drows.append([d["optimizer"], d["error"][:80], "", "", ""])
            continue
        drows.append(
            [
                d["optimizer"],
                fmt(d["peak_rss_max"] / 2**20, ".0f"),
                fmt((d["peak_rss_max"] - base["peak_rss_max"]) / 2**20, "+.0f") if base else "n/a",
                " / ".join(fmt(b / 2**20, ".2f") for b in d["state_bytes_per_rank"]),
                fmt(d["tokens_per_s"], ",.0f"),
            ]
        )
    out += f"\n## Demo job (configs/train/demo.json: tiny LLaMA, DeepSpeed ZeRO-2, {nproc} ranks)\n\n" + markdown_table(
        ["optimizer", "peak RSS MiB (max over ranks)", "vs AdamW MiB", "state MiB per rank", "tokens/s"], drows
    )
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="60m,130m")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--optimizers", default=None, help="comma list (default: all registered); AdamW always")
    ap.add_argument("--steps", type=int, default=20, help="demo-job steps per optimizer")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--skip-demo", action="store_true")
    ap.add_argument("--out", default="memory")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--optimizer", help=argparse.SUPPRESS)
    args = parse_args(ap, argv, dict(sizes="tiny", vocab=4096, steps=3, optimizers="scale,sinkgd"))
    if args.worker:
        return demo_worker(args)
    torch.set_num_threads(1)
    names = ["adamw"] + optimizers.select(args.optimizers, optimizers.registered())
    states = []
    for size in args.sizes.split(","):
        for name in names:
            try:
                rec = state_vs_formula(name, size.strip(), args.vocab)
            except (RuntimeError, ValueError, TypeError) as exc:
                print(f"state {size} {name}: ERROR {exc}")
                continue
            states.append(rec)
            print(
                f"state {size} {name}: {rec['state_bytes'] / 2**20:.2f} MiB ({rec['vs_adamw']:.3f} of AdamW), "
                f"formula: {_match_cell(rec)}",
                flush=True,
            )
    demos = [] if args.skip_demo else demo_runs(names, args)
    notes = [
        "State elements leave out per-tensor step counters; 'state MiB' includes them.",
        "Peak RSS is the whole process (Python, torch, DeepSpeed, data); on the tiny demo model the optimizer "
        "state is a small part of it.",
    ]
    config = {k: v for k, v in vars(args).items() if k not in ("worker", "optimizer")}
    records = [{"kind": "state", **r} for r in states] + [{"kind": "demo", **d} for d in demos]
    markdown = to_markdown(states, demos, args.nproc)
    path = write_results(args.out, config, records, markdown, notes, out_dir=args.results_dir)
    print(f"wrote {path} and {path.with_suffix('.md')}")


if __name__ == "__main__":
    main()
