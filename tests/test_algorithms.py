"""SCALE, SinkGD and RACS against float64 references and the invariants of docs/algorithms/."""

from __future__ import annotations

import math

import pytest
import torch
from references import racs_fixed_point, racs_step, scale_step, sr_sinkhorn
from tiny_model import Tiny
from torch import nn

import shardopt
from shardopt import RACS, SCALE, SinkGD
from shardopt.optim import OPTIMIZERS


def grads(shape, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=torch.float64) * (1 + i) for i in range(steps)]


def run_opt(opt_cls, w0, gs, **kw):
    p = nn.Parameter(w0.float().clone())
    opt = opt_cls([{"params": [p], **kw.pop("group", {})}], **kw)
    history = []
    for g in gs:
        before = p.detach().clone()
        p.grad = g.float()
        opt.step()
        history.append(before - p.detach())
    return p.detach().double(), history, opt


@pytest.mark.parametrize("dim,beta", [(1, 0.0), (0, 0.0), (1, 0.9)])
def test_scale_matches_float64_reference(dim, beta):
    w0 = torch.randn(7, 5, dtype=torch.float64)
    gs = grads((7, 5), 4)
    got, hist, _ = run_opt(SCALE, w0, gs, lr=1e-2, group={"treatment": "scale", "norm_dim": dim, "momentum": beta})
    W, M = w0.clone(), torch.zeros_like(w0)
    for g in gs:
        W, M = scale_step(W, g, M, 1e-2, beta=beta, dim=dim)
    torch.testing.assert_close(got, W, rtol=1e-6, atol=1e-6)
    rms = torch.sqrt((hist[0].double() / 1e-2).pow(2).mean(dim=dim))
    torch.testing.assert_close(rms, torch.ones_like(rms), rtol=1e-5, atol=1e-5)  # normalized rows have RMS 1


def test_sr_sinkhorn_float64_invariants():
    G = torch.randn(6, 9, dtype=torch.float64)
    X = sr_sinkhorn(G, 5)
    m, n = G.shape
    torch.testing.assert_close(X.norm(dim=0), torch.full((n,), math.sqrt(m), dtype=torch.float64))
    torch.testing.assert_close(X.norm(), torch.tensor(math.sqrt(m * n), dtype=torch.float64))
    assert torch.equal(torch.sign(X), torch.sign(G))
    X200 = sr_sinkhorn(G, 200)
    torch.testing.assert_close(
        X200.norm(dim=1), torch.full((m,), math.sqrt(n), dtype=torch.float64), rtol=1e-9, atol=1e-9
    )
    torch.testing.assert_close(sr_sinkhorn(3.7 * G, 5), X)  # scale invariance


def test_sinkgd_update_is_sr_sinkhorn():
    w0 = torch.zeros(6, 9, dtype=torch.float64)  # so that (before - after) is the update, without cancellation
    gs = grads((6, 9), 3)
    lr, scale = 0.02, 0.05
    _, hist, _ = run_opt(SinkGD, w0, gs, lr=lr, lr_scale=scale)
    for h, g in zip(hist, gs):
        X = h.double() / (lr * scale)
        torch.testing.assert_close(X, sr_sinkhorn(g, 5), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(X.norm(dim=0), torch.full((9,), 6**0.5, dtype=torch.float64), rtol=1e-5, atol=1e-5)


def test_racs_matches_float64_reference():
    w0 = torch.randn(5, 8, dtype=torch.float64)
    gs = grads((5, 8), 5)
    got, _, _ = run_opt(RACS, w0, gs, lr=0.02)
    W, st = w0.clone(), {}
    for g in gs:
        W = racs_step(W, g, st, 0.02)
    torch.testing.assert_close(got, W, rtol=1e-5, atol=1e-6)


def test_racs_scaling_vectors_solve_the_fixed_point():
    G = torch.randn(5, 8, dtype=torch.float64)
    P = G * G
    q, s = racs_fixed_point(P, 500)
    torch.testing.assert_close(s, P.T @ q / (q @ q))
    torch.testing.assert_close(q, P @ s / (s @ s))
    U, S, Vh = torch.linalg.svd(P)
    torch.testing.assert_close(torch.outer(q, s), S[0] * torch.outer(U[:, 0], Vh[0]))
    # the fp32 optimizer with beta = 0 stores exactly these vectors
    p = nn.Parameter(torch.zeros(5, 8))
    opt = RACS([p], beta=0.0, iterations=500)
    p.grad = G.float()
    opt.step()
    torch.testing.assert_close(opt.state[p]["q"].double(), q, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(opt.state[p]["s"].double(), s, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_zero_gradients_give_zero_updates_never_nan(name):
    model = Tiny()
    # Muon's decoupled weight decay (torch default 0.1) shrinks weights even on a zero gradient
    opt = shardopt.create_optimizer(model, name, **({"weight_decay": 0.0} if name == "muon" else {}))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
    for n, p in model.named_parameters():
        assert torch.isfinite(p).all(), n
        torch.testing.assert_close(p.detach(), before[n], msg=n)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_state_dict_resume_and_lr_scheduler(name):
    def train(steps, resume_at=None):
        torch.manual_seed(0)
        model = Tiny()
        opt = shardopt.create_optimizer(model, name)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        x = torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(3))
        for s in range(steps):
            if s == resume_at:
                sd, msd, ssd = opt.state_dict(), model.state_dict(), sched.state_dict()
                model = Tiny()
                model.load_state_dict(msd)
                opt = shardopt.create_optimizer(model, name)
                sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
                opt.load_state_dict(sd)
                sched.load_state_dict(ssd)
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        return model, opt

    a, opt = train(5)
    b, _ = train(5, resume_at=2)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=1e-7, msg=n)
    assert opt.param_groups[0]["lr"] < opt.defaults["lr"]  # the scheduler drives every group


def test_step_accepts_closure():
    model = Tiny()
    opt = shardopt.create_optimizer(model, "scale")
    x = torch.randint(0, 11, (2, 3))

    def closure():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        return loss

    assert torch.isfinite(opt.step(closure))


def test_muon_matches_torch_optim_muon():
    torch.manual_seed(0)
    w = torch.randn(7, 12)
    ours, theirs = nn.Parameter(w.clone()), nn.Parameter(w.clone())
    a = shardopt.Muon([ours], lr=0.02, ns_dtype="bfloat16")  # torch iterates Newton-Schulz in bf16
    b = torch.optim.Muon([theirs], lr=0.02)
    for g in grads((7, 12), 4):
        ours.grad, theirs.grad = g.float(), g.float()
        a.step()
        b.step()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-7)


@pytest.mark.parametrize("whitening", ["svd", "newton_schulz"])
@pytest.mark.parametrize("shape", [(5, 9), (9, 5)])
def test_swan_exact_whitening_invariants(shape, whitening):
    """docs/algorithms/swan.md: every singular value and line norm is sqrt(max(m, n)); L=5 == L=1."""
    m, n = shape
    k = max(m, n)
    outs = []
    for iterations in (1, 5):
        p = nn.Parameter(torch.zeros(m, n))
        opt = shardopt.SWAN([p], lr=1.0, lr_scale=1.0, iterations=iterations, whitening=whitening)
        p.grad = grads(shape, 1, seed=4)[0].float()
        opt.step()
        outs.append(-p.detach().double())
    x = outs[0]
    torch.testing.assert_close(
        torch.linalg.svdvals(x), torch.full((min(m, n),), k**0.5, dtype=torch.float64), rtol=1e-5, atol=1e-5
    )
    lines = x.norm(dim=1) if m <= n else x.norm(dim=0)
    torch.testing.assert_close(lines, torch.full_like(lines, k**0.5), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def test_load_state_dict_keeps_statistics_in_fp32():
    """torch casts loaded floating state to the parameter dtype; a bf16 model must keep fp32 moments."""
    model = Tiny().to(torch.bfloat16)
    opt = shardopt.create_optimizer(model, "racs")
    x = torch.randint(0, 11, (2, 3))
    nn.functional.cross_entropy(model(x).flatten(0, 1).float(), x.flatten()).backward()
    opt.step()
    opt.load_state_dict(opt.state_dict())
    for st in opt.state.values():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                assert v.dtype == torch.float32, k
