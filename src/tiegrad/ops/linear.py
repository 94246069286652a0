"""Affine layers: ``linear`` (PyTorch's weight layout (out, in)) and ``affine`` ((in, out))."""

from __future__ import annotations

from typing import Any

from ..errors import ShapeError
from ..tape import TensorRef
from ._core import affine_operands, session_of, sum_rows, value_of


def linear(x: Any, weight: Any, bias: Any = None) -> TensorRef:
    """``x @ weight.T + bias`` for ``x`` of shape ``(..., in)``, ``weight`` ``(out, in)``.

    ``bias`` has shape ``(out,)``. One node: the backend's fused kernel where it has one
    (``Backend.affine_rows``: torch's ``addmm``), else the bias is added in place into the
    fresh product (no second output-sized temporary). The VJP works on ``x`` flattened to 2-D,
    passes the transposes to BLAS as views, sums the bias gradient as one
    vector-matrix product and skips the products of operands that need no gradient.
    """
    return _affine("linear", x, weight, bias, out_in=True)


def affine(x: Any, weight: Any, bias: Any = None) -> TensorRef:
    """``x @ weight + bias`` for ``x`` of shape ``(..., in)``, ``weight`` ``(in, out)``.

    The layout of Hugging Face's GPT-2 ``Conv1D`` (``torch.addmm(bias, x, weight)``);
    otherwise as ``linear``: one node, the same in-place bias and VJP.
    """
    return _affine("affine", x, weight, bias, out_in=False)


def _affine(op: str, x: Any, weight: Any, bias: Any, out_in: bool) -> TensorRef:
    """``linear`` (``out_in``: weight (out, in)) or ``affine`` (weight (in, out))."""
    s = session_of(x, weight, bias)
    bk = s.backend
    xv, wv = value_of(s, x), value_of(s, weight)
    xs, ws = tuple(xv.shape), tuple(wv.shape)
    if len(ws) != 2 or not xs or xs[-1] != ws[1 if out_in else 0]:
        layout = "(out, in)" if out_in else "(in, out)"
        raise ShapeError(
            f"{op}: input of shape {xs} does not fit weight of shape {ws} "
            f"(expected input (..., in) and weight {layout})"
        )
    n_out, n_in = ws if out_in else ws[::-1]
    refs, bv = affine_operands(s, op, x, xv, weight, wv, bias, n_out)
    flat = len(xs) == 2  # 2-D input: no reshapes around the products
    x2 = xv if flat else bk.reshape(xv, (-1, n_in))
    out2 = bk.affine_rows(x2, wv, bv, out_in)
    if out2 is None:
        out2 = bk.matmul(x2, bk.transpose(wv, (1, 0)) if out_in else wv)
        if bias is not None:
            if bv.dtype == out2.dtype:
                out2 = bk.add_(out2, bv)
            else:
                out2 = out2 + bv  # keep NumPy's type promotion
    out = out2 if flat else bk.reshape(out2, xs[:-1] + (n_out,))
    rg = s._rg
    ids = tuple([r.id for r in refs])
    want_x, want_w = rg[ids[0]], rg[ids[1]]
    want_b = bias is not None and rg[ids[2]]

    def vjp(g):
        g2 = g if flat else bk.reshape(g, (-1, n_out))
        gx = None
        if want_x:
            gx = bk.matmul(g2, wv if out_in else bk.transpose(wv, (1, 0)))
            gx = gx if flat else bk.reshape(gx, xs)
        gw = None
        if want_w:
            gt = bk.transpose(g2, (1, 0))
            gw = bk.matmul(gt, x2) if out_in else bk.matmul(bk.transpose(x2, (1, 0)), g2)
        if bias is None:
            return gx, gw
        return gx, gw, (sum_rows(bk, g2) if want_b else None)

    return s._record(out, ids, vjp)
