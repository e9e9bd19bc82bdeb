"""Whole-matrix kernels used on owner ranks: quintic Newton-Schulz and the exact polar factor."""
from __future__ import annotations

import torch

__all__ = ["newton_schulz", "polar_factor", "MUON_COEFFICIENTS"]

#: quintic coefficients of Muon (KellerJordan/Muon; torch.optim.Muon defaults)
MUON_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(g: torch.Tensor, steps: int = 5, coefficients=MUON_COEFFICIENTS, eps: float = 1e-7,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Approximate orthogonalization ``U V^T`` of ``g`` (singular values land near 1), run in ``dtype`` on the
    wide orientation, returned in fp32. ``dtype=torch.bfloat16`` reproduces ``torch.optim.Muon``."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    if tall:
        x = x.T
    return x.float()


def polar_factor(g: torch.Tensor) -> torch.Tensor:
    """Exact ``U V^T`` from the reduced SVD in float64 (zero singular directions map to zero)."""
    u, s, vh = torch.linalg.svd(g.double(), full_matrices=False)
    keep = (s > s.max() * max(g.shape) * torch.finfo(torch.float64).eps).to(u.dtype) if s.numel() else s
    return ((u * keep) @ vh).float()


def whiten_newton_schulz(x: torch.Tensor, steps: int = 12, eps: float = 1e-12) -> torch.Tensor:
    """``(X X^T)^{-1/2} X`` (for m <= n; the transpose otherwise) by the coupled Newton-Schulz iteration on the
    small Gram matrix (specs/racs_alice.md section 7, B.8): ``Y0 = A/|A|_F, Z0 = I``,
    ``T = (3I - Z Y)/2, Y <- Y T, Z <- T Z``; then ``Z -> (A/|A|_F)^{-1/2}``. Unlike Muon's quintic it converges
    to the polar factor (singular values -> 1), in fp32."""
    x = x.float()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    a = x @ x.T
    c = a.norm().clamp(min=eps)
    eye = torch.eye(a.size(0), dtype=a.dtype, device=a.device)
    y, z = a / c, eye
    for _ in range(steps):
        t = 0.5 * (3.0 * eye - z @ y)
        y, z = y @ t, t @ z
    out = (z @ x) / c.sqrt()
    return out.T if tall else out
