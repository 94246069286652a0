"""Elementwise functions: exp, log, sqrt, rsqrt, cos, sin, tanh, sigmoid, silu, relu, gelu.

VJPs are module-level functions bound with ``functools.partial`` (one object per node;
see ``arithmetic``).
"""

from __future__ import annotations

import math
from functools import partial

from ..errors import HyperparameterError
from ..tape import TensorRef
from ._core import session_of

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _times(d, g):
    return (g * d,)


def _over(d, g):
    return (g / d,)


def _sqrt_vjp(out, g):
    return (g * 0.5 / out,)


def _rsqrt_vjp(out, g):
    return (g * (-0.5 * out * out * out),)


def _cos_vjp(bk, xv, g):
    return (-g * bk.sin(xv),)


def _sin_vjp(bk, xv, g):
    return (g * bk.cos(xv),)


def _sigmoid_of(bk, xv):
    """``sigmoid(x)`` as ``(1 + tanh(x / 2)) / 2``: no overflow for any finite ``x``."""
    return 0.5 * (1.0 + bk.tanh(0.5 * xv))


def _silu_vjp(bk, xv, g):
    sig = _sigmoid_of(bk, xv)
    return (g * (sig * (1.0 + xv * (1.0 - sig))),)


def _tanh_vjp(out, g):
    return (g * (1.0 - out * out),)


def _sigmoid_vjp(out, g):
    return (g * out * (1.0 - out),)


def _relu_vjp(bk, out, g):
    return (bk.relu_vjp(g, out),)


def _gelu_vjp(bk, saved, g):
    return (bk.gelu_vjp(g, saved),)


def _gelu_tanh_vjp(xv, t, g):
    dinner = _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * xv * xv)
    return (g * (0.5 * (1.0 + t) + 0.5 * xv * (1.0 - t * t) * dinner),)


def exp(x: TensorRef) -> TensorRef:
    """``e ** x``; VJP: ``g * exp(x)``."""
    s = session_of(x)
    out = s.backend.exp(x.value)
    return s._record(out, (x.id,), partial(_times, out))


def log(x: TensorRef) -> TensorRef:
    """Natural logarithm; VJP: ``g / x``."""
    s = session_of(x)
    xv = x.value
    return s._record(s.backend.log(xv), (x.id,), partial(_over, xv))


def sqrt(x: TensorRef) -> TensorRef:
    """Square root; VJP: ``g / (2 * sqrt(x))``."""
    s = session_of(x)
    out = s.backend.sqrt(x.value)
    return s._record(out, (x.id,), partial(_sqrt_vjp, out))


def rsqrt(x: TensorRef) -> TensorRef:
    """``1 / sqrt(x)`` (PyTorch's ``torch.rsqrt``); VJP: ``g * -0.5 * rsqrt(x)**3``."""
    s = session_of(x)
    out = s.backend.rsqrt(x.value)
    return s._record(out, (x.id,), partial(_rsqrt_vjp, out))


def cos(x: TensorRef) -> TensorRef:
    """Cosine; VJP: ``-g * sin(x)``."""
    s = session_of(x)
    bk = s.backend
    xv = x.value
    return s._record(bk.cos(xv), (x.id,), partial(_cos_vjp, bk, xv))


def sin(x: TensorRef) -> TensorRef:
    """Sine; VJP: ``g * cos(x)``."""
    s = session_of(x)
    bk = s.backend
    xv = x.value
    return s._record(bk.sin(xv), (x.id,), partial(_sin_vjp, bk, xv))


def tanh(x: TensorRef) -> TensorRef:
    """Hyperbolic tangent; VJP: ``g * (1 - tanh(x)**2)``."""
    s = session_of(x)
    out = s.backend.tanh(x.value)
    return s._record(out, (x.id,), partial(_tanh_vjp, out))


def sigmoid(x: TensorRef) -> TensorRef:
    """Logistic function, as ``(1 + tanh(x / 2)) / 2`` (no overflow); VJP: ``g * y * (1 - y)``."""
    s = session_of(x)
    out = _sigmoid_of(s.backend, x.value)
    return s._record(out, (x.id,), partial(_sigmoid_vjp, out))


def silu(x: TensorRef) -> TensorRef:
    """SiLU (swish), ``x * sigmoid(x)`` as PyTorch's ``F.silu``, with ``sigmoid``'s form
    (no overflow); VJP: ``g * y * (1 + x * (1 - y))`` with ``y = sigmoid(x)``.

    As PyTorch, the VJP keeps only the input and computes ``y`` again (the same bits as
    the forward's): a SwiGLU MLP holds no sigmoid-sized array per layer until backward.
    """
    s = session_of(x)
    bk = s.backend
    xv = x.value
    return s._record(xv * _sigmoid_of(bk, xv), (x.id,), partial(_silu_vjp, bk, xv))


def relu(x: TensorRef) -> TensorRef:
    """``max(x, 0)``; VJP: ``g`` where ``x > 0``, else 0.

    The VJP reads the mask from the output (``out > 0`` exactly where ``x > 0``), which
    the next op usually keeps anyway, so the input can be freed.
    """
    s = session_of(x)
    out = s.backend.relu(x.value)
    return s._record(out, (x.id,), partial(_relu_vjp, s.backend, out))


def gelu(x: TensorRef, approximate: str = "none") -> TensorRef:
    """GELU, exact (``"none"``, with erf) or the ``"tanh"`` form, as in PyTorch.

    The exact form is the backend's fused ``gelu`` kernel, which also returns what its
    VJP needs (the NumPy backend: the derivative, so the VJP keeps only that array and
    multiplies); ``Backend.gelu_vjp`` computes the input cotangent.
    """
    s = session_of(x)
    bk = s.backend
    xv = x.value
    if approximate == "none":
        out, saved = bk.gelu(xv)
        return s._record(out, (x.id,), partial(_gelu_vjp, bk, saved))
    if approximate == "tanh":
        t = bk.tanh(_SQRT_2_OVER_PI * (xv + 0.044715 * xv * xv * xv))
        return s._record(0.5 * xv * (1.0 + t), (x.id,), partial(_gelu_tanh_vjp, xv, t))
    raise HyperparameterError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
