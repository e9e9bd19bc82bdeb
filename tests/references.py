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
        X = X * torch.where(r > 0, n**0.5 / torch.where(r > 0, r, 1), 0)[:, None]
        c = torch.sqrt((X * X).sum(0))
        X = X * torch.where(c > 0, m**0.5 / torch.where(c > 0, c, 1), 0)[None, :]
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


# ---- whole-matrix rules: each a plain float64 function of (W, G, state) with exact linear algebra ----------


def _safe_scale(x, num):
    """``num / x`` where ``x > 0``, else 0 (zero lines stay zero)."""
    return torch.where(x > 0, num / torch.where(x > 0, x, torch.ones_like(x)), torch.zeros_like(x))


def polar(X, rtol=None):
    """``U V^T`` of the thin SVD of ``X``; singular values below ``rtol * s_max`` are dropped."""
    U, S, Vh = torch.linalg.svd(X, full_matrices=False)
    tol = (max(X.shape) * torch.finfo(X.dtype).eps if rtol is None else rtol) * S[0]
    keep = S > tol
    return U[:, keep] @ Vh[keep]


def swan_direction(G, iterations=1, center=False):
    """docs/algorithms/swan.md: line normalization to sqrt(k) along the k = max(m, n) long lines, then
    whitening sqrt(k) (X X^T)^(-1/2) X, as the exact polar factor; returns the update direction X."""
    m, n = G.shape
    X = (G if m <= n else G.T).clone()
    k = X.shape[1]
    for _ in range(iterations):
        if center:
            X = X - X.mean(dim=1, keepdim=True)
        X = X * _safe_scale(X.norm(dim=1, keepdim=True), k**0.5)
        X = k**0.5 * polar(X)
    return X if m <= n else X.T


def inverse_sqrt(V, eps):
    """``(V + eps I)^(-1/2)`` by eigh; with ``eps == 0`` the pseudo-inverse root."""
    lam, E = torch.linalg.eigh(V + eps * torch.eye(V.shape[0], dtype=V.dtype))
    lam = lam.clamp(min=0)
    keep = lam > (V.shape[0] * 1.2e-7 * lam.max() if eps == 0 else 0)
    return (E[:, keep] * lam[keep].rsqrt()) @ E[:, keep].T


def asgo_step(
    W, G, st, lr, betas=(0.9, 0.95), eps=1e-6, tau=1, side="auto", statistic="gradient", update_rms=None, wd=0.0
):
    """docs/algorithms/asgo.md, ASGO: M = EMA(G); V = EMA of the Gram on the smaller side; P = (V + eps I)^-1/2
    refreshed at steps 1, 1 + tau, ...; W <- W (1 - lr wd) - lr (P M or M P)."""
    b1, b2 = betas
    m, n = G.shape
    left = side == "left" or (side == "auto" and m < n)
    k = m if left else n
    st["t"] = st.get("t", 0) + 1
    st["M"] = b1 * st.get("M", torch.zeros_like(G)) + (1 - b1) * G
    S = st["M"] if statistic == "momentum" else G
    st["V"] = b2 * st.get("V", torch.zeros(k, k, dtype=G.dtype)) + (1 - b2) * (S @ S.T if left else S.T @ S)
    if (st["t"] - 1) % tau == 0:
        st["P"] = inverse_sqrt(st["V"], eps)
    D = st["P"] @ st["M"] if left else st["M"] @ st["P"]
    if update_rms is not None:
        D = D * (update_rms * (m * n) ** 0.5 / D.norm())
    return W * (1 - lr * wd) - lr * D


def dasgo_step(W, G, st, lr, betas=(0.9, 0.99), eps=1e-6, wd=0.0):
    """docs/algorithms/asgo.md, DASGO: M = EMA(G); v = EMA(colsum(G * G)); W <- W - lr M diag(v + eps)^-1/2."""
    b1, b2 = betas
    st["M"] = b1 * st.get("M", torch.zeros_like(G)) + (1 - b1) * G
    st["v"] = b2 * st.get("v", torch.zeros(G.shape[1], dtype=G.dtype)) + (1 - b2) * (G * G).sum(0)
    return W * (1 - lr * wd) - lr * st["M"] / torch.sqrt(st["v"] + eps)


def sumo_step(W, G, st, lr, rank, alpha=0.25, mu=0.9, K=200, gamma=1.1, wd=0.0):
    """docs/algorithms/sumo.md with the exact top-r left singular basis (the optimizer's range finder finds the
    same subspace when its sketch spans all rows) and c(m, n) = sqrt(max(m, n))."""
    m, n = G.shape
    left = m >= n
    A = G if left else G.T
    rows, cols = A.shape
    r = min(rank, rows, cols)
    st["t"] = st.get("t", 0) + 1
    if (st["t"] - 1) % K == 0:
        Q_new = torch.linalg.svd(A, full_matrices=False).U[:, :r]
        st["M"] = Q_new.T @ st["Q"] @ st["M"] if "Q" in st else torch.zeros(r, cols, dtype=G.dtype)
        st["Q"] = Q_new
    st["M"] = mu * st["M"] + st["Q"].T @ A
    O = polar(st["M"], rtol=max(r, cols) * torch.finfo(torch.float32).eps)
    prev = st.get("prev", 0.0)
    if gamma is not None and prev > 0 and O.norm() > gamma * prev:
        O = O * (gamma * prev / O.norm())
    st["prev"] = O.norm()
    D = alpha * max(m, n) ** 0.5 * st["Q"] @ O
    return W * (1 - lr * wd) - lr * (D if left else D.T)


def alice_step(
    W,
    G,
    st,
    lr,
    rank,
    leading,
    alpha=0.3,
    alpha_c=0.4,
    betas=(0.9, 0.9, 0.999),
    K=200,
    gamma=1.01,
    eps=1e-8,
    tracking=True,
    reproject=True,
    complement_draw=None,
    wd=0.0,
):
    """docs/algorithms/alice.md, with exact linear algebra: the first basis is the top-r left singular basis of
    A; later switches are one Rayleigh-Ritz step on Q = b3 U Qt U^T + (1 - b3) A A^T, formed here. When l < r the
    r - l complement columns are ``complement_draw(count, switch)``: indices into the complete-QR complement
    (the optimizer's seeded draw, which a reference cannot invent). A basis vector's sign is arbitrary (the
    paper does not fix it), yet it matters because M and V are not rotated at a switch: each new column's
    largest-magnitude entry is made positive (docs/algorithms/alice.md)."""
    b1, b2, b3 = betas
    b3 = b3 if tracking else 0.0
    m, n = G.shape
    transpose = m > n
    A = G.T if transpose else G
    rows, cols = A.shape
    r = min(rank, rows, cols)
    st["t"] = t = st.get("t", 0) + 1
    if t == 1 or t % K == 0:
        if "U" not in st:
            U1 = torch.linalg.svd(A, full_matrices=False).U[:, :r]
            st.update(
                switches=0,
                Qt=torch.zeros(r, r, dtype=G.dtype),
                M=torch.zeros(r, cols, dtype=G.dtype),
                V=torch.zeros(r, cols, dtype=G.dtype),
                p=torch.zeros(cols, dtype=G.dtype),
                phi=0.0,
            )
        else:
            U = st["U"]
            Q = b3 * U @ st["Qt"] @ U.T + (1 - b3) * A @ A.T
            Ut = torch.linalg.qr(Q @ U).Q
            lam, E = torch.linalg.eigh(Ut.T @ Q @ Ut)
            U1 = Ut @ E.flip(1)
        lead = r if r == rows else max(min(leading, r), 2 * r - rows)
        if lead < r:
            complement = torch.linalg.qr(U1, mode="complete").Q[:, r:]
            U1 = torch.cat([U1[:, :lead], complement[:, complement_draw(r - lead, st["switches"])]], dim=1)
        U1 = U1 * torch.where(U1.gather(0, U1.abs().argmax(0, keepdim=True)) < 0, -1.0, 1.0).to(U1.dtype)
        if tracking and reproject and "U" in st:
            c = U1.T @ st["U"]
            st["Qt"] = c @ st["Qt"] @ c.T
        st["U"] = U1
        st["switches"] += 1
    U = st["U"]
    sigma = U.T @ A
    st["Qt"] = b3 * st["Qt"] + (1 - b3) * sigma @ sigma.T
    st["M"] = b1 * st["M"] + (1 - b1) * sigma
    st["V"] = b2 * st["V"] + (1 - b2) * sigma * sigma
    w = st["M"] / (st["V"].sqrt() + eps)
    R = A - U @ sigma
    st["p"] = b1 * st["p"] + (1 - b1) * (R * R).sum(0)
    if r < rows:
        C = (rows - r) ** 0.5 * R * _safe_scale(torch.sqrt(st["p"] + eps), 1.0)
    else:
        C = torch.zeros_like(R)
    eta = gamma / max(C.norm() / st["phi"], gamma) if st["phi"] > 0 else 1.0
    st["phi"] = eta * C.norm()
    D = alpha * (U @ w + alpha_c * eta * C)
    return W * (1 - lr * wd) - lr * (D.T if transpose else D)
