"""Teams (issue 27, item 4): a matrix computed by a group of ranks, planned without processes.

What is checked here from static layouts (``MatrixLayout.row_chunks`` / ZeRO-like flat ranges at simulated
world sizes): the team row plans and state placements, the packing (aligned blocks, the memory budget, the
same plan on every rank), what ``auto`` gains from teams at scale, the bytes the plan predicts for a team
against a count from the row plans, the symmetric reductions and Muon's split Newton-Schulz form. The
collectives themselves run in ``tests_dist`` (parity, checkpoints and the time model's bytes with teams).
"""

from __future__ import annotations

import math

import pytest
import torch

from shardopt.sharding import MatrixLayout
from shardopt.sharding.blocks import RowPlan
from shardopt.sharding.layout import FlatPiece
from shardopt.sharding.matfun import MUON_COEFFICIENTS, complete_locally, muon_gram_products, newton_schulz_iteration
from shardopt.sharding.matrix_ops import MatrixOps, _from_triangle, _triangle
from shardopt.sharding.state_split import Placement, share, share_shape
from shardopt.sharding.teams import TeamCost, choose, pack, team_sizes

GROUP = object()
_BLOCK = [(4096, 4096)] * 4 + [(11008, 4096), (11008, 4096), (4096, 11008)]


def _muon_cost(a_shape, parts=1):
    from shardopt.optim.muon import Muon

    return Muon.whole_matrix_cost(None, {"ns_steps": 5}, a_shape, parts)


def _asgo(a_shape, parts=1):
    from shardopt.optim.asgo import _asgo_cost

    return _asgo_cost(a_shape)


def _plan(shapes, strategy, cost, world, rank=0, **kw):
    lays = [MatrixLayout.row_chunks(s, world, rank, GROUP) for s in shapes]
    names = [f"layers.{i}.weight" for i in range(len(shapes))]
    return MatrixOps(lays, names, [m < n for m, n in shapes], strategy, cost, **kw)


def _busiest(ops, world):
    return max(ops.modeled(r)["seconds"] for r in range(world))


# ---------------------------------------------------------------------------------------------- row plans
def test_team_row_plan_spreads_rows_evenly_over_the_members_only():
    lay = MatrixLayout.row_chunks((10, 6), 8, 0, GROUP)
    plan = RowPlan.team(lay, transpose=False, members=(2, 3, 4))
    assert [plan.rows(r) for r in range(8)] == [(0, 0), (0, 0), (0, 4), (4, 8), (8, 10), (10, 10), (10, 10), (10, 10)]
    # every element of a member's rows comes from the rank holding it; a non-member receives nothing
    for d in range(8):
        a0, a1 = plan.rows(d)
        assert sum(plan.moved(s, d) for s in range(8)) == (a1 - a0) * 6
    assert sum(plan.sent) + sum(plan.moved(r, r) for r in range(8)) == 60


def test_team_placement_cuts_state_over_the_members():
    lay = MatrixLayout.row_chunks((16, 8), 4, 1, GROUP)
    place = Placement.of(RowPlan.team(lay, False, (2, 3)), None, (2, 3))
    assert [share(place, 10, r) for r in range(4)] == [(0, 0), (0, 0), (0, 5), (5, 10)]
    assert share_shape(place, (7, 10), 1, 3) == (7, 5) and share_shape(place, (7, 10), 1, 0) == (7, 0)
    assert share_shape(place, (), None, 0) == ()  # counters on every rank


# ---------------------------------------------------------------------------------------------- packing
def test_team_sizes_are_powers_of_two_and_the_world():
    assert team_sizes(12) == [1, 2, 4, 8, 12] and team_sizes(8, smallest=2) == [2, 4, 8]


def test_pack_puts_teams_on_aligned_blocks_and_the_factorization_on_the_least_loaded_member():
    world = 8
    costs = {0: {4: TeamCost(4, 1.0, 3.0)}, 1: {2: TeamCost(2, 2.0, 2.0)}, 2: {1: TeamCost(1, 5.0, 5.0)}}
    base = torch.zeros(world, dtype=torch.float64)
    base[0] = 0.5
    plan = pack(
        [2, 0, 1],
        {0: 4, 1: 2, 2: 1},
        costs,
        world,
        base,
        {0: 8.0, 1: 2.0, 2: 1.0},
        {0: None, 1: None, 2: None},
        lambda h, big, share: torch.ones_like(h, dtype=torch.bool),
    )
    assert plan.members[2] == (1,)  # the least-loaded rank (rank 0 has 0.5 already)
    assert plan.members[0] == (4, 5, 6, 7)  # the block without the loaded rank 1
    assert plan.factor[0] == 4 and plan.load[4] == 3.0 and plan.load[5] == 1.0
    assert plan.members[1] == (2, 3)
    assert plan.busiest == 5.0


def test_pack_respects_the_memory_budget_and_sole_holders():
    world = 4
    costs = {0: {2: TeamCost(2, 1.0, 1.0)}, 1: {1: TeamCost(1, 1.0, 1.0)}}
    cap = lambda h, big, share: h + share <= 3.0  # noqa: E731
    plan = pack(
        [1, 0],
        {0: 2, 1: 1},
        costs,
        world,
        torch.zeros(world, dtype=torch.float64),
        {0: 4.0, 1: 2.0},
        {0: None, 1: 3},
        cap,
    )
    assert plan.members[1] == (3,)  # held whole by rank 3: it stays there
    assert plan.members[0] == (0, 1)  # 2 each; the block (2, 3) would put rank 3 at 4
    assert (
        pack([0], {0: 2}, costs, world, torch.zeros(world, dtype=torch.float64), {0: 8.0}, {0: None}, cap) is None
    )  # no team has room


def test_choose_takes_bigger_teams_where_matrices_are_fewer_than_ranks():
    """Two big matrices on 8 ranks: one owner each leaves 6 ranks idle; teams of four finish sooner."""
    world = 8
    costs = {i: {g: TeamCost(g, 10.0 / g + 0.1 * g, 10.0 / g + 0.1 * g) for g in team_sizes(world)} for i in range(2)}
    plan = choose(
        [0, 1],
        ["a", "b"],
        costs,
        world,
        torch.zeros(world, dtype=torch.float64),
        {0: 0.0, 1: 0.0},
        {0: None, 1: None},
        lambda h, big, share: torch.ones_like(h, dtype=torch.bool),
    )
    assert sorted(len(m) for m in plan.members.values()) == [4, 4]
    assert plan.busiest == pytest.approx(10.0 / 4 + 0.4)


# ---------------------------------------------------------------------------------------------- plans
@pytest.mark.parametrize("world", [64, 1024])
def test_auto_uses_teams_where_the_largest_matrix_bounds_the_busiest_owner(world):
    """Muon on 7B-like matrices: an owner's 4096 x 11008 Newton-Schulz is 4.4 TFLOP; at P = 1024 teams bring
    the busiest rank close to the total work / P, below either forced strategy."""
    shapes = _BLOCK * 4
    plans = {s: _plan(shapes, s, _muon_cost, world, profile="gpu") for s in ("auto", "gather", "distributed")}
    t = {s: _busiest(p, world) for s, p in plans.items()}
    assert t["auto"] <= min(t["gather"], t["distributed"]) * (1 + 1e-9), t
    if world == 1024:
        assert "team" in plans["auto"].kinds and t["auto"] < 0.5 * t["gather"], t


def test_every_rank_derives_the_same_team_plan():
    world = 16
    shapes = _BLOCK * 2
    plans = [_plan(shapes, "team", _asgo, world, rank=r, profile="gpu") for r in range(world)]
    first = plans[0]
    assert set(first.kinds) == {"team"}
    for p in plans[1:]:
        assert p.kinds == first.kinds and p.teams == first.teams and p.factor_owners == first.factor_owners
        assert [q.starts for q in p.plans] == [q.starts for q in first.plans]


def test_forced_team_size_and_what_each_rank_computes():
    world = 8
    shapes = [(64, 32)] * 6
    ops = _plan(shapes, "team", _asgo, world, rank=5, profile="cpu", team_size=4)
    assert all(len(t) == 4 and t in ((0, 1, 2, 3), (4, 5, 6, 7)) for t in ops.teams)
    assert [ops.active(i) for i in range(6)] == [5 in t for t in ops.teams]
    assert all(ops.split(i) and ops.parts(i) == 4 for i in range(6))
    assert all(ops.factor_owners[i] in ops.teams[i] for i in range(6))
    assert "team" in ops.describe()


def test_a_matrix_held_whole_by_one_rank_stays_there_under_teams():
    lay = MatrixLayout(
        (32, 16), [FlatPiece(0, 0), FlatPiece(0, 512), FlatPiece(512, 512), FlatPiece(512, 512)], 0, GROUP
    )
    ops = MatrixOps([lay], ["w"], [False], "team", _asgo, profile="cpu", team_size=2)
    assert ops.kinds == ["gather"] and ops.owners == [1]


def test_modeled_team_bytes_equal_a_count_from_the_row_plans():
    """``modeled_payload`` of a team matrix against the elements its row plan moves (pieces in, results out)
    and the reduced matrices and state among its members."""
    world = 8
    shapes = [(96, 40), (40, 96)]
    for rank in range(world):
        ops = _plan(shapes, "team", _asgo, world, rank=rank, profile="cpu", team_size=4)
        got = ops.modeled_payload()
        gather = distributed = state = 0.0
        for i, plan in enumerate(ops.plans):
            c = ops.cost_of(i)
            to = sum(plan.moved(rank, d) for d in range(world) if d != rank)
            back = sum(plan.moved(s, rank) for s in range(world) if s != rank)
            gather += 4 * (c.channels * to + back)
            if rank in ops.teams[i]:
                distributed += 4 * (c.reduced + c.shared)
                state += 4 * c.state / 4
        assert got["gather"] == pytest.approx(gather) and got["realign"] == 0
        assert got["distributed"] == pytest.approx(distributed) and got["state"] == pytest.approx(state)


def test_buckets_and_transients_count_a_members_share_of_the_rows():
    world = 4
    ops = _plan([(64, 32)] * 3, "team", _asgo, world, rank=0, profile="cpu", team_size=2)
    c = ops.cost_of(0)
    member = [i for i in range(3) if 0 in ops.teams[i]]
    assert ops.peak_transient(limit=1e12) == pytest.approx(sum(c.state + c.reduced + 32 * 32 for _ in member))


# ---------------------------------------------------------------------------------------------- numerics
def test_symmetric_reductions_send_the_upper_triangle():
    x = torch.randn(5, 5, dtype=torch.float64)
    x = x + x.T
    tri = _triangle(x)
    assert tri.numel() == 15
    assert torch.equal(_from_triangle(tri, 5), x)


def test_muon_split_form_equals_the_standard_iteration():
    """``a x + b G x + c G (G x)`` is the quintic step ``a x + (b G + c G^2) x`` (fp32 rounding)."""
    torch.manual_seed(0)
    x = torch.randn(3, 24, 40)
    plain = complete_locally(newton_schulz_iteration(x, 5, MUON_COEFFICIENTS, 1e-7))
    split = complete_locally(newton_schulz_iteration(x, 5, MUON_COEFFICIENTS, 1e-7, gram_products=True))
    assert torch.allclose(plain, split, atol=2e-6, rtol=0)
    assert muon_gram_products((11008, 4096), 8) and not muon_gram_products((11008, 4096), 2)
    assert not muon_gram_products((11008, 4096), 1)


def test_muon_split_cost_has_no_repeated_small_products():
    whole, split = _muon_cost((11008, 4096), 1), _muon_cost((11008, 4096), 8)
    assert whole.small_matmul == 5 * 2.0 * 4096**3 and split.small_matmul == 0.0
    assert split.row_flops == 5 * 6.0 * 4096**2 * 11008
    assert split.reduced == 5 * 4096 * 4097 // 2 + 1 and split.rounds == 6
    assert math.isclose(whole.row_flops, 5 * 4.0 * 4096**2 * 11008)


# ---------------------------------------------------------------------------------------------- split roots (issue 53)
def _on_team(g, fn):
    """``fn(rows)`` on ``g`` members in threads whose ``rows`` exchange blocks through memory (a team's
    all-gathers and sums, without processes): every member's result."""
    import threading

    from shardopt.sharding.teams import RowExchange

    slots, results = [None] * g, [None] * g
    barrier = threading.Barrier(g)

    class Rows:
        bounds = RowExchange.bounds

        def __init__(self, j):
            self.index, self.size, self.steps = j, g, 0

        def _swap(self, value):
            slots[self.index] = value
            barrier.wait()
            got = list(slots)
            barrier.wait()
            return got

        def gather(self, blocks):
            got = self._swap([b.clone() for b in blocks])
            return [torch.cat([got[m][j] for m in range(g)], 1) for j in range(len(blocks))]

        def sum(self, x):
            return sum(self._swap(x.clone()))

    threads = [threading.Thread(target=lambda j=j: results.__setitem__(j, fn(Rows(j)))) for j in range(g)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _spd(batch, k, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, k, 2 * k, generator=gen, dtype=torch.float64)
    return (x @ x.mT / k).to(dtype)


@pytest.mark.parametrize("g", [2, 3])
def test_split_coupled_root_equals_the_whole_iteration(g):
    """SWAN's fp32 whitening root with its products cut into row blocks over g members (k = 37: uneven blocks)
    is the whole iteration's to fp32 rounding, identical on every member."""
    from shardopt.sharding.iterative import coupled_inverse_sqrt_rows
    from shardopt.sharding.matfun import coupled_inverse_sqrt

    a = _spd(3, 37, torch.float32)
    want = coupled_inverse_sqrt(a, 12, 1e-12)
    got = _on_team(g, lambda rows: coupled_inverse_sqrt_rows(a, 12, 1e-12, rows))
    for r in got:
        assert torch.equal(r, got[0])
        assert (r - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("g", [2, 3, 4, 5])
def test_split_checked_root_equals_the_whole_iteration(g):
    """ASGO's checked float64 root: the same step count, residual test and result (to float64 rounding)."""
    from shardopt.sharding.iterative import inverse_sqrt_checked, inverse_sqrt_checked_rows

    a = _spd(2, 24, torch.float64) + 1e-3 * torch.eye(24, dtype=torch.float64)
    want, ok = inverse_sqrt_checked(a, 1e-3)
    got = _on_team(g, lambda rows: (inverse_sqrt_checked_rows(a, 1e-3, rows), rows.steps))
    assert bool(ok.all())
    for (root, good), steps in got:
        assert torch.equal(good, ok) and steps == got[0][1] > 0
        assert (root - want).abs().max() <= 1e-12 * want.abs().max()


def test_split_exchange_counts_what_the_iteration_moves():
    from shardopt.sharding.iterative import coupled_iteration_rows, split_exchange

    a = _spd(1, 8, torch.float64)
    for steps in (1, 2, 5):
        for residual in (False, True):
            counted = []

            def run(rows, steps=steps, residual=residual, counted=counted):
                gather, total = rows.gather, rows.sum
                rows.gather = lambda blocks: (counted.append(len(blocks)) if rows.index == 0 else None, gather(blocks))[
                    1
                ]
                rows.sum = lambda x: (counted.append(0) if rows.index == 0 else None, total(x))[1]
                return coupled_iteration_rows(a, torch.linalg.matrix_norm(a), steps, rows, residual)

            _on_team(2, run)
            assert (sum(counted), len(counted)) == split_exchange(steps, residual), (steps, residual, counted)
