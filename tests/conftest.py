import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402

#: ``make test-full`` (``SHARDOPT_TESTS=full``) runs every case; CI (``make test``) the ones that carry each claim
FULL = os.environ.get("SHARDOPT_TESTS", "ci").strip().lower() == "full"


def ci_first(values, keep: int = 1, what: str = "the first case"):
    """``values`` as parametrize values, the ones after the first ``keep`` skipped unless the full tier runs (tuples
    unpacked, as parametrize takes them)."""
    mark = pytest.mark.skipif(not FULL, reason=f"full tier only (SHARDOPT_TESTS=full, make test-full); CI: {what}")
    return [v if i < keep or FULL else pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=mark)
            for i, v in enumerate(values)]
