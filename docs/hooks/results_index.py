"""MkDocs hook: the list of committed benchmark results on the Benchmarks page, generated at build time.

``docs/results`` is a link to ``benchmarks/results``, so every result table (``<name>.md``) and plot is
a page or image of the site. This hook replaces ``<!-- result-files -->`` on ``benchmarks.md`` with one row
per result file: its link and the run line the benchmark wrote under its title (date, commit, versions, device).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PLACEHOLDER = "<!-- result-files -->"
PAGE = "benchmarks.md"
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _run_line(path: Path) -> str:
    """The first line under the title that is not a heading (the run's environment)."""
    for line in path.read_text(encoding="utf-8").splitlines()[1:]:
        if line.strip() and not line.startswith("#"):
            return " ".join(line.split()).replace("|", "\\|")
    return ""


def render() -> str:
    rows = ["| result | run |", "|---|---|"]
    for path in sorted(RESULTS.glob("*.md")):
        rows.append(f"| [{path.stem}](results/{path.name}) | {_run_line(path)} |")
    pngs = sorted(RESULTS.glob("*.png"))
    plots = ", ".join(f"[{p.name}](results/{p.name})" for p in pngs)
    return "\n".join(rows) + "\n\n" + (f"Plots: {plots}.\n" if pngs else "")


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if page.file.src_uri == PAGE:
        if PLACEHOLDER not in markdown:
            raise ValueError(f"{PAGE}: the placeholder {PLACEHOLDER} is missing")
        return markdown.replace(PLACEHOLDER, render())
    return markdown
