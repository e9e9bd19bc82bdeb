"""The one record an optimizer's build logs (logger ``shardopt``, INFO, rank 0 only).

Every front door (``create_optimizer``, ``shardopt.deepspeed.initialize``, Megatron, the Hugging Face Trainer,
accelerate, torch.optim-style construction) builds a ``ShardedOptimizer``, so its constructor logs: how many
parameters each role and rule got, and every role that was guessed (name -> role), the ones worth checking. Other
ranks stay quiet (their tables differ only where a pipeline stage holds other parameters). A rebuild over the same
tensors with the same rules (``shardopt.param_groups`` then the sharder's inner optimizer) is not logged again.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["LOGGER", "log_build"]

#: shardopt's logger: ``logging.getLogger("shardopt").setLevel(logging.INFO)`` shows the build record
LOGGER = logging.getLogger("shardopt")

#: (role, rule) each tensor was last logged with
_LOGGED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def log_build(who: str, rows: Sequence[Sequence[str]], tensors: Sequence[torch.Tensor]) -> None:
    """Log ``who``'s table (``routing.describe_row`` rows, one per tensor of ``tensors``) as one record on rank 0:
    the count per ``role -> rule`` and the guessed roles. The counts and guesses also ride on the record as
    ``shardopt_roles`` and ``shardopt_guessed`` (dicts) for handlers that want them as data."""
    seen = [(row[2], row[4]) for row in rows]
    if tensors and all(_LOGGED.get(t) == s for t, s in zip(tensors, seen)):
        return
    for t, s in zip(tensors, seen):
        _LOGGED[t] = s
    if _rank() != 0 or not LOGGER.isEnabledFor(logging.INFO):
        return
    counts = Counter(f"{role} -> {rule}" for role, rule in seen)
    guessed = {row[0]: row[2] for row in rows if row[3] == "guessed"}
    by_rule = ", ".join(f"{k}: {n}" for k, n in sorted(counts.items()))
    guesses = (
        (
            "; guessed roles (routing={pattern: role} changes one): "
            + ", ".join(f"{n} -> {r}" for n, r in guessed.items())
        )
        if guessed
        else "; no role was guessed"
    )
    LOGGER.info(
        "%s built over %d parameters; by role and rule: %s%s",
        who,
        len(rows),
        by_rule,
        guesses,
        extra={"shardopt_roles": dict(counts), "shardopt_guessed": guessed},
    )
