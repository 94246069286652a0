"""Scaled dot-product attention as one op with a fused VJP (softmax backward inline)."""

from __future__ import annotations

import math
from typing import Any

from ..errors import DTypeError, ShapeError
from ..session import TensorRef
from ._core import lift, needs_grad, session_of, swap_last, unbroadcast, value_of


def scaled_dot_product_attention(
    q: Any,
    k: Any,
    v: Any,
    causal: bool = False,
    key_padding_mask: Any = None,
    scale: float | None = None,
) -> TensorRef:
    """``softmax(q @ k^T * scale + mask) @ v`` for q (..., Tq, D), k (..., Tk, D), v (..., Tk, Dv).

    ``scale`` defaults to ``1 / sqrt(D)``. ``causal`` hides key ``j`` from query ``i``
    when ``j > i`` (PyTorch's ``is_causal``, top-left aligned). ``key_padding_mask`` is a
    boolean (B, Tk) array where True hides that key (PyTorch's convention); B is the
    first axis of q. A query that sees no key gets zeros and no gradient (PyTorch's
    math kernel gives NaN there). Leading axes broadcast like ``matmul``.
    """
    s = session_of(q, k, v, key_padding_mask)
    bk = s.backend
    qv, kv, vv = value_of(s, q), value_of(s, k), value_of(s, v)
    qs, ks, vs = tuple(qv.shape), tuple(kv.shape), tuple(vv.shape)
    if len(qs) < 2 or len(ks) < 2 or len(vs) < 2 or qs[-1] != ks[-1] or ks[-2] != vs[-2]:
        raise ShapeError(
            f"scaled_dot_product_attention: q {qs}, k {ks} and v {vs} do not fit "
            "(expected q (..., Tq, D), k (..., Tk, D), v (..., Tk, Dv))"
        )
    tq, tk = qs[-2], ks[-2]
    if scale is None:
        scale = 1.0 / math.sqrt(qs[-1])
    for xs, ys in ((qs, ks), (qs, vs), (ks, vs)):
        for m, n in zip(reversed(xs[:-2]), reversed(ys[:-2])):
            if m != n and m != 1 and n != 1:
                raise ShapeError(
                    f"scaled_dot_product_attention: leading axes of q {qs}, k {ks} and "
                    f"v {vs} do not broadcast"
                )
    hidden = None
    if causal:
        hidden = bk.expand_dims(bk.arange(tq, bk.int64), -1) < bk.arange(tk, bk.int64)
    if key_padding_mask is not None:
        kpm = value_of(s, key_padding_mask)
        if bk.dtype_name(kpm.dtype) != "bool":
            raise DTypeError(
                f"scaled_dot_product_attention: key_padding_mask must be bool, got {kpm.dtype}"
            )
        if len(qs) < 3 or tuple(kpm.shape) != (qs[0], tk):
            raise ShapeError(
                f"scaled_dot_product_attention: key_padding_mask has shape "
                f"{tuple(kpm.shape)}, expected (B, Tk) = ({qs[0] if len(qs) > 2 else '?'}, "
                f"{tk}) for q {qs} and k {ks}"
            )
        kpm = bk.reshape(kpm, (qs[0],) + (1,) * (len(qs) - 2) + (tk,))
        hidden = kpm if hidden is None else (hidden | kpm)
    q, k, v = lift(s, q, qv), lift(s, k, kv), lift(s, v, vv)
    scores = bk.matmul(qv, swap_last(bk, kv)) * scale
    if hidden is not None:
        scores = bk.where(hidden, -math.inf, scores)
    m = bk.max(scores, axis=-1, keepdims=True)
    if hidden is not None:
        m = bk.where(m == -math.inf, 0.0, m)
    e = bk.exp(scores - m)
    den = bk.sum(e, axis=-1, keepdims=True)
    if hidden is not None:
        den = bk.where(den == 0, 1.0, den)
    p = e / den
    out = bk.matmul(p, vv)
    want_q, want_k, want_v = needs_grad(s, q), needs_grad(s, k), needs_grad(s, v)

    def vjp(g):
        gv = unbroadcast(bk, bk.matmul(swap_last(bk, p), g), vs) if want_v else None
        if not (want_q or want_k):
            return None, None, gv
        gp = bk.matmul(g, swap_last(bk, vv))
        gs = p * (gp - bk.sum(gp * p, axis=-1, keepdims=True)) * scale
        gq = unbroadcast(bk, bk.matmul(gs, kv), qs) if want_q else None
        gk = unbroadcast(bk, bk.matmul(swap_last(bk, gs), qv), ks) if want_k else None
        return gq, gk, gv

    return s._record(out, (q.id, k.id, v.id), vjp)
