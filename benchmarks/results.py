"""Result files: every benchmark writes ``results/<name>.json`` (all numbers) and ``results/<name>.md`` (tables).

One writer, so every file records the same environment (versions, device, threads, commit) and the
summary can trust the layout: ``{"benchmark", "environment", "config", "records", "notes"}``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any, Iterable, Sequence

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parents[1]
#: smoke runs (``--quick``) write here, under the git-ignored ``runs/``
QUICK_DIR = REPO_ROOT / "runs" / "benchmarks" / "quick"

__all__ = [
    "RESULTS_DIR",
    "REPO_ROOT",
    "QUICK_DIR",
    "environment",
    "markdown_table",
    "write_results",
    "read_results",
    "fmt",
]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_commit() -> str:
    """The checkout's commit; ``SHARDOPT_COMMIT`` names it where the tree was copied without its history (a
    lent GPU machine)."""
    if os.environ.get("SHARDOPT_COMMIT"):
        return os.environ["SHARDOPT_COMMIT"]
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or "unknown"
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment(device: str = "cpu") -> dict[str, Any]:
    """What the numbers depend on: versions, the device, CPU threads, the commit (dirty trees included)."""
    import torch

    env = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": _git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": device,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    try:
        import deepspeed

        env["deepspeed"] = deepspeed.__version__
    except Exception:  # optional extra; a broken install must not stop a benchmark that does not need it
        pass
    return env


def fmt(value: Any, spec: str = ".3g") -> str:
    """A table cell: numbers formatted with ``spec``, ``None`` as "n/a", everything else as ``str``."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        return format(value, spec)
    return str(value)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(c) if not isinstance(c, str) else c for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_results(
    name: str,
    config: dict[str, Any],
    records: list[dict[str, Any]],
    markdown: str,
    notes: Sequence[str] = (),
    device: str = "cpu",
    out_dir: Path | None = None,
    raw: Any = None,
) -> Path:
    """Write ``<name>.json`` and ``<name>.md`` under ``out_dir`` (default ``benchmarks/results``); ``raw``
    (per-case measurements behind the records) goes into the JSON only."""
    out = Path(out_dir or RESULTS_DIR)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(device)
    payload = {"benchmark": name, "environment": env, "config": config, "records": records, "notes": list(notes)}
    if raw is not None:
        payload["raw"] = raw
    (out / f"{name}.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    header = (
        f"# {name}\n\n{env['date']}, commit {env['commit']}, torch {env['torch']}, "
        f"{env.get('gpu', env['cpu'])}, {env['torch_threads']} thread(s)\n\n"
    )
    tail = "".join(f"- {n}\n" for n in notes)
    (out / f"{name}.md").write_text(header + markdown + ("\n" + tail if tail else ""))
    return out / f"{name}.json"


def read_results(name: str, out_dir: Path | None = None) -> dict[str, Any] | None:
    path = Path(out_dir or RESULTS_DIR) / f"{name}.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text())
