"""Gradient clipping over canonical gradients: each storage counted once (C4, C5).

The trajectories against torch's ``clip_grad_norm_`` / ``clip_grad_value_`` are in
``test_optim_torch.py``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import tiegrad.ops as T
from tiegrad import DTypeError, EagerSession, HyperparameterError, NonFiniteError, Param, ParamList
from tiegrad.optim import SGD, clip_grad_norm, clip_grad_value, norms, total_norm


def test_a_tied_storage_counts_once_in_the_norm():  # C4, C5
    p, q = Param(np.zeros(2)), Param(np.zeros(1))
    opt = SGD(ParamList([p, q, p]), lr=1.0)
    s = EagerSession()
    loss = T.sum(s.use(p) * 1.5) + T.sum(s.use(q) * 2.0) + T.sum(s.use(p) * 1.5)
    grads = opt.canonical_gradients(s.backward(loss))
    assert grads[2] is None
    norm = total_norm(grads)
    assert norm == pytest.approx(math.sqrt(2 * 3.0**2 + 2.0**2))  # p's sum once, not twice
    clipped = list(grads)
    reported = clip_grad_norm(clipped, max_norm=1.0)
    assert reported == norm
    assert total_norm(clipped) == pytest.approx(1.0, rel=1e-5)
    opt.step(clipped)
    np.testing.assert_allclose(p.value, -3.0 / (norm + 1e-6) * np.ones(2))


def test_inputs_are_never_written_and_unclipped_entries_pass_through():
    a, b = np.array([3.0, 4.0]), np.array([0.0])
    same = [a, None, b]
    norm = clip_grad_norm(same, max_norm=10.0)
    assert norm == 5.0 and same[0] is a and same[2] is b and same[1] is None
    clipped = [a, None, b]
    assert clip_grad_norm(clipped, max_norm=1.0) == 5.0
    assert clipped[0] is not a and a.tolist() == [3.0, 4.0]
    np.testing.assert_allclose(clipped[0], [0.6, 0.8], rtol=1e-6)
    valued = [a, None, b]
    assert clip_grad_value(valued, 3.5) is None
    assert valued[0].tolist() == [3.0, 3.5] and a.tolist() == [3.0, 4.0]
    with pytest.raises(DTypeError, match="expected a list"):
        clip_grad_norm((a, None, b), 1.0)


def test_norm_types_and_dtypes():
    grads = [np.array([3.0, -4.0], np.float32), np.array([[-12.0]], np.float32)]
    assert total_norm(grads, math.inf) == 12.0
    assert total_norm(grads, 1.0) == pytest.approx(19.0)
    assert total_norm(grads) == pytest.approx(13.0)
    clip_grad_norm(grads, 1.0)
    assert all(g.dtype == np.float32 for g in grads)
    assert total_norm([]) == 0.0


def test_nonfinite_gradients():
    nan = np.array([1.0, math.nan])
    grads = [nan]
    norm = clip_grad_norm(grads, 1.0)
    assert math.isnan(norm) and grads[0] is nan
    with pytest.raises(NonFiniteError, match="total 2.0-norm"):
        clip_grad_norm([np.array([math.inf])], 1.0, error_if_nonfinite=True)


def test_zero_dimensional_gradients_stay_arrays_and_scalars_are_accepted():
    # Scaling or clamping a 0-d array in NumPy gives a scalar; the list gets 0-d arrays.
    for first in (np.array(3.0, np.float32), np.float32(3.0)):
        grads = [first, np.array([4.0, 0.0], np.float32)]
        assert total_norm(grads) == 5.0
        assert clip_grad_norm(grads, 1.0) == 5.0
        assert isinstance(grads[0], np.ndarray) and grads[0].shape == ()
        assert grads[0].dtype == np.float32 and float(grads[0]) == pytest.approx(0.6)
        assert total_norm(grads) == pytest.approx(1.0, rel=1e-5)
        clip_grad_value(grads, 0.5)
        assert isinstance(grads[0], np.ndarray) and grads[0].shape == ()
        assert grads[0].dtype == np.float32 and float(grads[0]) == 0.5
    valued = [np.float64(-2.0)]
    clip_grad_value(valued, 1.0)
    assert isinstance(valued[0], np.ndarray) and valued[0].dtype == np.float64
    assert valued[0].shape == () and float(valued[0]) == -1.0


def test_norms_that_overflow_are_infinite_as_torchs_and_finiteness_is_by_value():
    huge = np.array([1e200, 1.0, 2.0, 3.0])  # finite; its squares overflow float64
    assert norms.all_finite(huge) and not norms.all_finite(np.array([1e200, math.nan]))
    assert not norms.all_finite(np.array([math.inf], np.float32))
    for p in (2.0, 3.0):
        assert total_norm([huge], p) == math.inf  # torch's clip_grad_norm_ reports inf
    assert total_norm([huge], math.inf) == 1e200
    grads = [huge]
    assert clip_grad_norm(grads, 1.0) == math.inf and grads[0] is huge
    with pytest.raises(NonFiniteError, match="total 2.0-norm"):
        clip_grad_norm([huge], 1.0, error_if_nonfinite=True)
    # A float32 sum that overflows is redone in float64: the norm stays exact.
    assert total_norm([np.array([1e30, 0.0], np.float32)]) == pytest.approx(1e30, rel=1e-6)


@pytest.mark.parametrize(
    "call, error, fragment",
    [
        (lambda: clip_grad_norm([np.ones(2)], -1.0), HyperparameterError, "max_norm"),
        (lambda: clip_grad_norm([np.ones(2)], math.nan), HyperparameterError, "max_norm"),
        (lambda: clip_grad_norm([np.ones(2)], 1.0, 0.0), HyperparameterError, "norm_type"),
        (lambda: clip_grad_norm([np.ones(2)], 1.0, "two"), HyperparameterError, "norm_type"),
        (lambda: clip_grad_norm(np.ones(2), 1.0), DTypeError, "per-slot list"),
        (
            lambda: clip_grad_norm([np.ones(2, int)], 1.0),
            DTypeError,
            "slot 0 holds an ndarray of dtype int64, expected a floating ndarray",
        ),
        (
            lambda: total_norm([None, np.int64(3)]),
            DTypeError,
            "slot 1 holds a NumPy scalar of dtype int64, expected",
        ),
        (lambda: clip_grad_value([[1.0]], 1.0), DTypeError, "slot 0 holds an object of type list"),
        (lambda: clip_grad_value([np.ones(2)], -0.5), HyperparameterError, "clip_value"),
    ],
)
def test_bad_arguments(call, error, fragment):
    with pytest.raises(error, match=fragment):
        call()
