"""The batched iterative factorizations of the GPU path (``shardopt.sharding.iterative``; issue 29, item 1),
checked on a CPU: they give the float64 eigendecomposition's results to float32 rounding, flag the matrices they
cannot settle, and an optimizer that takes them steps as it does with eigh."""

from __future__ import annotations

import pytest
import torch

import shardopt
from shardopt.sharding import iterative
from shardopt.sharding.matfun import _eigh_inverse_root, _polar_from_gram, inverse_root, polar_factor

EPS32 = torch.finfo(torch.float32).eps


def _statistic(kind: str, k: int = 48, rows: int = 96, seed: int = 0) -> torch.Tensor:
    """An EMA of Grams ``G^T G`` like ASGO's ``V`` (float32), of gradients of the given kind."""
    gen = torch.Generator().manual_seed(seed)
    v = torch.zeros(k, k)
    for _ in range(10):
        if kind == "random":
            g = torch.randn(rows, k, generator=gen) * 1e-3
        elif kind == "low_rank":
            g = torch.randn(rows, 4, generator=gen) @ torch.randn(4, k, generator=gen) * 1e-2
        elif kind == "decaying":
            g = torch.randn(rows, k, generator=gen) * torch.logspace(0, -3, k) * 1e-2
        else:
            g = torch.zeros(rows, k)
        v = 0.95 * v + 0.05 * (g.T @ g)
    return v


@pytest.mark.parametrize("kind", ["random", "low_rank", "decaying", "zero"])
@pytest.mark.parametrize("eps", [1e-6, 1e-9])
def test_inverse_sqrt_matches_eigh_or_says_it_does_not(kind: str, eps: float) -> None:
    v = torch.stack([_statistic(kind, seed=s) for s in range(3)]).double()
    a = (v + v.mT) / 2 + eps * torch.eye(v.shape[-1], dtype=torch.float64)
    want = _eigh_inverse_root(a, pseudo_inverse=False).double()
    got, ok = iterative.inverse_sqrt_checked(a, eps)
    assert torch.equal(got, got.mT), "the root is symmetric exactly (shared as a triangle)"
    err = (got - want).flatten(1).norm(dim=1) / want.flatten(1).norm(dim=1)
    assert (err[ok] <= 4 * EPS32).all(), (kind, eps, err.tolist(), ok.tolist())
    if kind != "low_rank":  # a well-resolved spectrum converges; a low-rank one near eps may be refused
        assert ok.all(), (kind, eps, ok.tolist())


def test_inverse_root_auto_equals_eigh_on_either_route() -> None:
    v = torch.stack([_statistic(kind, seed=1) for kind in ("random", "low_rank", "decaying", "zero")])
    eigh = inverse_root(v, 1e-9, "eigh")
    with iterative.forced(True):
        batched = inverse_root(v, 1e-9, "auto")
    with iterative.forced(False):
        assert torch.equal(inverse_root(v, 1e-9, "auto"), eigh)
    assert batched.dtype == torch.float32
    assert ((batched - eigh).flatten(1).norm(dim=1) <= 4 * EPS32 * eigh.flatten(1).norm(dim=1)).all()


@pytest.mark.parametrize("wide", [True, False])
def test_polar_matches_the_gram_route_and_flags_what_the_cutoff_decides(wide: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    r, n = 16, 120
    full = torch.randn(r, n, generator=gen)
    decaying = torch.randn(r, n, generator=gen) * torch.logspace(0, -3, r)[:, None]
    deficient = torch.randn(r, 3, generator=gen) @ torch.randn(3, n, generator=gen)
    m = torch.stack([full, decaying, deficient, torch.zeros(r, n)]).double()
    m = m if wide else m.mT
    tol = n * EPS32
    want = _polar_from_gram(m, tol)
    got, ok = iterative.polar_from_gram_checked(m, tol)
    assert ok.tolist() == [True, True, False, False]
    assert (got[ok] - want[ok]).abs().amax() <= 1e-10
    with iterative.forced(True):
        routed = polar_factor(m.float(), rtol=tol)  # the flagged ones take the eigendecomposition
    with iterative.forced(False):
        assert torch.allclose(routed, polar_factor(m.float(), rtol=tol), atol=1e-6)


def test_step_count_is_fixed_by_the_spectrum_bound() -> None:
    counts = [iterative.steps_to_converge(y) for y in (1.0, 0.5, 1e-2, 1e-6, 1e-12)]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] <= iterative.MAX_STEPS
    assert iterative.steps_to_converge(1e-40) == iterative.MAX_STEPS + 1
    assert iterative.steps_to_converge(0.0) == iterative.MAX_STEPS + 1


def test_scaled_schedule_halves_the_steps_and_keeps_every_eigenvalue_in_range() -> None:
    """The scaled iteration (issue 53): fewer steps than the plain iteration, about half of them from a bound of
    1e-6 or less (the plain one's slow growth phase is the long part there), and the scalar
    map of every eigenvalue of ``A / s`` in ``[y0, 1]`` (a grid) stays in (0, 1] and ends within 1e-10 of 1."""
    assert len(iterative.scaled_schedule(1e-8)) == 14 and iterative.steps_to_converge(1e-8) == 28
    for y0 in (0.5, 1e-2, 1e-6, 1e-8, 1e-12):
        scales = iterative.scaled_schedule(y0)
        plain = iterative.steps_to_converge(y0)
        assert len(scales) <= (plain + 1) // 2 + 1 if y0 <= 1e-6 else len(scales) < plain, (y0, len(scales))
        w = torch.logspace(torch.log10(torch.tensor(y0)).item(), 0, 2001, dtype=torch.float64)
        for c in scales:
            w = w * (1.5 * c - 0.5 * c**3 * w) ** 2
            assert (w > 0).all() and (w <= 1 + 1e-12).all(), y0
        assert (w - 1).abs().max() <= 1e-10, y0
    assert iterative.scaled_schedule(1e-40) is None and iterative.scaled_schedule(0.0) is None
    assert iterative.scaled_schedule(1.0) == ()


@pytest.mark.parametrize("scaled", [False, True])
def test_scaled_root_equals_the_plain_one_to_float32_rounding(scaled: bool) -> None:
    """Random SPD stacks with condition up to 1e10 (a bound ``eps / |A|`` down to 1e-10), clustered spectra and
    rank-deficient statistics plus ``eps``: the scaled iteration's root equals the eigendecomposition's as
    closely as the plain iteration's does."""
    gen = torch.Generator().manual_seed(5)
    k, eps = 64, 1e-8
    q, _ = torch.linalg.qr(torch.randn(4, k, k, generator=gen, dtype=torch.float64))
    lam = torch.stack(
        [
            torch.logspace(0, -10, k, dtype=torch.float64),
            torch.cat([torch.full((3,), 5.0, dtype=torch.float64), torch.zeros(k - 3, dtype=torch.float64)]),
            torch.rand(k, generator=gen, dtype=torch.float64) ** 8,
            torch.cat([torch.ones(k // 2, dtype=torch.float64), torch.full((k // 2,), 1e-7, dtype=torch.float64)]),
        ]
    )
    a = (q * lam.unsqueeze(-2)) @ q.mT
    a = (a + a.mT) / 2 + eps * torch.eye(k, dtype=torch.float64)
    want = _eigh_inverse_root(a, pseudo_inverse=False).double()
    s = torch.linalg.matrix_norm(a)
    if scaled:
        got, ok = iterative.inverse_sqrt_checked(a, eps)
        assert ok.all()
    else:
        z, _ = iterative.coupled_iteration(a, s, iterative.steps_to_converge(eps / float(s.max())))
        got = z / s.sqrt()[:, None, None]
    err = (got - want).flatten(1).norm(dim=1) / want.flatten(1).norm(dim=1)
    assert (err <= 4 * EPS32).all(), err.tolist()


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(100, 144, bias=False)  # SUMO's moments 6 x 100: cutoff 100 eps32 >= GRAM_RTOL
        self.down = torch.nn.Linear(144, 100, bias=False)


@pytest.mark.parametrize(
    "name, kw, route",
    [("asgo", {}, "inverse_sqrt_checked"), ("sumo", {"rank": 6, "refresh_interval": 2}, "polar_from_gram_checked")],
)
def test_optimizer_steps_equal_on_either_route(name: str, kw: dict, route: str, monkeypatch) -> None:
    """ASGO and SUMO step alike with the iterative routes (what CUDA takes) and with eigh (the CPU's), to float32
    rounding, over steps that refresh and steps that do not."""
    from shardopt.sharding import matfun

    calls = []
    real = getattr(matfun, route)
    monkeypatch.setattr(matfun, route, lambda *a: calls.append(1) or real(*a))
    results = []
    for force in (False, True):
        torch.manual_seed(0)
        net = _Net()
        opt = shardopt.create_optimizer(net, name, **kw)
        gen = torch.Generator().manual_seed(5)
        with iterative.forced(force):
            for _ in range(4):
                for p in net.parameters():
                    p.grad = torch.randn(p.shape, generator=gen) * 1e-2
                opt.step()
        results.append([p.detach().clone() for p in net.parameters()])
        assert bool(calls) == force, (name, force, len(calls))
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), (name, (a - b).abs().max().item())
