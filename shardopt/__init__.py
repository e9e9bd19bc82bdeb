"""shardopt: memory-efficient, matrix-aware optimizers that stay exact on sharded parameters.

The optimizers (vectors, and whatever the routing says, go to AdamW inside the same object):

* ``SCALE``: per-output-unit RMS normalization, EMA momentum on the LM head only (arXiv:2506.16659)
* ``SinkGD``: SR-Sinkhorn row/column normalization (arXiv:2502.06742)
* ``RACS``: row/column scaling from a rank-1 fit of G*G with a norm-growth limiter (arXiv:2502.07752)
* ``SWAN``: row normalization, then whitening (arXiv:2502.06742 s3.4)
* ``ASGO`` / ``DASGO``: one-sided Shampoo / its diagonal form (arXiv:2503.20762)
* ``SUMO``: rank-r moment in a refreshed subspace, orthogonalized exactly (arXiv:2505.24749)
* ``Alice`` / ``Alice0``: low-rank Adam in a tracked subspace with compensation (arXiv:2502.07752)
* ``Muon``: momentum + Newton-Schulz, the common baseline (equals ``torch.optim.Muon``)

``shardopt.create_optimizer(model, name, **hyperparameters)`` for single process, DDP and FSDP2;
``shardopt.deepspeed.initialize(model=..., config=...)`` for DeepSpeed ZeRO 0-3;
``shardopt.param_groups(model, name, **hyperparameters)`` for whole-parameter sharders
(``ZeroRedundancyOptimizer(groups, optimizer_class=shardopt.SCALE)``, fairscale ``OSS``). The classes also take
what ``torch.optim`` takes (``model.named_parameters()``, tensors, param groups). ``shardopt.describe(obj)`` prints
which role and rule every parameter got, for whatever a front door returned (optimizer, engine, trainer);
``shardopt.register_model(model)`` lets optimizers built from its bare tensors (torchtune's configs, one optimizer
per parameter) find their names and roles.
"""

from types import ModuleType

from ._version import __version__
from .optim import (
    ASGO,
    DASGO,
    RACS,
    SCALE,
    SUMO,
    SWAN,
    Alice,
    Alice0,
    ConfigError,
    Muon,
    ShardedOptimizer,
    SinkGD,
    create_optimizer,
    param_groups,
)
from .optim.describe import describe
from .plugin import fsdp1 as _fsdp1  # noqa: F401  registers legacy FSDP's model inspector, watcher and param source
from .plugin import wrapped as _wrapped  # noqa: F401  registers its pre-step check, param source and model watcher
from .plugin.known_models import register_model  # registers its param source (names for bare tensors)

__all__ = [
    "create_optimizer",
    "param_groups",
    "describe",
    "register_model",
    "SCALE",
    "SinkGD",
    "RACS",
    "SWAN",
    "ASGO",
    "DASGO",
    "SUMO",
    "Alice",
    "Alice0",
    "Muon",
    "ShardedOptimizer",
    "ConfigError",
    "__version__",
]


#: the documented submodules ``import shardopt`` reaches on first use (``shardopt.checkpoint.save(...)``): imported
#: only then, so ``import shardopt`` stays as quick as it was and DeepSpeed, Megatron-core and transformers (optional
#: extras) load only for the code that uses them
_SUBMODULES = ("checkpoint", "deepspeed", "megatron", "integrations", "sharding", "train", "plugin", "optim")


def __getattr__(name: str) -> ModuleType:
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'shardopt' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_SUBMODULES})
