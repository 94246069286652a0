"""Scaled dot-product attention as one op with a fused VJP (softmax backward inline).

``scaled_dot_product_attention`` takes separate q, k and v; ``self_attention`` takes the
packed (B, T, 3 d) projection of a multi-head self-attention layer and returns the
heads merged back to (B, T, d), so a layer records one node where the split, the head
permutes and the merge would record eight (docs/design.md: performance). A backend with its
own fused attention (``Backend.fused_attention``: PyTorch's on a device) runs it when
no key padding mask is given; otherwise both share one kernel: the mask is an additive
bias of ``-inf`` (no masked copy of the scores), the softmax runs in place
(``softmax_``: the backend's row kernel, else a per-head block maximum as the shift),
the batch runs in cache-sized blocks (``Backend.blockwise``), and the products scale
as they write, into the output and cotangent arrays themselves
(``Backend.scaled_matmul``: no scaled copy of q, no copy of a product).
"""

from __future__ import annotations

import math
from typing import Any

from .. import _checks
from ..backend.base import grouped_heads
from ..errors import DTypeError, HyperparameterError, ShapeError
from ..tape import TensorRef
from ._core import (
    lift,
    needs_grad,
    session_of,
    softmax_,
    swap_last,
    unbroadcast,
    value_of,
)

_OP = "scaled_dot_product_attention"


def _causal_offset(op: str, causal: Any, tq: int, tk: int) -> int | None:
    """The query offset of a causal mask (query ``i`` sees keys ``j <= i + offset``), or
    None without one: ``True``/``"top_left"`` 0 (PyTorch's ``is_causal``),
    ``"bottom_right"`` ``tk - tq`` (the queries are the last ``tq`` positions of ``tk``,
    as in a KV-cached decode). Any other value is a ``HyperparameterError``."""
    if causal is None or isinstance(causal, bool):
        return 0 if causal else None
    if causal == "top_left":
        return 0
    if causal == "bottom_right":
        return tk - tq
    raise HyperparameterError(
        f"{op}: causal must be False, True, 'top_left' or 'bottom_right', got {causal!r}"
    )


def _mask_bias(
    s, op: str, qs, tk: int, offset: int | None, key_padding_mask: Any, dtype, groups: int = 1
) -> Any:
    """The additive mask (0 where a key is seen, ``-inf`` where hidden) or None.

    ``offset`` (``_causal_offset``) hides key ``j`` from query ``i`` when ``j > i +
    offset``; ``key_padding_mask`` is a boolean (B, Tk) array, True = hidden, with B the
    first axis of ``qs``. With ``groups`` > 1 the query axis of ``qs`` holds that many
    heads' ``tq`` queries one after the other (grouped-query attention).
    """
    bk = s.backend
    rows = qs[-2]
    hidden = None
    if offset is not None:
        pos = bk.arange(rows, bk.int64)
        if groups > 1:
            pos = pos % (rows // groups)
        hidden = bk.expand_dims(pos + offset, -1) < bk.arange(tk, bk.int64)
    if key_padding_mask is not None:
        kpm = value_of(s, key_padding_mask)
        if bk.dtype_name(kpm.dtype) != "bool":
            raise DTypeError(f"{op}: key_padding_mask must be bool, got {kpm.dtype}")
        if len(qs) < 3 or tuple(kpm.shape) != (qs[0], tk):
            raise ShapeError(
                f"{op}: key_padding_mask has shape {tuple(kpm.shape)}, expected (B, Tk) = "
                f"({qs[0] if len(qs) > 2 else '?'}, {tk}) for q {qs}"
            )
        kpm = bk.reshape(kpm, (qs[0],) + (1,) * (len(qs) - 2) + (tk,))
        hidden = kpm if hidden is None else (hidden | kpm)
    if hidden is None:
        return None
    return bk.astype(bk.where(hidden, -math.inf, 0.0), dtype)


def _default_scale(d: int) -> float:
    """``1 / sqrt(d)``; 1 for features of no element, whose scores are all 0 (PyTorch then
    averages the values, as here)."""
    return 1.0 / math.sqrt(d) if d else 1.0


def _fused(bk, qv, kv, vv, offset, key_padding_mask: Any, scale: float, want: bool):
    """The backend's fused attention ``(out, vjp)``, or None to run ``_attend``.

    Only without a key padding mask, with no empty axis and where every query sees at
    least one key (``offset`` None or >= 0): there backends' kernels and ``_attend`` agree.
    """
    if key_padding_mask is not None or 0 in tuple(qv.shape) + tuple(kv.shape) + tuple(vv.shape):
        return None
    if offset is not None and offset < 0:
        return None
    causal = offset is not None
    return bk.fused_attention(qv, kv, vv, causal, scale, want, query_offset=offset or 0)


def _attend(bk, qv, kv, vv, bias, scale, want_q: bool, want_k: bool, want_v: bool):
    """Forward of ``softmax(q k^T * scale + bias) v`` and its VJP ``g -> (gq, gk, gv)``.

    A query row that sees no key gets zeros and no gradient. When q, k and v share their
    leading axes the work runs in blocks of the first axis (``Backend.blockwise``: each
    block's scores stay in cache); otherwise in one block over the broadcast leading
    axes, whose shape the cotangents then have (callers unbroadcast).
    ``vjp(g, buffers)`` may receive ``(gq, gk, gv)`` arrays (or None) to write the
    cotangents into.
    """
    kt = swap_last(bk, kv)
    probe = bk.matmul(qv[..., :0, :], kt[..., :0])  # broadcast leading axes and dtype
    lead = tuple(probe.shape[:-2])
    tq, tk, dv = tuple(qv.shape)[-2], tuple(kv.shape)[-2], tuple(vv.shape)[-1]
    split = bool(lead) and tuple(qv.shape[:-2]) == tuple(kv.shape[:-2]) == tuple(vv.shape[:-2])
    batched_bias = split and bias is not None and len(tuple(bias.shape)) == len(lead) + 2
    n = lead[0] if split else 1
    item = tq * tk * math.prod(lead[1:] if split else lead)
    out = bk.empty(lead + (tq, dv), bk.matmul(probe, vv[..., :0, :]).dtype)
    kept: dict[int, Any] = {}  # block start -> the softmax of the block

    def block(lo: int, hi: int) -> Any:
        return slice(lo, hi) if split else slice(None)

    def forward(lo: int, hi: int) -> None:
        i = block(lo, hi)

        def scores() -> Any:
            x = bk.scaled_matmul(qv[i], kt[i], scale)
            if bias is not None:
                x += bias[i] if batched_bias else bias
            return x

        p = softmax_(bk, scores(), scores)
        kept[lo] = p
        bk.scaled_matmul(p, vv[i], 1.0, out[i])

    bk.blockwise(forward, n, item)

    def vjp(g, buffers=(None, None, None)):
        grads = []
        for buf, want, x in zip(buffers, (want_q, want_k, want_v), (qv, kv, vv)):
            if not want:
                grads.append(None)
            elif buf is not None:
                grads.append(buf)
            else:
                xlead = tuple(x.shape[:-2]) if split else lead
                grads.append(bk.empty(xlead + tuple(x.shape)[-2:], g.dtype))
        gq, gk, gv = grads

        def backward(lo: int, hi: int) -> None:
            i = block(lo, hi)
            pb = kept[lo]
            gb = g[i]
            if want_v:
                bk.scaled_matmul(swap_last(bk, pb), gb, 1.0, gv[i])
            if not (want_q or want_k):
                return
            gs = bk.matmul(gb, swap_last(bk, vv[i]))
            if not bk.softmax_backward_rows_(gs, pb):
                rows = (math.prod(tuple(gs.shape)[:-1]), tk)  # tk may be 0
                rowdot = bk.einsum("ij,ij->i", bk.reshape(gs, rows), bk.reshape(pb, rows))
                gs -= bk.reshape(rowdot, tuple(gs.shape)[:-1] + (1,))
                gs *= pb
            if want_q:
                bk.scaled_matmul(gs, kv[i], scale, gq[i])
            if want_k:  # the scale applied to the product: the scaled q is not kept
                bk.scaled_matmul(swap_last(bk, gs), qv[i], scale, gk[i])

        bk.blockwise(backward, n, item)
        return gq, gk, gv

    return out, vjp


def scaled_dot_product_attention(
    q: Any,
    k: Any,
    v: Any,
    causal: bool | str = False,
    key_padding_mask: Any = None,
    scale: float | None = None,
) -> TensorRef:
    """``softmax(q @ k^T * scale + mask) @ v`` for q (..., Tq, D), k (..., Tk, D), v (..., Tk, Dv).

    ``scale`` defaults to ``1 / sqrt(D)``. ``causal``: ``True`` or ``"top_left"`` hides
    key ``j`` from query ``i`` when ``j > i`` (PyTorch's ``is_causal``);
    ``"bottom_right"`` when ``j > i + Tk - Tq``, the queries being the last ``Tq``
    positions of ``Tk`` (transformers' decode with a KV cache; the same as ``True`` when
    ``Tq == Tk``). ``key_padding_mask`` is a boolean (B, Tk) array where True hides that
    key (PyTorch's convention); B is the first axis of q. A query that sees no key gets
    zeros and no gradient (PyTorch's math kernel gives NaN there). Leading axes broadcast
    like ``matmul``.

    Grouped-query attention: k and v of shape (B, Hkv, Tk, ...) with fewer heads than q
    (B, Hq, Tq, D), ``Hq`` a multiple of ``Hkv``, give query head ``h`` key/value head
    ``h // (Hq / Hkv)``, as PyTorch's ``enable_gqa=True`` (no flag: such shapes do not
    broadcast otherwise). The queries of each group of heads attend as one block of
    rows, so no per-head copy of k and v is made, and their gradients are summed over
    the group.
    """
    s = session_of(q, k, v, key_padding_mask)
    bk = s.backend
    qv, kv, vv = value_of(s, q), value_of(s, k), value_of(s, v)
    qs, ks, vs = tuple(qv.shape), tuple(kv.shape), tuple(vv.shape)
    if len(qs) < 2 or len(ks) < 2 or len(vs) < 2 or qs[-1] != ks[-1] or ks[-2] != vs[-2]:
        raise ShapeError(
            f"{_OP}: q {qs}, k {ks} and v {vs} do not fit "
            "(expected q (..., Tq, D), k (..., Tk, D), v (..., Tk, Dv))"
        )
    scale = _default_scale(qs[-1]) if scale is None else _checks.real(_OP, "scale", scale)
    offset = _causal_offset(_OP, causal, qs[-2], ks[-2])
    groups = grouped_heads(qs, ks, vs)
    if groups == 1:
        for xs, ys in ((qs, ks), (qs, vs), (ks, vs)):
            for m, n in zip(reversed(xs[:-2]), reversed(ys[:-2])):
                if m != n and m != 1 and n != 1:
                    raise ShapeError(
                        f"{_OP}: leading axes of q {qs}, k {ks} and v {vs} do not broadcast "
                        "(nor are they grouped-query heads: k and v with Hkv heads on axis -3 "
                        "dividing q's, the other leading axes equal)"
                    )
    # the query heads of a group as one block of rows: (..., Hkv, groups * Tq, D)
    qg = qv if groups == 1 else bk.reshape(qv, qs[:-3] + (ks[-3], groups * qs[-2], qs[-1]))
    if key_padding_mask is not None:  # checked before anything is recorded (C6)
        bias = _mask_bias(
            s, _OP, tuple(qg.shape), ks[-2], offset, key_padding_mask, qv.dtype, groups
        )
    q, k, v = lift(s, q, qv), lift(s, k, kv), lift(s, v, vv)
    wants = (needs_grad(s, q), needs_grad(s, k), needs_grad(s, v))
    fused = _fused(bk, qv, kv, vv, offset, key_padding_mask, scale, any(wants))
    if fused is not None:
        out, fused_vjp = fused

        def vjp(g):
            return tuple(x if w else None for x, w in zip(fused_vjp(g), wants))

        return s._record(out, (q.id, k.id, v.id), vjp)
    if key_padding_mask is None:
        bias = _mask_bias(s, _OP, tuple(qg.shape), ks[-2], offset, None, qv.dtype, groups)
    out, attend_vjp = _attend(bk, qg, kv, vv, bias, scale, *wants)
    if groups > 1:
        out = bk.reshape(out, qs[:-1] + (vs[-1],))

    def vjp(g):
        gq, gk, gv = attend_vjp(
            g if groups == 1 else bk.reshape(g, tuple(qg.shape[:-1]) + (vs[-1],))
        )
        return (
            None if gq is None else bk.reshape(gq, qs) if groups > 1 else unbroadcast(bk, gq, qs),
            None if gk is None else unbroadcast(bk, gk, ks),
            None if gv is None else unbroadcast(bk, gv, vs),
        )

    return s._record(out, (q.id, k.id, v.id), vjp)


def self_attention(
    qkv: TensorRef,
    n_heads: int,
    causal: bool | str = False,
    key_padding_mask: Any = None,
    scale: float | None = None,
) -> TensorRef:
    """Multi-head self-attention from a packed projection ``qkv`` (B, T, 3 d); gives (B, T, d).

    The last axis of ``qkv`` holds the queries, then the keys, then the values (PyTorch's
    ``in_proj`` layout), each split into ``n_heads`` heads of ``d / n_heads`` features.
    Equal to splitting, moving the heads to axis 1, ``scaled_dot_product_attention``
    (same ``causal``, ``key_padding_mask`` and ``scale``) and merging the heads back,
    recorded as one node.
    """
    op = "self_attention"
    s = session_of(qkv)
    bk = s.backend
    xv = qkv.value
    shape = tuple(xv.shape)
    n_heads = _checks.size(op, "n_heads", n_heads)
    if len(shape) != 3 or shape[2] % (3 * n_heads):
        raise ShapeError(
            f"{op}: qkv has shape {shape} and n_heads={n_heads!r}; expected (B, T, 3 d) "
            "with d a multiple of n_heads"
        )
    b, t, d3 = shape
    d = d3 // 3
    hd = d // n_heads
    scale = _default_scale(hd) if scale is None else _checks.real(op, "scale", scale)
    offset = _causal_offset(op, causal, t, t)
    heads = (b, n_heads, t, hd)
    split = bk.transpose(bk.reshape(xv, (b, t, 3, n_heads, hd)), (2, 0, 3, 1, 4))
    want = needs_grad(s, qkv)
    fused = _fused(bk, split[0], split[1], split[2], offset, key_padding_mask, scale, want)
    if fused is None:
        bias = _mask_bias(s, op, heads, t, offset, key_padding_mask, xv.dtype)
        out, attend_vjp = _attend(bk, split[0], split[1], split[2], bias, scale, want, want, want)
    else:
        out, fused_vjp = fused

        def attend_vjp(g4, parts):
            for j, part in enumerate(fused_vjp(g4)):
                parts[j] = part

    merged = bk.reshape(bk.transpose(out, (0, 2, 1, 3)), (b, t, d))

    def vjp(g):
        g4 = bk.transpose(bk.reshape(g, (b, t, n_heads, hd)), (0, 2, 1, 3))
        gx = bk.empty((b, t, 3, n_heads, hd), g.dtype)
        attend_vjp(g4, bk.transpose(gx, (2, 0, 3, 1, 4)))
        return (bk.reshape(gx, shape),)

    return s._record(merged, (qkv.id,), vjp)
