"""Teams: a matrix computed by a small group of ranks instead of one owner or all of them (issue 27, item 4).

At scale ranks outnumber matrices (7B at P = 1024 has 224 hidden matrices), so one owner per matrix leaves the
busiest rank with the largest matrix's whole Newton-Schulz (4.4 TFLOP), while spreading every matrix over all
P ranks makes every rank pay every matrix's reduced ``k x k`` matrices. A *team* of ``g`` ranks takes the
middle: the matrix's rows of ``A`` are spread over its members (``RowPlan.team``), every sum over rows is
reduced among the members only (``team_group``: one process group per distinct member set, made by every rank
together before the first step that needs them, ``create_team_groups``), and a factorization shared by the
algorithm runs once, on one member. ``g = 1`` is the gather strategy's owner.

This module chooses the teams from numbers alone (modeled seconds per member, small state per member), the
same on every rank:

* ``pack``: longest first, each matrix to the aligned block of ``g`` consecutive ranks (``[b g, (b + 1) g)``)
  whose busiest member ends least loaded, its factorization on the least-loaded member; aligned blocks keep
  the number of distinct member sets, and so of process groups and of collectives per step, at most one per
  team size on every rank.
* ``choose``: the team size of each matrix for a target step time ``tau`` is the smallest that meets it (the
  least total work); ``tau`` is searched over the candidates' own seconds for the plan with the least
  busiest rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

__all__ = [
    "TeamCost",
    "TeamPlan",
    "pack",
    "choose",
    "team_sizes",
    "team_group",
    "create_team_groups",
    "global_team",
    "RowExchange",
]


@dataclass(frozen=True)
class TeamCost:
    """Modeled seconds of one matrix on a team of ``size``: on a member (``member``) and on the member that also
    runs the shared factorization (``factor``; equal where every member repeats it)."""

    size: int
    member: float
    factor: float


@dataclass
class TeamPlan:
    """Members (group ranks, ascending) and factorization member of each matrix, and the modeled busiest rank."""

    members: dict[int, tuple[int, ...]]
    factor: dict[int, int]
    busiest: float
    load: torch.Tensor


def team_sizes(world: int, smallest: int = 1) -> list[int]:
    """Candidate team sizes: powers of two from ``smallest`` up to ``world``, and ``world`` itself."""
    sizes, g = [], 1
    while g <= world:
        if g >= smallest:
            sizes.append(g)
        g *= 2
    if world >= smallest and world not in sizes:
        sizes.append(world)
    return sizes


def pack(
    order: Sequence[int],
    sizes: dict[int, int],
    costs: dict[int, dict[int, TeamCost]],
    world: int,
    base: torch.Tensor,
    state: dict[int, float],
    sole: dict[int, int | None],
    cap: Any,
) -> TeamPlan | None:
    """Place every matrix of ``order`` (longest first) on a team of ``sizes[i]`` ranks. ``base``: seconds every
    rank already has (float64, ``world``); ``state[i]``: the matrix's small state, split evenly over its
    members; ``sole[i]``: the rank that holds the matrix whole (it stays there, nothing to move), else None;
    ``cap(held, largest, share)``: per rank, whether ``share`` more state fits (tensors of ``world``). None
    when a matrix fits nowhere."""
    load = base.clone()
    held = torch.zeros(world, dtype=torch.float64)
    largest = torch.zeros(world, dtype=torch.float64)
    members: dict[int, tuple[int, ...]] = {}
    factor: dict[int, int] = {}
    for i in order:
        g = sizes[i]
        c = costs[i][g]
        share = state[i] / g
        if g == 1 and sole[i] is not None:
            r = sole[i]
            assert r is not None  # checked above
            if not bool(cap(held[r : r + 1], largest[r : r + 1], share)[0]):
                return None
            members[i], factor[i] = (r,), r
            load[r] += c.factor
            held[r] += share
            largest[r] = max(float(largest[r]), share)
            continue
        nb = world // g
        span = nb * g
        blocks = load[:span].view(nb, g)
        fo = blocks.argmin(1, keepdim=True)  # the least-loaded member runs the factorization
        after = (blocks + c.member).scatter_(1, fo, blocks.gather(1, fo) + c.factor)
        score = after.amax(1)
        fits = cap(held[:span], largest[:span], share).view(nb, g).all(1)
        if not bool(fits.any()):
            return None
        score = torch.where(fits, score, torch.full_like(score, math.inf))
        b = int(score.argmin())
        lo = b * g
        team = tuple(range(lo, lo + g))
        f = lo + int(fo[b, 0])
        members[i], factor[i] = team, f
        load[lo : lo + g] += c.member
        load[f] += c.factor - c.member
        held[lo : lo + g] += share
        largest[lo : lo + g] = torch.clamp(largest[lo : lo + g], min=share)
    return TeamPlan(members, factor, float(load.max()) if world else 0.0, load)


def choose(
    idx: Sequence[int],
    names: Sequence[str],
    costs: dict[int, dict[int, TeamCost]],
    world: int,
    base: torch.Tensor,
    state: dict[int, float],
    sole: dict[int, int | None],
    cap: Any,
) -> TeamPlan | None:
    """The team plan with the least busiest rank over targets ``tau``: each matrix on the smallest team whose
    busiest member meets ``tau`` (or the fastest team where none does), packed by ``pack``. ``tau`` runs over
    the candidates' own seconds by bisection for the smallest target the packing meets (on top of ``base``),
    then its neighbours; about log2(candidates) + 6 packings."""
    if not idx:
        return TeamPlan({}, {}, float(base.max()) if world else 0.0, base.clone())

    def sizes_for(tau: float) -> dict[int, int]:
        out = {}
        for i in idx:
            options = sorted(costs[i].values(), key=lambda c: c.size)
            meets = [c for c in options if c.factor <= tau]
            out[i] = meets[0].size if meets else min(options, key=lambda c: (c.factor, c.size)).size
        return out

    seen: dict[tuple, TeamPlan | None] = {}

    def evaluate(tau: float) -> TeamPlan | None:
        sizes = sizes_for(tau)
        key = tuple(sizes[i] for i in idx)
        if key not in seen:
            # matrices that stay with the rank holding them whole first, then longest first
            order = sorted(
                idx, key=lambda i: (not (sizes[i] == 1 and sole[i] is not None), -costs[i][sizes[i]].factor, names[i])
            )
            seen[key] = pack(order, sizes, costs, world, base, state, sole, cap)
        return seen[key]

    taus = sorted({c.factor for i in idx for c in costs[i].values()})
    floor = float(base.max()) if world else 0.0
    lo, hi = 0, len(taus) - 1
    while lo < hi:  # the smallest target whose packing meets it (above what every rank already has)
        mid = (lo + hi) // 2
        plan = evaluate(taus[mid])
        if plan is not None and plan.busiest <= (taus[mid] + floor) * (1 + 1e-12):
            hi = mid
        else:
            lo = mid + 1
    for j in range(max(lo - 2, 0), min(lo + 3, len(taus))):
        evaluate(taus[j])
    evaluate(taus[-1])
    plans = [p for p in seen.values() if p is not None]
    return min(plans, key=lambda p: p.busiest) if plans else None


# ---------------------------------------------------------------------------------------------- process groups
#: the default process group the team groups were made in, and its team groups by global ranks
_REGISTRY: dict[str, Any] = {"world": None, "groups": {}}


def global_team(parent: Any, members: tuple[int, ...]) -> tuple[int, ...]:
    """A team's members (ranks of ``parent``) as ranks of the default process group."""
    import torch.distributed as dist

    return tuple(dist.get_global_rank(parent, r) for r in members)


def create_team_groups(teams: Sequence[tuple[int, ...]]) -> None:
    """Make the process group of every team any rank needs (``teams``: this rank's, as global ranks; it may be
    empty). Collective over the default group: one ``all_gather_object`` of the teams, then one ``new_group``
    per team of the union, by every rank in the same sorted order (ranks outside a team get
    ``NON_GROUP_MEMBER``). Groups made on first use by their members alone (``use_local_synchronization``)
    would hang: torch names such a group by its ranks and the number of groups the rank already made, which
    differs between members in several teams, and on NCCL with a bound device the others must join the split."""
    import torch.distributed as dist

    world = dist.group.WORLD
    if _REGISTRY["world"] is not world:  # a new default group (tests re-initialize): nothing made is valid
        _REGISTRY["world"], _REGISTRY["groups"] = world, {}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(set(teams)))
    made = _REGISTRY["groups"]
    for team in sorted({tuple(t) for mine in everyone for t in mine}):
        if team not in made:
            made[team] = dist.new_group(list(team))


def team_group(parent: Any, members: tuple[int, ...]) -> Any:
    """The process group of ``members`` (ranks of ``parent``; this rank among them); the parent itself when the
    team is all of it. Made beforehand by ``create_team_groups`` (``ShardedOptimizer.step`` does it)."""
    import torch.distributed as dist

    if len(members) == dist.get_world_size(parent):
        return parent
    team = global_team(parent, members)
    found = _REGISTRY["groups"].get(team) if _REGISTRY["world"] is dist.group.WORLD else None
    if found is None or found == dist.GroupMember.NON_GROUP_MEMBER:
        raise RuntimeError(
            f"no process group for the team of ranks {team}: team groups are made by every rank at "
            "the first ShardedOptimizer.step() after the plans changed (create_team_groups)"
        )
    return found


class RowExchange:
    """One team member's row block of ``k x k`` products and the collectives that complete them
    (``iterative.coupled_iteration_rows``; issue 53): member ``index`` of ``size`` computes rows
    ``[index c, (index + 1) c)`` (``c = ceil(k / size)``), ``gather`` all-gathers every member's blocks (padded to
    ``c`` rows: one collective for all the tensors it is given) and ``sum`` all-reduces per-matrix scalars, both
    on ``group`` and counted under ``tag`` (``comm_stats``). ``steps`` records the iteration's step count (what
    its bytes follow; ``seen_steps``: the most of any in this process, for tests to compare bytes with)."""

    seen_steps = 0

    def __init__(self, group: Any, index: int, size: int, tag: str = "distributed"):
        self.group, self.index, self.size, self.tag = group, index, size, tag
        self.steps = 0

    def bounds(self, k: int) -> tuple[int, int]:
        c = -(-k // self.size)
        lo = min(self.index * c, k)
        return lo, min(lo + c, k)

    def gather(self, blocks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``(B, rows, k)`` blocks of this member -> the whole ``(B, k, k)`` matrices, in one all-gather."""
        import torch.distributed as dist

        from .comm import collective_counter

        k = blocks[0].size(-1)
        c = -(-k // self.size)
        padded = [b if b.size(1) == c else torch.nn.functional.pad(b, (0, 0, 0, c - b.size(1))) for b in blocks]
        buf = torch.cat(padded, 1).contiguous()
        collective_counter.record(buf, self.tag)
        got = [torch.empty_like(buf) for _ in range(self.size)]
        dist.all_gather(got, buf, group=self.group)
        return [torch.cat([g[:, j * c : (j + 1) * c] for g in got], 1)[:, :k] for j in range(len(blocks))]

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        from .comm import collective_counter

        out = x.clone()
        collective_counter.record(out, self.tag)
        dist.all_reduce(out, group=self.group)
        return out
