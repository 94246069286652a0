"""Layer normalization over the last axis with an optional affine weight and bias."""

from __future__ import annotations

from typing import Any

from ..errors import HyperparameterError, ShapeError
from ..session import TensorRef
from ._core import lift, needs_grad, session_of, value_of


def layer_norm(x: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5) -> TensorRef:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last axis (biased variance).

    ``weight`` and ``bias`` have shape ``(x.shape[-1],)``. One node with a closed-form
    VJP: ``gx = rstd * (gh - mean(gh) - xhat * mean(gh * xhat))`` with ``gh = g * weight``.
    """
    s = session_of(x, weight, bias)
    bk = s.backend
    if not eps > 0:
        raise HyperparameterError(f"layer_norm: eps must be > 0, got {eps}")
    xv = value_of(s, x)
    shape = tuple(xv.shape)
    if not shape:
        raise ShapeError("layer_norm: input must have at least one axis, got shape ()")
    d = shape[-1]
    params = {}
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None:
            pv = value_of(s, p)
            if tuple(pv.shape) != (d,):
                raise ShapeError(
                    f"layer_norm: {name} has shape {tuple(pv.shape)}, expected ({d},) "
                    f"for input of shape {shape}"
                )
            params[name] = (p, pv)
    x = lift(s, x, xv)
    w = lift(s, *params["weight"]) if "weight" in params else None
    b = lift(s, *params["bias"]) if "bias" in params else None
    refs = [r for r in (x, w, b) if r is not None]
    mu = bk.sum(xv, axis=-1, keepdims=True) * (1.0 / d)
    xc = xv - mu
    var = bk.sum(xc * xc, axis=-1, keepdims=True) * (1.0 / d)
    rstd = 1.0 / bk.sqrt(var + eps)
    xhat = xc * rstd
    out = xhat
    if w is not None:
        out = out * w.value
    if b is not None:
        out = out + b.value
    lead = tuple(range(len(shape) - 1))

    def _sum_lead(a):
        return bk.sum(a, axis=lead) if lead else a

    want_x = needs_grad(s, x)
    want_w = w is not None and needs_grad(s, w)
    want_b = b is not None and needs_grad(s, b)

    def vjp(g):
        grads = []
        if want_x:
            gh = g * w.value if w is not None else g
            m1 = bk.sum(gh, axis=-1, keepdims=True) * (1.0 / d)
            m2 = bk.sum(gh * xhat, axis=-1, keepdims=True) * (1.0 / d)
            grads.append(rstd * (gh - m1 - xhat * m2))
        else:
            grads.append(None)
        if w is not None:
            grads.append(_sum_lead(g * xhat) if want_w else None)
        if b is not None:
            grads.append(_sum_lead(g) if want_b else None)
        return grads

    return s._record(out, tuple(r.id for r in refs), vjp)
