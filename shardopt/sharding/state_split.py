"""Where whole-matrix optimizers' small state rests between steps: each rank keeps only its share.

A matrix's small state (a basis with one row per row of ``A``, ``r x cols`` moments, ``k x k`` statistics)
is declared by its optimizer as ``{key: (logical shape, split dim)}``; a ``Placement`` says how the split
dimension is cut over the ranks of the matrix's process group:

* distributed strategy: evenly (``torch.chunk``, DTensor's ``Shard``), whatever rows of ``A`` a rank
  computes on. Every rank gathers the whole state for the step anyway, so an even cut costs nothing and keeps
  ranks balanced where engines hand out contiguous ranges of the model (ZeRO-1/2: a rank holding attention
  matrices would otherwise keep more state per parameter than one holding MLP matrices);
* gather strategy: whole on the owner, nothing elsewhere;
* a team (``MatrixOps`` kind ``"team"``): evenly over the team's members, nothing elsewhere; the step gathers
  it among the members only (their own process group, ``teams.team_group``);
* not sharded (single process, DDP): the whole tensor.

0-d entries (counters, limiter norms) are kept on every rank (``split dim`` None). For a step,
``gather_full`` assembles the whole tensors of one bucket of distributed matrices on every rank of their
group (one ``all_gather`` per process group), the algorithm runs on them unchanged, and ``keep_share`` cuts
this rank's share back out, so the transient is one bucket, never the model.

State with one row per row of ``A`` that a step reads only at those rows (SUMO's basis ``Q``, Alice's ``U``)
declares its split dimension as ``ROWS``: under the distributed strategy and on a team it rests cut like the
rows each rank computes on (the row plan's ``starts``) and is never gathered for a step; the algorithm
reads it in place, and a refresh that needs more than a rank's rows reduces or assembles what it needs then
(issue 27: no per-step traffic for resting state a step does not need). Where the row plan is even (FSDP2,
teams) that cut is the even one, so checkpoints and memory plans see the same shares.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence, cast

import torch

from . import staging
from .blocks import RowPlan
from .comm import collective_counter

__all__ = [
    "StateSpec",
    "Placement",
    "ROWS",
    "rows_aligned",
    "share",
    "share_shape",
    "share_numel",
    "moving_numel",
    "gather_full",
    "keep_share",
    "StateShapeError",
    "shares_to_dtensors",
    "dtensors_to_shares",
]

#: ``{key: (logical shape, split dim or None)}`` of one matrix's small state
StateSpec = dict[str, tuple[tuple[int, ...], "int | None"]]


class _RowsDim(int):
    """Split dimension 0, cut like the rows of ``A`` the ranks compute on (an ``int`` equal to 0 everywhere
    else: shapes, ``narrow``, indexing)."""

    def __new__(cls) -> "_RowsDim":
        return super().__new__(cls, 0)

    def __repr__(self) -> str:
        return "ROWS"

    def __reduce__(self):
        return (_RowsDim, ())


#: the split dimension of state with one row per row of ``A`` that rests with those rows (module docstring)
ROWS = _RowsDim()


def rows_aligned(dim: "int | None") -> bool:
    """Whether a state spec's split dimension is ``ROWS``."""
    return isinstance(dim, _RowsDim)


class StateShapeError(RuntimeError):
    """A state tensor does not have the shape this rank's share should have (a per-rank state dict loaded at
    another world size, engine or strategy)."""


@dataclass(frozen=True)
class Placement:
    """How one matrix's small state is cut over its process group: whole on ``owner`` (gather strategy) or,
    with ``owner`` None, evenly over the ``world`` ranks (distributed; a group of one holds it whole).
    ``rank`` is this process's index in ``group``."""

    world: int
    rank: int
    owner: int | None = None
    group: Any = None
    #: a team: the group ranks (ascending) over which the state is cut evenly; the others keep none of it
    members: tuple[int, ...] | None = None
    #: where the rows are split (distributed, team): the rows of ``A`` each group rank computes on
    #: (``RowPlan.starts``), which cut ``ROWS`` state
    row_starts: tuple[int, ...] | None = None

    @classmethod
    def of(cls, plan: RowPlan, owner: int | None, members: tuple[int, ...] | None = None) -> "Placement":
        lay = plan.layout
        if lay.group is None:
            return cls(lay.world, lay.rank, None, None)
        if members is not None:
            return cls(lay.world, lay.rank, None, lay.group, tuple(members), tuple(plan.starts))
        if owner is not None and owner >= 0:
            return cls(lay.world, lay.rank, owner, lay.group)
        return cls(lay.world, lay.rank, None, lay.group, None, tuple(plan.starts))


def share(place: Placement, length: int, rank: int | None = None, dim: "int | None" = None) -> tuple[int, int]:
    """``[lo, hi)`` of a dimension of ``length`` that ``rank`` (default: this rank) keeps; ``dim`` is the
    spec's split dimension (``ROWS`` state follows the row plan where the rows are split)."""
    r = place.rank if rank is None else rank
    if place.owner is not None:
        return (0, length) if r == place.owner else (0, 0)
    if rows_aligned(dim) and place.row_starts is not None and place.row_starts[-1] == length:
        return place.row_starts[r], place.row_starts[r + 1]
    if place.members is not None:
        return _even(length, len(place.members), place.members.index(r)) if r in place.members else (0, 0)
    return _even(length, place.world, r)


def share_shape(plan: Placement, shape: tuple[int, ...], dim: int | None, rank: int | None = None) -> tuple[int, ...]:
    """Shape of ``rank``'s share of a state tensor of logical ``shape`` split along ``dim``."""
    if dim is None:
        return tuple(shape)
    lo, hi = share(plan, shape[dim], rank, dim)
    return tuple(hi - lo if d == dim else s for d, s in enumerate(shape))


def share_numel(plan: Placement, spec: StateSpec, rank: int | None = None) -> int:
    """Elements of one matrix's small state that ``rank`` keeps."""
    return sum(math.prod(share_shape(plan, shape, dim, rank)) for shape, dim in spec.values())


def moving_numel(plan: Placement, spec: StateSpec, rank: int | None = None) -> int:
    """Elements of ``rank``'s share that a step of a distributed or team matrix gathers: the split entries but
    ``ROWS`` ones, which stay with their rows."""
    return sum(
        math.prod(share_shape(plan, shape, dim, rank))
        for shape, dim in spec.values()
        if dim is not None and not rows_aligned(dim)
    )


def keep_share(plan: Placement, full: torch.Tensor, dim: int | None) -> torch.Tensor:
    """This rank's share of a whole state tensor (the tensor itself when the share is all of it)."""
    if dim is None:
        return full
    lo, hi = share(plan, full.shape[dim], None, dim)
    if lo == 0 and hi == full.shape[dim]:
        return full
    return full.narrow(dim, lo, hi - lo).clone()


def _by_group(entries: Sequence[tuple], by_team: bool = False) -> list[list[int]]:
    """Entry indices by process group (one collective each): in first-seen order, and with ``by_team`` each
    team's entries apart, after the others, in the order of their member sets (a rank in several teams meets
    them in the same order as every other member)."""
    by: dict[tuple, list[int]] = {}
    for e, (place, *_rest) in enumerate(entries):
        team = place.members if by_team else None
        by.setdefault((id(place.group), team), []).append(e)
    keys = [k for k in by if k[1] is None] + sorted((k for k in by if k[1] is not None), key=lambda k: k[1])
    return [by[k] for k in keys]


def gather_full(entries: Sequence[tuple[Placement, torch.Tensor, tuple[int, ...], int, str]]) -> list[torch.Tensor]:
    """Whole tensors from every rank's share: ``entries[e] = (plan, local share, logical shape, dim, name)``.

    One ``all_gather`` per process group for all entries (shares padded to the largest rank's total); a team's
    entries gather among its members, on the team's own group (every member passes them, the other ranks
    none). Every rank of a group must pass the same entries in the same order; a share of the wrong shape
    raises ``StateShapeError`` naming the matrix before any collective runs."""
    from .teams import team_group

    for plan, local, shape, dim, name in entries:
        want = share_shape(plan, shape, dim)
        if tuple(local.shape) != want:
            raise StateShapeError(
                f"optimizer state of {name!r} has shape {tuple(local.shape)} on this rank, but its share of the "
                f"{tuple(shape)} state is {want}: per-rank state dicts of whole-matrix optimizers load only at the "
                "same world size, engine and matrix_ops strategy; reshard with torch.distributed.checkpoint "
                "(get_state_dict / set_state_dict) or shardopt.checkpoint.save / load"
            )
    out: list[torch.Tensor | None] = [None] * len(entries)
    for idx in _by_group(entries, by_team=True):
        plan0 = entries[idx[0]][0]
        ranks = list(plan0.members) if plan0.members is not None else list(range(plan0.world))
        world = len(ranks)
        sizes = [[math.prod(share_shape(entries[e][0], entries[e][2], entries[e][3], r)) for e in idx] for r in ranks]
        width = max(sum(s) for s in sizes)
        local = entries[idx[0]][1]
        send = torch.zeros(width, dtype=local.dtype, device=local.device)
        pos = 0
        for e in idx:
            t = entries[e][1].reshape(-1)
            send[pos : pos + t.numel()] = t
            pos += t.numel()
        recv = [torch.empty_like(send) for _ in range(world)]
        collective_counter.record(send, "state")
        group = plan0.group if plan0.members is None else team_group(plan0.group, plan0.members)
        staging.all_gather(recv, send, group)
        offsets = [0] * world
        for k, e in enumerate(idx):
            plan, _, shape, dim, _ = entries[e]
            full = torch.empty(shape, dtype=local.dtype, device=local.device)
            for j, r in enumerate(ranks):
                part_shape = share_shape(plan, shape, dim, r)
                numel = sizes[j][k]
                if numel:
                    lo, hi = share(plan, shape[dim], r, dim)
                    full.narrow(dim, lo, hi - lo).copy_(recv[j][offsets[j] : offsets[j] + numel].view(part_shape))
                offsets[j] += numel
            out[e] = full
    return cast("list[torch.Tensor]", out)  # every entry was filled above


def _even(length: int, world: int, rank: int) -> tuple[int, int]:
    """``torch.chunk`` / DTensor ``Shard`` span of ``rank`` in a dimension of ``length``."""
    c = -(-length // world) if length else 0
    return min(rank * c, length), min((rank + 1) * c, length)


def _redistribute(
    entries: Sequence[tuple[Placement, torch.Tensor, tuple[int, ...], int]], to_even: bool
) -> list[torch.Tensor]:
    """Move each entry's split dimension between the plan's shares and even (``torch.chunk``) chunks: one
    ``all_to_all_single`` per process group for all entries. ``entries[e] = (plan, local, logical shape, dim)``."""
    out: list[torch.Tensor | None] = [None] * len(entries)
    for idx in _by_group(entries):
        plan0 = entries[idx[0]][0]
        world, me = plan0.world, plan0.rank

        def src(plan, length, q, dim, world=world):
            return share(plan, length, q, dim) if to_even else _even(length, world, q)

        def dst(plan, length, q, dim, world=world):
            return _even(length, world, q) if to_even else share(plan, length, q, dim)

        sends: list[list[torch.Tensor]] = [[] for _ in range(world)]
        recv_sizes = [0] * world
        results, spans = [], []
        for e in idx:
            plan, local, shape, dim = entries[e]
            length = shape[dim]
            lo, hi = src(plan, length, me, dim)
            mine = dst(plan, length, me, dim)
            result = torch.empty(
                tuple(mine[1] - mine[0] if d == dim else n for d, n in enumerate(shape)),
                dtype=local.dtype,
                device=local.device,
            )
            results.append(result)
            inner = math.prod(shape) // length if length else 0
            for q in range(world):
                a, b = max(lo, dst(plan, length, q, dim)[0]), min(hi, dst(plan, length, q, dim)[1])
                if b > a:
                    sends[q].append(local.narrow(dim, a - lo, b - a).contiguous().reshape(-1))
                qa, qb = src(plan, length, q, dim)
                a, b = max(qa, mine[0]), min(qb, mine[1])
                recv_sizes[q] += max(b - a, 0) * inner
            spans.append((lo, hi, mine, length))
        like = entries[idx[0]][1]
        flat = [torch.cat(parts) if parts else like.new_empty(0) for parts in sends]
        send = torch.cat(flat)
        recv = torch.empty(sum(recv_sizes), dtype=send.dtype, device=send.device)
        collective_counter.record(send, "state")
        if all(
            src(entries[e][0], entries[e][2][entries[e][3]], q, entries[e][3])
            == dst(entries[e][0], entries[e][2][entries[e][3]], q, entries[e][3])
            for e in idx
            for q in range(world)
        ):
            out_local = [entries[e][1] for e in idx]  # even shares are already DTensor chunks: nothing moves
            for e, t in zip(idx, out_local):
                out[e] = t
            continue
        staging.all_to_all_single(recv, send, recv_sizes, [t.numel() for t in flat], plan0.group)
        pos = [sum(recv_sizes[:q]) for q in range(world)]
        for k, e in enumerate(idx):
            plan, _, shape, dim = entries[e]
            _, _, mine, length = spans[k]
            for q in range(world):
                qa, qb = src(plan, length, q, dim)
                a, b = max(qa, mine[0]), min(qb, mine[1])
                if b > a:
                    part_shape = tuple(b - a if d == dim else n for d, n in enumerate(shape))
                    numel = math.prod(part_shape)
                    results[k].narrow(dim, a - mine[0], b - a).copy_(recv[pos[q] : pos[q] + numel].view(part_shape))
                    pos[q] += numel
            out[e] = results[k]
    return cast("list[torch.Tensor]", out)  # every entry was filled above


def shares_to_dtensors(entries: Sequence[tuple[Placement, torch.Tensor, tuple[int, ...], int, Any, int]]) -> list[Any]:
    """Shares -> DTensors sharded evenly along their split dimension over the mesh dimension of the plan's group
    (replicated over the others, as HSDP replicas hold the same shares), so DCP writes each element once
    and reshards on load. ``entries[e] = (plan, local, logical shape, dim, mesh, mesh dim)``."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    chunks = _redistribute([e[:4] for e in entries], to_even=True)
    out = []
    for (_plan, _, shape, dim, mesh, mesh_dim), chunk in zip(entries, chunks):
        placements = [Shard(dim) if d == mesh_dim else Replicate() for d in range(mesh.ndim)]
        stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
        out.append(DTensor.from_local(chunk, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride))
    return out


def dtensors_to_shares(entries: Sequence[tuple[Placement, torch.Tensor, tuple[int, ...], int]]) -> list[torch.Tensor]:
    """The inverse of ``shares_to_dtensors``: each entry's local even chunk -> this rank's share."""
    return _redistribute(entries, to_even=False)
