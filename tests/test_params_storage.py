"""Parameters as storage: identity (C1), snapshots (C2), fresh reads (C3), copy-on-write.

Pins the sentences of seed ``000`` (shared parameter gradients) and the storage side of
seed ``001`` (trainer parameters) that are not about validation or random layouts.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

import tiegrad
from tiegrad import EagerSession, Param, ParameterStorage, ParamList
from tiegrad.errors import DTypeError, ShapeError


class Handle:
    """A storage-less registration: get/set/shape/dtype/requires_grad, no ``storage``."""

    def __init__(self, value, requires_grad=True):
        self.v = np.array(value, dtype=np.float32)
        self.requires_grad = requires_grad
        self.sets = 0

    shape = property(lambda self: self.v.shape)
    dtype = property(lambda self: self.v.dtype)

    def get(self):
        return self.v.copy()

    def set(self, value):
        self.v = np.array(value, dtype=np.float32)
        self.sets += 1


# -- C1: storage identity -----------------------------------------------------------------


def test_param_copies_value_and_exposes_its_fields():  # C1
    src = np.arange(6, dtype=np.float32).reshape(2, 3)
    p = Param(src, requires_grad=False, name="w")
    assert isinstance(p.storage, ParameterStorage)
    assert (p.shape, p.dtype, p.requires_grad, p.name) == ((2, 3), np.float32, False, "w")
    assert not np.shares_memory(p.value, src)
    src[0, 0] = 100.0
    assert p.value[0, 0] == 0.0
    with pytest.raises(ValueError):
        p.value[0, 0] = 1.0  # the host value is read-only


def test_a_storage_built_from_an_array_copies_it():  # C1: no hidden alias of a NumPy array
    src = np.arange(4, dtype=np.float32)
    storage = ParameterStorage(src)
    src[0] = 100.0
    assert storage.host[0] == 0.0 and not np.shares_memory(storage.host, src)
    handle = Param.of_storage(storage)
    handle.set_value(np.full(4, 7.0, np.float32))
    assert src[1] == 1.0


def test_python_numbers_become_float32_and_integer_arrays_are_refused():
    assert Param(1.5).dtype == np.float32
    assert Param([[1, 2]]).dtype == np.float32
    assert Param(np.ones(2, np.float64)).dtype == np.float64
    with pytest.raises(DTypeError, match="int64"):
        Param(np.arange(3, dtype=np.int64), name="ids")


def test_equal_contents_never_alias():  # C1
    a, b = Param(np.ones(3)), Param(np.ones(3))
    pl = ParamList([a, b, a])
    assert a.storage is not b.storage
    assert pl.canonical_slot_indices() == [0, 1, 0]
    assert tiegrad.params.canonical_indices([a.storage, b.storage]) == [0, 1]


def test_numpy_views_never_alias():  # C1
    base = np.zeros((4, 2), dtype=np.float32)
    p, q = Param(base[:2]), Param(base[:2])
    r = Param(base.T)
    assert len({id(p.storage), id(q.storage), id(r.storage)}) == 3
    assert ParamList([p, q, r]).canonical_slot_indices() == [0, 1, 2]
    p.set_value(np.ones((2, 2), np.float32))
    assert not q.value.any() and not base.any()


def test_alias_shares_storage_and_keeps_or_overrides_flags():  # C1
    p = Param(np.zeros(2), name="p")
    same = p.alias()
    frozen = p.alias(requires_grad=False, name="p_frozen")
    assert same.storage is p.storage is frozen.storage
    assert (same.requires_grad, same.name) == (True, "p")
    assert (frozen.requires_grad, frozen.name) == (False, "p_frozen")
    frozen.set_value(np.full(2, 3.0))
    assert p.value.tolist() == [3.0, 3.0]
    assert ParamList([p, same, frozen]).canonical_slot_indices() == [0, 0, None]


def test_parameter_of_storage_is_a_trainable_view_over_the_cells():
    p = Param(np.ones(2), requires_grad=False)
    view = tiegrad.parameter_of_storage(p.storage)
    assert view.storage is p.storage and view.requires_grad
    view.set_value(np.zeros(2))
    assert not p.value.any()


def test_storage_identity_reads_no_tensor_data():  # C1: grouping never touches values
    class Opaque(ParameterStorage):
        __slots__ = ()

        @property
        def host(self):
            raise AssertionError("grouping read the host value")

        def current_host_value(self):
            raise AssertionError("grouping read the current value")

    st = Opaque(np.zeros(2, np.float32))
    other = Opaque(np.zeros(2, np.float32))
    p, q = Param.of_storage(st), Param.of_storage(other)
    assert ParamList([p, q, p.alias(requires_grad=False), p]).canonical_slot_indices() == [
        0,
        1,
        None,
        0,
    ]
    groups = tiegrad.params.group_parameter_registrations(
        {3: p, 1: q, 2: p}, {3: st, 1: other, 2: st}
    )
    assert [(g.id, g.leaves, g.storage) for g in groups] == [(1, (1,), other), (2, (2, 3), st)]


def test_storage_less_registrations_are_never_merged_even_with_themselves():  # C1
    s = EagerSession()
    h = Handle([1.0, 2.0])
    p = Param([0.0, 0.0])
    refs = [s.use(h), s.use(p), s.use(h), s.use(p)]
    groups = s.parameter_groups()
    assert [(g.id, g.leaves) for g in groups] == [(0, (0,)), (1, (1, 3)), (2, (2,))]
    assert groups[0].parameter is h and groups[0].storage is None
    assert groups[2].parameter is h and groups[2].storage is None
    loss = (refs[0] * refs[1]).sum() + (refs[2] * refs[3]).sum()
    grads = s.backward(loss)
    s.sgd_step(0.5, grads)
    assert h.sets == 2  # two separate groups, two updates, both applied
    np.testing.assert_array_equal(h.v, [1.0, 2.0])  # p was 0, so its gradients were 0
    np.testing.assert_array_equal(p.value, [-1.0, -2.0])  # 0 - 0.5 * (h + h)


def test_storage_less_group_reads_through_get():  # seed 000: AnyParam.get
    s = EagerSession()
    h = Handle([4.0])
    s.use(h)
    (group,) = s.parameter_groups()
    np.testing.assert_array_equal(group.current_host_value(), [4.0])
    h.v = np.array([7.0], np.float32)
    np.testing.assert_array_equal(group.current_host_value(), [7.0])


# -- C2 / C3: snapshots and fresh reads ------------------------------------------------------


def test_each_leaf_keeps_its_snapshot_and_gradients_follow_it():  # C2
    s = EagerSession()
    p = Param(np.array([1.0, 2.0], np.float32))
    x0 = s.use(p)
    p.set_value(np.array([5.0, 7.0], np.float32))
    x1 = s.use(p)
    loss = (x0 * x0).sum() + (x1 * x1 * x1).sum()
    grads = s.backward(loss, retain_graph=True)
    np.testing.assert_array_equal(x0.value, [1.0, 2.0])
    np.testing.assert_array_equal(x1.value, [5.0, 7.0])
    np.testing.assert_array_equal(grads[x0], [2.0, 4.0])  # 2 * snapshot 0
    np.testing.assert_array_equal(grads[x1], [75.0, 147.0])  # 3 * snapshot 1 ** 2
    (group,) = s.parameter_groups()
    assert group.leaves == (x0.id, x1.id)
    s.sgd_step(0.01, grads)  # C3: starts from [5, 7], the current value
    np.testing.assert_allclose(p.value, [5.0 - 0.77, 7.0 - 1.51], rtol=1e-6)
    np.testing.assert_array_equal(x0.value, [1.0, 2.0])
    np.testing.assert_array_equal(x1.value, [5.0, 7.0])


def test_update_starts_from_current_value_not_from_any_leaf():  # C3
    s = EagerSession()
    p = Param(np.float32(1.0))
    leaf = s.use(p)
    grads = s.backward(leaf * 2.0)
    p.set_value(np.float32(10.0))  # after the last use
    s.sgd_step(1.0, grads)
    assert p.value == np.float32(8.0)
    assert leaf.value == np.float32(1.0)


def test_paramlist_update_starts_from_current_value():  # C3
    p = Param(np.float32(1.0))
    pl = ParamList([p, p])
    p.set_value(np.float32(4.0))
    pl.sgd_step(0.5, [np.float32(1.0) * np.ones((), np.float32)] * 2)
    assert p.value == np.float32(3.0)


def test_use_records_a_new_leaf_on_every_call_and_registers_frozen_uses():  # C2, C4
    s = EagerSession()
    p = Param(np.zeros(2))
    frozen = p.alias(requires_grad=False)
    a, b, c = s.use(p), s.use(p), s.use(frozen)
    assert len({a.id, b.id, c.id}) == 3
    assert s.parameter_registrations() == {a.id: p, b.id: p, c.id: frozen}
    assert s.storage_registrations() == {a.id: p.storage, b.id: p.storage, c.id: p.storage}
    assert [g.leaves for g in s.parameter_groups()] == [(a.id, b.id)]  # frozen use not grouped
    assert not c.requires_grad


def test_copy_on_write_while_a_tape_holds_the_array():  # C2, docs/design.md: snapshots are free
    s = EagerSession()
    p = Param(np.array([1.0, 2.0], np.float32))
    pl = ParamList([p])
    leaf = s.use(p)
    held = p.value
    assert leaf.value is held  # the snapshot is the host array itself, no copy
    pl.sgd_step(1.0, [np.ones(2, np.float32)])
    assert p.value is not held  # copied: the live tape holds the old array
    np.testing.assert_array_equal(leaf.value, [1.0, 2.0])
    np.testing.assert_array_equal(p.value, [0.0, 1.0])
    after = p.value
    pl.sgd_step(1.0, [np.ones(2, np.float32)])  # the new array is not on any tape
    assert p.value is after
    s.reset()
    s.use(p)
    s.reset()
    current = p.value
    pl.sgd_step(1.0, [np.ones(2, np.float32)])  # after reset: in place, no copy
    assert p.value is current
    np.testing.assert_array_equal(current, [-2.0, -1.0])
    assert not current.flags.writeable


def test_a_committed_view_of_read_only_memory_is_updated_in_a_copy():  # C2, C7
    base = np.ones(4, np.float32)
    base.flags.writeable = False
    p = Param(np.zeros(4, np.float32))
    p.storage.commit_host(base[:])  # a view: its memory cannot be made writable
    ParamList([p]).sgd_step(1.0, [np.ones(4, np.float32)])
    np.testing.assert_array_equal(p.value, np.zeros(4, np.float32))
    np.testing.assert_array_equal(base, np.ones(4, np.float32))  # never written
    assert not p.value.flags.writeable


def test_another_sessions_tape_still_pins_the_array():  # C2
    s1, s2 = EagerSession(), EagerSession()
    p = Param(np.float32(1.0))
    old = s1.use(p)
    s2.use(p)
    s2.reset()
    ParamList([p]).sgd_step(1.0, [np.ones((), np.float32)])
    assert old.value == np.float32(1.0) and p.value == np.float32(0.0)
    del old
    s1 = None
    gc.collect()
    held = p.value
    ParamList([p]).sgd_step(1.0, [np.ones((), np.float32)])  # no live tape holds it now
    assert p.value is held


def test_repeated_uses_across_resets_and_sessions_keep_the_pin_list_small():
    p = Param(np.zeros(2))
    s1, s2 = EagerSession(), EagerSession()
    for _ in range(50):
        s1.use(p)
        s2.use(p)
        s1.use(p)
        s1.reset()
        s2.reset()
    assert len(p.storage._pins) <= 2


def test_set_value_releases_nothing_recorded_and_checks_first():  # C2, C6
    s = EagerSession()
    p = Param(np.zeros(3, np.float32), name="w")
    leaf = s.use(p)
    before = p.value
    with pytest.raises(ShapeError, match=r"'w'.*\(3,\).*\(2,\)"):
        p.set_value(np.zeros(2, np.float32))
    with pytest.raises(DTypeError, match=r"'w'.*float32.*float64"):
        p.set_value(np.zeros(3, np.float64))
    assert p.value is before
    p.set_value([1.0, 2.0, 3.0])
    assert p.value is not before and not leaf.value.any()


# -- describe ------------------------------------------------------------------------------


def test_describe_reports_ties_and_the_mixed_frozen_trainable_case():
    p = Param(np.zeros((2, 3)), name="emb")
    q = Param(np.zeros(3), name="bias")
    pl = ParamList([p, q, p.alias(requires_grad=False, name="emb_frozen"), p])
    text = pl.describe()
    lines = text.splitlines()
    assert "canonical" in lines[0]
    assert "emb_frozen" in lines[3] and "None" in lines[3]
    assert "mixed" in lines[1] and "mixed" in lines[3] and "mixed" not in lines[2]
    assert "shared by slots [0, 2, 3]" in lines[1]
    assert lines[-1] == "4 slots, 2 storages, 2 optimizer slots"
    untied = ParamList([Param(np.zeros(2)), Param(np.zeros(2))]).describe()
    assert "mixed" not in untied and "shared" not in untied


def test_mixed_frozen_and_trainable_slot_updates_the_storage_once():  # C5
    p = Param(np.array([1.0], np.float32))
    pl = ParamList([p.alias(requires_grad=False), p])
    assert pl.optimizer_storage() == [None, p.storage]
    assert pl.canonical_slot_indices() == [None, 1]
    pl.sgd_step(1.0, [np.full(1, 100.0, np.float32), np.full(1, 0.5, np.float32)])
    np.testing.assert_array_equal(p.value, [0.5])  # the frozen slot's gradient is ignored


def test_storage_hash_and_equality_are_identity():  # C1: the alias map keys on storages
    assert ParameterStorage.__eq__ is object.__eq__
    assert ParameterStorage.__hash__ is object.__hash__
    a, b = Param(np.ones(2)).storage, Param(np.ones(2)).storage
    assert a != b and len({a, b, a}) == 2


def test_alias_map_follows_later_changes_of_the_trainability_mask():  # C5: no cache
    p, q = Param(np.zeros(2)), Param(np.zeros(2))
    a = p.alias()
    pl = ParamList([p, q, a])
    assert pl.canonical_slot_indices() == [0, 1, 0]
    p.requires_grad = False  # freeze the first handle: slot 2 becomes the representative
    assert pl.canonical_slot_indices() == [None, 1, 2]
    assert pl.optimizer_storage() == [None, q.storage, p.storage]
    p.requires_grad = True
    assert pl.canonical_slot_indices() == [0, 1, 0]


def test_values_read_the_host_in_slot_order():  # C7 host side
    p, q = Param(np.zeros(2)), Param(np.ones(3))
    pl = ParamList([q, p, q])
    assert [v is s.host for v, s in zip(pl.values(), pl.storages())] == [True] * 3
    assert [v.shape for v in pl.values_synced()] == [(3,), (2,), (3,)]
    assert pl.shapes == ((3,), (2,), (3,)) and pl.dtypes == (np.float64,) * 3


def test_use_without_gradients_is_registered_but_not_grouped():  # issue 16 over REFERENCE 4
    s = EagerSession()
    p = Param(np.zeros(2))
    with s.no_grad():
        leaf = s.use(p)
    assert not leaf.requires_grad
    assert s.parameter_registrations() == {leaf.id: p}
    assert s.parameter_groups() == []
