"""Optimizer contracts: one update per storage (C4), canonical state (C5), fresh reads
(C3), snapshots (C2) and validation before any write (C6)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tiegrad.ops as T
from tiegrad import (
    AliasError,
    DTypeError,
    EagerSession,
    HyperparameterError,
    MissingGradientError,
    NonFiniteError,
    Param,
    ParamList,
    ShapeError,
    SlotError,
)
from tiegrad.optim import SGD, Adagrad, Adam, AdamW, RMSprop
from tiegrad.optim.adam import AdamCoefficients, adam_rule

F64 = np.float64
OPTIMIZERS = [
    (SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    (SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    (Adam, {"lr": 0.05, "weight_decay": 0.1, "amsgrad": True}),
    (AdamW, {"lr": 0.05}),
    (RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True}),
    (Adagrad, {"lr": 0.1, "lr_decay": 0.01, "initial_accumulator_value": 0.1}),
]
IDS = [f"{cls.kind}-{i}" for i, (cls, _) in enumerate(OPTIMIZERS)]


def snapshot(opt) -> tuple:
    """Every byte an optimizer step could change: values, state, counters, groups."""
    values = [(p.value.dtype.str, p.value.shape, p.value.tobytes()) for p in opt.params]
    state = {
        slot: {k: v.tobytes() if isinstance(v, np.ndarray) else v for k, v in entry.items()}
        for slot, entry in opt.state.items()
    }
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return values, state, opt.step_count, opt.skipped_steps, groups


def tied_setup(cls, kwargs, dtype=F64):
    """[p, q, p, frozen r]: canonical slots [0, 1, 0, None]; two steps taken."""
    g = np.random.default_rng(0)
    p = Param(g.standard_normal((3, 2)), dtype=dtype, name="p")
    q = Param(g.standard_normal(4), dtype=dtype, name="q")
    r = Param(g.standard_normal(2), dtype=dtype, requires_grad=False, name="r")
    opt = cls(ParamList([p, q, p, r]), **kwargs)
    for _ in range(2):
        opt.step(list_grads(opt, g, dtype))
    return opt, g


def list_grads(opt, g, dtype=F64) -> list:
    slots = opt.params.canonical_slot_indices()
    per_slot = [g.standard_normal(p.shape).astype(dtype) for p in opt.params]
    return opt.params.canonical_gradients(slots, per_slot)


# -- C4: one update per storage ------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_storage_used_k_times_gets_one_update_with_the_summed_gradient(k):  # C4
    coeffs = [0.5 + j for j in range(k)]
    for cls, kwargs in [(SGD, {"lr": 0.1}), (Adam, {"lr": 0.01})]:
        p = Param(np.zeros(3))
        opt = cls(ParamList([p]), **kwargs)
        s = EagerSession()
        loss = sum((T.sum(s.use(p)) * c for c in coeffs), start=s.constant(0.0))
        opt.step(s.backward(loss))
        total = sum(coeffs)
        if cls is SGD:
            np.testing.assert_array_equal(p.value, np.full(3, -0.1 * total))
        else:  # Adam's first update has magnitude lr whatever the gradient: once, not k times
            np.testing.assert_allclose(p.value, np.full(3, -0.01), rtol=1e-6)
            state = opt.state[0]
            assert state["step"] == 1
            np.testing.assert_allclose(state["exp_avg"], np.full(3, 0.1 * total))


@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS, ids=IDS)
def test_tied_list_equals_independent_storages_fed_the_sums(cls, kwargs):  # C4, C5
    # Reference case 14: [p, q, p] with (a, b, c) == independent [P, Q] with (a + c, b).
    g = np.random.default_rng(1)
    p0, q0 = g.standard_normal((2, 3)), g.standard_normal(3)
    p, q = Param(p0), Param(q0)
    pp, qq = Param(p0), Param(q0)
    tied, free = cls(ParamList([p, q, p]), **kwargs), cls(ParamList([pp, qq]), **kwargs)
    for _ in range(6):
        a, b, c = g.standard_normal((2, 3)), g.standard_normal(3), g.standard_normal((2, 3))
        tied.step(tied.params.canonical_gradients([0, 1, 0], [a, b, c]))
        free.step([a + c, b])
        assert p.value.tobytes() == pp.value.tobytes()
        assert q.value.tobytes() == qq.value.tobytes()
    assert sorted(tied.state) == [0, 1]
    for name, arr in tied.state[0].items():
        other = free.state[0][name]
        assert other == arr if name == "step" else other.tobytes() == arr.tobytes()


@settings(max_examples=30, deadline=None)
@given(
    layout=st.lists(st.tuples(st.integers(0, 3), st.booleans()), min_size=1, max_size=7),
    which=st.integers(0, len(OPTIMIZERS) - 1),
    seed=st.integers(0, 2**16),
)
def test_any_tie_layout_matches_independent_storages(layout, which, seed):  # C1, C4, C5
    cls, kwargs = OPTIMIZERS[which]
    g = np.random.default_rng(seed)
    inits = [g.standard_normal(2 + i) for i in range(4)]
    tied_storages = [Param(v) for v in inits]
    free_storages = [Param(v) for v in inits]
    slots_params = [tied_storages[i].alias(requires_grad=train) for i, train in layout]
    trained = sorted({i for i, train in layout if train})
    if not trained:
        with pytest.raises(SlotError):
            cls(ParamList([]), **kwargs)
        return
    tied = cls(ParamList(slots_params), **kwargs)
    free = cls(ParamList([free_storages[i] for i in trained]), **kwargs)
    slots = tied.params.canonical_slot_indices()
    for _ in range(3):
        per_slot = [g.standard_normal(p.shape) for p in tied.params]
        sums = tied.params.canonical_gradients(slots, per_slot)
        tied.step(sums)
        by_storage = {id(tied.params[c].storage): sums[c] for c in set(slots) - {None}}
        free.step([by_storage[id(tied_storages[i].storage)] for i in trained])
    for i in range(4):
        assert tied_storages[i].value.tobytes() == free_storages[i].value.tobytes()
    assert sorted(tied.state) == sorted(set(slots) - {None})


# -- C2, C3 and the session route ----------------------------------------------------------
def test_update_starts_from_the_current_value_and_leaves_snapshots_alone():  # C2, C3
    p = Param(np.ones(2))
    opt = SGD(ParamList([p]), lr=0.25)
    s = EagerSession()
    ref = s.use(p)
    grads = s.backward(T.sum(ref * 2.0))
    p.set_value(np.full(2, 5.0))  # written after the use: the update starts here (C3)
    opt.step(grads)
    np.testing.assert_array_equal(p.value, [4.5, 4.5])
    np.testing.assert_array_equal(ref.value, [1.0, 1.0])  # the leaf keeps its snapshot (C2)


def test_a_pinned_value_is_copied_and_an_unpinned_one_updated_in_place():  # C2
    p = Param(np.ones(2))
    opt = Adam(ParamList([p]), lr=0.1)
    s = EagerSession()
    ref = s.use(p)
    opt.step(s.backward(T.sum(ref), retain_graph=True))
    assert p.value is not ref.value and ref.value.tolist() == [1.0, 1.0]
    s.reset()
    before = p.value
    opt.step([np.ones(2)])
    assert p.value is before  # no live tape holds it: written in place


def test_session_groups_of_storages_not_held_are_ignored_and_frozen_uses_add_nothing():  # C4
    p, other = Param(np.ones(2)), Param(np.ones(2))
    opt = SGD(ParamList([p]), lr=1.0)
    s = EagerSession()
    frozen_view = p.alias(requires_grad=False)
    loss = T.sum(s.use(p) * 3.0) + T.sum(s.use(other)) + T.sum(s.use(frozen_view) * 100.0)
    opt.step(s.backward(loss))
    np.testing.assert_array_equal(p.value, [-2.0, -2.0])
    np.testing.assert_array_equal(other.value, [1.0, 1.0])


def test_latest_gradients_route():
    p = Param(np.ones(2))
    opt = SGD(ParamList([p]), lr=0.5)
    s = EagerSession()
    s.backward(T.sum(s.use(p)))
    opt.step()
    np.testing.assert_array_equal(p.value, [0.5, 0.5])


def test_module_parameters_work_end_to_end():
    nn = pytest.importorskip("tiegrad.nn")
    model = nn.Sequential(nn.Linear(3, 4, rng=np.random.default_rng(0)), nn.Tanh())
    opt = AdamW(model.parameters(), lr=0.01)
    s = EagerSession()
    before = [p.value.copy() for p in opt.params]
    out = model(s, np.ones((2, 3), np.float32))
    opt.step(s.backward(T.sum(out * out)))
    assert all(not np.array_equal(b, p.value) for b, p in zip(before, opt.params))
    assert sorted(opt.state) == [0, 1]


# -- frozen slots, groups ------------------------------------------------------------------
def test_frozen_slots_own_no_state_and_are_never_written():  # C5
    opt, _ = tied_setup(Adam, {"lr": 0.1})
    frozen = opt.params[3]
    assert sorted(opt.state) == [0, 1]
    assert opt.state_tensor_specs() == {
        0: {"exp_avg": ((3, 2), "float64"), "exp_avg_sq": ((3, 2), "float64")},
        1: {"exp_avg": ((4,), "float64"), "exp_avg_sq": ((4,), "float64")},
    }
    np.testing.assert_array_equal(frozen.value, np.random.default_rng(0).standard_normal(12)[10:])


def test_bias_group_hyperparameters_apply_per_group():
    w, b = Param(np.ones(2)), Param(np.ones(2))
    opt = SGD([{"params": [w]}, {"params": [b], "weight_decay": 0.0}], lr=0.1, weight_decay=1.0)
    opt.step([np.zeros(2), np.zeros(2)])
    np.testing.assert_allclose(w.value, [0.9, 0.9])  # decayed
    np.testing.assert_array_equal(b.value, [1.0, 1.0])  # not decayed
    assert [g["slots"] for g in opt.param_groups] == [(0,), (1,)]
    assert opt.param_groups[0]["params"] == (w,)


def test_a_storage_in_two_groups_needs_equal_hyperparameters():  # C1, C6
    w = Param(np.ones(2), name="w")
    with pytest.raises(
        AliasError, match=r"slot 0 \('w'\) in group 0 and slot 1 \('w'\) in group 1"
    ):
        SGD([{"params": [w]}, {"params": [w], "lr": 0.5}], lr=0.1)
    opt = SGD([{"params": [w]}, {"params": [w], "lr": 0.1}], lr=0.1)
    opt.step([np.ones(2), None])
    np.testing.assert_allclose(w.value, [0.9, 0.9])  # one update
    opt.param_groups[1]["lr"] = 0.2
    before = snapshot(opt)
    with pytest.raises(AliasError, match="lr 0.1 vs 0.2"):
        opt.step([np.ones(2), None])
    assert snapshot(opt) == before


def test_construction_errors():
    p = Param(np.ones(2))
    with pytest.raises(SlotError, match="empty parameter list"):
        Adam([])
    with pytest.raises(SlotError, match=r"params\[1\] must be a tiegrad.Param"):
        Adam([p, np.ones(2)])
    with pytest.raises(HyperparameterError, match="unknown hyperparameter"):
        Adam([{"params": [p], "weight_decy": 0.0}])
    with pytest.raises(HyperparameterError, match="nesterov"):
        SGD([p], momentum=0.9, dampening=0.1, nesterov=True)
    with pytest.raises(HyperparameterError, match="nonfinite"):
        Adam([p], nonfinite="ignore")
    with pytest.raises(HyperparameterError, match="rounds to 0 in float32"):
        Adam([Param(np.ones(2, np.float32))], eps=1e-50)


# -- C6: bad input changes nothing ---------------------------------------------------------
def set_group(key, value):
    def apply(opt, g):
        opt.param_groups[0][key] = value
        opt.step(list_grads(opt, g))

    return apply


def with_grads(edit):
    def apply(opt, g):
        grads = list_grads(opt, g)
        edit(grads)
        opt.step(grads)

    return apply


BAD_STEPS = {
    "lr negative": (set_group("lr", -0.1), HyperparameterError),
    "lr NaN": (set_group("lr", math.nan), HyperparameterError),
    "lr inf": (set_group("lr", math.inf), HyperparameterError),
    "wrong gradient shape": (with_grads(lambda gs: gs.__setitem__(1, np.ones(5))), ShapeError),
    "wrong gradient dtype": (
        with_grads(lambda gs: gs.__setitem__(1, np.ones(4, np.float32))),
        DTypeError,
    ),
    "missing gradient": (with_grads(lambda gs: gs.__setitem__(1, None)), MissingGradientError),
    "entry at an alias slot": (
        with_grads(lambda gs: gs.__setitem__(2, np.ones((3, 2)))),
        SlotError,
    ),
    "entry at a frozen slot": (with_grads(lambda gs: gs.__setitem__(3, np.ones(2))), SlotError),
    "wrong list length": (with_grads(lambda gs: gs.pop()), SlotError),
    "NaN in the last gradient": (
        with_grads(lambda gs: gs[1].__setitem__(3, math.nan)),
        NonFiniteError,
    ),
    "inf in the first gradient": (
        with_grads(lambda gs: gs[0].__setitem__((0, 0), -math.inf)),
        NonFiniteError,
    ),
    "not a gradient container": (lambda opt, g: opt.step({0: np.ones((3, 2))}), SlotError),
}


@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS, ids=IDS)
@pytest.mark.parametrize("case", list(BAD_STEPS))
def test_bad_step_input_changes_nothing(cls, kwargs, case):  # C6
    opt, g = tied_setup(cls, kwargs)
    action, error = BAD_STEPS[case]
    before = snapshot(opt)
    with pytest.raises(error):
        action(opt, g)
    after = snapshot(opt)
    if case.startswith("lr"):  # the bad lr stays in the group: restore it to compare
        after[4][0]["lr"] = before[4][0]["lr"]
    assert after == before


@pytest.mark.parametrize(
    "betas", [(1.0, 0.999), (0.9, 1.0), (-0.1, 0.999), (0.9, -0.1), (math.nan, 0.9), (0.9,)]
)
@pytest.mark.parametrize("cls", [Adam, AdamW])
def test_betas_outside_the_unit_interval_change_nothing(cls, betas):  # C6
    opt, g = tied_setup(cls, {"lr": 0.05})
    before = snapshot(opt)
    opt.param_groups[0]["betas"] = betas
    with pytest.raises(HyperparameterError, match="betas"):
        opt.step(list_grads(opt, g))
    opt.param_groups[0]["betas"] = before[4][0]["betas"]
    assert snapshot(opt) == before
    with pytest.raises(HyperparameterError, match="betas"):
        cls([Param(np.ones(2))], betas=betas)


@pytest.mark.parametrize(
    "key, value",
    [("amsgrad", 1), ("eps", 0.0), ("eps", -1e-8), ("weight_decay", -0.1), ("maximize", "no")],
)
def test_other_bad_hyperparameters_change_nothing(key, value):  # C6
    opt, g = tied_setup(Adam, {"lr": 0.05})
    before = snapshot(opt)
    opt.param_groups[0][key] = value
    with pytest.raises(HyperparameterError, match=key):
        opt.step(list_grads(opt, g))
    opt.param_groups[0][key] = before[4][0][key]
    assert snapshot(opt) == before


def test_session_route_missing_gradient_names_the_slot_and_changes_nothing():  # C4, C6
    p, q = Param(np.ones(2), name="p"), Param(np.ones(3), name="q")
    opt = Adam(ParamList([p, q]), lr=0.1)
    opt.step([np.ones(2), np.ones(3)])
    before = snapshot(opt)
    s = EagerSession()
    grads = s.backward(T.sum(s.use(p)))  # q is trainable but unused
    with pytest.raises(MissingGradientError, match=r"slot 1 \('q'\) is trainable but has no"):
        opt.step(grads)
    assert snapshot(opt) == before


def test_allow_missing_leaves_none_but_still_checks_what_is_given():  # C4, C6
    p, q = Param(np.ones(2), name="p"), Param(np.ones(3), name="q")
    opt = Adam(ParamList([p, q, p]), lr=0.1)
    s = EagerSession()
    grads = s.backward(T.sum(s.use(p) * 2.0))  # q is trainable but unused
    parts = opt.canonical_gradients(grads, allow_missing=True)
    assert parts[1] is None and parts[2] is None  # q missing; slot 2 is p's alias
    np.testing.assert_array_equal(parts[0], np.full(2, 2.0))
    with pytest.raises(MissingGradientError, match=r"slot 1 \('q'\) is trainable"):
        opt.canonical_gradients(grads)
    with pytest.raises(ShapeError, match="gradient of slot 0"):
        opt.canonical_gradients([np.ones(3), None, None], allow_missing=True)
    before = snapshot(opt)
    with pytest.raises(MissingGradientError, match=r"slot 1 \('q'\) is trainable"):
        opt.step(parts)  # the step checks the sum it is given
    assert snapshot(opt) == before


def test_nonfinite_skip_counts_and_changes_nothing_else():  # C6
    opt, g = tied_setup(AdamW, {"lr": 0.05, "nonfinite": "skip"})
    before = snapshot(opt)
    grads = list_grads(opt, g)
    grads[1][0] = math.inf
    opt.step(grads)
    values, state, steps, skipped, groups = snapshot(opt)
    assert (values, state, steps, groups) == (before[0], before[1], before[2], before[4])
    assert skipped == before[3] + 1
    opt.step(list_grads(opt, g))
    assert opt.step_count == before[2] + 1 and opt.state[0]["step"] == 3


# -- alias map changes ---------------------------------------------------------------------
def test_retying_a_slot_keeps_the_history_of_the_storage_still_trained():  # C5, issue 16
    # State belongs to the storage: q's own storage is no longer trained (dropped), p's
    # storage keeps its history at slot 0.
    p, q = Param(np.ones(2)), Param(np.zeros(2))
    opt = Adam(ParamList([p, q]), lr=0.1)
    opt.step([np.ones(2), np.ones(2)])
    q.storage = p.storage  # slot 1 now shares slot 0's storage
    opt.step([np.ones(2), None])
    assert {slot: e["step"] for slot, e in opt.state.items()} == {0: 2}


@pytest.mark.parametrize("value", [np.zeros(3), np.zeros(2, np.float32)])
def test_a_new_storage_at_a_slot_starts_a_history_of_its_own_shape_and_dtype(value):
    # A slot's new storage (another shape or dtype) is a new history: zero moments, step 1.
    p, q = Param(np.ones(2)), Param(np.zeros(2))
    opt = Adam(ParamList([p, q]), lr=0.1)
    opt.step([np.ones(2), np.ones(2)])
    q.storage = Param(value).storage
    opt.step([np.ones(2), np.ones_like(value)])
    assert opt.state[1]["step"] == 1 and opt.state[0]["step"] == 2
    assert opt.state[1]["exp_avg"].shape == value.shape
    assert opt.state[1]["exp_avg"].dtype == value.dtype


def test_freezing_a_slot_drops_its_state_at_the_next_step():  # C5
    p, q = Param(np.ones(2)), Param(np.zeros(2))
    opt = Adam(ParamList([p, q]), lr=0.1)
    opt.step([np.ones(2), np.ones(2)])
    q.requires_grad = False
    q_before = q.value.copy()
    opt.step([np.ones(2), None])
    assert sorted(opt.state) == [0]
    np.testing.assert_array_equal(q.value, q_before)


# -- familiar API --------------------------------------------------------------------------
def test_zero_grad_is_a_no_op_and_lr_is_mutable():
    opt, g = tied_setup(SGD, {"lr": 0.1})
    before = snapshot(opt)
    assert opt.zero_grad() is None
    assert snapshot(opt) == before
    opt.param_groups[0]["lr"] = 0.0
    opt.step(list_grads(opt, g))
    assert snapshot(opt)[0] == before[0]  # lr 0: values unchanged, step still counted
    assert opt.step_count == before[2] + 1
    assert "SGD (4 slots" in repr(opt)


def test_state_is_read_only():
    opt, _ = tied_setup(Adam, {"lr": 0.1})
    with pytest.raises(TypeError):
        opt.state[0]["step"] = 7
    with pytest.raises(ValueError):
        opt.state[0]["exp_avg"][0, 0] = 1.0


def test_float32_parameters_stay_float32():
    opt, g = tied_setup(AdamW, {"lr": 0.05}, dtype=np.float32)
    assert all(p.value.dtype == np.float32 for p in opt.params)
    assert all(v.dtype == np.float32 for k, v in opt.state[0].items() if k != "step")
    with pytest.raises(DTypeError):
        opt.step(list_grads(opt, g, F64))


def test_the_rule_runs_on_torch_tensors():
    # The device path: the same rule, with torch as the array namespace.
    torch = pytest.importorskip("torch")
    g = np.random.default_rng(2)
    p, grad = g.standard_normal(50), g.standard_normal(50)
    m, v, vmax = g.random(50), g.random(50), g.random(50)
    c = AdamCoefficients(0.99, 0.1, True, 0.9, 0.999, 0.1, 0.001, 1e-8, -0.01, True)
    np_state = {"exp_avg": m.copy(), "exp_avg_sq": v.copy(), "max_exp_avg_sq": vmax.copy()}
    t_state = {k: torch.tensor(a) for k, a in np_state.items()}
    np_p, t_p = p.copy(), torch.tensor(p)
    adam_rule(np, np_p, grad, np_state, [np.empty(50) for _ in range(3)], c)
    adam_rule(
        torch,
        t_p,
        torch.tensor(grad),
        t_state,
        [torch.empty(50, dtype=torch.float64) for _ in range(3)],
        c,
    )
    np.testing.assert_allclose(t_p.numpy(), np_p, rtol=1e-15)
    for k in np_state:
        np.testing.assert_allclose(t_state[k].numpy(), np_state[k], rtol=1e-15)


def test_a_storage_used_once_gets_the_very_array_backward_produced():  # C4
    p, q = Param(np.ones(3, np.float32)), Param(np.ones(2, np.float32))
    opt = SGD(ParamList([p, q]), lr=0.1)
    s = EagerSession()
    p_use, q_use = s.use(p), s.use(q)
    grads = s.backward((p_use * p_use).sum() + (s.use(q) * q_use).sum())
    resolved = opt.canonical_gradients(grads)
    assert resolved[0] is grads[p_use]  # one use: no copy, no addition
    np.testing.assert_array_equal(resolved[1], 2 * np.ones(2, np.float32))  # two uses summed
