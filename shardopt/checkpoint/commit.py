"""A checkpoint is complete or invisible: durable files, a completion marker, then the pointer a restart reads.

A save is committed in three steps, so that a rank killed at any point leaves the previous checkpoint the one a
restart picks: every rank writes and ``fsync``s its files; after the ranks agree (a collective), rank 0 writes
the tag's marker ``shardopt_complete.json`` (every file of the tag with its size) and then the pointer
(DeepSpeed's ``latest``, the trainer's), each atomically. A load checks the marker before it reads anything, and
an incomplete checkpoint is refused naming the missing or partial file and the last complete checkpoint beside
it. ``clean`` removes what interrupted saves left (``.tmp-*`` files, part files no main file names).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from typing import Any

from .files import STATE_FILE, read_metadata

__all__ = [
    "MARKER",
    "fsync_dir",
    "write_atomic",
    "write_marker",
    "remove_marker",
    "incomplete",
    "last_complete",
    "leftovers",
    "clean",
]

MARKER = "shardopt_complete.json"
_PART = re.compile(r"^(?P<stem>.+)\.[0-9a-f]{8}\.r\d{5}\.\d+\.safetensors$")


def fsync_dir(directory: str, files: bool = True) -> None:
    """Flush ``directory``'s regular files (``torch.save`` and DeepSpeed never ``fsync``) and its entries to disk."""
    if files:
        for name in sorted(os.listdir(directory)):
            path = os.path.join(directory, name)
            if os.path.isfile(path) and not name.startswith(".tmp-"):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically and durably (a ``.tmp-*`` file, fsync, rename, fsync the directory):
    a crash leaves the old file or the new one, never a truncated one."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
        fsync_dir(directory, files=False)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_marker(tag_dir: str, info: dict[str, Any] | None = None) -> None:
    """Record that ``tag_dir`` is complete: every file in it (``.tmp-*`` left out) and its size. Call on one rank
    after every rank's files are durable."""
    files = {
        name: os.path.getsize(os.path.join(tag_dir, name))
        for name in sorted(os.listdir(tag_dir))
        if name != MARKER and not name.startswith(".tmp-") and os.path.isfile(os.path.join(tag_dir, name))
    }
    write_atomic(os.path.join(tag_dir, MARKER), json.dumps({"files": files, **(info or {})}, indent=1))


def remove_marker(tag_dir: str) -> None:
    """Before a tag is written again: the tag stops being complete until its new marker is written."""
    path = os.path.join(tag_dir, MARKER)
    if os.path.isfile(path):
        os.unlink(path)
        fsync_dir(tag_dir, files=False)


def _read_marker(tag_dir: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(tag_dir, MARKER)) as f:
            marker = json.load(f)
        return marker if isinstance(marker.get("files"), dict) else None
    except (OSError, ValueError):
        return None


def _problem(tag_dir: str, needs_shardopt: bool = True) -> str | None:
    """What makes ``tag_dir`` incomplete (a missing or partial file, no marker), or None."""
    if not os.path.isdir(tag_dir):
        return f"{tag_dir} does not exist"
    marker = _read_marker(tag_dir)
    if marker is None:
        if os.path.isfile(os.path.join(tag_dir, MARKER)):
            return f"its completion marker {os.path.join(tag_dir, MARKER)} is unreadable"
        main = os.path.join(tag_dir, STATE_FILE)
        if os.path.isfile(main):
            try:
                committed = (read_metadata(main).get("extra") or {}).get("commit")
            except Exception as err:  # a damaged main file is named by its reader
                return str(err)
            if not committed:  # written before markers existed, or by `shardopt checkpoint convert`
                return None
            return f"it has no completion marker {MARKER} (the save was interrupted after shardopt's files)"
        if not needs_shardopt:
            return None
        left = sorted(os.listdir(tag_dir))
        return (
            f"it has neither shardopt's {STATE_FILE} nor a completion marker {MARKER} (the save was "
            f"interrupted; files there: {', '.join(left[:6]) or 'none'}{', ...' if len(left) > 6 else ''})"
        )
    for name, size in marker["files"].items():
        path = os.path.join(tag_dir, name)
        if not os.path.isfile(path):
            return f"its file {path} is missing"
        if os.path.getsize(path) != size:
            return f"its file {path} is partial or changed ({os.path.getsize(path)} bytes, {size} when saved)"
    return None


def last_complete(save_dir: str, exclude: str | None = None) -> str | None:
    """The newest tag directory under ``save_dir`` whose marker holds (by saved step, then time), or None."""
    best: tuple | None = None
    for name in os.listdir(save_dir) if os.path.isdir(save_dir) else []:
        tag_dir = os.path.join(save_dir, name)
        if name == exclude or not os.path.isdir(tag_dir):
            continue
        marker = _read_marker(tag_dir)
        if marker is None or _problem(tag_dir) is not None:
            continue
        key = (marker.get("global_steps", -1), os.path.getmtime(os.path.join(tag_dir, MARKER)))
        best = max(best, (key, tag_dir)) if best is not None else (key, tag_dir)
    return best[1] if best is not None else None


def incomplete(save_dir: str, tag: str, needs_shardopt: bool = True) -> str | None:
    """The error for loading tag ``tag`` of ``save_dir`` when it is incomplete (naming the missing or partial
    file and the last complete checkpoint), or None when it is complete. ``needs_shardopt`` False: a tag with
    no shardopt file and no marker (a DeepSpeed checkpoint written without shardopt) counts as complete."""
    tag_dir = os.path.join(save_dir, tag)
    problem = _problem(tag_dir, needs_shardopt)
    if problem is None:
        return None
    last = last_complete(save_dir, exclude=tag)
    hint = (
        f"the last complete checkpoint is {last} (load it with tag={os.path.basename(last)!r})"
        if last
        else "no complete checkpoint was found beside it"
    )
    return f"checkpoint {tag_dir} is incomplete: {problem}; {hint}"


def leftovers(directory: str) -> list[str]:
    """What interrupted saves left in ``directory`` and its tag directories: ``.tmp-*`` files and part files that
    no main file beside them names. Never a file of a complete checkpoint."""
    found: list[str] = []
    dirs = [directory] + sorted(
        os.path.join(directory, n) for n in os.listdir(directory) if os.path.isdir(os.path.join(directory, n))
    )
    for d in dirs:
        names = os.listdir(d)
        found += [os.path.join(d, n) for n in sorted(names) if n.startswith(".tmp-")]
        stems: dict[str, list[str]] = {}
        for n in names:
            if m := _PART.match(n):
                stems.setdefault(m.group("stem"), []).append(n)
        for stem, parts in stems.items():
            main = os.path.join(d, f"{stem}.safetensors")
            try:
                meta = read_metadata(main)
                named = {p[0] for e in meta["index"].values() for p in e["pieces"]}
            except Exception:
                named = set()
            if not os.path.isfile(main) or named:  # a damaged main file: its parts are left for its error to name
                found += [os.path.join(d, n) for n in sorted(parts) if n not in named]
    return found


def clean(directory: str) -> list[str]:
    """Remove ``leftovers(directory)``; returns what was removed. Call on one rank, with no save under way."""
    removed = []
    for path in leftovers(directory):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed
