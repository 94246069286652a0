"""2-D convolution and max pooling (NCHW) by im2col over the backend's sliding windows."""

from __future__ import annotations

from typing import Any

from .._checks import count
from ..backend import Array, Backend
from ..errors import ShapeError
from ..tape import TensorRef
from ._core import affine_operands, needs_grad, session_of, value_of


def _fold(bk: Backend, cols: Array, shape: tuple[int, ...], stride: int) -> Array:
    """Sum windows (N, C, OH, OW, kh, kw) back into an (N, C, H, W) array of ``shape``."""
    _, _, oh, ow, kh, kw = tuple(cols.shape)
    out = bk.zeros(shape, cols.dtype)
    for i in range(kh):
        for j in range(kw):
            rows = slice(i, i + stride * (oh - 1) + 1, stride)
            cs = slice(j, j + stride * (ow - 1) + 1, stride)
            bk.accumulate_at(out, (slice(None), slice(None), rows, cs), cols[:, :, :, :, i, j])
    return out


def conv2d(x: Any, weight: Any, bias: Any = None, stride: int = 1, padding: int = 0) -> TensorRef:
    """Cross-correlation of x (N, C, H, W) with weight (O, C, kh, kw), plus bias (O,).

    As ``torch.nn.functional.conv2d`` with square ``stride`` and zero ``padding``. The
    forward is one matrix product over the im2col windows; the input's VJP sums the
    windows' cotangents back into place.
    """
    s = session_of(x, weight, bias)
    bk = s.backend
    stride = count("conv2d", "stride", stride, 1)
    padding = count("conv2d", "padding", padding, 0)
    xv, wv = value_of(s, x), value_of(s, weight)
    xs, ws = tuple(xv.shape), tuple(wv.shape)
    if len(xs) != 4 or len(ws) != 4 or xs[1] != ws[1]:
        raise ShapeError(
            f"conv2d: input of shape {xs} does not fit weight of shape {ws} "
            "(expected input (N, C, H, W) and weight (O, C, kh, kw))"
        )
    n, c, h, wd = xs
    o, _, kh, kw = ws
    hp, wp = h + 2 * padding, wd + 2 * padding
    if hp < kh or wp < kw:
        raise ShapeError(
            f"conv2d: padded input {(hp, wp)} is smaller than the kernel {(kh, kw)} "
            f"(input {xs}, weight {ws}, padding {padding})"
        )
    refs, bv = affine_operands(s, "conv2d", x, xv, weight, wv, bias, o)
    xp = bk.pad(xv, [(0, 0), (0, 0), (padding, padding), (padding, padding)]) if padding else xv
    win = bk.sliding_windows(xp, kh, kw, stride)
    oh, ow = tuple(win.shape)[2:4]
    ckk = c * kh * kw
    cols = bk.reshape(bk.transpose(win, (0, 2, 3, 1, 4, 5)), (n * oh * ow, ckk))
    wm = bk.reshape(wv, (o, ckk))
    out2 = bk.matmul(cols, bk.transpose(wm, (1, 0)))
    if bias is not None:
        out2 = out2 + bv
    out = bk.transpose(bk.reshape(out2, (n, oh, ow, o)), (0, 3, 1, 2))
    want_x, want_w = needs_grad(s, refs[0]), needs_grad(s, refs[1])
    want_b = bias is not None and needs_grad(s, refs[2])

    def vjp(g):
        g2 = bk.reshape(bk.transpose(g, (0, 2, 3, 1)), (n * oh * ow, o))
        gx = gw = gb = None
        if want_x:
            gcols = bk.reshape(bk.matmul(g2, wm), (n, oh, ow, c, kh, kw))
            gxp = _fold(bk, bk.transpose(gcols, (0, 3, 1, 2, 4, 5)), (n, c, hp, wp), stride)
            gx = gxp[:, :, padding : padding + h, padding : padding + wd] if padding else gxp
        if want_w:
            gw = bk.reshape(bk.matmul(bk.transpose(g2, (1, 0)), cols), ws)
        if bias is None:
            return gx, gw
        if want_b:
            gb = bk.sum(g2, axis=0)
        return gx, gw, gb

    return s._record(out, tuple(r.id for r in refs), vjp)


def max_pool2d(x: TensorRef, kernel_size: int, stride: int | None = None) -> TensorRef:
    """Maximum over kernel_size x kernel_size windows of x (N, C, H, W); stride defaults to it.

    As ``torch.nn.functional.max_pool2d`` without padding: each window's gradient goes to
    its first maximal element; overlapping windows accumulate.
    """
    s = session_of(x)
    bk = s.backend
    k = count("max_pool2d", "kernel_size", kernel_size, 1)
    stride = k if stride is None else count("max_pool2d", "stride", stride, 1)
    xv = x.value
    xs = tuple(xv.shape)
    if len(xs) != 4 or xs[2] < k or xs[3] < k:
        raise ShapeError(
            f"max_pool2d: input of shape {xs} does not fit kernel_size {k} "
            "(expected (N, C, H, W) with H, W >= kernel_size)"
        )
    win = bk.sliding_windows(xv, k, k, stride)
    n, c, oh, ow = tuple(win.shape)[:4]
    flat = bk.reshape(win, (n, c, oh, ow, k * k))
    arg = bk.expand_dims(bk.argmax(flat, axis=-1), -1)
    out = bk.reshape(bk.take_along_axis(flat, arg, -1), (n, c, oh, ow))

    def vjp(g):
        hit = arg == bk.arange(k * k, arg.dtype)
        cols = bk.where(hit, bk.expand_dims(g, -1), bk.zeros((), g.dtype))
        return (_fold(bk, bk.reshape(cols, (n, c, oh, ow, k, k)), xs, stride),)

    return s._record(out, (x.id,), vjp)
