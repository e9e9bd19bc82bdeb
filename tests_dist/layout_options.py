"""The hyperparameters the layout suites of issues 45-47 run every optimizer with (``tp_llm_worker``,
``pipeline_llm_worker``, ``fused_moe_worker``): refresh intervals of 2 so that each rule's whole-matrix work
(ASGO's root, SUMO's refreshes, Alice's switches) happens within their few steps."""

from __future__ import annotations

OPTIONS = {
    "scale": dict(lr=3e-3, adam_lr=3e-3),
    "sinkgd": dict(lr=0.02),
    "racs": dict(lr=0.05),
    "muon": dict(lr=0.02),
    "swan": dict(lr=0.05),
    "dasgo": dict(lr=0.01),
    "asgo": dict(lr=0.01, refresh_interval=2),
    "sumo": dict(lr=0.02, rank=2, refresh_interval=2, matrix_ops={"strategy": "gather"}),
    "alice": dict(lr=0.02, rank=3, leading=1, refresh_interval=2, matrix_ops={"strategy": "distributed"}),
    "alice0": dict(lr=0.02, rank=3, leading=1, refresh_interval=2),
}
