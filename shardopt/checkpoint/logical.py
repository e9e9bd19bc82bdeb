"""Optimizer state (and the fp32 parameters it steps) with logical, unsharded meaning, kept sharded.

Every rank describes what it holds as *records*: a piece of a logical tensor ``"<name>::<key>"`` on the
tensor's 2-D view. Element-wise state and parameters are the rank's piece of the parameter; per-row/column
statistics, counters and 0-d entries are whole (the same on every rank after ``state_dict``'s reduction);
whole-matrix optimizers' small state is the rank's share (``shardopt.sharding.state_split``). ``save_sharded``
has each rank write its own records (one part file per rank, plus an index in the main file), so no rank
ever holds more than its share plus one part being written; ``import_from`` has each rank read only the
slices that overlap its pieces, at any world size and engine. How an entry relates to its parameter comes
from the optimizer's ``state_kinds``; the layout of each piece comes from the fragments the engine adapters
build, so nothing here knows about DeepSpeed or FSDP.
"""

from __future__ import annotations

import contextlib
import glob
import math
import os
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Protocol

import torch
import torch.distributed as dist

from ..optim.base import ShardedOptimizer
from ..sharding.batched import matrix_name
from ..sharding.comm import Round
from ..sharding.fragment import Fragment
from ..sharding.layout import ColPiece, FlatPiece, MatrixLayout, Piece, put_piece, take_piece
from ..sharding.state_split import share, share_shape
from .errors import CheckpointError
from .files import FORMAT, _natural_view, piece_spec, write_part

__all__ = [
    "export_state",
    "import_state",
    "import_from",
    "save_sharded",
    "local_records",
    "CheckpointError",
    "PARAM_KEY",
    "SEP",
    "PART_BYTES",
    "fill_param_range",
]

PARAM_KEY = "param"  # the fp32 values the optimizer steps (master weights under mixed precision)
SEP = "::"
#: a rank's records are written in part files of at most this many bytes (one tensor may exceed it alone),
#: so the serialization buffer never holds more than one part
PART_BYTES = 256 << 20


@dataclass
class Record:
    """This rank's piece of logical tensor ``key`` (shape ``shape``, 2-D view ``view``) as a 1-D tensor."""

    key: str
    kind: str
    shape: tuple[int, ...]
    view: tuple[int, int]
    piece: Piece
    data: torch.Tensor

    @property
    def ident(self) -> str:
        """Same string on every rank that holds the same piece (replicas write it once)."""
        return f"{self.key}|{piece_spec(self.piece)}"


def fill_param_range(reader: Any, name: str, lo: int, hi: int, out: torch.Tensor) -> bool:
    """Elements ``[lo, hi)`` of parameter ``name``'s row-major flattening into the 1-D ``out``, from its
    ``param`` record, or from the records of its matrices where it is a batched parameter (``name[e]``, one per
    expert: ``sharding.batched``). False when the checkpoint holds neither."""
    key = f"{name}{SEP}{PARAM_KEY}"
    if key in reader.index:
        reader.fill(key, FlatPiece(lo, hi), out)
        return True
    first = f"{matrix_name(name, 0)}{SEP}{PARAM_KEY}"
    if first not in reader.index:
        return False
    size = math.prod(reader.index[first]["shape"])
    pos = lo
    while pos < hi:
        e = pos // size
        stop = min(hi, (e + 1) * size)
        reader.fill(
            f"{matrix_name(name, e)}{SEP}{PARAM_KEY}",
            FlatPiece(pos - e * size, stop - e * size),
            out[pos - lo : stop - lo],
        )
        pos = stop
    return True


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _entries(opt: ShardedOptimizer, p: torch.Tensor, frag: Fragment) -> dict[str, torch.Tensor]:
    """State entries of one fragment: tensor-level ones plus its per-matrix ones."""
    st = opt.state.get(p, {})
    out = opt.tensor_entries(p, st)
    if opt.nests(p):
        out.update(opt.matrix_state(p, frag, st, create=False) or {})
    return out


def _whole(key: str, kind: str, value: torch.Tensor) -> Record:
    # a copy: whole entries are small, and one tensor may be listed under several names (a ZeRO partition's
    # step counter for each of its matrices), which safetensors refuses to store twice
    t = (
        value.detach().float().reshape(-1).cpu().clone()
        if isinstance(value, torch.Tensor)
        else torch.tensor([float(value)])
    )
    return Record(
        key,
        kind,
        tuple(value.shape) if isinstance(value, torch.Tensor) else (),
        (1, t.numel()),
        FlatPiece(0, t.numel()),
        t,
    )


def _matrix_view(shape: tuple[int, ...], dim: int) -> tuple[tuple[int, int], Any]:
    """2-D view of a split state tensor and the piece kind its share is along ``dim``."""
    if dim == 0:
        return (shape[0], math.prod(shape[1:])), FlatPiece
    return (shape[0], shape[1]), ColPiece


def local_records(opt: ShardedOptimizer, include_params: bool = True) -> list[Record]:
    """This rank's pieces of every logical tensor. Collective (per-row/column statistics are completed with
    one bucketed all-reduce and 0-d small state is synced from owners), so every rank calls it."""
    opt.sync_state()
    records: list[Record] = []
    pending: list[tuple[int, torch.Tensor]] = []  # rows/cols vectors completed by the round below
    rnd = Round()
    for p in opt.stepped_tensors():
        for frag in opt.fragments(p):
            lay = frag.layout
            items = dict(_entries(opt, p, frag))
            if include_params:
                items[PARAM_KEY] = p
            for key in sorted(items):
                value, name = items[key], f"{frag.name}{SEP}{key}"
                kind = "elements" if key == PARAM_KEY else opt.state_kinds.get(key)
                if kind is None:
                    raise CheckpointError(
                        f"state entry {key!r} of {frag.name!r} has no declared kind in {type(opt).__name__}.state_kinds"
                    )
                if kind == "elements":
                    if frag.numel:  # kept in its dtype: converted to fp32 part by part when written
                        data = frag.local(value).detach()
                        records.append(Record(name, kind, frag.logical_shape, lay.shape, lay.pieces[lay.rank], data))
                elif kind in ("rows", "cols"):
                    full = value.detach().float().clone()
                    if lay.group is not None:
                        owned = lay.axis_plan(opt.line_axis(frag, kind)).owned  # stored axis (in x out: swapped)
                        full = torch.zeros_like(full)
                        full[owned] = value.detach().float()[owned]
                        rnd.add_full(lay, full)
                    pending.append((len(records), full))
                    records.append(_whole(name, kind, full))
                elif kind == "matrix" and isinstance(value, torch.Tensor) and value.dim():
                    found = opt.matrix_state_share(frag.name)
                    spec = found[1].get(key) if found else None
                    if spec is None or spec[1] is None:
                        records.append(_whole(name, kind, value))
                        continue
                    assert found is not None  # spec came from it
                    plan, shape, dim = found[0], spec[0], spec[1]
                    view, piece_type = _matrix_view(shape, dim)
                    lo, hi = share(plan, shape[dim], None, dim)
                    if hi > lo and value.numel():
                        w = view[1] if dim == 0 else 1
                        piece = FlatPiece(lo * w, hi * w) if piece_type is FlatPiece else ColPiece(lo, hi)
                        records.append(Record(name, kind, tuple(shape), view, piece, value.detach().reshape(-1)))
                else:
                    records.append(_whole(name, kind, value))
    rnd.run()
    for i, full in pending:
        records[i].data = full.reshape(-1).cpu()
    return records


# ---------------------------------------------------------------------------------------------- saving
def _assign(descriptors: list[list[tuple[str, int]]], stem: str, save_id: str) -> list[list[tuple[int, str]]]:
    """Who writes what, where: each piece by the first rank that holds it; each rank's pieces in part files of
    at most ``PART_BYTES`` (rank 0's first part is the main file, ``""``). Returns per-rank ``(record index,
    file)`` lists."""
    seen: set[str] = set()
    plan: list[list[tuple[int, str]]] = []
    for rank, descs in enumerate(descriptors):
        mine, part, used = [], 0, 0
        for i, (ident, nbytes) in enumerate(descs):
            if ident in seen:
                continue
            seen.add(ident)
            if used and used + nbytes > PART_BYTES:
                part, used = part + 1, 0
            used += nbytes
            file = "" if rank == 0 and part == 0 else f"{stem}.{save_id}.r{rank:05d}.{part}.safetensors"
            mine.append((i, file))
        plan.append(mine)
    return plan


def save_sharded(
    path: str,
    opt: ShardedOptimizer,
    meta: dict[str, Any],
    include_params: bool = True,
    extra: list[Record] | None = None,
) -> str:
    """Write ``opt``'s state (and stepped parameters) at ``path`` (the main ``.safetensors`` file), with this
    rank's ``extra`` records (the model's frozen parameters and buffers). Collective; each rank writes only its
    own pieces. Returns ``path`` on every rank."""
    records = local_records(opt, include_params) + list(extra or ())
    rank = dist.get_rank() if _dist() else 0
    world = dist.get_world_size() if _dist() else 1
    descs = [(r.ident, r.data.numel() * 4) for r in records]
    info = [(r.key, r.kind, list(r.shape), list(r.view), piece_spec(r.piece)) for r in records]
    directory = os.path.dirname(os.path.abspath(path))
    stem = os.path.basename(path)[: -len(".safetensors")]
    if _dist():
        gathered_d: list[Any] | None = [None] * world if rank == 0 else None
        gathered_i: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(descs, gathered_d, dst=0)
        dist.gather_object(info, gathered_i, dst=0)
    else:
        gathered_d, gathered_i = [descs], [info]
    todo: list[Any] = [None]
    index: dict[str, Any] = {}
    scatter: list[list[tuple[int, str]]] | None = None
    if rank == 0:
        assert gathered_d is not None and gathered_i is not None  # rank 0 gathered them
        save_id = uuid.uuid4().hex[:8]
        plan = _assign(gathered_d, stem, save_id)
        for r, mine in enumerate(plan):
            for i, file in mine:
                key, kind, shape, view, spec = gathered_i[r][i]
                entry = index.setdefault(key, {"shape": shape, "view": view, "pieces": []})
                entry["pieces"].append([file, f"{key}@{r}", *spec])
        scatter = plan
    if _dist():
        dist.scatter_object_list(todo, scatter, src=0)
    else:
        assert scatter is not None  # a single process is rank 0
        todo = [scatter[0]]
    by_file: dict[str, list[Record]] = {}
    for i, file in todo[0]:
        by_file.setdefault(file, []).append(records[i])

    def part_tensors(file: str) -> dict[str, torch.Tensor]:  # fp32 CPU copies made for one part file at a time
        return {f"{r.key}@{rank}": r.data.detach().float().cpu().contiguous() for r in by_file.get(file, [])}

    try:
        for file in by_file:
            if file:
                write_part(os.path.join(directory, file), part_tensors(file))
        if _dist():
            dist.barrier()
        if rank == 0:
            kinds = {r.key.split(SEP)[1]: r.kind for r in records}
            for part in gathered_i or []:
                for key, kind, *_ in part:
                    kinds[key.split(SEP)[1]] = kind
            write_part(
                path,
                part_tensors(""),
                {"format": FORMAT, **meta, "kinds": kinds, "keys": sorted(index), "index": index, "world_size": world},
            )
            referenced = {p[0] for e in index.values() for p in e["pieces"]}
            # leftovers of earlier saves here (interrupted ones' part and .tmp-* files): every rank's files of
            # this save are in place (the barrier above), so no .tmp-* file here is still being written
            stale = glob.glob(os.path.join(directory, f"{glob.escape(stem)}.*.r*.safetensors"))
            for path_ in stale + glob.glob(os.path.join(directory, ".tmp-*")):
                if os.path.basename(path_) not in referenced:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path_)
    finally:
        if _dist():
            dist.barrier()
    return path


# ---------------------------------------------------------------------------------------------- loading
class Source(Protocol):
    """Where logical tensors come from: a checkpoint's files (``StateReader``) or whole tensors in memory."""

    index: dict[str, dict]

    def fill(self, key: str, target: Piece, out: torch.Tensor) -> None: ...

    def check_files(self, keys: Iterable[str]) -> None: ...


class WholeTensors:
    """Whole logical tensors held in memory as a ``Source``."""

    def __init__(self, full: dict[str, torch.Tensor]):
        self.full = full
        self.index = {k: {"shape": list(v.shape), "view": _natural_view(tuple(v.shape))} for k, v in full.items()}

    def fill(self, key: str, target: Piece, out: torch.Tensor) -> None:
        m, n = self.index[key]["view"]
        take_piece(self.full[key].reshape(m, n), target, out, (m, n))

    def check_files(self, keys: Any) -> None:
        return None


def _target(source: Source, key: str, lay: MatrixLayout, frag_logical: tuple[int, ...]) -> Piece:
    """This rank's piece of an element-wise tensor on the source's 2-D view of it."""
    m, n = source.index[key]["view"]
    if (m, n) == tuple(lay.shape):
        return lay.pieces[lay.rank]
    piece = lay.pieces[lay.rank]
    if isinstance(piece, FlatPiece):  # the same row-major elements on another 2-D view
        return FlatPiece(piece.lo, piece.hi)
    raise CheckpointError(f"{key}: stored as {m}x{n}, cannot cut this rank's column or rectangular block from it")


def import_from(
    opt: ShardedOptimizer, source: Source, kinds: dict[str, str], load_params: bool = True, load_state: bool = True
) -> None:
    """Rebuild this rank's optimizer state (and stepped parameters) from ``source``, reading only this rank's
    pieces. Everything is checked first (entries present, shapes, files complete); a checkpoint that fails
    those checks changes nothing. ``load_state=False`` reads the parameters only and leaves the optimizer's
    state as it is (DeepSpeed's ``load_optimizer_states=False`` and ``load_module_only``)."""
    by_name: dict[str, list[str]] = {}
    for k in source.index:
        by_name.setdefault(k.split(SEP)[0], []).append(k)
    actions: list[tuple] = []
    needed: list[str] = []
    for p in opt.stepped_tensors():
        for frag in opt.fragments(p):
            if frag.name not in by_name:
                raise CheckpointError(
                    f"checkpoint has no entries for parameter {frag.name!r}; it was saved from "
                    "another model or is incomplete"
                )
            for k in by_name[frag.name]:
                stored = k.split(SEP)[1]
                # the kind is recorded under the stored key; the state takes today's name of an old key
                key = opt.state_key_renames.get(stored, stored)
                kind, shape = kinds.get(stored), tuple(source.index[k]["shape"])
                if kind == "elements" and math.prod(shape) != math.prod(frag.logical_shape):
                    raise CheckpointError(
                        f"{k}: checkpoint shape {shape} does not match the parameter's {frag.logical_shape}"
                    )
                if kind not in ("elements", "tensor", "rows", "cols", "scalar", "matrix"):
                    raise CheckpointError(f"{k}: unknown kind {kind!r}")
                if (key == PARAM_KEY and not load_params) or (key != PARAM_KEY and not load_state):
                    continue
                actions.append((p, frag, k, key, kind, shape))
                needed.append(k)
    source.check_files(needed)
    # everything is checked: the old state goes before the new one is read, so a load in place never holds
    # two copies of the state
    if load_state:
        opt.state.clear()
    new_state: dict[torch.Tensor, dict] = {p: {} for p in opt.stepped_tensors()}
    param_reads: list[tuple] = []
    for p, frag, k, key, kind, shape in actions:
        st = new_state[p]
        device = frag.local(p).device
        if key == PARAM_KEY:
            param_reads.append((p, frag, k))
            continue
        if kind == "elements":
            if key not in st:
                st[key] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            if frag.numel:
                buf = torch.empty(frag.numel, dtype=torch.float32)
                source.fill(k, _target(source, k, frag.layout, frag.logical_shape), buf)
                frag.local(st[key]).copy_(buf)
            continue
        target = opt.matrix_state(p, frag, st)
        if kind == "tensor":
            st[key] = _read_whole(source, k)
            continue
        found = opt.matrix_state_share(frag.name) if kind == "matrix" and shape else None
        spec = found[1].get(key) if found else None
        if spec is None or spec[1] is None:
            target[key] = _read_whole(source, k).to(device)
            continue
        assert found is not None  # spec came from it
        plan, want, dim = found[0], spec[0], spec[1]
        if tuple(want) != shape:
            raise CheckpointError(
                f"{k}: checkpoint shape {shape} does not match {tuple(want)} (another rank or "
                "matrix_ops setting changes no shape; another model or hyperparameters do)"
            )
        view, piece_type = _matrix_view(shape, dim)
        lo, hi = share(plan, shape[dim], None, dim)
        local_shape = share_shape(plan, shape, dim)
        buf = torch.zeros(math.prod(local_shape), dtype=torch.float32)
        if hi > lo and tuple(source.index[k]["view"]) != tuple(view) and piece_type is ColPiece:
            # stored on another 2-D view (a file of whole tensors from elsewhere): cut the share from the whole
            # tensor of this one matrix
            buf = _read_whole(source, k).narrow(dim, lo, hi - lo).contiguous().reshape(-1)
        elif hi > lo:
            w = view[1] if dim == 0 else 1
            piece = FlatPiece(lo * w, hi * w) if piece_type is FlatPiece else ColPiece(lo, hi)
            source.fill(k, piece, buf)
        target[key] = buf.view(local_shape).to(device)
    with torch.no_grad():
        for p, frag, k in param_reads:
            if frag.numel:
                buf = torch.empty(frag.numel, dtype=torch.float32)
                source.fill(k, _target(source, k, frag.layout, frag.logical_shape), buf)
                frag.local(p).copy_(buf.to(p.dtype))
    if not load_state:
        return
    opt.state.clear()
    for p, st in new_state.items():
        if st:
            opt.state[p] = st


def _read_whole(source: Source, k: str) -> torch.Tensor:
    entry = source.index[k]
    m, n = entry["view"]
    out = torch.zeros(m * n, dtype=torch.float32)
    source.fill(k, FlatPiece(0, m * n), out)
    return out.view(entry["shape"])


def import_state(
    opt: ShardedOptimizer, full: dict[str, torch.Tensor], kinds: dict[str, str], load_params: bool = True
) -> None:
    """``import_from`` whole logical tensors held in memory (conversions, tests)."""
    import_from(opt, WholeTensors(full), kinds, load_params)


def export_state(opt: ShardedOptimizer, include_params: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Whole logical tensors ``{"<name>::<key>": tensor}`` and ``{key: kind}`` on rank 0 (others get ``{}``).

    Assembles everything on rank 0: for inspection and tests. Checkpoints use ``save_sharded``, which never
    does. Collective when ``torch.distributed`` is initialized."""
    records = local_records(opt, include_params)
    for r in records:
        r.data = r.data.detach().float().cpu()
    if _dist():
        gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(records, gathered, dst=0)
        if dist.get_rank() != 0:
            return {}, {}
        assert gathered is not None  # rank 0 gathered them
        records = [r for part in gathered for r in part]
    index: dict[str, dict] = {}
    for r in records:
        index.setdefault(r.key, {"shape": list(r.shape), "view": list(r.view), "recs": {}})["recs"].setdefault(
            r.ident, r
        )
    full: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    for key, entry in index.items():
        m, n = entry["view"]
        out = torch.zeros(m, n, dtype=torch.float32)
        for rec in entry["recs"].values():
            put_piece(out, rec.piece, rec.data.float().cpu(), (m, n))
            kinds[key.split(SEP)[1]] = rec.kind
        full[key] = out.reshape(entry["shape"])
    return full, kinds
