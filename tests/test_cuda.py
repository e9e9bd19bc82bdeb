"""The GPU path: every optimizer on CUDA against the same steps on the CPU, bf16 and zero-gradient steps on CUDA,
synchronizing calls inside a step (torch's sync debug mode; ``tests/test_host_syncs.py`` is the CPU proxy), and
DeepSpeed fp16 with dynamic loss scaling (which the CPU accelerator refuses).

Skipped without a CUDA device, so CI (CPU only) skips them; run them where a GPU is lent:
``python -m pytest tests/test_cuda.py``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import shardopt
from shardopt.optim.registry import OPTIMIZERS
from shardopt.train.model import Llama, LlamaConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

NAMES = list(OPTIMIZERS)
#: whole-matrix factorizations (SVD, eigh, Newton-Schulz) run in LAPACK on the CPU and cuSOLVER/cuBLAS on the
#: GPU; after three steps their results agree to this relative error (the element-wise rules to fp32 rounding)
TOLERANCE = {"sumo": 2e-4, "alice": 2e-4, "alice0": 2e-4, "asgo": 2e-4, "dasgo": 2e-4, "muon": 2e-4, "swan": 2e-4}


def _model(device: str, dtype: torch.dtype = torch.float32) -> Llama:
    torch.manual_seed(0)  # built on the CPU, so both devices start from the same weights
    model = Llama(
        LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_heads=2, num_layers=2, max_seq_len=16)
    )
    return model.to(device=device, dtype=dtype)


def _grads(model: torch.nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(device=p.device, dtype=p.dtype)


@pytest.fixture(autouse=True)
def _no_tf32():
    """fp32 products in full fp32 on the GPU, so CPU and CUDA compute the same function."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _ieee(name: str) -> dict:
    """The ieee precision for a whole-matrix rule (``matrix_ops.precision``'s ``"auto"`` picks bf16 for Muon on
    CUDA), so that CPU and CUDA compute the same function; Muon keeps its default strategy."""
    from shardopt.optim import OPTIMIZERS

    if "matrix_ops" not in OPTIMIZERS[name].Config.model_fields:
        return {}
    return {"matrix_ops": {"precision": "ieee", **({"strategy": "gather"} if name == "muon" else {})}}


@pytest.mark.parametrize("name", NAMES)
def test_cuda_matches_cpu(name: str) -> None:
    models = {d: _model(d) for d in ("cpu", "cuda")}
    opts = {d: shardopt.create_optimizer(m, name, **_ieee(name)) for d, m in models.items()}
    for step in range(3):
        for d, m in models.items():
            _grads(m, step)
            opts[d].step()
    tol = TOLERANCE.get(name, 1e-5)
    for (n, a), b in zip(models["cpu"].named_parameters(), models["cuda"].parameters()):
        err = (b.detach().cpu().double() - a.detach().double()).norm() / a.detach().double().norm()
        assert err <= tol, f"{name}: {n} differs between CPU and CUDA by {err:.2e} (relative) > {tol:g}"
    for st in opts["cuda"].state.values():
        for key, value in _tensors(st):
            if value.dim() > 0:
                assert value.is_cuda, f"{name}: state {key} left the GPU"


def test_cuda_muon_auto_precision_is_torch_bf16_iteration() -> None:
    """``matrix_ops.precision="auto"`` on CUDA runs Muon's iteration in bf16, as ``torch.optim.Muon``: the same
    numbers as ``ns_dtype="bfloat16"``."""
    runs = []
    for kw in ({}, {"ns_dtype": "bfloat16"}):
        model = _model("cuda")
        opt = shardopt.create_optimizer(model, "muon", **kw)
        for step in range(3):
            _grads(model, step)
            opt.step()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def _tensors(state: dict, prefix: str = ""):
    for k, v in state.items():
        if isinstance(v, dict):
            yield from _tensors(v, f"{prefix}{k}.")
        elif isinstance(v, torch.Tensor):
            yield f"{prefix}{k}", v


@pytest.mark.parametrize("name", NAMES)
def test_cuda_bf16_params_fp32_state(name: str) -> None:
    model = _model("cuda", torch.bfloat16)
    opt = shardopt.create_optimizer(model, name)
    for step in range(2):
        _grads(model, step)
        opt.step()
    for n, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.isfinite(p.float()).all(), f"{name}: {n} not finite bf16"
    for st in opt.state.values():
        for key, value in _tensors(st):
            if value.is_floating_point() and value.dim() > 0:
                assert value.dtype == torch.float32, f"{name}: state {key} is {value.dtype}, not float32"


@pytest.mark.parametrize("name", NAMES)
def test_cuda_zero_gradients_stay_finite(name: str) -> None:
    model = _model("cuda")
    opt = shardopt.create_optimizer(model, name)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters()), f"{name}: zero gradients produced NaN/inf"


#: the rules whose steps read nothing from the device (as in tests/test_host_syncs.py)
SYNC_FREE = ("scale", "sinkgd", "racs", "dasgo", "muon", "swan")
#: rules that gate their writes on the device, so the default non-finite check reads nothing either
#: (``ShardedOptimizer.skips_on_device``, ``nonfinite.gate_step``)
#: (the gates of Alice, Muon, SWAN and SUMO have not run on a GPU yet)
DEVICE_SKIP = ("scale", "sinkgd", "dasgo", "racs", "alice", "alice0", "muon", "swan", "sumo")


def _synchronizing_calls(opt) -> int:
    """The synchronizing CUDA calls of one ``opt.step()``, as torch's sync debug mode reports them (a read of a
    device value, a copy from pageable host memory, an explicit synchronize)."""
    old = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode(old)
    return sum("synchroniz" in str(w.message).lower() for w in caught)


@pytest.mark.parametrize("on_nonfinite,allowed", [("ignore", 0), ("skip", 1)])
@pytest.mark.parametrize("name", SYNC_FREE)
def test_cuda_steps_do_not_wait_for_the_device(name: str, on_nonfinite: str, allowed: int) -> None:
    """After the first step (which builds the plans and their index tensors), a step of these rules issues no
    synchronizing call; the default non-finite check reads its one flag (README "Host synchronizations"), none
    where the rule skips on the device."""
    allowed = 0 if name in DEVICE_SKIP else allowed
    model = _model("cuda")
    opt = shardopt.create_optimizer(model, name, on_nonfinite=on_nonfinite)
    counts = []
    for step in range(3):
        _grads(model, step)
        counts.append(_synchronizing_calls(opt))
    assert all(c <= allowed for c in counts[1:]), f"{name}: synchronizing calls per step {counts}, at most {allowed}"


@pytest.mark.parametrize("name", DEVICE_SKIP)
def test_cuda_device_skip_equals_host_check(name: str) -> None:
    """A step with a NaN gradient skipped on the device leaves what the host check leaves, and so do the steps
    around it (bit for bit); the skip is counted at the next step."""
    runs = []
    for on_device in (False, True):
        model = _model("cuda")
        opt = shardopt.create_optimizer(model, name, weight_decay=0.1)
        opt.nonfinite_on_device = on_device
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for step in range(5):
                _grads(model, step)
                if step == 2:
                    next(model.parameters()).grad.view(-1)[3] = float("nan")
                opt.step()
            assert opt.skipped_steps == 1
        runs.append((model, opt))
    (hm, ho), (dm, do) = runs
    for (n, a), b in zip(hm.named_parameters(), dm.parameters()):
        assert torch.equal(a, b), n
    for a, b in zip(ho.state_dict()["state"].values(), do.state_dict()["state"].values()):
        for k in a:
            if isinstance(a[k], torch.Tensor):
                assert torch.equal(a[k].cpu(), b[k].cpu()), k


@pytest.mark.parametrize("weight", [0.1, 0.01])
def test_cuda_skippable_lerp_is_lerp(weight: float) -> None:
    """The fused SGD kernel that ``nonfinite.skippable_lerp_`` borrows writes what ``_foreach_lerp_`` writes on
    CUDA too (the same formula, rounded the same way), and nothing when ``found_inf`` is 1."""
    from shardopt.optim.nonfinite import skippable_lerp_

    g = torch.Generator(device="cuda").manual_seed(0)
    targets = [torch.randn(1024, 1000, device="cuda", generator=g), torch.randn(4099, device="cuda", generator=g)]
    sources = [torch.randn_like(t) * 3 for t in targets]
    expected = [t.clone() for t in targets]
    torch._foreach_lerp_(expected, sources, weight)
    ran = [t.clone() for t in targets]
    skippable_lerp_(ran, sources, weight, torch.zeros(1, device="cuda"))
    assert all(torch.equal(a, b) for a, b in zip(ran, expected))
    sources[0][3, 1] = float("nan")
    skipped = [t.clone() for t in targets]
    skippable_lerp_(skipped, sources, weight, torch.ones(1, device="cuda"))
    assert all(torch.equal(a, b) for a, b in zip(skipped, targets))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("name", ["scale", "sumo"])
def test_deepspeed_fp16_loss_scaling(stage: int, name: str, tmp_path: Path) -> None:
    """A loss scale that starts too high overflows: DeepSpeed skips those steps without calling the optimizer,
    lowers the scale, and training then proceeds with finite weights and a falling loss."""
    pytest.importorskip("deepspeed")
    env = dict(
        os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1"
    )
    env.pop("DS_ACCELERATOR", None)
    out = tmp_path / "fp16.json"
    worker = Path(__file__).with_name("deepspeed_fp16_worker.py")
    proc = subprocess.run(
        [sys.executable, str(worker), name, str(stage), str(out)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rec = json.loads(out.read_text())
    assert rec["skipped"] >= 1, rec
    assert rec["stepped_when_not_skipped"], rec  # the optimizer ran exactly on the steps DeepSpeed did not skip
    assert rec["optimizer_step_count"] == rec["steps"] - rec["skipped"], rec
    assert rec["final_scale"] < rec["initial_scale"], rec
    assert rec["finite"], rec
    assert rec["last_loss"] < rec["first_loss"], rec


_megatron: dict = {}


def megatron_cuda_records(tmp_dir: Path) -> dict:
    """One launch of ``tests_dist/megatron_worker.py --device cuda`` at world size 1 for every optimizer."""
    if not _megatron:
        root = Path(__file__).resolve().parents[1]
        out = tmp_dir / "megatron.json"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node=1",
                f"--master_port={port}",
                str(root / "tests_dist" / "megatron_worker.py"),
                "--out",
                str(out),
                "--optimizers",
                ",".join(NAMES),
                "--device",
                "cuda",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        _megatron.update({r["optimizer"]: r for r in json.loads(out.read_text())})
    return _megatron


@pytest.mark.parametrize("name", NAMES)
def test_megatron_distributed_optimizer_step_matches_cpu(name: str, tmp_path_factory) -> None:
    """Megatron-core's real CUDA path (DistributedDataParallel + DistributedOptimizer, no CPU shim) at world size 1
    with shardopt's optimizer: three steps of Megatron's GPTModel equal the CPU one-process reference (absolute
    difference of the weights, the CUDA tolerance of each rule)."""
    pytest.importorskip("megatron.core")
    rec = megatron_cuda_records(tmp_path_factory.mktemp("megatron"))[name]
    assert "error" not in rec, rec["error"]
    assert rec["n_wrong_rules"] == 0 and rec["second_copies"] == 0 and rec["non_fp32_state"] == 0
    tol = TOLERANCE.get(name, 1e-5)
    assert rec["max_abs_diff"] <= tol, f"{name}: Megatron on CUDA differs from the CPU by {rec['max_abs_diff']:.2e}"
