"""Convergence at a fixed token budget: AdamW, every shardopt optimizer and the peers, each with a small
learning-rate sweep, on the tiny LLaMA and the trainer's default corpus.

    python -m benchmarks.convergence                      # 200 steps x 1024 tokens, lr x {0.5, 1, 2}
    python -m benchmarks.convergence --steps 400 --lr-mults 0.5,1,2,4     # a longer run
    python -m benchmarks.convergence --quick              # 10 steps, 3 optimizers, smoke test

Every run is the reference trainer on one process with the same data order, schedule (10% warm-up, cosine
to 10%) and token budget; only the optimizer and its learning rates change. Each optimizer starts from its
paper defaults (peers: their authors' LLaMA recipes, ``benchmarks.peers``) with every learning rate scaled
by the multiplier. Where the best run is the largest (smallest) rate tried, the sweep goes on at twice (half)
that rate, up to ``--extend`` more runs, so the table's best is an optimum, not a sweep end; the figure
shows the best run's curves.
Runs go to ``runs/benchmarks/convergence/`` (``--quick``: ``runs/benchmarks/quick/convergence/``), results to
``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from typing import Any

import torch

from shardopt.train.model import PRESETS

from . import optimizers, peers
from .cli import parse_args
from .results import QUICK_DIR, fmt, markdown_table, write_results

BASE_CONFIG = "configs/train/single_scale.json"
RUN_ROOT = "runs/benchmarks/convergence"


def run_one(name: str, mult: float, args: argparse.Namespace, tag: str = "") -> dict[str, Any]:
    """One training run; ``tag`` names a variant's run directory (``benchmarks.routes_convergence``)."""
    from .train_run import make_config, read_metrics, train

    root = os.path.join(QUICK_DIR, "convergence") if args.quick else RUN_ROOT  # a smoke run keeps the full runs
    run_dir = os.path.join(root, f"{name}_x{mult:g}" + (f"_{tag}" if tag else ""))
    params = {} if name in peers.PEERS else optimizers.sweep_hyperparameters(name, mult)
    cfg = make_config(
        BASE_CONFIG,
        name,
        params,
        [
            f"run_dir={run_dir}",
            f"seed={args.seed}",
            f"train.steps={args.steps}",
            f"train.micro_batch_size={args.batch}",
            f"data.seq_len={args.seq}",
            f"eval.every={args.eval_every}",
            f"eval.max_sequences={args.eval_sequences}",
            "eval.at_start=false",
            "train.log_every=5",
            "checkpoint.every=0",
        ],
    )
    hidden = PRESETS[cfg.model.preset]["hidden_size"]
    rec: dict[str, Any] = {
        "optimizer": name,
        "lr_mult": mult,
        "hyperparameters": peers.recipe(name, hidden, mult) if name in peers.PEERS else params,
    }
    t0 = time.perf_counter()
    try:
        summary = train(cfg, peer=name if name in peers.PEERS else None, peer_multiplier=mult)
    except FloatingPointError as exc:
        return rec | {"diverged": str(exc)}
    except Exception as exc:  # a broken optimizer is reported in its row; the other runs go on
        return rec | {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:200]}
    metrics = read_metrics(run_dir)
    rec |= {
        "val_loss": summary["end_val_loss"],
        "tokens_per_s": summary["tokens_per_s"],
        "state_bytes": summary["state_bytes"],
        "tokens": summary["steps"] * summary["tokens_per_step"],
        "wall_s": time.perf_counter() - t0,
        "train_curve": [(m["tokens"], m["loss"]) for m in metrics if "loss" in m],
        "val_curve": [(m["step"] * summary["tokens_per_step"], m["val_loss"]) for m in metrics if "val_loss" in m],
    }
    return rec


def best_runs(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per optimizer, the run with the lowest final validation loss (diverged runs never win)."""
    best: dict[str, dict[str, Any]] = {}
    for r in records:
        loss = r.get("val_loss")
        if loss is None or not math.isfinite(loss):
            continue
        if r["optimizer"] not in best or loss < best[r["optimizer"]]["val_loss"]:
            best[r["optimizer"]] = r
    return best


def next_multiplier(runs: list[dict[str, Any]], factor: float = 2.0) -> float | None:
    """The multiplier to try next when one optimizer's best run sits at an end of the rates tried so far (the
    optimum may lie beyond it), else ``None``. A diverged run never wins, so a sweep that ran into divergence
    on one side stops there."""
    best = next(iter(best_runs(runs).values()), None)
    if best is None or not at_edge(runs, best):
        return None
    top = best["lr_mult"] == max(r["lr_mult"] for r in runs)
    return best["lr_mult"] * factor if top else best["lr_mult"] / factor


def at_edge(runs: list[dict[str, Any]], best: dict[str, Any]) -> bool:
    """Whether ``best`` is the largest or smallest rate tried: its loss is then an upper bound on the optimum."""
    tried = [r["lr_mult"] for r in runs]
    return best["lr_mult"] in (min(tried), max(tried))


def plot(records: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.get_cmap("tab20").colors  # more optimizers than the default 10-colour cycle
    for i, (name, r) in enumerate(best_runs(records).items()):
        label, color = f"{name} (lr x{r['lr_mult']:g})", colors[(2 * i) % 20 + (2 * i) // 20]
        tok, loss = zip(*r["train_curve"])
        ax_t.plot([t / 1e3 for t in tok], loss, lw=1.2, color=color, label=label)
        if r["val_curve"]:
            tok, loss = zip(*r["val_curve"])
            ax_v.plot([t / 1e3 for t in tok], loss, "o-", lw=1.2, ms=3, color=color, label=label)
    for ax, title in ((ax_t, "training loss"), (ax_v, "validation loss")):
        ax.set_xlabel("tokens (thousands)")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.set_title(f"{title}, best learning rate per optimizer")
        ax.grid(alpha=0.3)
    ax_v.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _outcome(run: dict[str, Any]) -> str:
    if "diverged" in run:
        return "diverged"
    if "error" in run:
        return "error: " + run["error"][:60]
    return fmt(run["val_loss"], ".3f")


def to_markdown(records: list[dict[str, Any]], mults: list[float], unavailable: dict[str, str]) -> str:
    best = best_runs(records)
    rows = []
    for name in dict.fromkeys(r["optimizer"] for r in records):
        runs = [r for r in records if r["optimizer"] == name]
        by_mult = {r["lr_mult"]: r for r in runs}
        cells = [_outcome(by_mult[m]) if m in by_mult else "" for m in mults]
        extra = "; ".join(f"x{m:g}: {_outcome(by_mult[m])}" for m in sorted(by_mult) if m not in mults)
        b = best.get(name)
        rows.append(
            [
                name,
                *cells,
                extra or "-",
                (f"x{b['lr_mult']:g}" + (" (end)" if at_edge(runs, b) else "")) if b else "n/a",
                fmt(b["val_loss"], ".3f") if b else "n/a",
                fmt(math.exp(b["val_loss"]), ".1f") if b else "n/a",
                fmt(b["tokens_per_s"], ",.0f") if b else "n/a",
                fmt(b["state_bytes"] / 2**20, ".2f") if b else "n/a",
            ]
        )
    for name, why in unavailable.items():
        rows.append([name, *["not run"] * len(mults), "", why, "", "", "", ""])
    return (
        markdown_table(
            [
                "optimizer",
                *[f"val loss, lr x{m:g}" for m in mults],
                "sweep extended",
                "best lr",
                "best val loss",
                "val ppl",
                "tokens/s",
                "state MiB",
            ],
            rows,
        )
        + "\n![curves](convergence.png)\n"
    )


def add_run_arguments(ap: argparse.ArgumentParser) -> None:
    """The training-run options ``run_one`` reads (also ``benchmarks.routes_convergence``'s)."""
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps per run (same for every run)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--eval-every", type=int, default=40)
    ap.add_argument("--eval-sequences", type=int, default=64)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--threads", type=int, default=1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--optimizers",
        default=None,
        help="comma list from adamw, the registered names and the peers (default: all of them)",
    )
    ap.add_argument("--lr-mults", default="0.5,1,2", help="learning-rate multipliers on each optimizer's defaults")
    ap.add_argument(
        "--extend",
        type=int,
        default=2,
        help="extra runs per optimizer while its best rate is the largest or smallest tried (x2 or /2 "
        "each time), so the sweep brackets the optimum; 0 keeps exactly --lr-mults",
    )
    add_run_arguments(ap)
    ap.add_argument("--out", default="convergence")
    args = parse_args(
        ap, argv, dict(steps=10, lr_mults="1", eval_every=5, optimizers="adamw,scale,torch_muon", extend=0)
    )
    torch.set_num_threads(args.threads)
    names = optimizers.select(args.optimizers, ["adamw", *optimizers.registered(), *peers.PEERS])
    mults = [float(m) for m in args.lr_mults.split(",")]
    unavailable = {n: peers.available(n)[1] for n in names if n in peers.PEERS and not peers.available(n)[0]}
    records = []
    for name in (n for n in names if n not in unavailable):
        runs: list[dict[str, Any]] = []
        queue = list(mults)
        while queue:
            mult = queue.pop(0)
            rec = run_one(name, mult, args)
            runs.append(rec)
            outcome = (
                f"val loss {rec['val_loss']:.4f}  {rec['tokens_per_s']:,.0f} tok/s  {rec['wall_s']:.0f}s"
                if "val_loss" in rec
                else rec.get("diverged") or rec["error"]
            )
            print(f"{name:12s} lr x{mult:<4g} {outcome}", flush=True)
            if not queue and len(runs) < len(mults) + args.extend:
                following = next_multiplier(runs)
                queue += [following] if following is not None else []
        records += runs
    for name, why in unavailable.items():
        print(f"{name:12s} not run: {why}")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    figure = args.results_dir / f"{args.out}.png"
    plot(records, str(figure))
    markdown = to_markdown(records, mults, unavailable).replace("convergence.png", figure.name)
    notes = [
        f"Same budget for every run: {args.steps} steps x {args.batch} x {args.seq} tokens on one process.",
        f"Sweep: lr x {args.lr_mults} of each optimizer's defaults; where the best was the largest or smallest "
        f"rate tried, up to {args.extend} more runs at twice / half that rate ('sweep extended'). '(end)': the "
        "best is still at an end of the sweep, so its loss is an upper bound on the optimum.",
        "Peers not run here: " + ("; ".join(f"{k}: {v}" for k, v in unavailable.items()) or "none"),
    ]
    config = vars(args) | {"unavailable": unavailable}
    path = write_results(args.out, config, records, markdown, notes, out_dir=args.results_dir)
    print(f"wrote {path}, {path.with_suffix('.md')} and {figure}")


if __name__ == "__main__":
    main()
