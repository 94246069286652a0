"""Normalizations over the last axis: layer norm (optional weight and bias) and RMS norm
(optional weight, Llama's and Gemma's)."""

from __future__ import annotations

import math
from typing import Any

from .._checks import positive, real
from ..errors import DTypeError, ShapeError
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


def rms_norm(x: Any, weight: Any = None, eps: float = 1e-6, offset: float = 0.0) -> TensorRef:
    """``x * rsqrt(mean(x**2) + eps) * (offset + weight)`` over the last axis.

    As transformers' ``LlamaRMSNorm`` (``offset=0``, the default) and ``GemmaRMSNorm``
    (``offset=1.0``, the weight stored as ``w`` scaling by ``1 + w``), in their order of
    operations: the statistics and the normalized rows ``h`` are computed in at least
    float32 (float16 and bfloat16 inputs in float32; float64 stays float64, where
    transformers would drop to float32). With ``offset=0`` the output is
    ``weight * h.astype(x.dtype)`` (Llama: the dtype of that product); otherwise
    ``(h * (offset + weight)).astype(x.dtype)`` with the sum in ``h``'s dtype (Gemma:
    always ``x``'s dtype). ``weight`` has shape ``(x.shape[-1],)`` or is None (no scale
    but ``offset``, if any). One node; VJP with ``s`` the scale and ``r = rsqrt(...)``:
    ``gx = r * (gs - h * mean(gs * h))`` with ``gs = g * s``, ``gw`` the sums of
    ``g * h`` over the rows. Each gradient has its operand's dtype.

    ``x`` and ``weight`` must have floating dtypes (``DTypeError``), ``eps`` is a finite
    number > 0 and ``offset`` a finite number (``HyperparameterError``). Nothing is
    recorded when a check fails (C6).
    """
    op = "rms_norm"
    s = session_of(x, weight)
    bk = s.backend
    eps = positive(op, "eps", eps)
    offset = real(op, "offset", offset)
    xv = value_of(s, x)
    shape = tuple(xv.shape)
    if not shape:
        raise ShapeError(f"{op}: input must have at least one axis, got shape ()")
    d = shape[-1]
    wv = None if weight is None else vector_value(s, op, "weight", weight, d, "input", shape)
    for name, v in (("input", xv), ("weight", wv)):
        if v is not None and not bk.is_floating(v.dtype):
            raise DTypeError(
                f"{op}: {name} has dtype {bk.dtype_name(v.dtype)}, expected a floating dtype"
            )
    x = lift(s, x, xv)
    w = None if weight is None else lift(s, weight, wv)
    refs = [x] if w is None else [x, w]
    half = half_to_float32(bk, xv.dtype)
    h = xv if half is None else bk.astype(xv, half)
    rstd = bk.rsqrt(sum_last(bk, h * h) / max(d, 1) + eps)
    h = h * rstd
    llama = not offset
    if llama:  # weight * h.to(x.dtype); the weight's gradient sums g * h.to(x.dtype)
        hw = h if half is None else bk.astype(h, xv.dtype)
        scale = wv
        out = hw if w is None else wv * hw
    else:  # (h * (offset + weight.float())).to(x.dtype); the weight's gradient: g * h
        hw = h
        wh = wv if wv is None or half_to_float32(bk, wv.dtype) is None else bk.astype(wv, h.dtype)
        scale = offset if w is None else offset + wh
        out = bk.astype(h * scale, xv.dtype)
    want_x = needs_grad(s, x)
    want_w = w is not None and needs_grad(s, w)
    rows = math.prod(shape[:-1])
    x_dtype = xv.dtype  # the VJP keeps the normalized rows, not the input (the residual)

    def vjp(g):
        gc = g if half is None or half_to_float32(bk, g.dtype) is None else bk.astype(g, half)
        gx = gw = None
        if want_w:  # the rows the weight multiplied, in the statistics' dtype
            seen = hw if half is None or not llama else bk.astype(hw, half)
            gw = bk.astype(sum_rows(bk, bk.reshape(gc * seen, (rows, d))), wv.dtype)
        if want_x:
            gs = gc if scale is None else gc * scale
            gx = bk.astype(rstd * (gs - h * (sum_last(bk, gs * h) / max(d, 1))), x_dtype)
        return (gx,) if w is None else (gx, gw)

    return s._record(out, tuple(r.id for r in refs), vjp)
