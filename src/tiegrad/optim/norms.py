"""Gradient norms: one read of each array, in its own dtype, with an exact fallback.

Used by the optimizers' non-finite check and by gradient clipping. A sum of squares
is a single BLAS ``dot`` over the flattened array: finite exactly when every element
is finite, except when finite elements overflow the dtype, which is detected and
recomputed in float64.
"""

from __future__ import annotations

import math

import numpy as np


def sum_of_squares(g: np.ndarray) -> float:
    """``sum(g**2)`` as a float: inf or NaN only when ``g`` holds a non-finite element."""
    f = g.reshape(-1)
    s = float(np.dot(f, f))
    if math.isfinite(s) or not np.isfinite(f).all():
        return s
    f = f.astype(np.float64)
    return float(np.dot(f, f))


def vector_norm(g: np.ndarray, norm_type: float) -> float:
    """The ``norm_type``-norm of ``g`` flattened (``math.inf``: the largest magnitude)."""
    if g.size == 0:
        return 0.0
    if norm_type == 2.0:
        return math.sqrt(sum_of_squares(g))
    a = np.abs(g.reshape(-1))
    if norm_type == math.inf:
        return float(a.max())
    return float(np.sum(a.astype(np.float64) ** norm_type) ** (1.0 / norm_type))
