"""Whole-matrix optimizers against the float64 invariants in docs/algorithms/ (single process).

ASGO's first step equals its closed form through the SVD of G (docs/algorithms/asgo.md), and its staleness law
(5.4); DASGO's first step (5.6); SUMO's update is a rank-r partial isometry in span(Q) and, on a rank-r
gradient, the polar factor of G (docs/algorithms/sumo.md); Alice's basis is orthonormal after every switch
and at full rank the step reduces to its dense form, Adam in the basis (docs/algorithms/alice.md).
"""

from __future__ import annotations

import pytest
import torch

import shardopt

torch.set_default_dtype(torch.float32)


def one_matrix(m: int, n: int, seed: int = 0) -> torch.nn.Parameter:
    g = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter(torch.randn(m, n, generator=g, dtype=torch.float32))


def step_with(opt: torch.optim.Optimizer, p: torch.nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
    """The update the optimizer applies for ``grad`` (new - old weights, in float64)."""
    before = p.detach().double().clone()
    p.grad = grad.float().clone()
    opt.step()
    return p.detach().double() - before


def rand(m: int, n: int, seed: int, rank: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if rank is None:
        return torch.randn(m, n, generator=g, dtype=torch.float64)
    return torch.randn(m, rank, generator=g, dtype=torch.float64) @ torch.randn(
        rank, n, generator=g, dtype=torch.float64
    )


@pytest.mark.parametrize("shape", [(6, 10), (10, 6), (7, 7)])
@pytest.mark.parametrize("eps", [1e-6, 0.0])
def test_asgo_first_step_closed_form(shape: tuple[int, int], eps: float) -> None:
    from shardopt.optim.asgo import ASGO

    p = one_matrix(*shape)
    lr, b1, b2 = 0.1, 0.9, 0.95
    opt = ASGO([p], lr=lr, betas=(b1, b2), eps=eps)
    g = rand(*shape, seed=1)
    delta = step_with(opt, p, g)
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    want = -lr * (1 - b1) * (u * (s / torch.sqrt((1 - b2) * s * s + eps))) @ vh
    assert torch.allclose(delta, want, atol=2e-5 * want.abs().max().item(), rtol=0)


def test_asgo_stale_root_follows_the_refresh_law() -> None:
    """Constant G, eps = 0, tau = 1: factor (1 - b1^(t+1)) / sqrt(1 - b2^(t+1)); with tau = 3 the denominator
    stays at the last refresh (docs/algorithms/asgo.md)."""
    from shardopt.optim.asgo import ASGO

    g = rand(5, 8, seed=2)
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    polar = u @ vh
    b1, b2 = 0.9, 0.95
    for tau, eps in ((1, 0.0), (3, 1e-12)):
        p = one_matrix(5, 8)
        opt = ASGO([p], lr=1.0, betas=(b1, b2), eps=eps, refresh_interval=tau)
        for t in range(6):
            delta = step_with(opt, p, g)
            t0 = (t // tau) * tau
            factor = (1 - b1 ** (t + 1)) / (1 - b2 ** (t0 + 1)) ** 0.5
            assert torch.allclose(delta, -factor * polar, atol=5e-5 * factor), (tau, t)


def test_dasgo_first_step_closed_form() -> None:
    from shardopt.optim.asgo import DASGO

    p = one_matrix(9, 4)
    lr, b1, b2, eps = 0.05, 0.9, 0.99, 1e-6
    opt = DASGO([p], lr=lr, betas=(b1, b2), eps=eps)
    g = rand(9, 4, seed=3)
    delta = step_with(opt, p, g)
    want = -lr * (1 - b1) * g / torch.sqrt((1 - b2) * (g * g).sum(0, keepdim=True) + eps)
    assert torch.allclose(delta, want, atol=1e-6)


@pytest.mark.parametrize("shape", [(12, 7), (7, 12)])
def test_sumo_first_step_is_the_polar_factor_of_a_rank_r_gradient(shape: tuple[int, int]) -> None:
    from shardopt.optim.sumo import SUMO

    r = 3
    p = one_matrix(*shape)
    opt = SUMO([p], lr=1.0, rank=r, alpha=1.0, step_scale="none", refresh_interval=100)
    g = rand(*shape, seed=4, rank=r)
    delta = step_with(opt, p, g)
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    assert torch.allclose(delta, -(u[:, :r] @ vh[:r]), atol=1e-5)
    # I6: a descent direction, <G, dW> = -sum of the top-r singular values
    assert torch.allclose((g * delta).sum(), -s[:r].sum(), rtol=1e-5)


def test_sumo_moment_orthogonalized_to_unit_singular_values() -> None:
    """Several steps with refreshes: every update is a rank-r partial isometry inside span(Q) (I1, I5)."""
    from shardopt.optim.sumo import SUMO

    r = 3
    p = one_matrix(10, 6)
    opt = SUMO([p], lr=1.0, rank=r, alpha=1.0, step_scale="none", refresh_interval=2, gamma=None)
    for t in range(6):
        delta = step_with(opt, p, rand(10, 6, seed=10 + t))
        sv = torch.linalg.svdvals(delta)
        assert torch.allclose(sv[:r], torch.ones(r, dtype=torch.float64), atol=1e-5), sv
        assert sv[r:].abs().max() < 1e-5
        q = opt.state[p]["Q"].double()
        assert torch.allclose(q.T @ q, torch.eye(r, dtype=torch.float64), atol=1e-5)
        assert (delta - q @ (q.T @ delta)).abs().max() < 1e-5


def test_sumo_limiter_caps_norm_growth() -> None:
    from shardopt.optim.sumo import SUMO

    p = one_matrix(8, 5)
    opt = SUMO([p], lr=1.0, rank=2, alpha=1.0, step_scale="none", gamma=1.1)
    step_with(opt, p, rand(8, 5, seed=5, rank=1))  # rank-1 moment: |O| = 1
    delta = step_with(opt, p, rand(8, 5, seed=6) * 100)  # rank-2 moment: |O| would be sqrt(2)
    assert abs(delta.norm().item() - 1.1) < 1e-5


@pytest.mark.parametrize("shape", [(6, 11), (11, 6)])
def test_alice_basis_orthonormal_after_every_switch(shape: tuple[int, int]) -> None:
    from shardopt.optim.alice import Alice

    p = one_matrix(*shape)
    opt = Alice([p], rank=3, leading=1, refresh_interval=2)
    for t in range(7):
        step_with(opt, p, rand(*shape, seed=20 + t))
        u = opt.state[p]["U"].double()
        assert torch.allclose(u.T @ u, torch.eye(3, dtype=torch.float64), atol=1e-5)
    assert int(opt.state[p]["switches"]) == 4  # steps 1, 2, 4, 6


def test_alice_full_rank_is_adam_in_its_basis() -> None:
    """r = rows: no compensation, and the step is Adam (no bias correction) on U^T G mapped back by U."""
    from shardopt.optim.alice import Alice

    m, n = 5, 9
    lr, alpha, b1, b2, eps = 0.1, 0.5, 0.9, 0.99, 1e-8
    p = one_matrix(m, n)
    opt = Alice([p], lr=lr, alpha=alpha, rank=m, leading=m, betas=(b1, b2, 0.999), eps=eps, refresh_interval=1000)
    grads = [rand(m, n, seed=30 + t) for t in range(4)]
    mom = torch.zeros(m, n, dtype=torch.float64)
    var = torch.zeros(m, n, dtype=torch.float64)
    for t, g in enumerate(grads):
        delta = step_with(opt, p, g)
        u = opt.state[p]["U"].double()
        assert torch.allclose(u.T @ u, torch.eye(m, dtype=torch.float64), atol=1e-6)
        s = u.T @ g
        mom = b1 * mom + (1 - b1) * s
        var = b2 * var + (1 - b2) * s * s
        want = -lr * alpha * u @ (mom / (var.sqrt() + eps))
        assert torch.allclose(delta, want, atol=2e-5 * want.abs().max().item()), t


@pytest.mark.parametrize("shape", [(6, 10), (10, 6)])
def test_alice_compensation_matches_the_explicit_residual_form(shape: tuple[int, int]) -> None:
    """r < rows: the step equals the documented form with R = A - U sigma and C = sqrt(rows - r) R / sqrt(p) formed
    explicitly (float64), the norm-growth limiter included, although the optimizer forms neither."""
    from shardopt.optim.alice import Alice

    lr, alpha, alpha_c, gamma, b1, b2, eps, r = 0.1, 0.3, 0.4, 1.01, 0.9, 0.9, 1e-8, 2
    p = one_matrix(*shape)
    opt = Alice(
        [p],
        lr=lr,
        alpha=alpha,
        alpha_c=alpha_c,
        gamma=gamma,
        rank=r,
        leading=1,
        betas=(b1, b2, 0.999),
        eps=eps,
        refresh_interval=1000,
    )
    transpose = shape[0] > shape[1]
    rows, cols = sorted(shape)
    mom, var = torch.zeros(r, cols, dtype=torch.float64), torch.zeros(r, cols, dtype=torch.float64)
    energy, phi = torch.zeros(cols, dtype=torch.float64), 0.0
    for t in range(5):
        g = rand(*shape, seed=50 + t) * (3.0 if t == 3 else 1.0)  # a jump that the limiter must cap
        delta = step_with(opt, p, g)
        a = g.T if transpose else g
        u = opt.state[p]["U"].double()
        s = u.T @ a
        mom, var = b1 * mom + (1 - b1) * s, b2 * var + (1 - b2) * s * s
        resid = a - u @ s
        energy = b1 * energy + (1 - b1) * (resid * resid).sum(0)
        comp = resid * (rows - r) ** 0.5 / (energy + eps).sqrt()
        norm = comp.norm().item()
        eta = 1.0 if phi == 0 else gamma / max(norm / phi, gamma)
        phi = eta * norm
        want = -lr * alpha * (u @ (mom / (var.sqrt() + eps)) + alpha_c * eta * comp)
        want = want.T if transpose else want
        assert torch.allclose(delta, want, atol=1e-5 * want.abs().max().item()), t
        assert abs(float(opt.state[p]["phi"]) - phi) <= 1e-5 * phi, t


def test_alice0_has_no_tracking_state_and_same_first_step_as_alice() -> None:
    from shardopt.optim.alice import Alice, Alice0

    g = rand(6, 10, seed=40)
    a, b = one_matrix(6, 10), one_matrix(6, 10)
    da = step_with(Alice([a], rank=3, leading=1), a, g)
    opt0 = Alice0([b], rank=3, leading=1)
    db = step_with(opt0, b, g)
    assert "Q_tilde" not in opt0.state[b]
    assert torch.allclose(da, db, atol=1e-7)


@pytest.mark.parametrize("name", ["asgo", "sumo", "alice", "alice0", "swan"])
def test_zero_gradients_give_no_nan(name: str) -> None:
    model = torch.nn.Linear(9, 6, bias=False)
    opt = shardopt.create_optimizer(
        model, name, **({"rank": 2, "leading": 1} if "alice" in name else {"rank": 2} if name == "sumo" else {})
    )
    for _ in range(3):
        model.weight.grad = torch.zeros_like(model.weight)
        opt.step()
    assert torch.isfinite(model.weight).all()


@pytest.mark.parametrize("shape", [(16, 40), (40, 16), (3, 16, 40)])
@pytest.mark.parametrize("kind", ["full", "rank_deficient", "ill_conditioned", "zero"])
def test_polar_factor_gram_path_matches_the_svd(shape: tuple[int, ...], kind: str) -> None:
    """The float64 Gram-eigh route (cutoffs >= GRAM_RTOL) gives the SVD's U V^T to float32 rounding and drops
    the same directions (rank-deficient; singular values spread over 5.5 decades across the 1e-4 cutoff; zero)."""
    from shardopt.sharding.matfun import GRAM_RTOL, polar_factor

    g = torch.Generator().manual_seed(7)
    *batch, m, n = shape
    k = min(m, n)
    if kind == "rank_deficient":
        x = torch.randn(*batch, m, 3, generator=g, dtype=torch.float64) @ torch.randn(
            *batch, 3, n, generator=g, dtype=torch.float64
        )
    elif kind == "ill_conditioned":
        u = torch.linalg.qr(torch.randn(*batch, m, k, generator=g, dtype=torch.float64)).Q
        v = torch.linalg.qr(torch.randn(*batch, n, k, generator=g, dtype=torch.float64)).Q
        x = (u * torch.logspace(0, -5.5, k, dtype=torch.float64)) @ v.mT
    elif kind == "zero":
        x = torch.zeros(*shape, dtype=torch.float64)
    else:
        x = torch.randn(*shape, generator=g, dtype=torch.float64)
    x = x.float()
    rtol = 1e-4
    assert rtol >= GRAM_RTOL
    uu, ss, vh = torch.linalg.svd(x.double(), full_matrices=False)
    keep = (ss > ss.amax(-1, keepdim=True) * rtol).double() if ss.numel() else ss
    want = (uu * keep.unsqueeze(-2)) @ vh if kind != "zero" else torch.zeros_like(x.double())
    got = polar_factor(x, rtol=rtol)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert torch.allclose(got.double(), want, atol=1e-6)


def test_products_for_transposed_blocks_keep_the_storage_orientation() -> None:
    """Blocks of G^T are views; products and column sums of squares computed for them come out stored like G
    (so mapping back to G's flat layout is a view) and equal the plain results."""
    from shardopt.sharding.orientation import mm_like, stored_transposed
    from shardopt.sharding.primitives import col_sumsq

    g = torch.randn(300, 40)
    a = g.T  # a 40 x 300 block of A = G^T
    x, y = torch.randn(40, 5), torch.randn(5, 300)
    assert stored_transposed(a) and not stored_transposed(g) and not stored_transposed(torch.randn(1, 7).T)
    out = mm_like(a, x, y)
    assert out.shape == (40, 300) and out.mT.is_contiguous()
    assert torch.allclose(out, x @ y, atol=1e-5)
    plain = mm_like(g, torch.randn(300, 5), torch.randn(5, 40))
    assert plain.is_contiguous()
    for block in (a, g, torch.randn(700, 30)):
        assert torch.allclose(col_sumsq(block), (block.double() ** 2).sum(0).float(), rtol=1e-5)
