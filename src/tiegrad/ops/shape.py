"""Shape and selection ops: reshape, transpose/permute, indexing, concat, stack, where."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import ShapeError
from ..session import TensorRef
from ._core import lift, session_of, unbroadcast


def reshape(x: TensorRef, shape: Sequence[int]) -> TensorRef:
    s = session_of(x)
    bk = s.backend
    old = tuple(x.value.shape)
    try:
        out = bk.reshape(x.value, tuple(shape))
    except (ValueError, RuntimeError) as e:
        raise ShapeError(f"reshape: cannot reshape {old} to {tuple(shape)}") from e
    return s._record(out, (x.id,), lambda g: (bk.reshape(g, old),))


def permute(x: TensorRef, axes: Sequence[int]) -> TensorRef:
    s = session_of(x)
    bk = s.backend
    nd = x.value.ndim
    axes = tuple(a % nd for a in axes) if nd else ()
    if sorted(axes) != list(range(nd)):
        raise ShapeError(f"permute: axes {tuple(axes)} are not a permutation of {nd} axes")
    inverse = tuple(sorted(range(nd), key=lambda i: axes[i]))
    return s._record(bk.transpose(x.value, axes), (x.id,), lambda g: (bk.transpose(g, inverse),))


def transpose(x: TensorRef, axis0: int = -2, axis1: int = -1) -> TensorRef:
    """Swap two axes (the last two by default)."""
    nd = x.value.ndim
    axes = list(range(nd))
    axes[axis0], axes[axis1] = axes[axis1], axes[axis0]
    return permute(x, axes)


def _plain_index(index: Any) -> Any:
    if isinstance(index, tuple):
        return tuple(i.value if isinstance(i, TensorRef) else i for i in index)
    return index.value if isinstance(index, TensorRef) else index


def getitem(x: TensorRef, index: Any) -> TensorRef:
    """Basic and integer-array indexing; repeated indices accumulate in the VJP."""
    s = session_of(x)
    bk = s.backend
    xv = x.value
    index = _plain_index(index)
    try:
        out = xv[index]
    except IndexError as e:
        raise ShapeError(f"getitem: index {index!r} is invalid for shape {tuple(xv.shape)}") from e
    shape, dtype = tuple(xv.shape), xv.dtype

    def vjp(g):
        z = bk.zeros(shape, dtype)
        bk.accumulate_at(z, index, g)
        return (z,)

    return s._record(out, (x.id,), vjp)


def concat(xs: Sequence[Any], axis: int = 0) -> TensorRef:
    s = session_of(*xs)
    bk = s.backend
    refs = [lift(s, x) for x in xs]
    vals = [r.value for r in refs]
    try:
        out = bk.concat(vals, axis)
    except (ValueError, RuntimeError) as e:
        shapes = [tuple(v.shape) for v in vals]
        raise ShapeError(f"concat: shapes {shapes} cannot be joined on axis {axis}") from e
    ax = axis % out.ndim
    bounds = [0]
    for v in vals:
        bounds.append(bounds[-1] + v.shape[ax])

    def vjp(g):
        lead = (slice(None),) * ax
        return tuple(g[lead + (slice(lo, hi),)] for lo, hi in zip(bounds[:-1], bounds[1:]))

    return s._record(out, tuple(r.id for r in refs), vjp)


def stack(xs: Sequence[Any], axis: int = 0) -> TensorRef:
    s = session_of(*xs)
    bk = s.backend
    refs = [lift(s, x) for x in xs]
    vals = [r.value for r in refs]
    shapes = {tuple(v.shape) for v in vals}
    if len(shapes) != 1:
        raise ShapeError(f"stack: all shapes must be equal, got {sorted(shapes)}")
    out = bk.stack(vals, axis)
    ax = axis % out.ndim

    def vjp(g):
        lead = (slice(None),) * ax
        return tuple(g[lead + (k,)] for k in range(len(vals)))

    return s._record(out, tuple(r.id for r in refs), vjp)


def where(cond: Any, a: Any, b: Any) -> TensorRef:
    """``a`` where ``cond`` holds, else ``b`` (``cond`` is a constant, broadcast)."""
    s = session_of(cond, a, b)
    bk = s.backend
    c = cond.value if isinstance(cond, TensorRef) else bk.asarray(cond)
    a, b = lift(s, a), lift(s, b)
    av, bv = a.value, b.value
    sa, sb = tuple(av.shape), tuple(bv.shape)
    out = bk.where(c, av, bv)
    zero = bk.zeros((), out.dtype)

    def vjp(g):
        return (
            unbroadcast(bk, bk.where(c, g, zero), sa),
            unbroadcast(bk, bk.where(c, zero, g), sb),
        )

    return s._record(out, (a.id, b.id), vjp)
