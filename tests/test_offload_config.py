"""ZeRO-Offload settings (issue 56), without launching DeepSpeed: what each front door sets and refuses, where a
collective on CPU-resident partitions runs (``sharding.staging``'s routing decision), the lost-optimizer message,
and the precision-aware cutoffs (``sharding.precision``)."""

from __future__ import annotations

import pytest
import torch

from shardopt.optim.registry import ConfigError
from shardopt.plugin.deepspeed_engine import OFFLOAD_KEYS, apply_offload_keys, offload_devices, parse_section
from shardopt.sharding import precision, staging

SECTION = {"optimizer": "scale", "params": {"lr": 1e-3}}


def config(stage: int, **zero) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": stage, **zero},
        "shardopt": dict(SECTION),
    }


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_cpu_offload_sets_the_keys_deepspeed_would_ask_for(stage: int) -> None:
    cfg = config(
        stage, offload_optimizer={"device": "cpu"}, **({"offload_param": {"device": "cpu"}} if stage == 3 else {})
    )
    parse_section(cfg)
    assert {k: cfg[k] for k in OFFLOAD_KEYS} == OFFLOAD_KEYS


def test_no_offload_leaves_the_force_key_alone() -> None:
    cfg = config(2)
    parse_section(cfg)
    assert "zero_force_ds_cpu_optimizer" not in cfg
    assert offload_devices(cfg) == {"offload_optimizer": "none", "offload_param": "none"}


@pytest.mark.parametrize("key", ["offload_optimizer", "offload_param"])
def test_nvme_is_refused_naming_cpu(key: str) -> None:
    cfg = config(3, **{key: {"device": "nvme", "nvme_path": "/tmp"}})
    with pytest.raises(ConfigError, match=rf"zero_optimization\.{key}\.device = 'nvme'.*\"device\": \"cpu\""):
        parse_section(cfg)


@pytest.mark.parametrize(
    "stage,zero,match",
    [
        (
            0,
            {"offload_optimizer": {"device": "cpu"}},
            r"offload_optimizer.device = 'cpu' needs zero_optimization.stage",
        ),
        (2, {"offload_param": {"device": "cpu"}}, r"offload_param.device = 'cpu' needs zero_optimization.stage 3"),
        (2, {"offload_optimizer": "cpu"}, r"zero_optimization.offload_optimizer: expected an object"),
    ],
)
def test_offload_where_deepspeed_would_ignore_it_is_refused(stage: int, zero: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        apply_offload_keys(config(stage, **zero))


def test_force_cpu_optimizer_true_is_refused_with_its_name() -> None:
    cfg = {**config(2, offload_optimizer={"device": "cpu"}), "zero_force_ds_cpu_optimizer": True}
    with pytest.raises(ConfigError, match=r"zero_force_ds_cpu_optimizer = True in the DeepSpeed config.*false"):
        parse_section(cfg)


def test_accelerate_front_door_sets_the_key_before_prepare() -> None:
    """``integrations.accelerate.keep_optimizer_under_offload`` edits the plugin's config in place (what
    accelerate reads in ``prepare``), only when a shardopt optimizer is prepared."""
    from types import SimpleNamespace

    import shardopt
    from shardopt.integrations.accelerate import keep_optimizer_under_offload

    cfg = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    acc = SimpleNamespace(
        state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(hf_ds_config=SimpleNamespace(config=cfg)))
    )
    model = torch.nn.Linear(4, 4)
    keep_optimizer_under_offload(acc, (model, torch.optim.SGD(model.parameters(), lr=0.1)))
    assert "zero_force_ds_cpu_optimizer" not in cfg  # not ours to change
    keep_optimizer_under_offload(acc, (model, shardopt.create_optimizer(model, "scale", lr=1e-3)))
    assert cfg["zero_force_ds_cpu_optimizer"] is False and cfg["zero_allow_untested_optimizer"] is True


# ------------------------------------------------------------------------------------------ staging decision
@pytest.mark.parametrize(
    "backend,device,expected",
    [
        ("gloo", "cpu", None),  # CPU tests, and gloo DP groups: as before
        ("nccl", "cuda", None),  # partitions on the GPU: as before
        ("nccl", "cpu", "cuda:0"),  # ZeRO-Offload on NCCL: through the device
        ("cpu:gloo,cuda:nccl", "cpu", None),  # a group with a CPU backend takes it directly
        ("cpu:gloo,cuda:nccl", "cuda", None),
        ("hccl", "cpu", "cuda:0"),  # any device-only backend
        ("mpi", "cpu", None),
    ],
)
def test_staging_decision(backend: str, device: str, expected: str | None) -> None:
    got = staging.staging_device(torch.device(device), backend, torch.device("cuda", 0))
    assert (None if got is None else str(got)) == expected


def test_staging_without_a_device_names_the_fix() -> None:
    with pytest.raises(RuntimeError, match=r"'nccl' process group got a cpu tensor.*torch.cuda.set_device"):
        staging.staging_device(torch.device("cpu"), "nccl", None)


def test_staged_collective_runs_where_the_backend_takes_it(monkeypatch) -> None:
    """A CPU buffer on a (pretended) NCCL group is reduced on the staging device and copied back in place; on
    this CPU host the 'device' is the CPU itself, so the wrapper's copies are what is checked."""
    import torch.distributed as dist

    seen = []
    monkeypatch.setattr(staging, "_backend", lambda group: "nccl")
    monkeypatch.setattr(staging, "accelerator_device", lambda: torch.device("meta"))
    monkeypatch.setattr(staging, "_host_only", lambda: False)  # as on a host with an accelerator
    monkeypatch.setattr(staging, "takes_device", lambda backend, kind: kind == "meta")
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None: seen.append(t.device.type))
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src: seen.append(("copy", src.device.type)) or self)
    staging.all_reduce(torch.ones(3))
    assert seen == ["meta", ("copy", "meta")]


# ----------------------------------------------------------------------------------- precision-aware cutoffs
def test_cutoffs_follow_the_arrival_precision_and_keep_fp32() -> None:
    fp32 = 64 * torch.finfo(torch.float32).eps
    assert precision.noise_rtol(torch.float32, (4, 64), fp32) == fp32  # fp32 runs: unchanged
    assert precision.noise_rtol(torch.bfloat16, (4, 64), fp32) == pytest.approx(2 * 2**-7)
    assert precision.noise_rtol(torch.float16, (4, 64), fp32) == pytest.approx(2 * 2**-10)
    assert precision.noise_eig_rtol(torch.float32, 8, 1e-6) == 1e-6
    assert precision.noise_eig_rtol(torch.bfloat16, 8, 1e-6) == pytest.approx(8 * 2**-14)


def test_arrival_dtype_sources() -> None:
    from types import SimpleNamespace

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2).to(torch.bfloat16))
    assert precision.model_arrival_dtypes(model) == {"1.weight": torch.bfloat16, "1.bias": torch.bfloat16}
    opt = SimpleNamespace()
    precision.record_arrival_dtypes(opt, {"0.weight": torch.float16})
    assert precision.arrival_dtype(opt, "0.weight", torch.zeros(1)) == torch.float16
    assert precision.arrival_dtype(opt, "x", torch.zeros(1, dtype=torch.bfloat16)) == torch.bfloat16
    assert precision.arrival_dtype(opt, "x", torch.zeros(1)) == torch.float32


def test_sumo_drops_bf16_rounding_directions_only_for_bf16_gradients() -> None:
    """A rank-1 gradient plus bf16-sized noise: with fp32 arrival SUMO's moment keeps the noise directions (unit
    weight in the polar factor); recorded as bf16 they are dropped, and the update is the rank-1 one."""
    import shardopt

    torch.manual_seed(0)
    u, v = torch.randn(16, 1), torch.randn(1, 32)
    g = u @ v
    g = g + 2**-9 * g.abs().mean() * torch.randn_like(g)
    updates = {}
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.nn.Parameter(torch.zeros(16, 32))
        opt = shardopt.create_optimizer([("w", w)], "sumo", lr=1.0, rank=4)
        precision.record_arrival_dtypes(opt, {"w": dtype})
        w.grad = g.clone()
        opt.step()
        updates[dtype] = -w.detach()
    s32 = torch.linalg.svdvals(updates[torch.float32])
    s16 = torch.linalg.svdvals(updates[torch.bfloat16])
    assert (s32 > 1e-3 * s32[0]).sum() >= 2  # fp32 arrival: the noise directions get weight
    assert (s16 > 1e-3 * s16[0]).sum() == 1  # bf16 arrival: only the signal


def test_alice_noise_floor_follows_the_arrival_precision() -> None:
    """Alice's per-entry noise floor (``drop_noise_directions``, ``residual_energy``) is ``fp32_floor`` for fp32
    gradients, bit for bit, and ``eps(bf16)`` for bf16-arrived ones; a stack mixing both gets one floor each."""
    from types import SimpleNamespace

    import shardopt
    from shardopt.sharding.subspace import fp32_floor

    w = [torch.nn.Parameter(torch.zeros(16, 32)) for _ in range(2)]
    opt = shardopt.create_optimizer([("a", w[0]), ("b", w[1])], "alice", rank=4, leading=2)
    items = [SimpleNamespace(frag=SimpleNamespace(name=n), tensor=t) for n, t in (("a", w[0]), ("b", w[1]))]
    stack = SimpleNamespace(rows=16, cols=32, idx=[0, 1])
    assert opt._noise_floor(stack, items) == fp32_floor((16, 32))
    precision.record_arrival_dtypes(opt, {"a": torch.bfloat16, "b": torch.bfloat16})
    assert opt._noise_floor(stack, items) == torch.finfo(torch.bfloat16).eps
    precision.record_arrival_dtypes(opt, {"b": torch.float32})
    mixed = opt._noise_floor(stack, items)
    assert mixed.tolist() == pytest.approx([torch.finfo(torch.bfloat16).eps, fp32_floor((16, 32))])


def test_asgo_pseudo_inverse_drops_bf16_rounding_directions_only_for_bf16_gradients() -> None:
    """ASGO with ``eps = 0`` (its pseudo-inverse root): a rank-2 gradient plus bf16-sized noise; with fp32 arrival
    the noise directions get unit weight (``M V^{-1/2}``), recorded as bf16 they are dropped."""
    import shardopt

    torch.manual_seed(0)
    g = torch.randn(16, 2) @ torch.randn(2, 32)
    g = g + 2**-7 * g.abs().mean() * torch.randn_like(g)
    kept = {}
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.nn.Parameter(torch.zeros(16, 32))
        opt = shardopt.create_optimizer([("w", w)], "asgo", lr=1.0, eps=0.0)
        precision.record_arrival_dtypes(opt, {"w": dtype})
        w.grad = g.clone()
        opt.step()
        s = torch.linalg.svdvals(w.detach())
        kept[dtype] = int((s > 1e-3 * s[0]).sum())
    assert kept[torch.float32] > 2 and kept[torch.bfloat16] == 2, kept


def test_inverse_root_cutoff_per_matrix() -> None:
    from shardopt.sharding.matfun import inverse_root

    torch.manual_seed(0)
    a = torch.randn(3, 8, 8, dtype=torch.float64)
    a = a @ a.mT
    assert torch.equal(inverse_root(a, 0.0), inverse_root(a, 0.0, rtol=None))  # the fp32 default, bit for bit
    roots = inverse_root(a, 0.0, rtol=torch.tensor([1e-9, 0.5, 2.0], dtype=torch.float64))
    ranks = [int(torch.linalg.matrix_rank(r.double(), rtol=1e-6)) for r in roots]
    assert ranks[0] == 8 and 0 < ranks[1] < 8 and ranks[2] == 0, ranks


@pytest.mark.parametrize("whitening,center", [("svd", False), ("newton_schulz", True)])
def test_swan_exact_root_follows_the_arrival_precision(whitening: str, center: bool) -> None:
    """SWAN's exact root (``whitening="svd"``, or centered square matrices): a rank-8 gradient whose singular values
    fall from 1 to 1e-3, summed whole or from two bf16-rounded halves (world size 1 vs 2). With the fp32 cutoff
    the directions below bf16 rounding get unit weight and the two updates differ by 8-40%; recorded as bf16 they
    are dropped and the updates differ by the rounding of the kept ones (< 1%)."""
    import shardopt

    torch.manual_seed(0)
    m = 24
    u, _ = torch.linalg.qr(torch.randn(m, 8))
    v, _ = torch.linalg.qr(torch.randn(m, 8))
    sv = torch.logspace(0, -3, 8)
    halves = [(u * sv) @ (0.3 * torch.randn(8, 8) + torch.eye(8)) @ v.T for _ in range(2)]
    whole = (halves[0] + halves[1]).bfloat16().float()
    split = (halves[0].bfloat16().float() + halves[1].bfloat16().float()).bfloat16().float()
    spread, kept = {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        updates = []
        for g in (whole, split):
            w = torch.nn.Parameter(torch.zeros(m, m))
            opt = shardopt.create_optimizer(
                [("w", w)], "swan", lr=1.0, lr_scale=1.0, center=center, whitening=whitening
            )
            precision.record_arrival_dtypes(opt, {"w": dtype})
            w.grad = g.clone()
            opt.step()
            updates.append(w.detach().clone())
        spread[dtype] = float((updates[0] - updates[1]).norm() / updates[0].norm())
        s = torch.linalg.svdvals(updates[0])
        kept[dtype] = int((s > 1e-3 * s[0]).sum())
    assert spread[torch.float32] > 0.05 and spread[torch.bfloat16] < 0.01, spread
    assert kept[torch.bfloat16] < kept[torch.float32], kept


def test_swan_exact_root_mixed_precisions_in_one_stack() -> None:
    """Same-shape matrices stacked together keep each one's own cutoff: an fp32 matrix's update is the one it gets
    alone (bit for bit), whatever precision its stack-mate's gradient arrived in."""
    import shardopt

    torch.manual_seed(0)
    grads = {n: torch.randn(16, 3) @ torch.randn(3, 16) + 1e-2 * torch.randn(16, 16) for n in ("a", "b")}

    def step(names: list[str], dtypes: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
        ws = {n: torch.nn.Parameter(torch.zeros(16, 16)) for n in names}
        opt = shardopt.create_optimizer(list(ws.items()), "swan", lr=1.0, lr_scale=1.0, whitening="svd")
        precision.record_arrival_dtypes(opt, dtypes)
        for n, w in ws.items():
            w.grad = grads[n].clone()
        opt.step()
        return {n: w.detach().clone() for n, w in ws.items()}

    both = step(["a", "b"], {"b": torch.bfloat16})
    assert torch.equal(both["a"], step(["a"], {})["a"])
    assert torch.equal(both["b"], step(["b"], {"b": torch.bfloat16})["b"])
    assert not torch.equal(both["b"], step(["b"], {})["b"])


def test_asgo_cutoff_finds_the_matrix_in_a_flat_partition() -> None:
    """ASGO's local path on an engine's flat partition (DeepSpeed ZeRO at world size 1: ``use_layouts(flat=)``)
    looks the arrival precision up by the fragment's name, as the sharded path does: the bf16 cutoff applies and
    the update equals the one the parameter gets stepped directly (before, the partition had no name, so world
    size 1 kept the fp32 cutoff while world size 2 took the bf16 one: 0.6% -> 9.7% spread on bf16 ZeRO-2)."""
    import shardopt
    from shardopt.sharding.fragment import Fragment
    from shardopt.sharding.layout import MatrixLayout

    torch.manual_seed(0)
    g = torch.randn(16, 2) @ torch.randn(2, 32)
    g = g + 2**-7 * g.abs().mean() * torch.randn_like(g)

    def step(dtype: torch.dtype, flat: bool) -> torch.Tensor:
        w = torch.nn.Parameter(torch.zeros(16, 32))
        opt = shardopt.create_optimizer([("w", w)], "asgo", lr=1.0, eps=0.0)
        precision.record_arrival_dtypes(opt, {"w": dtype})
        if not flat:
            w.grad = g.clone()
            opt.step()
            return w.detach()
        part = torch.nn.Parameter(torch.zeros(16 * 32))
        opt.param_groups[0]["params"] = [part]
        opt.use_layouts(flat=[(part, [Fragment("w", MatrixLayout.whole((16, 32)), 0)])])
        part.grad = g.reshape(-1).clone()
        opt.step()
        return part.detach().view(16, 32)

    for dtype, kept in ((torch.float32, 10), (torch.bfloat16, 2)):
        direct, flat = step(dtype, False), step(dtype, True)
        assert torch.equal(direct, flat), dtype
        s = torch.linalg.svdvals(flat)
        assert int((s > 1e-3 * s[0]).sum()) == kept, dtype
