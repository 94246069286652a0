"""Shape and selection ops: reshape, transpose/permute, indexing, concat, stack, where."""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral
from typing import Any

from ..errors import IndexRangeError, ShapeError
from ..tape import TensorRef
from ._core import check_broadcast, lift, scalar_value, session_of, unbroadcast, value_of


def reshape(x: TensorRef, shape: Sequence[int]) -> TensorRef:
    """``x`` with a new shape of the same size (one ``-1`` allowed); VJP: reshape back."""
    s = session_of(x)
    bk = s.backend
    old = tuple(x.value.shape)
    try:
        out = bk.reshape(x.value, tuple(shape))
    except (ValueError, RuntimeError, TypeError) as e:
        raise ShapeError(f"reshape: cannot reshape {old} to {tuple(shape)}") from e
    return s._record(out, (x.id,), lambda g: (bk.reshape(g, old),))


def permute(x: TensorRef, axes: Sequence[int]) -> TensorRef:
    """``x`` with its axes reordered (``axes[i]`` is the source of output axis ``i``)."""
    s = session_of(x)
    bk = s.backend
    nd = x.value.ndim
    axes = tuple(axes)
    if len(axes) != nd or not all(isinstance(a, Integral) and -nd <= a < nd for a in axes):
        raise ShapeError(f"permute: axes {axes} are not a permutation of {nd} axes")
    axes = tuple(int(a) % nd for a in axes)
    if sorted(axes) != list(range(nd)):
        raise ShapeError(f"permute: axes {axes} are not a permutation of {nd} axes")
    inverse = tuple(sorted(range(nd), key=lambda i: axes[i]))
    return s._record(bk.transpose(x.value, axes), (x.id,), lambda g: (bk.transpose(g, inverse),))


def transpose(x: TensorRef, axis0: int = -2, axis1: int = -1) -> TensorRef:
    """Swap two axes (the last two by default)."""
    nd = x.value.ndim
    for a in (axis0, axis1):
        if not -nd <= a < nd:
            raise ShapeError(f"transpose: axis {a} is out of range for an array of rank {nd}")
    axes = list(range(nd))
    axes[axis0], axes[axis1] = axes[axis1], axes[axis0]
    return permute(x, axes)


def _plain_index(s, index: Any) -> Any:
    if isinstance(index, tuple):
        return tuple(_plain_index(s, i) for i in index)
    if isinstance(index, TensorRef):
        s.check(index)
        return index.value
    return index


def getitem(x: TensorRef, index: Any) -> TensorRef:
    """Basic and integer-array (or boolean mask) indexing, as NumPy's ``x[index]``.

    Index arrays may be refs (their values are used). The VJP scatter-adds the
    cotangent into zeros, so repeated indices accumulate.
    """
    s = session_of(x)
    bk = s.backend
    xv = x.value
    index = _plain_index(s, index)
    try:
        index = bk.index(index)
        out = xv[index]
    except IndexError as e:
        raise IndexRangeError(
            f"getitem: index {index!r} is invalid for shape {tuple(xv.shape)} ({e})"
        ) from None
    shape, dtype = tuple(xv.shape), xv.dtype

    def vjp(g):
        z = bk.zeros(shape, dtype)
        bk.accumulate_at(z, index, g)
        return (z,)

    return s._record(out, (x.id,), vjp)


def concat(xs: Sequence[Any], axis: int = 0) -> TensorRef:
    """Join arrays along an existing axis; VJP: the matching slices of the cotangent."""
    xs = list(xs)  # a generator is read once
    s = session_of(*xs)
    bk = s.backend
    vals = [value_of(s, x) for x in xs]
    shapes = [tuple(v.shape) for v in vals]
    nd = len(shapes[0])
    ax = axis % nd if -nd <= axis < nd else None

    def others(sh: tuple[int, ...]) -> tuple[int, ...]:
        return sh[:ax] + sh[ax + 1 :]

    if ax is None or any(len(sh) != nd or others(sh) != others(shapes[0]) for sh in shapes):
        raise ShapeError(f"concat: shapes {shapes} cannot be joined on axis {axis}")
    out = bk.concat(vals, axis)
    refs = [lift(s, x, v) for x, v in zip(xs, vals)]
    bounds = [0]
    for sh in shapes:
        bounds.append(bounds[-1] + sh[ax])

    def vjp(g):
        lead = (slice(None),) * ax
        return tuple(g[lead + (slice(lo, hi),)] for lo, hi in zip(bounds[:-1], bounds[1:]))

    return s._record(out, tuple(r.id for r in refs), vjp)


def stack(xs: Sequence[Any], axis: int = 0) -> TensorRef:
    """Join equal-shaped arrays along a new axis; VJP: the matching slices."""
    xs = list(xs)  # a generator is read once
    s = session_of(*xs)
    bk = s.backend
    vals = [value_of(s, x) for x in xs]
    shapes = [tuple(v.shape) for v in vals]
    if len(set(shapes)) != 1:
        raise ShapeError(f"stack: all shapes must be equal, got {shapes}")
    nd = len(shapes[0]) + 1
    if not -nd <= axis < nd:
        raise ShapeError(f"stack: axis {axis} is out of range for a result of rank {nd}")
    out = bk.stack(vals, axis)
    refs = [lift(s, x, v) for x, v in zip(xs, vals)]
    ax = axis % nd

    def vjp(g):
        lead = (slice(None),) * ax
        return tuple(g[lead + (k,)] for k in range(len(vals)))

    return s._record(out, tuple(r.id for r in refs), vjp)


def _fits(bk: Any, number: int | float | None, dtype: Any) -> bool:
    """Whether ``number`` (None: not a number) takes ``dtype`` without losing its kind."""
    return number is not None and (isinstance(number, int) or bk.is_floating(dtype))


def where(cond: Any, a: Any, b: Any) -> TensorRef:
    """``a`` where ``cond`` holds, else ``b`` (``cond`` is a constant; all broadcast).

    A Python number for one of ``a`` and ``b`` takes the other's dtype where that holds
    it (an integer, or any number for a floating dtype), as in PyTorch: ``where(mask,
    x, 0)`` of a float32 ``x`` is float32.
    """
    s = session_of(cond, a, b)
    bk = s.backend
    c = value_of(s, cond)
    av, bv = value_of(s, a), value_of(s, b)
    na, nb = scalar_value(a), scalar_value(b)
    if na is None and _fits(bk, nb, av.dtype):
        bv = bk.astype(bv, av.dtype)
    elif nb is None and _fits(bk, na, bv.dtype):
        av = bk.astype(av, bv.dtype)
    check_broadcast("where", av, bv)
    check_broadcast("where", c, av)
    check_broadcast("where", c, bv)
    out = bk.where(c, av, bv)
    a, b = lift(s, a, av), lift(s, b, bv)
    sa, sb = tuple(av.shape), tuple(bv.shape)
    zero = bk.zeros((), out.dtype)

    def vjp(g):
        return (
            unbroadcast(bk, bk.where(c, g, zero), sa),
            unbroadcast(bk, bk.where(c, zero, g), sb),
        )

    return s._record(out, (a.id, b.id), vjp)
