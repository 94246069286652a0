"""Shape and selection ops: reshape, unsqueeze/squeeze, expand, transpose/permute,
indexing, concat, stack, where."""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral
from typing import Any

from ..errors import IndexRangeError, ShapeError
from ..tape import TensorRef
from ._core import (
    check_broadcast,
    lift,
    normalize_axes,
    scalar_value,
    session_of,
    unbroadcast,
    value_of,
)


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


def unsqueeze(x: TensorRef, axis: int) -> TensorRef:
    """``x`` with a new axis of size 1 at ``axis`` (PyTorch's ``unsqueeze``): ``axis`` is
    an integer in ``[-x.ndim - 1, x.ndim]``, counted in the result; a ``reshape`` node."""
    session_of(x)
    nd = x.value.ndim
    if isinstance(axis, bool) or not isinstance(axis, Integral) or not -nd - 1 <= axis <= nd:
        raise ShapeError(
            f"unsqueeze: axis {axis!r} is out of range for an array of rank {nd}, expected an "
            f"integer in [{-nd - 1}, {nd}]"
        )
    a = int(axis) % (nd + 1)
    shape = tuple(x.value.shape)
    return reshape(x, shape[:a] + (1,) + shape[a:])


def squeeze(x: TensorRef, axis: int | Sequence[int] | None = None) -> TensorRef:
    """``x`` without the size-1 axes ``axis`` (an int or a tuple; None: every size-1
    axis); a ``reshape`` node. An axis of another size is a ``ShapeError`` naming it, as
    in NumPy (PyTorch leaves such an axis in place without a word)."""
    session_of(x)
    shape = tuple(x.value.shape)
    if axis is None:
        axes = tuple(i for i, n in enumerate(shape) if n == 1)
    else:
        axes = normalize_axes(axis, len(shape), "squeeze")
        wide = [a for a in axes if shape[a] != 1]
        if wide:
            raise ShapeError(
                f"squeeze: axis {wide[0]} of shape {shape} has size {shape[wide[0]]}, expected 1"
            )
    return reshape(x, tuple(n for i, n in enumerate(shape) if i not in axes))


def expand(x: TensorRef, shape: Sequence[int]) -> TensorRef:
    """``x`` broadcast to ``shape`` without a copy (PyTorch's ``expand``; a view).

    ``shape`` may add leading axes; ``-1`` keeps an existing axis's size; only axes of
    size 1 stretch. VJP: the cotangent summed over the added and stretched axes.
    """
    s = session_of(x)
    bk = s.backend
    old = tuple(x.value.shape)
    want = tuple(shape)
    lead = len(want) - len(old)
    ok = lead >= 0 and all(isinstance(n, Integral) and not isinstance(n, bool) for n in want)
    if ok:
        new = want[:lead] + tuple(m if n == -1 else n for m, n in zip(old, want[lead:]))
        ok = all(n >= 0 for n in new) and all(m in (1, n) for m, n in zip(old, new[lead:]))
    if not ok:
        raise ShapeError(
            f"expand: cannot expand shape {old} to {want} (only axes of size 1 stretch, -1 "
            "keeps an axis, new axes go in front)"
        )
    out = bk.broadcast_to(x.value, new)
    return s._record(out, (x.id,), lambda g: (unbroadcast(bk, g, old),))


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
