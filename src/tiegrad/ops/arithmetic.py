"""Arithmetic: add, sub, mul, div, neg, pow and matmul, each with its VJP beside it.

Binary ops broadcast like NumPy; a Python number operand stays a number (no node).
"""

from __future__ import annotations

from typing import Any

from ..errors import ShapeError
from ..session import TensorRef
from ._core import is_scalar, lift, session_of, unbroadcast


def add(a: Any, b: Any) -> TensorRef:
    s = session_of(a, b)
    bk = s.backend
    if is_scalar(b):
        return s._record(a.value + b, (a.id,), lambda g: (g,))
    if is_scalar(a):
        return s._record(b.value + a, (b.id,), lambda g: (g,))
    a, b = lift(s, a), lift(s, b)
    sa, sb = tuple(a.value.shape), tuple(b.value.shape)
    return s._record(
        a.value + b.value,
        (a.id, b.id),
        lambda g: (unbroadcast(bk, g, sa), unbroadcast(bk, g, sb)),
    )


def sub(a: Any, b: Any) -> TensorRef:
    s = session_of(a, b)
    bk = s.backend
    if is_scalar(b):
        return s._record(a.value - b, (a.id,), lambda g: (g,))
    if is_scalar(a):
        return s._record(a - b.value, (b.id,), lambda g: (-g,))
    a, b = lift(s, a), lift(s, b)
    sa, sb = tuple(a.value.shape), tuple(b.value.shape)
    return s._record(
        a.value - b.value,
        (a.id, b.id),
        lambda g: (unbroadcast(bk, g, sa), unbroadcast(bk, -g, sb)),
    )


def mul(a: Any, b: Any) -> TensorRef:
    s = session_of(a, b)
    bk = s.backend
    if is_scalar(a):
        a, b = b, a
    if is_scalar(b):
        return s._record(a.value * b, (a.id,), lambda g: (g * b,))
    a, b = lift(s, a), lift(s, b)
    av, bv = a.value, b.value
    sa, sb = tuple(av.shape), tuple(bv.shape)
    return s._record(
        av * bv,
        (a.id, b.id),
        lambda g: (unbroadcast(bk, g * bv, sa), unbroadcast(bk, g * av, sb)),
    )


def div(a: Any, b: Any) -> TensorRef:
    s = session_of(a, b)
    bk = s.backend
    if is_scalar(b):
        inv = 1.0 / b
        return s._record(a.value * inv, (a.id,), lambda g: (g * inv,))
    if is_scalar(a):
        bv = b.value
        out = a / bv
        return s._record(out, (b.id,), lambda g: (-g * out / bv,))
    a, b = lift(s, a), lift(s, b)
    av, bv = a.value, b.value
    sa, sb = tuple(av.shape), tuple(bv.shape)
    out = av / bv

    def vjp(g):
        ga = g / bv
        return unbroadcast(bk, ga, sa), unbroadcast(bk, -ga * out, sb)

    return s._record(out, (a.id, b.id), vjp)


def neg(a: TensorRef) -> TensorRef:
    s = session_of(a)
    return s._record(-a.value, (a.id,), lambda g: (-g,))


def pow(a: TensorRef, exponent: float) -> TensorRef:
    """``a ** exponent`` for a scalar exponent."""
    s = session_of(a)
    if not is_scalar(exponent):
        raise ShapeError(
            f"pow: the exponent must be a Python number, got {type(exponent).__name__}"
        )
    av = a.value
    if exponent == 2:
        return s._record(av * av, (a.id,), lambda g: (g * (2.0 * av),))
    return s._record(av**exponent, (a.id,), lambda g: (g * (exponent * av ** (exponent - 1)),))


def matmul(a: Any, b: Any) -> TensorRef:
    """Matrix product with NumPy semantics: 1-D operands, 2-D and batched (broadcast)."""
    s = session_of(a, b)
    bk = s.backend
    a, b = lift(s, a), lift(s, b)
    av, bv = a.value, b.value
    sa, sb = tuple(av.shape), tuple(bv.shape)
    if not sa or not sb or sa[-1] != (sb[0] if len(sb) == 1 else sb[-2]):
        raise ShapeError(f"matmul: shapes {sa} and {sb} are not aligned")
    a2 = bk.reshape(av, (1,) + sa) if len(sa) == 1 else av
    b2 = bk.reshape(bv, sb + (1,)) if len(sb) == 1 else bv
    out2 = bk.matmul(a2, b2)
    out = out2
    if len(sa) == 1:
        out = bk.reshape(out, tuple(out.shape[:-2]) + tuple(out.shape[-1:]))
    if len(sb) == 1:
        out = bk.reshape(out, tuple(out.shape[:-1]))
    oshape2 = tuple(out2.shape)

    def vjp(g):
        g2 = bk.reshape(g, oshape2)
        ga = bk.matmul(g2, _swap(bk, b2))
        gb = bk.matmul(_swap(bk, a2), g2)
        return (
            bk.reshape(unbroadcast(bk, ga, tuple(a2.shape)), sa),
            bk.reshape(unbroadcast(bk, gb, tuple(b2.shape)), sb),
        )

    return s._record(out, (a.id, b.id), vjp)


def _swap(bk, x):
    axes = tuple(range(x.ndim - 2)) + (x.ndim - 1, x.ndim - 2)
    return bk.transpose(x, axes)
