"""Half precision, integer inputs, extreme GELU arguments and NumPy-scalar hyperparameters.

float16 sums, means, losses and layer-norm statistics accumulate in float32 and round
back once (PyTorch's accumulation type): a float16 sum of squares no longer overflows.
Integer input to ``layer_norm`` computes in float64 (its promotion with a float).
GELU of ``inf`` and of huge float64 values is finite where PyTorch's is. A NumPy or
``Fraction`` hyperparameter is read as a Python float (a NumPy scalar would widen a
float32 result to float64); a bool or a non-number is a ``HyperparameterError``.
Each test runs on both routes (the numba kernels and pure NumPy) where they differ.
"""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest

import tiegrad.backend.host_dispatch as nb
import tiegrad.ops as T
from tiegrad import EagerSession, nn
from tiegrad.backend import host_special
from tiegrad.errors import HyperparameterError

torch = pytest.importorskip("torch")
F = torch.nn.functional

F16 = np.float16


@pytest.fixture(params=["numba", "numpy"])
def route(request, monkeypatch):
    """Run the test with the numba kernels on, then with the pure NumPy route."""
    monkeypatch.setattr(nb._numba, "ENABLED", request.param == "numba")


def _wide_rows() -> np.ndarray:
    """float16 rows whose float16 sum of squares overflows (|x| up to ~100, 300 columns)."""
    return (np.random.default_rng(0).standard_normal((4, 300)) * 30).astype(F16)


# -- layer norm ----------------------------------------------------------------------------


@pytest.mark.usefixtures("route")
@pytest.mark.parametrize("affine", [False, True])
def test_float16_layer_norm_matches_torch_forward_and_gradients(affine):
    x = _wide_rows()
    rng = np.random.default_rng(1)
    w = (1 + 0.1 * rng.standard_normal(300)).astype(F16)
    b = (0.1 * rng.standard_normal(300)).astype(F16)
    # a large cotangent: its float16 row sums (300 * 500) overflow too
    cot = (rng.standard_normal((4, 300)) * 500).astype(F16)
    s = EagerSession()
    refs = [s.leaf(a) for a in ((x, w, b) if affine else (x,))]
    out = T.layer_norm(*refs)
    grads = s.backward(out, seed=cot)
    tins = [torch.tensor(a, requires_grad=True) for a in ((x, w, b) if affine else (x,))]
    tout = F.layer_norm(tins[0], (300,), *tins[1:])
    tout.backward(torch.tensor(cot))
    assert out.dtype == F16
    np.testing.assert_allclose(out.value, tout.detach().numpy(), rtol=0, atol=4e-3)
    assert np.abs(out.value).max() > 3  # not the zeros of a float16 rstd that underflowed
    for r, t in zip(refs, tins):
        ours, theirs = grads[r], t.grad.numpy()
        assert ours.dtype == F16 and np.isfinite(ours).all()
        scale = float(np.abs(theirs).max())
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-3 * scale)


@pytest.mark.usefixtures("route")
def test_float16_layer_norm_module_keeps_float16():
    s = EagerSession()
    y = nn.LayerNorm(300, dtype=F16)(s, _wide_rows())
    ref = F.layer_norm(torch.tensor(_wide_rows()), (300,)).numpy()
    assert y.dtype == F16
    np.testing.assert_allclose(y.value, ref, rtol=0, atol=4e-3)


@pytest.mark.usefixtures("route")
@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint8])
def test_integer_layer_norm_computes_in_float64(dtype):
    x = np.arange(24).reshape(4, 6).astype(dtype) * 3
    s = EagerSession()
    want = T.layer_norm(s.leaf(x.astype(np.float64))).value
    y = T.layer_norm(s.constant(x))
    assert y.dtype == np.float64
    np.testing.assert_array_equal(y.value, want)
    # the module's float32 parameters promote with the float64 rows, as in ``linear``
    out = nn.LayerNorm(6)(s, x)
    assert out.dtype == np.float64
    np.testing.assert_allclose(out.value, want, rtol=0, atol=1e-6)


# -- sums, means and losses ----------------------------------------------------------------


def test_float16_mean_and_sum_accumulate_in_float32():
    s = EagerSession()
    m = T.mean(s.leaf(np.ones(70000, F16)))
    assert m.dtype == F16 and float(m.value) == 1.0
    # a strided axis reduction: float16 accumulation drifts (19.53 for 20.0)
    x = np.full((2000, 3), 0.01, F16)
    for op, tfn in ((T.sum, torch.sum), (T.mean, torch.mean)):
        ours = op(s.leaf(x), axis=0)
        theirs = tfn(torch.tensor(x), dim=0).numpy()
        assert ours.dtype == F16
        np.testing.assert_array_equal(ours.value, theirs)
    # partial sums beyond float16's range whose total is within it
    big = np.array([60000, 60000, -60000, -60000, 7] * 3, F16).reshape(5, 3, order="F")
    np.testing.assert_array_equal(T.sum(s.leaf(big), axis=0).value, np.full(3, 7, F16))


def test_float32_and_float64_sums_and_means_keep_their_bits():
    rng = np.random.default_rng(3)
    for dtype in (np.float32, np.float64):
        x = rng.standard_normal((37, 53)).astype(dtype)
        s = EagerSession()
        for axis in (None, 0, 1):
            total = np.add.reduce(x, axis=axis)
            assert T.sum(s.leaf(x), axis=axis).value.tobytes() == total.tobytes()
            n = x.size if axis is None else x.shape[axis]
            mean = T.mean(s.leaf(x), axis=axis).value
            assert mean.dtype == dtype and mean.tobytes() == (total * (1.0 / n)).tobytes()


@pytest.mark.usefixtures("route")
def test_float16_mse_loss_accumulates_in_float32():
    s = EagerSession()
    x = np.full(1000, 10, F16)
    loss = T.mse_loss(s.leaf(x), np.zeros_like(x))
    assert loss.dtype == F16 and float(loss.value) == 100.0
    # squares beyond float16's range (300**2) whose mean is within it
    x = np.zeros(1000, F16)
    x[:3] = 300
    p = s.leaf(x)
    loss = T.mse_loss(p, np.zeros_like(x))
    assert float(loss.value) == np.float16(270.0)
    np.testing.assert_array_equal(s.backward(loss)[p][:4], np.array([0.6, 0.6, 0.6, 0], F16))
    summed = T.mse_loss(s.leaf(np.full(100, 10, F16)), np.zeros(100, F16), reduction="sum")
    assert summed.dtype == F16 and float(summed.value) == 10000.0


@pytest.mark.usefixtures("route")
def test_float16_cross_entropy_mean_accumulates_in_float32():
    logits = np.tile(np.array([-3, 3, 3, 3], F16), (100000, 1))
    targets = np.ones(100000, np.int64)
    s = EagerSession()
    ours = T.cross_entropy(s.leaf(logits), targets)
    # the float32 loss, rounded (PyTorch's float16 mean here is NaN): the sum (110000)
    # is beyond float16's range, the mean (1.1) is not
    want = T.cross_entropy(s.leaf(logits.astype(np.float32)), targets).value
    assert ours.dtype == F16
    np.testing.assert_allclose(ours.value, want, rtol=1e-3)


# -- GELU of extreme arguments -------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # inf * 0 and overflowing squares
@pytest.mark.parametrize("dtype", [np.float64, F16])
def test_gelu_of_inf_and_huge_values_matches_torch(dtype):
    big = 6e4 if dtype == F16 else 1e62
    x = np.array([np.inf, -np.inf, big, -big, 40.0, -40.0, 3.0], dtype)
    s = EagerSession()
    ref = s.leaf(x)
    y = T.gelu(ref)
    grad = s.backward(y, seed=np.ones_like(x))[ref]
    t = torch.tensor(x, requires_grad=True)
    ty = F.gelu(t)
    ty.backward(torch.ones_like(t))
    tol = 1e-3 if dtype == F16 else 1e-12
    np.testing.assert_allclose(y.value, ty.detach().numpy(), rtol=tol, equal_nan=True)
    np.testing.assert_allclose(grad, t.grad.numpy(), rtol=tol, equal_nan=True)
    assert y.value[0] == np.inf and y.value[2] == x[2] and grad[2] == 1 and grad[3] == 0


def test_erf_of_large_and_infinite_arguments():
    x = np.array([np.inf, -np.inf, 1e62, -1e300, 27.0, 30.0, np.nan])
    np.testing.assert_array_equal(host_special._erf(x), [1, -1, 1, -1, 1, 1, np.nan])


# -- hyperparameters -----------------------------------------------------------------------


def test_numpy_scalar_hyperparameters_keep_float32():
    x = np.random.default_rng(4).standard_normal((8, 5)).astype(np.float32)
    t = np.array([0, 1, 2, 3, 4, 0, 1, 2])
    for p in (np.float64(0.25), np.float16(0.25), Fraction(1, 4)):
        a, b = EagerSession(seed=7), EagerSession(seed=7)
        ours = T.dropout(a.leaf(x), p)
        assert ours.dtype == np.float32
        np.testing.assert_array_equal(ours.value, T.dropout(b.leaf(x), 0.25).value)
    s = EagerSession()
    plain = T.cross_entropy(s.leaf(x), t, label_smoothing=0.1, ignore_index=2).value
    loss = T.cross_entropy(
        s.leaf(x), t, label_smoothing=np.float64(0.1), ignore_index=np.int64(2)
    ).value
    assert loss.dtype == np.float32 and loss == plain


@pytest.mark.usefixtures("route")
@pytest.mark.parametrize("eps", [np.float16(1e-3), np.float64(1e-3), Fraction(1, 1000)])
def test_layer_norm_takes_numpy_and_fraction_eps(eps):
    x = np.random.default_rng(5).standard_normal((3, 8)).astype(np.float32)
    s = EagerSession()
    y = T.layer_norm(s.leaf(x), eps=eps)
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y.value, T.layer_norm(s.leaf(x), eps=float(eps)).value)


BAD_HYPERPARAMETERS = [
    ("layer_norm", "eps", lambda x, v: T.layer_norm(x, eps=v), [True, "1e-5", Decimal("1e-5")]),
    ("dropout", "p", lambda x, v: T.dropout(x, v), [True, "0.5", None]),
    (
        "cross_entropy",
        "label_smoothing",
        lambda x, v: T.cross_entropy(x, np.zeros(3, np.int64), label_smoothing=v),
        [np.True_, "0.1"],
    ),
    (
        "cross_entropy",
        "ignore_index",
        lambda x, v: T.cross_entropy(x, np.zeros(3, np.int64), ignore_index=v),
        [True, -100.0, "1"],
    ),
]


@pytest.mark.parametrize(("op", "name", "call", "values"), BAD_HYPERPARAMETERS)
def test_bad_hyperparameters_are_named_errors_that_record_nothing(op, name, call, values):
    s = EagerSession()
    x = s.leaf(np.ones((3, 4), np.float32))
    for v in values:
        with pytest.raises(HyperparameterError, match=f"{op}: {name} must be"):
            call(x, v)
        assert len(s) == 1


# -- dropout in half precision -------------------------------------------------------------


def test_float16_dropout_draws_the_float32_mask():
    x = np.ones((64, 33), F16)
    a, b = EagerSession(seed=11), EagerSession(seed=11)
    ours = T.dropout(a.leaf(x), 0.3)
    ref = T.dropout(b.leaf(x.astype(np.float32)), 0.3)
    assert ours.dtype == F16
    np.testing.assert_array_equal(ours.value != 0, ref.value != 0)
    np.testing.assert_array_equal(ours.value[ours.value != 0], F16(1 / 0.7))
