"""SWAN as a multi-normalized gradient: row normalization, then whitening (arXiv:2502.06742 section 3.4,
docs/algorithms/swan.md).

For m <= n, with k = n (else on the transpose: the lines are columns and k = m)::

    repeat L:  X = sqrt(k) X / rownorm(X)          (optionally centered first; ``line_scale``)
               X = sqrt(k) (X X^T)^{-1/2} X         (whitening = sqrt(k) * polar factor U V^T; ``whiten``)
    W = W - lr * lr_scale * X

Sharded: the line norms are partial sums completed by one bucketed all-reduce; whitening needs only the
small Gram matrix of each matrix (``MatrixOps``: reduced from row blocks, or computed by an owner rank), then
the coupled Newton-Schulz iteration on it (converges to the polar factor; 12 steps by default, fp32), or an
exact float64 eigendecomposition (``whitening="svd"``).

Whole matrices (single process, or an owner's) are stacked by shape: line norms, Grams and products run
batched, and the roots of all Grams of one size as one batch. Single process, every sweep runs on the stacks.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Iterable, Literal

import pydantic
import torch
from typing_extensions import Unpack

from ..sharding import Round, col_sums, masked_rsqrt, row_sums, scale_into
from ..sharding.iterative import coupled_inverse_sqrt_rows
from ..sharding.matfun import by_shape, gram_inverse_sqrt
from ..sharding.matrix_ops import OpCost
from ..sharding.precision import LOW_PRECISION, arrival_dtype, noise_eig_rtol
from ..sharding.stacking import group_indices, same_shape
from .base import ShardedOptimizer
from .config import CommonOptions, WholeMatrixConfig
from .items import apply_items
from .nonfinite import zero_nonfinite

__all__ = ["SWAN", "line_scale", "whiten", "SWANConfig"]


def line_scale(norm2: torch.Tensor, k: int) -> torch.Tensor:
    """``sqrt(k) / |line|`` per line from the completed squared line norms (0 for a zero line)."""
    return masked_rsqrt(norm2, math.sqrt(k))


def whiten(a_rows: torch.Tensor, root: torch.Tensor, k: int) -> torch.Tensor:
    """Rows of ``sqrt(k) A (A^T A)^{-1/2}`` given ``root = (A^T A)^{-1/2}`` of the whole ``A``."""
    return (a_rows @ root) * math.sqrt(k)


def _subtract_line_means(layout: Any, x: torch.Tensor, means: torch.Tensor, axis: int) -> None:
    for b, view in layout.views(x):
        if axis == 0:
            view.sub_(means[b.row : b.row + b.height, None])
        else:
            view.sub_(means[None, b.col : b.col + b.width])


class SWANConfig(WholeMatrixConfig):
    """docs/algorithms/swan.md: SWAN-dagger lr 0.02 x 0.05, one normalize+whiten sweep, no centering."""

    treatment = "swan"

    lr: float = pydantic.Field(0.02, ge=0, description="global lr (AdamW's too unless adam_lr)")
    lr_scale: float = pydantic.Field(0.05, ge=0, description="the matrix lr is lr * lr_scale")
    iterations: int = pydantic.Field(1, ge=1, description="normalize + whiten sweeps")
    center: bool = pydantic.Field(False, description="subtract the row means first")
    whitening: Literal["newton_schulz", "svd"] = pydantic.Field(
        "newton_schulz",
        description="polar factor by the coupled Newton-Schulz iteration on the Gram, or by an "
        "exact float64 eigendecomposition",
    )
    ns_steps: int = pydantic.Field(12, ge=1, lt=100, description="coupled Newton-Schulz steps (converges)")


_D = SWANConfig.defaults()


class SWAN(ShardedOptimizer):
    """SWAN (``treatment="swan"``; keys ``lr`` 0.02, ``lr_scale`` 0.05, ``iterations`` 1, ``center`` False,
    ``whitening`` "newton_schulz" | "svd", ``ns_steps`` 12, ``weight_decay`` 0); others use AdamW at ``lr``."""

    Config = SWANConfig
    matrix_treatments = ("swan",)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = _D.lr,
        lr_scale: float = _D.lr_scale,
        iterations: int = _D.iterations,
        center: bool = _D.center,
        whitening: str = _D.whitening,
        ns_steps: int = _D.ns_steps,
        weight_decay: float = _D.weight_decay,
        **options: Unpack[CommonOptions],
    ):
        self._init_from_config(
            params,
            self.Config.from_arguments(
                type(self).__name__,
                dict(
                    lr=lr,
                    lr_scale=lr_scale,
                    iterations=iterations,
                    center=center,
                    whitening=whitening,
                    ns_steps=ns_steps,
                    weight_decay=weight_decay,
                ),
                options,
            ),
        )

    def skips_on_device(self, group: dict) -> bool:
        """SWAN keeps no state: a skipped step whitens gradients whose non-finite elements read as 0 and applies
        the result times 0 with a decay factor of 1 (``_step_swan``)."""
        return group.get("treatment") == "swan" or super().skips_on_device(group)

    def _step_swan(self, group: dict) -> None:
        lr = group["lr"] * group["lr_scale"]
        gate = self._step_gate  # None, or 0-d 1./0.: the step's skip decided on the device (nonfinite.gate_step)
        all_items = self._matrix_items(group)
        if gate is not None:
            for it in all_items:
                it.grad = zero_nonfinite(it.grad)
        here, items = self._whole_here_items(group, all_items)
        if here:  # matrices held whole by this rank (one process, DDP, a ZeRO rank's own): every sweep on stacks
            self._run_whole_matrix(group, here, lambda its, ops: self._local_bucket(its, ops, group))
            _apply_gated(here, lr, group["weight_decay"], gate)
        if not items:
            return
        # matrices split between ranks (the same ones on every rank): line norms reduced, whitening on MatrixOps
        rnd = Round()
        for it in items:
            m, n = it.layout.shape
            it.work["axis"] = 0 if self.a_transpose(group, (m, n)) else 1  # lines: rows of G when A = G^T
            it.work["k"] = max(m, n)
            it.work["x"] = it.grad.clone()
        for _ in range(group["iterations"]):
            if group["center"]:
                for it in items:
                    sums = (row_sums if it.work["axis"] == 0 else col_sums)(it.layout, it.work["x"])
                    rnd.add_axis(it.layout, sums, it.work["axis"])
                    it.work["sums"] = sums
                rnd.run()
                for it in items:
                    _subtract_line_means(it.layout, it.work["x"], it.work["sums"] / it.work["k"], it.work["axis"])
            for it in items:
                sq = it.work["x"] * it.work["x"]
                it.work["norm2"] = (row_sums if it.work["axis"] == 0 else col_sums)(it.layout, sq)
                rnd.add_axis(it.layout, it.work["norm2"], it.work["axis"])
            rnd.run()
            for it in items:
                inv = line_scale(it.work["norm2"], it.work["k"])
                scale_into(
                    it.layout,
                    it.work["x"],
                    it.work["x"],
                    inv if it.work["axis"] == 0 else None,
                    inv if it.work["axis"] == 1 else None,
                )
            self._whiten(items, group)
        _apply_gated(items, lr, group["weight_decay"], gate)

    whole_matrix_work = True

    def whole_matrix_transpose(self, group: dict, shape: tuple[int, int]) -> bool:
        m, n = shape
        return m <= n

    def whole_matrix_cost(self, group: dict, a_shape: tuple[int, int], parts: int = 1) -> OpCost:
        """The Gram and the whitening product (``4 rows k^2``, split with the rows), the root, once, on a
        factorization owner: the coupled Newton-Schulz iteration's ``3 ns_steps - 2`` products of ``k x k``
        matrices, or a float64 eigendecomposition (``whitening="svd"``, about ``10 k^3``). The Gram and the root
        cross the network whole, not as triangles: the fp32 iteration grows near-null directions by 1.5 per step
        and leaves its root asymmetric by more than rounding on rank-deficient gradients, so a symmetrized one
        would move the result."""
        rows, k = a_shape
        if group["whitening"] == "svd":
            small: dict[str, Any] = dict(small_flops=10.0 * k**3, small_matmul=2.0 * k**3, small_calls=1.0)
        else:  # a team inside one node may split its products by row blocks (issue 53)
            small = dict(
                small_matmul=2.0 * k**3 * (3 * group["ns_steps"] - 2), split_k=k, split_steps=group["ns_steps"]
            )
        return OpCost(row_flops=4.0 * rows * k * k, reduced=k * k, shared=k * k, **small)

    def _whiten(self, items: list, group: dict) -> None:
        """``x <- sqrt(k) x (x^T x)^{-1/2}`` on the orientation whose Gram is small: a sum over the long
        dimension's rows, reduced over row blocks (distributed) or computed by an owner (gather)."""
        self._run_whole_matrix(group, items, lambda its, ops: self._whiten_bucket(its, ops, group))

    def _whiten_bucket(self, items: list, ops: Any, group: dict) -> None:
        blocks = [b[0] for b in ops.to_blocks([[it.work["x"]] for it in items])]
        active = [i for i in range(len(items)) if ops.active(i)]
        spread = [i for i in active if ops.split(i)]
        # whole matrices (an owner's, or not sharded): stacked by shape, one batched Gram, root and product
        rtols = self._svd_rtols(items)
        stacks = _stacks({i: blocks[i] for i in active if not ops.split(i)})
        out = _unstack(
            stacks, _whiten_stacks([a for _, a in stacks], group, [[rtols[i] for i in idx] for idx, _ in stacks])
        )
        grams = ops.allreduce({i: blocks[i].T @ blocks[i] for i in spread})
        roots = ops.compute_once(
            grams,
            lambda mine: _gram_roots(mine, items, group, rtols=rtols),
            split=lambda mine, rows: _gram_roots(mine, items, group, rows, rtols),
        )
        out.update({i: whiten(blocks[i], roots[i], max(items[i].layout.shape)) for i in spread})
        for it, piece in zip(items, ops.from_blocks([out.get(i) for i in range(len(items))])):
            it.work["x"] = piece
        ops.account()

    def _local_bucket(self, items: list, ops: Any, group: dict) -> None:
        """Every sweep of matrices held whole (``local``: each local gradient is the row-major matrix), stacked
        by shape as ``A`` (rows = the long side ``k``, so the lines are its columns): normalize the lines,
        then whiten (the roots of all Grams of one size in one batch), ``iterations`` times."""
        stacks = []
        for idx in group_indices(range(len(items)), lambda i: tuple(items[i].layout.shape)):
            m, n = items[idx[0]].layout.shape
            g = torch.stack([items[i].grad for i in idx]).view(len(idx), m, n)
            t = self.a_transpose(group, (m, n))  # on the logical shape (a weight stored in x out: optim.transposed)
            stacks.append((idx, t, g.mT if t else g))  # A = G^T where whole_matrix_transpose
        xs = [a for _, _, a in stacks]
        rtols = self._svd_rtols(items)
        stack_rtols = [[rtols[i] for i in idx] for idx, _, _ in stacks]
        for _ in range(group["iterations"]):
            for j, a in enumerate(xs):
                k = a.size(-2)
                if group["center"]:
                    a = a - a.sum(-2, keepdim=True) / k
                xs[j] = a * line_scale((a * a).sum(-2, keepdim=True), k)
            xs = _whiten_stacks(xs, group, stack_rtols)
            ops.account()
        for (idx, transposed, _), a in zip(stacks, xs):
            g = a.mT if transposed else a
            for i, piece in zip(idx, g.reshape(len(idx), -1).unbind(0)):
                items[i].work["x"] = piece

    def _svd_rtols(self, items: list) -> list[float | None]:
        """Per matrix, the exact root's eigenvalue cutoff (relative to the Gram's largest) where its gradient
        arrived in bf16/fp16: ``precision.noise_eig_rtol`` of the ``s x s`` Gram (``s`` the short side), so
        directions at the gradient's rounding level are dropped, not whitened to unit weight; None (the fp32
        cutoff, unchanged) for fp32 gradients. Row normalization scales rows, so the elementwise rounding bound
        carries over to the normalized matrix; centering can cancel, so there it is the bound of the
        uncentered lines (documented in docs/exactness.md)."""
        out: list[float | None] = []
        for it in items:
            dtype = arrival_dtype(self, it.frag.name, it.tensor)
            k = min(it.layout.shape)
            out.append(noise_eig_rtol(dtype, k, k * 1.2e-7) if dtype in LOW_PRECISION else None)
        return out


def _apply_gated(items: list, lr: float, weight_decay: float, gate: torch.Tensor | None) -> None:
    """``apply_items`` of the whitened updates ``work["x"]``, times the device's gate where it decides the skip."""
    updates: list[torch.Tensor] | tuple[torch.Tensor, ...] = [it.work["x"] for it in items]
    if gate is not None:
        updates = torch._foreach_mul(updates, gate)
    apply_items(items, updates, lr, weight_decay, gate=gate)


def _gram_roots(
    grams: dict[int, torch.Tensor], items: list, group: dict, rows: Any = None, rtols: list[float | None] | None = None
) -> dict[int, torch.Tensor]:
    """``(A^T A)^{-1/2}`` of reduced Grams, batched by shape: the configured method, or the exact root where
    the Gram is singular by construction (``_exact_root``). ``rows``: a team's row exchange, whose members
    split the coupled iteration's products (``iterative.coupled_inverse_sqrt_rows``; issue 53). ``rtols``:
    per item, the exact root's cutoff for bf16/fp16 gradients (``SWAN._svd_rtols``; None: the fp32 one)."""
    exact = {i for i in grams if _exact_root(group, *items[i].layout.shape)}
    svd = set(grams) if group["whitening"] == "svd" else exact
    cuts: list[float | None] = rtols if rtols is not None else [None] * len(items)
    low = {i for i in svd if cuts[i] is not None}
    if rows is not None and group["whitening"] == "newton_schulz":
        root = lambda g: coupled_inverse_sqrt_rows(g.float(), group["ns_steps"], 1e-12, rows)  # noqa: E731
    else:
        root = lambda g: gram_inverse_sqrt(g, group["whitening"], group["ns_steps"])  # noqa: E731
    roots = by_shape(root, {i: g for i, g in grams.items() if i not in exact and i not in low})
    roots.update(by_shape(lambda g: gram_inverse_sqrt(g, "svd"), {i: grams[i] for i in exact if i not in low}))
    for idx in group_indices(sorted(low), lambda i: cuts[i]):  # the same cutoff: one batch per shape
        rtol = cuts[idx[0]]
        roots.update(
            by_shape(functools.partial(gram_inverse_sqrt, method="svd", rtol=rtol), {i: grams[i] for i in idx})
        )
    return roots


def _exact_root(group: dict, rows: int, cols: int) -> bool:
    """Centered lines of a square matrix sum to zero, so its Gram is singular by construction and the coupled
    iteration would amplify the null direction by 1.5 per step (to inf/NaN): those take the exact
    pseudo-inverse root, which maps it to zero. Decided by shape, the same on every rank."""
    return group["center"] and rows == cols


def _stacks(blocks: dict[int, torch.Tensor]) -> list[tuple[list[int], torch.Tensor]]:
    """Same-shape blocks stacked: ``(indices, (B, rows, cols) stack)`` per shape, in first-seen order."""
    return [(idx, torch.stack([blocks[i] for i in idx])) for idx in same_shape(blocks)]


def _unstack(stacks: list[tuple[list[int], torch.Tensor]], results: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    return {i: r[j] for (idx, _), r in zip(stacks, results) for j, i in enumerate(idx)}


def _whiten_stacks(
    stacks: list[torch.Tensor], group: dict, rtols: list[list[float | None]] | None = None
) -> list[torch.Tensor]:
    """``sqrt(k) A (A^T A)^{-1/2}`` for ``(B, k, s)`` stacks of whole matrices ``A`` (``k >= s``): the inverse
    roots of all ``s x s`` Grams taken by one method run as one batch, whatever ``k``. ``rtols``: per stack,
    each matrix's exact-root cutoff for bf16/fp16 gradients (None: the fp32 one, ``s * 1.2e-7``)."""
    grams = [a.mT @ a for a in stacks]
    by: dict[tuple, list[int]] = {}
    for j, (a, g) in enumerate(zip(stacks, grams)):
        method = "svd" if _exact_root(group, *a.shape[-2:]) else group["whitening"]
        cut = None
        if method == "svd" and rtols is not None and any(r is not None for r in rtols[j]):
            cut = tuple(g.shape[-1] * 1.2e-7 if r is None else r for r in rtols[j])
        by.setdefault((g.shape[-1], g.dtype, g.device, method, cut), []).append(j)
    roots: list = [None] * len(stacks)
    for (_, _, _, method, cut), idx in by.items():
        cat = grams[idx[0]] if len(idx) == 1 else torch.cat([grams[j] for j in idx])
        rtol = None if cut is None else torch.tensor(cut * len(idx), dtype=torch.float64)
        r = gram_inverse_sqrt(cat, method, group["ns_steps"], rtol=rtol)
        for j, piece in zip(idx, r.split([grams[j].size(0) for j in idx])):
            roots[j] = piece
    return [whiten(a, r, a.size(-2)) for a, r in zip(stacks, roots)]
