"""Whole-matrix operations on sharded matrices: one step's strategy, row blocks and bucketed reductions.

An algorithm that needs Gram matrices, projections, SVDs or eigendecompositions is written once against
``MatrixOps``: it asks for row blocks of each oriented matrix ``A`` (``to_blocks``), computes partial sums
over its rows and has them reduced (``allreduce``, one collective per process group for all matrices), runs
small factorizations on identical inputs on every rank that takes part, and returns row-block results
(``from_blocks``). Each matrix gets one strategy:

* ``local``: not sharded (single process, DDP replicas); nothing is communicated.
* ``gather``: an owner rank (longest-processing-time, identical on every rank) receives the whole matrix,
  computes alone, and sends every rank its piece of the result; the others skip it.
* ``distributed``: rows stay where the engine put them (only rows cut by a partition boundary move; across
  the grain an all-to-all of ~1/P of the matrix per rank), every rank computes on its rows, and sums over
  rows are all-reduced: small ``k x k`` / ``r x n`` matrices instead of the matrix itself.

``strategy="auto"`` (issue 27) minimizes the busiest rank's modeled step time (``time_model``: FLOPs by kind,
bytes sent or received, collective rounds, turned into seconds by ``matrix_ops.profile``) under a memory
budget: by default a rank keeps at most ``(1 + BUDGET_SLACK)`` x its even share of the group's small state,
plus the whole state of the largest matrix it owns (what any owner-compute scheme must hold), plus
``STATE_SLACK_ELEMENTS``; ``matrix_ops.memory_budget_mib`` replaces that by a fixed number. It starts from
every matrix gathered (owners balanced by modeled seconds), moves to the distributed strategy the matrices
that break the budget, then, while it lowers the modeled step, the costliest matrix of the busiest owner.
``"gather"`` / ``"distributed"`` force one (``distributed`` also keeps every rank's small state within
``STATE_SLACK`` of the even share, as before). A matrix held whole by a single rank of its group is computed
there with no communication under any strategy that gathers it.

Small persistent state (``OpCost.state``) rests split over the ranks by ``shardopt.sharding.state_split``; a
step runs in buckets (``buckets``) whose whole-tensor transients stay below a bound, not the model's size.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import torch

from .blocks import RowPlan, from_blocks, to_blocks
from .comm import collective_counter
from .layout import MatrixLayout
from .owner import owner_plan, sole_holder
from .state_split import Placement
from .time_model import HardwareProfile, StepCost, resolve_profile

__all__ = ["MatrixOps", "OpCost", "Strategy", "FLOPS_PER_BYTE", "STRATEGIES", "STATE_SLACK", "BUDGET_SLACK",
           "BUCKET_ELEMENTS"]

Strategy = Literal["auto", "gather", "distributed"]
STRATEGIES = ("auto", "gather", "distributed")
#: how many FLOPs one byte on the network is worth when owners of forced ``gather`` plans are balanced
FLOPS_PER_BYTE = 100.0
#: under ``distributed`` a rank that holds a matrix whole may keep its state only while its small state stays
#: within this fraction (plus ``STATE_SLACK_ELEMENTS``) of the even share (all small state / P)
STATE_SLACK = 0.10
#: under ``auto`` (default budget) a rank keeps at most (1 + BUDGET_SLACK) x the even share + the largest
#: matrix it owns + ``STATE_SLACK_ELEMENTS`` of small state
BUDGET_SLACK = 0.15
STATE_SLACK_ELEMENTS = 1 << 20
#: bytes of one fp32 element on the wire
_B = 4
#: default bound on a bucket's whole-matrix transients (fp32 elements: 128 MiB)
BUCKET_ELEMENTS = 32 << 20


@dataclass(frozen=True)
class OpCost:
    """Estimated work of one matrix's step on the oriented ``A`` (rows x cols).

    ``row_flops``: FLOPs that split with the rows of ``A`` (products with ``A``); ``small_flops``: FLOPs of
    factorizations of small matrices (on the owner under ``gather``; under ``distributed`` on one rank when
    ``shared``, else on every rank); ``reduced``: fp32 elements all-reduced per step under the distributed
    strategy.
    """

    row_flops: float
    small_flops: float = 0.0
    reduced: float = 0.0
    state: float = 0.0  # fp32 elements of small persistent state (bases, moments, k x k statistics)
    #: elements of the small factorization's result under the distributed strategy when one rank computes it
    #: and shares it (``MatrixOps.compute_once``); 0: every rank repeats the factorization
    shared: float = 0.0
    #: m x n tensors sent to the row blocks (gather or realign) per step; one result tensor comes back
    channels: float = 1.0


class MatrixOps:
    """The whole-matrix plan of one step for ``layouts`` (oriented by ``transposes``), identical on every rank."""

    def __init__(self, layouts: Sequence[MatrixLayout], names: Sequence[str], transposes: Sequence[bool],
                 strategy: str, cost: Callable[[tuple[int, int]], OpCost],
                 profile: HardwareProfile | str | dict | None = None, memory_budget_mib: float | None = None):
        if strategy not in STRATEGIES:
            raise ValueError(f"matrix_ops strategy must be one of {STRATEGIES}, got {strategy!r}")
        self.names = list(names)
        self.strategy = strategy
        self.profile = resolve_profile(profile, _device_type(layouts))
        self.budget_elements = None if memory_budget_mib is None else float(memory_budget_mib) * 2 ** 20 / _B
        self.kinds: list[str] = []
        self.costs: list[OpCost] = []
        self.a_shapes: list[tuple[int, int]] = []
        for lay, t in zip(layouts, transposes):
            a_shape = (lay.shape[1], lay.shape[0]) if t else lay.shape
            self.a_shapes.append(a_shape)
            self.costs.append(cost(a_shape))
            if lay.group is None:
                self.kinds.append("local")
            elif lay.holders <= 1 or strategy in ("gather", "auto"):
                self.kinds.append("gather")
            else:
                self.kinds.append("distributed")
        self._layouts, self._transposes = list(layouts), list(transposes)
        if strategy == "auto":
            self.owners = self._choose_by_time(layouts)
        else:
            self.owners = self._assign_owners(layouts, strategy == "distributed")
        self.factor_owners = self._assign_factor_owners(layouts)
        self.plans: list[RowPlan] = []
        #: where each matrix's small state rests (shardopt.sharding.state_split)
        self.placements: list[Placement] = []
        for i, (lay, t) in enumerate(zip(layouts, transposes)):
            if self.kinds[i] == "gather":
                self.plans.append(RowPlan.owner(lay, t, self.owners[i]))
            else:
                self.plans.append(RowPlan.aligned(lay, t))
            self.placements.append(Placement.of(self.plans[-1], self.owners[i] if self.kinds[i] == "gather" else None))
        self._mark_whole_here()

    def _mark_whole_here(self) -> None:
        """``here[i]``: this rank holds matrix ``i`` whole and no other rank holds any of it (``local``, or a
        ZeRO partition that contains the whole matrix, which its holder computes as ``gather`` owner), so it
        is computed here with no communication and its pieces are the matrix itself. ``elsewhere[i]``: the
        same holds on another rank, and this rank has nothing of it to do. Both are static and complementary
        across ranks, so the remaining matrices (split between ranks, or ``distributed``) are the same set on
        every rank and their collectives are unchanged when the others are left out of them."""
        self.here, self.elsewhere = [], []
        for kind, plan in zip(self.kinds, self.plans):
            lay = plan.layout
            size = lay.shape[0] * lay.shape[1]
            sole = kind == "gather" and lay.holders == 1 and size > 0
            self.here.append(kind == "local" or (sole and lay.local_numel == size))
            self.elsewhere.append(sole and lay.local_numel == 0)

    @property
    def all_here(self) -> bool:
        """Every matrix is held whole by this rank alone: the algorithms' stacked paths with no row blocks."""
        return all(self.here)

    def here_and_shared(self) -> tuple[list[int], list[int]]:
        """(the matrices this rank computes alone, those it shares with other ranks); the ones another rank
        holds whole are in neither: this rank has none of their elements, state or collectives, and the shared
        ones are the same set on every rank."""
        here = [i for i, h in enumerate(self.here) if h]
        shared = [i for i, (h, e) in enumerate(zip(self.here, self.elsewhere)) if not h and not e]
        return here, shared

    @property
    def positions(self) -> dict[str, int]:
        """Matrix name -> its index in this plan (made once per plan)."""
        found = self.__dict__.get("_positions")
        if found is None:
            found = self._positions = {name: i for i, name in enumerate(self.names)}
        return found

    def _assign_owners(self, layouts: Sequence[MatrixLayout], memory_bound: bool) -> list[int]:
        """Owners of the gathered matrices, balancing FLOPs and small state together (each normalized by its
        total). With ``memory_bound`` (the distributed strategy: matrices one rank holds whole are gathered to
        it), the largest-state gathered matrices switch to the distributed strategy until the busiest owner's
        state is within ``STATE_SLACK`` of the even share."""
        n = len(layouts)
        if memory_bound:  # LPT keeps the busiest owner within one matrix of the mean: no matrix may exceed the slack
            for idx in _by_group(layouts).values():
                world = layouts[idx[0]].world
                limit = STATE_SLACK * sum(self.costs[i].state for i in idx) / world + STATE_SLACK_ELEMENTS
                for i in idx:  # also a matrix one rank holds whole: its state would all rest on that rank
                    if self.kinds[i] == "gather" and self.costs[i].state > limit:
                        self.kinds[i] = "distributed"
        while True:
            gathered = [i for i in range(n) if self.kinds[i] == "gather"]
            owners = owner_plan([layouts[i] for i in gathered], [self.names[i] for i in gathered],
                                _balance_weights([self.costs[i] for i in gathered],
                                                 [layouts[i].shape for i in gathered]))
            result = [-1] * n
            for i, o in zip(gathered, owners):
                result[i] = o
            if not memory_bound:
                return result
            worst = self._worst_owner_overflow(layouts, result)
            if worst is None:
                return result
            self.kinds[worst] = "distributed"

    def _worst_owner_overflow(self, layouts: Sequence[MatrixLayout], owners: list[int]) -> int | None:
        """The largest-state gathered matrix on an owner whose state exceeds its even share, else None."""
        for idx in _by_group(layouts).values():
            world = layouts[idx[0]].world
            bound = (1 + STATE_SLACK) * sum(self.costs[i].state for i in idx) / world + STATE_SLACK_ELEMENTS
            load: dict[int, list[int]] = {}
            for i in idx:
                if self.kinds[i] == "gather":
                    load.setdefault(owners[i], []).append(i)
            for mats in load.values():
                if sum(self.costs[i].state for i in mats) > bound:
                    return max(mats, key=lambda i: (self.costs[i].state, self.names[i]))
        return None

    def _assign_factor_owners(self, layouts: Sequence[MatrixLayout]) -> list[int]:
        """The rank that computes each distributed matrix's small factorization once (``compute_once``; balanced
        by its FLOPs, longest first), the gather owner otherwise; identical on every rank."""
        out = list(self.owners)
        spread = [i for i, k in enumerate(self.kinds) if k == "distributed" and self.costs[i].shared]
        plan = owner_plan([layouts[i] for i in spread], [self.names[i] for i in spread],
                          [self.costs[i].small_flops for i in spread])
        for i, o in zip(spread, plan):
            out[i] = o
        return out

    def compute_once(self, inputs: dict[int, torch.Tensor],
                     fn: Callable[[dict[int, torch.Tensor]], dict[int, torch.Tensor]]) -> dict[int, torch.Tensor]:
        """``fn`` of identical small inputs (reduced Grams, EMA statistics) without repeating it on every rank:
        a distributed matrix's result is computed by its factorization owner alone and shared with one
        all-reduce per process group (the others add exact zeros, so every rank gets the owner's result);
        other matrices (an owner's, local ones) are computed here. ``fn`` maps a dict of inputs to results of
        the inputs' shapes. Every rank issues the same collective, also a rank that owns none."""
        mine = {i: x for i, x in inputs.items()
                if self.kinds[i] != "distributed" or self.factor_owners[i] == self.plans[i].layout.rank}
        out = fn(mine) if mine else {}
        spread = {i: out[i] if i in out else torch.zeros_like(x) for i, x in inputs.items()
                  if self.kinds[i] == "distributed"}
        if spread:
            out.update(self.allreduce(spread))
        return out

    # ------------------------------------------------------------------ the time model (issue 27)
    def op_cost(self, i: int, kind: str | None = None, owner: bool = True, bound: bool = False) -> StepCost:
        """Modeled work of matrix ``i`` on one rank under ``kind`` (default: its strategy): on the owner
        (``owner``) or on another rank under ``gather``; under ``distributed`` on the busiest rank's rows, with
        the factorization where it runs (every rank, or only its factorization owner when ``shared``).
        ``bound``: under ``distributed``, a lower bound without the row plan (an even share of the rows, no row
        moved), which costs O(1) instead of O(P)."""
        kind = kind or self.kinds[i]
        c, lay = self.costs[i], self._layouts[i]
        m, n = lay.shape
        if kind == "local":
            return StepCost(matmul=c.row_flops, factor=c.small_flops)
        if kind == "gather":
            piece = m * n / max(lay.holders, 1)
            if not owner:  # its piece to the owner and the result back
                return StepCost(sent=_B * piece * c.channels, received=_B * piece)
            moved = m * n - piece  # the other holders' pieces in (``channels`` tensors), their results out
            return StepCost(matmul=c.row_flops, factor=c.small_flops, sent=_B * moved,
                            received=_B * moved * c.channels, rounds=2.0 if moved else 0.0)
        world = lay.world
        if bound:
            share, moved = 1.0 / world, 0
        else:
            plan = RowPlan.aligned(lay, self._transposes[i])
            rows = max((b - a for a, b in zip(plan.starts, plan.starts[1:])), default=0)
            share, moved = rows / max(self.a_shapes[i][0], 1), max(plan.sent)
        ring = 2.0 * (world - 1) / world  # a ring all-reduce sends (and receives) 2 (P-1)/P of the buffer
        state = c.state * (world - 1) / world  # the resting state all-gathered for the step
        net = _B * ((c.channels + 1) * moved + ring * (c.reduced + c.shared) + state)
        factor = c.small_flops if not c.shared or owner else 0.0
        return StepCost(matmul=c.row_flops * share, factor=factor, sent=net, received=net, rounds=4.0)

    def seconds(self, i: int, kind: str | None = None, owner: bool = True) -> float:
        return self.op_cost(i, kind, owner).seconds(self.profile)

    def _choose_by_time(self, layouts: Sequence[MatrixLayout]) -> list[int]:
        """``auto``: per process group, start from the split into distributed and gathered matrices with the
        lowest estimated busiest rank (``_distribute_first``), give the gathered ones owners by modeled
        seconds within every rank's memory budget (``_owners_within_budget``; a matrix no rank has room for is
        distributed), then, while it lowers the busiest rank's modeled seconds, move the costliest gathered
        matrix of the busiest owner to ``distributed``. Deterministic from static metadata, so every rank
        plans the same."""
        owners = [-1] * len(layouts)
        for idx in _by_group(layouts).values():
            world = layouts[idx[0]].world
            t_gather = {i: self.seconds(i, "gather") for i in idx}
            t_dist = {i: self._amortized_distributed(i, world, t_gather[i]) for i in idx}
            for i in self._distribute_first(idx, t_gather, t_dist, world):
                self.kinds[i] = "distributed"
            for _ in range(2 * len(idx) + 1):
                placed, homeless = self._owners_within_budget(idx, t_gather)
                if homeless:
                    for i in homeless:
                        self.kinds[i] = "distributed"
                    continue
                load: dict[int, float] = {}
                for i, r in placed.items():
                    load[r] = load.get(r, 0.0) + t_gather[i]
                if not load:
                    break
                busiest = max(load, key=lambda r: (load[r], -r))
                mine = [i for i, r in placed.items() if r == busiest]
                move = max(mine, key=lambda i: (t_gather[i] - t_dist[i], self.names[i]))
                rest = sorted(load.values(), reverse=True)
                after = max(load[busiest] - t_gather[move], rest[1] if len(rest) > 1 else 0.0)
                if t_dist[move] + after >= load[busiest]:
                    break
                self.kinds[move] = "distributed"
            placed, _ = self._owners_within_budget(idx, t_gather)
            for i in idx:
                owners[i] = placed.get(i, -1) if self.kinds[i] == "gather" else -1
        return owners

    def _owners_within_budget(self, idx: Sequence[int], t_gather: dict[int, float]) -> tuple[dict[int, int], list[int]]:
        """Owners of the gathered matrices among ``idx`` (one process group): longest modeled seconds first, each
        to the least-loaded rank that stays within its small-state budget (a matrix one rank holds whole stays
        with it). Returns ``({matrix: owner}, [matrices no rank has room for])``. The budget of rank ``r``:
        ``memory_budget_mib``, else (1 + BUDGET_SLACK) x the even share + the largest matrix it owns +
        ``STATE_SLACK_ELEMENTS``, counting the distributed matrices' state, which rests evenly."""
        world = self._layouts[idx[0]].world
        state = {i: self.costs[i].state for i in idx}
        total = sum(state.values())
        spread = sum(state[i] for i in idx if self.kinds[i] != "gather") / world
        held, largest, load = [spread] * world, [0.0] * world, [0.0] * world

        def fits(r: int, i: int) -> bool:
            if not state[i]:
                return True
            if self.budget_elements is not None:
                cap = self.budget_elements
            else:
                cap = (1 + BUDGET_SLACK) * total / world + max(largest[r], state[i]) + STATE_SLACK_ELEMENTS
            return held[r] + state[i] <= cap

        def take(r: int, i: int) -> None:
            placed[i] = r
            held[r] += state[i]
            largest[r] = max(largest[r], state[i])
            load[r] += t_gather[i]

        placed: dict[int, int] = {}
        homeless: list[int] = []
        gathered = sorted((i for i in idx if self.kinds[i] == "gather"), key=lambda i: (-t_gather[i], self.names[i]))
        sole = [i for i in gathered if self._layouts[i].holders <= 1]
        for i in sole:  # nothing to move: the holder computes it, if it has room
            r = sole_holder(self._layouts[i])
            if r is not None and fits(r, i):
                take(r, i)
            else:
                homeless.append(i)
        heap = [(load[r], r) for r in range(world)]
        heapq.heapify(heap)
        for i in gathered:
            if self._layouts[i].holders <= 1:
                continue
            skipped = []
            while heap:
                l, r = heapq.heappop(heap)
                if l != load[r]:  # stale entry: the rank took a matrix since
                    heapq.heappush(heap, (load[r], r))
                    continue
                if fits(r, i):
                    take(r, i)
                    heapq.heappush(heap, (load[r], r))
                    break
                skipped.append((l, r))
            else:
                homeless.append(i)
            for e in skipped:
                heapq.heappush(heap, e)
        return placed, homeless

    def _amortized_distributed(self, i: int, world: int, gather: float) -> float:
        """A distributed matrix's seconds on every rank, its shared factorization spread over the ranks (the
        factorization owners are balanced like the gather owners). Where even a lower bound is no less than
        its gathered seconds (``gather``), the bound is returned: such a matrix is never distributed for time
        (every rank would pay at least what it relieves one owner of), and at P = 4096 the exact row plans of
        every matrix took most of a plan's 15 s."""
        for bound in (True, False):
            c = self.op_cost(i, "distributed", owner=False, bound=bound)
            if self.costs[i].shared:
                c.factor += self.costs[i].small_flops / world
            t = c.seconds(self.profile)
            if bound and t >= gather:
                return t
        return t

    def _distribute_first(self, idx: Sequence[int], t_gather: dict[int, float], t_dist: dict[int, float],
                          world: int) -> list[int]:
        """The matrices to start distributed: those most favourable to it (smallest distributed / gathered
        seconds) up to the count that minimizes the estimated busiest rank, the distributed ones' seconds (every
        rank pays each) plus the gathered ones' balanced load (their mean over the ranks, or the largest one).
        Moving one matrix at a time cannot find this: with one matrix per owner, moving any one alone costs
        every rank its distributed seconds without unloading the busiest owner."""
        order = sorted(idx, key=lambda i: (t_dist[i] / max(t_gather[i], 1e-30), self.names[i]))
        tail_sum, tail_max = [0.0] * (len(order) + 1), [0.0] * (len(order) + 1)
        for j in range(len(order) - 1, -1, -1):
            tail_sum[j] = tail_sum[j + 1] + t_gather[order[j]]
            tail_max[j] = max(tail_max[j + 1], t_gather[order[j]])
        best, best_k, head = float("inf"), 0, 0.0
        for k in range(len(order) + 1):
            est = head + max(tail_sum[k] / world, tail_max[k])
            if est < best:
                best, best_k = est, k
            if k < len(order):
                head += t_dist[order[k]]
        return order[:best_k]

    def modeled(self, rank: int | None = None) -> dict[str, float]:
        """This plan's modeled work on ``rank`` (default: this rank) per step: FLOPs by kind, bytes sent and
        received, collective rounds (bucketed: per strategy in use, not per matrix), seconds under the profile."""
        total = StepCost()
        rounds = {"gather": 2.0, "distributed": 4.0}
        used = set()
        for i, kind in enumerate(self.kinds):
            lay = self._layouts[i]
            r = lay.rank if rank is None else rank
            if kind == "gather" and self.owners[i] != r:
                piece = lay._piece_numel(lay.pieces[r])
                c = StepCost(sent=_B * piece * self.costs[i].channels, received=_B * piece)
            else:
                c = self.op_cost(i, kind, owner=kind != "distributed" or self.factor_owners[i] == r)
            if c.sent or c.received:
                used.add(kind)
            c.rounds = 0.0
            total += c
        total.rounds = sum(rounds.get(k, 0.0) for k in used)
        return {"matmul_flops": total.matmul, "factor_flops": total.factor, "sent_bytes": total.sent,
                "received_bytes": total.received, "rounds": total.rounds, "seconds": total.seconds(self.profile)}

    def modeled_payload(self, rank: int | None = None, state_share=None) -> dict[str, float]:
        """Bytes ``rank`` hands to collectives per step by ``collective_counter`` tag (what ``comm_stats``
        records: the send buffer of each call), as the plan predicts them: ``gather`` (pieces to owners and
        results back), ``realign`` (rows to the distributed row blocks and back), ``distributed`` (reduced
        small matrices and shared factorizations), ``state`` (this rank's share of distributed matrices'
        resting state, all-gathered). ``state_share(i, rank)``: elements of matrix ``i``'s state the rank
        keeps (default: an even cut of ``OpCost.state``)."""
        out = {"gather": 0.0, "realign": 0.0, "distributed": 0.0, "state": 0.0}
        for i, kind in enumerate(self.kinds):
            lay, c = self._layouts[i], self.costs[i]
            r = lay.rank if rank is None else rank
            if kind == "gather" and lay.holders > 1:
                if self.owners[i] == r:  # the results of every other rank's piece
                    out["gather"] += _B * sum(lay._piece_numel(p) for q, p in enumerate(lay.pieces) if q != r)
                else:
                    out["gather"] += _B * c.channels * lay._piece_numel(lay.pieces[r])
            elif kind == "distributed":
                plan = RowPlan.aligned(lay, self._transposes[i])
                back = sum(plan.moved(q, r) for q in range(lay.world) if q != r)
                out["realign"] += _B * (c.channels * plan.sent[r] + back)
                out["distributed"] += _B * (c.reduced + c.shared)
                out["state"] += _B * (state_share(i, r) if state_share is not None else c.state / lay.world)
        return out

    def describe(self) -> str:
        """The plan as a table (one row per matrix: strategy, owner, modeled seconds on its owner or on every
        rank) and a line with this rank's modeled step and the profile; the same text on every rank but the
        last line, which speaks for this rank."""
        rows = [f"{'matrix':40s} {'A shape':>13s} {'strategy':11s} {'owner':>5s} {'modeled ms':>10s}"]
        for i, (name, kind) in enumerate(zip(self.names, self.kinds)):
            shape = "x".join(map(str, self.a_shapes[i]))
            owner = str(self.owners[i]) if kind == "gather" else "-"
            rows.append(f"{name[-40:]:40s} {shape:>13s} {kind:11s} {owner:>5s} {1e3 * self.seconds(i):10.3f}")
        m = self.modeled()
        rows.append(f"this rank: {1e3 * m['seconds']:.3f} ms modeled ({m['matmul_flops'] / 1e9:.3g} GFLOP products, "
                    f"{m['factor_flops'] / 1e9:.3g} GFLOP factorizations, {m['sent_bytes'] / 2**20:.3g} MiB sent, "
                    f"{m['received_bytes'] / 2**20:.3g} MiB received) under {self.profile.describe()}")
        return "\n".join(rows)

    def _transient(self, i: int, rank: int | None) -> float:
        """Whole-tensor elements matrix ``i`` puts on ``rank`` during its bucket's step."""
        c, plan = self.costs[i], self.plans[i]
        if self.kinds[i] == "distributed":
            return c.state + c.reduced
        if self.kinds[i] == "gather":
            r = plan.layout.rank if rank is None else rank
            m, n = plan.a_shape
            return c.state + c.reduced + m * n if self.owners[i] == r else 0.0
        return 0.0

    def peak_transient(self, limit: float = BUCKET_ELEMENTS, rank: int | None = None) -> float:
        """The largest bucket's whole-tensor transients on ``rank`` (elements): gathered state, reduced
        partial sums, whole matrices on their owner. Bounded by ``limit`` (or by one matrix, if larger)."""
        return max((sum(self._transient(i, rank) for i in b) for b in self.buckets(limit)), default=0.0)

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self.plans)

    def subset(self, idx: Sequence[int]) -> "MatrixOps":
        """The plan of matrices ``idx`` only (same strategies, owners and row plans): a bucket, or the
        matrices of one ``step()`` call when an engine steps part of a param group (ZeRO-3 sub-groups).
        Static, so each subset is made once and kept (with what it caches: its buckets and FLOP totals)."""
        key = tuple(idx)
        cache = self.__dict__.setdefault("_subsets", {})
        sub = cache.get(key)
        if sub is None:
            if len(cache) >= 256:  # callers that ask for ever new subsets must not grow it without bound
                cache.clear()
            sub = cache[key] = self._make_subset(key)
        return sub

    def _make_subset(self, idx: Sequence[int]) -> "MatrixOps":
        sub = object.__new__(MatrixOps)
        sub.names = [self.names[i] for i in idx]
        sub.kinds = [self.kinds[i] for i in idx]
        sub.costs = [self.costs[i] for i in idx]
        sub.owners = [self.owners[i] for i in idx]
        sub.factor_owners = [self.factor_owners[i] for i in idx]
        sub.plans = [self.plans[i] for i in idx]
        sub.placements = [self.placements[i] for i in idx]
        sub.a_shapes = [self.a_shapes[i] for i in idx]
        sub._layouts = [self._layouts[i] for i in idx]
        sub._transposes = [self._transposes[i] for i in idx]
        sub.strategy, sub.profile, sub.budget_elements = self.strategy, self.profile, self.budget_elements
        sub.here = [self.here[i] for i in idx]
        sub.elsewhere = [self.elsewhere[i] for i in idx]
        return sub

    def buckets(self, limit: float = BUCKET_ELEMENTS) -> list[list[int]]:
        """Consecutive runs of matrices whose whole-tensor transients (small state gathered for the step,
        reduced partial sums, whole matrices on their owner) add up to at most ``limit`` elements; at
        least one matrix each. Static, so every rank runs the same buckets in the same order."""
        cache = self.__dict__.setdefault("_buckets", {})
        if limit not in cache:
            cache[limit] = self._make_buckets(limit)
        return cache[limit]

    def _make_buckets(self, limit: float) -> list[list[int]]:
        out: list[list[int]] = []
        used = 0.0
        for i, (c, kind, plan) in enumerate(zip(self.costs, self.kinds, self.plans)):
            m, n = plan.a_shape
            size = c.state + c.reduced + (m * n if kind == "gather" else 0)
            if not out or used + size > limit:
                out.append([])
                used = 0.0
            out[-1].append(i)
            used += size
        return out

    def active(self, i: int) -> bool:
        """Whether this rank computes matrix ``i`` (holds its rows, or takes part in its reductions)."""
        return self.kinds[i] != "gather" or self.owners[i] == self.plans[i].layout.rank

    def rows(self, i: int) -> tuple[int, int]:
        return self.plans[i].rows()

    def my_rows(self, i: int, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a ``rows(A) x k`` matrix held whole (a replicated basis, an assembled sketch)."""
        a0, a1 = self.rows(i)
        return full[a0:a1]

    def strategy_of(self, name: str) -> str:
        return self.kinds[self.names.index(name)]

    # ------------------------------------------------------------------ data movement
    def to_blocks(self, channels: Sequence[Sequence[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """``channels[i]``: this rank's 1-D pieces of matrix ``i``'s tensors -> their row blocks of ``A``."""
        plans, pieces, tags = [], [], []
        for i, chans in enumerate(channels):
            for piece in chans:
                plans.append(self.plans[i])
                pieces.append(piece)
                tags.append(self._tag(i))
        if pieces:
            self._device = pieces[0].device  # results return to the parameters' device, also where a rank has none
        flat = to_blocks(plans, pieces, tags)
        out, pos = [], 0
        for chans in channels:
            out.append(flat[pos: pos + len(chans)])
            pos += len(chans)
        return out

    def from_blocks(self, blocks: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        """Row-block results (``None`` where this rank computed nothing) -> this rank's 1-D pieces."""
        return from_blocks(self.plans, blocks, [self._tag(i) for i in range(len(self))],
                           getattr(self, "_device", "cpu"))

    def _tag(self, i: int) -> str:
        return "gather" if self.kinds[i] == "gather" else "realign"

    def allreduce(self, parts: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Sum each distributed matrix's partial tensor over its group (one all-reduce per group and dtype);
        others are returned as they are (their ranks already hold every row)."""
        import torch.distributed as dist

        buckets: dict[tuple, list[int]] = {}
        for i in sorted(parts):
            if self.kinds[i] == "distributed":
                lay = self.plans[i].layout
                buckets.setdefault((id(lay.group), parts[i].dtype), []).append(i)
        out = dict(parts)
        for idx in buckets.values():
            flat = torch.cat([parts[i].reshape(-1) for i in idx])
            collective_counter.record(flat, "distributed")
            dist.all_reduce(flat, group=self.plans[idx[0]].layout.group)
            pos = 0
            for i in idx:
                k = parts[i].numel()
                out[i] = flat[pos: pos + k].view(parts[i].shape)
                pos += k
        return out

    def assemble(self, blocks: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Row blocks of small tall matrices (rows of ``A`` x k) -> the whole matrix on every rank that computes."""
        full = {}
        for i, b in blocks.items():
            if self.kinds[i] == "distributed":
                a0, a1 = self.rows(i)
                f = torch.zeros(self.plans[i].a_shape[0], b.shape[1], dtype=b.dtype, device=b.device)
                f[a0:a1] = b
                full[i] = f
            else:
                full[i] = b
        return self.allreduce(full)

    def account(self) -> None:
        """Add this step's estimated FLOPs on this rank, by strategy, to the active counters (static totals,
        summed once per plan)."""
        totals = self.__dict__.get("_flop_totals")
        if totals is None:
            totals = self._flop_totals = self._make_flop_totals()
        for kind, flops in totals.items():
            collective_counter.add_flops(kind, flops)

    def _make_flop_totals(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for i, c in enumerate(self.costs):
            if not self.active(i):
                continue
            plan = self.plans[i]
            a0, a1 = plan.rows()
            share = (a1 - a0) / max(plan.a_shape[0], 1)
            small = c.small_flops if not (self.kinds[i] == "distributed" and c.shared) \
                or self.factor_owners[i] == plan.layout.rank else 0.0
            totals[self.kinds[i]] = totals.get(self.kinds[i], 0.0) + c.row_flops * share + small
        return totals


def _device_type(layouts: Sequence[MatrixLayout]) -> str | None:
    """Where the parameters live, for ``profile="auto"``: read from a layout's ``device`` if an engine set one."""
    for lay in layouts:
        dev = getattr(lay, "device", None)
        if dev is not None:
            return torch.device(dev).type
    return None


def _by_group(layouts: Sequence[MatrixLayout]) -> dict[int, list[int]]:
    by: dict[int, list[int]] = {}
    for i, lay in enumerate(layouts):
        if lay.group is not None:
            by.setdefault(id(lay.group), []).append(i)
    return by


def _balance_weights(costs: Sequence[OpCost], shapes: Sequence[tuple[int, int]]) -> list[float]:
    """One number per gathered matrix for the owner plan: its share of the gathered FLOPs plus its share of
    the gathered small state, so owners end up balanced in both time and memory."""
    work = [_gather_cost(c, s) for c, s in zip(costs, shapes)]
    total_work = sum(work) or 1.0
    total_state = sum(c.state for c in costs)
    return [w / total_work + (c.state / total_state if total_state else 0.0) for w, c in zip(work, costs)]


def _gather_cost(c: OpCost, shape: tuple[int, int]) -> float:
    m, n = shape
    return FLOPS_PER_BYTE * 4 * 2 * m * n + c.row_flops + c.small_flops
