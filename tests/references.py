"""Slow float64 references written line by line from docs/algorithms/ and the papers (never used by the package)."""
from __future__ import annotations

import torch


def scale_step(W, G, M, lr, beta=0.0, dim=1, eps=1e-8):
    """docs/algorithms/scale.md: RMS normalization along ``dim`` (of M when beta > 0)."""
    X = G
    if beta:
        M = beta * M + (1 - beta) * G
        X = M
    s = torch.sqrt(torch.mean(X * X, dim=dim, keepdim=True)).clamp_min(eps)
    return W - lr * X / s, M


def sr_sinkhorn(G, L):
    """docs/algorithms/sinkgd.md, direct form with zero-safe divisions."""
    X = G.clone()
    m, n = X.shape
    for _ in range(L):
        r = torch.sqrt((X * X).sum(1))
        X = X * torch.where(r > 0, n ** 0.5 / torch.where(r > 0, r, 1), 0)[:, None]
        c = torch.sqrt((X * X).sum(0))
        X = X * torch.where(c > 0, m ** 0.5 / torch.where(c > 0, c, 1), 0)[None, :]
    return X


def racs_fixed_point(P, iterations):
    """docs/algorithms/racs.md: q = 1; repeat: s = P^T q / |q|^2; q = P s / |s|^2."""
    q = torch.ones(P.shape[0], dtype=P.dtype)
    for _ in range(iterations):
        s = P.T @ q / (q @ q)
        q = P @ s / (s @ s)
    return q, s


def racs_step(W, G, state, lr, beta=0.9, alpha=0.05, gamma=1.01, iterations=5):
    P = G * G
    q_hat, s_hat = racs_fixed_point(P, iterations)
    state["s"] = beta * state.get("s", torch.zeros_like(s_hat)) + (1 - beta) * s_hat
    state["q"] = beta * state.get("q", torch.zeros_like(q_hat)) + (1 - beta) * q_hat
    Gt = G / torch.sqrt(state["q"][:, None] * state["s"][None, :])
    norm = torch.linalg.norm(Gt)
    phi = state.get("phi", 0.0)
    eta = 1.0 if phi == 0 else gamma / max(norm / phi, gamma)
    state["phi"] = eta * norm
    return W - lr * eta * alpha * Gt
