"""The documentation site (``make docs``) and the README it is linked from.

- The configuration reference is generated from the pydantic models (``docs/hooks/config_reference.py``): every key
  of every registered optimizer's model, of ``matrix_ops`` and of its numeric ``profile`` appears, in the section
  of its optimizer, so a key added to a model cannot be missing from the docs.
- ``mkdocs.yml`` names pages and hooks that exist, the ``docs`` extra installs MkDocs, and ``make test`` builds the
  docs.
- The README stays a short front page: at most 250 lines, no commit hashes, every relative link and image pointing
  at a file of the repository, and its results table is the one ``python -m benchmarks.overview`` makes from the
  committed results.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from shardopt.optim.config import MatrixOpsConfig, ProfileConfig
from shardopt.optim.registry import OPTIMIZERS

ROOT = Path(__file__).resolve().parents[1]


def _hook(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_hook_{name}", ROOT / "docs" / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reference() -> str:
    return _hook("config_reference").render()


def _section(text: str, heading: str) -> str:
    """The text from ``heading`` to the next heading of the same or a higher level."""
    level = heading.split(" ", 1)[0]
    start = text.index(heading + "\n")
    rest = text[start + len(heading) + 1 :]
    m = re.search(rf"^#{{1,{len(level)}}} ", rest, flags=re.M)
    return rest[: m.start()] if m else rest


def _keys(section: str) -> set[str]:
    """The keys of a section's table rows (first cell, a code span, maybe inside a link)."""
    return {m.group(1) for m in re.finditer(r"^\| \[?`([^`]+)`", section, flags=re.M)}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_key_of_every_optimizer_is_in_the_reference(reference: str, name: str) -> None:
    section = _section(reference, f"### `{name}` {{#{name}}}")
    model = OPTIMIZERS[name].Config
    assert _keys(section) == set(model.model_fields), f"{name}: the reference's keys differ from {model.__name__}'s"
    for key, field in model.model_fields.items():
        assert field.description, f"{name}.{key}: no description in {model.__name__} (the reference would show none)"
        assert " ".join(field.description.split()) in section.replace("\\|", "|"), f"{name}.{key}: description"


def test_matrix_ops_and_its_profile_are_expanded(reference: str) -> None:
    ops = _section(reference, "## `matrix_ops` {#matrix_ops}").split("\n### ")[0]  # without the profile's table
    assert _keys(ops) == {f"matrix_ops.{k}" for k in MatrixOpsConfig.model_fields}
    profile = _section(reference, "### `matrix_ops.profile` {#matrix_opsprofile}")
    assert _keys(profile) == {f"matrix_ops.profile.{k}" for k in ProfileConfig.model_fields}
    for name, cls in OPTIMIZERS.items():  # each whole-matrix optimizer's row links to the expansion
        if "matrix_ops" in cls.Config.model_fields:
            assert "[`matrix_ops`](#matrix_ops)" in _section(reference, f"### `{name}` {{#{name}}}"), name


def test_the_deepspeed_section_and_the_trainer_config_are_in_the_reference(reference: str) -> None:
    from shardopt.plugin.deepspeed_engine import ShardoptSection
    from shardopt.train.config import TrainConfig

    keys = _keys(reference)
    assert {f"shardopt.{k}" for k in ShardoptSection.model_fields} <= keys
    assert set(TrainConfig.model_fields) <= keys
    for section, field in TrainConfig.model_fields.items():  # nested sections expanded under their key path
        nested = getattr(field.annotation, "model_fields", None)
        if nested:
            assert {f"{section}.{k}" for k in nested} <= keys, section
            assert all(f.description for f in nested.values()), f"{section}: a key without a description"


def test_the_reference_page_has_the_placeholder_the_hook_fills() -> None:
    hook = _hook("config_reference")
    assert hook.PLACEHOLDER in (ROOT / "docs" / hook.PAGE).read_text()


def test_mkdocs_names_pages_and_hooks_that_exist() -> None:
    text = (ROOT / "mkdocs.yml").read_text()
    for page in re.findall(r"^\s+-\s+(?:[^:\n]+:\s+)?([\w/.-]+\.md)\s*$", text, flags=re.M):
        assert (ROOT / "docs" / page).is_file(), f"mkdocs.yml: nav page {page} is missing"
    for hook in re.findall(r"^\s+-\s+(docs/hooks/\w+\.py)\s*$", text, flags=re.M):
        assert (ROOT / hook).is_file(), f"mkdocs.yml: hook {hook} is missing"
    assert "strict: true" in text


def test_the_docs_extra_and_make_test_build_the_site() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("mkdocs") for d in extras["docs"])
    makefile = (ROOT / "Makefile").read_text()
    assert ",docs]" in makefile, "the set-up recipe installs the docs extra"
    recipe = makefile.split("\ntest: setup\n", 1)[1].split("\n\n", 1)[0]
    assert "$(DOCS) || status=1" in recipe and "mkdocs build --strict" in makefile


def test_the_readme_is_a_short_front_page() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    hashes = re.findall(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", text)
    assert not hashes, f"commit hashes in README.md: {hashes} (run history belongs in the result files)"


def _github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_of_the_readme_exists() -> None:
    """Links and images of the front page (``[text](target)``, ``![alt](target)``) point at files or folders of the
    repository (``#anchors`` stripped; web links not checked); a bare ``#anchor`` names a heading of the README."""
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)
    assert targets, "no links found in README.md"
    headings = {_github_slug(h) for h in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, flags=re.M)}
    missing = []
    for target in targets:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, flags=re.I):  # http(s), mailto: not files
            continue
        path, _, anchor = target.partition("#")
        if not path:
            if anchor not in headings:
                missing.append(f"{target} (no such heading)")
        elif not (ROOT / path).exists():
            missing.append(target)
    assert not missing, f"README.md links to what is not in the repository: {missing}"


def test_the_readme_results_table_is_made_from_the_committed_results() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.overview", "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (ROOT / "benchmarks" / "results" / "overview.png").is_file()
