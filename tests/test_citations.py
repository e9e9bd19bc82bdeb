"""Every file a comment, docstring or the README cites must be in the repository.

Issue 18 found 21 citations of ``specs/*.md`` and "card section ..." items: notes kept outside the repository,
so no reader could follow them. The algorithm notes now live in ``docs/algorithms/``; this test keeps every cited
repository path (``docs/...``, ``shardopt/...``, ``tests/...``, ...) pointing at a file that exists.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ["shardopt", "tests", "tests_dist", "benchmarks", "examples", "launch"]
TOP = ("docs", "shardopt", "tests", "tests_dist", "benchmarks", "examples", "launch", "configs", "docker")
# a path under one of the repository's top folders, ending in a file extension; globs and placeholders skipped
CITED = re.compile(
    r"(?<![\w./-])((?:%s)/[\w./-]*\.(?:md|py|json|yaml|yml|sh|toml|txt|safetensors))(?![\w*{<])" % "|".join(TOP)
)
#: paths that tests name on purpose because they do not exist (error-message checks)
MISSING_ON_PURPOSE = {"configs/deepspeed/nope.json"}
GONE = re.compile(r"specs/\w+\.md|card section|spec card")


def _sources() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for top in SCANNED:
        files += sorted(
            p
            for p in (ROOT / top).rglob("*")
            if p.suffix in (".py", ".md", ".sh", ".json", ".yaml") and p.is_file() and "results" not in p.parts
        )
    return [f for f in files if f.name != "test_citations.py"]


def _citations() -> list[tuple[str, int, str]]:
    found = []
    for f in _sources():
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            for m in CITED.finditer(line):
                if m.group(1).rstrip(".") not in MISSING_ON_PURPOSE:
                    found.append((str(f.relative_to(ROOT)), n, m.group(1).rstrip(".")))
    return found


def test_the_scan_sees_the_algorithm_notes():
    cited = {c for _, _, c in _citations()}
    for name in ("scale", "sinkgd", "swan", "racs", "alice", "asgo", "sumo"):
        assert f"docs/algorithms/{name}.md" in cited, name


@pytest.mark.parametrize("where,line,path", _citations(), ids=lambda v: str(v))
def test_cited_path_exists(where, line, path):
    assert (ROOT / path).exists(), f"{where}:{line} cites {path}, which is not in the repository"


def test_no_citation_of_notes_outside_the_repository():
    bad = [
        f"{f.relative_to(ROOT)}:{n}: {line.strip()}"
        for f in _sources()
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1)
        if GONE.search(line)
    ]
    assert not bad, "cite docs/algorithms/<name>.md instead:\n" + "\n".join(bad)


def test_relative_links_of_the_docs_resolve():
    for f in (ROOT / "docs").rglob("*.md"):
        for target in re.findall(r"\]\(([^)#:]+)\)", f.read_text(encoding="utf-8")):
            assert (f.parent / target).exists(), f"{f.relative_to(ROOT)} links to {target}"
