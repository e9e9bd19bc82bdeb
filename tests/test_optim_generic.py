"""Every shardopt optimizer behaves like a ``torch.optim.Optimizer``: generic tests over one table.

Written after torch's pattern (``OptimizerInfo`` in ``torch/testing/_internal/common_optimizers.py`` and the
generic tests of ``test/test_optim.py``) for shardopt's contract: matrices get the optimizer's rule and
everything else its AdamW, so the tests use the shapes torch uses (a ``10 x 5`` weight with a bias, ``2 x 3``
parameters, a small MLP) and check that

- a step goes the right direction on several shapes, contiguous or not, with a flat list, param groups,
  per-group lr / weight decay and LR schedulers, and a tensor lr equals a float one;
- under torch's 7-iteration protocol (a step without gradients, a layer frozen for two steps) the vectors
  equal ``torch.optim.AdamW`` and Muon equals ``torch.optim.Muon``;
- state dicts are deterministic, load between named and unnamed optimizers, in older form (number ``step``),
  through ``torch.load(weights_only=True)`` and, for bf16 parameters, bit-exactly; hooks all run; deepcopy
  and pickle give an optimizer that steps identically;
- bad input gets torch's errors (or a clear one).

By design (documented in the table and the tests): SinkGD and SWAN, and SCALE without momentum, keep no
per-matrix state (their state entries are empty); matrix rules count every step, gradient or not (their
refresh schedules drive collectives, and under sharding one rank may lack a gradient another has), while
AdamW counts only steps with a gradient, as torch; shardopt steps real tensors only (complex parameters are
refused); SCALE's AdamW puts eps outside the bias correction (its released code), so the AdamW comparison
switches that group option to torch's.
"""

from __future__ import annotations

import copy
import functools
import io
import pickle
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
from tiny_model import Tiny
from torch import nn
from torch.nn import Parameter
from torch.optim.lr_scheduler import ReduceLROnPlateau, StepLR

import shardopt
from shardopt.optim import routing
from shardopt.optim.alice import Alice, Alice0
from shardopt.optim.asgo import ASGO, DASGO
from shardopt.optim.sumo import SUMO

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*exceeds min.*:RuntimeWarning"),  # SUMO/Alice rank 128 on tiny matrices
    pytest.mark.filterwarnings("ignore:.*parameters were given without names.*:UserWarning"),
]


# ------------------------------------------------------------------------------------------------- the table
@dataclass
class OptimInput:
    """Constructor keyword arguments (beyond the parameters) and what they exercise."""

    kwargs: dict[str, Any]
    desc: str


@dataclass
class ErrorInput:
    """Input that must fail: ``params`` (``None``: a 2 x 3 matrix and its bias), kwargs, error, message."""

    params: Any
    kwargs: dict[str, Any]
    error: type[BaseException]
    match: str
    desc: str
    on_step: bool = False


@dataclass
class OptimInfo:
    cls: type
    #: configurations, built fresh for each use (a tensor lr is mutable)
    inputs: Callable[[], list[OptimInput]]
    #: by design the matrix rule keeps no state for these kwargs: its state entries are empty
    stateless: Callable[[dict], bool] = lambda kw: False
    #: by design SCALE's AdamW adds eps before the bias correction (its released code)
    adam_eps_mode: str = "torch"
    error_inputs: Callable[[], list[ErrorInput]] = lambda: []
    notes: str = ""

    @property
    def name(self) -> str:
        return self.cls.__name__


def with_common(specific: list[OptimInput]) -> Callable[[], list[OptimInput]]:
    """torch's generic configurations (default, another lr, weight decay, a tensor lr) plus the rule's own."""

    def inputs() -> list[OptimInput]:
        return [
            OptimInput({}, "default"),
            OptimInput({"lr": 0.01}, "non-default lr"),
            OptimInput({"weight_decay": 0.1}, "nonzero weight_decay"),
            OptimInput({"lr": torch.tensor(0.01)}, "Tensor lr"),
        ] + copy.deepcopy(specific)

    return inputs


OPTIM_INFOS = [
    OptimInfo(
        shardopt.SCALE,
        with_common(
            [
                OptimInput({"momentum": 0.9}, "momentum (the LM-head form)"),
                OptimInput({"norm": "l2", "norm_dim": 0}, "l2 norm per column"),
            ]
        ),
        stateless=lambda kw: not kw.get("momentum"),
        adam_eps_mode="outside",
        error_inputs=lambda: [
            ErrorInput(None, {"momentum": 1.0}, ValueError, "momentum", "momentum in [0, 1)"),
            ErrorInput(None, {"norm": "l3"}, ValueError, "norm must be", "unknown norm"),
        ],
        notes="no matrix state without momentum (by design); AdamW eps outside the bias correction (by design)",
    ),
    OptimInfo(
        shardopt.SinkGD,
        with_common([OptimInput({"iterations": 2, "lr_scale": 0.2}, "2 sweeps")]),
        stateless=lambda kw: True,
        error_inputs=lambda: [ErrorInput(None, {"iterations": 0}, ValueError, "iterations", "L >= 1")],
        notes="stateless matrix rule (by design)",
    ),
    OptimInfo(
        shardopt.RACS,
        with_common([OptimInput({"beta": 0.5, "iterations": 3, "gamma": 1.5}, "beta, gamma")]),
        error_inputs=lambda: [ErrorInput(None, {"gamma": 0.5}, ValueError, "gamma", "gamma >= 1")],
    ),
    OptimInfo(
        shardopt.SWAN,
        with_common(
            [
                OptimInput({"whitening": "svd"}, "exact whitening"),
                OptimInput({"center": True, "iterations": 2}, "centered, 2 sweeps"),
            ]
        ),
        stateless=lambda kw: True,
        error_inputs=lambda: [ErrorInput(None, {"whitening": "qr"}, ValueError, "whitening", "unknown whitening")],
        notes="stateless matrix rule (by design)",
    ),
    OptimInfo(
        ASGO,
        with_common(
            [
                OptimInput({"root": "newton_schulz"}, "Newton-Schulz root"),
                OptimInput(
                    {"root": "newton_schulz", "weight_decay": 0.1, "lr": 0.02}, "Newton-Schulz root, weight decay"
                ),
                OptimInput(
                    {
                        "betas": (0.9, 0.8),
                        "eps": 1e-10,
                        "root": "newton_schulz",
                        "ns_steps": 10,
                        "update_rms": 0.2,
                        "weight_decay": 0.1,
                    },
                    "the released code's settings",
                ),
                OptimInput({"eps": 0.0}, "pseudo-inverse root"),
                OptimInput({"side": "left", "statistic": "momentum"}, "left, momentum statistic"),
                OptimInput({"refresh_interval": 3}, "root refreshed every 3 steps"),
            ]
        ),
        error_inputs=lambda: [
            ErrorInput(None, {"statistic": "hessian"}, ValueError, "statistic", "unknown statistic"),
            ErrorInput(None, {"eps": 0.0, "refresh_interval": 2}, ValueError, "eps = 0", "stale pseudo-inverse"),
            ErrorInput(
                None, {"betas": (1.0, 0.95)}, ValueError, r"Invalid beta parameter at index 0: 1.0", "beta1 < 1"
            ),
        ],
    ),
    OptimInfo(
        DASGO,
        with_common([OptimInput({"betas": (0.5, 0.9)}, "other betas")]),
        error_inputs=lambda: [
            ErrorInput(None, {"betas": (0.9, 1.5)}, ValueError, r"Invalid beta parameter at index 1: 1.5", "beta2 < 1")
        ],
    ),
    OptimInfo(
        SUMO,
        with_common(
            [
                OptimInput({"rank": 2, "refresh_interval": 3}, "rank 2, refresh every 3"),
                OptimInput({"rank": 1, "gamma": None, "step_scale": "muon", "power_iters": 0}, "rank 1, no limiter"),
            ]
        ),
        error_inputs=lambda: [ErrorInput(None, {"step_scale": "huge"}, ValueError, "step_scale", "unknown scale")],
    ),
    OptimInfo(
        Alice,
        with_common(
            [
                OptimInput({"rank": 2, "leading": 1, "refresh_interval": 3}, "rank 2, switch every 3"),
                OptimInput({"rank": 2, "leading": 1, "refresh_interval": 2, "reproject": False}, "literal mixing"),
            ]
        ),
        error_inputs=lambda: [ErrorInput(None, {"rank": 2, "leading": 3}, ValueError, "leading", "l <= r")],
    ),
    OptimInfo(Alice0, with_common([OptimInput({"rank": 2, "leading": 1, "refresh_interval": 3}, "rank 2")])),
    OptimInfo(
        shardopt.Muon,
        with_common(
            [
                OptimInput({"momentum": 0.8}, "non-default momentum"),
                OptimInput({"ns_steps": 6}, "6 Newton-Schulz steps"),
                OptimInput({"nesterov": False}, "plain momentum"),
                OptimInput({"adjust_lr_fn": "match_rms_adamw"}, "AdamW-matched lr"),
                OptimInput({"ns_dtype": "bfloat16"}, "torch's bf16 iteration"),
            ]
        ),
        error_inputs=lambda: [
            ErrorInput(None, {"adjust_lr_fn": "arbitrary"}, ValueError, "adjust_lr_fn must be", "unknown lr rule"),
            ErrorInput(None, {"ns_dtype": "float8"}, ValueError, "ns_dtype", "unknown dtype"),
        ],
    ),
]


def generic_error_inputs() -> list[ErrorInput]:
    """torch's errors for every optimizer (``get_error_inputs_for_all_optims``) and shardopt's refusals."""
    p = Parameter(torch.randn(2, 3))
    p2 = Parameter(torch.randn(2, 3))
    bias = Parameter(torch.randn(2))
    cplx = torch.randn(2, 3, dtype=torch.complex64, requires_grad=True)
    return [
        ErrorInput(p, {}, TypeError, "should be an iterable of Tensors or dicts", "a tensor as params"),
        ErrorInput({p, p2}, {}, TypeError, "ordered collections", "a set of parameters"),
        ErrorInput([{"params": {p, p2}}], {}, TypeError, "ordered collections", "a set in a group"),
        ErrorInput([p, 3.0], {}, TypeError, "can only optimize Tensors", "a number among the parameters"),
        ErrorInput([], {}, ValueError, "empty parameter list", "no parameters"),
        ErrorInput([p, p], {}, UserWarning, "duplicate parameters", "duplicates in a group"),
        ErrorInput(
            [{"params": p}, {"params": p}], {}, ValueError, "more than one parameter group", "duplicates across groups"
        ),
        ErrorInput(
            None,
            {"lr": torch.tensor([1e-3, 1e-3])},
            ValueError,
            "Tensor lr must be 1-element",
            "a tensor lr with two elements",
        ),
        ErrorInput(
            [{"params": [p]}, {"params": [p2], "lr": torch.tensor([1e-3, 1e-3])}],
            {},
            ValueError,
            "Tensor lr must be 1-element",
            "a group's tensor lr with two elements",
        ),
        ErrorInput(None, {"lr": -1.0}, ValueError, r"lr\b.*>= 0|Invalid learning rate: -1.0", "negative lr"),
        ErrorInput(None, {"weight_decay": -1.0}, ValueError, r"Invalid weight_decay value: -1", "negative wd"),
        ErrorInput([("weight", p), p2], {}, ValueError, "Some param names are missing", "named and unnamed"),
        ErrorInput(
            [{"params": [p], "lr": 1e-2}, {"params": [("weight", p2)]}],
            {},
            ValueError,
            "all optimizer param groups should be with/without names",
            "named and unnamed groups",
        ),
        ErrorInput([cplx], {}, ValueError, r"is complex \(torch.complex64\).*view_as_real", "complex parameter"),
        ErrorInput(
            [{"params": [bias], "treatment": "__matrix__"}],
            {},
            ValueError,
            r"of shape \(2,\).*needs 2-D",
            "a vector in a matrix group",
        ),
        ErrorInput(
            [{"params": [p], "treatment": "lion"}], {}, ValueError, "treatment 'lion' is not known", "unknown treatment"
        ),
    ]


def cases(infos=OPTIM_INFOS, keep: Callable[[OptimInfo, OptimInput], bool] = lambda i, c: True):
    return [
        pytest.param(info, case, id=f"{info.name}-{case.desc}")
        for info in infos
        for case in info.inputs()
        if keep(info, case)
    ]


ALL_CASES = cases()
BY_OPTIMIZER = [pytest.param(info, id=info.name) for info in OPTIM_INFOS]
FLOAT_LR_CASES = cases(keep=lambda i, c: not isinstance(c.kwargs.get("lr"), torch.Tensor))


def group_options(info: OptimInfo, kwargs: dict) -> dict:
    """The kwargs that are param-group options (the rest are constructor-only, e.g. ``adam_*``)."""
    defaults = info.cls([Parameter(torch.zeros(2, 2))]).defaults
    return {k: v for k, v in kwargs.items() if k in defaults}


def assert_same(a: Any, b: Any, exact: bool = False, where: str = "") -> None:
    """Nested state dicts / params equal (tensors to torch's float tolerance, or bit-exactly)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        if exact:
            assert a.dtype == b.dtype and torch.equal(a, b), where
        else:
            torch.testing.assert_close(a, b, msg=where)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, sorted(map(str, a)), sorted(map(str, b)))
        for k in a:
            assert_same(a[k], b[k], exact, f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, exact, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def without_param_names(sd: dict) -> dict:
    sd = copy.deepcopy(sd)
    for g in sd["param_groups"]:
        g.pop("param_names", None)
    return sd


def matrix_and_bias(shape=(10, 5), contiguous=True, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    m, n = shape
    if contiguous:
        weight = Parameter(torch.randn(m, n, generator=g, dtype=dtype))
        bias = Parameter(torch.randn(m, generator=g, dtype=dtype))
    else:
        weight = Parameter(torch.randn(m, n, 2, generator=g, dtype=dtype)[..., 0])
        bias = Parameter(torch.randn(m, 2, generator=g, dtype=dtype)[..., 0])
    return weight, bias, torch.randn(n, generator=g, dtype=dtype)


# --------------------------------------------------------------------------------------- the right direction
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "noncontiguous"])
@pytest.mark.parametrize("info,case", ALL_CASES)
def test_goes_right_direction(info, case, contiguous):
    """A flat list [weight, bias] (the weight gets the rule, the bias AdamW) lowers |Wx + b|^2 in 20 steps, for
    a tall, a wide and a one-row matrix."""
    for shape in ((10, 5), (5, 7), (1, 10)):
        _goes_right_direction(info, case, shape, contiguous)


def _goes_right_direction(info, case, shape, contiguous):
    weight, bias, x = matrix_and_bias(shape, contiguous)
    strides = (weight.stride(), bias.stride())
    opt = info.cls([weight, bias], **copy.deepcopy(case.kwargs))
    assert [g["treatment"] for g in opt.param_groups] == [opt.matrix_treatments[0], "adamw"]

    def closure():
        opt.zero_grad()
        loss = (weight.mv(x) + bias).pow(2).sum()
        loss.backward()
        return loss

    initial = closure().item()
    for _ in range(20):
        closure()
        opt.step()
    assert closure().item() < initial, shape
    assert (weight.stride(), bias.stride()) == strides


@pytest.mark.parametrize("info", BY_OPTIMIZER)
def test_param_groups_with_lr_schedulers_go_right_direction(info):
    for schedulers in ([lambda o: StepLR(o, gamma=0.9, step_size=10)], [lambda o: ReduceLROnPlateau(o)]):
        _goes_right_direction_scheduled(info, schedulers)


def _goes_right_direction_scheduled(info, schedulers):
    weight, _, x = matrix_and_bias()
    weight2 = Parameter(torch.randn(10, 5))
    opt = info.cls([{"params": [weight]}, {"params": [weight2], "lr": 0.01}])
    scheds = [make(opt) for make in schedulers]

    def closure():
        opt.zero_grad()
        loss = (weight.mv(x) + weight2.mv(x)).pow(2).sum()
        loss.backward()
        return loss

    initial = closure().item()
    for _ in range(20):
        loss = opt.step(closure)
        for s in scheds:
            s.step(loss.item()) if isinstance(s, ReduceLROnPlateau) else s.step()
    assert closure().item() < initial


@pytest.mark.parametrize("info,case", ALL_CASES)
def test_param_groups_weight_decay(info, case):
    weight, bias, x = matrix_and_bias()
    options = group_options(info, case.kwargs)
    opt = info.cls([dict(params=[weight], **options), dict(params=[bias], **{**options, "weight_decay": 0.0})])
    initial = (weight.mv(x) + bias).pow(2).sum().item()
    for _ in range(20):
        opt.zero_grad()
        loss = (weight.mv(x) + bias).pow(2).sum()
        loss.backward()
        opt.step()
    assert loss.item() < initial


@pytest.mark.parametrize("info,case", ALL_CASES)
def test_param_groups_lr(info, case):
    """Per-group lr: [weight, bias] at the configuration's lr descend, a group at the constructor's ~0 lr
    (and ~0 AdamW lr) stays put."""
    weight, bias, x = matrix_and_bias()
    irrelevant = Parameter(torch.randn(2))
    before = irrelevant.detach().clone()
    options = {"lr": 1e-3, **group_options(info, case.kwargs)}
    opt = info.cls([dict(params=[weight, bias], **options), dict(params=[irrelevant])], lr=1e-28, adam_lr=1e-28)
    initial = (weight.mv(x) + bias).pow(2).sum().item()
    for _ in range(20):
        opt.zero_grad()
        loss = (weight.mv(x) + bias).pow(2).sum()
        loss.backward()
        irrelevant.grad = torch.rand_like(irrelevant)
        opt.step()
    assert loss.item() < initial
    assert torch.equal(irrelevant, before)


@pytest.mark.parametrize("num_dim", [0, 1, 2])
@pytest.mark.parametrize("info,case", FLOAT_LR_CASES)
def test_tensor_lr(info, case, num_dim):
    """A one-element tensor lr of any shape gives the float lr's steps."""
    weight, bias, x = matrix_and_bias()
    weight_c, bias_c = (Parameter(t.detach().clone()) for t in (weight, bias))
    kwargs = {**case.kwargs, "lr": 1e-3}
    opt = info.cls([weight, bias], **kwargs)
    opt_c = info.cls([weight_c, bias_c], **{**kwargs, "lr": torch.tensor(1e-3).reshape([1] * num_dim)})
    for _ in range(5):
        for o, w, b in ((opt, weight, bias), (opt_c, weight_c, bias_c)):
            o.zero_grad()
            (w.mv(x) + b).pow(2).sum().backward()
            o.step()
        torch.testing.assert_close(weight, weight_c)
        torch.testing.assert_close(bias, bias_c)


# ---------------------------------------------------------------------- torch's 7-iteration protocol, AdamW, Muon
def mlp(dtype=torch.float32) -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(2, 3), nn.Sigmoid(), nn.Linear(3, 1), nn.Sigmoid()).to(dtype)


def seven_iterations(models: list[nn.Module], optimizers: list, extra: list[list[torch.Tensor]]) -> None:
    """torch's ``_compare_between``: 7 steps; no backward at i = 2 (grads None), ``model[2]`` frozen for
    i = 3, 4. After every step all parameters and their state must agree (state by name: the reference may be
    two optimizers)."""
    inp = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]).reshape(3, 2)
    for i in range(7):
        for model, opts in zip(models, optimizers):
            for o in opts:
                o.zero_grad()
            model[2].requires_grad_(not 3 <= i < 5)
            if i != 2:
                model(inp).sum().backward()
            for o in opts:
                o.step()
        (a, b), (ea, eb) = models, extra
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(p, q, msg=f"iteration {i}: {name}")
        states = [{id_: st for o in opts for id_, st in o.state.items()} for opts in optimizers]
        for p, q in zip(list(a.parameters()) + ea, list(b.parameters()) + eb):
            assert_same(states[0].get(p, {}), states[1].get(q, {}), where=f"iteration {i} state of {tuple(p.shape)}")


@pytest.mark.parametrize("info,case", ALL_CASES)
def test_vectors_equal_torch_adamw_across_a_grad_less_step_and_frozen_layers(info, case):
    """The optimizer on a flat list == (the same optimizer on the matrices alone) + torch.optim.AdamW on the
    vectors: AdamW's per-parameter step counts advance only with a gradient, and the matrix groups do not
    depend on the AdamW ones."""
    model, ref = mlp(), mlp()
    empty, empty_ref = (torch.zeros((), requires_grad=True) for _ in range(2))  # torch's zero-size last param
    opt = info.cls(list(model.parameters()) + [empty], **copy.deepcopy(case.kwargs))
    (adam,) = [g for g in opt.param_groups if g["treatment"] == "adamw"]
    adam["eps_mode"] = "torch"  # SCALE's released-code form differs from torch's by design (see the table)
    matrices = [p for p in ref.parameters() if p.dim() == 2]
    vectors = [p for p in ref.parameters() if p.dim() != 2] + [empty_ref]
    ref_opts = [
        info.cls(matrices, **copy.deepcopy(case.kwargs)),
        torch.optim.AdamW(
            vectors, lr=float(adam["lr"]), betas=adam["betas"], eps=adam["eps"], weight_decay=adam["weight_decay"]
        ),
    ]
    seven_iterations([model, ref], [[opt], ref_opts], [[empty], [empty_ref]])


MUON_CASES = cases(
    [i for i in OPTIM_INFOS if i.cls is shardopt.Muon], keep=lambda i, c: not set(c.kwargs) & {"ns_dtype"}
)


@pytest.mark.parametrize("info,case", MUON_CASES)
def test_muon_equals_torch_muon(info, case):
    """shardopt's Muon (bf16 Newton-Schulz, as torch) == torch.optim.Muon on the matrices + torch.optim.AdamW
    on the vectors, across the grad-less step and the frozen layer."""
    model, ref = mlp(), mlp()
    kwargs = copy.deepcopy(case.kwargs)
    opt = shardopt.Muon(model.parameters(), ns_dtype="bfloat16", **kwargs)
    ref_opts = [
        torch.optim.Muon([p for p in ref.parameters() if p.dim() == 2], **copy.deepcopy(kwargs)),
        torch.optim.AdamW(
            [p for p in ref.parameters() if p.dim() != 2], lr=float(kwargs.get("lr", 1e-3)), weight_decay=0.0
        ),
    ]
    seven_iterations([model, ref], [[opt], ref_opts], [[], []])


# ---------------------------------------------------------------------------------------- no-op steps, printing
@pytest.mark.parametrize("info,case", ALL_CASES)
def test_step_is_noop_when_params_have_no_grad(info, case):
    """Nothing moves, and vectors get no state (as torch's AdamW). By design a matrix rule keeps counting
    steps and allocates its state for every matrix of a group, gradient or not: its refresh schedule drives
    collectives, and under sharding one rank may lack a gradient another has."""
    params = [torch.randn(2, 3, requires_grad=False) for _ in range(2)] + [torch.randn(3)]
    old = [p.clone() for p in params]
    opt = info.cls(params, **copy.deepcopy(case.kwargs))
    for _ in range(2):
        assert opt.step(lambda: torch.tensor([1.0])).item() == 1.0
    assert all(torch.equal(p, q) for p, q in zip(params, old))
    assert params[2] not in opt.state


@pytest.mark.parametrize("info,case", ALL_CASES)
def test_step_is_noop_for_zero_grads(info, case):
    """All-zero gradients move nothing (no weight decay: that moves parameters by itself)."""
    param = torch.randn(5, 1, requires_grad=True)  # a matrix: the rule sees an all-zero gradient
    vector = torch.randn(5, requires_grad=True)
    old = [param.detach().clone(), vector.detach().clone()]
    opt = info.cls([param, vector], **{**copy.deepcopy(case.kwargs), "weight_decay": 0.0})
    for _ in range(2):
        param.grad, vector.grad = torch.zeros_like(param), torch.zeros_like(vector)
        opt.step()
    assert torch.equal(param, old[0]) and torch.equal(vector, old[1])


@pytest.mark.parametrize("info,case", ALL_CASES)
def test_optimizer_can_be_printed(info, case):
    opt = info.cls([Parameter(torch.randn(2, 3)), Parameter(torch.randn(2))], **copy.deepcopy(case.kwargs))
    assert info.name in repr(opt) and "treatment" in repr(opt)


@pytest.mark.parametrize("info,case", ALL_CASES)
def test_non_empty_state(info, case):
    """After a step every parameter has state, except the matrices of rules that keep none (by design)."""
    model = nn.Linear(5, 5)
    opt = info.cls(model.parameters(), **copy.deepcopy(case.kwargs))
    model(torch.rand(2, 5)).sum().backward()
    opt.step()
    assert len(opt.state[model.bias]) > 0
    if info.stateless(case.kwargs):
        assert len(opt.state.get(model.weight, {})) == 0
    else:
        assert len(opt.state[model.weight]) > 0


# ------------------------------------------------------------------------------------------------ state dicts
def fwd_bwd(opt, w, b, x):
    opt.zero_grad()
    loss = (w.mv(x) + b).pow(2).sum()
    loss.backward()
    return loss


def named(params, is_named):
    return [(f"name{i}", p) for i, p in enumerate(params)] if is_named else list(params)


@pytest.mark.parametrize("named1", [False, True], ids=["unnamed1", "named1"])
@pytest.mark.parametrize("named0", [False, True], ids=["unnamed0", "named0"])
@pytest.mark.parametrize("info,case", ALL_CASES)
def test_state_dict_deterministic(info, case, named0, named1):
    """Loaded into an optimizer over equal (not identical) parameters, both step the same and give equal
    state dicts (param_names aside), named or not; repeated groups are represented identically."""
    torch.manual_seed(0)
    weight, bias = Parameter(torch.randn(2, 3)), Parameter(torch.randn(2))
    x = torch.randn(3)
    opt = info.cls(named([weight, bias], named0), **copy.deepcopy(case.kwargs))
    for _ in range(10):
        fwd_bwd(opt, weight, bias, x)
        opt.step()
    with torch.no_grad():
        weight_c, bias_c = Parameter(weight.clone()), Parameter(bias.clone())
    opt_c = info.cls(named([weight_c, bias_c], named1), **copy.deepcopy(case.kwargs))
    opt_c.load_state_dict(copy.deepcopy(opt.state_dict()))
    for _ in range(10):
        fwd_bwd(opt, weight, bias, x)
        fwd_bwd(opt_c, weight_c, bias_c, x)
        opt.step()
        opt_c.step()
        torch.testing.assert_close(weight, weight_c)
        torch.testing.assert_close(bias, bias_c)
    assert_same(without_param_names(opt.state_dict()), without_param_names(opt_c.state_dict()))
    opt_c.param_groups.extend(opt_c.param_groups)
    assert_same(
        without_param_names(opt.state_dict())["param_groups"][-1],
        without_param_names(opt_c.state_dict())["param_groups"][-1],
    )


def small_model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2))


def train_small(opt, model, steps=3):
    x = torch.rand(5, 4, generator=torch.Generator().manual_seed(2))
    for _ in range(steps):
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()


@pytest.mark.parametrize("info,case", ALL_CASES)
def test_can_load_older_state_dict(info, case):
    """An older state dict (every ``step`` a Python number, as torch < 1.12 saved) loads and the optimizer
    steps as if it had not been saved."""
    model, ref = small_model(), small_model()
    opt, opt_ref = (info.cls(m.parameters(), **copy.deepcopy(case.kwargs)) for m in (model, ref))
    train_small(opt, model)
    train_small(opt_ref, ref)
    old = copy.deepcopy(opt.state_dict())
    numbers = 0
    for st in old["state"].values():
        if isinstance(st.get("step"), torch.Tensor):
            st["step"] = st["step"].item()
            numbers += 1
    assert numbers > 0  # every optimizer keeps a step for its AdamW part
    opt.load_state_dict(old)
    assert all(isinstance(st["step"], torch.Tensor) for st in opt.state.values() if "step" in st)
    train_small(opt, model, 2)
    train_small(opt_ref, ref, 2)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("named1", [False, True], ids=["unnamed1", "named1"])
@pytest.mark.parametrize("named0", [False, True], ids=["unnamed0", "named0"])
@pytest.mark.parametrize("info,case", ALL_CASES)
def test_can_load_from_to_named_state_dict(info, case, named0, named1):
    model = small_model()
    opt = info.cls(model.named_parameters() if named0 else model.parameters(), **copy.deepcopy(case.kwargs))
    train_small(opt, model)
    saved = copy.deepcopy(opt.state_dict())
    opt2 = info.cls(model.named_parameters() if named1 else model.parameters(), **copy.deepcopy(case.kwargs))
    opt2.load_state_dict(saved)
    train_small(opt2, model, 1)
    names = [n for g in opt2.state_dict()["param_groups"] for n in g.get("param_names", [])]
    if named0 or named1:  # the names survive whichever side had them
        assert names == ["0.weight", "2.weight", "0.bias", "1.weight", "1.bias", "2.bias"]
        assert [opt2.param_names[id(p)] for g in opt2.param_groups for p in g["params"]] == names
    else:
        assert names == []


@pytest.mark.parametrize("is_named", [False, True], ids=["unnamed", "named"])
@pytest.mark.parametrize("info,case", ALL_CASES)
def test_save_load_equality_with_weights_only(info, case, is_named):
    weight, bias, x = matrix_and_bias((2, 3))
    opt = info.cls(named([weight, bias], is_named), **copy.deepcopy(case.kwargs))
    for _ in range(3):
        opt.step(functools.partial(fwd_bwd, opt, weight, bias, x))
    sd = opt.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    assert_same(torch.load(buf, weights_only=True), sd, exact=True)


@pytest.mark.parametrize("info,case", ALL_CASES)
def test_bf16_round_trip_keeps_fp32_state_bit_exact(info, case):
    """bf16 parameters, fp32 statistics: ``load_state_dict(state_dict())`` (also into a fresh optimizer, and
    through torch.save) must not pass the statistics through bf16."""
    torch.manual_seed(0)
    weight, bias, x = matrix_and_bias((4, 3), dtype=torch.bfloat16)
    opt = info.cls([weight, bias], **copy.deepcopy(case.kwargs))
    for _ in range(3):
        fwd_bwd(opt, weight, bias, x)
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    floats = [
        t
        for st in sd["state"].values()
        for k, t in st.items()
        if isinstance(t, torch.Tensor) and k != "step" and t.is_floating_point()
    ]
    assert floats and all(t.dtype == torch.float32 for t in floats)
    opt.load_state_dict(opt.state_dict())
    assert_same(opt.state_dict(), sd, exact=True)
    weight_c, bias_c = (Parameter(t.detach().clone()) for t in (weight, bias))
    opt_c = info.cls([weight_c, bias_c], **copy.deepcopy(case.kwargs))
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    opt_c.load_state_dict(torch.load(buf, weights_only=True))
    assert_same(opt_c.state_dict(), sd, exact=True)
    for _ in range(2):
        for o, w, b in ((opt, weight, bias), (opt_c, weight_c, bias_c)):
            fwd_bwd(o, w, b, x)
            o.step()
    assert torch.equal(weight, weight_c) and torch.equal(bias, bias_c)


# ---------------------------------------------------------------------------------------------------- hooks
def state_dict_pre_hook(opt) -> None:
    opt.state["test"] = 1


def state_dict_post_hook(opt, sd):
    if "test" in sd["state"]:
        sd["state"].pop("test")
        sd["ran_state_dict_pre_hook"] = True
    else:
        sd["ran_state_dict_pre_hook"] = False
    return sd


def load_pre_hook1(opt, sd) -> None:
    sd["param_groups"][0]["lr"] = 0.002


def load_pre_hook2(opt, sd):
    mine = copy.deepcopy(sd)
    mine["param_groups"][0]["lr"] = 0.003
    return mine


def load_post_hook(opt) -> None:
    opt.state["ran_load_state_dict_pre_hook2"] = bool(opt.param_groups[0]["lr"] == 0.003)
    opt.state["ran_load_state_dict_post_hook"] = True


def one_matrix_optimizer(info, case):
    param = torch.rand(2, 3, requires_grad=True)
    return info.cls([param], **copy.deepcopy(case.kwargs)), param


def step_once(opt, param):
    param.grad = torch.rand_like(param)
    opt.step()


@pytest.mark.parametrize("info,case", ALL_CASES)
def test_state_dict_hooks(info, case):
    opt, param = one_matrix_optimizer(info, case)
    step_once(opt, param)
    opt.register_state_dict_pre_hook(state_dict_pre_hook)
    assert opt.state_dict()["state"]["test"] == 1
    opt, param = one_matrix_optimizer(info, case)
    opt.register_state_dict_post_hook(state_dict_post_hook)
    assert opt.state_dict()["ran_state_dict_pre_hook"] is False
    opt.register_state_dict_pre_hook(state_dict_pre_hook)
    sd = opt.state_dict()
    assert "test" not in sd["state"] and sd["ran_state_dict_pre_hook"] is True
    step_once(opt, param)  # a non-parameter key in optimizer.state does not disturb stepping


@pytest.mark.parametrize("info,case", ALL_CASES)
def test_load_state_dict_hooks(info, case):
    opt, param = one_matrix_optimizer(info, case)
    step_once(opt, param)
    sd = opt.state_dict()
    opt.register_load_state_dict_pre_hook(load_pre_hook1)
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 0.002
    opt.register_load_state_dict_pre_hook(load_pre_hook2, prepend=True)
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 0.002  # prepended: hook1 runs last

    opt, param = one_matrix_optimizer(info, case)
    opt.register_load_state_dict_post_hook(load_post_hook)
    opt.load_state_dict(opt.state_dict())
    assert opt.state["ran_load_state_dict_pre_hook2"] is False and opt.state["ran_load_state_dict_post_hook"]
    opt.register_load_state_dict_pre_hook(load_pre_hook2)
    step_once(opt, param)
    opt.load_state_dict(opt.state_dict())  # the hook's non-parameter keys load back as they are
    assert opt.state["ran_load_state_dict_pre_hook2"] is True and opt.state["ran_load_state_dict_post_hook"]
    step_once(opt, param)
    sd = opt.state_dict()
    assert sd["state"]["ran_load_state_dict_post_hook"] is True


@pytest.mark.parametrize("info,case", ALL_CASES)
def test_step_hooks(info, case):
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    data: list[int] = []
    params = [torch.tensor([1.0, 1.0])]
    opt = info.cls(params, **copy.deepcopy(case.kwargs))
    other = torch.optim.SGD(params)
    handles = [
        register_optimizer_step_pre_hook(lambda *a: data.append(0)),
        register_optimizer_step_post_hook(lambda *a: data.append(5)),
        opt.register_step_pre_hook(lambda *a: data.append(1)),
        opt.register_step_post_hook(lambda *a: data.append(2)),
        other.register_step_pre_hook(lambda *a: data.append(1)),
        other.register_step_post_hook(lambda *a: data.append(2)),
    ]
    try:
        opt.step()
        assert data == [0, 1, 2, 5]
        other.step()
        opt.step()
        assert data == [0, 1, 2, 5] * 3
    finally:
        for h in handles:
            h.remove()
    opt.step()
    other.step()
    assert data == [0, 1, 2, 5] * 3


# ------------------------------------------------------------------------------------------ deepcopy, pickle
@pytest.mark.parametrize("info,case", ALL_CASES)
def test_deepcopy_and_pickle_step_identically(info, case):
    params = [Parameter(torch.randn(2, 3)) for _ in range(2)] + [Parameter(torch.randn(3))]
    opt = info.cls(params, **copy.deepcopy(case.kwargs))
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        for p in params:
            p.grad = torch.rand(p.shape, generator=g)
        opt.step()
    public = {k for k in opt.__dict__ if not k.startswith("_")}
    copies = [copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))]
    for c in copies:
        assert {k for k in c.__dict__ if not k.startswith("_")} == public
        assert [c.param_names[id(p)] for gr in c.param_groups for p in gr["params"]] == [
            opt.param_names[id(p)] for gr in opt.param_groups for p in gr["params"]
        ]
    for _ in range(3):
        grads = [torch.rand(p.shape, generator=g) for p in params]
        for o in [opt] + copies:
            for p, grad in zip((p for gr in o.param_groups for p in gr["params"]), grads):
                p.grad = grad.clone()
            o.step()
    for c in copies:
        for p, q in zip(
            (p for gr in opt.param_groups for p in gr["params"]), (p for gr in c.param_groups for p in gr["params"])
        ):
            assert torch.equal(p, q)
        assert_same(opt.state_dict(), c.state_dict(), exact=True)


# -------------------------------------------------------------------------------- parameters: names and roles
@pytest.mark.parametrize("info", BY_OPTIMIZER)
def test_flat_list_gives_matrices_the_rule_and_warns_once(info, monkeypatch):
    monkeypatch.setattr(routing, "_WARNED", set())
    model = Tiny()
    with pytest.warns(UserWarning, match="embedding and LM-head roles need names"):
        opt = info.cls(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        info.cls(Tiny().parameters())  # once
    treatment = {id(p): g["treatment"] for g in opt.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        assert treatment[id(p)] == (opt.matrix_treatments[0] if p.dim() == 2 else "adamw"), name
    assert all("param_names" not in g for g in opt.param_groups)
    assert sorted(opt.param_names.values()) == sorted(f"param_{i}" for i in range(6))


@pytest.mark.parametrize("info", BY_OPTIMIZER)
def test_named_parameters_route_like_create_optimizer(info):
    """``cls(model.named_parameters())`` and ``create_optimizer(model.named_parameters(), name)`` give every
    parameter the group options ``create_optimizer(model, name)`` gives it (roles from names), and their state
    dicts carry the names."""
    key = info.name.lower()
    model = Tiny()
    reference = shardopt.create_optimizer(model, key)
    ref = {reference.param_names[id(p)]: g for g in reference.param_groups for p in g["params"]}
    for opt in (info.cls(model.named_parameters()), shardopt.create_optimizer(model.named_parameters(), key)):
        got = {n: g for g in opt.param_groups for n in g["param_names"]}
        assert got.keys() == ref.keys()
        for name in ref:
            role_keys = ["treatment"] + (["norm_dim", "momentum"] if ref[name]["treatment"] != "adamw" else [])
            assert {k: got[name].get(k) for k in role_keys} == {k: ref[name].get(k) for k in role_keys}, name
        names = [n for g in opt.state_dict()["param_groups"] for n in g["param_names"]]
        assert sorted(names) == sorted(n for n, _ in model.named_parameters())


def test_roles_from_names_match_roles_from_modules():
    from shardopt.train import Llama, model_config

    for model in (
        Tiny(),
        Llama(model_config("tiny", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2)),
    ):
        assert routing.roles_from_names(list(model.named_parameters())) == routing.param_roles(model)


@pytest.mark.parametrize("info", BY_OPTIMIZER)
def test_add_param_group_names_are_deterministic(info):
    """Parameters added later are named by position (never by memory address), so seeded draws and
    checkpoints reproduce in a new process: two independently built optimizers step identically."""
    results = []
    for _ in range(2):
        torch.manual_seed(0)
        first, later = Parameter(torch.randn(6, 4)), [Parameter(torch.randn(5, 7)), Parameter(torch.randn(5))]
        kwargs = {"rank": 2, "leading": 1, "refresh_interval": 2} if info.cls in (SUMO, Alice, Alice0) else {}
        if info.cls is SUMO:
            kwargs.pop("leading")
        opt = info.cls([first], **kwargs)
        opt.add_param_group({"params": later, "lr": 0.01})
        names = [opt.param_names[id(p)] for g in opt.param_groups for p in g["params"]]
        assert names == ["param_0", "param_1", "param_2"]
        assert opt.group_param_names == [["param_0"], ["param_1"], ["param_2"]]
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            for p in [first] + later:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        results.append([p.detach().clone() for p in [first] + later])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("info", BY_OPTIMIZER)
def test_non_contiguous_parameters_step_exactly(info):
    """A transposed weight and a strided bias get bit-for-bit the steps of contiguous copies, and keep their
    strides and storage."""
    base = torch.randn(5, 6)
    weight = Parameter(base.T)  # 6 x 5, a transposed view
    bias = Parameter(torch.randn(6, 2)[:, 0])
    weight_c, bias_c = Parameter(weight.detach().contiguous()), Parameter(bias.detach().contiguous())
    opt, opt_c = info.cls([weight, bias]), info.cls([weight_c, bias_c])
    strides = (weight.stride(), bias.stride())
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        grads = [torch.randn(6, 5, generator=g), torch.randn(6, generator=g)]
        weight.grad, bias.grad = grads[0].T.contiguous().T, grads[1]  # a strided gradient too
        weight_c.grad, bias_c.grad = (t.clone() for t in grads)
        opt.step()
        opt_c.step()
        assert torch.equal(weight, weight_c) and torch.equal(bias, bias_c)
    assert (weight.stride(), bias.stride()) == strides


# ---------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("info", BY_OPTIMIZER)
def test_errors(info):
    for err in generic_error_inputs() + info.error_inputs():
        params = err.params if err.params is not None else [Parameter(torch.randn(2, 3)), Parameter(torch.randn(2))]
        if isinstance(params, list) and params and isinstance(params[0], dict):
            params = [
                {**g, "treatment": info.cls.matrix_treatments[0]} if g.get("treatment") == "__matrix__" else g
                for g in params
            ]
        ctx = pytest.warns if issubclass(err.error, Warning) else pytest.raises
        if err.on_step:
            opt = info.cls(params, **err.kwargs)
            with ctx(err.error, match=err.match):
                opt.step()
        else:
            with ctx(err.error, match=err.match):
                info.cls(params, **err.kwargs)


def test_the_table_covers_every_optimizer():
    assert {i.name.lower() for i in OPTIM_INFOS} == set(shardopt.optim.OPTIMIZERS)
