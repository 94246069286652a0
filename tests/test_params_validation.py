"""Validate before mutate (C6): every bad input raises a TiegradError naming the slot and
the expected and actual values, and afterwards every parameter is bit-identical."""

from __future__ import annotations

import math

import numpy as np
import pytest

import tiegrad
from tiegrad import EagerSession, Param, ParamList, TiegradError
from tiegrad.errors import (
    DTypeError,
    HyperparameterError,
    MissingGradientError,
    ShapeError,
    SlotError,
    TapeError,
)
from tiegrad.params import group_parameter_registrations

F32 = np.float32


def make_list():
    """[p, q, frozen p, p, r]: a tie, a frozen alias and a lone storage."""
    p = Param(np.array([1.0, 2.0], F32), name="p")
    q = Param(np.array([[3.0]], F32), name="q")
    r = Param(np.array(4.0, F32), name="r")
    return ParamList([p, q, p.alias(requires_grad=False), p, r])


def good_grads(pl):
    return [np.full(p.shape, 0.5, p.dtype) for p in pl]


def state(pl):
    return [(id(p.storage), p.value, p.value.tobytes(), p.storage.host_current) for p in pl]


def assert_unchanged(pl, before):
    after = state(pl)
    for (sid, arr, data, flag), (sid2, arr2, data2, flag2) in zip(before, after):
        assert sid == sid2 and arr is arr2 and data == data2 and flag == flag2


def raises_cleanly(pl, exc, fragments, fn):
    """``fn()`` raises ``exc`` whose message holds every fragment; ``pl`` is untouched."""
    before = state(pl)
    with pytest.raises(exc) as info:
        fn()
    assert isinstance(info.value, TiegradError)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    assert_unchanged(pl, before)
    return info.value


# -- of_pack ----------------------------------------------------------------------------------


def test_of_pack_mask_shorter_and_longer_are_distinct_errors():  # seed 001, C6
    values = [np.zeros(2, F32), np.zeros(3, F32)]
    with pytest.raises(SlotError, match=r"shorter.*1 flags for 2 values"):
        ParamList.of_pack(values, [True])
    with pytest.raises(SlotError, match=r"longer.*3 flags for 2 values"):
        ParamList.of_pack(values, [True, False, True])
    pl = ParamList.of_pack(values, [False, True])
    assert pl.requires_grad_array() == [False, True]
    assert pl.shapes == ((2,), (3,))
    assert ParamList.of_pack(values).requires_grad_array() == [True, True]


def test_of_pack_allocates_fresh_storages():  # C1
    v = np.ones(2, F32)
    pl = ParamList.of_pack([v, v])
    assert pl.canonical_slot_indices() == [0, 1]
    assert not np.shares_memory(pl[0].value, v)


def test_paramlist_only_holds_params():
    with pytest.raises(SlotError, match="slot 1: expected a Param, got ndarray"):
        ParamList([Param(1.0), np.zeros(1)])


# -- canonical_gradients ----------------------------------------------------------------------


def test_canonical_gradients_rejects_wrong_slot_list_length():
    pl = make_list()
    slots = pl.canonical_slot_indices()
    raises_cleanly(
        pl,
        SlotError,
        ["4 slots for 5 parameters"],
        lambda: pl.canonical_gradients(slots[:4], good_grads(pl)),
    )
    raises_cleanly(
        pl,
        SlotError,
        ["6 gradients for 5 parameters"],
        lambda: pl.canonical_gradients(slots, good_grads(pl) + [np.zeros(1, F32)]),
    )


@pytest.mark.parametrize(
    "slots, fragments",
    [
        ([0, 2, None, 0, 4], ["slot 1 points at 2", "expected an index in [0, 1]"]),
        ([0, -1, None, 0, 4], ["slot 1 points at -1"]),
        ([0, 1.0, None, 0, 4], ["slot 1 points at 1.0"]),
        ([0, True, None, 0, 4], ["slot 1 points at True"]),
        ([None, 1, None, 0, 4], ["slot 3 points at slot 0, which is a frozen slot", "canonical"]),
        ([0, 1, 0, 2, 4], ["slot 3 points at slot 2, which is mapped to 0", "canonical"]),
    ],
)
def test_canonical_gradients_rejects_invalid_slots(slots, fragments):  # C5, C6
    pl = make_list()
    grads = good_grads(pl)
    raises_cleanly(pl, SlotError, fragments, lambda: pl.canonical_gradients(slots, grads))


def test_canonical_gradients_rejects_bad_gradients():  # C6
    pl = make_list()
    slots = pl.canonical_slot_indices()

    def with_grad(i, g):
        grads = good_grads(pl)
        grads[i] = g
        return grads

    cases = [
        (MissingGradientError, ["slot 3 has no gradient", "(2,)"], with_grad(3, None)),
        (ShapeError, ["slot 3", "(3,)", "expected (2,)"], with_grad(3, np.zeros(3, F32))),
        (ShapeError, ["slot 1", "(1,)", "expected (1, 1)"], with_grad(1, np.zeros(1, F32))),
        (DTypeError, ["slot 4", "float64", "expected float32"], with_grad(4, np.zeros((), float))),
        (DTypeError, ["slot 0", "list", "(2,)"], with_grad(0, [0.5, 0.5])),
        (DTypeError, ["slot 4", "float"], with_grad(4, 0.5)),
    ]
    for exc, fragments, grads in cases:
        raises_cleanly(pl, exc, fragments, lambda grads=grads: pl.canonical_gradients(slots, grads))
    grads = with_grad(2, None)  # a frozen slot needs no gradient
    assert pl.canonical_gradients(slots, grads)[2] is None


def test_canonical_gradients_rejects_a_mapping_of_node_ids():
    pl = make_list()
    grads = dict(enumerate(good_grads(pl)))
    raises_cleanly(
        pl,
        SlotError,
        ["one gradient per slot", "dict"],
        lambda: pl.canonical_gradients(pl.canonical_slot_indices(), grads),
    )


def test_canonical_gradient_checks_entry_and_shape():  # seed 001: canonicalGradient
    g = np.zeros(2, F32)
    sums = [g, None]
    assert ParamList.canonical_gradient((2,), sums, 0) is g
    with pytest.raises(MissingGradientError, match="slot 1 has no summed gradient"):
        ParamList.canonical_gradient((2,), sums, 1)
    with pytest.raises(ShapeError, match=r"slot 0 has shape \(2,\), expected \(3,\)"):
        ParamList.canonical_gradient((3,), sums, 0)
    for bad in (2, -1, None, 0.0):
        with pytest.raises(SlotError, match=r"outside \[0, 2\)"):
            ParamList.canonical_gradient((2,), sums, bad)


# -- updates --------------------------------------------------------------------------------


@pytest.mark.parametrize("lr", [-0.1, math.nan, math.inf, -math.inf, "fast", None])
def test_sgd_step_rejects_bad_learning_rates(lr):  # C6
    pl = make_list()
    raises_cleanly(
        pl, HyperparameterError, ["lr: expected", repr(lr)], lambda: pl.sgd_step(lr, good_grads(pl))
    )
    s = EagerSession()
    loss = s.use(pl[0]).sum()
    grads = s.backward(loss)
    raises_cleanly(pl, HyperparameterError, ["lr: expected"], lambda: s.sgd_step(lr, grads))


def test_paramlist_sgd_step_validates_every_slot_before_the_first_write():  # C6
    pl = make_list()
    grads = good_grads(pl)
    grads[4] = np.zeros(2, F32)  # the last slot is wrong: nothing may be written
    raises_cleanly(
        pl, ShapeError, ["slot 4", "(2,)", "expected ()"], lambda: pl.sgd_step(0.1, grads)
    )
    grads = good_grads(pl)
    grads[3] = None
    raises_cleanly(pl, MissingGradientError, ["slot 3"], lambda: pl.sgd_step(0.1, grads))


def test_set_values_checks_every_value_first():  # C6
    pl = make_list()
    good = [p.value + 1 for p in pl]
    bad_shape = [*good[:3], np.zeros(3, F32), good[4]]
    raises_cleanly(
        pl, ShapeError, ["set_values slot 3", "(2,)", "(3,)"], lambda: pl.set_values(bad_shape)
    )
    bad_dtype = [*good[:4], np.zeros((), np.float64)]
    raises_cleanly(
        pl,
        DTypeError,
        ["set_values slot 4", "float32", "float64"],
        lambda: pl.set_values(bad_dtype),
    )
    ragged = [*good[:1], [[1.0], [2.0, 3.0]], *good[2:]]
    raises_cleanly(pl, DTypeError, ["set_values slot 1", "(1, 1)"], lambda: pl.set_values(ragged))
    raises_cleanly(pl, SlotError, ["expected 5 values, got 4"], lambda: pl.set_values(good[:4]))
    pl.set_values(good)  # a tie is written at every slot; the last slot of p wins
    np.testing.assert_array_equal(pl[0].value, good[3])
    np.testing.assert_array_equal(pl[4].value, good[4])


def test_set_values_refuses_arrays_of_another_dtype_from_any_library():  # C6
    torch = pytest.importorskip("torch")
    pl = make_list()
    values = [p.value.copy() for p in pl]
    values[4] = torch.zeros((), dtype=torch.float64)
    raises_cleanly(pl, DTypeError, ["slot 4", "float32", "float64"], lambda: pl.set_values(values))
    values[4] = torch.zeros((), dtype=torch.float32)
    pl.set_values(values)
    assert pl[4].value == 0.0


def test_session_sgd_step_validates_every_group_before_the_first_write():  # C6
    pl = make_list()
    p, q, _, _, r = pl
    s = EagerSession()
    a, b, c = s.use(p), s.use(q), s.use(r)
    grads = dict(s.backward(a.sum() + b.sum() + c))
    cases = [
        (MissingGradientError, ["no gradient for leaf 2", "()"], {**grads, c.id: None}),
        (MissingGradientError, ["leaf 1"], {k: v for k, v in grads.items() if k != b.id}),
        (ShapeError, ["leaf 2", "(2,)", "expected ()"], {**grads, c.id: np.zeros(2, F32)}),
        (DTypeError, ["leaf 2", "float64", "float32"], {**grads, c.id: np.zeros((), float)}),
        (DTypeError, ["leaf 2", "list"], {**grads, c.id: [1.0]}),
    ]
    for exc, fragments, bad in cases:
        raises_cleanly(pl, exc, fragments, lambda bad=bad: s.sgd_step(0.1, bad))
    other = EagerSession()
    foreign = other.backward(other.use(p).sum())
    raises_cleanly(pl, TapeError, ["another session"], lambda: s.sgd_step(0.1, foreign))
    fresh = EagerSession()
    fresh.use(p)
    raises_cleanly(pl, MissingGradientError, ["no backward"], lambda: fresh.sgd_step(0.1))


def test_session_sgd_step_checks_storage_less_getters_before_writing():  # C6
    pl = make_list()

    class BadGetter:
        shape, dtype, requires_grad = (2,), np.dtype(F32), True

        def get(self):
            return self.value

        def set(self, value):
            raise AssertionError("must not be written")

    h = BadGetter()
    h.value = np.zeros(2, F32)
    s = EagerSession()
    s.use(pl[0])
    s.use(h)
    grads = {0: np.ones(2, F32), 1: np.ones(2, F32)}
    h.value = np.zeros(3, F32)  # the getter now disagrees with the declared shape
    raises_cleanly(pl, ShapeError, ["getter", "(3,)", "(2,)"], lambda: s.sgd_step(0.1, grads))


def test_grouping_rejects_a_storage_of_another_shape():  # reference case 6
    p = Param(np.zeros(2, F32))
    other = Param(np.zeros(1, F32))
    pl = ParamList([p, other])
    before = state(pl)
    with pytest.raises(ShapeError, match=r"leaf 40: its storage has shape \(1,\).*\(2,\)"):
        group_parameter_registrations({40: p, 10: p}, {40: other.storage, 10: p.storage})
    assert_unchanged(pl, before)


def test_dense_group_gradient_reports_leaf_and_shapes():
    s = EagerSession()
    p = Param(np.zeros(2, F32))
    s.use(p)
    s.use(p)
    (group,) = s.parameter_groups()
    with pytest.raises(MissingGradientError, match=r"group 0: no gradient for leaf 1"):
        tiegrad.dense_group_gradient(group, {0: np.zeros(2, F32)})
    with pytest.raises(MissingGradientError, match="leaf 1"):
        tiegrad.dense_group_gradient(group, [np.zeros(2, F32)])
    with pytest.raises(ShapeError, match=r"leaf 1 has shape \(3,\), expected \(2,\)"):
        tiegrad.dense_group_gradient(group, [np.zeros(2, F32), np.zeros(3, F32)])


class _NoAdd(np.ndarray):
    def __add__(self, other):
        raise AssertionError("a gradient was added before every leaf was validated")


def test_dense_group_gradient_checks_every_leaf_dtype_before_adding():  # C4, C6
    s = EagerSession()
    p = Param(np.zeros(2, F32))
    for _ in range(3):
        s.use(p)
    (group,) = s.parameter_groups()
    grads = [np.zeros(2, F32).view(_NoAdd), np.zeros(2, F32), np.zeros(2, np.float64)]
    with pytest.raises(
        DTypeError, match=r"group 0: gradient of leaf 2 has dtype float64, expected float32"
    ):
        tiegrad.dense_group_gradient(group, grads)


def test_sums_of_0d_gradients_are_0d_arrays():  # C4
    z = Param(np.float32(2.0))
    pl = ParamList([z, z.alias(), z.alias()])
    one = np.array(1.0, np.float32)
    sums = pl.canonical_gradients(pl.canonical_slot_indices(), [one, one * 2, one * 3])
    assert type(sums[0]) is np.ndarray and sums[0].shape == () and sums[0] == 6.0
    s = EagerSession()
    uses = [s.use(z) for _ in range(3)]
    (group,) = s.parameter_groups()
    total = tiegrad.params.dense_group_gradient(group, {u.id: one for u in uses})
    assert type(total) is np.ndarray and total == 3.0
