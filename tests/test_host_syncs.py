"""Host synchronizations inside ``step()``, counted on a CPU (issue 29, item 2).

A GPU step stalls whenever the host reads a value computed on the device (``.item()``, ``bool(t)``, ``int(t)``,
``.tolist()``, a boolean mask), whenever it copies host data to the device (``torch.tensor(x, device=...)``: a copy
from pageable memory waits for the device), and whenever a ``torch.linalg`` factorization checks its error codes on the
host (``eigh``, ``svd``, ``cholesky``, ...: the non-``_ex`` calls do so on CUDA). On a CPU these cost nothing, so the
test counts the *calls* under a ``TorchFunctionMode``: a proxy that needs no GPU and names each site.

Reads of the step counters are not syncs: like ``torch.optim``'s (``capturable=False``) they live on the host.
The rules that do need a read are documented (README "Host synchronizations"): the non-finite check of
``on_nonfinite="skip"`` / ``"raise"`` (one read per step, as ``torch.amp.GradScaler``'s) and the factorizations
of ASGO, SUMO and Alice (float64 on the device today).
"""

from __future__ import annotations

import collections
import traceback

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import shardopt

READS = {
    torch.Tensor.item,
    torch.Tensor.__bool__,
    torch.Tensor.tolist,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.numpy,
    torch.nonzero,
    torch.Tensor.nonzero,
    torch.masked_select,
    torch.Tensor.masked_select,
    torch.unique,
    torch.Tensor.unique,
}
CHECKED_LINALG = {
    torch.linalg.eigh,
    torch.linalg.eigvalsh,
    torch.linalg.svd,
    torch.linalg.svdvals,
    torch.linalg.cholesky,
    torch.linalg.inv,
    torch.linalg.solve,
    torch.linalg.pinv,
    torch.linalg.lstsq,
    torch.linalg.eig,
    torch.linalg.matrix_rank,
}
#: reads of host tensors, not of the device: the host-resident step counters (read by the step and by Alice's
#: switch schedule in ``skips_on_device``) and the device skip's flag, copied to pinned host memory without
#: waiting and read at the next step once its event says the copy is done (``nonfinite.settle_device_skip``)
HOST_COUNTERS = {"_step_counts", "adamw_group_step", "skips_on_device", "settle_device_skip"}
FROM_HOST = {torch.tensor, torch.as_tensor}  # with a device: host data copied there (on CUDA, a synchronizing copy)


class SyncCounter(TorchFunctionMode):
    """Counts device-value reads and error-checked factorizations by the shardopt line that made them."""

    def __init__(self):
        super().__init__()
        self.sites: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kind = "read" if func in READS else "linalg" if func in CHECKED_LINALG else None
        if func in FROM_HOST and (kwargs or {}).get("device") is not None:
            kind = "copy"  # host data to the device: a copy from pageable memory waits for the device on CUDA
        if kind is None and func is torch.Tensor.__getitem__ and len(args) > 1:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
                kind = "read"  # a boolean mask: its true count sizes the result
        if kind is not None:
            frames = [
                f for f in traceback.extract_stack()[:-1] if "/shardopt/" in f.filename and not f.name.startswith("<")
            ]  # comprehensions: their def
            if frames and frames[-1].name not in HOST_COUNTERS:
                self.sites[(kind, f"{frames[-1].filename.rsplit('/shardopt/', 1)[-1]}:{frames[-1].name}")] += 1
        return func(*args, **(kwargs or {}))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.up = nn.Linear(32, 48)
        self.down = nn.Linear(48, 32)
        self.norm = nn.LayerNorm(32)
        self.lm_head = nn.Linear(32, 64, bias=False)

    def forward(self, x):
        return self.lm_head(self.norm(self.down(torch.relu(self.up(self.embed(x))))))


def syncs_per_step(name: str, steps: int = 4, **kw) -> list[collections.Counter]:
    torch.manual_seed(0)
    model = Model()
    opt = shardopt.create_optimizer(model, name, **kw)
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    out = []
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        opt.zero_grad()
        loss.backward()
        with SyncCounter() as counter:
            opt.step()
        out.append(counter.sites)
    return out


SYNC_FREE = ["scale", "sinkgd", "racs", "dasgo", "muon", "swan"]


@pytest.mark.parametrize("name", SYNC_FREE)
def test_elementwise_and_newton_schulz_steps_never_wait_for_the_device(name):
    for step, sites in enumerate(syncs_per_step(name, on_nonfinite="ignore")):
        assert not sites, f"{name} step {step + 1}: host syncs at {dict(sites)}"


@pytest.mark.parametrize("name", SYNC_FREE)
def test_the_nonfinite_check_is_one_read_per_step(name):
    for step, sites in enumerate(syncs_per_step(name)):
        assert dict(sites) == {("read", "optim/nonfinite.py:nonfinite_grads"): 1}, (name, step + 1, dict(sites))


@pytest.mark.parametrize("name", SYNC_FREE + ["alice", "alice0"])
def test_a_skip_decided_on_the_device_reads_nothing(name, monkeypatch):
    """The default check decided on the device (as CUDA does; the CPU is made to here): after the first step
    (Alice's first switch reads, and so keeps the host's check) a step reads nothing from the device."""
    monkeypatch.setattr(shardopt.ShardedOptimizer, "nonfinite_on_device", True)
    low_rank = {"rank": 8, "leading": 4, "refresh_interval": 5} if name.startswith("alice") else {}
    for step, sites in enumerate(syncs_per_step(name, **low_rank)):
        if step:
            assert not sites, f"{name} step {step + 1}: host syncs at {dict(sites)}"


def test_sumo_between_refreshes_reads_only_for_its_checked_polar_factor():
    """SUMO's limiter decides on the device (it used to read ``limited.any()`` every step); what is left
    between refreshes is the float64 polar factor: its eigendecomposition and the check that picks the SVD
    for the matrices whose Gram spectrum does not settle the cutoff (``matfun.polar_factor``)."""
    steps = syncs_per_step("sumo", steps=3, on_nonfinite="ignore", refresh_interval=10, rank=8)
    for sites in steps[1:]:
        assert all(where.startswith("sharding/matfun.py") for _, where in sites), dict(sites)
        assert not any(where.startswith("optim/sumo.py") for _, where in sites), dict(sites)


@pytest.mark.parametrize("name", ["asgo", "sumo", "alice", "alice0"])
def test_factorizing_optimizers_sync_only_in_factorizations_and_schedules(name):
    """The record of what is left for the GPU path (issue 29, item 1): every site is a factorization, its
    fallback check, or a refresh/switch schedule's counter (read once per refresh, not per step)."""
    allowed = (
        "sharding/matfun.py",
        "sharding/iterative.py",
        "sharding/subspace.py",
        "optim/alice.py:_switch",
        "optim/sumo.py:_refresh",
        "optim/asgo.py",
        "sharding/owner.py",
    )
    low_rank = {"rank": 8, **({"leading": 4} if name.startswith("alice") else {})} if name != "asgo" else {}
    for step, sites in enumerate(syncs_per_step(name, on_nonfinite="ignore", **low_rank)):
        for _, where in sites:
            assert where.startswith(allowed), (name, step + 1, where)


def test_asgo_on_the_iterative_route_reads_twice_per_root_shape():
    """ASGO's roots as batched products (the CUDA route, forced here): per stack of same-size roots one read sets
    the step count, one counts the matrices that need the eigendecomposition (``iterative.count_fallbacks``); no
    error-checked factorization (eigh on CUDA syncs once per matrix, inside cuSOLVER)."""
    from shardopt.sharding import iterative

    with iterative.forced(True):
        steps = syncs_per_step("asgo", steps=3, on_nonfinite="ignore")
    for sites in steps:
        assert dict(sites) == {
            ("read", "sharding/iterative.py:inverse_sqrt_checked"): 1,
            ("read", "sharding/iterative.py:count_fallbacks"): 1,
        }, dict(sites)
