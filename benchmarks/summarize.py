"""The benchmark summary, built only from the committed result files (the docs' Benchmarks page includes it; the
README shows ``benchmarks.overview``'s shorter table).

    python -m benchmarks.summarize            # reads benchmarks/results/*.json, writes results/SUMMARY.md
    python -m benchmarks.summarize --check    # exit 1 if SUMMARY.md disagrees with the results
    python -m benchmarks.summarize --quick    # the same from the smoke runs in runs/benchmarks/quick
    python -m benchmarks.summarize --scale    # print the scale-simulation table (benchmarks.scale); writes nothing

One row per optimizer, one column group per benchmark, then every issue-6 target with its measured figure.
A benchmark without a result file shows "not run"; nothing is filled in by hand, and a test runs ``--check``,
so the summary cannot drift from the committed result files.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable

from . import targets
from .results import QUICK_DIR, REPO_ROOT, RESULTS_DIR, fmt, markdown_table, read_results

Columns = dict[str, dict[str, str]]  # optimizer -> column -> cell


def _step_time(data: dict[str, Any]) -> Columns:
    out: Columns = {}
    sizes = list(dict.fromkeys(r["size"] for r in data["records"]))
    for r in data["records"]:
        cell = out.setdefault("adamw" if r["optimizer"] == "adamw_foreach" else r["optimizer"], {})
        if "error" in r:
            cell[f"step / AdamW ({r['size']})"] = "error"
            continue
        cell[f"step / AdamW ({r['size']})"] = fmt(r.get("vs_adamw_foreach"), ".2f")
        if r["size"] == sizes[-1]:
            cell[f"time / floor ({r['size']})"] = fmt(r.get("time_over_floor"), ".1f")
    return out


def _comm(data: dict[str, Any]) -> Columns:
    out: Columns = {}
    ws = max(r["world_size"] for r in data["records"])
    for name in dict.fromkeys(r["optimizer"] for r in data["records"]):
        rows = [r for r in data["records"] if r["optimizer"] == name and "error" not in r]
        top = [r for r in rows if r["world_size"] == ws]
        if not rows:
            out[name] = {f"comm % of grad (ws {ws}, worst layout)": "error"}
            continue
        worst = 100 * max(r["fraction_of_grad"] for r in top) if top else None
        out[name] = {
            f"comm % of grad (ws {ws}, worst layout)": fmt(worst, ".3f"),
            "calls independent of #matrices": fmt(all(r["calls_independent"] for r in rows)),
        }
    return out


def _memory(data: dict[str, Any]) -> Columns:
    out: Columns = {}
    states = [r for r in data["records"] if r.get("kind") == "state"]
    if states:
        size = states[-1]["size"]
        for r in (r for r in states if r["size"] == size):
            out.setdefault(r["optimizer"], {})[f"state / AdamW ({size})"] = fmt(r["vs_adamw"], ".3f")
    return out


def _scaling(data: dict[str, Any]) -> Columns:
    out: Columns = {}
    ws = max(r["world_size"] for r in data["records"])
    for r in data["records"]:
        if r["world_size"] == ws and r.get("whole_matrix"):
            out.setdefault(r["optimizer"], {})[f"owner work ws {ws} / ws 1"] = fmt(r.get("owner_flops_vs_ws1"), ".2f")
    return out


def _convergence(data: dict[str, Any]) -> Columns:
    from .convergence import at_edge, best_runs

    out: Columns = {}
    for name, r in best_runs(data["records"]).items():
        runs = [x for x in data["records"] if x["optimizer"] == name]
        where = f"lr x{r['lr_mult']:g}" + (", sweep end" if at_edge(runs, r) else "")
        out[name] = {
            "val loss (best lr)": f"{fmt(r['val_loss'], '.3f')} ({where})",
            "tokens/s": fmt(r["tokens_per_s"], ",.0f"),
        }
    for name in data["config"].get("unavailable", {}):
        out[name] = {"val loss (best lr)": "not run"}
    return out


def scale_section(data: dict[str, Any] | None) -> str:
    """Per-rank optimizer state at simulated scale (``benchmarks.scale``): one row per optimizer under its
    default strategy (auto), the busiest rank's state at the largest world size of each model (worst layout)
    and against torch AdamW's busiest rank there, whether busiest <= 1.15 x single / P + the largest owned
    matrix's state + 16 MiB held in every case the bound covers (auto, distributed, optimizers without
    whole-matrix work, team), the worst modeled optimizer seconds over forward+backward (issue 27), and plan
    building."""
    if data is None:
        return "Scale simulation (`benchmarks.scale`): not run.\n"
    recs = [r for r in data["records"] if "error" not in r]
    models = list(dict.fromkeys(r["model"] for r in recs))
    top = {m: max(r["world_size"] for r in recs if r["model"] == m) for m in models}
    mib = 1 << 20
    rows = []
    for name in _ordered(dict.fromkeys(r["optimizer"] for r in recs)):
        mine = [r for r in recs if r["optimizer"] == name]
        default = [r for r in mine if r["strategy"] in ("-", "auto")]
        row = [name]
        for m in models:
            at = [r for r in default if r["model"] == m and r["world_size"] == top[m]]
            worst = max(at, key=lambda r: r["busiest_bytes"], default=None)
            row.append(
                "n/a"
                if worst is None
                else f"{worst['busiest_bytes'] / mib:.1f} ({worst['vs_adamw']:.2f}x AdamW, {worst['layout']})"
            )
        covered = [r for r in mine if r["bound_applies"]]
        miss = [r for r in covered if not r["within_bound"]]
        row.append(
            "met"
            if not miss
            else "MISSED: "
            + ", ".join(
                f"{r['model']} {r['layout']} P={r['world_size']} {r['strategy']} "
                f"({r['busiest_bytes'] / r['bound_bytes']:.2f}x)"
                for r in miss
            )
        )
        gather = [r for r in mine if r["strategy"] == "gather"]
        row.append(fmt(max(r["busiest_bytes"] / r["bound_bytes"] for r in gather), ".2f") if gather else "-")
        timed = [r for r in default if "time_ratio" in r]
        if timed:
            worst = max(timed, key=lambda r: r["time_ratio"])
            row.append(
                f"{worst['time_ratio']:.3f} ({worst['model']} {worst['layout']} P={worst['world_size']})"
                + ("" if worst["within_time"] else " **over 0.10**")
            )
        else:
            row.append("n/a")
        row.append(fmt(max(r["plan_s"] for r in mine), ".2f"))
        rows.append(row)
    heads = [
        "optimizer",
        *[f"busiest MiB, {m} P={top[m]} (worst layout)" for m in models],
        "bound (auto, distributed, team)",
        "gather: busiest / bound",
        "modeled s / fwd+bwd (auto, worst)",
        "plan s (max)",
    ]
    return (
        f"Per-rank optimizer state at simulated scale (`benchmarks.scale`, {_describe_run(data)}; "
        f"layouts {', '.join(dict.fromkeys(r['layout'] for r in recs))}; "
        f"P = {', '.join(str(w) for w in dict.fromkeys(r['world_size'] for r in recs))}):\n\n"
        + markdown_table(heads, rows)
    )


SOURCES: dict[str, Callable[[dict[str, Any]], Columns]] = {
    "step_time": _step_time,
    "comm": _comm,
    "memory": _memory,
    "scaling": _scaling,
    "convergence": _convergence,
}


def target_lines(results: dict[str, dict[str, Any] | None]) -> list[str]:
    """Each issue-6 target with the measured figure and a verdict (or 'not run')."""
    lines = []
    st = results.get("step_time")
    for name, limit in targets.STEP_TIME_VS_ADAMW.items():
        recs = [r for r in (st or {}).get("records", []) if r["optimizer"] == name and r.get("vs_adamw_foreach")]
        if not recs:
            lines.append(f"- step time {name} <= {limit}x AdamW: not run")
            continue
        figures = ", ".join(f"{r['vs_adamw_foreach']:.2f}x ({r['size']})" for r in recs)
        ok = all(r["vs_adamw_foreach"] <= limit for r in recs)
        lines.append(f"- step time {name} <= {limit}x AdamW (foreach): {figures}: {'met' if ok else 'MISSED'}")
    cm = results.get("comm")
    for name in targets.COMM_TARGET_OPTIMIZERS:
        recs = [r for r in (cm or {}).get("records", []) if r["optimizer"] == name and "error" not in r]
        if not recs:
            lines.append(f"- comm {name} <= {100 * targets.COMM_FRACTION_OF_GRAD:g}% of gradient: not run")
            continue
        worst = max(recs, key=lambda r: r["fraction_of_grad"])
        ok = all(r.get("target_met") for r in recs)
        lines.append(
            f"- comm {name} <= {100 * targets.COMM_FRACTION_OF_GRAD:g}% of gradient, calls independent of "
            f"#matrices: worst {100 * worst['fraction_of_grad']:.3f}% (ws {worst['world_size']}, "
            f"{worst['layout']}), calls independent: {all(r['calls_independent'] for r in recs)}: "
            f"{'met' if ok else 'MISSED'}"
        )
    return lines


def summary_body(results_dir: Path = RESULTS_DIR) -> str:
    """The table, the targets and the sources: what SUMMARY.md holds and the README shows between its markers."""
    results = {name: read_results(name, results_dir) for name in SOURCES}
    table: Columns = {}
    columns: list[str] = []
    for name, extract in SOURCES.items():
        if results[name] is None:
            continue
        for opt, cells in extract(results[name]).items():
            table.setdefault(opt, {}).update(cells)
            columns += [c for c in cells if c not in columns]
    body = [[n] + [table[n].get(c, "") for c in columns] for n in _ordered(table)]
    sources = "; ".join(f"`{n}`: {_describe_run(r)}" for n, r in results.items())
    return (
        markdown_table(["optimizer", *columns], body)
        + "\nTargets (issue 6):\n\n"
        + "\n".join(target_lines(results))
        + f"\n\nSources: {sources}.\n\n"
        + scale_section(read_results("scale", results_dir))
    )


def build_summary(results_dir: Path = RESULTS_DIR) -> str:
    where = results_dir.relative_to(REPO_ROOT) if results_dir.is_relative_to(REPO_ROOT) else results_dir
    return (
        f"# Benchmark summary\n\nGenerated by `python -m benchmarks.summarize` from `{where}/`; "
        "`adamw` is `torch.optim.AdamW` (foreach), the reference of every ratio.\n\n" + summary_body(results_dir)
    )


def _describe_run(result: dict[str, Any] | None) -> str:
    if result is None:
        return "not run"
    env = result["environment"]
    return f"{env['date']}, commit {env['commit']}, {env.get('gpu', env['cpu'])}, {env['torch_threads']} thread(s)"


def _ordered(names: Any) -> list[str]:
    """Baselines first, then shardopt's registry order, then the peers."""
    from .optimizers import ADAMW_VARIANTS, registered
    from .peers import PEERS

    known = ["adamw", *ADAMW_VARIANTS, *registered(), *PEERS]
    return sorted(names, key=lambda n: known.index(n) if n in known else len(known))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"summarize the smoke runs in {QUICK_DIR}")
    ap.add_argument("--results-dir", type=Path, default=None, help="default: benchmarks/results")
    ap.add_argument(
        "--scale", action="store_true", help="print the scale-simulation table (benchmarks.scale) and write nothing"
    )
    ap.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if SUMMARY.md differs from the result files"
    )
    args = ap.parse_args(argv)
    results_dir = args.results_dir or (QUICK_DIR if args.quick else RESULTS_DIR)
    if args.scale:
        print(scale_section(read_results("scale", results_dir)))
        return
    text, path = build_summary(results_dir), results_dir / "SUMMARY.md"
    if args.check:
        if not path.exists() or path.read_text() != text:
            raise SystemExit(
                f"{path} is out of date with {results_dir}; run `python -m benchmarks.summarize` and commit"
            )
        print(f"SUMMARY.md agrees with {results_dir}")
        return
    path.write_text(text)
    print(text)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
