"""The host kernels on MKL's OpenMP team (``host_kernels.entries``, issue 9).

Where MKL lends its team, every float32 kernel call of the NumPy backend runs the
kernel's C entry point. Its results must not depend on the number of threads or on how
the call is cut into blocks, must agree with the jitted kernels (the route without a
team) to float32 rounding, and bad layouts must still take the NumPy path.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

numba = pytest.importorskip("numba")

import tiegrad.backend.numpy_backend as nb  # noqa: E402
from tiegrad import _threads  # noqa: E402
from tiegrad.backend import NUMPY, blas  # noqa: E402

_LENT = _threads.TEAM if blas.LIBRARY else None  # MKL lends its team as it loads
pytestmark = [
    pytest.mark.skipif(_LENT is None, reason="no OpenMP team: oneMKL is not loaded"),
    pytest.mark.skipif(not nb._numba.ENABLED, reason="the kernels are switched off"),
]

D = 96  # the row size of the row kernels


def _calls(x, w, b):
    """Every kernel of the backend once, on copies: name -> tuple of result arrays."""
    out = {}
    y, saved = NUMPY.gelu(x)
    out["gelu"] = (y, saved)
    out["gelu_vjp"] = (NUMPY.gelu_vjp(x, saved),)
    out["relu_vjp"] = (NUMPY.relu_vjp(x, y),)
    out["relu"] = (NUMPY.relu(x),)
    out["add"] = (NUMPY.add(x, saved),)
    out["add_"] = (NUMPY.add_(x.reshape(-1, D).copy(), w),)
    rows = x.reshape(-1, D)
    ln, xhat, rstd = NUMPY.layer_norm_rows(rows, w, b, 1e-5)
    out["layer_norm"] = (ln, xhat, rstd)
    out["layer_norm_backward"] = NUMPY.layer_norm_backward_rows(
        rows, w, xhat, rstd, (True, True, True)
    )
    p = rows.copy()
    assert NUMPY.softmax_rows_(p)
    gp = rows.copy()
    assert NUMPY.softmax_backward_rows_(gp, p)
    out["softmax"], out["softmax_backward"] = (p,), (gp,)
    return out


@pytest.fixture
def operands():
    g = np.random.default_rng(7)
    x = g.standard_normal(D * 1001).astype(np.float32)  # 1001 rows: a partial last block
    x[5] = np.inf
    x[D * 3 + 1] = np.nan
    return x, g.standard_normal(D).astype(np.float32), g.standard_normal(D).astype(np.float32)


def _route(monkeypatch, threads, team, share_min=1 << 15):
    monkeypatch.setenv("TIEGRAD_NUM_THREADS", str(threads))
    monkeypatch.setattr(_threads, "TEAM", team)
    monkeypatch.setattr(nb, "_SHARE_MIN", share_min)


def test_results_do_not_depend_on_threads_or_blocks(monkeypatch, operands):
    _route(monkeypatch, 1, _LENT)
    want = _calls(*operands)
    for threads, share_min in ((2, 1 << 15), (2, 500), (3, 97)):
        _route(monkeypatch, threads, _LENT, share_min)
        got = _calls(*operands)
        for name, arrays in want.items():
            for a, b in zip(arrays, got[name]):
                np.testing.assert_array_equal(a, b, err_msg=f"{name} on {threads} threads")


def test_a_process_without_its_team_keeps_the_bits(monkeypatch, operands):
    # a forked child that gave a GNU OpenMP team up runs the entry points on its own thread
    _route(monkeypatch, 2, _LENT, 500)
    want = _calls(*operands)
    gone = SimpleNamespace(size=_LENT.size, survives_fork=False, pid=-1)  # lent by a parent
    _route(monkeypatch, 2, gone, 500)
    got = _calls(*operands)
    for name, arrays in want.items():
        for a, b in zip(arrays, got[name]):
            np.testing.assert_array_equal(a, b, err_msg=name)


def test_the_team_agrees_with_the_jitted_kernels(monkeypatch, operands):
    _route(monkeypatch, 1, None)
    want = _calls(*operands)
    _route(monkeypatch, 2, _LENT, 500)
    got = _calls(*operands)
    for name, arrays in want.items():
        for a, b in zip(arrays, got[name]):
            np.testing.assert_allclose(b, a, rtol=2e-6, atol=1e-6, err_msg=name)


def test_gelu_vjp_is_the_exact_product(monkeypatch, operands):
    x = operands[0]
    saved = NUMPY.gelu(x)[1]
    _route(monkeypatch, 2, _LENT, 500)
    np.testing.assert_array_equal(NUMPY.gelu_vjp(x, saved), x * saved)
    wide = x.astype(np.float64)  # another dtype: NumPy's promotion, no kernel
    assert NUMPY.gelu_vjp(wide, saved).dtype == np.float64
    strided = x[::2]
    np.testing.assert_array_equal(NUMPY.gelu_vjp(strided, saved[::2]), strided * saved[::2])


def test_a_job_holds_addresses_and_float32_bits():
    from tiegrad.backend import host_kernels

    a = np.zeros((4, 3), np.float32)
    job = host_kernels.job(2, 3, 4, 3, (a, 1e-5))
    assert job.dtype == np.int64 and job.flags.c_contiguous
    assert list(job[:5]) == [0, 2, 3, 4, 3]
    assert job[5] == a.ctypes.data
    assert np.int32(job[6]).view(np.float32) == np.float32(1e-5)


def test_kernels_never_write_into_read_only_arrays(monkeypatch):
    _route(monkeypatch, 2, _LENT, 500)
    x = np.random.default_rng(3).standard_normal((1000, D)).astype(np.float32)
    before = x.copy()
    x.flags.writeable = False
    assert not NUMPY.softmax_rows_(x)
    assert not NUMPY.softmax_backward_rows_(x, x)
    with pytest.raises(ValueError, match="read-only"):
        NUMPY.add_(x, np.ones(D, np.float32))
    np.testing.assert_array_equal(x, before)


def test_layer_norm_column_sums_are_the_weight_and_bias_cotangents(monkeypatch):
    _route(monkeypatch, 2, _LENT, 500)
    g = np.random.default_rng(5)
    rows = g.standard_normal((1001, D)).astype(np.float32)
    w = g.standard_normal(D).astype(np.float32)
    _, xhat, rstd = NUMPY.layer_norm_rows(rows, w, None, 1e-5)
    cot = g.standard_normal((1001, D)).astype(np.float32)
    gx, gw, gb = NUMPY.layer_norm_backward_rows(cot, w, xhat, rstd, (True, True, True))
    wide = cot.astype(np.float64)
    np.testing.assert_allclose(gw, (wide * xhat).sum(axis=0), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gb, wide.sum(axis=0), rtol=1e-4, atol=1e-4)
    assert NUMPY.layer_norm_backward_rows(cot, w, xhat, rstd, (True, False, False))[1:] == (
        None,
        None,
    )
