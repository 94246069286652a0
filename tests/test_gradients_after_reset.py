"""Gradients keep their recording's registrations: backward, reset, then step (C2, C4)."""

import numpy as np
import pytest

import tiegrad as tg
from tiegrad.optim import SGD


def _tied_loss(s, w):
    a, b = s.use(w), s.use(w)
    return (a * a).sum() + (3.0 * b).sum()


def test_step_after_reset_uses_the_recorded_groups_and_writes_in_place():
    w = tg.Param(np.array([1.0, 2.0], np.float32))
    opt = SGD(tg.ParamList([w]), lr=0.5)
    s = tg.EagerSession()
    grads = s.backward(_tied_loss(s, w))
    s.reset()  # unpins the storage: the update may write in place
    before = w.storage.host
    (group,) = grads.parameter_groups()  # C4: both uses, one group, after the reset
    assert group.leaves == (0, 1)
    opt.step(grads)
    np.testing.assert_allclose(w.value, [1.0 - 0.5 * 5.0, 2.0 - 0.5 * 7.0])
    assert w.storage.host is before  # in place: no live tape held the array


def test_step_before_reset_copies_and_keeps_the_snapshot():
    w = tg.Param(np.array([1.0, 2.0], np.float32))
    opt = SGD(tg.ParamList([w]), lr=0.5)
    s = tg.EagerSession()
    a = s.use(w)
    grads = s.backward((a * a).sum(), retain_graph=True)
    opt.step(grads)
    np.testing.assert_array_equal(a.value, [1.0, 2.0])  # C2: the leaf keeps its snapshot
    np.testing.assert_allclose(w.value, [0.0, 0.0])


def test_refs_of_an_older_recording_do_not_index_newer_gradients():
    s = tg.EagerSession()
    x = s.leaf([1.0, 2.0])
    old = s.backward((x * x).sum())
    s.reset()
    y = s.leaf([3.0, 4.0])
    new = s.backward((y * y).sum())
    np.testing.assert_allclose(old[x], [2.0, 4.0])  # its own recording: still readable
    with pytest.raises(tg.TapeError):
        new[x]
    assert x not in new
