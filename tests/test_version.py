"""The version a user reads (``shardopt --version``, ``shardopt.__version__``) is the one pyproject.toml declares,
installed or not (issue 54)."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import tomllib

import shardopt
from shardopt import _version

ROOT = Path(__file__).resolve().parents[1]
DECLARED = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_console_script_prints_the_pyproject_version():
    script = Path(sys.executable).parent / "shardopt"
    assert script.exists(), f"{script}: no console script; install the checkout (make setup: pip install -e .)"
    out = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"shardopt {DECLARED}"


def test_module_cli_and_attribute_agree():
    out = subprocess.run(
        [sys.executable, "-m", "shardopt", "--version"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"shardopt {DECLARED}"
    assert shardopt.__version__ == DECLARED


def test_uninstalled_checkout_reads_pyproject(monkeypatch):
    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(_version.metadata, "version", not_installed)
    assert _version.version() == DECLARED
    monkeypatch.setattr(_version, "_from_pyproject", lambda: None)
    assert _version.version() == _version.UNKNOWN


def test_pyproject_scan_reads_only_the_project_table(tmp_path):
    f = tmp_path / "pyproject.toml"
    f.write_text('[tool.x]\nversion = "9.9"\n\n[project]\nname = "shardopt"\nversion = "1.2.3rc1"\n\n[tool.y]\n')
    assert _version._from_pyproject(f) == "1.2.3rc1"
    f.write_text('[project]\nname = "shardopt"\n\n[tool.x]\nversion = "9.9"\n')
    assert _version._from_pyproject(f) is None
    assert _version._from_pyproject(tmp_path / "missing.toml") is None
