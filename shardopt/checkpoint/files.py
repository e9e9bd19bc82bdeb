"""The on-disk form: safetensors files, written atomically, read without unpickling anything.

A checkpoint is a main file ``shardopt_state.safetensors`` plus, when several ranks wrote it, part files
beside it (``shardopt_state.<save id>.r<rank>.<n>.safetensors``). Every tensor stored is one *piece* of a
logical tensor ``"<param name>::<key>"``: a ``FlatPiece`` (a row-major element range) or a ``ColPiece`` (a
column block) of the logical tensor's 2-D view, exactly as a rank holds it, so no rank ever assembles the
whole state. The main file's metadata holds the JSON of ``{format, kinds, optimizer, param_groups,
world_size, engine, extra, keys, index}``; ``index`` maps each logical key to its shape, 2-D view and pieces
``[file, tensor name, "flat" | "cols", a, b]`` (file ``""`` is the main file). Readers fetch only the slices
that overlap what they need (``StateReader``); files of format v1 (whole tensors, no index) still load.

Every file carries the CRC-32 of each tensor's bytes (metadata ``shardopt_crc32``; safetensors has no checksum of
its own), verified before anything loads: flipped bytes are refused naming the file and tensor, not loaded as
silent garbage. ``SHARDOPT_CHECKPOINT_VERIFY=0`` skips the check (files without checksums load unchecked).
"""

from __future__ import annotations

import json
import math
import os
import struct
import tempfile
import zlib
from contextlib import ExitStack
from typing import Any, Iterable

import torch

from ..sharding.layout import ColFlatPiece, ColPiece, FlatPiece, Piece, RectPiece, _blocks_of
from .errors import CheckpointError

__all__ = [
    "STATE_FILE",
    "FORMAT",
    "write_state_file",
    "write_part",
    "read_state_file",
    "read_metadata",
    "StateReader",
    "piece_spec",
    "whole_index",
    "CRC_KEY",
    "verify_file",
    "verify_enabled",
]

STATE_FILE = "shardopt_state.safetensors"
FORMAT = "shardopt-logical-v2"
_OLD_FORMATS = ("shardopt-logical-v1",)
#: the safetensors metadata key holding ``{tensor name: CRC-32 of its bytes}`` (JSON)
CRC_KEY = "shardopt_crc32"
_CHUNK = 64 << 20


def verify_enabled() -> bool:
    """Whether loads verify checksums: yes unless ``SHARDOPT_CHECKPOINT_VERIFY`` is ``0``/``false``/``no``/``off``."""
    return os.environ.get("SHARDOPT_CHECKPOINT_VERIFY", "1").strip().lower() not in ("0", "false", "no", "off")


def _crc(t: torch.Tensor) -> int:
    """CRC-32 of a contiguous CPU tensor's bytes, as safetensors stores them (little-endian, row-major)."""
    if t.numel() == 0:
        return 0
    return zlib.crc32(t.reshape(-1).view(torch.uint8).numpy().data)


def piece_spec(piece: FlatPiece | ColPiece | RectPiece | ColFlatPiece) -> list:
    """How a piece is written in a checkpoint's index: ``["flat", lo, hi]``, ``["cols", c0, c1]``,
    ``["rect", r0, r1, c0, c1]`` (a block of a tensor-parallel shard) or ``["colflat", c0, c1, lo, hi]`` (a flat
    partition of a tensor-parallel column shard)."""
    if isinstance(piece, RectPiece):
        return ["rect", piece.r0, piece.r1, piece.c0, piece.c1]
    if isinstance(piece, ColFlatPiece):
        return ["colflat", piece.c0, piece.c1, piece.lo, piece.hi]
    return ["flat", piece.lo, piece.hi] if isinstance(piece, FlatPiece) else ["cols", piece.c0, piece.c1]


def _piece(kind: str, *bounds: int) -> FlatPiece | ColPiece | RectPiece | ColFlatPiece:
    if kind == "rect":
        return RectPiece(*bounds)
    if kind == "colflat":
        return ColFlatPiece(*bounds)
    return FlatPiece(*bounds) if kind == "flat" else ColPiece(*bounds)


def _natural_view(shape: tuple[int, ...]) -> list[int]:
    """A tensor's 2-D view as parameters and small state use it: rows x the rest (vectors: one row)."""
    return [shape[0], math.prod(shape[1:])] if len(shape) >= 2 else [1, math.prod(shape)]


def whole_index(tensors: dict[str, torch.Tensor], file: str = "") -> dict[str, Any]:
    """Index entries for whole tensors stored under their own names (one piece each)."""
    return {
        k: {"shape": list(v.shape), "view": _natural_view(tuple(v.shape)), "pieces": [[file, k, "flat", 0, v.numel()]]}
        for k, v in tensors.items()
    }


def write_part(path: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any] | None = None) -> None:
    """Write atomically: a temporary file in the same directory, fsync, then rename over ``path``. A crash
    mid-save leaves the previous file (if any) intact. Files get the user's umask, as ``torch.save``'s do, and
    each tensor's CRC-32 in the metadata (``CRC_KEY``)."""
    from safetensors.torch import save_file

    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=directory)
    os.close(fd)
    try:
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        metadata = {CRC_KEY: json.dumps({k: _crc(v) for k, v in tensors.items()})}
        if meta is not None:
            metadata["shardopt"] = json.dumps(meta)
        save_file(tensors, tmp, metadata=metadata)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_state_file(path: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """One self-contained file of whole logical tensors (single process, conversions)."""
    flat = {k: v.reshape(-1) for k, v in tensors.items()}
    meta = {k: v for k, v in meta.items() if k not in ("format", "index", "flat_stored")}
    write_part(path, flat, {"format": FORMAT, **meta, "index": whole_index(tensors)})


def _data_end(path: str) -> tuple[int, dict]:
    """(bytes the header says the file holds, header) of a safetensors file: the cheap truncation check."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError("no header")
        (n,) = struct.unpack("<Q", raw)
        header = json.loads(f.read(n))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    return 8 + n + end, header


def verify_file(path: str, names: Iterable[str] | None = None) -> None:
    """Check the CRC-32 of tensors ``names`` (all when None) of a safetensors file against its metadata; a
    mismatch raises ``CheckpointError`` naming the file and tensor. Files written without checksums pass."""
    try:
        end, header = _data_end(path)
        sums = json.loads((header.get("__metadata__") or {}).get(CRC_KEY) or "null")
    except Exception as err:
        raise CheckpointError(f"{path}: corrupt or truncated shardopt state file ({err})") from None
    if sums is None:
        return
    if os.path.getsize(path) < end:
        raise CheckpointError(
            f"{path}: corrupt or truncated shardopt state file ({os.path.getsize(path)} of {end} bytes)"
        )
    wanted = sorted(sums if names is None else names)
    base = end - max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    with open(path, "rb") as f:
        for name in wanted:
            if name not in header or name not in sums:
                what = "entry" if name not in header else "checksum"
                raise CheckpointError(
                    f"{path}: tensor {name!r} has no {what} in the file; the file is damaged or "
                    "not the one the checkpoint names"
                )
            a, b = header[name]["data_offsets"]
            f.seek(base + a)
            crc, left = 0, b - a
            while left > 0:  # in chunks: one tensor may be larger than the memory to spare
                chunk = f.read(min(left, _CHUNK))
                if not chunk:
                    break
                crc, left = zlib.crc32(chunk, crc), left - len(chunk)
            if crc != sums[name]:
                raise CheckpointError(
                    f"{path}: checksum mismatch in tensor {name!r} (bytes {base + a}-{base + b} of "
                    "the file changed after it was written: a damaged disk or copy); restore the "
                    "file or load an earlier checkpoint"
                )


def _interrupted(path: str) -> str:
    """Why there is no main file at ``path``: a save there was interrupted (its part or ``.tmp-*`` files are
    there), or nothing was saved."""
    directory = os.path.dirname(os.path.abspath(path))
    stem = os.path.basename(path)[: -len(".safetensors")]
    try:
        names = os.listdir(directory)
    except OSError:
        names = []
    left = sorted(n for n in names if n.startswith(".tmp-") or (n.startswith(stem + ".") and ".r" in n))
    if not left:
        return f"{path}: no shardopt state file here (expected {STATE_FILE})"
    parent = os.path.dirname(directory)
    done = (
        [
            os.path.join(parent, n)
            for n in os.listdir(parent)
            if os.path.isfile(os.path.join(parent, n, os.path.basename(path)))
        ]
        if os.path.isdir(parent)
        else []
    )
    last = max(done, key=lambda d: os.path.getmtime(os.path.join(d, os.path.basename(path))), default=None)
    return (
        f"{path}: incomplete checkpoint, the save was interrupted before its main file was written (found "
        f"{', '.join(left[:3])}{', ...' if len(left) > 3 else ''}); "
        + (f"the last complete checkpoint beside it is {last}" if last else "load the checkpoint saved before it")
    )


def read_metadata(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise CheckpointError(_interrupted(path))
    try:
        _, header = _data_end(path)
        raw = (header.get("__metadata__") or {}).get("shardopt")
    except Exception as err:
        raise CheckpointError(f"{path}: corrupt or truncated shardopt state file ({err})") from None
    if raw is None:
        raise CheckpointError(f"{path}: not a shardopt state file (no 'shardopt' metadata)")
    meta = json.loads(raw)
    if meta.get("format") in _OLD_FORMATS:  # whole tensors under their own names
        meta["index"] = {
            k: {
                "shape": v["shape"],
                "view": [1, math.prod(v["shape"])],
                "pieces": [["", k, "flat", 0, math.prod(v["shape"])]],
            }
            for k, v in header.items()
            if k != "__metadata__"
        }
        meta["flat_stored"] = False
    elif meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: unsupported format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


class StateReader:
    """Reads regions of logical tensors from a checkpoint's files, touching only the overlapping slices."""

    def __init__(self, path: str, meta: dict[str, Any] | None = None, verify: bool | None = None):
        self.path = path
        self.verify = verify_enabled() if verify is None else verify  # checksums checked by ``check_files``
        self.meta = meta if meta is not None else read_metadata(path)
        self.index: dict[str, dict] = self.meta["index"]
        self._stack = ExitStack()
        self._handles: dict[str, Any] = {}
        self._flat = self.meta.get("flat_stored", True)

    def __enter__(self) -> "StateReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def _file(self, name: str) -> str:
        return self.path if not name else os.path.join(os.path.dirname(os.path.abspath(self.path)), name)

    def check_files(self, keys: Iterable[str]) -> None:
        """Every file and stored tensor that ``keys`` need exists and is complete (before anything loads)."""
        need: dict[str, set[str]] = {}
        for k in keys:
            for file, tname, *_ in self.index[k]["pieces"]:
                need.setdefault(file, set()).add(tname)
        for file, names in need.items():
            path = self._file(file)
            if not os.path.isfile(path):
                raise CheckpointError(f"{self.path}: incomplete, part file {file!r} is missing")
            try:
                end, header = _data_end(path)
            except Exception as err:
                raise CheckpointError(f"{path}: corrupt or truncated shardopt state file ({err})") from None
            if os.path.getsize(path) < end:
                raise CheckpointError(
                    f"{path}: corrupt or truncated shardopt state file ({os.path.getsize(path)} of {end} bytes)"
                )
            missing = sorted(names - set(header))
            if missing:
                raise CheckpointError(f"{path}: incomplete, tensor {missing[0]!r} is missing")
            if self.verify:
                verify_file(path, names)

    def _slice(self, file: str, tname: str) -> Any:
        from safetensors import safe_open

        if file not in self._handles:
            try:
                self._handles[file] = self._stack.enter_context(safe_open(self._file(file), framework="pt"))
            except Exception as err:
                raise CheckpointError(f"{self._file(file)}: corrupt or truncated shardopt state file ({err})") from None
        return self._handles[file].get_slice(tname)

    def fill(self, key: str, target: Piece, out: torch.Tensor) -> None:
        """Write ``target``'s elements of logical tensor ``key`` (on its 2-D view) into the 1-D ``out``."""
        entry = self.index[key]
        m, n = entry["view"]
        want = _blocks_of(target, m, n)
        for file, tname, kind, *bounds in entry["pieces"]:
            saved = _piece(kind, *bounds)
            if (
                isinstance(saved, FlatPiece)
                and isinstance(target, FlatPiece)
                and (saved.hi <= target.lo or saved.lo >= target.hi)
            ):
                continue
            sl = None
            for bs in _blocks_of(saved, m, n):
                for bt in want:
                    i0, i1 = max(bs.row, bt.row), min(bs.row + bs.height, bt.row + bt.height)
                    j0, j1 = max(bs.col, bt.col), min(bs.col + bs.width, bt.col + bt.width)
                    if i0 >= i1 or j0 >= j1:
                        continue
                    sl = sl if sl is not None else self._slice(file, tname)
                    start = bs.offset + (i0 - bs.row) * bs.width
                    stop = bs.offset + (i1 - bs.row) * bs.width
                    chunk = sl[start:stop] if self._flat else sl[:].reshape(-1)[start:stop]
                    chunk = chunk.view(i1 - i0, bs.width)[:, j0 - bs.col : j1 - bs.col]
                    dst = out[bt.offset : bt.offset + bt.height * bt.width].view(bt.height, bt.width)
                    dst[i0 - bt.row : i1 - bt.row, j0 - bt.col : j1 - bt.col].copy_(chunk)

    def whole(self, key: str) -> torch.Tensor:
        """The whole logical tensor ``key`` (fp32), assembled from its pieces."""
        entry = self.index[key]
        m, n = entry["view"]
        out = torch.zeros(m * n, dtype=torch.float32)
        self.fill(key, FlatPiece(0, m * n), out)
        return out.view(entry["shape"])


def read_state_file(path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Whole tensors and metadata (offline tools: inspect, convert); a truncated or corrupt file, or a
    missing part, raises ``CheckpointError``."""
    meta = read_metadata(path)
    missing = [k for k in meta.get("keys", []) if k not in meta["index"]]
    if missing:
        raise CheckpointError(f"{path}: incomplete, {len(missing)} tensors missing (e.g. {missing[0]!r})")
    with StateReader(path, meta) as reader:
        reader.check_files(meta["index"])
        try:
            tensors = {k: reader.whole(k) for k in meta["index"]}
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(f"{path}: corrupt or truncated shardopt state file ({err})") from None
    return tensors, meta
