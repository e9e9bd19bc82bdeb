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
