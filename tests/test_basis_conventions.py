"""Every basis an ``eigh``, ``svd`` or QR gives comes with arbitrary signs (and, for tied values, an arbitrary
rotation) that follow rounding. Where state is kept in that basis the result must not depend on them (issue 63):

* Alice / Alice-0 keep ``M`` and ``V`` in the basis's coordinates without rotating them at a switch (the paper's
  rule), so the basis is made unique: ``subspace.pin_signs`` (largest-magnitude entry positive);
* SUMO carries its moment into the new basis (``M <- Q_new^T Q M``) and orthogonalizes it: any rotation or sign
  of the range finder's basis gives the same step;
* ASGO's root ``V f(Lambda) V^T`` is a function of the statistic: the eigenvectors' signs cancel;
* Alice's compensation depends on ``span(U)`` only: its residual energies are rotation-invariant."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardopt
import shardopt.optim.sumo as sumo_module
from shardopt.optim.alice import compensation_scale, residual_energy
from shardopt.sharding.subspace import pin_signs


def _orthogonal(k: int, seed: int) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(k, k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)).Q


def test_pin_signs_is_the_same_basis_whatever_the_input_signs() -> None:
    basis = _orthogonal(6, 0)[:, :4].float()
    flips = torch.tensor([1.0, -1.0, -1.0, 1.0])
    pinned = pin_signs(basis)
    assert torch.equal(pin_signs(basis * flips), pinned)  # flipping a sign is exact: the very same numbers
    top = pinned.gather(0, pinned.abs().argmax(0, keepdim=True))
    assert bool((top > 0).all()), top
    # stacks pin each matrix's columns; a zero column (a basis left incomplete) stays zero
    stacked = torch.stack([basis, -basis, torch.zeros_like(basis)])
    out = pin_signs(stacked)
    assert torch.equal(out[0], pinned) and torch.equal(out[1], pinned) and torch.equal(out[2], stacked[2])


def _train(name: str, options: dict, steps: int = 6) -> list[torch.Tensor]:
    torch.manual_seed(0)
    params = [nn.Parameter(0.1 * torch.randn(*s)) for s in ((12, 20), (20, 12), (8, 8))]
    opt = shardopt.create_optimizer(nn.ParameterList(params), name, routing={"*": "matrix"}, **options)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach().clone() for p in params]


def test_sumo_step_does_not_depend_on_the_range_finders_basis(monkeypatch: pytest.MonkeyPatch) -> None:
    """The range finder's basis rotated (and signs flipped) by a different orthogonal matrix at every refresh:
    SUMO's moment is carried into it and its polar factor rotates along, so the parameters end where they do
    with the basis as computed (to fp32 rounding of the rotation)."""
    options = dict(lr=0.02, rank=4, refresh_interval=2)
    want = _train("sumo", options)
    original = sumo_module.range_basis
    calls = [0]

    def rotated(*args, **kwargs):
        out = original(*args, **kwargs)
        calls[0] += 1
        return {i: (u.double() @ _orthogonal(u.shape[-1], 100 * calls[0] + i)).float() for i, u in out.items()}

    monkeypatch.setattr(sumo_module, "range_basis", rotated)
    got = _train("sumo", options)
    assert calls[0] >= 3
    diff = max((a - b).abs().max().item() for a, b in zip(got, want))
    assert diff <= 1e-6, diff


def test_asgo_root_does_not_depend_on_eigenvector_signs(monkeypatch: pytest.MonkeyPatch) -> None:
    """ASGO's root from eigenvectors with flipped signs: the same parameters (``V f(Lambda) V^T``)."""
    options = dict(lr=0.02, root="eigh")
    want = _train("asgo", options)
    eigh = torch.linalg.eigh
    flipped = [0]

    def flipping(a, *args, **kwargs):
        lam, vec = eigh(a, *args, **kwargs)
        flipped[0] += 1
        signs = torch.where(torch.arange(vec.shape[-1], device=vec.device) % 2 == 0, -1.0, 1.0).to(vec.dtype)
        return torch.return_types.linalg_eigh((lam, vec * signs))

    monkeypatch.setattr(torch.linalg, "eigh", flipping)
    got = _train("asgo", options)
    assert flipped[0] > 0
    diff = max((a - b).abs().max().item() for a, b in zip(got, want))
    assert diff <= 1e-6, diff


def test_alice_compensation_depends_on_the_span_only() -> None:
    """``p``, ``C`` and ``|C|`` from ``U`` or from ``U`` rotated within its span (signs included) agree."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(10, 16, generator=g, dtype=torch.float64)
    u = _orthogonal(10, 4)[:, :3]
    p = torch.rand(16, generator=g, dtype=torch.float64)
    out = []
    for basis in (u, u @ _orthogonal(3, 5), -u):
        sigma = basis.T @ a
        energy = residual_energy(a.square().sum(0), sigma)
        out.append((energy, *compensation_scale(p, energy, 10, 3, 1e-8)))
    for other in out[1:]:
        for x, y in zip(out[0], other):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
