"""The package's version, read once at import: the installed distribution's metadata (a wheel, ``pip install -e``),
so ``shardopt.__version__`` and ``shardopt --version`` always say what pip installed. A checkout imported without
an install (``PYTHONPATH=.``) has no metadata; it reads the ``version = "..."`` line of the ``pyproject.toml``
beside the package (a line scan: no TOML parser, nothing imported)."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

#: what a copy of the package that is neither installed nor in a checkout reports (PEP 440: a local version of 0)
UNKNOWN = "0+unknown"


#: where a source checkout keeps the version (one directory above the package)
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _from_pyproject(path: Path = PYPROJECT) -> str | None:
    """``version`` of the ``[project]`` table of ``path``; None when the file or the line is missing."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return None
    project = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    found = project and re.search(r'^version\s*=\s*["\']([^"\']+)["\']', project.group(1), re.M)
    return found.group(1) if found else None


def version() -> str:
    """The installed distribution's version, else the checkout's ``pyproject.toml`` version, else ``UNKNOWN``."""
    try:
        return metadata.version("shardopt")
    except metadata.PackageNotFoundError:
        return _from_pyproject() or UNKNOWN


__version__ = version()
