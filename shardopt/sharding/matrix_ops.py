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
* ``team``: the matrix is gathered to a team of ``g`` ranks (``teams``), its rows spread over them, and the
  algorithm runs as under ``distributed`` among the members only (their own process group); a factorization
  the algorithm shares runs on one member. Where ranks outnumber matrices, this is how the busiest rank
  approaches the total work / P instead of one matrix's whole work.

``strategy="auto"`` (issue 27) minimizes the busiest rank's modeled step time (``time_model``: FLOPs by kind,
bytes sent or received, collective rounds, turned into seconds by ``matrix_ops.profile``) under a memory
budget: by default a rank keeps at most ``(1 + BUDGET_SLACK)`` x its even share of the group's small state,
plus the whole state of the largest matrix it owns (what any owner-compute scheme must hold), plus
``STATE_SLACK_ELEMENTS``; ``matrix_ops.memory_budget_mib`` replaces that by a fixed number. It starts from
every matrix gathered (owners balanced by modeled seconds), moves to the distributed strategy the matrices
that break the budget, then, while it lowers the modeled step, the costliest matrix of the busiest owner; and
then takes, where the model says it is faster, the plan that puts the gathered matrices (or all of them) on
teams of ranks (``teams.choose``). ``"gather"`` / ``"distributed"`` / ``"team"`` force one (``distributed``
also keeps every rank's small state within ``STATE_SLACK`` of the even share, as before; ``team`` takes
``team_size`` ranks per matrix, or the size the model picks). A matrix held whole by a single rank of its
group is computed there with no communication under any strategy that gathers it.

Reductions over the rows of symmetric small matrices (Grams, roots) may be sent as their upper triangles
(``allreduce(..., symmetric=True)``): half the bytes, and every rank gets the same exactly symmetric result.

Small persistent state (``OpCost.state``) rests split over the ranks by ``shardopt.sharding.state_split``; a
step runs in buckets (``buckets``) whose whole-tensor transients stay below a bound, not the model's size.
"""

from __future__ import annotations

import heapq
import inspect
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import torch

from . import staging
from .blocks import RowPlan, from_blocks, to_blocks
from .comm import collective_counter
from .layout import MatrixLayout
from .owner import owner_plan, sole_holder
from .state_split import Placement
from .teams import RowExchange, TeamCost, TeamPlan, choose, team_group, team_sizes
from .time_model import HardwareProfile, StepCost, resolve_profile

__all__ = [
    "MatrixOps",
    "OpCost",
    "Strategy",
    "FLOPS_PER_BYTE",
    "STRATEGIES",
    "STATE_SLACK",
    "BUDGET_SLACK",
    "BUCKET_ELEMENTS",
]

Strategy = Literal["auto", "gather", "distributed", "team"]
STRATEGIES = ("auto", "gather", "distributed", "team")

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
    #: FLOPs of products of small matrices (Muon's ``G^2``, SWAN's Newton-Schulz root), run where the
    #: factorization runs (the same rules as ``small_flops``) but at the matmul rate
    small_matmul: float = 0.0
    #: collective rounds of reductions per step when the rows are split (Muon: one per Newton-Schulz step
    #: and the norm); the row moves, a shared result and the resting state add theirs (``split_rounds``)
    rounds: float = 1.0
    #: elements of ``state`` with one row per row of ``A`` that rest with the rows a rank computes on
    #: (``state_split.ROWS``: SUMO's ``Q``, Alice's ``U``): a step with split rows does not gather them
    row_state: float = 0.0
    #: fp32 elements all-reduced at a refresh step (a new basis, a switch) beyond a regular step's, when the
    #: rows are split; every ``refresh_every`` steps (0: the optimizer never refreshes)
    refresh_reduced: float = 0.0
    refresh_every: float = 0.0
    #: factorization calls per step (``eigh``/``svd``/``qr``, each a solver launch: the profile's
    #: ``factor_latency``), a refresh's spread over its interval; run where ``small_flops`` runs
    small_calls: float = 0.0
    #: a root a team inside one node can split by row blocks (issue 53): all of ``small_matmul`` is the coupled
    #: iteration on ``split_k x split_k`` matrices (``iterative.coupled_iteration_rows``), ``split_steps`` steps
    #: (with its residual: ``split_residual``) of ``split_itemsize``-byte elements, per step (a refresh's spread
    #: over its interval: ``split_every``); 0: not splittable. ``split_form``: what its steps all-gather
    #: (``iterative.split_exchange``: "coupled", SWAN's ``Y``/``Z`` iteration; "newton", the checked roots' ``M``)
    split_k: int = 0
    split_steps: int = 0
    split_residual: bool = False
    split_itemsize: int = 4
    split_every: float = 1.0
    split_form: str = "coupled"

    @property
    def refresh_per_step(self) -> float:
        """``refresh_reduced`` spread over the steps between refreshes (what the time model charges a step)."""
        return self.refresh_reduced / self.refresh_every if self.refresh_every else 0.0

    @property
    def moving_state(self) -> float:
        """Elements of the resting state that a step with split rows gathers."""
        return self.state - self.row_state

    def split_rounds(self) -> float:
        """Collective rounds per step of a matrix whose rows are split: the rows in and out, the reductions,
        a shared factorization, the resting state gathered."""
        return 2.0 + self.rounds + (1.0 if self.shared else 0.0) + (1.0 if self.moving_state else 0.0)


def _packed(k: int) -> int:
    """Elements of the upper triangle of a ``k x k`` matrix (what a symmetric reduction sends)."""
    return k * (k + 1) // 2


class MatrixOps:
    """The whole-matrix plan of one step for ``layouts`` (oriented by ``transposes``), identical on every rank."""

    def __init__(
        self,
        layouts: Sequence[MatrixLayout],
        names: Sequence[str],
        transposes: Sequence[bool],
        strategy: str,
        cost: Callable[..., OpCost],
        profile: HardwareProfile | str | dict | None = None,
        memory_budget_mib: float | None = None,
        team_size: int | None = None,
    ):
        """``cost(a_shape)`` or ``cost(a_shape, parts)``: the matrix's work when its rows of ``A`` are computed
        on ``parts`` ranks (1: whole on one rank), which may change how an algorithm computes (Muon)."""
        if strategy not in STRATEGIES:
            raise ValueError(f"matrix_ops strategy must be one of {STRATEGIES}, got {strategy!r}")
        if team_size is not None and (isinstance(team_size, bool) or not isinstance(team_size, int) or team_size < 2):
            raise ValueError(f"matrix_ops.team_size must be an integer >= 2 or null, got {team_size!r}")
        self.names = list(names)
        self.strategy = strategy
        self.profile = resolve_profile(profile, _device_type(layouts))
        self.budget_elements = None if memory_budget_mib is None else float(memory_budget_mib) * 2**20 / _B
        self.team_size = team_size
        self._cost = cost
        try:
            self._cost_takes_parts = len(inspect.signature(cost).parameters) >= 2
        except (TypeError, ValueError):
            self._cost_takes_parts = False
        self._split_costs: dict[tuple, OpCost] = {}
        self.kinds: list[str] = []
        self.costs: list[OpCost] = []
        self.a_shapes: list[tuple[int, int]] = []
        for lay, t in zip(layouts, transposes):
            a_shape = (lay.shape[1], lay.shape[0]) if t else lay.shape
            self.a_shapes.append(a_shape)
            self.costs.append(cost(a_shape))
            if lay.group is None:
                self.kinds.append("local")
            elif lay.holders <= 1 or strategy in ("gather", "auto", "team"):
                self.kinds.append("gather")
            else:
                self.kinds.append("distributed")
        self._layouts, self._transposes = list(layouts), list(transposes)
        #: a team's members (group ranks, ascending) per matrix of kind "team", else None
        self.teams: list[tuple[int, ...] | None] = [None] * len(self.kinds)
        self._team_factor: dict[int, int] = {}
        #: per matrix: its root's products are split over its team (issue 53; ``compute_once(split=...)``)
        self.split_roots: list[bool] = [False] * len(self.kinds)
        if strategy == "auto":
            self.owners = self._choose_by_time(layouts)
        elif strategy == "team":
            self.owners = self._assign_teams(layouts)
        else:
            self.owners = self._assign_owners(layouts, strategy == "distributed")
        self.factor_owners = self._assign_factor_owners(layouts)
        self.split_roots = [
            k == "team" and self._split_pays(i, len(self._members(i)), self._members(i))
            for i, k in enumerate(self.kinds)
        ]
        self.plans: list[RowPlan] = []
        #: where each matrix's small state rests (shardopt.sharding.state_split)
        self.placements: list[Placement] = []
        for i, (lay, t) in enumerate(zip(layouts, transposes)):
            if self.kinds[i] == "gather":
                self.plans.append(RowPlan.owner(lay, t, self.owners[i]))
            elif self.kinds[i] == "team":
                self.plans.append(RowPlan.team(lay, t, self._members(i)))
            else:
                self.plans.append(RowPlan.aligned(lay, t))
            self.placements.append(
                Placement.of(self.plans[-1], self.owners[i] if self.kinds[i] == "gather" else None, self.teams[i])
            )
        self._mark_whole_here()

    # ------------------------------------------------------------------ kinds
    def split(self, i: int) -> bool:
        """Whether matrix ``i``'s rows of ``A`` are spread over several computing ranks (``distributed`` or a
        ``team``): its sums over rows are partial and reduced (``allreduce``)."""
        return self.kinds[i] in ("distributed", "team")

    def parts(self, i: int) -> int:
        """How many ranks compute matrix ``i`` (its rows of ``A`` are cut into that many blocks): 1 for ``local``
        and ``gather``, the team's size, or the group's size under ``distributed``; the same on every rank."""
        kind = self.kinds[i]
        if kind == "team":
            return len(self._members(i))
        if kind == "distributed":
            return self._layouts[i].world
        return 1

    def cost_of(self, i: int, parts: int | None = None) -> OpCost:
        """Matrix ``i``'s ``OpCost`` when ``parts`` ranks compute it (default: as planned)."""
        parts = self.parts(i) if parts is None else parts
        if parts <= 1 or not self._cost_takes_parts:
            return self.costs[i]
        key = (self.a_shapes[i], parts)
        found = self._split_costs.get(key)
        if found is None:
            found = self._split_costs[key] = self._cost(self.a_shapes[i], parts)
        return found

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
            owners = owner_plan(
                [layouts[i] for i in gathered],
                [self.names[i] for i in gathered],
                _balance_weights([self.costs[i] for i in gathered], [layouts[i].shape for i in gathered], self.profile),
            )
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
        by its modeled seconds, longest first), a team's member chosen with the team, the gather owner otherwise;
        identical on every rank."""
        out = list(self.owners)
        spread = [i for i, k in enumerate(self.kinds) if k == "distributed" and self.cost_of(i).shared]
        shared = self._shared_seconds(spread)
        plan = owner_plan([layouts[i] for i in spread], [self.names[i] for i in spread], [shared[i] for i in spread])
        for i, o in zip(spread, plan):
            out[i] = o
        for i, f in self._team_factor.items():
            if self.kinds[i] == "team":
                out[i] = f
        return out

    def _assign_teams(self, layouts: Sequence[MatrixLayout]) -> list[int]:
        """``strategy="team"``: every matrix held by several ranks on a team (``team_size`` ranks, capped at the
        group's size, or per matrix the size the model finds fastest, at least 2), packed by ``teams.choose``
        (a forced strategy: no memory budget, as under ``gather``); a matrix one rank holds whole stays with it
        (``gather``). Teams sit on aligned blocks of ranks, so a ``team_size`` that does not divide the group's
        size leaves its last ``size mod team_size`` ranks out of every team (they still send their pieces)."""
        owners = [-1] * len(layouts)
        for idx in _by_group(layouts).values():
            world = layouts[idx[0]].world
            if self.team_size is not None:
                sizes = [min(self.team_size, world)]
            else:
                sizes = [g for g in self._node_team_sizes(idx[0], team_sizes(world)) if g >= 2] or [world]
            sole = {i: sole_holder(layouts[i]) if layouts[i].holders <= 1 else None for i in idx}
            t_gather = {i: self.seconds(i, "gather") for i in idx}
            costs = {
                i: self._team_costs(i, [1] if sole[i] is not None or world < 2 else sizes, t_gather[i]) for i in idx
            }
            plan = choose(
                idx,
                self.names,
                costs,
                world,
                torch.zeros(world, dtype=torch.float64),
                {i: self.costs[i].state for i in idx},
                sole,
                self._capacity(idx, world, 0.0, force=True),
            )
            self._apply_team_plan(idx, plan, owners)
        return owners

    def _members(self, i: int) -> tuple[int, ...]:
        """Matrix ``i``'s team (every matrix of kind "team" has one; the others None)."""
        team = self.teams[i]
        assert team is not None, f"matrix {i} is of kind {self.kinds[i]!r}, not 'team'"
        return team

    def team_sets(self) -> list[tuple[int, ...]]:
        """The teams of this plan smaller than their process group, as ranks of the default group (what
        ``teams.create_team_groups`` makes groups for)."""
        from .teams import global_team

        out = set()
        for kind, team, plan in zip(self.kinds, self.teams, self.plans):
            if kind == "team" and team is not None and len(team) < plan.layout.world:
                out.add(global_team(plan.layout.group, team))
        return sorted(out)

    def compute_once(
        self,
        inputs: dict[int, torch.Tensor],
        fn: Callable[[dict[int, torch.Tensor]], dict[int, torch.Tensor]],
        symmetric: bool = False,
        split: Callable | None = None,
    ) -> dict[int, torch.Tensor]:
        """``fn`` of identical small inputs (reduced Grams, EMA statistics) without repeating it on every rank:
        a split matrix's result (``distributed`` or ``team``) is computed by its factorization owner alone and
        shared with one all-reduce per process group or team (the others add exact zeros, so every rank gets the
        owner's result); other matrices (an owner's, local ones) are computed here. ``fn`` maps a dict of inputs
        to results of the inputs' shapes (``symmetric``: symmetric ``k x k`` results, sent as triangles). Every
        rank that computes a split matrix issues the same collective, also a rank that owns none.

        ``split(inputs, rows)``: where the plan splits a team's root (``split_roots``, issue 53), every member
        computes it together instead, its products by row blocks (``rows``: a ``teams.RowExchange``), one call
        per team in the order of their member sets; each member gets every result and nothing is shared."""
        if split is not None and any(self.split_roots[i] for i in inputs):
            inputs = dict(inputs)
            out_split: dict[int, torch.Tensor] = {}
            by_team: dict[tuple, dict[int, torch.Tensor]] = {}
            for i in sorted(inputs):
                if self.split_roots[i]:
                    by_team.setdefault(self._members(i), {})[i] = inputs.pop(i)
            for team in sorted(by_team):
                lay = self.plans[next(iter(by_team[team]))].layout
                rows = RowExchange(team_group(lay.group, team), team.index(lay.rank), len(team))
                out_split.update(split(by_team[team], rows))
                RowExchange.seen_steps = max(RowExchange.seen_steps, rows.steps)
            rest = self.compute_once(inputs, fn, symmetric) if inputs else {}
            return {**rest, **out_split}
        mine = {
            i: x for i, x in inputs.items() if not self.split(i) or self.factor_owners[i] == self.plans[i].layout.rank
        }
        out = fn(mine) if mine else {}
        spread = {i: out[i] if i in out else torch.zeros_like(x) for i, x in inputs.items() if self.split(i)}
        if spread:
            out.update(self.allreduce(spread, symmetric=symmetric))
        return out

    # ------------------------------------------------------------------ the time model (issue 27)
    def op_cost(
        self,
        i: int,
        kind: str | None = None,
        owner: bool = True,
        bound: bool = False,
        size: int | None = None,
        rank: int | None = None,
    ) -> StepCost:
        """Modeled work of matrix ``i`` on one rank under ``kind`` (default: its strategy): on the owner
        (``owner``) or on another rank under ``gather``; under ``distributed`` on the busiest rank's rows, with
        the factorization where it runs (every rank, or only its factorization owner when ``shared``); on a
        ``team`` of ``size`` ranks (default: its team) on a member, with the factorization when ``owner`` (see
        ``_team_cost``; ``rank``: that rank exactly, from the plan).
        ``bound``: under ``distributed``, a lower bound without the row plan (an even share of the rows, no row
        moved), which costs O(1) instead of O(P). Collectives of a group that lies within one node cost the
        node's links (issue 53)."""
        cost = self._op_cost(i, kind, owner, bound, size, rank)
        kind = kind or self.kinds[i]
        return cost.on_node() if kind in ("gather", "distributed") and self._group_on_node(i) else cost

    def _op_cost(
        self, i: int, kind: str | None, owner: bool, bound: bool, size: int | None, rank: int | None
    ) -> StepCost:
        kind = kind or self.kinds[i]
        c, lay = self.costs[i], self._layouts[i]
        m, n = lay.shape
        if kind == "local":
            return StepCost(matmul=c.row_flops + c.small_matmul, factor=c.small_flops, calls=c.small_calls)
        if kind == "gather":
            piece = m * n / max(lay.holders, 1)
            if not owner:  # its piece to the owner and the result back
                return StepCost(sent=_B * piece * c.channels, received=_B * piece, rounds=2.0)
            moved = m * n - piece  # the other holders' pieces in (``channels`` tensors), their results out
            return StepCost(
                matmul=c.row_flops + c.small_matmul,
                factor=c.small_flops,
                calls=c.small_calls,
                sent=_B * moved,
                received=_B * moved * c.channels,
                rounds=2.0 if moved else 0.0,
            )
        if kind == "team":
            return self._team_cost(i, size or len(self._members(i)), owner, rank)
        world = lay.world
        c = self.cost_of(i, world)
        if bound:
            share, moved = 1.0 / world, 0
        else:
            plan = RowPlan.aligned(lay, self._transposes[i])
            rows = max((b - a for a, b in zip(plan.starts, plan.starts[1:])), default=0)
            share, moved = rows / max(self.a_shapes[i][0], 1), max(plan.sent)
        ring = 2.0 * (world - 1) / world  # a ring all-reduce sends (and receives) 2 (P-1)/P of the buffer
        state = c.moving_state * (world - 1) / world  # the resting state all-gathered for the step
        net = _B * ((c.channels + 1) * moved + ring * (c.reduced + c.shared + c.refresh_per_step) + state)
        mine = not c.shared or owner  # where the small work runs: every rank, or the factorization owner
        return StepCost(
            matmul=c.row_flops * share + (c.small_matmul if mine else 0.0),
            factor=c.small_flops if mine else 0.0,
            calls=c.small_calls if mine else 0.0,
            sent=net,
            received=net,
            rounds=c.split_rounds(),
        )

    def _team_cost(self, i: int, g: int, factor: bool, rank: int | None = None) -> StepCost:
        """Matrix ``i`` on a team of ``g`` ranks, for one member (``factor``: the member that runs the shared
        factorization). It receives its rows of ``A`` (``channels`` tensors) from their holders and sends the
        results of its rows back, sends its own piece to the members and gets its results; among the members
        the reduced small matrices (a ring: 2 (g - 1) / g of them, also the shared factorization) and the
        resting state (its (g - 1) / g). With ``rank`` of a planned team, the moved elements are the plan's;
        otherwise estimated (an even share of the rows, none of them already in place: an upper bound)."""
        c = self.cost_of(i, g)
        lay = self._layouts[i]
        m, n = lay.shape
        rows, cols = self.a_shapes[i]
        planned = rank is not None and self.kinds[i] == "team" and i < len(self.plans)
        team = self.teams[i] if planned else None
        split = self.split_roots[i] if planned else self._split_pays(i, g, team)
        member = True
        if rank is not None and self.kinds[i] == "team" and i < len(self.plans):
            plan = self.plans[i]
            a0, a1 = plan.rows(rank)
            member = rank in self._members(i)
            block = (a1 - a0) * cols
            back = block - (plan.moved(rank, rank) if block else 0)  # its rows' elements held by other ranks
            out = plan.sent[rank]  # its piece's elements in the members' rows
            share = (a1 - a0) / max(rows, 1)
            received, sent = c.channels * back + out, c.channels * out + back
        else:
            rows_g = -(-rows // g) if rows else 0
            share = rows_g / max(rows, 1)
            block = rows_g * cols
            piece = m * n / max(lay.holders, 1)
            received, sent = c.channels * block + piece, block + c.channels * piece
        moves = StepCost(sent=_B * sent, received=_B * received, rounds=2.0)
        if self._group_on_node(i):
            moves = moves.on_node()
        if not member:  # a holder outside the team: its piece out, its results back
            return moves
        shared = 0.0 if split else c.shared
        coll = 2.0 * (g - 1) / g * (c.reduced + shared + c.refresh_per_step) + c.moving_state * (g - 1) / g
        mine = not c.shared or factor
        inner = StepCost(
            matmul=c.row_flops * share + (c.small_matmul if mine and not split else 0.0),
            factor=c.small_flops if mine else 0.0,
            calls=c.small_calls if mine else 0.0,
            sent=_B * coll,
            received=_B * coll,
            rounds=c.split_rounds() - 2.0 - (1.0 if split and c.shared else 0.0),
        )
        if split:  # every member runs its rows of the root's products and all-gathers the rest
            inner.matmul += c.small_matmul * self._split_share(c, g)
            ex, ex_rounds = self._split_exchange(c, g)
            inner.sent += ex
            inner.received += ex
            inner.rounds += ex_rounds
        if self._team_on_node(i, team) if team is not None else self._blocks_on_node(i, g):
            inner = inner.on_node()  # the team's own collectives stay inside its node
        inner += moves
        return inner

    def _team_costs(self, i: int, sizes: Sequence[int], t_gather: float) -> dict[int, TeamCost]:
        """``TeamCost`` of matrix ``i`` for each team size (1: its gather owner's seconds)."""
        out = {}
        for g in sizes:
            if g == 1:
                out[1] = TeamCost(1, t_gather, t_gather)
            else:
                out[g] = TeamCost(
                    g,
                    self._team_cost(i, g, False).seconds(self.profile),
                    self._team_cost(i, g, True).seconds(self.profile),
                )
        return out

    # ------------------------------------------------------------------ nodes and split roots (issue 53)
    def _node_team_sizes(self, i: int, sizes: Sequence[int]) -> list[int]:
        """The team sizes whose aligned blocks of matrix ``i``'s group all lie within one node, where such teams of
        2 or more exist (else every size: no team can avoid straddling nodes): ``auto`` never puts a matrix on a
        team across nodes where one inside a node exists (issue 53)."""
        local = [g for g in sizes if self._blocks_on_node(i, g)]
        return local if any(g >= 2 for g in local) else list(sizes)

    def _global_ranks(self, i: int) -> tuple[int, ...]:
        """The default group's ranks of matrix ``i``'s group, by group rank (cached per group)."""
        lay = self._layouts[i]
        cache = self.__dict__.setdefault("_ranks_of", {})
        key = id(lay.group)
        if key not in cache:
            ranks = tuple(range(lay.world))
            try:
                import torch.distributed as dist

                if lay.group is not None and dist.is_initialized():
                    ranks = tuple(dist.get_process_group_ranks(lay.group))
            except (RuntimeError, ValueError, AttributeError):
                pass
            cache[key] = ranks
        return cache[key]

    def _group_on_node(self, i: int) -> bool:
        """Whether matrix ``i``'s whole group lies within one node (its collectives then cost the node's links)."""
        return self.profile.within_node(self._global_ranks(i))

    def _team_on_node(self, i: int, team: Sequence[int]) -> bool:
        """Whether a team (group ranks of matrix ``i``'s group) lies within one node."""
        ranks = self._global_ranks(i)
        return self.profile.within_node(tuple(ranks[r] for r in team))

    def _blocks_on_node(self, i: int, g: int) -> bool:
        """Whether every aligned block of ``g`` ranks of matrix ``i``'s group lies within one node."""
        cache = self.__dict__.setdefault("_blocks_local", {})
        key = (id(self._layouts[i].group), g)
        if key not in cache:
            ranks = self._global_ranks(i)
            span = len(ranks) // g * g
            cache[key] = all(self.profile.within_node(ranks[b : b + g]) for b in range(0, span, g))
        return cache[key]

    @staticmethod
    def _split_share(c: OpCost, g: int) -> float:
        """A member's share of a split root's products: its row block, ``ceil(k / g)`` of ``k`` rows."""
        return -(-c.split_k // g) / c.split_k

    @staticmethod
    def _split_exchange(c: OpCost, g: int, steps: int | None = None) -> tuple[float, float]:
        """A member's bytes (fp32 elements, ``_B``) sent, and received, by a split root per step, and its
        rounds: ring all-gathers of ``ceil(k / g)``-row blocks (``g - 1`` of them each way) and the residual."""
        from .iterative import split_exchange

        gathers, rounds = split_exchange(c.split_steps if steps is None else steps, c.split_residual, c.split_form)
        block = -(-c.split_k // g) * c.split_k * c.split_itemsize / _B
        scalars = (c.split_itemsize / _B) * 2.0 * (g - 1) / g if c.split_residual else 0.0
        return (gathers * (g - 1) * block + scalars) / c.split_every, rounds / c.split_every

    def _split_pays(self, i: int, g: int, team: Sequence[int] | None) -> bool:
        """Whether a team of ``g`` (``team``, or any aligned block) splits matrix ``i``'s root: it can (``split_k``,
        no factorization beside it), the team lies within one node, and the member's modeled seconds of the
        split (its rows of the products, the all-gathers at the node's rates) are below the factorization
        member's whole root and the shared result's all-reduce."""
        c = self.cost_of(i, g)
        if g < 2 or not c.split_k or c.small_flops or c.small_calls:
            return False
        if team is not None and not self._team_on_node(i, team):
            return False
        if team is None and not self._blocks_on_node(i, g):
            return False
        ex, rounds = self._split_exchange(c, g)
        split = self.profile.seconds(
            matmul=c.small_matmul * self._split_share(c, g), node_bytes=_B * ex, node_rounds=rounds
        )
        whole = self.profile.seconds(
            matmul=c.small_matmul, node_bytes=_B * 2.0 * (g - 1) / g * c.shared, node_rounds=1.0 if c.shared else 0.0
        )
        return split < whole

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
            for i in self._distribute_first(idx, t_gather, t_dist, world, self._shared_seconds(idx, world)):
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
            self._consider_teams(idx, world, t_gather, t_dist, owners)
        return owners

    def _consider_teams(
        self, idx: Sequence[int], world: int, t_gather: dict[int, float], t_dist: dict[int, float], owners: list[int]
    ) -> None:
        """``auto``, after the gather / distributed plan of one process group: the same estimate of its busiest
        rank (every rank pays the distributed matrices and the moves of its pieces; owners their matrices)
        against two team plans (``teams.choose``): the gathered matrices on teams beside the distributed ones,
        and every matrix on a team (a team of one is an owner). The plan with the least busiest rank is kept
        (the current one on ties). Deterministic from static metadata."""
        if world < 2:
            return
        lays = self._layouts
        sizes = self._node_team_sizes(idx[0], team_sizes(world))
        sole = {i: sole_holder(lays[i]) if lays[i].holders <= 1 else None for i in idx}
        state = {i: self.costs[i].state for i in idx}
        costs = {i: self._team_costs(i, [1] if sole[i] is not None else sizes, t_gather[i]) for i in idx}
        moves = {
            i: self.op_cost(i, "gather", owner=False).seconds(self.profile) if sole[i] is None else 0.0 for i in idx
        }  # a holder's piece to the owner or team and its results back
        gathered = [i for i in idx if self.kinds[i] == "gather"]
        spread = [i for i in idx if self.kinds[i] == "distributed"]
        if any(owners[i] < 0 for i in gathered):
            return
        base = sum(t_dist[i] for i in spread) + sum(moves[i] for i in gathered)
        current = torch.full((world,), base, dtype=torch.float64)
        for i in gathered:
            current[owners[i]] += t_gather[i]
        best, best_busiest = None, float(current.max())
        spread_state = sum(state[i] for i in spread) / world
        candidates = [
            (gathered, base, spread_state),
            (list(idx), sum(moves[i] for i in idx), 0.0),
        ]
        for mats, start, held in candidates:
            plan = choose(
                mats,
                self.names,
                costs,
                world,
                torch.full((world,), start, dtype=torch.float64),
                state,
                sole,
                self._capacity(idx, world, held),
            )
            if plan is not None and plan.busiest < best_busiest * (1 - 1e-9):
                best, best_busiest = (mats, plan), plan.busiest
        if best is not None:
            self._apply_team_plan(*best, owners)

    def _capacity(
        self, idx: Sequence[int], world: int, held: float, force: bool = False
    ) -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]:
        """The memory budget as ``teams.pack`` asks it: ``cap(held, largest, share)`` per rank (tensors), whether
        ``share`` more small state fits a rank that keeps ``held`` (plus ``held`` of evenly spread state) and
        whose largest owned share is ``largest``. ``force``: no budget (a forced strategy)."""
        if force:
            return lambda h, big, share: torch.ones_like(h, dtype=torch.bool)
        if self.budget_elements is not None:
            limit = self.budget_elements
            return lambda h, big, share: h + held + share <= limit
        total = sum(self.costs[i].state for i in idx)
        even = (1 + BUDGET_SLACK) * total / world + STATE_SLACK_ELEMENTS
        return lambda h, big, share: h + held + share <= even + torch.clamp(big, min=share)

    def _apply_team_plan(self, idx: Sequence[int], plan: TeamPlan | None, owners: list[int]) -> None:
        """Strategies from a team plan: a team of one is the matrix's gather owner, a larger one a ``team``
        (its factorization member is the owner of its 0-d state, as a gather owner's); with no plan (nothing
        fits the budget) the matrices are ``distributed``."""
        for i in idx:
            if plan is None or i not in plan.members:
                self.kinds[i], owners[i] = "distributed", -1
                continue
            members = plan.members[i]
            if len(members) == 1:
                self.kinds[i], owners[i], self.teams[i] = "gather", members[0], None
            else:
                self.kinds[i], owners[i], self.teams[i] = "team", plan.factor[i], members
                self._team_factor[i] = plan.factor[i]

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
            split = self.cost_of(i, world)
            if split.shared:
                c.factor += split.small_flops / world
                c.calls += split.small_calls / world
                c.matmul += split.small_matmul / world
            t = c.seconds(self.profile)
            if bound and t >= gather:
                return t
        return t

    def _shared_seconds(self, idx: Sequence[int], world: int | None = None) -> dict[int, float]:
        """Seconds of each matrix's small work that one factorization owner runs when it is distributed over
        ``world`` ranks (default: as planned; ``compute_once``; 0 where every rank repeats it)."""
        out = {}
        for i in idx:
            split = self.cost_of(i, world)
            out[i] = (
                self.profile.seconds(split.small_matmul, split.small_flops, calls=split.small_calls)
                if split.shared
                else 0.0
            )
        return out

    def _distribute_first(
        self,
        idx: Sequence[int],
        t_gather: dict[int, float],
        t_dist: dict[int, float],
        world: int,
        t_shared: dict[int, float],
    ) -> list[int]:
        """The matrices to start distributed: those most favourable to it (smallest distributed / gathered
        seconds) up to the count that minimizes the estimated busiest rank: what every rank pays for each
        distributed one, plus the balanced load of the owners (their mean over the ranks, or the largest one),
        which run the gathered matrices and the distributed ones' shared factorizations (``t_shared``: a
        factorization is not split, so fewer of them than ranks cost one whole on its owner, not a share).
        Moving one matrix at a time cannot find this: with one matrix per owner, moving any one alone costs
        every rank its distributed seconds without unloading the busiest owner."""
        order = sorted(idx, key=lambda i: (t_dist[i] / max(t_gather[i], 1e-30), self.names[i]))
        tail_sum, tail_max = [0.0] * (len(order) + 1), [0.0] * (len(order) + 1)
        for j in range(len(order) - 1, -1, -1):
            tail_sum[j] = tail_sum[j + 1] + t_gather[order[j]]
            tail_max[j] = max(tail_max[j + 1], t_gather[order[j]])
        best, best_k, head, owned_sum, owned_max = float("inf"), 0, 0.0, 0.0, 0.0
        for k in range(len(order) + 1):
            est = head + max((tail_sum[k] + owned_sum) / world, tail_max[k], owned_max)
            if est < best:
                best, best_k = est, k
            if k < len(order):
                i = order[k]
                head += t_dist[i] - t_shared[i] / world  # what every rank pays
                owned_sum += t_shared[i]
                owned_max = max(owned_max, t_shared[i])
        return order[:best_k]

    def modeled(self, rank: int | None = None) -> dict[str, float]:
        """This plan's modeled work on ``rank`` (default: this rank) per step: FLOPs by kind, bytes sent and
        received, collective rounds (bucketed: per strategy in use, not per matrix), seconds under the profile."""
        total = StepCost()
        used: dict[tuple, float] = {}
        used_node: dict[tuple, float] = {}
        for i, kind in enumerate(self.kinds):
            lay = self._layouts[i]
            r = lay.rank if rank is None else rank
            if kind == "gather" and self.owners[i] != r:
                piece = lay._piece_numel(lay.pieces[r])
                c = StepCost(sent=_B * piece * self.costs[i].channels, received=_B * piece, rounds=2.0)
                c = c.on_node() if self._group_on_node(i) else c
            elif kind == "team":
                c = self._team_cost(i, len(self._members(i)), self.factor_owners[i] == r, rank=r)
            else:
                c = self.op_cost(i, kind, owner=kind != "distributed" or self.factor_owners[i] == r)
            # rounds are bucketed: per strategy (per team: each has its own group), the most of its matrices
            key = (kind, self._members(i) if kind == "team" and r in self._members(i) else None)
            if c.sent or c.received:
                used[key] = max(used.get(key, 0.0), c.rounds)
            if c.node_sent or c.node_received:
                used_node[key] = max(used_node.get(key, 0.0), c.node_rounds)
            c.rounds = c.node_rounds = 0.0
            total += c
        total.rounds = sum(used.values())
        total.node_rounds = sum(used_node.values())
        return {
            "matmul_flops": total.matmul,
            "factor_flops": total.factor,
            "sent_bytes": total.sent + total.node_sent,
            "received_bytes": total.received + total.node_received,
            "node_bytes": total.node_bytes,
            "rounds": total.rounds + total.node_rounds,
            "seconds": total.seconds(self.profile),
        }

    def modeled_payload(
        self,
        rank: int | None = None,
        state_share: Callable[[int, int], float] | None = None,
        refresh: bool = False,
        steps: int | None = None,
    ) -> dict[str, float]:
        """Bytes ``rank`` hands to collectives per step by ``collective_counter`` tag (what ``comm_stats``
        records: the send buffer of each call), as the plan predicts them: ``gather`` (pieces to owners or
        teams and results back), ``realign`` (rows to the distributed row blocks and back), ``distributed``
        (reduced small matrices and shared factorizations), ``state`` (this rank's share of distributed and
        team matrices' resting state, all-gathered). ``state_share(i, rank)``: elements of matrix ``i``'s state
        the rank keeps and a step gathers (``state_split.moving_numel``; default: an even cut of
        ``OpCost.moving_state`` over the ranks that keep it). ``refresh``: a step at which every matrix
        refreshes (its ``refresh_reduced`` added to ``distributed``) instead of one between refreshes. ``steps``:
        the step count a split root took (its bytes follow it; ``split_steps`` otherwise: ASGO's is set by its
        statistic's spectrum, and its modeled count is ``ROOT_STEPS_MODELED``)."""
        out = {"gather": 0.0, "realign": 0.0, "distributed": 0.0, "state": 0.0}
        for i, kind in enumerate(self.kinds):
            lay, c = self._layouts[i], self.cost_of(i)
            r = lay.rank if rank is None else rank
            if kind == "gather" and lay.holders > 1:
                if self.owners[i] == r:  # the results of every other rank's piece
                    out["gather"] += _B * sum(lay._piece_numel(p) for q, p in enumerate(lay.pieces) if q != r)
                else:
                    out["gather"] += _B * c.channels * lay._piece_numel(lay.pieces[r])
            elif kind == "team":
                plan = self.plans[i]
                a0, a1 = plan.rows(r)
                back = (a1 - a0) * plan.a_shape[1] - (plan.moved(r, r) if a1 > a0 else 0)
                out["gather"] += _B * (c.channels * plan.sent[r] + back)
                if r in self._members(i):
                    if self.split_roots[i]:  # its blocks of the split root's all-gathers, no shared result
                        from .iterative import split_exchange

                        g = len(self._members(i))
                        gathers, _ = split_exchange(steps or c.split_steps, c.split_residual, c.split_form)
                        out["distributed"] += (
                            _B * (c.reduced + (c.refresh_reduced if refresh else 0.0))
                            + (gathers * -(-c.split_k // g) * c.split_k + (1 if c.split_residual else 0))
                            * c.split_itemsize
                        )
                    else:
                        out["distributed"] += _B * (c.reduced + c.shared + (c.refresh_reduced if refresh else 0.0))
                    out["state"] += _B * (
                        state_share(i, r) if state_share is not None else c.moving_state / len(self._members(i))
                    )
            elif kind == "distributed":
                plan = RowPlan.aligned(lay, self._transposes[i])
                back = sum(plan.moved(q, r) for q in range(lay.world) if q != r)
                out["realign"] += _B * (c.channels * plan.sent[r] + back)
                out["distributed"] += _B * (c.reduced + c.shared + (c.refresh_reduced if refresh else 0.0))
                out["state"] += _B * (state_share(i, r) if state_share is not None else c.moving_state / lay.world)
        return out

    def describe(self) -> str:
        """The plan as a table (one row per matrix: strategy, owner or team, modeled seconds on its owner, on a
        team's factorization member or on every rank) and a line with this rank's modeled step and the
        profile; the same text on every rank but the last line, which speaks for this rank."""
        rows = [f"{'matrix':40s} {'A shape':>13s} {'strategy':11s} {'owner':>11s} {'modeled ms':>10s}"]
        for i, (name, kind) in enumerate(zip(self.names, self.kinds)):
            shape = "x".join(map(str, self.a_shapes[i]))
            if kind == "gather":
                owner = str(self.owners[i])
            elif kind == "team":
                team = self._members(i)
                owner = (
                    f"{team[0]}-{team[-1]}" if team == tuple(range(team[0], team[-1] + 1)) else ",".join(map(str, team))
                )
            else:
                owner = "-"
            rows.append(f"{name[-40:]:40s} {shape:>13s} {kind:11s} {owner:>11s} {1e3 * self.seconds(i):10.3f}")
        m = self.modeled()
        rows.append(
            f"this rank: {1e3 * m['seconds']:.3f} ms modeled ({m['matmul_flops'] / 1e9:.3g} GFLOP products, "
            f"{m['factor_flops'] / 1e9:.3g} GFLOP factorizations, {m['sent_bytes'] / 2**20:.3g} MiB sent, "
            f"{m['received_bytes'] / 2**20:.3g} MiB received) under {self.profile.describe()}"
        )
        return "\n".join(rows)

    def _transient(self, i: int, rank: int | None) -> float:
        """Whole-tensor elements matrix ``i`` puts on ``rank`` during its bucket's step."""
        c, plan = self.cost_of(i), self.plans[i]
        r = plan.layout.rank if rank is None else rank
        if self.kinds[i] == "distributed":
            return c.state + c.reduced
        if self.kinds[i] == "team":
            a0, a1 = plan.rows(r)
            return c.state + c.reduced + (a1 - a0) * plan.a_shape[1] if r in self._members(i) else 0.0
        if self.kinds[i] == "gather":
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
        sub.teams = [self.teams[i] for i in idx]
        sub.split_roots = [self.split_roots[i] for i in idx]
        sub._team_factor = {}
        sub._cost, sub._cost_takes_parts, sub._split_costs = self._cost, self._cost_takes_parts, self._split_costs
        sub.team_size = self.team_size
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
        for i, (kind, plan) in enumerate(zip(self.kinds, self.plans)):
            c = self.cost_of(i)
            m, n = plan.a_shape
            # on its owner a gathered matrix is whole, on a team member one share of its rows
            whole = m * n if kind == "gather" else -(-m // len(self._members(i))) * n if kind == "team" else 0
            size = c.state + c.reduced + whole
            if not out or used + size > limit:
                out.append([])
                used = 0.0
            out[-1].append(i)
            used += size
        return out

    def active(self, i: int) -> bool:
        """Whether this rank computes matrix ``i`` (holds its rows, or takes part in its reductions)."""
        kind = self.kinds[i]
        if kind == "gather":
            return self.owners[i] == self.plans[i].layout.rank
        if kind == "team":
            return self.plans[i].layout.rank in self._members(i)
        return True

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
            out.append(flat[pos : pos + len(chans)])
            pos += len(chans)
        return out

    def from_blocks(self, blocks: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        """Row-block results (``None`` where this rank computed nothing) -> this rank's 1-D pieces."""
        return from_blocks(
            self.plans, blocks, [self._tag(i) for i in range(len(self))], getattr(self, "_device", "cpu")
        )

    def _tag(self, i: int) -> str:
        return "realign" if self.kinds[i] == "distributed" else "gather"

    def allreduce(self, parts: dict[int, torch.Tensor], symmetric: bool = False) -> dict[int, torch.Tensor]:
        """Sum each split matrix's partial tensor over the ranks that compute it: one all-reduce per process
        group and dtype for the ``distributed`` ones, then one per team and dtype, on the team's own group
        (teams in the order of their member sets, so a rank in several teams meets them as every other
        member does); others are returned as they are (their ranks already hold every row). ``symmetric``:
        every part is a symmetric ``k x k`` matrix; its upper triangle is sent (half the bytes) and the sum
        comes back exactly symmetric."""
        buckets: dict[tuple, list[int]] = {}
        for i in sorted(parts):
            if self.split(i):
                lay = self.plans[i].layout
                buckets.setdefault((id(lay.group), self.teams[i], parts[i].dtype), []).append(i)
        out = dict(parts)
        keys = [k for k in buckets if k[1] is None] + sorted(
            (k for k in buckets if k[1] is not None), key=lambda k: (k[1], str(k[2]))
        )
        for key in keys:
            idx = buckets[key]
            lay = self.plans[idx[0]].layout
            pieces = [_triangle(parts[i]) if symmetric else parts[i].reshape(-1) for i in idx]
            flat = torch.cat(pieces) if len(pieces) > 1 else pieces[0].clone()
            collective_counter.record(flat, "distributed")
            group = lay.group if key[1] is None else team_group(lay.group, key[1])
            staging.all_reduce(flat, group)  # through the device for CPU pieces on NCCL (offload)
            pos = 0
            for i, piece in zip(idx, pieces):
                k = piece.numel()
                chunk = flat[pos : pos + k]
                out[i] = _from_triangle(chunk, parts[i].shape[-1]) if symmetric else chunk.view(parts[i].shape)
                pos += k
        return out

    def assemble(self, blocks: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Row blocks of small tall matrices (rows of ``A`` x k) -> the whole matrix on every rank that computes."""
        full = {}
        for i, b in blocks.items():
            if self.split(i):
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
            c = self.cost_of(i)
            a0, a1 = plan.rows()
            share = (a1 - a0) / max(plan.a_shape[0], 1)
            small = (
                c.small_flops + c.small_matmul
                if not (self.split(i) and c.shared) or self.factor_owners[i] == plan.layout.rank
                else 0.0
            )
            if self.split_roots[i]:  # every member its rows of the root's products
                small = c.small_matmul * self._split_share(c, len(self._members(i)))
            totals[self.kinds[i]] = totals.get(self.kinds[i], 0.0) + c.row_flops * share + small
        return totals


def _triangle(x: torch.Tensor) -> torch.Tensor:
    """The upper triangle of a square matrix, row by row (what a symmetric reduction sends)."""
    if x.dim() != 2 or x.shape[0] != x.shape[1]:
        raise ValueError(f"a symmetric reduction takes square matrices, got shape {tuple(x.shape)}")
    k = x.shape[-1]
    rows, cols = _triu(k, x.device)
    return x[rows, cols]


def _from_triangle(flat: torch.Tensor, k: int) -> torch.Tensor:
    """The symmetric ``k x k`` matrix whose upper triangle is ``flat``."""
    rows, cols = _triu(k, flat.device)
    out = flat.new_empty(k, k)
    out[rows, cols] = flat
    out[cols, rows] = flat
    return out


_TRIU: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _triu(k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (k, str(device))
    found = _TRIU.get(key)
    if found is None:
        rows, cols = torch.triu_indices(k, k, device=device).unbind(0)
        found = _TRIU[key] = (rows, cols)
    return found


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


def _balance_weights(
    costs: Sequence[OpCost], shapes: Sequence[tuple[int, int]], profile: HardwareProfile | None = None
) -> list[float]:
    """One number per gathered matrix for the owner plan: its share of the gathered work (FLOPs, or with a
    profile modeled seconds: a factorization call weighs its latency) plus its share of the gathered small
    state, so owners end up balanced in both time and memory."""
    work = [_gather_cost(c, s, profile) for c, s in zip(costs, shapes)]
    total_work = sum(work) or 1.0
    total_state = sum(c.state for c in costs)
    return [w / total_work + (c.state / total_state if total_state else 0.0) for w, c in zip(work, costs)]


def _gather_cost(c: OpCost, shape: tuple[int, int], profile: HardwareProfile | None = None) -> float:
    """A gathered matrix's work on its owner: FLOPs with its moved bytes at ``FLOPS_PER_BYTE``, or, under a
    ``profile``, the same in seconds (factorizations at their rate and latency)."""
    m, n = shape
    flops = FLOPS_PER_BYTE * 4 * 2 * m * n + c.row_flops + c.small_matmul
    if profile is None:
        return flops + c.small_flops
    return profile.seconds(matmul=flops, factor=c.small_flops, calls=c.small_calls)
