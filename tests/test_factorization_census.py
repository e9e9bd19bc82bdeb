"""No ``eigh``/``svd``/``qr`` on a CUDA step's path between refreshes (issue 42, item 2), checked on a CPU with the
CUDA routes forced (``iterative.forced``): the calls inside ``step()`` are counted by a dispatch mode
(``sharding.op_census``), which sees every aten op whatever calls it.

Between refreshes every optimizer runs none. A step that refreshes runs at most its class's documented
``refresh_factorizations`` per stack of same-shape matrices (SUMO: the SVD of the range finder's small sketch;
Alice: the sketch's SVD, the Rayleigh-Ritz ``eigh`` and Alg. 2's complete QR), nothing else: orthonormalizations
are Cholesky-QR2, polar factors and inverse roots batched Newton-Schulz products, and the fallback counter says
no matrix needed its factorization. The model has repeated shapes, so a call per matrix instead of per shape
would exceed the bound."""

from __future__ import annotations

import contextlib

import pytest
import torch

import shardopt
from shardopt.optim.registry import OPTIMIZERS
from shardopt.sharding import iterative
from shardopt.sharding.op_census import census

REFRESH = 3
STEPS = 7
OPTIONS = {
    "sumo": {"rank": 8, "refresh_interval": REFRESH},
    "alice": {"rank": 8, "leading": 2, "refresh_interval": REFRESH},
    "alice0": {"rank": 8, "leading": 2, "refresh_interval": REFRESH},
}


class _Block(torch.nn.Module):
    def __init__(self, dim: int = 64, ffn: int = 176) -> None:
        super().__init__()
        self.q = torch.nn.Linear(dim, dim, bias=False)
        self.k = torch.nn.Linear(dim, dim, bias=False)
        self.up = torch.nn.Linear(dim, ffn, bias=False)
        self.down = torch.nn.Linear(ffn, dim, bias=False)
        self.norm = torch.nn.LayerNorm(dim)


class _LM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(96, 64)
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])
        self.lm_head = torch.nn.Linear(64, 96, bias=False)


def _shapes(model: torch.nn.Module) -> int:
    """Distinct matrix shapes up to orientation (the stacks a refresh batches over; a bound, not the count)."""
    return len({tuple(sorted(p.shape)) for p in model.parameters() if p.dim() == 2})


def _refresh_count(opt: torch.optim.Optimizer) -> int:
    """Refreshes (SUMO) and switches (Alice) so far, summed over the matrices: a step that raises it refreshed."""
    return sum(int(st[k]) for st in opt.state.values() for k in ("refreshes", "switches") if k in st)


def _census(name: str, device: str = "cpu") -> tuple[list[dict[str, int]], set[int], type, int, dict[str, int]]:
    """Calls per step; on the CPU with the CUDA routes forced, on CUDA as they are."""
    torch.manual_seed(0)
    model = _LM().to(device)
    opt = shardopt.create_optimizer(model, name, **OPTIONS.get(name, {}))
    gen = torch.Generator().manual_seed(1)
    steps, refreshing = [], set()
    iterative.fallback_counts(reset=True)
    with iterative.forced(True) if device == "cpu" else contextlib.nullcontext():
        for _ in range(STEPS):
            for p in model.parameters():
                p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(device)
            before = _refresh_count(opt)
            with census() as counted:
                opt.step()
            if _refresh_count(opt) > before:
                refreshing.add(len(steps))
            steps.append({k: counted.calls.get(k, 0) for k in ("eigh", "svd", "qr")})
    return steps, refreshing, type(opt), _shapes(model), iterative.fallback_counts(reset=True)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_no_factorization_between_refreshes_and_only_the_documented_ones_at_a_refresh(name: str, device: str) -> None:
    """``cpu``: the CUDA routes forced; ``cuda`` (where a GPU is lent): the routes CUDA takes by default."""
    steps, refreshing, cls, shapes, fallbacks = _census(name, device)
    documented = cls.refresh_factorizations
    assert len(refreshing) >= (2 if documented else 0), (name, refreshing)
    for s, calls in enumerate(steps):
        if s not in refreshing:
            assert sum(calls.values()) == 0, f"{name} step {s + 1} (no refresh) ran {calls}"
            continue
        for kind, n in calls.items():
            assert n <= documented.get(kind, 0) * shapes, (
                f"{name} step {s + 1} (refresh) ran {n} {kind}; documented: {documented} per shape, {shapes} shapes"
            )
        assert sum(calls.values()) > 0, f"{name} step {s + 1}: a refresh the census did not see"
    assert not fallbacks, f"{name}: matrices left to a factorization: {fallbacks}"


def test_a_fallback_is_counted_and_runs_the_factorization() -> None:
    """A rank-deficient sketch fails Cholesky-QR2's check: it is orthonormalized by QR instead, and counted."""
    x = torch.randn(2, 40, 6, dtype=torch.float64)
    x[1, :, 5] = x[1, :, 0]  # rank 5
    iterative.fallback_counts(reset=True)
    with iterative.forced(True), census() as counted:
        q = iterative.orthonormal_columns(x)
    assert iterative.fallback_counts(reset=True) == {"orthonormal": 1}
    assert counted.calls.get("qr") == 1
    eye = torch.eye(6, dtype=torch.float64)
    assert torch.allclose(q.mT @ q, eye.expand(2, 6, 6), atol=1e-12)
    want = torch.linalg.qr(x[0]).Q
    assert torch.allclose((q[0] * torch.sign(torch.diagonal(want.mT @ q[0]))), want, atol=1e-12), (
        "Cholesky-QR2 equals Householder QR up to each column's sign"
    )
