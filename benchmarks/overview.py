"""The README's results overview: one table and one figure, built only from the committed result files.

    python -m benchmarks.overview           # writes benchmarks/results/overview.png and the table into README.md
    python -m benchmarks.overview --check   # exit 1 if the README's table differs from the result files

The table puts, per optimizer, its state memory and CPU step time next to ``torch.optim.AdamW`` (``memory``,
``step_time``), its GPU training throughput next to fused AdamW (``throughput_cuda``) and its best validation loss
in the learning-rate sweep (``convergence``). The figure shows the convergence curves of the best runs beside the
GPU throughput. Run it from the repository root (fairscale installs an unrelated top-level ``benchmarks``
package, which a run from elsewhere would import instead; see ``benchmarks/README.md``). The full tables, with
the machine and run of every file, are ``benchmarks/results/SUMMARY.md`` and the documentation's Benchmarks page
(``docs/benchmarks.md``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .results import REPO_ROOT, RESULTS_DIR, fmt, markdown_table, read_results

BEGIN = "<!-- results overview: written by `python -m benchmarks.overview`; do not edit by hand -->"
END = "<!-- end of results overview -->"
FIGURE = "overview.png"
#: the model sizes the table reads (the largest size of each benchmark's committed run)
STEP_SIZE, MEMORY_SIZE, THROUGHPUT_SIZE = "130m", "130m", "350m"


def _by_optimizer(result: dict[str, Any] | None, **match: Any) -> dict[str, dict[str, Any]]:
    if result is None:
        return {}
    return {
        r["optimizer"]: r
        for r in result["records"]
        if "error" not in r and all(r.get(k) == v for k, v in match.items())
    }


def _best_convergence(result: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    from .convergence import best_runs

    return best_runs(result["records"]) if result else {}


def _order(names: list[str]) -> list[str]:
    from shardopt.optim.registry import OPTIMIZERS

    known = ["adamw", *OPTIMIZERS]
    return [n for n in known if n in names]


def table(results_dir: Path = RESULTS_DIR) -> str:
    """The README table (markdown, ends with a newline)."""
    step = _by_optimizer(read_results("step_time", results_dir), size=STEP_SIZE)
    memory = _by_optimizer(read_results("memory", results_dir), kind="state", size=MEMORY_SIZE)
    gpu_result = read_results("throughput_cuda", results_dir)
    gpu = _by_optimizer(gpu_result, size=THROUGHPUT_SIZE)
    best = _best_convergence(read_results("convergence", results_dir))
    device = (gpu_result or {}).get("environment", {}).get("gpu", "GPU")
    headers = [
        "optimizer",
        f"state / AdamW ({MEMORY_SIZE.upper()})",
        f"CPU step / AdamW ({STEP_SIZE.upper()})",
        f"training tokens/s / AdamW ({device}, {THROUGHPUT_SIZE.upper()})",
        "best val. loss (lr sweep)",
    ]
    rows = []
    for name in _order(sorted({"adamw"} | set(step) | set(memory) | set(gpu) | set(best))):
        b = best.get(name)
        ref = name == "adamw"  # the reference of the ratios (AdamW paired with itself gives the noise, ~1.00)
        rows.append(
            [
                f"`{name}`",
                fmt(memory.get(name, {}).get("vs_adamw"), ".2f"),
                "1 (reference)" if ref else fmt(step.get(name, {}).get("vs_adamw_foreach"), ".2f"),
                "1 (reference)" if ref else fmt(gpu.get(name, {}).get("vs_adamw_fused"), ".3f"),
                f"{b['val_loss']:.2f}" if b else "",
            ]
        )
    return markdown_table(headers, rows)


def figure(path: Path, results_dir: Path = RESULTS_DIR) -> None:
    """Validation loss of each optimizer's best run (left) and GPU training throughput against fused AdamW
    (right), written as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = _best_convergence(read_results("convergence", results_dir))
    gpu_result = read_results("throughput_cuda", results_dir)
    gpu = _by_optimizer(gpu_result, size=THROUGHPUT_SIZE)
    fig, (ax_l, ax_t) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [1.25, 1]})
    palette = plt.get_cmap("tab10").colors
    color = {n: palette[i % 10] for i, n in enumerate(_order([*best, *gpu])[1:])}  # one colour per optimizer
    for name in _order(list(best)):
        r = best[name]
        tokens, loss = zip(*r["val_curve"])
        adamw = name == "adamw"
        ax_l.plot(
            [t / 1e3 for t in tokens],
            loss,
            marker="o",
            ms=3,
            lw=2.4 if adamw else 1.3,
            color="black" if adamw else color[name],
            ls="--" if adamw else "-",
            label=f"{name} {r['val_loss']:.2f} (lr x{r['lr_mult']:g})",
        )
    ax_l.set(
        xlabel="training tokens (k)",
        ylabel="validation loss",
        title="Convergence: best learning rate of each optimizer (CPU, 200 steps)",
    )
    ax_l.legend(fontsize=7, ncol=2)
    ax_l.grid(alpha=0.3)
    names = [n for n in _order(list(gpu)) if n != "adamw"]
    ratios = [gpu[n]["vs_adamw_fused"] for n in names]
    ax_t.barh(names, ratios, color=[color[n] for n in names])
    ax_t.axvline(1.0, color="black", ls="--", lw=1.5)
    for y, v in enumerate(ratios):
        ax_t.text(v - 0.015, y, f"{v:.3f}", va="center", ha="right", fontsize=8, color="white", weight="bold")
    device = (gpu_result or {}).get("environment", {}).get("gpu", "GPU")
    ax_t.set(
        xlim=(0, 1.05),
        xlabel="training tokens/s / fused AdamW (dashed: AdamW)",
        title=f"Throughput: LLaMA {THROUGHPUT_SIZE.upper()} on one {device}",
    )
    ax_t.invert_yaxis()
    ax_t.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def readme_with_table(readme: str, body: str) -> str:
    """``readme`` with the text between its overview markers replaced by ``body``."""
    if BEGIN not in readme or END not in readme:
        raise SystemExit(f"README: markers {BEGIN!r} and {END!r} not found; put them where the table goes")
    head, rest = readme.split(BEGIN, 1)
    return head + BEGIN + "\n" + body + rest[rest.index(END) :]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if README.md's table differs from the result files"
    )
    args = ap.parse_args(argv)
    readme = REPO_ROOT / "README.md"
    updated = readme_with_table(readme.read_text(), table())
    if args.check:
        if readme.read_text() != updated:
            raise SystemExit(
                "README.md's results table is out of date with benchmarks/results; "
                "run `python -m benchmarks.overview` and commit"
            )
        print("README.md's results table agrees with benchmarks/results")
        return
    figure(RESULTS_DIR / FIGURE)
    readme.write_text(updated)
    print(f"wrote {RESULTS_DIR / FIGURE} and the table into {readme}")


if __name__ == "__main__":
    main()
