"""Device group gradients (C8, reference case 30), proven with the live-temporary counter."""

from __future__ import annotations

import gc
import os
import weakref

import numpy as np
import pytest

import tiegrad
from tiegrad import EagerSession, Param, ParameterGroup, with_device_group_gradient
from tiegrad.backend import device_backend
from tiegrad.backend.tracker import TemporaryTracker

torch = pytest.importorskip("torch")

DEVICE = os.environ.get("TIEGRAD_TEST_DEVICE", "torch:cpu")


def _grads(uses: int):
    """A device session where one storage is used ``uses`` times with weights 1, 2, 3..."""
    p = Param(np.arange(4, dtype=np.float32))
    s = EagerSession(device=DEVICE)
    loss = None
    for k in range(uses):
        term = (s.use(p) ** 2 * float(k + 1)).sum()
        loss = term if loss is None else loss + term
    grads = s.backward(loss)
    (group,) = s.parameter_groups()
    return s, group, grads


def _snapshot(grads):
    return {i: (g, g.detach().clone()) for i, g in grads.items()}


def _unchanged(grads, snap) -> bool:
    return set(grads) == set(snap) and all(
        grads[i] is t and torch.equal(t, copy) for i, (t, copy) in snap.items()
    )


def test_group_of_one_lends_the_same_tensor():  # C4, C8
    s, group, grads = _grads(1)
    tracker = s.backend.temporaries
    start = tracker.live
    seen = []
    out = with_device_group_gradient(group, grads, lambda g: seen.append(g) or "done")
    assert out == "done"
    assert seen[0] is grads[group.id]
    assert tracker.live == start


def test_group_of_several_sums_left_to_right_into_one_released_temporary():  # C8
    s, group, grads = _grads(3)
    assert len(group.leaves) == 3
    tracker = s.backend.temporaries
    start = tracker.live
    tracker.reset_peak()
    snap = _snapshot(grads)
    refs = []

    def action(g):
        assert tracker.live == start + 1 and tracker.owns(g)
        refs.append(weakref.ref(g))
        return g.detach().clone()

    total = with_device_group_gradient(group, grads, action)
    expected = grads[group.leaves[0]] + grads[group.leaves[1]]
    for leaf in group.leaves[2:]:
        expected = expected + grads[leaf]
    assert torch.equal(total, expected)  # the same additions in the same order
    assert tracker.live == start and tracker.peak == start + 1
    gc.collect()
    assert refs[0]() is None  # the temporary is gone once released
    assert _unchanged(grads, snap)  # the input map is borrowed, never released


def test_temporary_is_released_when_the_action_raises():  # C8
    s, group, grads = _grads(2)
    tracker = s.backend.temporaries
    start = tracker.live
    snap = _snapshot(grads)

    def action(g):
        assert tracker.live == start + 1
        raise RuntimeError("optimizer failed")

    with pytest.raises(RuntimeError, match="optimizer failed"):
        with_device_group_gradient(group, grads, action)
    assert tracker.live == start
    assert _unchanged(grads, snap)


def test_case_30_missing_later_leaf_raises_and_releases_everything():  # C6, C8
    s, group, grads = _grads(2)
    tracker = s.backend.temporaries
    start, total_before = tracker.live, tracker.total
    three = ParameterGroup(group.id, group.parameter, group.leaves[:2] + (10_000,), group.storage)
    snap = _snapshot(grads)
    calls = []
    with pytest.raises(tiegrad.MissingGradientError, match="no gradient for leaf 10000"):
        with_device_group_gradient(three, grads, calls.append)
    assert calls == [] and tracker.live == start and tracker.total == total_before
    assert _unchanged(grads, snap)


def test_host_gradients_are_refused():  # C7, C8
    s, group, grads = _grads(2)
    host = {i: g.cpu().numpy() for i, g in grads.items()}
    with pytest.raises(tiegrad.DeviceError, match="is a host array"):
        with_device_group_gradient(group, host, lambda g: g)
    assert s.backend.temporaries.live == 0


def test_tracker_refuses_to_release_a_borrowed_tensor():  # C8
    tracker = TemporaryTracker()
    t = torch.zeros(1)
    with pytest.raises(tiegrad.TiegradError, match="not an owned temporary"):
        tracker.release(t)
    tracker.own(t)
    with pytest.raises(tiegrad.TiegradError, match="already owned"):
        tracker.own(t)
    tracker.release(t)
    assert (tracker.live, tracker.peak, tracker.total) == (0, 1, 1)


def test_device_sgd_step_leaves_no_live_temporary():  # C8
    s, group, grads = _grads(3)
    tracker = device_backend(DEVICE).temporaries
    start = tracker.live
    total_before = tracker.total
    s.sgd_step(0.01)
    assert tracker.live == start and tracker.total == total_before + 1
