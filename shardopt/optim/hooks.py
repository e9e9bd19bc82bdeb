"""Hook points where engine adapters and integrations plug into the optimizers, so that the algorithms never
import them (``tests/test_import_graph.py``: nothing under ``shardopt.optim`` imports ``shardopt.plugin`` or
``shardopt.integrations``).

Five registries, each a list of callables run in registration order:

* ``pre_step_checks``: ``check(optimizer)`` at the top of every ``ShardedOptimizer.step`` (after the closure,
  before any tensor is read). ``shardopt.plugin.wrapped.check_stepped_tensors`` is one: it maps the flat
  partitions of a DeepSpeed ZeRO wrapper found on the call stack, or raises instead of stepping a tensor whose
  matrices are unknown. A module-level list (rather than torch's per-instance ``register_step_pre_hook``) so
  that it covers every optimizer however it was built (a plain ``SCALE(...)`` handed to DeepSpeed by someone
  else), also after ``copy.deepcopy`` or unpickling, which drop torch's per-instance hooks.
* ``param_sources``: ``source(params, who) -> params`` on what a constructor was given, before the param
  groups are normalized (``shardopt.plugin.wrapped.names_from_trainer`` names the Hugging Face Trainer's
  unnamed groups and declares each tensor's role from the model's module types, see
  ``routing.declare_module_roles``). A source returns ``params`` unchanged when it does not apply.
* ``model_watchers``: ``watch(model, optimizer)`` after ``create_optimizer`` built an optimizer for an
  ``nn.Module`` (``shardopt.plugin.wrapped.watch_model`` raises if a DeepSpeed engine later runs that model
  with another optimizer).

* ``model_inspectors``: ``inspect(model)`` before a model's parameters are routed (``build_param_groups``):
  an engine adapter declares what its parameters are where their tensors do not say it
  (``shardopt.plugin.fsdp1.inspect_model``: the logical shapes of legacy FSDP's flattened views), or refuses a
  layout it cannot describe before any group is formed.

* ``zero_grad_hooks``: ``hook(optimizer, set_to_none)`` after ``ShardedOptimizer.zero_grad`` cleared the
  stepped tensors' gradients: an adapter whose stepped tensors stand in for others clears those too
  (``shardopt.plugin.fsdp1.clear_flat_grads``: legacy FSDP's flat gradients).

``shardopt/__init__.py`` imports ``shardopt.plugin.wrapped``, which registers its three functions, so they are
in place before any optimizer can be built (importing ``shardopt.optim.scale`` imports ``shardopt`` first).
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = [
    "pre_step_checks",
    "param_sources",
    "model_watchers",
    "model_inspectors",
    "register_pre_step_check",
    "register_param_source",
    "register_model_watcher",
    "register_model_inspector",
    "run_pre_step_checks",
    "apply_param_sources",
    "watch_model",
    "inspect_model",
    "zero_grad_hooks",
    "register_zero_grad_hook",
    "run_zero_grad_hooks",
]

pre_step_checks: list[Callable[[Any], None]] = []
param_sources: list[Callable[[Any, str], Any]] = []
model_watchers: list[Callable[[Any, Any], None]] = []
model_inspectors: list[Callable[[Any], None]] = []
zero_grad_hooks: list[Callable[[Any, bool], None]] = []


def _register(registry: list, fn: Callable) -> Callable:
    if fn not in registry:
        registry.append(fn)
    return fn


def register_pre_step_check(fn: Callable[[Any], None]) -> Callable[[Any], None]:
    """Run ``fn(optimizer)`` before every step of every shardopt optimizer (once per function)."""
    return _register(pre_step_checks, fn)


def register_param_source(fn: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
    """Let ``fn(params, who)`` rewrite a constructor's ``params`` (once per function)."""
    return _register(param_sources, fn)


def register_model_watcher(fn: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
    """Call ``fn(model, optimizer)`` after ``create_optimizer`` built an optimizer for a model (once per function)."""
    return _register(model_watchers, fn)


def register_model_inspector(fn: Callable[[Any], None]) -> Callable[[Any], None]:
    """Call ``fn(model)`` before a model's parameters are routed (once per function)."""
    return _register(model_inspectors, fn)


def register_zero_grad_hook(fn: Callable[[Any, bool], None]) -> Callable[[Any, bool], None]:
    """Call ``fn(optimizer, set_to_none)`` after every ``zero_grad`` of a shardopt optimizer (once per function)."""
    return _register(zero_grad_hooks, fn)


def run_zero_grad_hooks(optimizer: Any, set_to_none: bool) -> None:
    for hook in list(zero_grad_hooks):
        hook(optimizer, set_to_none)


def inspect_model(model: Any) -> None:
    for inspect in list(model_inspectors):
        inspect(model)


def run_pre_step_checks(optimizer: Any) -> None:
    for check in list(pre_step_checks):
        check(optimizer)


def apply_param_sources(params: Any, who: str) -> Any:
    for source in list(param_sources):
        params = source(params, who)
    return params


def watch_model(model: Any, optimizer: Any) -> None:
    for watch in list(model_watchers):
        watch(model, optimizer)
