"""Optimizers, schedules and clipping against torch.optim in float64 (C3, C4, C5).

The model uses one weight three times (slots 0, 2, 3 hold the same storage), has a
frozen slot, a frozen handle on the tied weight (a use that contributes no gradient,
C4) and a bias in a second group without weight decay. PyTorch sees the tied weight
once, as in a tied module. After every one of 25 steps both parameter sets agree to
1e-10. Gradients reach the optimizer by the three routes of ``step``: the session's
``Gradients``, a per-slot list summed with ``ParamList.canonical_gradients``, and
``None`` (the latest backward).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tiegrad.ops as T  # noqa: E402
from tiegrad import EagerSession, Param, ParamList  # noqa: E402
from tiegrad.backend import device_backend  # noqa: E402
from tiegrad.optim import (  # noqa: E402
    SGD,
    Adagrad,
    Adam,
    AdamW,
    RMSprop,
    clip_grad_norm,
    clip_grad_value,
    schedules,
)
from tiegrad.optim.plan import CHUNK  # noqa: E402

STEPS = 25
TOL = 1e-10
F64 = np.float64


class Model:
    """The same small model in tiegrad (slots) and torch (one tensor per storage)."""

    def __init__(self, seed: int = 0) -> None:
        g = np.random.default_rng(seed)
        self.w0 = g.standard_normal((4, 4)) * 0.5
        self.f0 = g.standard_normal((4, 4)) * 0.5
        self.b0 = g.standard_normal(4) * 0.1
        self.x = g.standard_normal((6, 4))
        w = Param(self.w0, name="w")
        self.frozen = Param(self.f0, requires_grad=False, name="f")
        self.b = Param(self.b0, name="b")
        self.w = w
        # slots: 0 w, 1 f (frozen), 2 w, 3 w, 4 frozen view of w | group 1: 5 b
        self.groups = [
            {"params": [w, self.frozen, w, w, w.alias(requires_grad=False)]},
            {"params": [self.b], "weight_decay": 0.0},
        ]
        self.tw = torch.tensor(self.w0, requires_grad=True)
        self.tb = torch.tensor(self.b0, requires_grad=True)
        self.tf = torch.tensor(self.f0)
        self.tx = torch.tensor(self.x)
        self.torch_groups = [{"params": [self.tw]}, {"params": [self.tb], "weight_decay": 0.0}]

    def loss(self, s: EagerSession, params: ParamList, sign: float) -> tuple[object, list]:
        refs = [s.use(p) for p in params]  # leaf id = slot
        x = s.constant(self.x)
        h = T.tanh(x @ refs[0])
        h = T.tanh(h @ refs[2]) + x @ refs[4]
        out = (h @ refs[3]) @ refs[1] + refs[5]
        return T.mean(out * out) * sign, refs

    def torch_step(self, opt, sign: float) -> None:
        opt.zero_grad()
        h = torch.tanh(self.tx @ self.tw)
        h = torch.tanh(h @ self.tw) + self.tx @ self.tw.detach()
        out = (h @ self.tw) @ self.tf + self.tb
        ((out * out).mean() * sign).backward()

    def agree(self) -> float:
        return max(
            float(np.abs(self.w.value - self.tw.detach().numpy()).max()),
            float(np.abs(self.b.value - self.tb.detach().numpy()).max()),
        )


def run(opt_cls, torch_cls, kwargs, route="session", schedule=None, clip=None) -> None:
    m = Model()
    opt = opt_cls(m.groups, **kwargs)
    topt = torch_cls(m.torch_groups, **kwargs)
    sched = tsched = None
    if schedule is not None:
        make, make_torch = schedule
        sched, tsched = make(opt), make_torch(topt)
    s = EagerSession()
    sign = -1.0 if kwargs.get("maximize") else 1.0  # maximizing -loss stays bounded
    for step in range(STEPS):
        s.reset()
        loss, refs = m.loss(s, opt.params, sign)
        grads = s.backward(loss)
        if route == "list":
            slots = opt.params.canonical_slot_indices()
            per_slot = [grads[r] if p.requires_grad else None for r, p in zip(refs, opt.params)]
            given = opt.params.canonical_gradients(slots, per_slot)
        elif route == "latest":
            given = None
        else:
            given = grads
        m.torch_step(topt, sign)
        if clip is not None:
            given, norm, tnorm = clip(opt, given, [m.tw, m.tb])
            assert norm == pytest.approx(tnorm, rel=1e-12, abs=1e-300)
        opt.step(given)
        topt.step()
        if sched is not None:
            sched.step()
            tsched.step()
            assert sched.get_last_lr() == pytest.approx(tsched.get_last_lr(), rel=1e-12)
        err = m.agree()
        assert err < TOL, f"step {step}: max difference {err}"
    assert opt.step_count == STEPS
    assert sorted(opt.state) == [0, 5]  # canonical trainable slots only (C5)
    assert all(st["step"] == STEPS for st in opt.state.values())


def combos(**axes):
    keys = list(axes)
    return [dict(zip(keys, values)) for values in itertools.product(*axes.values())]


SGD_CASES = [
    c
    for c in combos(
        lr=[0.05],
        momentum=[0.0, 0.9],
        dampening=[0.0, 0.3],
        nesterov=[False, True],
        weight_decay=[0.0, 0.05],
        maximize=[False, True],
    )
    if not c["nesterov"] or (c["momentum"] > 0 and c["dampening"] == 0)
]
ADAM_CASES = combos(
    lr=[0.02],
    betas=[(0.9, 0.999), (0.5, 0.8)],
    eps=[1e-8, 1e-3],
    weight_decay=[0.0, 0.1],
    amsgrad=[False, True],
    maximize=[False, True],
)
ADAMW_CASES = combos(
    lr=[0.02], weight_decay=[0.0, 0.01, 0.3], amsgrad=[False, True], maximize=[False, True]
)
RMSPROP_CASES = combos(
    lr=[0.005],
    alpha=[0.99, 0.5],
    momentum=[0.0, 0.9],
    centered=[False, True],
    weight_decay=[0.0, 0.05],
    maximize=[False, True],
)
ADAGRAD_CASES = combos(
    lr=[0.05],
    lr_decay=[0.0, 0.1],
    weight_decay=[0.0, 0.05],
    initial_accumulator_value=[0.0, 0.2],
    eps=[1e-10],
    maximize=[False, True],
)


CASES = [
    (SGD, SGD_CASES),
    (Adam, ADAM_CASES),
    (AdamW, ADAMW_CASES),
    (RMSprop, RMSPROP_CASES),
    (Adagrad, ADAGRAD_CASES),
]


@pytest.mark.parametrize(
    "opt_cls, kwargs",
    [pytest.param(cls, kw, id=f"{cls.__name__}-{kw}") for cls, cases in CASES for kw in cases],
)
def test_optimizer_matches_torch(opt_cls, kwargs):
    run(opt_cls, getattr(torch.optim, opt_cls.__name__), kwargs)


@pytest.mark.parametrize("route", ["list", "latest"])
@pytest.mark.parametrize(
    "opt_cls, torch_cls, kwargs",
    [
        (SGD, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
        (AdamW, torch.optim.AdamW, {"lr": 0.02}),
        (RMSprop, torch.optim.RMSprop, {"lr": 0.005, "centered": True}),
    ],
)
def test_every_gradient_route_gives_the_same_trajectory(opt_cls, torch_cls, kwargs, route):
    run(opt_cls, torch_cls, kwargs, route=route)


def test_defaults_are_torchs():
    m = Model()
    for ours, theirs in [
        (SGD, torch.optim.SGD),
        (Adam, torch.optim.Adam),
        (AdamW, torch.optim.AdamW),
        (RMSprop, torch.optim.RMSprop),
        (Adagrad, torch.optim.Adagrad),
    ]:
        mine = ours(m.groups).defaults
        torch_defaults = theirs(m.torch_groups).defaults
        for k, v in mine.items():
            assert torch_defaults[k] == pytest.approx(v), (ours.kind, k)


def test_large_and_many_small_parameters_match_torch():  # C5
    # One parameter longer than a CHUNK (sliced) and small ones merged into one call.
    g = np.random.default_rng(3)
    shapes = [(CHUNK + 100,), (300,), (5, 7), (3,), (2, 2, 2)]
    values = [g.standard_normal(s) for s in shapes]
    plist = ParamList.of_pack(values)
    tensors = [torch.tensor(v, requires_grad=True) for v in values]
    for amsgrad in (False, True):
        opt = Adam(plist, lr=0.01, weight_decay=0.1, amsgrad=amsgrad)
        topt = torch.optim.Adam(tensors, lr=0.01, weight_decay=0.1, amsgrad=amsgrad)
        for _ in range(5):
            grads = [g.standard_normal(s) for s in shapes]
            for t, gr in zip(tensors, grads):
                t.grad = torch.tensor(gr)
            opt.step(grads)
            topt.step()
            for p, t in zip(plist, tensors):
                np.testing.assert_allclose(p.value, t.detach().numpy(), rtol=0, atol=TOL)


# -- schedules -----------------------------------------------------------------------------
S = schedules
TS = torch.optim.lr_scheduler


def cosine_warmup_lambda(base: float, warmup: int, total: int, min_lr: float):
    def factor(t: int) -> float:
        if t < warmup:
            return t / warmup
        if t >= total:
            return min_lr / base
        progress = (t - warmup) / (total - warmup)
        return (min_lr + (base - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))) / base

    return factor


SCHEDULES = {
    "constant": (lambda o: S.ConstantLR(o, 0.5, 7), lambda o: TS.ConstantLR(o, 0.5, 7)),
    "step": (lambda o: S.StepLR(o, 4, 0.5), lambda o: TS.StepLR(o, 4, 0.5)),
    "exponential": (lambda o: S.ExponentialLR(o, 0.9), lambda o: TS.ExponentialLR(o, 0.9)),
    "lambda": (
        lambda o: S.LambdaLR(o, [lambda t: 1 / (1 + t), lambda t: 0.97**t]),
        lambda o: TS.LambdaLR(o, [lambda t: 1 / (1 + t), lambda t: 0.97**t]),
    ),
    "cosine_warmup": (
        lambda o: S.CosineWarmup(o, warmup_steps=5, total_steps=20, min_lr=1e-3),
        lambda o: TS.LambdaLR(
            o, [cosine_warmup_lambda(g["lr"], 5, 20, 1e-3) for g in o.param_groups]
        ),
    ),
    "one_cycle": (  # one step more than run() takes: torch's values end at total_steps - 1
        lambda o: S.OneCycleLR(o, max_lr=[0.05, 0.02], total_steps=STEPS + 1),
        lambda o: TS.OneCycleLR(o, max_lr=[0.05, 0.02], total_steps=STEPS + 1),
    ),
    "one_cycle_three_phase_linear": (
        lambda o: S.OneCycleLR(
            o, 0.05, total_steps=30, anneal_strategy="linear", three_phase=True, pct_start=0.4
        ),
        lambda o: TS.OneCycleLR(
            o, 0.05, total_steps=30, anneal_strategy="linear", three_phase=True, pct_start=0.4
        ),
    ),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize(
    "opt_cls, torch_cls, kwargs",
    [
        (SGD, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
        (Adam, torch.optim.Adam, {"lr": 0.02}),
    ],
)
def test_schedules_match_torch(name, opt_cls, torch_cls, kwargs):
    run(opt_cls, torch_cls, kwargs, schedule=SCHEDULES[name])


def test_one_cycle_cycles_torchs_momentum():
    m = Model()
    opt = SGD(m.groups, lr=0.05, momentum=0.9)
    topt = torch.optim.SGD(m.torch_groups, lr=0.05, momentum=0.9)
    ours, theirs = S.OneCycleLR(opt, 0.1, total_steps=10), TS.OneCycleLR(topt, 0.1, total_steps=10)
    for _ in range(10):
        assert [g["momentum"] for g in opt.param_groups] == pytest.approx(
            [g["momentum"] for g in topt.param_groups], rel=1e-12
        )
        topt.step()  # no gradients: changes nothing, keeps torch's call-order check quiet
        ours.step()
        theirs.step()


# -- clipping ------------------------------------------------------------------------------
def norm_clip(max_norm: float, norm_type: float):
    def clip(opt, given, tensors):
        grads = opt.canonical_gradients(given)
        norm = clip_grad_norm(grads, max_norm, norm_type)
        tnorm = float(torch.nn.utils.clip_grad_norm_(tensors, max_norm, norm_type))
        return grads, norm, tnorm

    return clip


def value_clip(value: float):
    def clip(opt, given, tensors):
        torch.nn.utils.clip_grad_value_(tensors, value)
        grads = opt.canonical_gradients(given)
        clip_grad_value(grads, value)
        return grads, 0.0, 0.0

    return clip


@pytest.mark.parametrize(
    "clip",
    [norm_clip(0.05, 2.0), norm_clip(0.02, math.inf), norm_clip(0.1, 1.5), value_clip(0.01)],
    ids=["norm2", "norm_inf", "norm1.5", "value"],
)
@pytest.mark.parametrize("route", ["session", "list"])
def test_clipping_matches_torch(clip, route):
    # The tied weight's summed gradient is counted once in the norm, as torch counts tw.
    run(AdamW, torch.optim.AdamW, {"lr": 0.02}, route=route, clip=clip)
    run(SGD, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}, route=route, clip=clip)


@pytest.mark.parametrize("three_phase", [False, True])
@pytest.mark.parametrize("strategy", ["cos", "linear"])
def test_one_cycle_matches_torch_up_to_total_steps(strategy, three_phase):
    # Steps 0 .. total_steps - 1 are torch's; at total_steps torch extrapolates past the
    # last phase (negative with "linear") where tiegrad holds its end value.
    kwargs = {"max_lr": 1.0, "total_steps": 10, "anneal_strategy": strategy}
    opt = SGD([Param(np.ones(2))], lr=0.1, momentum=0.9)
    topt = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1, momentum=0.9)
    ours = schedules.OneCycleLR(opt, three_phase=three_phase, **kwargs)
    theirs = TS.OneCycleLR(topt, three_phase=three_phase, **kwargs)
    for _ in range(10):
        pair = [opt.param_groups[0][k] for k in ("lr", "momentum")]
        assert pair == pytest.approx([topt.param_groups[0][k] for k in ("lr", "momentum")])
        topt.step()
        ours.step()
        theirs.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1.0 / 25 / 1e4, rel=1e-12)


@pytest.mark.parametrize("device", [False, True])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_centered_rmsprop_stays_finite_when_the_gradient_stops_varying(momentum, device):
    """``square_avg - grad_avg**2`` is never negative in exact arithmetic but can round
    to -1 ulp once both have converged: the rule takes it as 0, so the update stays
    finite, as torch's does."""
    g = (0.1 * (1 + 1e-7 * np.random.default_rng(0).standard_normal(64))).astype(np.float32)
    p = Param(np.zeros(64, np.float32))
    opt = RMSprop([p], lr=1e-6, centered=True, momentum=momentum)
    tp = torch.zeros(64, requires_grad=True)
    topt = torch.optim.RMSprop([tp], lr=1e-6, centered=True, momentum=momentum)
    grad = device_backend("torch:cpu").asarray(g) if device else g
    for _ in range(1500):
        opt.step([grad])
        tp.grad = torch.tensor(g)
        topt.step()
    assert np.isfinite(p.value).all() and torch.isfinite(tp).all()
    sq, ga = opt.state_dict()["state"][0]["square_avg"], opt.state_dict()["state"][0]["grad_avg"]
    assert (sq - ga * ga < 0).any()  # the case this test is about did occur
