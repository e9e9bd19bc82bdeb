"""The benchmark modules run as ``python -m benchmarks.<name>`` from the repository root, or from anywhere with the
repository on ``PYTHONPATH``, and nothing in the project imports ``benchmarks`` in a way that could find another
package of that name.

fairscale (the ``engines`` extra) installs an unrelated top-level package named ``benchmarks``. Python finds the
repository's folder only where the repository comes before site-packages on ``sys.path``: the current directory
(``python -m`` and ``python -c`` put it first) or ``PYTHONPATH``. From any other directory
``python -m benchmarks.scale`` imported fairscale's package and failed. The folder keeps its name (the project's
layout); ``benchmarks/README.md`` and the docs' Benchmarks page say how to run it. The suite checks:

(a) from the repository root, ``python -m benchmarks.scale --help`` works and ``import benchmarks`` is the
    repository's folder;
(b) from another directory with ``PYTHONPATH=<repository>``, ``python -m benchmarks.scale --help`` works (and,
    where fairscale is installed, without it ``import benchmarks`` is fairscale's: the hazard is real);
(c) the benchmark modules import their siblings only relatively (``from .results import ...``), so once the
    package is the repository's every sibling is too; no other Python file of the project imports
    ``benchmarks``; and a file outside ``benchmarks/`` that launches ``python -m benchmarks.<name>`` says where it
    runs (``cwd``: the repository root, or the repository on ``PYTHONPATH`` through ``env``).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
#: the project's Python outside benchmarks/ (the virtual environment and build outputs excluded)
OTHER_TOPS = ["shardopt", "tests", "tests_dist", "examples", "launch", "docs", "configs", "docker"]


def _run(args: list[str], cwd: Path | str, pythonpath: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=180)


def _where_benchmarks(cwd: Path | str, pythonpath: str | None = None) -> Path:
    proc = _run(["-c", "import benchmarks; print(benchmarks.__file__)"], cwd, pythonpath)
    assert proc.returncode == 0, proc.stderr
    return Path(proc.stdout.strip()).resolve().parent


def test_from_the_repository_root_the_module_runs_and_the_package_is_ours():
    assert _where_benchmarks(REPO) == BENCH
    proc = _run(["-m", "benchmarks.scale", "--help"], cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "usage:" in proc.stdout and "benchmarks.scale" in proc.stdout


def test_from_elsewhere_with_the_repository_on_pythonpath_the_module_runs():
    with tempfile.TemporaryDirectory() as elsewhere:
        assert _where_benchmarks(elsewhere, str(REPO)) == BENCH
        proc = _run(["-m", "benchmarks.scale", "--help"], cwd=elsewhere, pythonpath=str(REPO))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "usage:" in proc.stdout


def test_without_the_repository_on_the_path_another_benchmarks_package_wins():
    """Why the rule exists: where an installed package is named ``benchmarks`` (fairscale's), a run outside the
    repository root imports it, and ``python -m benchmarks.scale`` fails."""
    with tempfile.TemporaryDirectory() as elsewhere:
        found = _run(
            ["-c", "import importlib.util as u; s = u.find_spec('benchmarks'); print(s.origin if s else '')"], elsewhere
        )
        if not found.stdout.strip():
            pytest.skip("no installed package named benchmarks (fairscale is not installed)")
        assert _where_benchmarks(elsewhere) != BENCH
        proc = _run(["-m", "benchmarks.scale", "--help"], cwd=elsewhere)  # the failure the rule avoids
        assert proc.returncode != 0 and "No module named benchmarks.scale" in proc.stderr


def _imports(path: Path) -> list[tuple[int, str, int]]:
    """(line, module, level) of every import in ``path``: ``import a.b`` gives ("a.b", 0); ``from .x import y``
    gives ("x", 1); ``importlib.import_module("a.b")`` with a literal name gives ("a.b", 0)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, 0) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.lineno, node.module or "", node.level))
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            out.append((node.lineno, node.args[0].value, 0))
    return out


def _is_benchmarks(module: str) -> bool:
    return module == "benchmarks" or module.startswith("benchmarks.")


def test_benchmark_modules_import_their_siblings_relatively():
    files = sorted(BENCH.glob("*.py"))
    assert len(files) > 10
    bad = [
        f"benchmarks/{f.name}:{line}: import {module}"
        for f in files
        for line, module, level in _imports(f)
        if level == 0 and _is_benchmarks(module)
    ]
    assert not bad, (
        "absolute imports of `benchmarks` can find fairscale's package; import siblings relatively "
        "(from .results import ...):\n" + "\n".join(bad)
    )
    relative = [module for f in files for _, module, level in _imports(f) if level]
    assert relative, "the benchmark modules no longer import each other? (then this test checks nothing)"


def _project_python() -> list[Path]:
    files = [REPO / "conftest.py"]
    for top in OTHER_TOPS:
        files += sorted(p for p in (REPO / top).rglob("*.py") if "__pycache__" not in p.parts)
    return [f for f in files if f.is_file()]


def test_nothing_else_imports_the_benchmarks_package():
    bad = [
        f"{f.relative_to(REPO)}:{line}: import {module}"
        for f in _project_python()
        for line, module, level in _imports(f)
        if level == 0 and _is_benchmarks(module)
    ]
    assert not bad, (
        "outside benchmarks/ the package is run as `python -m benchmarks.<name>` from the repository "
        "root, never imported (an import would find fairscale's package wherever the root is not "
        "first on sys.path):\n" + "\n".join(bad)
    )


def test_launches_of_benchmark_modules_from_outside_say_where_they_run():
    launches, bad = 0, []
    for f in _project_python():
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"), str(f))):
            if not isinstance(node, ast.Call):
                continue
            lists = [a for a in node.args if isinstance(a, (ast.List, ast.Tuple))]
            strings = [
                e.value for a in lists for e in a.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)
            ]
            if any(_is_benchmarks(s) for s in strings) and "-m" in strings:
                launches += 1
                if not any(k.arg in ("cwd", "env", "pythonpath") for k in node.keywords):
                    bad.append(f"{f.relative_to(REPO)}:{node.lineno}")
    assert not bad, (
        "a `python -m benchmarks.<name>` launch that passes neither cwd=<repository root> nor an env "
        "with the repository on PYTHONPATH: " + ", ".join(bad)
    )
    assert launches >= 1  # this file's own launches at least
