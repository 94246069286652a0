"""The numba kernels of the NumPy backend (``tiegrad.backend.host_kernels``, issue 9).

Each kernel is checked against the NumPy code path it replaces (``tiegrad._numba.ENABLED`` off)
and against float64 references: the exponential, GELU, layer norm forward and
backward, the attention softmax and its backward, cross-entropy, special values, the fallbacks
(float64, strided operands, the environment switch) and the placement of a kernel's
output arrays.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

numba = pytest.importorskip("numba")

import tiegrad.backend.host_dispatch as nb  # noqa: E402
import tiegrad.ops as T  # noqa: E402
from tiegrad import EagerSession  # noqa: E402
from tiegrad.backend import NUMPY  # noqa: E402
from tiegrad.backend import host_kernels as hk  # noqa: E402


@pytest.fixture
def fused(monkeypatch):
    """Run with the kernels on (the default when numba imports)."""
    monkeypatch.setattr(nb._numba, "ENABLED", True)


def both_paths(monkeypatch, run):
    """``run()`` with the kernels, then with the NumPy code, as two lists of arrays."""
    monkeypatch.setattr(nb._numba, "ENABLED", True)
    with_kernels = run()
    monkeypatch.setattr(nb._numba, "ENABLED", False)
    without = run()
    return with_kernels, without


@numba.njit
def _exp_all(z, out):
    for i in range(z.size):
        out[i] = hk.exp_neg(z[i])


def test_exp_neg_is_within_two_ulp_and_handles_the_ends():
    z = -np.concatenate([np.linspace(0, 87, 200_001), np.random.default_rng(0).random(10**5)])
    z = z.astype(np.float32)
    out = np.empty_like(z)
    _exp_all(z, out)
    want = np.exp(z.astype(np.float64))
    ulp = np.spacing(want.astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(out - want) / ulp) <= 2.0
    ends = np.array([0.0, -0.0, -87.0, -88.0, -1e30, -np.inf, np.nan], np.float32)
    got = np.empty_like(ends)
    _exp_all(ends, got)
    assert got[0] == 1 and got[1] == 1 and got[2] > 0
    assert got[3] == 0 and got[4] == 0 and got[5] == 0 and np.isnan(got[6])


def test_gelu_kernel_matches_the_numpy_kernel(monkeypatch):
    x = np.random.default_rng(1).standard_normal((3, 70_001)).astype(np.float32) * 4
    (y, d), (y0, d0) = both_paths(monkeypatch, lambda: list(NUMPY.gelu(x)))
    scale = np.maximum(1.0, np.abs(x))
    assert np.max(np.abs(y - y0) / scale) < 3e-7
    assert np.max(np.abs(d - d0)) < 3e-7
    assert y.shape == d.shape == x.shape and y.dtype == d.dtype == np.float32


@pytest.mark.parametrize("affine", ["none", "weight", "both"])
def test_layer_norm_kernels_match_the_numpy_path(monkeypatch, affine):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((5, 301, 24)) * 3 + 1).astype(np.float32)
    w = rng.standard_normal(24).astype(np.float32)
    b = rng.standard_normal(24).astype(np.float32)
    cot = rng.standard_normal(x.shape).astype(np.float32)

    def run():
        s = EagerSession()
        refs = [s.leaf(x), s.leaf(w), s.leaf(b)]
        args = {"none": (), "weight": (refs[1],), "both": (refs[1], refs[2])}[affine]
        y = T.layer_norm(refs[0], *args)
        grads = s.backward(y, seed=cot)
        return [y.value] + [grads[r] for r in refs[: 1 + len(args)]]

    fast, slow = both_paths(monkeypatch, run)
    for a, c in zip(fast, slow):
        np.testing.assert_allclose(a, c, rtol=2e-5, atol=2e-5)
    x64 = x.astype(np.float64)
    xhat = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5)
    want = {"none": xhat, "weight": xhat * w, "both": xhat * w + b}[affine]
    np.testing.assert_allclose(fast[0], want, rtol=0, atol=3e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_softmax_kernels_match_the_numpy_path(monkeypatch, causal):
    rng = np.random.default_rng(3)
    qkv = (rng.standard_normal((6, 17, 48)) * 2).astype(np.float32)
    mask = np.zeros((6, 17), bool)
    mask[1, 5:] = True
    mask[2] = True  # every key hidden: zeros and no gradient
    cot = rng.standard_normal((6, 17, 16)).astype(np.float32)

    def run():
        s = EagerSession()
        xr = s.leaf(qkv)
        y = T.self_attention(xr, 2, causal=causal, key_padding_mask=mask)
        return [y.value, s.backward(y, seed=cot)[xr]]

    fast, slow = both_paths(monkeypatch, run)
    for a, c in zip(fast, slow):
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-5)
    assert np.all(fast[0][2] == 0) and np.all(fast[1][2] == 0)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_kernels_match_the_numpy_path(monkeypatch, reduction, smoothing):
    rng = np.random.default_rng(4)
    logits = (rng.standard_normal((3, 70, 33)) * 4).astype(np.float32)
    logits[0, 3] += 80  # a row far above the others
    t = rng.integers(0, 33, (3, 70))
    t[1, ::3] = 5
    cot = rng.standard_normal((3, 70)).astype(np.float32) if reduction == "none" else None

    def run():
        s = EagerSession()
        xr = s.leaf(logits)
        y = T.cross_entropy(xr, t, reduction, ignore_index=5, label_smoothing=smoothing)
        return [y.value, s.backward(y, seed=cot)[xr]]

    fast, slow = both_paths(monkeypatch, run)
    for a, c in zip(fast, slow):
        assert a.dtype == c.dtype == np.float32 and a.shape == c.shape
        np.testing.assert_allclose(a, c, rtol=2e-6, atol=2e-6)
    assert not fast[1][t == 5].any()  # an ignored position has no gradient
    monkeypatch.setattr(nb._numba, "ENABLED", True)
    rows = logits.reshape(-1, 33), t.reshape(-1)
    count = int(np.count_nonzero(t != 5))  # the caller's host count, which a mean needs
    assert NUMPY.cross_entropy_rows(*rows, 5, smoothing, True, reduction, count) is not None


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_ignores_positions_whose_logits_are_not_finite(monkeypatch, reduction):
    # An ignored position contributes nothing on either path: no NaN from its logits
    # in the loss or in the gradient, and no NaN from a cotangent there.
    rng = np.random.default_rng(8)
    logits = rng.standard_normal((6, 9)).astype(np.float32)
    logits[1, 2], logits[3] = np.nan, -np.inf
    logits[4, 0] = np.inf
    t = np.array([0, -100, 8, -100, -100, 2])
    cot = np.float32([1, np.nan, 2, 3, 4, 5]) if reduction == "none" else None

    def run():
        s = EagerSession()
        xr = s.leaf(logits)
        with np.errstate(all="ignore"):  # NumPy's path meets the non-finite rows
            y = T.cross_entropy(xr, t, reduction)
            return [y.value, s.backward(y, seed=cot)[xr]]

    for loss, grad in both_paths(monkeypatch, run):
        assert np.isfinite(loss).all() and np.isfinite(grad).all()
        assert not np.asarray(loss).reshape(-1)[[1, 3, 4] if reduction == "none" else []].any()
        assert not grad[t == -100].any()
        assert grad[[0, 2, 5]].any(axis=1).all()


def test_cross_entropy_kernel_vjp_runs_twice_and_takes_a_wider_cotangent(fused):
    rng = np.random.default_rng(9)
    logits = rng.standard_normal((5, 7)).astype(np.float32)
    t = np.array([0, 6, 3, -100, 2])
    s = EagerSession()
    xr = s.leaf(logits)
    y = T.cross_entropy(xr, t, reduction="none")
    cot = rng.standard_normal(5)  # float64
    first = s.backward(y, seed=cot, retain_graph=True)[xr]
    again = s.backward(y, seed=cot)[xr]
    np.testing.assert_array_equal(first, again)
    assert first.dtype == np.float32
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    p[np.arange(5), np.maximum(t, 0)] -= 1.0  # row 3, ignored, is zeroed below
    want = np.where((t != -100)[:, None], p * cot[:, None], 0.0)
    np.testing.assert_allclose(first, want, rtol=1e-5, atol=1e-6)


def test_cross_entropy_kernel_special_rows_and_no_position_counted(fused):
    s = EagerSession()
    x = np.zeros((4, 6), np.float32)
    x[0] = -np.inf  # no finite logit: NaN, as PyTorch
    x[1, 2] = np.nan
    x[2, 4] = np.inf
    xr = s.leaf(x)
    with np.errstate(divide="ignore", invalid="ignore"):  # the log of a zero sum, as NumPy's path
        loss = T.cross_entropy(xr, np.array([1, 0, 4, 3]), reduction="none")
    assert np.isnan(loss.value[:3]).all() and loss.value[3] == np.float32(np.log(6))
    ignored = s.leaf(x)
    mean = T.cross_entropy(ignored, np.full(4, -100), reduction="mean")
    assert mean.value == 0  # no position counted: 0, not NaN (``ops.cross_entropy``)
    assert not s.backward(mean)[ignored].any()


def test_cross_entropy_kernel_refuses_what_it_does_not_cover(fused):
    t = np.zeros(4, np.int64)
    assert NUMPY.cross_entropy_rows(np.ones((4, 3)), t, -100, 0.0, True) is None  # float64
    assert NUMPY.cross_entropy_rows(np.ones((3, 4), np.float32).T, t, -100, 0.0, True) is None
    assert NUMPY.cross_entropy_rows(np.ones((4, 3), np.float32), t, 2**63, 0.0, True) is None


@numba.njit
def _row_maxima(x, out):
    for r in range(x.shape[0]):
        out[r] = hk._row_max(x[r])


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 16, 17, 64, 71])
def test_row_max_is_the_largest_element_not_nan_in_every_lane_and_the_tail(n):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((4 * n + 3, n)) * 5).astype(np.float32)
    for r in range(min(n, x.shape[0])):
        x[r, r] = 100.0  # the maximum in each lane and in the tail
        x[r, (r + 1) % n] = np.nan
    x[-3] = np.nan
    x[-2] = -np.inf
    out = np.empty(x.shape[0], np.float32)
    _row_maxima(x, out)
    hidden = np.where(np.isnan(x), -np.inf, x)
    want = hidden.max(-1) if n else np.full(x.shape[0], -np.inf, np.float32)
    np.testing.assert_array_equal(out, want)
    if n > 1:
        assert np.all(out[: min(n, x.shape[0])] == 100.0)


@pytest.mark.parametrize("spread", [1.0, 10.0, 80.0])
def test_softmax_kernel_is_accurate_across_wide_rows(spread):
    """The exponential inside the kernel keeps its accuracy (no fast-math reordering)."""
    x = -np.random.default_rng(5).random((512, 64)) * spread
    x[:, 0] = 0.0
    x = x.astype(np.float32)
    p = x.copy()
    hk.softmax(p, 0, p.shape[0])
    e = np.exp(x.astype(np.float64))
    want = e / e.sum(-1, keepdims=True)
    ulp = np.spacing(want.astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(p - want) / ulp) <= 8.0


def test_softmax_kernel_rows_far_apart_nan_and_hidden(fused):
    x = np.array(
        [[0.0, 1.0, 2.0], [-500.0, -501.0, -499.0], [-np.inf] * 3, [1.0, np.nan, 0.0]],
        np.float32,
    )
    p = x.copy()
    assert NUMPY.softmax_rows_(p)
    e = np.exp(x[:2].astype(np.float64) - x[:2].max(-1, keepdims=True))
    np.testing.assert_allclose(p[:2], e / e.sum(-1, keepdims=True), rtol=1e-6)
    assert np.all(p[2] == 0) and np.all(np.isnan(p[3]))
    g = np.random.default_rng(4).standard_normal((2, 3)).astype(np.float32)
    gp = g.copy()
    assert NUMPY.softmax_backward_rows_(gp, p[:2].copy())
    want = p[:2] * (g - (g * p[:2]).sum(-1, keepdims=True))
    np.testing.assert_allclose(gp, want, rtol=1e-6, atol=1e-7)


def test_float64_and_strided_operands_take_the_numpy_path(fused):
    x64 = np.ones((4, 8))
    assert NUMPY.layer_norm_rows(x64, None, None, 1e-5) is None
    assert NUMPY.layer_norm_backward_rows(x64, None, x64, x64[:, :1], (True,) * 3) is None
    x = np.ones((8, 4), np.float32).T
    assert NUMPY.layer_norm_rows(x, None, None, 1e-5) is None
    assert NUMPY.layer_norm_rows(x.copy(), np.ones(8), None, 1e-5) is None  # mixed dtypes
    assert not NUMPY.softmax_rows_(x)
    assert not NUMPY.softmax_backward_rows_(x, x)


def test_kernel_outputs_lie_apart_from_the_input_and_each_other():
    n = nb._PLACE_MIN
    base = np.empty(n + 1000, np.float32)
    for skip in (0, 1, 16, 1000):
        x = base[skip : skip + n]
        outs = nb._outputs_apart(x, 2)
        addresses = [a.__array_interface__["data"][0] for a in (x, *outs)]
        for i, a in enumerate(addresses):
            for c in addresses[i + 1 :]:
                gap = (a - c) % 4096
                assert min(gap, 4096 - gap) >= 4096 // 3 - 64
        assert all(o.size == x.size and o.dtype == np.float32 for o in outs)
        assert outs[0].base is not outs[1].base  # each output is freed on its own


def test_small_kernel_outputs_are_plain_fresh_arrays():
    x = np.ones(nb._PLACE_MIN - 1, np.float32)
    outs = nb._outputs_apart(x, 2)
    assert [(o.shape, o.dtype, o.base) for o in outs] == [(x.shape, np.float32, None)] * 2
    assert not np.shares_memory(outs[0], outs[1])


@pytest.mark.parametrize("value, enabled", [("1", False), ("0", True)])
def test_the_environment_switch_turns_the_kernels_off(value, enabled):
    code = (
        "import numpy as np; import tiegrad.backend.host_dispatch as nb; "
        "print(nb._fused_kernels(np.ones(2, np.float32)) is not None)"
    )
    env = dict(os.environ, TIEGRAD_NO_NUMBA=value)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == str(enabled), out.stderr


def test_relu_vjp_kernel_matches_the_numpy_product_bit_for_bit(monkeypatch):
    rng = np.random.default_rng(11)
    y = np.maximum(rng.standard_normal((300, 70)), 0).astype(np.float32)
    g = rng.standard_normal((300, 70)).astype(np.float32)
    g[0, :4] = [np.nan, np.inf, -np.inf, 0.0]
    y[0, :4] = [0.0, 0.0, 2.0, 0.0]
    with np.errstate(invalid="ignore"):  # inf * 0 on the NumPy path
        got, want = both_paths(monkeypatch, lambda: NUMPY.relu_vjp(g, y))
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_equal(got, want)  # NaN where g is NaN or infinite and y is 0
    assert np.isnan(got[0, 0]) and np.isnan(got[0, 1]) and got[0, 2] == -np.inf


@pytest.mark.parametrize(
    "g,y",
    [
        (np.ones((4, 6)), np.ones((4, 6), np.float32)),  # float64 cotangent: promotes
        (np.ones((6, 4), np.float32).T, np.ones((4, 6), np.float32)),  # strided
        (np.ones((4, 6), np.float32), np.ones((1, 6), np.float32)),  # broadcast
    ],
    ids=["float64", "strided", "broadcast"],
)
def test_relu_vjp_falls_back_to_numpy_outside_the_kernel(fused, g, y):
    got = NUMPY.relu_vjp(g, y)
    want = g * (y > 0)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("threads", [1, 2])
def test_sums_are_numpys_bit_for_bit(monkeypatch, fused, threads):
    monkeypatch.setenv("TIEGRAD_NUM_THREADS", str(threads))
    g = np.random.default_rng(11)
    rows = -(-2 * nb._SHARE_MIN // 96)  # large enough to share
    a = g.standard_normal((rows, 96)).astype(np.float32)
    b = g.standard_normal((rows, 96)).astype(np.float32)
    a[0, :3] = [np.inf, np.nan, -np.inf]
    b[0, :3] = [-np.inf, 1.0, -np.inf]
    with np.errstate(invalid="ignore"):  # inf - inf (one thread: NumPy's own loop)
        want, got = a + b, NUMPY.add(a, b)
    np.testing.assert_array_equal(got, want)
    v = g.standard_normal(96).astype(np.float32)
    x = a.copy()
    assert NUMPY.add_(x, v) is x
    np.testing.assert_array_equal(x, a + v)


def test_sums_outside_the_kernels_keep_numpys_rules(fused):
    a = np.ones((700, 96), np.float32)
    assert NUMPY.add(a, np.ones((700, 96))).dtype == np.float64  # promotion
    np.testing.assert_array_equal(NUMPY.add(a, np.ones(96, np.float32)), a + 1)  # broadcast
    strided = np.ones((700, 192), np.float32)[:, ::2]
    np.testing.assert_array_equal(NUMPY.add(strided, a), strided + a)
    x = np.zeros((700, 96), np.float32)
    NUMPY.add_(x, np.ones(96, np.float64))  # casts like x += b
    assert x.dtype == np.float32 and np.all(x == 1)


@pytest.mark.parametrize("threads", [1, 2])
def test_relu_kernel_is_numpys_maximum_bit_for_bit(monkeypatch, fused, threads):
    monkeypatch.setenv("TIEGRAD_NUM_THREADS", str(threads))
    x = np.random.default_rng(12).standard_normal(70_001).astype(np.float32)
    x[:6] = [np.nan, -0.0, 0.0, -np.inf, np.inf, -1e-45]
    got = NUMPY.relu(x)
    want = np.maximum(x, 0.0)
    np.testing.assert_array_equal(got, want)
    assert np.array_equal(np.signbit(got), np.signbit(want))


def test_index_add_kernel_sums_as_numpys_add_at(fused):
    g = np.random.default_rng(13)
    ids = g.integers(0, 96, 2048)  # many repeats
    values = g.standard_normal((2048, 128)).astype(np.float32)
    out = g.standard_normal((96, 128)).astype(np.float32)
    want = out.copy()
    np.add.at(want, ids, values)
    NUMPY.index_add(out, ids, values)
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("bad", [-1, 96])
def test_index_add_outside_the_kernel_keeps_numpys_rules(fused, bad):
    ids = np.array([0, 5, bad, 5])
    values = np.ones((4, 8), np.float32)
    out = np.zeros((96, 8), np.float32)
    if bad < 0:  # NumPy wraps a negative index
        NUMPY.index_add(out, ids, values)
        assert out[95, 0] == 1 and out[5, 0] == 2
    else:
        with pytest.raises(IndexError):
            NUMPY.index_add(out, ids, values)
