"""Small state at rest: shares partition every state tensor, follow the rows of A, put everything on the
owner under gather; bucketed steps equal one-bucket steps; the planner's per-rank state equals what a step
allocates."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_model import Tiny
from torch import nn

import shardopt
from shardopt.optim.registry import OPTIMIZERS
from shardopt.sharding import FlatPiece, MatrixLayout
from shardopt.sharding.blocks import RowPlan
from shardopt.sharding.state_split import ROWS, Placement, keep_share, moving_numel, share, share_numel, share_shape

GROUP = object()
WHOLE_MATRIX = ("swan", "asgo", "sumo", "alice", "alice0")


def flat_layout(shape, world, rank, rng):
    m, n = shape
    cuts = sorted(rng.randint(0, m * n) for _ in range(world - 1))
    bounds = [0, *cuts, m * n]
    return MatrixLayout(shape, [FlatPiece(a, b) for a, b in zip(bounds, bounds[1:])], rank, GROUP)


@pytest.mark.parametrize("seed", range(20))
def test_shares_partition_every_dimension_evenly_and_owners_keep_everything(seed):
    rng = random.Random(seed)
    shape, world = (rng.randint(1, 40), rng.randint(1, 40)), rng.randint(2, 6)
    lay = flat_layout(shape, world, 0, rng)
    for transpose in (False, True):
        plan = RowPlan.aligned(lay, transpose)
        even = Placement.of(plan, None)  # distributed: cut like torch.chunk (DTensor's Shard), whatever rows
        for length in (plan.a_shape[0], plan.a_shape[1], 7, 1):
            spans = [share(even, length, r) for r in range(world)]
            assert spans[0][0] == 0 and spans[-1][1] == length
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # contiguous, disjoint, complete
            chunks = torch.arange(length).chunk(world)
            assert [hi - lo for lo, hi in spans][: len(chunks)] == [len(c) for c in chunks]
        owner = rng.randrange(world)
        gathered = Placement.of(RowPlan.owner(lay, transpose, owner), owner)
        for r in range(world):
            want = (5, 3) if r == owner else (5, 0)
            assert share_shape(gathered, (5, 3), 1, r) == want  # the owner keeps all of it, others nothing
        spec = {"basis": ((plan.a_shape[0], 3), 0), "moment": ((3, plan.a_shape[1]), 1), "n": ((), None)}
        for place in (even, gathered):
            total = sum(share_numel(place, spec, r) for r in range(world))
            assert total == 3 * plan.a_shape[0] + 3 * plan.a_shape[1] + world  # 0-d entries: one per rank


@pytest.mark.parametrize("seed", range(20))
def test_rows_state_rests_with_the_rows_each_rank_computes_on(seed):
    """``ROWS`` state (SUMO's Q, Alice's U) is cut like the row plan (uneven where engines cut flat ranges),
    partitions its rows, is whole on a gather owner, and is left out of what a step gathers."""
    rng = random.Random(seed)
    shape, world = (rng.randint(1, 40), rng.randint(1, 40)), rng.randint(2, 6)
    r = rng.randint(1, 5)
    for rank in range(world):
        lay = flat_layout(shape, world, rank, random.Random(seed))
        for transpose in (False, True):
            plan = RowPlan.aligned(lay, transpose)
            rows, cols = plan.a_shape
            place = Placement.of(plan, None)
            spans = [share(place, rows, q, ROWS) for q in range(world)]
            assert spans == [plan.rows(q) for q in range(world)]
            assert share_shape(place, (rows, r), ROWS) == (plan.rows()[1] - plan.rows()[0], r)
            assert share(place, rows, rank, 0) == share(place, rows, rank)  # a plain dim 0 stays even
            full = torch.arange(rows * r, dtype=torch.float32).view(rows, r)
            a0, a1 = plan.rows()
            assert torch.equal(keep_share(place, full, ROWS), full[a0:a1])
            spec = {"Q": ((rows, r), ROWS), "M": ((r, cols), 1), "n": ((), None)}
            assert sum(share_numel(place, spec, q) for q in range(world)) == r * (rows + cols) + world
            assert moving_numel(place, spec, rank) == share_numel(place, {"M": spec["M"]}, rank)
            owner = rng.randrange(world)
            gathered = Placement.of(RowPlan.owner(lay, transpose, owner), owner)
            assert share_shape(gathered, (rows, r), ROWS, owner) == (rows, r)
            assert share_shape(gathered, (rows, r), ROWS, (owner + 1) % world) == (0, r)


def train(name, steps=3, **kw):
    torch.manual_seed(0)
    model = Tiny()
    opt = shardopt.create_optimizer(model, name, **kw)
    x = torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        opt.step()
    return model, opt


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("name", WHOLE_MATRIX)
def test_a_step_in_many_buckets_equals_one_bucket(name):
    one, _ = train(name)
    many, opt = train(name, matrix_ops={"bucket_mb": 1e-6})  # every matrix in a bucket of its own
    plan = next(opt.matrix_plan(g) for g in range(len(opt.param_groups)) if opt.matrix_plan(g) is not None)
    assert len(plan.buckets(opt.matrix_bucket_elements)) == len(plan)
    for (n, a), b in zip(one.named_parameters(), many.parameters()):
        assert torch.equal(a, b), n


def _held(opt) -> int:
    total = 0

    def walk(d):
        nonlocal total
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v)
            elif isinstance(v, torch.Tensor) and k != "step":
                total += v.numel()

    for st in opt.state.values():
        walk(st)
    return total


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_planned_state_equals_what_a_step_allocates(name):
    _, opt = train(name, steps=2)
    assert sum(opt.planned_state_elements().values()) == _held(opt)
