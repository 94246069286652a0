"""Elementwise functions: exp, log, sqrt, tanh, sigmoid, relu and gelu."""

from __future__ import annotations

import math

from ..errors import TiegradError
from ..session import TensorRef
from ._core import session_of

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def exp(x: TensorRef) -> TensorRef:
    s = session_of(x)
    out = s.backend.exp(x.value)
    return s._record(out, (x.id,), lambda g: (g * out,))


def log(x: TensorRef) -> TensorRef:
    s = session_of(x)
    xv = x.value
    return s._record(s.backend.log(xv), (x.id,), lambda g: (g / xv,))


def sqrt(x: TensorRef) -> TensorRef:
    s = session_of(x)
    out = s.backend.sqrt(x.value)
    return s._record(out, (x.id,), lambda g: (g * 0.5 / out,))


def tanh(x: TensorRef) -> TensorRef:
    s = session_of(x)
    out = s.backend.tanh(x.value)
    return s._record(out, (x.id,), lambda g: (g * (1.0 - out * out),))


def sigmoid(x: TensorRef) -> TensorRef:
    s = session_of(x)
    out = 0.5 * (1.0 + s.backend.tanh(0.5 * x.value))  # overflow-free logistic
    return s._record(out, (x.id,), lambda g: (g * out * (1.0 - out),))


def relu(x: TensorRef) -> TensorRef:
    s = session_of(x)
    xv = x.value
    out = s.backend.maximum(xv, 0.0)
    return s._record(out, (x.id,), lambda g: (g * (xv > 0),))


def gelu(x: TensorRef, approximate: str = "none") -> TensorRef:
    """GELU, exact (``"none"``, with erf) or the ``"tanh"`` form, as in PyTorch."""
    s = session_of(x)
    bk = s.backend
    xv = x.value
    if approximate == "none":
        cdf = 0.5 * (1.0 + bk.erf(xv * _INV_SQRT_2))
        out = xv * cdf

        def vjp(g):
            return (g * (cdf + xv * bk.exp(-0.5 * xv * xv) * _INV_SQRT_2PI),)

    elif approximate == "tanh":
        inner = _SQRT_2_OVER_PI * (xv + 0.044715 * xv * xv * xv)
        t = bk.tanh(inner)
        out = 0.5 * xv * (1.0 + t)

        def vjp(g):
            dinner = _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * xv * xv)
            return (g * (0.5 * (1.0 + t) + 0.5 * xv * (1.0 - t * t) * dinner),)

    else:
        raise TiegradError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return s._record(out, (x.id,), vjp)
