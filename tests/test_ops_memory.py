"""What the decoder ops keep for backward between forward and backward (the step's
activations): measured with tracemalloc, which sees every NumPy array. Each bound is an
array size of the test's own input, as PyTorch's saved tensors for the same op."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable

import numpy as np

import tiegrad.ops as T
from tiegrad import EagerSession, TensorRef


def held_bytes(record: Callable[[], TensorRef]) -> tuple[int, TensorRef]:
    """The traced bytes that ``record()`` leaves allocated (its output included)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        out = record()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before, out
    finally:
        tracemalloc.stop()


def test_silu_keeps_its_input_alone_for_backward():
    """The output and nothing sigmoid-sized: the VJP computes the sigmoid again."""
    s = EagerSession()
    x = s.leaf(np.random.default_rng(0).standard_normal((64, 4096), dtype=np.float32))
    held, y = held_bytes(lambda: T.silu(x))
    assert y.value.nbytes <= held < 1.5 * x.value.nbytes
    sig = 1.0 / (1.0 + np.exp(-x.value.astype(np.float64)))
    want = sig * (1.0 + x.value * (1.0 - sig))
    np.testing.assert_allclose(s.backward(T.sum(y))[x], want, rtol=1e-5, atol=1e-6)


def test_rms_norm_keeps_the_normalized_rows_not_its_input():
    """The output and the normalized rows (and the per-row scales): the input, a
    decoder's residual stream, is freed once no one else holds it."""
    s = EagerSession()
    x = s.leaf(np.random.default_rng(1).standard_normal((256, 1024), dtype=np.float32))
    w = s.leaf(np.linspace(0.5, 1.5, 1024, dtype=np.float32))
    held, y = held_bytes(lambda: T.rms_norm(x * 2.0, w, 1e-5))
    assert 2 * y.value.nbytes <= held < 2.5 * x.value.nbytes
    g = s.backward(T.sum(y * y))
    assert g[x].shape == x.shape and g[w].shape == w.shape


def test_rotary_with_constant_tables_keeps_no_input():
    """Tables that take no gradient (a model's): the VJP needs only them, so the rotated
    input (a view of a projection's output) is freed."""
    s = EagerSession()
    rng = np.random.default_rng(2)
    x = s.leaf(rng.standard_normal((2, 4, 128, 64), dtype=np.float32))
    cos, sin = T.rope_tables(np.arange(128), 64)
    cos, sin = s.constant(cos), s.constant(sin)
    held, y = held_bytes(lambda: T.rotary(x * 2.0, cos, sin))
    assert y.value.nbytes <= held < 1.5 * x.value.nbytes
    gx = s.backward(y, seed=np.ones(y.shape, np.float32))[x]
    c, sn = cos.value, sin.value  # d(sum of y)/dx: 2 (cos + rotate_half's transpose of sin)
    want = 2.0 * (c + np.concatenate([sn[:, 32:], -sn[:, :32]], -1))
    np.testing.assert_allclose(gx, np.broadcast_to(want, gx.shape), rtol=1e-6, atol=1e-6)
