"""The release artifacts (issue 54): what ``make dist`` builds holds the whole package and nothing else (CI), and its
wheel installs into an empty virtual environment, where ``shardopt --version`` and a 2-rank FSDP2 example run from
it with the checkout out of reach (full tier).

Both build from a copy of the files git sees (tracked, and untracked but not ignored), as ``make dist`` does from
the checkout, with the same command, so that a test never writes into the checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from email.parser import HeaderParser
from pathlib import Path

import pytest
import tomllib
from tiers import full_only

from launch import free_port, run_bounded

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
DECLARED = PROJECT["version"]
#: the smallest documented distributed run that needs no DeepSpeed: FSDP2 on 2 CPU ranks (gloo)
EXAMPLE = ("fsdp2_train.py", "common.py")


def _run(cmd: list, timeout: float, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))} exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
    return out


def _source_copy(dst: Path) -> Path:
    """The checkout's files as git sees them (what a clone would build), copied to ``dst``."""
    listed = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], 60, cwd=ROOT).stdout
    for rel in filter(None, listed.split("\0")):
        if (ROOT / rel).is_file():  # a tracked file deleted in the working tree is not built
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dst / rel)
    return dst


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict[str, Path]:
    """``make dist``'s command (an sdist, then the wheel built from it) on a copy of the checkout."""
    tmp = tmp_path_factory.mktemp("dist")
    src = _source_copy(tmp / "src")
    _run([sys.executable, "-m", "build", "--outdir", tmp / "dist", src], 600)
    (wheel,) = (tmp / "dist").glob("*.whl")
    (sdist,) = (tmp / "dist").glob("*.tar.gz")
    return {"src": src, "wheel": wheel, "sdist": sdist}


def test_the_wheel_holds_the_package_and_nothing_else(dist):
    src = dist["src"]
    with zipfile.ZipFile(dist["wheel"]) as z:
        names = set(z.namelist())
        info = f"shardopt-{DECLARED}.dist-info"
        meta = HeaderParser().parsestr(z.read(f"{info}/METADATA").decode())
        entry_points = z.read(f"{info}/entry_points.txt").decode()
    package = {
        p.relative_to(src).as_posix()
        for p in (src / "shardopt").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    # every folder of modules is a package (setuptools' find would leave a folder without __init__.py out)
    folders = {p.rsplit("/", 1)[0] for p in package if p.endswith(".py")}
    assert all(f"{f}/__init__.py" in package for f in folders), sorted(folders)
    assert not package - names, f"{dist['wheel'].name} lacks {sorted(package - names)}"
    assert "shardopt/py.typed" in names, "the PEP 561 marker: type checkers read the installed package's hints"
    extra = sorted(n for n in names if not n.startswith(info + "/") and n not in package)
    assert not extra, f"{dist['wheel'].name} holds files the package does not have (tests? examples?): {extra}"
    assert {n.split("/")[0] for n in names} == {"shardopt", info}
    assert meta["Name"] == "shardopt" and meta["Version"] == DECLARED
    requires = {r.split(";")[0].replace(" ", "") for r in meta.get_all("Requires-Dist")}
    assert {d.replace(" ", "") for d in PROJECT["dependencies"]} <= requires
    assert "shardopt = shardopt.cli:main" in entry_points


def test_the_sdist_builds_the_wheel_from_the_package_and_its_metadata(dist):
    """The wheel above was built from this sdist; it carries the sources, pyproject.toml and the README."""
    import tarfile

    with tarfile.open(dist["sdist"]) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert {"pyproject.toml", "README.md", "shardopt/__init__.py", "shardopt/cli.py"} <= names


@full_only("the wheel's and the sdist's contents (the tests above)")
def test_the_wheel_installs_into_an_empty_venv_and_runs(dist, tmp_path):
    """The acceptance of issue 54: no editable install, no system site-packages, the checkout not importable."""
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], 300)
    bin_ = venv / "bin"
    py = bin_ / "python"
    home = os.environ.copy()
    for var in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
        home.pop(var, None)
    theirs = [p for p in home.get("PATH", "").split(os.pathsep) if p and not p.startswith(str(ROOT))]
    env = {**home, "PATH": os.pathsep.join([str(bin_), *theirs]), "OMP_NUM_THREADS": "1", "VIRTUAL_ENV": str(venv)}
    _run([py, "-m", "pip", "install", "-q", "torch==2.13.0"], 1200, env=env)  # as make setup installs it
    _run([py, "-m", "pip", "install", "-q", dist["wheel"]], 600, env=env)  # the wheel and its dependencies

    run = tmp_path / "run"  # outside the checkout, with only the example's two files
    run.mkdir()
    for name in EXAMPLE:
        shutil.copy2(ROOT / "examples" / name, run / name)
    where = _run([py, "-c", "import shardopt; print(shardopt.__file__)"], 300, env=env, cwd=run).stdout.strip()
    assert Path(where).is_relative_to(venv), f"shardopt imported from {where}, not from the installed wheel"
    version = _run([bin_ / "shardopt", "--version"], 300, env=env, cwd=run)
    assert version.stdout.strip() == f"shardopt {DECLARED}"

    cmd = [str(py), "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    cmd += ["--master_port", str(free_port()), EXAMPLE[0], "--steps", "2"]
    out = run_bounded(cmd, env=env, timeout=600, cwd=run)
    assert out.returncode == 0, f"{' '.join(cmd)} exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
    assert "step 2: loss" in out.stdout, out.stdout
