"""Behavioural cases 1-15 of REFERENCE-SEMANTICS.md section 11, in tiegrad's API.

Cases 16-18 need device mirrors and live with the device tests. Case 14 runs SGD
through ``ParamList.sgd_step``; momentum, Adam and AdamW are written here as update
rules over canonical slots (state keyed by the canonical slot, C5), which is the
layout contract the optimizer classes build on.
"""

from __future__ import annotations

import numpy as np
import pytest

from tiegrad import EagerSession, Param, ParamList, dense_group_gradient
from tiegrad.errors import ShapeError, SlotError
from tiegrad.params import canonical_indices, group_parameter_registrations

F32 = np.float32


def scalar(x):
    return np.array(x, F32)


# -- storage identity and canonical slots -----------------------------------------------------


def test_case_01_canonical_indices_follow_identity_only():  # C1, C5
    p = Param(scalar(2.0), name="p")
    q = Param(scalar(2.0), name="q")
    renamed = p.alias(name="renamed")
    fresh = [Param(p.value) for _ in range(3)]  # same contents, new cells
    one = Param(np.array([2.0], F32))
    storages = [p.storage, q.storage, renamed.storage, *(f.storage for f in fresh)]
    storages += [one.storage, None, p.storage]
    expected = [0, 1, 0, 3, 4, 5, 6, None, 0]
    assert canonical_indices(storages) == expected
    p.set_value(scalar(19.0))
    assert canonical_indices(storages) == expected


def test_case_02_frozen_view_is_never_a_representative():  # C5
    p, q = Param(scalar(1.0)), Param(scalar(1.0))
    pl = ParamList([p.alias(requires_grad=False), p, q, p])
    assert pl.canonical_slot_indices() == [None, 1, 2, 1]


def test_case_03_no_cache_between_calls():  # C5
    p, q = Param(scalar(1.0)), Param(scalar(1.0))
    tied, untied = ParamList([p, p]), ParamList([p, q])
    for _ in range(4):
        assert tied.canonical_slot_indices() == [0, 0]
        assert untied.canonical_slot_indices() == [0, 1]


def test_case_04_equal_valued_allocations_are_not_aliased():  # C1
    for _ in range(128):
        a, b = Param(scalar(3.0)), Param(scalar(3.0))
        assert ParamList([a, b, a]).canonical_slot_indices() == [0, 1, 0]


# -- grouping and gradient sums --------------------------------------------------------------


def test_case_05_grouping_by_descriptor():  # C1, C4
    p, q = Param(scalar(1.0)), Param(scalar(1.0))
    groups = group_parameter_registrations(
        {40: p, 10: q, 20: p, 30: p}, {40: p.storage, 20: p.storage}
    )
    assert [(g.id, list(g.leaves)) for g in groups] == [(10, [10]), (20, [20, 40]), (30, [30])]
    assert [g.storage for g in groups] == [None, p.storage, None]
    assert all(g.parameter is (q if g.id == 10 else p) for g in groups)


def test_case_06_descriptor_of_another_shape_raises():  # C6
    p = Param(scalar(2.0))
    other = Param(np.array([1.0], F32))
    with pytest.raises(ShapeError, match="leaf 40"):
        group_parameter_registrations({40: p, 10: p, 20: p}, {40: other.storage, 20: p.storage})
    assert p.value == 2.0


def test_case_07_frozen_registration_is_excluded():  # C4
    p = Param(scalar(1.0))
    frozen = p.alias(requires_grad=False)
    groups = group_parameter_registrations({0: frozen, 1: p}, {0: p.storage, 1: p.storage})
    assert [(g.id, g.leaves) for g in groups] == [(1, (1,))]


def test_case_08_snapshots_and_fresh_reads():  # C2, C3, C4
    other = EagerSession()
    p = Param(scalar(1.0))
    other_leaf = other.use(p)
    s = EagerSession()
    l0 = s.use(p)
    p.set_value(scalar(5.0))
    l1 = s.use(p)
    (group,) = s.parameter_groups()
    assert group.leaves == (l0.id, l1.id) and group.id == l0.id
    s.sgd_step(0.25, {l0.id: scalar(2.0), l1.id: scalar(3.0)})
    assert p.value == F32(3.75)
    assert l0.value == 1.0 and l1.value == 5.0
    s.reset()
    assert other_leaf.value == 1.0


def test_case_09_dense_group_gradient():  # C4
    s = EagerSession()
    p, q = Param(np.zeros(2, F32)), Param(np.zeros(2, F32))
    s.use(q)
    for _ in range(3):
        s.use(p)
    single, shared = s.parameter_groups()
    rng = np.random.default_rng(9)
    grads = {i: rng.standard_normal(2).astype(F32) for i in range(4)}
    assert dense_group_gradient(single, grads) is grads[0]
    a, b, c = grads[1], grads[2], grads[3]
    assert np.array_equal(dense_group_gradient(shared, grads), (a + b) + c)


def test_case_10_bad_gradient_shape_leaves_every_parameter_unchanged():  # C6
    p, q = Param(scalar(2.0)), Param(scalar(7.0))
    pl = ParamList([p, q])
    with pytest.raises(ShapeError, match="slot 1"):
        pl.sgd_step(0.1, [scalar(1.0), np.ones(1, F32)])
    assert p.value == 2.0 and q.value == 7.0


def test_case_11_canonical_gradients_errors():  # C5, C6
    p = Param(scalar(1.0))
    pl = ParamList([p, p])
    with pytest.raises(ShapeError):
        pl.canonical_gradients([0, 0], [scalar(1.0), np.ones(1, F32)])
    with pytest.raises(SlotError):
        pl.canonical_gradients([0], [scalar(1.0), scalar(1.0)])
    with pytest.raises(SlotError, match="slot 0 points at 1"):
        pl.canonical_gradients([1, 1], [scalar(1.0), scalar(1.0)])


def test_case_12_canonical_gradients_sum_at_representatives():  # C4, C5
    p, q = Param(np.zeros(2, F32)), Param(np.zeros(2, F32))
    pl = ParamList([p.alias(requires_grad=False), p, q, p])
    a, b, c, d = (np.full(2, v, F32) for v in (1.0, 2.0, 4.0, 8.0))
    sums = pl.canonical_gradients([None, 1, 2, 1], [a, b, c, d])
    assert sums[0] is None and sums[3] is None
    assert np.array_equal(sums[1], b + d)
    assert sums[2] is c


def test_case_13_paramlist_sgd_writes_a_tied_storage_once():  # C4, C5
    p, q = Param(np.ones(2, F32)), Param(np.ones(2, F32))
    pl = ParamList([p, q, p])
    a, b, c = (np.full(2, v, F32) for v in (1.0, 2.0, 4.0))
    p_host = p.value
    pl.sgd_step(0.1, (a, b, c))
    assert np.array_equal(p.value, np.ones(2, F32) - F32(0.1) * (a + c))
    assert np.array_equal(q.value, np.ones(2, F32) - F32(0.1) * b)
    assert p.value is p_host  # one in-place write, no tape holds it


def momentum(state, p, g, lr):
    b = g if state is None else F32(0.9) * state + g
    return b, p - F32(lr) * b


def adam(state, p, g, lr, wd=0.0):
    m, v, t = state if state is not None else (np.zeros_like(g), np.zeros_like(g), 0)
    t += 1
    m = F32(0.9) * m + F32(0.1) * g
    v = F32(0.999) * v + F32(0.001) * g * g
    mh = m * F32(1.0 / (1.0 - 0.9**t))
    vh = v * F32(1.0 / (1.0 - 0.999**t))
    p = p - p * F32(lr * wd)
    return (m, v, t), p - (F32(lr) / (np.sqrt(np.maximum(vh, 0)) + F32(1e-8))) * mh


def adamw(state, p, g, lr):
    return adam(state, p, g, lr, wd=0.01)


def canonical_step(pl, states, rule, lr, grads):
    """One generic update keyed by canonical slot: summed gradients, each storage once."""
    slots = pl.canonical_slot_indices()
    sums = pl.canonical_gradients(slots, grads)
    for i, c in enumerate(slots):
        if c == i:
            states[i], new = rule(states.get(i), pl[i].storage.current_host_value(), sums[i], lr)
            pl[i].set_value(new)


@pytest.mark.parametrize(
    "rule", ["sgd", momentum, adam, adamw], ids=["sgd", "momentum", "adam", "adamw"]
)
def test_case_14_tied_equals_independent_fed_the_sum(rule):  # C4, C5
    init_p, init_q = np.array([0.5, -1.0], F32), np.array([2.0, 0.25], F32)
    p, q = Param(init_p), Param(init_q)
    tied = ParamList([p, q, p])
    P, Q = Param(init_p), Param(init_q)
    indep = ParamList([P, Q])
    tied_state, indep_state = {}, {}
    for k in range(6):
        a, b, c = (np.array([k + o, -(k + o) / 2], F32) for o in (1, 3, 5))
        if rule == "sgd":
            tied.sgd_step(0.05, [a, b, c])
            indep.sgd_step(0.05, [a + c, b])
        else:
            canonical_step(tied, tied_state, rule, 0.05, [a, b, c])
            canonical_step(indep, indep_state, rule, 0.05, [a + c, b])
        assert p.value.tobytes() == P.value.tobytes()
        assert q.value.tobytes() == Q.value.tobytes()
    if rule != "sgd":  # optimizer state lives at the canonical slots 0 and 1 only
        assert sorted(tied_state) == [0, 1] and sorted(indep_state) == [0, 1]


def test_case_15_of_pack_mask_length():  # seed 001: ofPackWithRequiresGrad
    values = [np.zeros(2, F32), np.zeros((1, 3), F32)]
    with pytest.raises(SlotError, match="shorter"):
        ParamList.of_pack(values, [True])
    with pytest.raises(SlotError, match="longer"):
        ParamList.of_pack(values, [True, False, True])
    pl = ParamList.of_pack(values, [True, False])
    assert pl.requires_grad_array() == [True, False]
