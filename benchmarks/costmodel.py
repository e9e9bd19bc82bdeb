"""Per-matrix cost formulas from docs/algorithms/: persistent state, compulsory memory traffic, FLOPs.

A matrix is (m, n) = PyTorch (out, in); k = min(m, n), K = max(m, n). Counts are elements; multiply by the
element size for bytes. The formulas are keyed by optimizer name (not param-group treatment: Alice and
Alice-0 may share one rule) and read hyperparameters from the matrix's param group, so a rank or refresh
interval set by the user is what gets counted. A name without a formula gives ``None``: the tables then
say "n/a" instead of guessing.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

__all__ = [
    "matrix_view",
    "state_elements",
    "traffic_elements",
    "matrix_flops",
    "find_hyper",
    "refresh_interval",
    "low_rank",
]

Rule = Callable[[int, int, Mapping[str, Any]], float]


def matrix_view(p: Any) -> tuple[int, int]:
    """(m, n) of a parameter: matrices as they are, anything else as one column (AdamW's formulas only count
    elements, so the split does not matter there)."""
    return (int(p.shape[0]), int(p.shape[1])) if p.dim() == 2 else (int(p.numel()), 1)


def find_hyper(group: Mapping[str, Any], *fragments: str) -> tuple[str, Any] | None:
    """The first group key containing one of ``fragments`` (exact names first), as (key, value).

    Optimizers that land later name their knobs as their papers do (``rank``, ``update_interval``, ``tau``,
    ``update_proj_gap``); matching on fragments keeps this module from hard-coding one spelling."""
    for frag in fragments:
        if frag in group:
            return frag, group[frag]
    for key in sorted(group):
        value = group[key]
        if any(frag in key for frag in fragments) and isinstance(value, (int, float)) and not isinstance(value, bool):
            return key, value
    return None


def low_rank(group: Mapping[str, Any]) -> int | None:
    found = find_hyper(group, "rank")
    return int(found[1]) if found else None


def refresh_interval(group: Mapping[str, Any]) -> tuple[str, int] | None:
    """(key, K) of a refresh-based optimizer (subspace switch, preconditioner root every K steps), else None."""
    found = find_hyper(group, "update_interval", "refresh_interval", "tau", "update_proj_gap", "interval", "gap")
    if found is None or isinstance(found[1], bool) or int(found[1]) < 1:
        return None
    return found[0], int(found[1])


def interval_of(opt: Any) -> tuple[str, int] | None:
    """The largest refresh interval over an optimizer's matrix groups (None: every step costs the same; AdamW's
    groups have none)."""
    found = [refresh_interval(g) for g in opt.param_groups if g.get("treatment", "adamw") != "adamw"]
    found = [f for f in found if f is not None and f[1] > 1]
    return max(found, key=lambda f: f[1]) if found else None


def _ranked(rule: Callable[[int, int, int], float]) -> Rule:
    """A low-rank formula at r = min(rank, m, n): a rank above the smaller side cannot exist."""

    def apply(m: int, n: int, hp: Mapping[str, Any]) -> float | None:
        r = low_rank(hp)
        return None if r is None else rule(m, n, min(r, m, n))

    return apply


# Persistent optimizer state per matrix routed to the optimizer's matrix rule (elements).
_STATE: dict[str, Rule] = {
    "adamw": lambda m, n, hp: 2 * m * n,  # exp_avg + exp_avg_sq
    "scale": lambda m, n, hp: m * n if hp.get("momentum", 0) else 0,  # docs/algorithms/scale.md: LM head only
    "sinkgd": lambda m, n, hp: 0,  # docs/algorithms/sinkgd.md: stateless
    "swan": lambda m, n, hp: 0,  # docs/algorithms/swan.md
    "racs": lambda m, n, hp: m + n + 1,  # docs/algorithms/racs.md: q, s, phi
    "muon": lambda m, n, hp: m * n,  # momentum
    "asgo": lambda m, n, hp: m * n + 2 * min(m, n) ** 2,  # docs/algorithms/asgo.md: M, V, P
    "dasgo": lambda m, n, hp: m * n + n,  # docs/algorithms/asgo.md: M, v (columns)
    "sumo": _ranked(lambda m, n, r: (m + n) * r),  # docs/algorithms/sumo.md: Q, M
    # docs/algorithms/alice.md (rows <= cols): U k x r, M and V r x K, p K, Q~ r x r, phi
    "alice": _ranked(lambda m, n, r: min(m, n) * r + 2 * max(m, n) * r + max(m, n) + r * r + 1),
    "alice0": _ranked(lambda m, n, r: min(m, n) * r + 2 * max(m, n) * r + max(m, n) + 1),
}


def state_elements(name: str, m: int, n: int, hp: Mapping[str, Any]) -> float | None:
    """Documented state of one m x n matrix under optimizer ``name`` (``"adamw"`` for AdamW-routed tensors)."""
    rule = _STATE.get(name)
    return None if rule is None else rule(m, n, hp)


def traffic_elements(name: str, m: int, n: int, hp: Mapping[str, Any]) -> float | None:
    """Fewest elements one step must move through memory: read G, read and write W, read and write every
    persistent state element once. SCALE: 3mn; AdamW: 7mn. Anything above this is re-reading (Sinkhorn
    sweeps, temporaries) that fusion could in principle avoid."""
    state = state_elements(name, m, n, hp)
    return None if state is None else 3 * m * n + 2 * state


def _ns_quintic(m: int, n: int, steps: int) -> float:
    k, big = min(m, n), max(m, n)
    return steps * (4.0 * k * k * big + 2.0 * k**3)  # X X^T, (bA + cA^2), B X per step


def _interval(hp: Mapping[str, Any]) -> int:
    found = refresh_interval(hp)
    return found[1] if found else 1


# Floating-point work per matrix per step (multiply-add = 2); refresh work amortized over its interval.
_FLOPS: dict[str, Rule] = {
    "muon": lambda m, n, hp: _ns_quintic(m, n, int(hp.get("ns_steps", 5))),
    # Gram + apply (2 k^2 K each) and a coupled Newton-Schulz step of 3 k x k products (6 k^3)
    "swan": lambda m, n, hp: (
        int(hp.get("iterations", 1))
        * (4.0 * min(m, n) ** 2 * max(m, n) + int(hp.get("ns_steps", 12)) * 6.0 * min(m, n) ** 3)
    ),
    # Gram and apply (2 K k^2 each), eigh ~10 k^3 every tau steps (docs/algorithms/asgo.md)
    "asgo": lambda m, n, hp: 4.0 * max(m, n) * min(m, n) ** 2 + 10.0 * min(m, n) ** 3 / _interval(hp),
    # project and back-project (2 m n r each); the refresh (QR/SVD of an m x r or m x n block) is left out
    "sumo": _ranked(lambda m, n, r: 4.0 * m * n * r),
    "alice": _ranked(lambda m, n, r: 4.0 * m * n * r),
    "alice0": _ranked(lambda m, n, r: 4.0 * m * n * r),
}


def matrix_flops(name: str, m: int, n: int, hp: Mapping[str, Any]) -> float:
    """Matrix-product work of one step (0 for element-wise rules: their floor is memory traffic)."""
    rule = _FLOPS.get(name)
    value = rule(m, n, hp) if rule is not None else 0.0
    return float(value or 0.0)
