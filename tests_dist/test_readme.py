"""Every code block of README.md and of the documentation (docs/**/*.md) runs as written, so neither can drift
from the code.

Each file is split into fenced blocks (```bash, ```python, ```json). A block may carry a marker, the HTML
comment on the line before it (invisible on GitHub and on the site; the same ``readme-test`` marker everywhere):

- ``<!-- readme-test: ci ... -->``: ``make demo`` / ``make test``. They are what CI runs (this test runs
  inside ``make test``, so running them here would recurse); here each target is checked with ``make -n``.
- ``<!-- readme-test: syntax-only Docker|Slurm ... -->``: needs a container runtime or a cluster, so only
  ``bash -n`` on the block and on the launch scripts it names. No other reason is accepted.
- ``<!-- readme-test: excerpt FILE -->``: a Python block copied from a runnable example: its lines must appear
  in FILE in the same order (whitespace-normalized), it must compile, and a runnable block must run FILE.
- ``<!-- readme-test: same-as FILE -->``: the block is FILE's content (a config the page shows).
- ``<!-- readme-test: runs-in PAGE -->``: a bash block shown again where it is not run (the README names the
  commands its guides run): each of its commands must be in a runnable block of PAGE, so it runs once.

FILE and PAGE are paths from the repository root. ``text`` blocks are output, not code, and are not run. A Python
block must be an excerpt of a runnable example, and some runnable block (of any page) must run that example.

Every other bash block runs in the full tier, one test per page (``-k <page>`` selects one: ``-k checkpoints``):
the page's blocks in order, in one scratch directory that looks like a fresh clone (links to the checkout's files
and its ``.venv``), after ``. .venv/bin/activate`` (the set-up every page assumes, shown in
docs/getting-started.md), with ``DS_ACCELERATOR`` unset as in a new user's shell. A page's blocks depend only on
that page's earlier blocks. What this test changes, and only to keep it short:
trainer launches (``-m shardopt.train``, ``launch/multinode.sh``) get ``--set train.steps=2`` and a small
validation set appended (the configs' 400 steps take minutes); ``pip install`` gets ``--dry-run --no-index
--no-build-isolation`` (nothing is installed or downloaded); ``launch/multinode.sh`` gets a free
``MASTER_PORT`` from the environment (single-node ``torchrun`` picks a free port itself). The tokenizer cache is the
checkout's ``runs/cache`` (as for ``make demo``). The examples the pages run are tiny by default, so they run unchanged.
Every block has a timeout. About 2.5 minutes on 2 quiet cores, 5 under load (the first DeepSpeed launch on a machine
also builds its CPU op: 1-2 minutes more). What a command prints where a page says so (``CLAIMS``) is checked in its
output, on whichever page the command is.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib
from tiers import full_only

from launch import ROOT, free_port

README = ROOT / "README.md"
DOCS = ROOT / "docs"
BLOCK_TIMEOUT = 600
SYNTAX_ONLY_REASONS = ("Docker", "Slurm")
MARKERS = ("", "ci", "syntax-only", "excerpt", "same-as", "runs-in")
#: what every runnable block runs after: the environment docs/getting-started.md sets up
SETUP = ". .venv/bin/activate\n"
TINY_TRAINER = [
    "--set",
    "train.steps=2",
    "--set",
    "eval.max_sequences=4",
    "--set",
    "eval.every=0",
    "--set",
    "train.progress=false",
]
PIP_OFFLINE = ["--dry-run", "--no-index", "--no-build-isolation"]
#: what a page says a command prints (its comment), checked in the block's output
CLAIMS = {
    "--load ckpt": "resumed from ckpt at step 4 on 4 ranks",
    "--load fsdp_ckpt": "resumed from fsdp_ckpt at step 4 on 3 ranks",
    "--load ds_ckpt": "resumed from ds_ckpt at step 4 on 2 ranks",
}


@dataclass
class Block:
    file: str  # the page, relative to the repository root
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    marker: str  # "" or the marker's words after "readme-test:"

    @property
    def kind(self) -> str:
        return self.marker.split()[0] if self.marker else ""

    @property
    def arg(self) -> str:
        parts = self.marker.split()
        return parts[1] if len(parts) > 1 else ""

    @property
    def runnable(self) -> bool:
        return self.lang == "bash" and not self.kind

    def where(self) -> str:
        return f"{self.file}:{self.line} ({self.lang} block)"


def doc_files() -> list[Path]:
    """README.md and every page under docs/ (not the benchmark results linked into docs/results)."""
    pages = sorted(p for p in DOCS.rglob("*.md") if p.resolve().is_relative_to(DOCS.resolve()))
    return [README, *pages]


def file_blocks(path: Path) -> list[Block]:
    rel = str(path.relative_to(ROOT))
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        assert j < len(lines), f"{rel}:{i + 1}: code block never closed"
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        mm = re.match(r"^<!--\s*readme-test:\s*(.*?)\s*-->$", lines[k].strip()) if k >= 0 else None
        blocks.append(Block(rel, i + 1, m.group(1), "\n".join(lines[i + 1 : j]) + "\n", mm.group(1) if mm else ""))
        i = j + 1
    return blocks


FILES = {str(p.relative_to(ROOT)): file_blocks(p) for p in doc_files()}
BLOCKS = [b for blocks in FILES.values() for b in blocks]
#: the pages whose blocks run in the full tier
RUNNABLE_FILES = [f for f, blocks in FILES.items() if any(b.runnable for b in blocks)]


def _normalized(text: str) -> list[str]:
    return [" ".join(line.split()) for line in text.splitlines() if line.strip()]


def _commands(block: Block) -> list[str]:
    """The block's commands, continuation lines joined, comments and blank lines dropped."""
    joined = block.text.replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def _split_comment(line: str) -> tuple[str, str]:
    m = re.search(r"\s+#\s.*$", line)
    return (line[: m.start()], line[m.start() :]) if m else (line, "")


def _runnable_bash(block: Block) -> str:
    """The block with this test's documented shortening applied (see the module docstring)."""
    out = []
    for line in block.text.replace("\\\n", " ").splitlines():
        cmd, comment = _split_comment(line)
        if re.search(r"-m shardopt\.train\b|launch/multinode\.sh\b", cmd):
            cmd = f"{cmd} {shlex.join(TINY_TRAINER)}"
        cmd = re.sub(r"\bpip install\b", "pip install " + " ".join(PIP_OFFLINE), cmd)
        out.append(cmd + comment)
    return "\n".join(out) + "\n"


def _is_setup(block: Block) -> bool:
    return block.lang == "bash" and any(re.match(r"^(\.|source)\s+\.venv/bin/activate\b", c) for c in _commands(block))


# ------------------------------------------------------------------------------------------ static checks
def test_the_readme_and_the_docs_have_blocks():
    assert FILES["README.md"], "README.md has no code blocks"
    assert len(FILES) > 10, f"only {list(FILES)}: are the docs/ pages missing?"
    assert len([b for b in BLOCKS if b.runnable]) >= 8, (
        "fewer than 8 runnable blocks: did the docs lose their examples?"
    )


@pytest.mark.parametrize("doc", list(FILES))
def test_every_block_has_a_language_and_a_known_marker(doc):
    for b in FILES[doc]:
        assert b.lang in ("bash", "python", "json", "text"), (
            f"{b.where()}: tag the block as bash, python or json (or text for output that is not run)"
        )
        assert b.kind in MARKERS, f"{b.where()}: unknown marker {b.marker!r}"
        if b.kind == "syntax-only":
            assert b.arg in SYNTAX_ONLY_REASONS, (
                f"{b.where()}: only Docker and Slurm blocks may skip running (got {b.arg!r})"
            )
        if b.kind == "ci":
            assert all(re.fullmatch(r"make [\w-]+(\s+#.*)?", c) for c in _commands(b)), (
                f"{b.where()}: a 'ci' block may hold only make targets"
            )
        if b.kind in ("excerpt", "same-as", "runs-in"):
            assert (ROOT / b.arg).is_file(), f"{b.where()}: {b.arg} does not exist"
        if b.kind == "runs-in":
            assert b.lang == "bash", f"{b.where()}: 'runs-in' is for bash blocks"
        if b.lang == "python" and not b.kind:
            pytest.fail(f"{b.where()}: a Python block must be an excerpt of a runnable example")


@pytest.mark.parametrize("doc", list(FILES))
def test_ci_blocks_name_real_make_targets(doc):
    for b in (b for b in FILES[doc] if b.kind == "ci"):
        for cmd in _commands(b):
            target = cmd.split()[1]
            proc = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True, timeout=60)
            assert proc.returncode == 0, f"{b.where()}: make -n {target}: {proc.stderr}"


@pytest.mark.parametrize("doc", list(FILES))
def test_excerpts_are_in_their_examples_in_order_and_the_examples_run(doc):
    runnable = "".join(b.text for b in BLOCKS if b.runnable)
    for b in (b for b in FILES[doc] if b.kind == "excerpt"):
        compile(b.text, b.where(), "exec")
        source = iter(_normalized((ROOT / b.arg).read_text()))
        for line in _normalized(b.text):
            assert any(line == s for s in source), f"{b.where()}: {line!r} is not in {b.arg} (in this order)"
        assert b.arg in runnable, f"{b.where()}: no runnable block of the README or docs/ runs {b.arg}"


@pytest.mark.parametrize("doc", list(FILES))
def test_runs_in_blocks_run_on_their_page(doc):
    """A command shown twice runs once: where the block says."""
    for b in (b for b in FILES[doc] if b.kind == "runs-in"):
        assert b.arg in FILES, f"{b.where()}: {b.arg} is not a page this test reads"
        there = {
            " ".join(c.split())
            for o in FILES[b.arg]
            if o.runnable
            for c in (_split_comment(x)[0] for x in _commands(o))
        }
        for cmd in _commands(b):
            cmd = " ".join(_split_comment(cmd)[0].split())
            assert cmd in there, f"{b.where()}: `{cmd}` is not in a runnable block of {b.arg}"


@pytest.mark.parametrize("doc", list(FILES))
def test_same_as_blocks_are_their_files(doc):
    for b in (b for b in FILES[doc] if b.kind == "same-as"):
        assert b.text.strip() == (ROOT / b.arg).read_text().strip(), f"{b.where()}: differs from {b.arg}"


@pytest.mark.parametrize("doc", list(FILES))
def test_json_blocks_are_valid_deepspeed_configs(doc):
    from shardopt.train.config import validate_deepspeed_config

    for b in (b for b in FILES[doc] if b.lang == "json"):
        validate_deepspeed_config(json.loads(b.text), where=b.where())


@pytest.mark.parametrize("doc", list(FILES))
def test_syntax_only_blocks_parse(doc):
    for b in (b for b in FILES[doc] if b.kind == "syntax-only"):
        proc = subprocess.run(["bash", "-n"], input=b.text, capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, f"{b.where()}: {proc.stderr}"
        for script in re.findall(r"\b(launch/[\w.]+|docker/[\w.]+\.sh)\b", b.text):
            proc = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True, timeout=30)
            assert proc.returncode == 0, f"{b.where()}: {script}: {proc.stderr}"


def test_every_example_script_runs_in_the_docs():
    runnable = "".join(b.text for b in BLOCKS if b.runnable)
    scripts = [p for p in (ROOT / "examples").glob("*.py") if "__main__" in p.read_text()]
    assert scripts
    for p in scripts:
        assert f"examples/{p.name}" in runnable, f"examples/{p.name} is not run by a block of README.md or docs/"


def test_every_claim_is_on_a_runnable_block():
    """CLAIMS follow their commands to whichever page runs them; a claim whose command left every page is stale."""
    for needle in CLAIMS:
        hits = [b for b in BLOCKS if b.runnable and any(re.search(re.escape(needle) + r"\b", c) for c in _commands(b))]
        assert hits, f"no runnable block runs `{needle}`, whose output CLAIMS checks"


def test_python_version_agrees_with_pyproject_and_makefile():
    need = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    low = re.fullmatch(r">=\s*(\d+\.\d+)", need).group(1)
    said = f"Python {low} or newer, tested on 3.11"
    assert said in " ".join(README.read_text().split()), f"README.md should say {said!r} (pyproject: {need})"
    assert said in (ROOT / "Makefile").read_text(), f"the Makefile's comment should say {said!r}"


# ------------------------------------------------------------------------------------------- running it all
def _scratch(tmp_path: Path) -> Path:
    """A directory that looks like a fresh clone after `make setup`: links to the checkout and its venv."""
    venv = Path(sys.prefix)
    if not (venv / "bin" / "activate").is_file():
        pytest.skip(f"needs the project's virtual environment (.venv, as `make test` sets up); {venv} is not one")
    skip = {".git", ".venv", "runs", "build", ".pytest_cache", "__pycache__"}
    for entry in ROOT.iterdir():
        if entry.name not in skip and not entry.name.endswith(".egg-info"):
            (tmp_path / entry.name).symlink_to(entry)
    (tmp_path / ".venv").symlink_to(venv)
    (ROOT / "runs" / "cache").mkdir(parents=True, exist_ok=True)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "cache").symlink_to(ROOT / "runs" / "cache")
    return tmp_path


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "VIRTUAL_ENV", "PYTHONHOME")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # the scratch copy reaches the venv through a link, so DeepSpeed's JIT op compiles with other include paths:
    # a cache of its own keeps it from rebuilding (3 minutes on 2 cores) the op every later suite loads
    env["TORCH_EXTENSIONS_DIR"] = str(Path(sys.prefix) / "torch_extensions_readme")
    return env


@full_only(
    "the blocks checked statically above (make -n, bash -n, the examples they name); running them all takes "
    "10-20 minutes on 2 cores"
)
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("doc", RUNNABLE_FILES)
def test_every_block_runs_as_written(doc, tmp_path):
    cwd = _scratch(tmp_path)
    setup = SETUP
    ran = 0
    for b in FILES[doc]:
        if not b.runnable:
            continue
        script = _runnable_bash(b)
        env = _env()
        env["MASTER_PORT"] = str(free_port())  # launch/multinode.sh's rendezvous (plain torchrun finds a free one)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                ["bash", "-c", f"set -eo pipefail\n{setup}{script}"],
                cwd=cwd,
                env=env,
                capture_output=True,
                text=True,
                timeout=BLOCK_TIMEOUT,
            )
        except subprocess.TimeoutExpired as err:
            pytest.fail(f"{b.where()} ran past {BLOCK_TIMEOUT}s:\n{script}\n{(err.stdout or '')[-3000:]}")
        out = proc.stdout + proc.stderr
        if proc.returncode != 0:
            pytest.fail(
                f"{b.where()} failed with exit status {proc.returncode}:\n{script}\n--- output:\n"
                f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
            )
        for needle, claim in CLAIMS.items():
            if any(re.search(re.escape(needle) + r"\b", c) for c in _commands(b)):
                assert claim in out, f"{b.where()}: the page says `{needle}` gives {claim!r}; output:\n{out[-4000:]}"
        print(f"{b.where()}: ran in {time.perf_counter() - t0:.0f}s")
        if _is_setup(b) and script not in setup:
            setup += script
        ran += 1
    assert ran, f"{doc}: no runnable block"
