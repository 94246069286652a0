"""Layer normalization over the last axis with an optional affine weight and bias."""

from __future__ import annotations

import math
from typing import Any

from .._checks import positive
from ..errors import ShapeError
from ..tape import TensorRef
from ._core import lift, needs_grad, session_of, sum_last, sum_rows, value_of, vector_value
from .reduce import half_to_float32


def layer_norm(x: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5) -> TensorRef:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last axis (biased variance).

    ``weight`` and ``bias`` have shape ``(x.shape[-1],)``. One node with a closed-form
    VJP: ``gx = rstd * (gh - mean(gh) - xhat * mean(gh * xhat))`` with ``gh = g * weight``.
    Rows run through the backend's fused kernels where it has them
    (``Backend.layer_norm_rows``), else as a 2-D array in cache-sized blocks.

    The output has the dtype of that formula with ``x`` promoted by a Python float
    (NumPy: integers give float64, as in ``linear``). Half precision is computed in
    float32 (statistics, output and gradients, as PyTorch does: a float16 sum of
    squares overflows) and rounded back once. ``eps`` is a finite real number > 0
    (read as a Python float).
    """
    s = session_of(x, weight, bias)
    bk = s.backend
    eps = positive("layer_norm", "eps", eps)
    xv = value_of(s, x)
    shape = tuple(xv.shape)
    if not shape:
        raise ShapeError("layer_norm: input must have at least one axis, got shape ()")
    d = shape[-1]
    params = {}
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None:
            params[name] = (p, vector_value(s, "layer_norm", name, p, d, "input", shape))
    x = lift(s, x, xv)
    w = lift(s, *params["weight"]) if "weight" in params else None
    b = lift(s, *params["bias"]) if "bias" in params else None
    refs = [r for r in (x, w, b) if r is not None]
    rows = math.prod(shape[:-1])
    x2 = bk.reshape(xv, (rows, d))
    wv = None if w is None else w.value
    bv = None if b is None else b.value
    head = x2[:0]  # x's dtype, for the dtype of a half-precision output
    half = half_to_float32(bk, x2.dtype)
    if half is not None:
        x2 = bk.astype(x2, half)
    elif not bk.is_floating(x2.dtype):
        x2 = bk.astype(x2, (head * 1.0).dtype)  # integers: x promoted by a float
    fused = bk.layer_norm_rows(x2, wv, bv, eps)
    if fused is None:
        out2, xhat, rstd = _layer_norm_blocks(bk, x2, wv, bv, eps)
    else:
        out2, xhat, rstd = fused
    out = bk.reshape(out2, shape)
    if half is not None:
        out = bk.astype(out, _affine_dtype(head, wv, bv))
    want_x = needs_grad(s, x)
    want_w = w is not None and needs_grad(s, w)
    want_b = b is not None and needs_grad(s, b)

    def vjp(g):
        g2 = bk.reshape(g, (rows, d))
        if half is not None and half_to_float32(bk, g2.dtype) is not None:
            g2 = bk.astype(g2, half)
        wants = (want_x, want_w, want_b)
        gx, gw, gb = bk.layer_norm_backward_rows(g2, wv, xhat, rstd, wants) or (None,) * 3
        if want_x and gx is None:
            gx = _layer_norm_backward_blocks(bk, g2, wv, xhat, rstd)
        if want_w and gw is None:
            gw = bk.einsum("ij,ij->j", g2, xhat)
        if want_b and gb is None:
            gb = sum_rows(bk, g2)
        grads = [None if gx is None else bk.reshape(gx, shape)]
        if w is not None:
            grads.append(gw)
        if b is not None:
            grads.append(gb)
        if half is not None:  # each gradient back in its operand's dtype
            grads = [
                gr if gr is None else bk.astype(gr, r.value.dtype) for gr, r in zip(grads, refs)
            ]
        return grads

    return s._record(out, tuple(r.id for r in refs), vjp)


def _layer_norm_blocks(bk, x2, wv, bv, eps: float):
    """``(out, xhat, rstd)`` of 2-D ``x2`` in cache-sized blocks (``Backend.blockwise``).

    Row means are matrix-vector products, row dot products ``einsum`` reductions (no
    product temporaries), and the other passes run in place on the block's slice of
    the outputs. ``x2`` has a float dtype; output dtypes follow the type promotion of
    the unfused formula (``_affine_dtype``).
    """
    rows, d = tuple(x2.shape)
    inv_d = 1.0 / d if d else 0.0
    xhat = bk.empty((rows, d), x2.dtype)
    rstd = bk.empty((rows, 1), x2.dtype)
    out_dtype = _affine_dtype(x2[:0], wv, bv)
    out2 = xhat if wv is None and bv is None else bk.empty((rows, d), out_dtype)

    def forward_rows(lo: int, hi: int) -> None:
        xb = x2[lo:hi]
        xh = xhat[lo:hi]
        xh[...] = xb - xb[:, :1]  # shifted by the first element: a constant row gives 0
        xh -= sum_last(bk, xh) * inv_d
        r = 1.0 / bk.sqrt(bk.reshape(bk.einsum("ij,ij->i", xh, xh), (-1, 1)) * inv_d + eps)
        rstd[lo:hi] = r
        xh *= r
        if out2 is not xhat:
            o = out2[lo:hi]
            o[...] = xh if wv is None else xh * wv
            if bv is not None:
                o += bv

    bk.blockwise(forward_rows, rows, d)
    return out2, xhat, rstd


def _affine_dtype(head, wv, bv):
    """The dtype of ``xhat * wv + bv`` for ``xhat`` of ``head``'s dtype (probed on 0 rows)."""
    if wv is not None:
        head = head * wv
    if bv is not None:
        head = head + bv
    return head.dtype


def _layer_norm_backward_blocks(bk, g2, wv, xhat, rstd):
    """``rstd * (gh - mean(gh) - xhat * mean(gh * xhat))``, ``gh = g2 * wv``, in blocks."""
    rows, d = tuple(g2.shape)
    inv_d = 1.0 / d if d else 0.0
    head = g2[:0] * xhat[:0] if wv is None else g2[:0] * wv * xhat[:0]
    gx = bk.empty((rows, d), head.dtype)

    def backward_rows(lo: int, hi: int) -> None:
        xh = xhat[lo:hi]
        gh = g2[lo:hi] if wv is None else g2[lo:hi] * wv
        m1 = sum_last(bk, gh) * inv_d
        m2 = bk.reshape(bk.einsum("ij,ij->i", gh, xh), (-1, 1)) * inv_d
        o = gx[lo:hi]
        o[...] = xh * -m2
        o -= m1
        o += gh
        o *= rstd[lo:hi]

    bk.blockwise(backward_rows, rows, d)
    return gx
