"""Whole-matrix operations on sharded matrices: one step's strategy, row blocks and bucketed reductions.

An algorithm that needs Gram matrices, projections, SVDs or eigendecompositions is written once against
``MatrixOps``: it asks for row blocks of each oriented matrix ``A`` (``to_blocks``), computes partial sums
over its rows and has them reduced (``allreduce``, one collective per process group for all matrices), runs
small factorizations on identical inputs on every rank that takes part, and returns row-block results
(``from_blocks``). Each matrix gets one strategy:

* ``local``: not sharded (single process, DDP replicas); nothing is communicated.
* ``gather``: an owner rank (longest-processing-time on estimated cost, identical on every rank) receives
  the whole matrix, computes alone, and sends every rank its piece of the result; the others skip it.
* ``distributed``: rows stay where the engine put them (only rows cut by a partition boundary move; across
  the grain an all-to-all of ~1/P of the matrix per rank), every rank computes on its rows, and sums over
  rows are all-reduced: small ``k x k`` / ``r x n`` matrices instead of the matrix itself.

``strategy="auto"`` picks per matrix the one with the lower estimated per-rank cost (bytes moved weighted by
``FLOPS_PER_BYTE`` plus FLOPs; a gathered matrix costs its owner the whole op, about 1/P per rank once the
owner plan balances them; the distributed strategy splits the row products and repeats small factorizations); ``"gather"`` / ``"distributed"`` force one. A matrix
held whole by a single rank of its group is computed there with no communication under any strategy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import torch

from .blocks import RowPlan, from_blocks, to_blocks
from .comm import collective_counter
from .layout import MatrixLayout
from .owner import owner_plan

__all__ = ["MatrixOps", "OpCost", "Strategy", "FLOPS_PER_BYTE", "STRATEGIES"]

Strategy = Literal["auto", "gather", "distributed"]
STRATEGIES = ("auto", "gather", "distributed")
#: how many FLOPs one byte on the network is worth in the strategy choice (~ a GPU's FLOP rate over its
#: interconnect bandwidth, an order of magnitude below it to favour moving little data)
FLOPS_PER_BYTE = 100.0


@dataclass(frozen=True)
class OpCost:
    """Estimated work of one matrix's step on the oriented ``A`` (rows x cols).

    ``row_flops``: FLOPs that split with the rows of ``A`` (products with ``A``); ``small_flops``: FLOPs every
    participating rank repeats (factorizations of small matrices); ``reduced``: fp32 elements all-reduced per
    step under the distributed strategy.
    """

    row_flops: float
    small_flops: float = 0.0
    reduced: float = 0.0


class MatrixOps:
    """The whole-matrix plan of one step for ``layouts`` (oriented by ``transposes``), identical on every rank."""

    def __init__(self, layouts: Sequence[MatrixLayout], names: Sequence[str], transposes: Sequence[bool],
                 strategy: str, cost: Callable[[tuple[int, int]], OpCost]):
        if strategy not in STRATEGIES:
            raise ValueError(f"matrix_ops strategy must be one of {STRATEGIES}, got {strategy!r}")
        self.names = list(names)
        n = len(layouts)
        self.kinds: list[str] = []
        self.costs: list[OpCost] = []
        for lay, t in zip(layouts, transposes):
            a_shape = (lay.shape[1], lay.shape[0]) if t else lay.shape
            c = cost(a_shape)
            self.costs.append(c)
            if lay.group is None:
                self.kinds.append("local")
            elif lay.holders <= 1 or strategy == "gather":
                self.kinds.append("gather")
            elif strategy == "distributed":
                self.kinds.append("distributed")
            else:
                self.kinds.append(self._cheaper(lay, t, c))
        gathered = [i for i in range(n) if self.kinds[i] == "gather"]
        owners = owner_plan([layouts[i] for i in gathered], [self.names[i] for i in gathered],
                            [_gather_cost(self.costs[i], layouts[i].shape) for i in gathered])
        self.owners = [-1] * n
        for i, o in zip(gathered, owners):
            self.owners[i] = o
        self.plans: list[RowPlan] = []
        for i, (lay, t) in enumerate(zip(layouts, transposes)):
            if self.kinds[i] == "gather":
                self.plans.append(RowPlan.owner(lay, t, self.owners[i]))
            else:
                self.plans.append(RowPlan.aligned(lay, t))

    @staticmethod
    def _cheaper(lay: MatrixLayout, transpose: bool, c: OpCost) -> str:
        """Per-rank cost of each strategy: gathering spreads whole matrices over the ranks (the owner plan
        balances them), so a rank pays about 1/P of a matrix's bytes and FLOPs; the distributed strategy splits
        the row products but repeats the small factorizations on every rank."""
        plan = RowPlan.aligned(lay, transpose)
        p = lay.holders
        dist = FLOPS_PER_BYTE * 4 * (2 * max(plan.sent) + 2 * c.reduced) + c.row_flops / p + c.small_flops
        return "distributed" if dist <= _gather_cost(c, lay.shape) / p else "gather"

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self.plans)

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
        """Add this step's estimated FLOPs on this rank, by strategy, to the active counters."""
        for i, c in enumerate(self.costs):
            if not self.active(i):
                continue
            plan = self.plans[i]
            a0, a1 = plan.rows()
            share = (a1 - a0) / max(plan.a_shape[0], 1)
            collective_counter.add_flops(self.kinds[i], c.row_flops * share + c.small_flops)


def _gather_cost(c: OpCost, shape: tuple[int, int]) -> float:
    m, n = shape
    return FLOPS_PER_BYTE * 4 * 2 * m * n + c.row_flops + c.small_flops
