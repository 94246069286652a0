"""Inputs at the edges of what the ops take: numbers that over- or underflow, axes of no
element, data that is not numbers, NumPy and ``Fraction`` arguments, and seeds that the
caller writes after ``backward`` (C6: a refused input records nothing)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

import tiegrad.ops as T
from tiegrad import DTypeError, EagerSession, HyperparameterError, ShapeError, TiegradError, _numba
from tiegrad.nn import LayerNorm, Linear

torch = pytest.importorskip("torch")


def raises_and_records_nothing(s, exc, match, fn):
    n = len(s)
    with pytest.raises(exc, match=match) as info:
        fn()
    assert isinstance(info.value, TiegradError)
    assert len(s) == n, f"a failing call recorded {len(s) - n} node(s)"


@pytest.fixture(params=["numba", "numpy"])
def route(request, monkeypatch):
    monkeypatch.setattr(_numba, "ENABLED", request.param == "numba" and _numba.ENABLED)


# -- division --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("c", [3.0, 7.0, 0.1, 1e-40, -1e-310])
def test_division_by_a_number_gives_pytorchs_values_and_gradient(dtype, c):
    x = np.array([0.0, 1e-38, -2.5, 1.0, 3e38], dtype)
    s = EagerSession()
    xr = s.leaf(x)
    with np.errstate(all="ignore"):
        y = T.div(xr, c)
        g = s.backward(y, np.full(5, 0.75, dtype))[xr]
    tx = torch.tensor(x, requires_grad=True)
    (tx / c).backward(torch.full((5,), 0.75, dtype=tx.dtype))
    np.testing.assert_array_equal(y.value, (tx / c).detach().numpy())
    np.testing.assert_array_equal(g, tx.grad.numpy())


def test_the_gradient_of_a_tiny_divisor_does_not_overflow_first():
    a, b = np.array([0.0, 1e-45], np.float32), np.array([1e-45, 1e-40], np.float32)
    s = EagerSession()
    ar, br = s.leaf(a), s.leaf(b)
    with np.errstate(over="ignore"):  # a's cotangent 1 / 1e-45 is inf, as in PyTorch
        grads = s.backward(T.div(ar, br).sum())
    ta, tb = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    (ta / tb).sum().backward()
    np.testing.assert_array_equal(grads[br], tb.grad.numpy())  # [-0, -1.4e35], no NaN or inf


# -- axes of no element ----------------------------------------------------------------------
@pytest.mark.parametrize("op", [T.softmax, T.log_softmax])
def test_softmax_over_an_axis_of_no_element_is_empty(op):
    s = EagerSession()
    x = s.leaf(np.ones((3, 0), np.float32))
    y = op(x, axis=-1)
    assert y.value.shape == (3, 0) and y.value.dtype == np.float32
    assert s.backward(y.sum())[x].shape == (3, 0)


@pytest.mark.usefixtures("route")
def test_attention_over_no_key_gives_zeros_and_no_position_is_empty():
    s = EagerSession()
    q = s.leaf(np.ones((2, 3, 4, 5), np.float32))
    k, v = s.leaf(np.ones((2, 3, 0, 5), np.float32)), s.leaf(np.ones((2, 3, 0, 6), np.float32))
    y = T.scaled_dot_product_attention(q, k, v)
    np.testing.assert_array_equal(y.value, np.zeros((2, 3, 4, 6), np.float32))
    grads = s.backward(y.sum())
    assert grads[q].shape == (2, 3, 4, 5) and grads[k].shape == (2, 3, 0, 5)
    s = EagerSession()
    qkv = s.leaf(np.ones((2, 0, 12), np.float32))
    y = T.self_attention(qkv, 2, causal=True)
    assert y.value.shape == (2, 0, 4) and s.backward(y.sum())[qkv].shape == (2, 0, 12)


def test_attention_with_features_of_no_element_averages_the_values_like_pytorch():
    v = np.arange(2 * 5 * 6, dtype=np.float32).reshape(2, 5, 6)
    s = EagerSession()
    q, k = s.leaf(np.ones((2, 4, 0), np.float32)), s.leaf(np.ones((2, 5, 0), np.float32))
    y = T.scaled_dot_product_attention(q, k, s.leaf(v))
    want = torch.nn.functional.scaled_dot_product_attention(
        torch.ones(2, 4, 0), torch.ones(2, 5, 0), torch.from_numpy(v)
    )
    np.testing.assert_allclose(y.value, want.numpy(), rtol=1e-6)


def test_an_embedding_of_no_feature_has_a_gradient_of_no_feature():
    s = EagerSession()
    w = s.leaf(np.ones((5, 0), np.float32))
    y = T.embedding(w, np.array([1, 2, 2]))
    assert y.value.shape == (3, 0) and s.backward(y.sum())[w].shape == (5, 0)


# -- data that is not numbers ----------------------------------------------------------------
@pytest.mark.parametrize(
    "bad",
    [
        np.array(["a", "b", "c"]),
        np.array([None, 1, 2], dtype=object),
        np.array([1 + 2j, 1, 1]),
        [[1.0], [2.0, 3.0]],
        1j,
    ],
    ids=["str", "object", "complex", "ragged", "complex-number"],
)
def test_operands_that_are_not_real_numbers_are_refused_before_recording(bad):
    s = EagerSession()
    x = s.leaf(np.ones(3))
    for fn in (
        lambda: T.add(x, bad),
        lambda: T.mul(bad, x),
        lambda: T.where(np.array([True, False, True]), x, bad),
        lambda: T.concat([x, bad], 0),
    ):
        raises_and_records_nothing(s, DTypeError, "expected", fn)


def test_a_layer_checks_its_input_shape_before_recording():
    s = EagerSession()
    for layer in (Linear(8, 2), LayerNorm(8)):
        raises_and_records_nothing(
            s, ShapeError, r"input has shape \(3, 5\)", lambda f=layer: f(s, np.ones((3, 5)))
        )


def test_a_seed_written_after_backward_leaves_the_gradients_alone():
    s = EagerSession()
    x = s.leaf(np.ones((2, 3)))
    seed = np.ones(6)
    grads = s.backward(x.reshape((6,)), seed)
    seed[...] = 5.0
    np.testing.assert_array_equal(grads[x], np.ones((2, 3)))


# -- arguments -------------------------------------------------------------------------------
def test_an_integer_array_to_a_negative_integer_power_is_a_dtype_error():
    s = EagerSession()
    ints = s.constant(np.arange(1, 4))
    raises_and_records_nothing(s, DTypeError, "negative integer power", lambda: T.pow(ints, -1))
    assert T.pow(ints, -1.0).value.tolist() == [1.0, 0.5, 1 / 3]


@pytest.mark.parametrize("axis", [[0, 1], None, True, 0.5])
def test_softmax_takes_one_integer_axis(axis):
    s = EagerSession()
    x = s.leaf(np.ones((2, 3)))
    for op in (T.softmax, T.log_softmax):
        raises_and_records_nothing(
            s, ShapeError, "axis must be one integer", lambda f=op: f(x, axis)
        )
    np.testing.assert_allclose(T.softmax(x, np.int64(0)).value, np.full((2, 3), 0.5))


def test_concat_and_stack_take_any_iterable():
    s = EagerSession()
    x = s.leaf(np.ones((2, 3)))
    assert T.concat((r for r in (x, x)), 0).shape == (4, 3)
    assert T.stack((r for r in (x, x)), 0).shape == (2, 2, 3)


def test_numpy_integers_and_fractions_are_taken_as_arguments():
    s = EagerSession()
    x = s.leaf(np.ones((1, 2, 6, 6), np.float32))
    w = s.leaf(np.ones((3, 2, 3, 3), np.float32))
    assert T.conv2d(x, w, stride=np.int64(2), padding=np.int32(1)).shape == (1, 3, 3, 3)
    assert T.max_pool2d(x, np.int64(2)).shape == (1, 2, 3, 3)
    qkv = s.leaf(np.ones((2, 4, 12), np.float32))
    a = T.self_attention(qkv, np.int64(2), scale=Fraction(1, 2))
    b = T.self_attention(qkv, 2, scale=0.5)
    np.testing.assert_array_equal(a.value, b.value)
    raises_and_records_nothing(
        s, HyperparameterError, "n_heads must be an integer", lambda: T.self_attention(qkv, 2.0)
    )
    raises_and_records_nothing(
        s,
        HyperparameterError,
        "scale must be a real number",
        lambda: T.self_attention(qkv, 2, scale="big"),
    )


def test_the_mean_of_integers_is_floating_over_one_element_too():
    s = EagerSession()
    assert T.mean(s.constant(np.array([[1], [2]])), axis=1).value.dtype == np.float64
