"""The fast paths of the host backend and the fused ops (issue 9): exact where they must be.

Covers the float32 GELU kernel (accuracy against float64, special values, blocks and
threads), ``Backend.blockwise`` (each item once, same ranges every call, errors reach
the caller), the softmax shift and its underflow fallback, ``self_attention`` against
its unfused composition, mixed dtypes of the in-place paths, and the glibc memory
setting with its opt-out.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

import tiegrad.backend.host_dispatch as nb
import tiegrad.ops as T
from tiegrad import EagerSession
from tiegrad.backend import NUMPY, Backend, NumpyBackend
from tiegrad.backend.host_special import _GELU_BLOCK
from tiegrad.ops import _core

_erfc64 = np.vectorize(math.erfc, otypes=[np.float64])


def gelu_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GELU and its derivative in float64 from ``math.erfc`` (exact in both tails)."""
    x = np.asarray(x, dtype=np.float64)
    cdf = 0.5 * _erfc64(-x / math.sqrt(2.0))
    return x * cdf, cdf + x * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


# -- GELU ---------------------------------------------------------------------------------
@pytest.fixture(params=["numba kernel", "numpy kernel"])
def gelu_path(request, monkeypatch):
    """Each float32 GELU test runs on both kernels (the numba one where numba imports)."""
    monkeypatch.setattr(nb._numba, "ENABLED", request.param == "numba kernel")


@pytest.mark.usefixtures("gelu_path")
def test_gelu_float32_is_accurate_to_float32_precision():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(100_000) * 3, np.linspace(-14, 14, 100_001)])
    x = x.astype(np.float32)
    y, d = NUMPY.gelu(x)
    assert y.dtype == d.dtype == np.float32
    want_y, want_d = gelu_reference(x)
    scale = np.maximum(1.0, np.abs(x.astype(np.float64)))
    assert np.max(np.abs(y - want_y) / scale) < 2e-7
    assert np.max(np.abs(d - want_d)) < 3e-7
    # no 1 + erf cancellation in the negative tail: small relative errors far out
    rel = np.abs(y - want_y) / np.abs(np.where(want_y == 0, 1.0, want_y))
    assert np.max(rel[(x < -1) & (x > -3)]) < 5e-6
    assert np.max(rel[(x <= -3) & (x > -10)]) < 3e-3


@pytest.mark.usefixtures("gelu_path")
def test_gelu_float32_special_values():
    x = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e30, -1e30, 1e-30], np.float32)
    with np.errstate(invalid="ignore"):
        y, d = NUMPY.gelu(x)
    assert y[0] == 0 and y[1] == 0 and d[0] == 0.5 and d[1] == 0.5
    assert y[2] == np.inf and y[3] == 0
    assert np.isnan(y[4]) and np.isnan(d[4])
    assert y[5] == np.float32(1e30) and d[5] == 1 and y[6] == 0 and d[6] == 0
    assert y[7] == np.float32(5e-31)


def test_gelu_float64_takes_the_exact_path():
    x = np.linspace(-6, 6, 1001)
    y, d = NUMPY.gelu(x)
    want_y, want_d = gelu_reference(x)
    np.testing.assert_allclose(y, want_y, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(d, want_d, rtol=1e-13, atol=1e-15)


@pytest.mark.usefixtures("gelu_path")
def test_gelu_gives_the_same_bits_on_any_number_of_threads(monkeypatch):
    x = np.random.default_rng(1).standard_normal((5, _GELU_BLOCK + 7)).astype(np.float32)
    monkeypatch.setenv("TIEGRAD_NUM_THREADS", "1")
    one = NUMPY.gelu(x)
    monkeypatch.setenv("TIEGRAD_NUM_THREADS", "3")
    many = NUMPY.gelu(x)
    for a, b in zip(one, many):
        assert a.shape == x.shape
        assert np.array_equal(a, b)


@pytest.mark.usefixtures("gelu_path")
def test_gelu_op_keeps_only_the_derivative_and_matches_float64():
    x = np.random.default_rng(2).standard_normal((4, 33)).astype(np.float32) * 2
    s = EagerSession()
    xr = s.leaf(x)
    y = T.gelu(xr)
    cot = np.random.default_rng(3).standard_normal(x.shape).astype(np.float32)
    g = s.backward(y, seed=cot)[xr]
    want_y, want_d = gelu_reference(x)
    np.testing.assert_allclose(y.value, want_y, rtol=0, atol=5e-7)
    np.testing.assert_allclose(g, cot * want_d, rtol=0, atol=2e-6)


# -- blockwise ------------------------------------------------------------------------------
@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("n, item", [(0, 8), (1, 10), (1000, 128), (37, nb._block() + 1)])
def test_blockwise_covers_each_item_once_with_the_same_ranges(monkeypatch, threads, n, item):
    monkeypatch.setenv("TIEGRAD_NUM_THREADS", str(threads))
    calls: list[tuple[int, int]] = []
    lock = threading.Lock()

    def kernel(lo: int, hi: int) -> None:
        with lock:
            calls.append((lo, hi))

    NUMPY.blockwise(kernel, n, item)
    first = sorted(calls)
    covered = [i for lo, hi in first for i in range(lo, hi)]
    assert covered == list(range(n))
    assert all(lo < hi for lo, hi in first)
    calls.clear()
    NUMPY.blockwise(kernel, n, item)
    assert sorted(calls) == first


def test_blockwise_default_runs_one_range():
    calls = []
    Backend.blockwise(NUMPY, lambda lo, hi: calls.append((lo, hi)), 10, 4)
    Backend.blockwise(NUMPY, lambda lo, hi: calls.append((lo, hi)), 0, 4)
    assert calls == [(0, 10)]


def test_blockwise_errors_reach_the_caller(monkeypatch):
    monkeypatch.setenv("TIEGRAD_NUM_THREADS", "2")

    def kernel(lo: int, hi: int) -> None:
        if lo > 0:
            raise ValueError(f"block {lo}")

    with pytest.raises(ValueError, match="block"):
        NUMPY.blockwise(kernel, 4 * nb._block(), 1)


class OneBlockBackend(NumpyBackend):
    """The NumPy backend with the interface's single-range ``blockwise``."""

    blockwise = Backend.blockwise


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_blocked_layer_norm_and_attention_match_one_block(dtype):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 700, 16)).astype(dtype)
    w = rng.standard_normal(16).astype(dtype)
    b = rng.standard_normal(16).astype(dtype)
    qkv = rng.standard_normal((40, 24, 48)).astype(dtype)

    def run(backend):
        s = EagerSession(backend=backend)
        refs = [s.leaf(a) for a in (x, w, b, qkv)]
        ln = T.layer_norm(refs[0], refs[1], refs[2])
        at = T.self_attention(refs[3], 2, causal=True)
        loss = T.sum(ln * ln) + T.sum(at * at)
        grads = s.backward(loss)
        return [ln.value, at.value] + [grads[r] for r in refs]

    tol = 1e-5 if dtype == np.float32 else 1e-12
    for a, c in zip(run(NUMPY), run(OneBlockBackend())):
        np.testing.assert_allclose(a, c, rtol=tol, atol=tol)


# -- softmax shifts ---------------------------------------------------------------------------
def softmax64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_cross_entropy_rows_far_below_the_block_maximum_stay_exact():
    logits = np.random.default_rng(5).standard_normal((6, 5)).astype(np.float32)
    logits[2] -= 500.0  # its exponentials underflow under the block shift
    targets = np.array([0, 1, 2, 3, 4, 0])
    s = EagerSession()
    lr = s.leaf(logits)
    loss = T.cross_entropy(lr, targets, reduction="none")
    grad = s.backward(loss, seed=np.ones(6, np.float32))[lr]
    p = softmax64(logits)
    np.testing.assert_allclose(loss.value, -np.log(p[np.arange(6), targets]), rtol=1e-5)
    onehot = np.eye(5)[targets]
    np.testing.assert_allclose(grad, p - onehot, rtol=0, atol=1e-6)


def test_shifted_exp_without_underflow_keeps_the_block_shift():
    x = np.array([[0.0, 1.0], [2.0, 3.0]], np.float32)
    s, e, den = _core.shifted_exp(NUMPY, x)
    np.testing.assert_array_equal(s, x - 3.0)
    np.testing.assert_allclose(e / den, softmax64(x), rtol=1e-6)


def test_attention_row_far_below_the_others_and_a_row_that_sees_nothing():
    rng = np.random.default_rng(6)
    q = rng.standard_normal((2, 3, 4))
    k = rng.standard_normal((2, 5, 4))
    v = rng.standard_normal((2, 5, 3))
    q[0, 1] *= 300.0  # scores of this query span hundreds: far below the block max
    mask = np.zeros((2, 5), bool)
    mask[1] = True  # batch 1 sees no key at all
    s = EagerSession()
    refs = [s.leaf(a) for a in (q, k, v)]
    out = T.scaled_dot_product_attention(*refs, key_padding_mask=mask)
    scores = q @ k.transpose(0, 2, 1) / 2.0
    np.testing.assert_allclose(out.value[0], softmax64(scores[0]) @ v[0], rtol=1e-10)
    assert np.all(out.value[1] == 0)
    grads = s.backward(T.sum(out))
    assert np.all(grads[refs[0]][1] == 0) and np.all(grads[refs[2]][1] == 0)


# -- self_attention ---------------------------------------------------------------------------
@pytest.mark.parametrize("causal, masked", [(False, False), (True, False), (True, True)])
def test_self_attention_equals_split_attention_merge(causal, masked):
    rng = np.random.default_rng(7)
    b, t, h, hd = 3, 5, 2, 4
    x = rng.standard_normal((b, t, 3 * h * hd))
    mask = None
    if masked:
        mask = np.zeros((b, t), bool)
        mask[0, -2:] = True
    cot = rng.standard_normal((b, t, h * hd))

    def fused(s, xr):
        return T.self_attention(xr, h, causal=causal, key_padding_mask=mask)

    def composed(s, xr):
        qkv = xr.reshape(b, t, 3, h, hd).permute(2, 0, 3, 1, 4)
        y = T.scaled_dot_product_attention(
            qkv[0], qkv[1], qkv[2], causal=causal, key_padding_mask=mask
        )
        return y.permute(0, 2, 1, 3).reshape(b, t, h * hd)

    results = []
    for fn in (fused, composed):
        s = EagerSession()
        xr = s.leaf(x)
        y = fn(s, xr)
        results.append((y.value, s.backward(y, seed=cot)[xr]))
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-12, atol=1e-14)


def test_self_attention_checks_its_shape():
    s = EagerSession()
    with pytest.raises(Exception, match=r"self_attention: qkv has shape \(2, 3, 10\)"):
        T.self_attention(s.leaf(np.zeros((2, 3, 10))), 2)
    assert len(s) == 1  # nothing recorded (C6)


# -- mixed dtypes on the in-place paths ---------------------------------------------------------
def test_layer_norm_and_linear_promote_mixed_dtypes_like_numpy():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((4, 6)).astype(np.float32)
    w64 = rng.standard_normal(6)
    s = EagerSession()
    xr = s.leaf(x)
    ln = T.layer_norm(xr, s.leaf(w64), s.leaf(np.zeros(6)))
    assert ln.dtype == np.float64
    xc = x - x.mean(axis=-1, keepdims=True)
    want = xc / np.sqrt((xc * xc).mean(axis=-1, keepdims=True) + 1e-5) * w64
    np.testing.assert_allclose(ln.value, want, rtol=1e-5, atol=1e-6)  # float32 rows
    lin = T.linear(xr, s.leaf(rng.standard_normal((3, 6)).astype(np.float32)), s.leaf(np.ones(3)))
    assert lin.dtype == np.float64


_FUSED_OPS = {
    "layer_norm": lambda c, x: T.layer_norm(c(x), c(np.ones(32, np.float32)), c(x[0])),
    "gelu": lambda c, x: T.gelu(c(x)),
    "relu": lambda c, x: T.relu(c(x)),
    "add": lambda c, x: c(x) + c(x[::-1].copy()),
    "mul": lambda c, x: c(x) * c(x[::-1].copy()),
    "softmax": lambda c, x: T.softmax(c(x), axis=-1),
    "log_softmax": lambda c, x: T.log_softmax(c(x), axis=-1),
    "linear": lambda c, x: T.linear(c(x), c(x[:8].copy()), c(x[0, :8].copy())),
    "self_attention": lambda c, x: T.self_attention(c(x.reshape(4, 16, 32)[..., :24]), 2, True),
}


@pytest.mark.usefixtures("gelu_path")
@pytest.mark.parametrize("op", sorted(_FUSED_OPS))
def test_fused_ops_read_read_only_inputs_and_seeds(op):
    """Read-only inputs (a parameter's value, a memory map) and seeds give the same
    values and gradients as writable copies (numba's layer norm once refused them)."""
    x = np.random.default_rng(9).standard_normal((64, 32)).astype(np.float32)
    results = []
    for writable in (True, False):
        s = EagerSession()

        def c(a, s=s, writable=writable):
            a = a.copy()
            a.flags.writeable = writable
            return s.leaf(a)

        y = _FUSED_OPS[op](c, x)
        seed = np.linspace(-1.0, 1.0, y.value.size, dtype=np.float32).reshape(y.value.shape)
        seed.flags.writeable = writable
        results.append((y.value.copy(), s.backward(y, seed)))
    (y_w, g_w), (y_r, g_r) = results
    np.testing.assert_array_equal(y_r, y_w)
    assert sorted(g_r) == sorted(g_w)
    for k in g_w:
        np.testing.assert_array_equal(g_r[k], g_w[k])
