"""Owner plans for whole-matrix operations: balanced, and a pure function of static metadata."""

from __future__ import annotations

import types

from shardopt.sharding import MatrixLayout
from shardopt.sharding.owner import newton_schulz_cost, owner_plan

GROUP = object()


def layouts(shapes, world=4, rank=0):
    return [MatrixLayout.row_chunks(s, world, rank, GROUP) for s in shapes]


def test_lpt_balances_within_25_percent_of_the_mean():
    # two LLaMA-60M blocks (q, k, v, o, gate, up, down): 14 matrices on 4 ranks
    block = [(512, 512)] * 4 + [(1376, 512), (1376, 512), (512, 1376)]
    shapes = block * 2
    names = [f"layers.{i // 7}.w{i % 7}" for i in range(len(shapes))]
    owners = owner_plan(layouts(shapes), names, newton_schulz_cost)
    load = [0.0] * 4
    for s, o in zip(shapes, owners):
        load[o] += newton_schulz_cost(s)
    assert max(load) <= 1.25 * (sum(load) / 4), load


def test_every_rank_derives_the_same_plan_from_the_same_metadata():
    shapes = [(64, 32), (32, 64), (64, 32), (16, 16), (128, 8), (8, 128), (64, 64), (48, 24)]
    names = [f"layer{i}.weight" for i in range(len(shapes))]
    plans = [owner_plan(layouts(shapes, rank=r), names, newton_schulz_cost) for r in range(4)]
    assert all(p == plans[0] for p in plans)  # the plan does not depend on which rank computes it
    assert set(plans[0]) == {0, 1, 2, 3}


def test_whole_matrices_are_computed_locally():
    assert owner_plan([MatrixLayout.whole((4, 4))], ["w"], newton_schulz_cost) == [-1]


def _ops(strategy, rank=0, cost=None):
    from shardopt.optim.asgo import _asgo_cost
    from shardopt.sharding.matrix_ops import MatrixOps

    block = [(512, 512)] * 4 + [(1376, 512), (1376, 512), (512, 1376)]
    shapes = block * 2
    names = [f"layers.{i // 7}.w{i % 7}" for i in range(len(shapes))]
    lays = layouts(shapes, rank=rank)
    return MatrixOps(lays, names, [m < n for m, n in shapes], strategy, cost or _asgo_cost), shapes


def test_gathered_asgo_roots_balance_within_25_percent_of_the_mean():
    from shardopt.sharding.matrix_ops import _gather_cost

    ops, shapes = _ops("gather")
    load = [0.0] * 4
    for i, o in enumerate(ops.owners):
        load[o] += _gather_cost(ops.costs[i], shapes[i])
    assert max(load) <= 1.25 * (sum(load) / 4), load


def test_every_rank_derives_the_same_strategy_and_owners():
    for strategy in ("auto", "gather", "distributed"):
        plans = [_ops(strategy, rank=r)[0] for r in range(4)]
        assert all(p.kinds == plans[0].kinds and p.owners == plans[0].owners for p in plans), strategy
        assert all([pl.starts for pl in p.plans] == [pl.starts for pl in plans[0].plans] for p in plans)


def test_owners_balance_state_and_flops_together_on_llama_60m():
    """Under gather the owner keeps a matrix's small state: owners must balance memory as well as time."""
    from shardopt.optim.alice import Alice
    from shardopt.optim.asgo import _asgo_cost
    from shardopt.optim.sumo import SUMO
    from shardopt.sharding.matrix_ops import MatrixOps, _gather_cost

    cpu = types.SimpleNamespace(iterative_routes=lambda group: False)  # the CPU's routes (the optimizer's self)
    block = [(512, 512)] * 4 + [(1376, 512), (1376, 512), (512, 1376)]
    shapes = block * 8  # LLaMA-60M: 8 layers
    names = [f"layers.{i // 7}.w{i % 7}" for i in range(len(shapes))]
    rules = {
        "sumo": (
            lambda s: SUMO.whole_matrix_cost(
                cpu, {"rank": 128, "oversample": 10, "power_iters": 2, "refresh_interval": 200}, s
            ),
            lambda m, n: m < n,
        ),
        "alice": (
            lambda s: Alice.whole_matrix_cost(cpu, {"rank": 128, "tracking": True, "refresh_interval": 200}, s),
            lambda m, n: m > n,
        ),
        "asgo": (_asgo_cost, lambda m, n: m < n),
    }
    for name, (cost, transpose) in rules.items():
        for world in (4, 8):
            ops = MatrixOps(layouts(shapes, world=world), names, [transpose(*s) for s in shapes], "gather", cost)
            state, work = [0.0] * world, [0.0] * world
            for i, o in enumerate(ops.owners):
                state[o] += ops.costs[i].state
                work[o] += _gather_cost(ops.costs[i], shapes[i])
            assert max(state) <= 1.25 * sum(state) / world, (name, world, state)
            assert max(work) <= 1.25 * sum(work) / world, (name, world, work)
