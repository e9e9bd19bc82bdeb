"""TEST-ONLY: run Megatron-core 0.16's DistributedDataParallel, DistributedOptimizer and pipeline schedules on the CPU.

Megatron-core hard-codes CUDA in three ways on the paths these tests use; this shim redirects them, in the test
processes only (it is not part of the ``shardopt`` package, and nothing in the package imports it):

* ``torch.cuda.current_device()`` as a ``device=`` argument (grad buffers, checkpoint buffers);
* ``device="cuda"`` tensors (loss scale, grad-norm and token-count scalars, p2p buffers);
* ``tensor.type() == "torch.cuda.FloatTensor"`` checks (which parameters the DistributedOptimizer accepts);
* the model-parallel CUDA RNG tracker that attention and dropout fork (the tests use no dropout: it forks nothing);
* (not CUDA, a launch cost) the distributed checkpoint writer's results queue, a spawn-context ``Manager`` that
  starts a fresh interpreter per rank importing the test's main module: the tests save synchronously, in the
  saving process, so a plain in-process queue serves.

Each module that holds such a reference gets a ``torch`` whose factory functions take ``"cuda"`` to mean the CPU;
``Tensor.type()`` (no argument) reports a CPU floating tensor under its CUDA name. On a GPU none of this is
installed: the real path runs unchanged.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types

import torch

_MODULES = (
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.async_utils",
)
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "empty_like", "ones_like")
_CUDA_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def _on_cpu(device):
    if device is None:
        return None
    text = str(device)
    return "cpu" if text.startswith("cuda") or isinstance(device, int) else device


def _factory(fn):
    def wrapped(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _on_cpu(kwargs["device"])
        return fn(*args, **kwargs)

    return wrapped


class _CpuCuda(types.ModuleType):
    """``torch.cuda`` whose current device is the CPU."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")

    def __getattr__(self, name):
        if name == "current_device":
            return lambda: "cpu"
        if name in ("synchronize", "empty_cache"):
            return lambda *a, **k: None
        return getattr(torch.cuda, name)


class _CpuTorch(types.ModuleType):
    """``torch`` as the shimmed modules see it: factories map ``"cuda"`` to the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, _factory(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


_installed = False
_SHIM = _CpuTorch()


def install() -> None:
    """Redirect the CUDA references of every Megatron-core module imported so far (call it again after importing
    more: model code, e.g. ``megatron.core.utils``' global buffers, holds them too)."""
    global _installed
    for name in _MODULES:
        importlib.import_module(name)
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(module, "torch", None) is torch:
            module.torch = _SHIM
    if _installed:
        return
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu" and self.dtype in _CUDA_NAMES:
            return _CUDA_NAMES[self.dtype]
        return original(self, dtype, non_blocking, **kwargs) if dtype is not None else original(self)

    torch.Tensor.type = type_
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.tensor_parallel import random as mp_random

    filesystem_async._get_write_results_queue = queue.Queue

    mp_random.CudaRNGStatesTracker.fork = lambda self, name="model-parallel-rng": contextlib.nullcontext()
    _installed = True
