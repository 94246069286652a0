"""The optimizer's cached step plan (``tiegrad.optim.plan``): reused while the layout
holds, rebuilt when anything it was derived from changes, and never a change of results
(bit for bit) nor of validation (C6).

The reference for "no change of results" is a cold twin: an equal optimizer over equal
parameters that forgets its plan before every step, so each of its steps does all the
layout work afresh, as every step did before the plan was cached. Each case runs on the
fused (numba) path and on the NumPy path.
"""

from __future__ import annotations

import gc
import math
import weakref

import numpy as np
import pytest
from optim_lists import make_list

import tiegrad.ops as T
from tiegrad import (
    DTypeError,
    EagerSession,
    HyperparameterError,
    MissingGradientError,
    NonFiniteError,
    Param,
    ParamList,
    ShapeError,
    SlotError,
    _numba,
)
from tiegrad.optim import SGD, Adagrad, Adam, AdamW, RMSprop, fused

CASES = [
    (Adam, {"lr": 0.01}),
    (AdamW, {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True}),
    (SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    (RMSprop, {"lr": 0.005, "momentum": 0.5, "centered": True}),
    (Adagrad, {"lr": 0.05, "lr_decay": 0.01}),
]
IDS = [f"{cls.kind}-{i}" for i, (cls, _) in enumerate(CASES)]
WARM = 6  # good steps before a change: the plan and its program are reused by then


@pytest.fixture(params=[True, False], ids=["fused", "numpy"])
def path(request, monkeypatch):
    """The fused path (skipped without numba) or the NumPy rules; small fused chunks."""
    if request.param and fused._kernels() is None:
        pytest.skip("numba is not installed")
    monkeypatch.setattr(_numba, "ENABLED", request.param)
    monkeypatch.setattr(fused, "CHUNK_MIN", 512)  # small batches still use the threads
    monkeypatch.setenv("TIEGRAD_NUM_THREADS", "2")
    return request.param


def grads_for(plist: ParamList, k: int) -> list:
    """Step ``k``'s gradients in list form (summed at canonical slots, None elsewhere)."""
    g = np.random.default_rng(100 + k)
    per_slot = [g.standard_normal(p.shape).astype(p.dtype) for p in plist]
    return plist.canonical_gradients(plist.canonical_slot_indices(), per_slot)


def fingerprint(opt) -> tuple:
    """Every byte a step could change: values, state, counters, hyperparameters."""
    values = [(p.value.dtype.str, p.value.shape, p.value.tobytes()) for p in opt.params]
    state = {
        slot: {k: v.tobytes() if isinstance(v, np.ndarray) else v for k, v in entry.items()}
        for slot, entry in opt.state.items()
    }
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return values, state, opt.step_count, opt.skipped_steps, groups


def twins(cls, kwargs, dtype=np.float32):
    """A warm optimizer and its cold twin over equal, separate parameter lists."""
    return cls(make_list(dtype), **kwargs), cls(make_list(dtype), **kwargs)


def cold_step(opt, grads) -> None:
    """A step without a cached plan."""
    opt._step_plan = None
    opt.step(grads)


def step_both(warm, cold, k: int) -> None:
    warm.step(grads_for(warm.params, k))
    cold_step(cold, grads_for(cold.params, k))
    assert fingerprint(warm) == fingerprint(cold), f"after step {k}"


# -- results -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("cls, kwargs", CASES, ids=IDS)
def test_warm_steps_equal_cold_steps_bit_for_bit(path, cls, kwargs, dtype):
    warm, cold = twins(cls, kwargs, dtype)
    for k in range(WARM):
        step_both(warm, cold, k)
    for opt in (warm, cold):  # a schedule's kind of change: coefficients only
        opt.param_groups[0]["lr"] = opt.param_groups[0]["lr"] * 0.5
    for k in range(WARM, WARM + 3):
        step_both(warm, cold, k)


def test_warm_steps_of_two_groups_equal_cold_steps(path):
    # Two runs of one dtype: each fused batch takes its rows of the gradient table.
    def make():
        plist = make_list()
        groups = [
            {"params": list(plist)[:3]},
            {"params": list(plist)[3:], "lr": 0.03, "amsgrad": True},
        ]
        return Adam(groups, lr=0.01)

    warm, cold = make(), make()
    for k in range(WARM + 2):
        step_both(warm, cold, k)
    assert [run.slots for run in warm._step_plan.program.runs] == [[0, 1], [3, 5]]


def test_the_plan_and_its_program_are_reused_while_the_layout_holds(path):
    opt = Adam(make_list(), lr=0.01)
    opt.step(grads_for(opt.params, 0))  # creates the state: its program is not reused
    opt.step(grads_for(opt.params, 1))
    plan, program = opt._step_plan, opt._step_plan.program
    for k in range(2, WARM):
        opt.param_groups[0]["lr"] = 0.01 / k  # coefficients only: the program holds
        opt.step(grads_for(opt.params, k))
        assert opt._step_plan is plan and plan.program is program
    assert [run.key[1] for run in program.runs] == [WARM + 1]  # the next step's number


@pytest.mark.parametrize(
    "change",
    ["re-tie", "freeze", "load", "state names", "fused switch", "device step"],
)
def test_each_dependency_of_the_plan_invalidates_it(path, change):
    # White-box: the part of the plan derived from what changed is rebuilt.
    opt = Adam(make_list(), lr=0.01)
    for k in range(WARM):
        opt.step(grads_for(opt.params, k))
    plan, program = opt._step_plan, opt._step_plan.program
    plist = opt.params
    if change == "re-tie":
        plist[3].storage = Param(plist[3].value).storage  # same values, a new storage
    elif change == "freeze":
        plist[1].requires_grad = False
    elif change == "load":
        opt.load_state_dict(opt.state_dict())
    elif change == "state names":
        opt.param_groups[0]["amsgrad"] = True
    elif change == "fused switch":
        _numba.ENABLED = not _numba.ENABLED  # restored by the fixture's monkeypatch
    else:
        torch = pytest.importorskip("torch")
        opt.step([None if g is None else torch.tensor(g) for g in grads_for(plist, WARM)])
    opt.step(grads_for(plist, WARM + 1))
    if change in ("re-tie", "freeze"):
        assert opt._step_plan is not plan
    else:
        assert opt._step_plan is plan and plan.program is not program


# -- layout changes after warm steps ---------------------------------------------------------
def test_a_retie_after_warm_steps_is_seen_and_an_untie_continues_like_a_cold_optimizer(path):
    warm, cold = twins(Adam, {"lr": 0.01})
    for k in range(WARM):
        step_both(warm, cold, k)
    own = [warm.params[1].storage, cold.params[1].storage]
    for plist in (warm.params, cold.params):
        plist[1].storage = plist[0].storage  # b now shares w's storage
    step_both(warm, cold, WARM)  # w's history goes on; b's old storage is not trained: dropped
    assert 1 not in warm.state and warm.state[0]["step"] == WARM + 1
    for opt, storage in zip((warm, cold), own):  # b back; slot 2 untied: new state
        opt.params[1].storage = storage
        opt.params[2].storage = Param(opt.params[0].value).storage
    for k in range(WARM + 1, WARM + 4):
        step_both(warm, cold, k)
    assert warm.state[2]["step"] == 3 and warm.state[1]["step"] == 3
    assert warm.state[0]["step"] == WARM + 4


def test_freezing_and_unfreezing_after_warm_steps(path):
    warm, cold = twins(RMSprop, {"lr": 0.01, "momentum": 0.5})
    for k in range(WARM):
        step_both(warm, cold, k)
    for plist in (warm.params, cold.params):
        plist[1].requires_grad = False
    given = grads_for(make_list(), 0)  # b's entry is not None: now refused
    before = fingerprint(warm)
    with pytest.raises(SlotError, match="slot 1 is frozen and its entry must be None"):
        warm.step(given)
    assert fingerprint(warm) == before
    step_both(warm, cold, WARM)
    assert 1 not in warm.state  # a frozen slot owns no state (C5)
    for plist in (warm.params, cold.params):
        plist[1].requires_grad = True
    step_both(warm, cold, WARM + 1)
    assert warm.state[1]["step"] == 1 and warm.state[0]["step"] == WARM + 2


def test_a_new_storage_of_another_shape_after_warm_steps_starts_its_own_history(path):
    # State belongs to a storage: the slot's old storage is no longer trained (its state
    # is dropped), the new one starts at step 1 with zero moments of its own shape.
    opt = Adam(make_list(), lr=0.01)
    for k in range(WARM):
        opt.step(grads_for(opt.params, k))
    before = {slot: entry["step"] for slot, entry in opt.state.items()}
    opt.params[3].storage = Param(np.zeros(4, np.float32)).storage
    opt.step(grads_for(opt.params, WARM))
    assert opt.state[3]["step"] == 1 and opt.state[3]["exp_avg"].shape == (4,)
    assert {s: e["step"] for s, e in opt.state.items() if s != 3} == {
        s: n + 1 for s, n in before.items() if s != 3
    }


def test_loading_a_state_dict_after_warm_steps_continues_from_it(path):
    warm, cold = twins(AdamW, {"lr": 0.01, "amsgrad": True})
    for k in range(3):
        step_both(warm, cold, k)
    saved, values = warm.state_dict(), warm.params.values()
    values = [v.copy() for v in values]
    for k in range(3, WARM):
        warm.step(grads_for(warm.params, k))
    warm.params.set_values(values)
    warm.load_state_dict(saved)
    for k in range(3, WARM + 2):
        step_both(warm, cold, k)


def test_replaced_state_buffers_are_not_kept_alive_by_the_plan(path):
    torch = pytest.importorskip("torch")
    opt = Adam(make_list(), lr=0.01)
    for k in range(WARM):
        opt.step(grads_for(opt.params, k))
    old = weakref.ref(opt._state.flat.layout()[0, "exp_avg"][0])
    opt.load_state_dict(opt.state_dict())  # new buffers; the old ones must go
    gc.collect()
    assert old() is None
    opt.step(grads_for(opt.params, WARM))
    old = weakref.ref(opt._state.flat.layout()[0, "exp_avg"][0])
    opt.param_groups[0]["amsgrad"] = True  # a device step that arranges a new layout
    opt.step([None if g is None else torch.tensor(g) for g in grads_for(opt.params, WARM + 1)])
    gc.collect()
    assert old() is None


def test_hyperparameters_are_checked_and_used_on_every_warm_step(path):
    warm, cold = twins(Adam, {"lr": 0.01})
    for k in range(WARM):
        step_both(warm, cold, k)
    before = fingerprint(warm)
    grads = grads_for(warm.params, WARM)
    for key, value, message in [
        ("lr", -1.0, "lr"),
        ("eps", 1e-50, "eps=1e-50 rounds to 0 in float32"),
        ("betas", (0.9, 1.0), r"betas\[1\] must be in \[0, 1\)"),
        ("amsgrad", 1, "amsgrad must be True or False"),
    ]:
        good = warm.param_groups[0][key]
        warm.param_groups[0][key] = value
        with pytest.raises(HyperparameterError, match=message):
            warm.step(grads)
        warm.param_groups[0][key] = good
        assert fingerprint(warm) == before
    for opt in (warm, cold):
        opt.param_groups[0]["amsgrad"] = True  # new state names: max_exp_avg_sq appears
        opt.param_groups[0]["betas"] = (0.8, 0.99)
    for k in range(WARM, WARM + 3):
        step_both(warm, cold, k)
    assert "max_exp_avg_sq" in warm.state[0]


def test_new_values_and_live_tapes_after_warm_steps(path):
    # C3: a step starts from the storage's current value; C2: a value a live tape holds
    # is copied, never written, however warm the plan.
    warm, cold = twins(SGD, {"lr": 0.1, "momentum": 0.9})
    for k in range(WARM):
        step_both(warm, cold, k)
    for plist in (warm.params, cold.params):
        plist[5].set_value(np.full(3001, 2.0, np.float32))
    step_both(warm, cold, WARM)
    s = EagerSession()
    leaf = s.use(warm.params[0])
    held = leaf.value.copy()
    step_both(warm, cold, WARM + 1)
    np.testing.assert_array_equal(leaf.value, held)
    assert warm.params[0].value is not leaf.value
    s.reset()
    step_both(warm, cold, WARM + 2)


def test_session_gradients_with_a_warm_plan(path):
    p, q = Param(np.ones((3, 2), np.float32), name="p"), Param(np.ones(2, np.float32), name="q")
    opt = Adam(ParamList([p, q, p.alias()]), lr=0.1)
    ref = Adam(
        ParamList([Param(np.ones((3, 2), np.float32)), Param(np.ones(2, np.float32))]), lr=0.1
    )
    for k in range(WARM):
        s = EagerSession()
        loss = T.sum(s.use(p) * float(k + 1)) + T.sum(s.use(q) * s.use(q)) + T.sum(s.use(p))
        opt.step(s.backward(loss))
        a, b = ref.params
        ref.step([np.full((3, 2), k + 2.0, np.float32), 2 * b.value])
    for mine, theirs in zip(opt.params.values(), ref.params.values() + [ref.params[0].value]):
        np.testing.assert_array_equal(mine, theirs)
    s = EagerSession()
    loss = T.sum(s.use(p))  # q is not used: its gradient is missing (C6)
    before = fingerprint(opt)
    with pytest.raises(MissingGradientError, match=r"slot 1 \('q'\) is trainable but has no"):
        opt.step(s.backward(loss))
    assert fingerprint(opt) == before


def test_gradient_forms_that_need_conversion_or_a_copy_with_a_warm_plan(path):
    class Sub(np.ndarray):
        pass

    warm, cold = twins(Adam, {"lr": 0.01})
    for k in range(WARM):
        step_both(warm, cold, k)
    grads = grads_for(warm.params, WARM)
    odd = list(grads)
    odd[0] = np.asfortranarray(grads[0])  # strided
    odd[1] = grads[1].tolist()  # converted
    odd[5] = grads[5].view(Sub)  # a subclass
    warm.step(odd)
    cold_step(cold, grads)
    assert fingerprint(warm) == fingerprint(cold)
    step_both(warm, cold, WARM + 1)


@pytest.mark.parametrize("which", ["other value", "other state"])
def test_gradients_that_alias_what_a_warm_step_writes_are_read_first(path, which):
    # Memory a step writes (another slot's parameter or state) given as a gradient after
    # warm steps with other gradients: copied before the kernel writes, as on any step.
    def make():
        g = np.random.default_rng(3)
        return Adam(ParamList.of_pack([g.standard_normal(3000, np.float32) for _ in range(3)]))

    warm, cold = make(), make()
    for k in range(WARM):
        for opt, step in ((warm, type(warm).step), (cold, cold_step)):
            step(opt, [np.full(3000, (k + 1.0) * (j + 1), np.float32) for j in range(3)])
    for opt, step in ((warm, type(warm).step), (cold, cold_step)):
        values = [p.value for p in opt.params]
        sources = values if which == "other value" else [opt.state[i]["exp_avg"] for i in range(3)]
        given = [sources[1], sources[2], sources[0]]  # each slot gets another slot's memory
        step(opt, given if opt is warm else [a.copy() for a in given])
    assert fingerprint(warm) == fingerprint(cold)


# -- C6 with a warm plan ---------------------------------------------------------------------
BAD = {
    "nan": (lambda g: g[5].__setitem__(2999, np.nan), NonFiniteError, r"slot 5 \('v'\) holds NaN"),
    "inf": (lambda g: g[3].__setitem__((), -np.inf), NonFiniteError, r"slot 3 \('s'\) holds NaN"),
    "shape": (
        lambda g: g.__setitem__(1, np.zeros(8, np.float32)),
        ShapeError,
        r"gradient of slot 1 \('b'\): expected shape \(7,\), got \(8,\)",
    ),
    "dtype": (
        lambda g: g.__setitem__(5, g[5].astype(np.float64)),
        DTypeError,
        r"gradient of slot 5 \('v'\): expected dtype float32, got float64",
    ),
    "missing": (
        lambda g: g.__setitem__(3, None),
        MissingGradientError,
        r"slot 3 \('s'\) is trainable but has no gradient",
    ),
    "alias entry": (
        lambda g: g.__setitem__(2, np.zeros((40, 30), np.float32)),
        SlotError,
        "slot 2 is an alias of slot 0 and its entry must be None",
    ),
    "length": (lambda g: g.pop(), SlotError, "5 gradients for 6 slots"),
}


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("cls, kwargs", CASES, ids=IDS)
def test_a_bad_gradient_after_many_good_steps_raises_naming_the_slot_and_changes_nothing(
    path, cls, kwargs, case
):  # C6
    spoil, error, message = BAD[case]
    warm, cold = twins(cls, kwargs)
    for k in range(WARM):
        step_both(warm, cold, k)
    before = fingerprint(warm)
    values = warm.params.values()
    grads = grads_for(warm.params, WARM)
    spoil(grads)
    with pytest.raises(error, match=message):
        warm.step(grads)
    assert fingerprint(warm) == before
    assert all(a is b for a, b in zip(warm.params.values(), values))  # not even re-installed
    for k in range(WARM, WARM + 2):  # and the plan goes on as if nothing happened
        step_both(warm, cold, k)


def test_a_skipped_nonfinite_step_with_a_warm_plan_changes_nothing(path):
    warm, cold = twins(Adam, {"lr": 0.01, "nonfinite": "skip"})
    for k in range(WARM):
        step_both(warm, cold, k)
    before = fingerprint(warm)
    grads = grads_for(warm.params, WARM)
    grads[0][39, 29] = math.inf
    warm.step(grads)
    values, state, steps, skipped, groups = fingerprint(warm)
    assert (values, state, steps, groups) == (before[0], before[1], before[2], before[4])
    assert skipped == before[3] + 1
    warm.skipped_steps -= 1  # the cold twin never saw the skipped step
    for k in range(WARM, WARM + 2):
        step_both(warm, cold, k)
    assert warm.state[0]["step"] == WARM + 2


def test_device_steps_between_warm_host_steps(path):
    torch = pytest.importorskip("torch")
    warm, cold = twins(Adam, {"lr": 0.01})
    for k in range(WARM + 4):
        on_device = WARM <= k < WARM + 2
        for opt, step in ((warm, type(warm).step), (cold, cold_step)):
            grads = grads_for(opt.params, k)
            step(
                opt, [None if g is None else torch.tensor(g) for g in grads] if on_device else grads
            )
        warm.params.sync()
        cold.params.sync()
        assert fingerprint(warm) == fingerprint(cold), f"after step {k}"
