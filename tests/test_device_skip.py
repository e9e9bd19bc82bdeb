"""A non-finite step skipped on the device (``nonfinite.gate_step``): the same steps as the host check's, with no
read of the flag in ``step()``; the host's counters catch up at the next step, ``state_dict`` or ``skipped_steps``.

CUDA takes this path by itself (``nonfinite_on_device="auto"``); here the CPU is made to (``True``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from tiny_model import Tiny
from torch import nn

import shardopt


class TwoHidden(Tiny):
    """Tiny with a second hidden matrix, so that a rule's step can hold a matrix with a gradient and one without."""

    def __init__(self):
        super().__init__()
        self.proj2 = nn.Linear(7, 7)

    def forward(self, x):
        return self.lm_head(self.norm(self.proj2(self.proj(self.embed(x)))))


def _pair(name: str = "scale", model_cls: type = Tiny, **options):
    """Two identical models and optimizers: the host check's and the device's."""
    out = []
    for on_device in (False, True):
        torch.manual_seed(0)
        model = model_cls()
        opt = shardopt.create_optimizer(model, name, **options)
        opt.nonfinite_on_device = on_device
        out.append((model, opt))
    return out


def _step(model, opt, seed: int, poison: str | None = None, value: float = float("nan")) -> None:
    x = torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(seed))
    opt.zero_grad()
    nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    if poison is not None:
        dict(model.named_parameters())[poison].grad.view(-1)[1] = value
    opt.step()


def _snapshot(model, opt):
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {
        opt.param_names[id(p)]: {k: v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)}
        for p, st in opt.state.items()
    }
    return params, state


def _assert_same(a, b) -> None:
    for n in a[0]:
        assert torch.equal(a[0][n], b[0][n]), n
    assert a[1].keys() == b[1].keys()
    for n in a[1]:
        for k in a[1][n]:
            assert torch.equal(a[1][n][k], b[1][n][k]), (n, k)


#: the rules that gate their writes, with options that exercise every gated write
GATED = {
    "scale": dict(weight_decay=0.1, momentum=0.9, embedding_momentum=0.5),
    "sinkgd": dict(weight_decay=0.1),
    "dasgo": dict(weight_decay=0.1),
    "racs": dict(weight_decay=0.1),
    "muon": dict(weight_decay=0.1),
    "swan": dict(weight_decay=0.1),
    "sumo": dict(weight_decay=0.1, rank=2, refresh_interval=5),  # refreshes at steps 1 and 6
    # a switch at steps 1 and 5: the skipped third step is one that switches nothing (skips_on_device)
    "alice": dict(weight_decay=0.1, rank=2, leading=1, refresh_interval=5),
    "alice0": dict(weight_decay=0.1, rank=2, leading=1, refresh_interval=5),
}


@pytest.mark.parametrize("name", sorted(GATED))
@pytest.mark.parametrize("bad", ["proj.weight", "embed.weight", "lm_head.weight", "norm.bias"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_device_skip_equals_host_skip(name: str, bad: str, value: float) -> None:
    """SCALE (weight decay, momentum on every matrix, AdamW on the vectors) and SinkGD (weight decay; AdamW on
    embedding, LM head and vectors): every step, the skipped one included, leaves what the host check's run
    leaves, bit for bit."""
    (hm, ho), (dm, do) = _pair(name, **GATED[name])
    for seed in range(2):
        _step(hm, ho, seed)
        _step(dm, do, seed)
    before = _snapshot(dm, do)
    with pytest.warns(RuntimeWarning, match="skipped step"):
        _step(hm, ho, 2, bad, value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is reported inside the device's step
        _step(dm, do, 2, bad, value)
    with pytest.warns(RuntimeWarning, match="decided on the device"):
        assert do.skipped_steps == 1
    assert ho.skipped_steps == 1
    _assert_same(before, _snapshot(dm, do))  # untouched, host counts taken back
    _assert_same(_snapshot(hm, ho), _snapshot(dm, do))
    for seed in range(3, 6):
        _step(hm, ho, seed)
        _step(dm, do, seed)
        _assert_same(_snapshot(hm, ho), _snapshot(dm, do))
    assert ho.state_dict()["state"].keys() == do.state_dict()["state"].keys()


@pytest.mark.parametrize("name", sorted(GATED))
def test_device_skip_with_a_matrix_without_gradient(name: str) -> None:
    """A step where one matrix has no gradient (the rules' partial-gradient branches), skipped or not, leaves
    what the host check's leaves."""
    (hm, ho), (dm, do) = _pair(name, TwoHidden, **GATED[name])
    for seed, poison in ((0, None), (1, None), (2, "proj2.weight"), (3, None)):
        for model, opt in ((hm, ho), (dm, do)):
            x = torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(seed))
            opt.zero_grad()
            nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
            if seed:
                model.proj.weight.grad = None
            if poison is not None:
                dict(model.named_parameters())[poison].grad.view(-1)[0] = float("nan")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                opt.step()
        assert ho.skipped_steps == do.skipped_steps
        _assert_same(_snapshot(hm, ho), _snapshot(dm, do))
    assert do.skipped_steps == 1


@pytest.mark.parametrize("name", sorted(GATED))
@pytest.mark.parametrize("magnitude", [4e18, 7e18, 1e30])
def test_device_skip_with_huge_finite_gradients(name: str, magnitude: float) -> None:
    """A step skipped for an inf elsewhere while a matrix's gradient is finite but huge (its squares and norms
    overflow): nothing of the overflow reaches the state or the weights, and the steps after it equal the host
    check's (the restores are selects, not products by 0)."""
    (hm, ho), (dm, do) = _pair(name, **GATED[name])
    for seed, poison in ((0, False), (1, False), (2, True), (3, False)):
        for model, opt in ((hm, ho), (dm, do)):
            x = torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(seed))
            opt.zero_grad()
            nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
            if poison:
                model.norm.bias.grad[0] = float("inf")
                grad = model.proj.weight.grad
                grad.copy_(torch.where(grad < 0, -magnitude, magnitude))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                opt.step()
        assert ho.skipped_steps == do.skipped_steps
        _assert_same(_snapshot(hm, ho), _snapshot(dm, do))


def test_bf16_weights_keep_the_host_check() -> None:
    """A gated decay factor is a device tensor, which a bf16 weight would round to its dtype: only fp32 weights
    (mixed precision's master weights) take the device's skip."""
    torch.manual_seed(0)
    model = Tiny()
    model.proj.to(torch.bfloat16)
    opt = shardopt.create_optimizer(model, "scale")
    opt.nonfinite_on_device = True
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    assert not opt._gates_on_device()
    model.proj.float()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    assert opt._gates_on_device()


def test_device_skip_settles_at_the_next_step_and_in_state_dict() -> None:
    """The skip is counted when the next step starts, and a state dict taken right after it has the counts of
    the steps that ran."""
    (hm, ho), (dm, do) = _pair()
    for seed in range(2):
        _step(hm, ho, seed)
        _step(dm, do, seed)
    with pytest.warns(RuntimeWarning):
        _step(hm, ho, 2, "norm.weight")
    _step(dm, do, 2, "norm.weight")
    with pytest.warns(RuntimeWarning, match="decided on the device"):
        sd = do.state_dict()
    steps = lambda sd: sorted(float(st["step"]) for st in sd["state"].values() if "step" in st)  # noqa: E731
    assert steps(sd) == steps(ho.state_dict()) == [2.0, 2.0, 2.0]
    assert do._skipped_steps == 1


@pytest.mark.parametrize("name", sorted(GATED))
def test_the_step_reads_no_flag_where_every_rule_gates(name: str, monkeypatch) -> None:
    """After the first step (Alice's first switch reads the device and keeps the host's check), no step reads
    the flag."""
    (_, _), (model, opt) = _pair(name, **GATED[name])
    _step(model, opt, 0)
    monkeypatch.setattr(opt, "_nonfinite_grads", lambda: pytest.fail("the host check ran"))
    _step(model, opt, 1)
    _step(model, opt, 2)
    assert opt.skipped_steps == 0


def test_a_switch_step_keeps_the_host_check() -> None:
    """Alice's step that switches a basis (steps 1 and K, 2K, ...) takes the host's check, the others the device's."""
    (_, _), (model, opt) = _pair("alice", **GATED["alice"])
    decided = []
    for seed in range(6):
        decided.append(opt._gates_on_device())
        _step(model, opt, seed)
    assert decided == [False, True, True, True, False, True]


@pytest.mark.parametrize("name", ["asgo"])
def test_rules_that_do_not_gate_keep_the_host_check(name: str) -> None:
    (hm, ho), (dm, do) = _pair(name)
    _step(dm, do, 0)
    with pytest.warns(RuntimeWarning, match="on this rank"):  # the host check's own report, in the step
        _step(dm, do, 1, "proj.weight")
    assert do.skipped_steps == 1


def test_bf16_vectors_keep_the_host_check() -> None:
    """AdamW skips on the device only through its fused kernel (fp32 tensors); bf16 ones go to the host check."""
    torch.manual_seed(0)
    model = Tiny().to(torch.bfloat16)
    opt = shardopt.create_optimizer(model, "scale")
    opt.nonfinite_on_device = True
    _step(model, opt, 0)
    assert not opt._gates_on_device()
    with pytest.warns(RuntimeWarning, match="on this rank"):
        _step(model, opt, 1, "norm.bias")
    assert opt.skipped_steps == 1


def test_a_copy_after_a_device_skip_has_settled_counts() -> None:
    import copy

    (_, _), (model, opt) = _pair()
    _step(model, opt, 0)
    _step(model, opt, 1, "proj.weight")
    with pytest.warns(RuntimeWarning, match="decided on the device"):
        twin = copy.deepcopy(opt)
    assert twin.skipped_steps == opt.skipped_steps == 1
    assert "_pending_skip" not in twin.__dict__


@pytest.mark.parametrize("weight", [0.0, 0.1, 0.3, 0.5, 0.8])
def test_skippable_lerp_is_lerp_and_skips(weight: float) -> None:
    """``nonfinite.skippable_lerp_`` writes what ``torch._foreach_lerp_`` writes, bit for bit, on a step that runs;
    on a skipped one (``found_inf`` 1, sources with inf and NaN) it writes nothing; the sources stay as they were."""
    from shardopt.optim.nonfinite import skippable_lerp_

    g = torch.Generator().manual_seed(0)
    targets = [torch.randn(37, 5, generator=g), torch.randn(8, generator=g)]
    sources = [torch.randn(37, 5, generator=g) * 3, torch.randn(8, generator=g)]
    expected = [t.clone() for t in targets]
    torch._foreach_lerp_(expected, sources, weight)
    ran = [t.clone() for t in targets]
    kept = [s.clone() for s in sources]
    skippable_lerp_(ran, sources, weight, torch.zeros(1))
    assert all(torch.equal(a, b) for a, b in zip(ran, expected))
    assert all(torch.equal(a, b) for a, b in zip(sources, kept))
    sources[0][3, 1], sources[1][2] = float("nan"), float("inf")
    skipped = [t.clone() for t in targets]
    skippable_lerp_(skipped, sources, weight, torch.ones(1))
    assert all(torch.equal(a, b) for a, b in zip(skipped, targets))
