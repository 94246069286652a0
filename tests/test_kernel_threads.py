"""The host kernels on several threads (``host_dispatch._rows_parallel``, issue 17).

A large float32 kernel call of the NumPy backend runs its blocks on the pool of
``tiegrad._threads``, or on numba's threads where those are oneMKL's OpenMP team
(``host_blocks``). Its results must not depend on the number of threads, on which
threads run it or on how the call is cut into blocks, bad layouts must still take the
NumPy path, and a kernel called with operands that disagree raises before it writes
anything.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

numba = pytest.importorskip("numba")

import tiegrad.backend.host_dispatch as nb  # noqa: E402
from tiegrad.backend import NUMPY, blas  # noqa: E402

pytestmark = pytest.mark.skipif(not nb._numba.ENABLED, reason="the kernels are switched off")

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
    targets = np.arange(len(rows)) * 7 % D
    targets[::5] = -100
    loss, vjp = NUMPY.cross_entropy_rows(rows, targets, -100, 0.1, True)
    out["cross_entropy"], out["cross_entropy_backward"] = (loss,), (vjp(loss),)
    return out


@pytest.fixture
def operands():
    g = np.random.default_rng(7)
    x = g.standard_normal(D * 1001).astype(np.float32)  # 1001 rows: a partial last block
    x[5] = np.inf
    x[D * 3 + 1] = np.nan
    return x, g.standard_normal(D).astype(np.float32), g.standard_normal(D).astype(np.float32)


def _route(monkeypatch, threads, share_min=nb._SHARE_MIN):
    monkeypatch.setenv("TIEGRAD_NUM_THREADS", str(threads))
    monkeypatch.setattr(nb, "_SHARE_MIN", share_min)


def test_results_do_not_depend_on_threads_or_blocks(monkeypatch, operands):
    _route(monkeypatch, 1)
    want = _calls(*operands)
    for threads, share_min in ((2, 1 << 15), (2, 500), (3, 97)):
        _route(monkeypatch, threads, share_min)
        got = _calls(*operands)
        for name, arrays in want.items():
            for a, b in zip(arrays, got[name]):
                np.testing.assert_array_equal(a, b, err_msg=f"{name} on {threads} threads")


def test_gelu_vjp_is_the_exact_product(monkeypatch, operands):
    x = operands[0]
    saved = NUMPY.gelu(x)[1]
    _route(monkeypatch, 2, 500)
    np.testing.assert_array_equal(NUMPY.gelu_vjp(x, saved), x * saved)
    wide = x.astype(np.float64)  # another dtype: NumPy's promotion, no kernel
    assert NUMPY.gelu_vjp(wide, saved).dtype == np.float64
    strided = x[::2]
    np.testing.assert_array_equal(NUMPY.gelu_vjp(strided, saved[::2]), strided * saved[::2])


def test_kernels_never_write_into_read_only_arrays(monkeypatch):
    _route(monkeypatch, 2, 500)
    x = np.random.default_rng(3).standard_normal((1000, D)).astype(np.float32)
    before = x.copy()
    x.flags.writeable = False
    assert not NUMPY.softmax_rows_(x)
    assert not NUMPY.softmax_backward_rows_(x, x)
    with pytest.raises(ValueError, match="read-only"):
        NUMPY.add_(x, np.ones(D, np.float32))
    np.testing.assert_array_equal(x, before)


def test_layer_norm_column_sums_are_the_weight_and_bias_cotangents(monkeypatch):
    _route(monkeypatch, 2, 500)
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


def _mismatched():
    """Calls of every kernel with one operand too short: (name, call, arrays it may write)."""
    f = np.float32
    a, short = np.ones(64, f), np.ones(63, f)
    rows, few = np.ones((8, 4), f), np.ones((7, 4), f)
    vec, col = np.ones(4, f), np.ones((8, 1), f)
    part = np.zeros((1, 4), f)
    out = np.zeros(64, f)
    flat_rows = np.zeros(32, f)[:32].reshape(8, 4)
    ids, vec8, out8 = np.arange(8) % 4, np.ones(8, f), np.zeros((8, 4), f)
    return [
        ("relu", lambda k: k.relu(a, short, 0, 64), short),
        ("relu_vjp", lambda k: k.relu_vjp(a, short, out, 0, 64), out),
        ("multiply", lambda k: k.multiply(short, a, out, 0, 64), out),
        ("add", lambda k: k.add(a, a, short, 0, 64), short),
        ("gelu", lambda k: k.gelu(a, out, short, 0, 64), out),
        ("add", lambda k: k.add(rows, rows, flat_rows, 0, 32), flat_rows),  # 2-D, equal sizes
        ("multiply", lambda k: k.multiply(rows, rows, flat_rows, 0, 32), flat_rows),
        ("relu", lambda k: k.relu(a, out, -4, 64), out),
        ("relu_vjp", lambda k: k.relu_vjp(a, a, out, 8, 2), out),
        ("gelu", lambda k: k.gelu(a, out, out.copy(), 0, 65), out),
        ("add_row_vector", lambda k: k.add_row_vector(rows, short, 0, 8), rows),
        ("add_row_vector", lambda k: k.add_row_vector(rows, vec, 0, 9), rows),
        ("index_add_rows", lambda k: k.index_add_rows(rows, np.array([0, 8]), few[:2]), rows),
        ("index_add_rows", lambda k: k.index_add_rows(rows, np.array([0, 1]), few[:1]), rows),
        ("layer_norm", lambda k: k.layer_norm(rows, vec, vec, 1e-5, few, col, rows, 0, 8), few),
        (
            "layer_norm",
            lambda k: k.layer_norm(rows, vec, vec, 1e-5, rows, col[:7], rows, 0, 8),
            rows,
        ),  # fmt: skip
        (
            "layer_norm_backward",
            lambda k: k.layer_norm_backward(rows, vec, rows, col, few, part, part, 0, 8),
            few,
        ),
        (
            "layer_norm_backward",
            lambda k: k.layer_norm_backward(rows, vec, rows, col, rows, part[:0], part, 0, 8),
            rows,
        ),  # fmt: skip
        ("softmax", lambda k: k.softmax(few, 0, 8), few),
        ("softmax_backward", lambda k: k.softmax_backward(rows, few, 0, 8), rows),
        (
            "cross_entropy",
            lambda k: k.cross_entropy(rows, ids, -1, True, few, vec8, vec8, vec8, 0, 8),
            few,
        ),
        (
            "cross_entropy",
            lambda k: k.cross_entropy(rows, ids + 1, -1, False, out8, vec8, vec8, vec8, 0, 8),
            out8,
        ),  # a target of 4 in rows of 4
        (
            "cross_entropy",
            lambda k: k.cross_entropy(rows, ids[:7], -1, False, out8, vec8, vec8, vec8, 0, 8),
            out8,
        ),
        (
            "cross_entropy",
            lambda k: k.cross_entropy(rows, ids, -1, False, out8, vec8, vec8[:7], vec8, 0, 8),
            out8,
        ),
        (
            "cross_entropy",
            lambda k: k.cross_entropy(rows, ids, -1, True, out8, vec8, vec8, vec8[:7], 0, 8),
            out8,
        ),
        (
            "cross_entropy_backward",
            lambda k: k.cross_entropy_backward(rows, ids, -1, vec8[:3], 1.0, 0.0, out8, 0, 8),
            out8,
        ),
        (
            "cross_entropy_backward",
            lambda k: k.cross_entropy_backward(rows, ids[:7], -1, vec8, 1.0, 0.0, out8, 0, 8),
            out8,
        ),
        (
            "cross_entropy_backward",
            lambda k: k.cross_entropy_backward(rows, ids - 1, 5, vec8, 1.0, 0.0, out8, 0, 8),
            out8,
        ),  # a target of -1, and ignore 5
    ]


@pytest.mark.parametrize("case", range(len(_mismatched())))
def test_a_kernel_raises_on_operands_that_disagree_and_writes_nothing(case):
    from tiegrad.backend import host_kernels

    name, call, written = _mismatched()[case]
    before = written.copy()
    with pytest.raises(ValueError, match=name):
        call(host_kernels)
    np.testing.assert_array_equal(written, before)


_TEAM_CHILD = """
import os, sys
import torch  # GNU OpenMP first: oneMKL then runs its products on it, as beside PyTorch
import numpy as np
sys.path.insert(0, sys.argv[1])
from tiegrad.backend import blas
from test_kernel_threads import D, _calls
blas.matmul(np.ones((64, 64), np.float32), np.ones((64, 64), np.float32))
if not blas.on_gnu_openmp():
    print("SKIP: oneMKL is not on GNU OpenMP here")
    sys.exit(0)
g = np.random.default_rng(7)
x = g.standard_normal(D * 3001).astype(np.float32)
x[5], x[D * 3 + 1] = np.inf, np.nan
w, b = g.standard_normal(D).astype(np.float32), g.standard_normal(D).astype(np.float32)
os.environ["TIEGRAD_NUM_THREADS"] = "1"
want = _calls(x, w, b)
os.environ.pop("TIEGRAD_NUM_THREADS")
got = _calls(x, w, b)
team = sys.modules["tiegrad.backend.host_blocks"]
assert team.shares_the_team(), "numba's threading layer is not omp"
kernel = {"gelu_vjp": "multiply", "add_": "add_row_vector"}
unused = [n for n in want if not getattr(team, kernel.get(n, n) + "_blocks").signatures]
assert not unused, unused
for name, arrays in want.items():
    for a, c in zip(arrays, got[name]):
        assert a.tobytes() == c.tobytes(), name
print("OK", team.TEAM)
"""


def test_blocks_on_mkls_openmp_team_give_the_bits_of_one_thread(tmp_path):
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if k != "TIEGRAD_NUM_THREADS"}
    env.update(OMP_NUM_THREADS="2", MKL_NUM_THREADS="2", NUMBA_NUM_THREADS="2")
    if blas.INSTALLED:  # oneMKL whatever the CPU: the team is its OpenMP team
        env["TIEGRAD_BLAS"] = "mkl"
    proc = subprocess.run(
        [sys.executable, "-c", _TEAM_CHILD, str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    if proc.stdout.startswith("SKIP"):
        pytest.skip(proc.stdout.strip())
    assert proc.stdout.startswith("OK 2"), proc.stdout
