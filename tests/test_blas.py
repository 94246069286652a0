"""The host backend's MKL path for matrix products (``tiegrad.backend.blas``).

Each layout MKL is handed must give ``np.matmul``'s shape, dtype and values (float64 to
1e-12) without calling NumPy; each layout it cannot read must go to NumPy unchanged.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import numpy as np
import pytest

from tiegrad.backend import NUMPY, blas

needs_mkl = pytest.mark.skipif(blas.LIBRARY is None, reason="oneMKL is not installed")
rng = np.random.default_rng(7)


def _operand(shape: tuple[int, ...], layout: str, dtype: type) -> np.ndarray:
    """An operand of ``shape`` stored as ``layout``: c, t (transposed), pad, step or neg."""
    *lead, r, c = shape
    lead = tuple(lead)
    if layout == "t":
        return np.swapaxes(rng.standard_normal(lead + (c, r)).astype(dtype), -1, -2)
    if layout == "pad":
        return rng.standard_normal(lead + (r, c + 3)).astype(dtype)[..., :c]
    if layout == "step":
        return rng.standard_normal(lead + (r, 2 * c)).astype(dtype)[..., ::2]
    if layout == "neg":
        return rng.standard_normal(lead + (r, c)).astype(dtype)[..., ::-1, :]
    return rng.standard_normal(shape).astype(dtype)


class _Spy:
    """Counts calls of ``np.matmul`` while delegating to it."""

    def __init__(self, real):
        self.real, self.calls = real, 0

    def __call__(self, a, b):
        self.calls += 1
        return self.real(a, b)


@pytest.fixture
def numpy_calls(monkeypatch):
    spy = _Spy(np.matmul)
    monkeypatch.setattr(np, "matmul", spy)
    return spy


BATCHES = [
    ((), ()),
    ((3,), ()),
    ((), (3,)),
    ((4,), (4,)),
    ((2, 3), (2, 3)),
    ((2, 3), ()),
    ((2, 3), (3,)),  # b repeats along the outer axis: matrices given by address
    ((2, 1), (1, 4)),  # an outer product of batches
]
SIZES = [(5, 7, 3), (1, 4, 6), (6, 4, 1), (1, 1, 1), (8, 1, 5)]


@needs_mkl
@pytest.mark.parametrize("la,lb", list(itertools.product(["c", "t", "pad"], repeat=2)))
@pytest.mark.parametrize("lead", BATCHES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_readable_layouts_go_to_mkl_and_match_numpy(la, lb, lead, dtype, numpy_calls):
    for m, k, n in SIZES:
        a = _operand(lead[0] + (m, k), la, dtype)
        b = _operand(lead[1] + (k, n), lb, dtype)
        got = blas.matmul(a, b)
        want = numpy_calls.real(a, b)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert got.flags.c_contiguous
        tol = 1e-12 if dtype == np.float64 else 1e-5
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    assert numpy_calls.calls == 0


@needs_mkl
def test_broadcast_operand_with_zero_stride_goes_to_mkl(numpy_calls):
    a = np.broadcast_to(rng.standard_normal((5, 7)), (4, 5, 7))
    b = rng.standard_normal((4, 7, 3))
    np.testing.assert_allclose(blas.matmul(a, b), numpy_calls.real(a, b), rtol=1e-12)
    assert numpy_calls.calls == 0


@needs_mkl
@pytest.mark.parametrize("layout", ["c", "t", "pad"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_vector_products_go_to_mkl_and_match_numpy(layout, dtype, numpy_calls):
    tol = 1e-12 if dtype == np.float64 else 1e-5
    for rows, cols in [(5, 7), (1, 4), (6, 1)]:
        mat = _operand((rows, cols), layout, dtype)
        right = rng.standard_normal(2 * cols).astype(dtype)[::2]
        left = rng.standard_normal(rows).astype(dtype)
        for a, b in [(mat, right), (left, mat), (right, right)]:
            got = blas.matmul(a, b)
            want = numpy_calls.real(a, b)
            assert np.shape(got) == np.shape(want) and got.dtype == want.dtype
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    assert numpy_calls.calls == 0


@needs_mkl
def test_head_views_and_reversed_batches_go_to_mkl(numpy_calls):
    qkv = rng.standard_normal((3, 7, 3 * 4 * 5)).astype(np.float32)  # (B, T, 3 * H * D)
    heads = qkv.reshape(3, 7, 3, 4, 5)
    q = heads[:, :, 0].transpose(0, 2, 1, 3)  # (B, H, T, D): batch strides do not collapse
    kt = heads[:, :, 1].transpose(0, 2, 3, 1)
    stepped = _operand((2, 3, 4, 5), "c", np.float32)[:, ::2]
    for a, b in [(q, kt), (q[::-1], kt), (q, kt[:, ::-1]), (stepped, kt[:2, :2, :5, :2])]:
        np.testing.assert_allclose(blas.matmul(a, b), numpy_calls.real(a, b), rtol=1e-5)
    assert numpy_calls.calls == 0


@pytest.mark.parametrize(
    "a,b",
    [
        (_operand((4, 5), "step", np.float32), _operand((5, 3), "c", np.float32)),
        (_operand((4, 5), "c", np.float64), _operand((5, 3), "neg", np.float64)),
        (np.ones((2, 3), np.float32), np.ones((3, 2), np.float64)),
        (np.ones((2, 3), np.int64), np.ones((3, 2), np.int64)),
        (np.ones((2, 3), np.float16), np.ones((3, 2), np.float16)),
        (np.ones((0, 3), np.float32), np.ones((3, 2), np.float32)),
        (np.ones((2, 0), np.float32), np.ones((0, 2), np.float32)),
        (np.ones(3, np.float32)[::-1], np.ones((3, 2), np.float32)),
        (_operand((2, 4, 3), "c", np.float32), np.ones(3, np.float32)),
    ],
    ids=[
        "strided",
        "negative",
        "mixed-dtype",
        "int",
        "float16",
        "empty",
        "k=0",
        "negative-vector",
        "batch-vector",
    ],
)
def test_other_layouts_go_to_numpy_unchanged(a, b, numpy_calls):
    got = blas.matmul(a, b)
    assert numpy_calls.calls == 1
    want = numpy_calls.real(a, b)
    assert got.dtype == want.dtype and np.array_equal(got, want)


def test_mismatched_operands_raise_numpy_errors():
    with pytest.raises(ValueError):
        blas.matmul(np.ones((2, 3), np.float32), np.ones((4, 2), np.float32))
    with pytest.raises(ValueError):
        blas.matmul(np.ones((2, 3, 4), np.float32), np.ones((3, 4, 5), np.float32))


@needs_mkl
def test_products_repeat_bit_for_bit_whatever_the_alignment():
    a = rng.standard_normal((300, 129)).astype(np.float32)
    b = rng.standard_normal((129, 77)).astype(np.float32)
    first = blas.matmul(a, b)
    for offset in range(1, 16):
        aa = np.empty(a.size + offset, np.float32)[offset:].reshape(a.shape)
        bb = np.empty(b.size + offset, np.float32)[offset:].reshape(b.shape)
        aa[...], bb[...] = a, b
        assert np.array_equal(blas.matmul(aa, bb), first)


def test_the_host_backend_multiplies_through_this_module():
    expected = blas.matmul if blas.LIBRARY else np.matmul
    assert NUMPY.matmul is expected


def _import_in_child(env_value: str, code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TIEGRAD_BLAS=env_value)
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def test_environment_switch_numpy_turns_mkl_off():
    run = _import_in_child("numpy", "from tiegrad.backend import blas; print(blas.LIBRARY)")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "None"


def test_environment_switch_rejects_unknown_values():
    run = _import_in_child("openblas", "import tiegrad")
    assert run.returncode != 0
    assert "ConfigError" in run.stderr and "TIEGRAD_BLAS='openblas'" in run.stderr


def test_required_mkl_that_is_missing_is_an_error_naming_the_folder():
    code = "import sys; sys.prefix = sys.prefix + '/no-such-env'; import tiegrad"
    run = _import_in_child("mkl", code)
    assert run.returncode != 0
    assert "ConfigError" in run.stderr and "no-such-env" in run.stderr
