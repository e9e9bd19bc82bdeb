"""Two tiers of the distributed suite, so that CI fits its time on a 2-core machine.

``make test`` (CI) runs every suite, each at the world sizes that carry its claim (3 ranks for uneven shards
and teams that are subgroups, 2 where a suite needs only a second rank), and leaves the rest of the world-size
cross product skipped with the reason below. ``make test-full`` (``SHARDOPT_TESTS=full``) runs every world
size. Each skipped world size is one more launch of the same worker: on a 2-core machine that is minutes each
(the work itself; the imports are paid once per session by ``rank_server.py``), which took CI past its limit.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import pytest

FULL = os.environ.get("SHARDOPT_TESTS", "ci").strip().lower() == "full"


def full_only(what: str) -> pytest.MarkDecorator:
    """Skip unless the full tier runs; ``what`` says what CI runs instead."""
    return pytest.mark.skipif(not FULL, reason=f"full tier only (SHARDOPT_TESTS=full, make test-full); CI: {what}")


#: the optimizers that suites other than the parity matrix run in CI: the issue's five, one of each kind of state
#: (SCALE's LM-head momentum, RACS's row/column vectors, SUMO's basis and low-rank moment, Alice's tracking, ASGO's
#: root statistic); the parity matrix runs every optimizer in both tiers
CI_OPTIMIZERS = ("scale", "racs", "sumo", "alice", "asgo")


#: the smaller set that the suites of issues 45-47 run in CI (an embedding and LM-head rule, row/column vectors, a
#: whole-matrix basis): their layouts are the claim, and each added launch costs CI time on 2 cores
CI_LAYOUT_OPTIMIZERS = ("scale", "racs", "sumo")


def selected(values: Iterable, ci: Iterable, key=lambda v: v) -> list:
    """What a worker runs: all of ``values`` in the full tier, those whose ``key`` is in ``ci`` in CI."""
    ci = set(ci)
    return [v for v in values if FULL or key(v) in ci]


def tiered(values: Iterable, ci: Iterable, what: str, key=lambda v: v) -> list:
    """``values`` as parametrize values; those whose ``key`` is not in ``ci`` are skipped unless the full tier
    runs (``what`` names what CI runs instead). Tuples are unpacked, as parametrize takes them."""
    values = list(values)
    keep = selected(values, ci, key)
    marks = full_only(what)
    return [v if v in keep else pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=marks) for v in values]


def world_sizes(all_sizes: Iterable, ci: Iterable) -> list:
    """World sizes (or tuples that start with one) as parametrize values, CI running those in ``ci``."""
    ci = tuple(ci)
    return tiered(all_sizes, ci, f"world sizes {sorted(ci)}", key=lambda v: v[0] if isinstance(v, tuple) else v)


def optimizers(names: Iterable) -> list:
    """The optimizers a suite runs: every one in the full tier, ``CI_OPTIMIZERS`` in CI."""
    return selected(names, CI_OPTIMIZERS)
