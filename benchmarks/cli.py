"""Command-line plumbing shared by the benchmark scripts."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .results import QUICK_DIR, RESULTS_DIR

__all__ = ["parse_args"]


def parse_args(ap: argparse.ArgumentParser, argv: list[str] | None, quick: dict[str, Any]) -> argparse.Namespace:
    """Parse ``argv`` with the common ``--results-dir`` and ``--quick``. With ``--quick``, ``quick`` replaces the
    defaults (flags given explicitly still win) and results go to ``runs/benchmarks/quick`` (not committed), so a
    smoke run never overwrites the results the README table is built from."""
    ap.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the JSON/markdown files go")
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: " + ", ".join(f"{k}={v}" for k, v in quick.items())
    )
    first, _ = ap.parse_known_args(argv)
    if first.quick:
        ap.set_defaults(**quick, results_dir=QUICK_DIR)
    return ap.parse_args(argv)
