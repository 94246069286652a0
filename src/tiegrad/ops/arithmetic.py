"""Arithmetic: add, sub, mul, div, neg, pow and matmul, each with its VJP beside it.

Binary ops broadcast like NumPy; a Python (or NumPy) number operand stays a number
(no leaf, no dtype promotion). Operands that do not broadcast raise ``ShapeError``.
These are the hottest ops, so equal shapes and two refs take a short path
(docs/design.md: performance), and a VJP computes only the cotangents of operands that
need one.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

from ..errors import DTypeError, ShapeError
from ..tape import TensorRef
from ._core import (
    broadcast_error,
    check_broadcast,
    operands,
    ref_pair,
    scalar_value,
    session_of,
    swap_last,
    unbroadcast,
)

# VJPs are module-level functions bound with ``functools.partial``: one object per node,
# where a closure costs a function plus a cell per captured name, all of them tracked
# by the garbage collector while the tape holds them (docs/design.md: performance).


def _pass(g):
    return (g,)


def _pass2(g):
    return g, g


def _negate(g):
    return (-g,)


def _scale(c, g):
    return (g * c,)


def _none(g):
    return (None,)


def _add_vjp(bk, sa, sb, g):
    return unbroadcast(bk, g, sa), unbroadcast(bk, g, sb)


def _sub_vjp(bk, sa, sb, want_b, g):
    return unbroadcast(bk, g, sa), (unbroadcast(bk, -g, sb) if want_b else None)


def _mul_vjp(bk, av, bv, want_a, want_b, g):
    return (
        unbroadcast(bk, g * bv, tuple(av.shape)) if want_a else None,
        unbroadcast(bk, g * av, tuple(bv.shape)) if want_b else None,
    )


def _divide(c, g):
    return (g / c,)


# The divisor's cotangent as PyTorch computes it, ``-g * ((a / b) / b)``: ``(g / b) * out``
# overflows first where ``b`` is tiny.
def _div_vjp(bk, bv, out, sa, want_a, want_b, g):
    return (
        unbroadcast(bk, g / bv, sa) if want_a else None,
        unbroadcast(bk, -g * (out / bv), tuple(bv.shape)) if want_b else None,
    )


def _rdiv_vjp(bv, out, g):
    return (-g * (out / bv),)


def _square_vjp(av, g):
    return (g * (2.0 * av),)


def _pow_vjp(av, c, g):
    return (g * (c * av ** (c - 1)),)


def _matmul2_vjp(bk, av, bv, want_a, want_b, g):
    return (
        bk.matmul(g, bk.transpose(bv, (1, 0))) if want_a else None,
        bk.matmul(bk.transpose(av, (1, 0)), g) if want_b else None,
    )


def add(a: Any, b: Any) -> TensorRef:
    """``a + b``; VJP: ``g`` to each operand, summed over broadcast axes."""
    s = ref_pair(a, b)
    if s is None:
        c = scalar_value(b)
        if c is not None:
            return session_of(a)._record(a.value + c, (a.id,), _pass)
        c = scalar_value(a)
        if c is not None:
            return session_of(b)._record(b.value + c, (b.id,), _pass)
        s, a, b = operands("add", a, b, check_broadcast)
    av, bv = a.value, b.value
    try:
        out = s.backend.add(av, bv)
    except (ValueError, RuntimeError):
        raise broadcast_error("add", av, bv) from None
    sa, sb = tuple(av.shape), tuple(bv.shape)
    vjp = _pass2 if sa == sb else partial(_add_vjp, s.backend, sa, sb)
    return s._record(out, (a.id, b.id), vjp)


def sub(a: Any, b: Any) -> TensorRef:
    """``a - b``; VJP: ``g`` and ``-g``, summed over broadcast axes."""
    s = ref_pair(a, b)
    if s is None:
        c = scalar_value(b)
        if c is not None:
            return session_of(a)._record(a.value - c, (a.id,), _pass)
        c = scalar_value(a)
        if c is not None:
            return session_of(b)._record(c - b.value, (b.id,), _negate)
        s, a, b = operands("sub", a, b, check_broadcast)
    av, bv = a.value, b.value
    try:
        out = av - bv
    except (ValueError, RuntimeError):
        raise broadcast_error("sub", av, bv) from None
    vjp = partial(_sub_vjp, s.backend, tuple(av.shape), tuple(bv.shape), s._rg[b.id])
    return s._record(out, (a.id, b.id), vjp)


def mul(a: Any, b: Any) -> TensorRef:
    """``a * b``; VJP: ``g * b`` and ``g * a``, summed over broadcast axes."""
    s = ref_pair(a, b)
    if s is None:
        c = scalar_value(b)
        if c is None:
            c = scalar_value(a)
            if c is not None:
                a = b
        if c is not None:
            return session_of(a)._record(a.value * c, (a.id,), partial(_scale, c))
        s, a, b = operands("mul", a, b, check_broadcast)
    av, bv = a.value, b.value
    try:
        out = av * bv
    except (ValueError, RuntimeError):
        raise broadcast_error("mul", av, bv) from None
    rg = s._rg
    vjp = partial(_mul_vjp, s.backend, av, bv, rg[a.id], rg[b.id])
    return s._record(out, (a.id, b.id), vjp)


def div(a: Any, b: Any) -> TensorRef:
    """``a / b``; VJP: ``g / b`` and ``-g * a / b**2``, summed over broadcast axes.

    A number divisor divides (PyTorch's bits; a product with ``1 / b`` differs in the
    last bit, and overflows where ``1 / b`` does not fit the array's dtype); ``a / 0``
    gives PyTorch's +-inf and NaN without NumPy's warning.
    """
    s = ref_pair(a, b)
    if s is None:
        c = scalar_value(b)
        if c == 0:
            inf = math.copysign(math.inf, c)
            return session_of(a)._record(a.value * inf, (a.id,), partial(_scale, inf))
        if c is not None:
            return session_of(a)._record(a.value / c, (a.id,), partial(_divide, c))
        c = scalar_value(a)
        if c is not None:
            bv = b.value
            out = c / bv
            return session_of(b)._record(out, (b.id,), partial(_rdiv_vjp, bv, out))
        s, a, b = operands("div", a, b, check_broadcast)
    av, bv = a.value, b.value
    try:
        out = av / bv
    except (ValueError, RuntimeError):
        raise broadcast_error("div", av, bv) from None
    rg = s._rg
    vjp = partial(_div_vjp, s.backend, bv, out, tuple(av.shape), rg[a.id], rg[b.id])
    return s._record(out, (a.id, b.id), vjp)


def neg(a: TensorRef) -> TensorRef:
    """``-a``; VJP: ``-g``."""
    s = session_of(a)
    return s._record(-a.value, (a.id,), _negate)


def pow(a: TensorRef, exponent: float) -> TensorRef:
    """``a ** exponent`` for a scalar exponent; VJP: ``g * exponent * a ** (exponent - 1)``.

    Exponent 0 gives ones and a zero gradient (no ``0 * inf`` at ``a == 0``).
    """
    s = session_of(a)
    c = scalar_value(exponent)
    if c is None:
        shaped = hasattr(exponent, "shape") and not isinstance(exponent, TensorRef)
        raise (ShapeError if shaped else DTypeError)(
            f"pow: the exponent must be a Python number, got {type(exponent).__name__}"
            + ("" if shaped else " (for a tensor exponent write ops.exp(b * ops.log(a)))")
        )
    av = a.value
    if c < 0 and isinstance(c, int) and s.backend.is_integer(av.dtype):
        raise DTypeError(
            f"pow: an integer array ({av.dtype}) to a negative integer power ({c}) is not an "
            "integer; make the array floating or the exponent a float"
        )
    if c == 2:
        return s._record(av * av, (a.id,), partial(_square_vjp, av))
    if c == 0:
        return s._record(av**0, (a.id,), _none)
    return s._record(av**c, (a.id,), partial(_pow_vjp, av, c))


def matmul(a: Any, b: Any) -> TensorRef:
    """Matrix product with NumPy semantics: 1-D operands, 2-D and batched (broadcast).

    VJP: ``g @ b^T`` and ``a^T @ g``, summed over broadcast batch axes.
    """
    s = ref_pair(a, b)
    if s is None:
        s, a, b = operands("matmul", a, b, _check_matmul)
    av, bv = a.value, b.value
    sa, sb = av.shape, bv.shape
    if len(sa) == 2 and len(sb) == 2 and sa[1] == sb[0]:
        bk, rg = s.backend, s._rg
        vjp = partial(_matmul2_vjp, bk, av, bv, rg[a.id], rg[b.id])
        return s._record(bk.matmul(av, bv), (a.id, b.id), vjp)
    return _matmul_general(s, a, b)


def _check_matmul(op: str, av: Any, bv: Any) -> None:
    sa, sb = tuple(av.shape), tuple(bv.shape)
    if not sa or not sb or sa[-1] != (sb[0] if len(sb) == 1 else sb[-2]):
        raise ShapeError(f"{op}: shapes {sa} and {sb} are not aligned")
    for m, n in zip(reversed(sa[:-2]), reversed(sb[:-2])):
        if m != n and m != 1 and n != 1:
            raise ShapeError(f"{op}: batch axes of shapes {sa} and {sb} do not broadcast")


def _matmul_general(s, a: TensorRef, b: TensorRef) -> TensorRef:
    """``matmul`` for 1-D and batched operands (and the misaligned 2-D error)."""
    bk = s.backend
    av, bv = a.value, b.value
    _check_matmul("matmul", av, bv)
    sa, sb = tuple(av.shape), tuple(bv.shape)
    rg = s._rg
    want_a, want_b = rg[a.id], rg[b.id]
    a2 = bk.reshape(av, (1,) + sa) if len(sa) == 1 else av
    b2 = bk.reshape(bv, sb + (1,)) if len(sb) == 1 else bv
    out2 = bk.matmul(a2, b2)
    out = out2
    if len(sa) == 1:
        out = bk.reshape(out, tuple(out.shape[:-2]) + tuple(out.shape[-1:]))
    if len(sb) == 1:
        out = bk.reshape(out, tuple(out.shape[:-1]))
    oshape2 = tuple(out2.shape)
    sa2, sb2 = tuple(a2.shape), tuple(b2.shape)

    def vjp(g):
        g2 = bk.reshape(g, oshape2)
        ga = gb = None
        if want_a:
            ga = bk.reshape(unbroadcast(bk, bk.matmul(g2, swap_last(bk, b2)), sa2), sa)
        if want_b:
            gb = bk.reshape(unbroadcast(bk, bk.matmul(swap_last(bk, a2), g2), sb2), sb)
        return ga, gb

    return s._record(out, (a.id, b.id), vjp)
