"""Finite-difference gradient checks of tiegrad ops (a helper shared by the test files).

``check_grad(fn, inputs)`` records ``fn`` on float64 leaves, pulls a random cotangent
back through the tape and compares every input's gradient with central differences of
``sum(fn(inputs) * cotangent)``. Each evaluation runs in a fresh session with the same
seed, so ops that draw from the session's generator (dropout) see the same mask.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tiegrad import EagerSession, TensorRef

__all__ = ["check_grad", "numeric_grad"]


def _evaluate(fn: Callable[..., TensorRef], arrays: Sequence[np.ndarray], seed: int) -> np.ndarray:
    s = EagerSession(seed=seed)
    with s.no_grad():
        out = fn(*[s.leaf(a) for a in arrays])
    return np.asarray(out.value, dtype=np.float64)


def numeric_grad(
    fn: Callable[..., TensorRef],
    inputs: Sequence[np.ndarray],
    cotangent: np.ndarray,
    eps: float = 1e-6,
    seed: int = 0,
) -> list[np.ndarray]:
    """Central differences of ``sum(fn(*inputs) * cotangent)`` with respect to each input."""
    arrays = [np.array(a, dtype=np.float64) for a in inputs]
    grads = []
    for a in arrays:
        g = np.zeros_like(a)
        flat, gflat = a.reshape(-1), g.reshape(-1)
        for i in range(flat.size):
            orig = flat[i]
            flat[i] = orig + eps
            hi = float(np.sum(_evaluate(fn, arrays, seed) * cotangent))
            flat[i] = orig - eps
            lo = float(np.sum(_evaluate(fn, arrays, seed) * cotangent))
            flat[i] = orig
            gflat[i] = (hi - lo) / (2 * eps)
        grads.append(g)
    return grads


def check_grad(
    fn: Callable[..., TensorRef],
    inputs: Sequence[Any],
    *,
    eps: float = 1e-6,
    rtol: float = 1e-5,
    atol: float = 1e-7,
    seed: int = 0,
) -> list[np.ndarray]:
    """Assert the tape's gradients of ``fn`` match central finite differences (float64).

    ``fn`` takes one ``TensorRef`` per input (float64 leaves that require grad) and
    returns a ``TensorRef``; other operands (targets, masks) belong in its closure, and
    constants are made with ``ref.session.constant``. Returns the tape's gradients.
    """
    arrays = [np.array(a, dtype=np.float64) for a in inputs]
    s = EagerSession(seed=seed)
    refs = [s.leaf(a) for a in arrays]
    out = fn(*refs)
    value = np.asarray(out.value)
    assert value.dtype == np.float64, f"float64 inputs gave a {value.dtype} output"
    cot = np.random.default_rng(1234).standard_normal(value.shape)
    grads = s.backward(out, seed=cot)
    analytic = [np.asarray(grads[r]) for r in refs]
    numeric = numeric_grad(fn, arrays, cot, eps=eps, seed=seed)
    for k, (ga, gn) in enumerate(zip(analytic, numeric)):
        assert ga.shape == gn.shape, f"input {k}: gradient shape {ga.shape}, expected {gn.shape}"
        assert ga.dtype == np.float64, f"input {k}: gradient dtype {ga.dtype}, expected float64"
        np.testing.assert_allclose(ga, gn, rtol=rtol, atol=atol, err_msg=f"input {k}")
    return analytic
