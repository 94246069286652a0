"""Gradient norms and the finiteness check: one read of each array in its own dtype.

Used by the optimizers' non-finite check and by gradient clipping. A sum of squares
is a single BLAS ``dot`` over the flattened array. A finite sum proves every element
finite; a sum that is not finite is either a NaN or infinity among the elements or an
overflow of finite elements, and only then are the elements themselves examined.
Overflows are detected and handled here, so NumPy's overflow warnings are silenced.
"""

from __future__ import annotations

import math

import numpy as np


def sum_of_squares(g: np.ndarray) -> float:
    """``sum(g**2)`` as a float; a sum that overflows a narrower dtype is redone in float64.

    NaN or inf when ``g`` holds a NaN or an infinity, and inf when finite elements'
    sum overflows float64 as well (as torch's norms do). Whether ``g`` is finite is
    ``all_finite``'s question: a finite ``g`` may have an infinite sum of squares.
    """
    f = g.reshape(-1)
    with np.errstate(over="ignore"):
        s = float(np.dot(f, f))
        if math.isfinite(s) or f.dtype.itemsize >= 8 or not np.isfinite(f).all():
            return s
        f = f.astype(np.float64)
        return float(np.dot(f, f))


def all_finite(g: np.ndarray) -> bool:
    """Whether every element of ``g`` is finite, decided by the values themselves.

    One ``dot`` when its sum is finite; otherwise (a non-finite element, or finite
    elements whose squares overflow) one ``isfinite`` pass over the elements.
    """
    f = g.reshape(-1)
    with np.errstate(over="ignore"):
        return math.isfinite(float(np.dot(f, f))) or bool(np.isfinite(f).all())


def vector_norm(g: np.ndarray, norm_type: float) -> float:
    """The ``norm_type``-norm of ``g`` flattened (``math.inf``: the largest magnitude).

    inf when ``g`` holds an infinity or the norm overflows float64 (as torch's
    ``clip_grad_norm_`` reports it), NaN when ``g`` holds a NaN.
    """
    if g.size == 0:
        return 0.0
    if norm_type == 2.0:
        return math.sqrt(sum_of_squares(g))
    a = np.abs(g.reshape(-1))
    if norm_type == math.inf:
        return float(a.max())
    with np.errstate(over="ignore"):
        return float(np.sum(a.astype(np.float64) ** norm_type) ** (1.0 / norm_type))
