"""Reductions over axes: sum, mean and max, with ``keepdims``.

VJPs are module-level functions bound with ``functools.partial`` (see ``arithmetic``).
Half-precision sums accumulate in float32 (``scaled_sum``), as PyTorch's do.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

from ..backend import Array, Backend
from ..errors import ShapeError
from ..tape import TensorRef
from ._core import normalize_axes, session_of


def half_to_float32(bk: Backend, dtype: Any) -> Any:
    """``bk.float32`` for a half-precision ``dtype`` (float16, bfloat16), else None.

    Half precision is computed in float32 where it would overflow or lose its low bits
    (sums, means, row statistics: PyTorch's accumulation type) and where NumPy has no
    half-precision routine (random draws); other dtypes run as they are.
    """
    return bk.float32 if dtype.itemsize == 2 and bk.is_floating(dtype) else None


def scaled_sum(
    bk: Backend, x: Array, axis: Any = None, keepdims: bool = False, scale: float | None = None
) -> Array:
    """``bk.sum(x, axis, keepdims) * scale`` (no product without ``scale``; with one, even
    1, the product makes an integer or bool sum floating, as a mean is).

    A half-precision ``x`` is summed and scaled in float32 and rounded back once: a
    float16 mean of 70000 ones is 1, not ``inf``. Other dtypes give the bits they did.
    """
    wide = half_to_float32(bk, x.dtype)
    out = bk.sum(x if wide is None else bk.astype(x, wide), axis=axis, keepdims=keepdims)
    if scale is not None:
        out = out * scale
    return out if wide is None else bk.astype(out, x.dtype)


def _kept_shape(shape: tuple[int, ...], axes: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(1 if i in axes else n for i, n in enumerate(shape))


def _spread_vjp(bk, kshape, shape, scale, g):
    """Broadcast ``g * scale`` back over the reduced axes (a read-only view, no copy)."""
    if scale != 1.0:
        g = g * scale
    return (bk.broadcast_to(bk.reshape(g, kshape), shape),)


def _max_vjp(bk, xv, mk, axes, kshape, g):
    mask = bk.astype(xv == mk, xv.dtype)
    count = bk.sum(mask, axis=axes, keepdims=True)
    return (mask * (bk.reshape(g, kshape) / count),)


def sum(x: TensorRef, axis: Any = None, keepdims: bool = False) -> TensorRef:
    """Sum over ``axis`` (all by default); VJP: ``g`` broadcast back.

    Half precision accumulates in float32 (``scaled_sum``).
    """
    s = session_of(x)
    bk = s.backend
    shape = tuple(x.value.shape)
    axes = normalize_axes(axis, len(shape), "sum")
    out = scaled_sum(bk, x.value, axes, keepdims)
    vjp = partial(_spread_vjp, bk, _kept_shape(shape, axes), shape, 1.0)
    return s._record(out, (x.id,), vjp)


def mean(x: TensorRef, axis: Any = None, keepdims: bool = False) -> TensorRef:
    """Mean over ``axis`` (all by default); VJP: ``g / n`` broadcast back.

    Over no elements (an empty axis) the mean is NaN, as in PyTorch and NumPy. Half
    precision accumulates in float32 (``scaled_sum``).
    """
    s = session_of(x)
    bk = s.backend
    shape = tuple(x.value.shape)
    axes = normalize_axes(axis, len(shape), "mean")
    n = math.prod(shape[a] for a in axes)
    inv = 1.0 / n if n else math.nan
    out = scaled_sum(bk, x.value, axes, keepdims, inv)
    vjp = partial(_spread_vjp, bk, _kept_shape(shape, axes), shape, inv)
    return s._record(out, (x.id,), vjp)


def max(x: TensorRef, axis: Any = None, keepdims: bool = False) -> TensorRef:
    """Maximum over axes; the gradient is split evenly among tied maxima (like ``amax``)."""
    s = session_of(x)
    bk = s.backend
    xv = x.value
    shape = tuple(xv.shape)
    axes = normalize_axes(axis, len(shape), "max")
    empty = [i for i in axes if shape[i] == 0]
    if empty:
        raise ShapeError(
            f"max: axis {empty[0]} of the input's shape {shape} has no element; the "
            "maximum of no elements is undefined (as in NumPy and PyTorch)"
        )
    mk = bk.max(xv, axis=axes, keepdims=True)
    out = mk if keepdims else bk.reshape(mk, tuple(n for i, n in enumerate(shape) if i not in axes))
    vjp = partial(_max_vjp, bk, xv, mk, axes, _kept_shape(shape, axes))
    return s._record(out, (x.id,), vjp)
