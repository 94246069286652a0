"""Learning-rate schedules: values, validation before any change (C6), state dicts.

The trajectories against torch.optim.lr_scheduler are in ``test_optim_torch.py``.
"""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest

from tiegrad import CheckpointError, HyperparameterError, Param
from tiegrad.optim import SGD, Adagrad, Adam
from tiegrad.optim.schedules import (
    ConstantLR,
    CosineWarmup,
    CosineWithWarmup,
    ExponentialLR,
    LambdaLR,
    OneCycleLR,
    StepLR,
)


def optimizer(lr=(0.1, 0.01), cls=SGD, **kwargs):
    return cls([{"params": [Param(np.ones(2))], "lr": v} for v in lr], **kwargs)


def lrs(opt) -> list[float]:
    return [g["lr"] for g in opt.param_groups]


MAKERS = {
    "constant": lambda o: ConstantLR(o, factor=0.5, total_iters=3),
    "step": lambda o: StepLR(o, step_size=2, gamma=0.5),
    "exponential": lambda o: ExponentialLR(o, gamma=0.9),
    "lambda": lambda o: LambdaLR(o, lambda t: 1.0 / (t + 1)),
    "cosine": lambda o: CosineWarmup(o, warmup_steps=3, total_steps=10, min_lr=1e-4),
    "one_cycle": lambda o: OneCycleLR(o, max_lr=0.2, total_steps=10),
}


def test_cosine_warmup_values():
    opt = optimizer(lr=(0.1,))
    sched = CosineWarmup(opt, warmup_steps=4, total_steps=12, min_lr=0.01)
    seen = [lrs(opt)[0]]
    for _ in range(14):
        sched.step()
        seen.append(lrs(opt)[0])
    assert seen[:5] == pytest.approx([0.0, 0.025, 0.05, 0.075, 0.1])  # linear warmup
    assert seen[8] == pytest.approx(0.01 + 0.09 * 0.5)  # halfway through the decay
    assert seen[12:] == pytest.approx([0.01] * 3)  # min_lr from total_steps on
    assert all(a >= b for a, b in zip(seen[4:], seen[5:]))
    assert CosineWithWarmup is CosineWarmup


def test_construction_sets_step_zero_and_lr_at_is_pure():
    opt = optimizer()
    sched = StepLR(opt, step_size=2, gamma=0.5)
    assert sched.last_epoch == 0 and sched.get_last_lr() == [0.1, 0.01]
    assert sched.lr_at(4) == pytest.approx([0.025, 0.0025])
    assert lrs(opt) == [0.1, 0.01] and sched.last_epoch == 0
    sched.step()
    sched.step()
    assert lrs(opt) == pytest.approx([0.05, 0.005]) and sched.last_epoch == 2


def test_one_cycle_sets_betas_for_adam_and_refuses_optimizers_without_momentum():
    opt = optimizer(cls=Adam)
    OneCycleLR(opt, max_lr=0.1, total_steps=5)
    assert [g["betas"] for g in opt.param_groups] == [(0.95, 0.999)] * 2
    with pytest.raises(HyperparameterError, match="cycle_momentum"):
        OneCycleLR(optimizer(cls=Adagrad), max_lr=0.1, total_steps=5)
    OneCycleLR(optimizer(cls=Adagrad), max_lr=0.1, total_steps=5, cycle_momentum=False)


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda o: CosineWarmup(o, warmup_steps=5, total_steps=4), "exceeds total_steps"),
        (lambda o: CosineWarmup(o, warmup_steps=1, total_steps=4, min_lr=-1.0), "min_lr"),
        (lambda o: CosineWarmup(o, warmup_steps=1.5, total_steps=4), "warmup_steps"),
        (lambda o: StepLR(o, step_size=0), "step_size"),
        (lambda o: StepLR(o, step_size=2, gamma=math.nan), "gamma"),
        (lambda o: ExponentialLR(o, gamma=-0.5), "gamma"),
        (lambda o: ConstantLR(o, factor=1.5), "factor"),
        (lambda o: LambdaLR(o, [lambda t: 1.0]), "lr_lambda"),
        (lambda o: LambdaLR(o, lambda t: -1.0), "lr"),
        (lambda o: OneCycleLR(o, max_lr=[0.1], total_steps=5), "max_lr"),
        (lambda o: OneCycleLR(o, max_lr=0.1, total_steps=5, anneal_strategy="exp"), "anneal"),
        (lambda o: OneCycleLR(o, max_lr=0.1, total_steps=5, max_momentum=1.0), "max_momentum"),
        (lambda o: OneCycleLR(o, max_lr=0.1, total_steps=0), "total_steps"),
    ],
)
def test_bad_schedule_arguments_raise_and_change_no_lr(make, fragment):  # C6
    opt = optimizer()
    with pytest.raises(HyperparameterError, match=fragment):
        make(opt)
    assert lrs(opt) == [0.1, 0.01]


def test_a_bad_learning_rate_at_a_later_step_changes_nothing():  # C6
    opt = optimizer()
    sched = LambdaLR(opt, lambda t: 1.0 if t < 2 else math.nan)
    sched.step()
    with pytest.raises(HyperparameterError, match="at step 2"):
        sched.step()
    assert sched.last_epoch == 1 and lrs(opt) == [0.1, 0.01]


def test_one_cycle_past_total_steps_raises_and_changes_nothing():  # C6
    opt = optimizer()
    sched = OneCycleLR(opt, max_lr=0.1, total_steps=3)
    for _ in range(3):
        sched.step()
    before = copy.deepcopy(
        [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    )
    with pytest.raises(HyperparameterError, match="past total_steps"):
        sched.step()
    assert sched.last_epoch == 3
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == before


@pytest.mark.parametrize("name", list(MAKERS))
def test_state_dict_round_trips_through_json(name):
    opt = optimizer()
    sched = MAKERS[name](opt)
    for _ in range(4):
        sched.step()
    sd = json.loads(json.dumps(sched.state_dict()))
    assert sd["kind"] == type(sched).kind and sd["last_epoch"] == 4
    other_opt = optimizer(lr=(0.5, 0.5))
    other = MAKERS[name](other_opt)
    other.load_state_dict(sd)
    assert other.last_epoch == 4 and lrs(other_opt) == pytest.approx(lrs(opt))
    sched.step()
    other.step()
    assert lrs(other_opt) == pytest.approx(lrs(opt))


@pytest.mark.parametrize(
    "edit, fragment",
    [
        (lambda sd: sd.update(kind="StepLR"), "'StepLR' schedule"),
        (lambda sd: sd.pop("min_lr"), "keys"),
        (lambda sd: sd.update(extra=1), "keys"),
        (lambda sd: sd.update(last_epoch=-1), "last_epoch"),
        (lambda sd: sd.update(last_epoch=True), "last_epoch"),
        (lambda sd: sd.update(base_lrs=[0.1]), "base_lrs"),
        (lambda sd: sd.update(base_lrs=[0.1, -0.1]), "lr"),
        (lambda sd: sd.update(warmup_steps=11), "exceeds"),
        (lambda sd: sd.update(min_lr="0"), "min_lr"),
    ],
)
def test_bad_schedule_state_changes_nothing(edit, fragment):  # C6
    opt = optimizer()
    sched = CosineWarmup(opt, warmup_steps=3, total_steps=10)
    sched.step()
    sd = sched.state_dict()
    edit(sd)
    before = (sched.state_dict(), lrs(opt))
    with pytest.raises((CheckpointError, HyperparameterError), match=fragment):
        sched.load_state_dict(sd)
    assert (sched.state_dict(), lrs(opt)) == before


@pytest.mark.parametrize("three_phase", [False, True])
@pytest.mark.parametrize("strategy", ["cos", "linear"])
def test_one_cycle_runs_a_full_loop_and_ends_at_the_last_phase_end(strategy, three_phase):
    # A loop of total_steps iterations steps the schedule to total_steps itself: the
    # last phase's end values there, not an extrapolation (negative with "linear").
    opt = optimizer(lr=(0.1,), momentum=0.9)
    sched = OneCycleLR(
        opt, max_lr=1.0, total_steps=10, anneal_strategy=strategy, three_phase=three_phase
    )
    for _ in range(10):
        opt.step([np.ones(2)])
        sched.step()
    assert sched.last_epoch == 10
    assert lrs(opt) == [pytest.approx(1.0 / 25 / 1e4, rel=1e-12)]
    assert opt.param_groups[0]["momentum"] == pytest.approx(0.95, rel=1e-12)


def test_a_learning_rate_beyond_floats_range_is_a_hyperparameter_error():
    from fractions import Fraction

    from tiegrad.optim import clip_grad_norm

    opt = SGD([Param(np.ones(2))], lr=0.1)
    sched = ExponentialLR(opt, 2.0)
    with pytest.raises(HyperparameterError, match="ExponentialLR at step 1100.*finite"):
        sched.lr_at(1100)  # 2.0 ** 1100 leaves float's range
    for bad in (10**400, Fraction(10**400), np.complex128(0.1 + 2j)):
        with pytest.raises(HyperparameterError):
            SGD([Param(np.ones(2))], lr=bad)
    with pytest.raises(HyperparameterError, match="weight_decay must be finite"):
        SGD([Param(np.ones(2))], lr=0.1, weight_decay=10**400)
    with pytest.raises(HyperparameterError, match="norm_type"):
        clip_grad_norm([np.ones(2)], 1.0, norm_type=10**400)
    assert opt.param_groups[0]["lr"] == 0.1


def test_a_second_live_schedule_on_one_optimizer_warns_that_they_do_not_multiply():
    import gc

    opt = SGD([Param(np.ones(2))], lr=1.0)
    first = StepLR(opt, 1, 0.5)
    del first
    gc.collect()
    kept = ExponentialLR(opt, 0.9)  # the first was dropped: no warning
    with pytest.warns(UserWarning, match="do not multiply"):
        StepLR(opt, 1, 0.5)
    assert kept.optimizer is opt
