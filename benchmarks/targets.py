"""The targets of issue 6, in one place so the scripts and the summary judge them the same way."""

from __future__ import annotations

__all__ = ["STEP_TIME_VS_ADAMW", "COMM_FRACTION_OF_GRAD", "COMM_TARGET_OPTIMIZERS", "step_time_verdict"]

#: optimizer step time / torch AdamW (foreach) step time, at most (amortized over the refresh interval)
STEP_TIME_VS_ADAMW: dict[str, float] = {
    "scale": 0.6,
    "sinkgd": 1.5,
    "racs": 1.5,
    "alice": 2.0,
    "alice0": 2.0,
    "sumo": 2.0,
}

#: shardopt bytes per step per rank / gradient bytes, at most, with a call count independent of #matrices
COMM_FRACTION_OF_GRAD = 0.02
COMM_TARGET_OPTIMIZERS = ("scale", "sinkgd", "racs")


def step_time_verdict(name: str, ratio: float | None) -> str:
    """ "met" / "missed" against the target, "reported" for optimizers without one (ASGO, Muon, SWAN)."""
    target = STEP_TIME_VS_ADAMW.get(name)
    if target is None or ratio is None:
        return "reported"
    return "met" if ratio <= target else "missed"
