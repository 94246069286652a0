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
