"""The precision of whole-matrix iterations (``matrix_ops.precision``): one documented policy, never a silent change.

Newton-Schulz iterations are chains of small matrix products. In fp32 they run on a GPU's CUDA cores at a few
percent of its tensor-core rate; in bf16 or TF32 they run on the tensor cores.

* ``"ieee"``: fp32 products (float64 where a route already uses it), as before this policy.
* ``"bf16"``: the iteration in bfloat16 (Muon: ``torch.optim.Muon``'s iteration, bit for bit).
* ``"tf32"``: the products in TF32 (operands with 10 mantissa bits, fp32 accumulation): CUDA's tensor-core mode
  where the matrices live on a GPU, emulated on the CPU by rounding operands to nearest (``round_tf32``), so that
  tests and the float64 oracle see TF32-sized errors (a GPU may truncate instead: the same size, other digits).
* ``"auto"`` (default): ``"ieee"`` on the CPU, so every exactness test and CPU run stays as it was; on CUDA the
  rule's own choice (``AUTO_CUDA``): Muon's iteration in bf16, as ``torch.optim.Muon`` runs it; ``"ieee"`` for the
  others.

Which rules take a low-precision route: Muon, whose fixed 5-step polynomial iteration needs no more accuracy than
its products give. SWAN's whitening, ASGO's roots and SUMO's and Alice's factors must keep the ieee route's
accuracy (their documented residual checks); a low-precision start corrected by fp32 steps is future work (a
coupled iteration started from low-precision iterates converges to a rotated root, not the root), so for them
``"tf32"`` / ``"bf16"`` are refused with an error rather than ignored. Every route is deterministic per matrix: a
sharded run equals the single-process run at the same precision.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator

import torch

__all__ = ["PRECISIONS", "AUTO_CUDA", "resolve_precision", "round_tf32", "matmul_in", "low_precision"]

PRECISIONS = ("auto", "ieee", "tf32", "bf16")
#: what ``"auto"`` means on CUDA, per rule (the others: "ieee")
AUTO_CUDA = {"muon": "bf16"}


def resolve_precision(setting: str, rule: str, device_type: str) -> str:
    """The precision a rule's iterations run at: ``setting`` unless ``"auto"`` (see the module docstring)."""
    if setting not in PRECISIONS:
        raise ValueError(f"matrix_ops.precision must be one of {PRECISIONS}, got {setting!r}")
    if setting != "auto":
        return setting
    return AUTO_CUDA.get(rule, "ieee") if device_type == "cuda" else "ieee"


def round_tf32(t: torch.Tensor) -> torch.Tensor:
    """``t`` (fp32) rounded to TF32's 10 explicit mantissa bits, to nearest, ties to even: the operand a tensor core
    multiplies in TF32 mode. Infinities and NaNs pass unchanged."""
    bits = t.contiguous().view(torch.int32)
    lsb = (bits >> 13) & 1
    rounded = ((bits + 0xFFF + lsb) & ~0x1FFF).view(torch.float32)
    return torch.where(torch.isfinite(t), rounded, t)


@contextlib.contextmanager
def _cuda_tf32() -> Iterator[None]:
    """TF32 matmuls on CUDA within the block: torch's ``fp32_precision`` setting where it exists (torch 2.9+; reading
    the legacy ``allow_tf32`` after it was set raises), else ``allow_tf32``."""
    matmul = torch.backends.cuda.matmul
    key, value = ("fp32_precision", "tf32") if hasattr(matmul, "fp32_precision") else ("allow_tf32", True)
    old = getattr(matmul, key)
    setattr(matmul, key, value)
    try:
        yield
    finally:
        setattr(matmul, key, old)


def matmul_in(precision: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``a @ b`` of fp32 matrices (batched) at ``precision``, returned in fp32: bf16 operands, TF32 operands (the
    tensor cores on CUDA, ``round_tf32`` elsewhere), or plain fp32 (``"ieee"``)."""
    if precision == "bf16":
        return lambda a, b: (a.bfloat16() @ b.bfloat16()).float()
    if precision == "tf32":

        def tf32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            if a.is_cuda:
                with _cuda_tf32():
                    return a @ b
            return round_tf32(a) @ round_tf32(b)

        return tf32
    if precision == "ieee":
        return torch.matmul
    raise ValueError(f"no matmul for precision {precision!r} (resolve 'auto' first)")


def low_precision(precision: str) -> bool:
    return precision in ("bf16", "tf32")


# ---------------------------------------------------------------------------------- the gradient's arrival precision
#: Where a rule drops singular or eigen-directions as numerically zero, the cutoff follows the precision the gradient
#: was computed in (bf16 or fp16 parameters, FSDP2's ``MixedPrecisionPolicy.param_dtype``, DeepSpeed's bit16
#: weights), not only the fp32 it is upcast to: rounding a gradient ``A`` to a unit roundoff ``u`` moves it by ``E``
#: with ``|E_ij| <= u |A_ij|``, so ``|E|_2 <= u |A|_F <= u sqrt(k) sigma_1`` (``k = min(m, n)``): a direction below
#: ``sqrt(k) eps sigma_1`` (``eps = 2u``, a factor-2 margin) can be rounding alone, and an orthogonalization would give
#: it unit weight, so it differs with the batching (issue 56: SUMO 80% between world sizes 1 and 2 in bf16). fp32
#: gradients keep each rule's fp32 cutoff, which is larger than this bound: fp32 runs are unchanged.
LOW_PRECISION = (torch.bfloat16, torch.float16)

__all__ += [
    "LOW_PRECISION",
    "arrival_dtype",
    "noise_rtol",
    "noise_eig_rtol",
    "model_arrival_dtypes",
    "record_arrival_dtypes",
]


def arrival_dtype(opt: object, name: str, tensor: torch.Tensor) -> torch.dtype:
    """The precision matrix ``name``'s gradient arrived in: recorded by an engine adapter
    (``record_arrival_dtypes``: DeepSpeed's bit16 weights, FSDP2's mixed-precision policy), else the stepped
    tensor's own dtype where it is bf16/fp16 (a bf16 model stepped whole), else fp32."""
    recorded = getattr(opt, "grad_dtypes", None)
    if recorded and name in recorded:
        return recorded[name]
    return tensor.dtype if tensor.dtype in LOW_PRECISION else torch.float32


def noise_rtol(dtype: torch.dtype, shape: tuple[int, ...], fp32_rtol: float) -> float:
    """The relative singular-value cutoff for a ``shape`` matrix built from ``dtype`` gradients: the rule's own
    ``fp32_rtol``, raised to ``sqrt(min(m, n)) eps(dtype)`` for bf16/fp16 (see above)."""
    if dtype not in LOW_PRECISION:
        return fp32_rtol
    return max(fp32_rtol, math.sqrt(min(shape[-2:])) * torch.finfo(dtype).eps)


def noise_eig_rtol(dtype: torch.dtype, k: int, fp32_rtol: float) -> float:
    """The same for the eigenvalues of a ``k x k`` Gram or second-moment statistic (squared singular values):
    ``fp32_rtol`` (relative to the largest eigenvalue), raised to ``k eps(dtype)^2`` for bf16/fp16."""
    if dtype not in LOW_PRECISION:
        return fp32_rtol
    return max(fp32_rtol, k * torch.finfo(dtype).eps ** 2)


def model_arrival_dtypes(model: torch.nn.Module) -> dict[str, torch.dtype]:
    """``{parameter name: bf16/fp16}`` for the parameters of ``model`` whose gradients are computed in low
    precision: FSDP2's ``MixedPrecisionPolicy.param_dtype`` (the sharded parameter stays fp32) or the parameter's
    own dtype. fp32 parameters are left out."""
    policy: dict[int, torch.dtype] = {}
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            continue
        try:
            groups = get_state()._fsdp_param_groups
        except Exception:  # noqa: BLE001 - torch internals moved: the parameters' own dtypes still apply
            continue
        for group in groups:
            dtype = getattr(getattr(group, "mp_policy", None), "param_dtype", None)
            for fsdp_param in getattr(group, "fsdp_params", []):
                if dtype is not None:
                    policy[id(fsdp_param.sharded_param)] = dtype
    out = {}
    for name, p in model.named_parameters():
        dtype = policy.get(id(p), p.dtype)
        if dtype in LOW_PRECISION:
            out[name] = dtype
    return out


def record_arrival_dtypes(opt: Any, dtypes: dict[str, torch.dtype]) -> None:
    """Remember, on ``opt``, the precision each named matrix's gradient arrives in (``arrival_dtype`` reads it)."""
    recorded = getattr(opt, "grad_dtypes", None)
    if recorded is None:
        recorded = {}
        opt.grad_dtypes = recorded
    recorded.update(dtypes)
