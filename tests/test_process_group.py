"""The trainer's restart-safe default group (issue 65): the ranks of one torchrun attempt agree on a generation that no
earlier attempt on the same store used, whatever the stale keys and whoever starts first
(``shardopt.train.process_group``; the real restarts: tests_dist/test_train_dist.py)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from shardopt.train.process_group import agree_generation


def attempt(store: dist.Store, world: int, order: list[int], delay: float = 0.02) -> list[int]:
    """One attempt's ranks, started in ``order`` ``delay`` seconds apart: the generation each returns."""
    got = [0] * world
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            got[r] = agree_generation(store, r, world, timedelta(seconds=20))
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = []
    for r in order:
        t = threading.Thread(target=rank, args=(r,))
        t.start()
        threads.append(t)
        time.sleep(delay)
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    return got


def test_every_attempt_agrees_on_a_fresh_generation():
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=20))
    seen = []
    # rank 0 first, last, in the middle; the second and later attempts find the earlier ones' hello keys
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1], [1, 3, 0, 2]):
        got = attempt(store, 4, order)
        assert len(set(got)) == 1, (order, got)
        seen.append(got[0])
    assert len(set(seen)) == len(seen)


def test_the_world_size_may_change_between_attempts():
    """An elastic job (``--nnodes 1:2``) restarts at another world size on the same store."""
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=20))
    first, second, third = attempt(store, 4, [1, 0, 3, 2]), attempt(store, 2, [1, 0]), attempt(store, 3, [2, 1, 0])
    assert len({first[0], second[0], third[0]}) == 3
    assert len(set(second)) == 1 and len(set(third)) == 1


def test_a_rank_that_never_comes_is_named():
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=20))
    one = threading.Thread(target=agree_generation, args=(store, 1, 3, timedelta(seconds=20)))
    one.start()
    with pytest.raises(TimeoutError, match=r"ranks \[2\] did not join attempt generation 1 within 0:00:01"):
        agree_generation(store, 0, 3, timedelta(seconds=1))
    one.join(timeout=30)
