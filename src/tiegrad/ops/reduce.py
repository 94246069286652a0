"""Reductions over axes: sum, mean and max, with ``keepdims``."""

from __future__ import annotations

from typing import Any

from ..session import TensorRef
from ._core import normalize_axes, session_of


def _kept_shape(shape: tuple[int, ...], axes: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(1 if i in axes else n for i, n in enumerate(shape))


def sum(x: TensorRef, axis: Any = None, keepdims: bool = False) -> TensorRef:
    s = session_of(x)
    bk = s.backend
    shape = tuple(x.value.shape)
    axes = normalize_axes(axis, len(shape))
    kshape = _kept_shape(shape, axes)
    out = bk.sum(x.value, axis=axes, keepdims=keepdims)
    return s._record(out, (x.id,), lambda g: (bk.broadcast_to(bk.reshape(g, kshape), shape),))


def mean(x: TensorRef, axis: Any = None, keepdims: bool = False) -> TensorRef:
    s = session_of(x)
    bk = s.backend
    shape = tuple(x.value.shape)
    axes = normalize_axes(axis, len(shape))
    kshape = _kept_shape(shape, axes)
    n = 1
    for a in axes:
        n *= shape[a]
    inv = 1.0 / n
    out = bk.sum(x.value, axis=axes, keepdims=keepdims) * inv
    return s._record(out, (x.id,), lambda g: (bk.broadcast_to(bk.reshape(g * inv, kshape), shape),))


def max(x: TensorRef, axis: Any = None, keepdims: bool = False) -> TensorRef:
    """Maximum over axes; the gradient is split evenly among tied maxima (like ``amax``)."""
    s = session_of(x)
    bk = s.backend
    xv = x.value
    shape = tuple(xv.shape)
    axes = normalize_axes(axis, len(shape))
    kshape = _kept_shape(shape, axes)
    mk = bk.max(xv, axis=axes, keepdims=True)
    out = mk if keepdims else bk.reshape(mk, tuple(n for i, n in enumerate(shape) if i not in axes))

    def vjp(g):
        mask = bk.astype(xv == mk, xv.dtype)
        count = bk.sum(mask, axis=axes, keepdims=True)
        return (mask * (bk.reshape(g, kshape) / count),)

    return s._record(out, (x.id,), vjp)
