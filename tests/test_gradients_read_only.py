"""Gradients handed to the user are read-only, so two leaves never share a writable array.

``a + b`` hands one cotangent to both operands and a view op hands its parent a view, so
returned gradients may share memory (issue 16). ``backward`` returns read-only views on
the host; a group of one still passes its gradient through as the same object (C4),
and a summed group gradient is a new, independent array.
"""

from __future__ import annotations

import numpy as np
import pytest

from tiegrad import EagerSession, Param, dense_group_gradient


def test_the_gradients_of_both_operands_of_add_are_read_only():
    s = EagerSession()
    a, b = s.leaf(np.ones(3)), s.leaf(np.ones(3))
    grads = s.backward(((a + b) * 2.0).sum())  # add hands one array to both operands
    for ref in (a, b):
        assert not grads[ref].flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            grads[ref] *= 2.0
    np.testing.assert_array_equal(grads[b], np.full(3, 2.0))


def test_a_retained_node_and_the_leaf_viewing_its_gradient_are_read_only():
    s = EagerSession()
    x = s.leaf(np.arange(6.0))
    y = x.reshape((2, 3))
    grads = s.backward((y * 2.0).sum(), retain=[x, y])
    assert not grads[x].flags.writeable and not grads[y].flags.writeable


def test_a_user_seed_is_not_made_read_only():
    s = EagerSession()
    out = s.leaf(np.ones(2)) * 3.0
    seed = np.ones(2)
    grads = s.backward(out, seed=seed, retain=[out])
    assert seed.flags.writeable and not grads[out].flags.writeable


def test_group_gradients_pass_through_or_are_independent():  # C4
    p, q = Param(np.ones(2)), Param(np.ones(2))
    s = EagerSession()
    grads = s.backward((s.use(p) + s.use(q) + s.use(q)).sum())
    gp, gq = s.parameter_groups()
    assert dense_group_gradient(gp, grads) is grads[gp.id]  # the same read-only object
    total = dense_group_gradient(gq, grads)  # a new array: writing it changes no leaf
    total *= 10.0
    np.testing.assert_array_equal(grads[gq.leaves[0]], np.ones(2))
    np.testing.assert_array_equal(grads[gp.id], np.ones(2))


def test_on_a_device_the_operands_of_add_get_distinct_tensors():
    pytest.importorskip("torch")
    s = EagerSession(device="torch:cpu")
    a, b = s.leaf(np.ones(3)), s.leaf(np.ones(3))
    grads = s.backward(((a + b) * 2.0).sum())
    assert grads[a] is not grads[b]
    grads[a].mul_(10.0)  # a device tensor cannot be read-only: it is independent
    assert grads[b].tolist() == [2.0, 2.0, 2.0]
