"""Softmax and log-softmax over one axis: a stable fused forward and a closed-form VJP."""

from __future__ import annotations

from ..tape import TensorRef
from ._core import one_axis, session_of


def softmax(x: TensorRef, axis: int = -1) -> TensorRef:
    """``exp(x) / sum(exp(x))`` along ``axis``, computed after subtracting the maximum.

    VJP: ``y * (g - sum(g * y, axis))``.
    """
    s = session_of(x)
    bk = s.backend
    ax = one_axis(axis, x.value.ndim, "softmax")
    xv = x.value
    if not tuple(xv.shape)[ax]:
        return _empty(s, x)
    e = bk.exp(xv - bk.max(xv, axis=ax, keepdims=True))
    out = e / bk.sum(e, axis=ax, keepdims=True)

    def vjp(g):
        return (out * (g - bk.sum(g * out, axis=ax, keepdims=True)),)

    return s._record(out, (x.id,), vjp)


def log_softmax(x: TensorRef, axis: int = -1) -> TensorRef:
    """``x - log(sum(exp(x)))`` along ``axis``, computed after subtracting the maximum.

    VJP: ``g - softmax(x) * sum(g, axis)``.
    """
    s = session_of(x)
    bk = s.backend
    ax = one_axis(axis, x.value.ndim, "log_softmax")
    xv = x.value
    if not tuple(xv.shape)[ax]:
        return _empty(s, x)
    shifted = xv - bk.max(xv, axis=ax, keepdims=True)
    out = shifted - bk.log(bk.sum(bk.exp(shifted), axis=ax, keepdims=True))

    def vjp(g):
        return (g - bk.exp(out) * bk.sum(g, axis=ax, keepdims=True),)

    return s._record(out, (x.id,), vjp)


def _empty(s, x: TensorRef) -> TensorRef:
    """(Log-)softmax along an axis of no element: an empty array, as in PyTorch; VJP ``g``."""
    return s._record(s.backend.exp(x.value), (x.id,), lambda g: (g,))
