"""The head's projection and its cross-entropy in one op, without the logits array."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import _checks
from ..backend import Array, Backend
from ..backend.base import smoothed_loss
from ..errors import DTypeError, ShapeError
from ..tape import TensorRef
from ._core import (
    _row_shift,
    check_index_range,
    check_reduction,
    host_targets,
    int_array,
    lift,
    session_of,
    sum_last,
    value_of,
)
from .loss import loss_count, reduce_losses

OP = "linear_cross_entropy"
TILE_BYTES = 48 << 20
"""The most bytes of one chunk of logits (rows x the whole vocabulary), at least a row."""
BLOCK_BYTES = 8 << 20
"""The most bytes of one block of the weight's gradient summed into it at a time."""


def linear_cross_entropy(
    h: Any,
    weight: Any,
    targets: Any,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
) -> TensorRef:
    """``cross_entropy(linear(h, weight), targets, ...)`` without the (rows x V) logits.

    ``h`` is (..., H), ``weight`` (V, H) as a ``Linear`` (or a tied embedding) holds it,
    ``targets`` integers of shape ``h.shape[:-1]``; ``reduction``, ``ignore_index`` and
    ``label_smoothing`` as in ``ops.cross_entropy`` (a "mean" over no position is 0).
    ``h`` and ``weight`` share one floating dtype (``DTypeError`` otherwise, as
    ``torch.nn.functional.linear``); every check runs before anything is recorded (C6).

    One node with two parents, ``h`` and ``weight``: the weight is an ordinary use, so a
    tied head's gradient is summed with the embedding's once (C4) and a frozen use gets
    none. The rows are taken in chunks of at most ``TILE_BYTES`` of logits; each chunk's
    logits are one matrix product, are turned in place into their softmax and then into
    their gradient (``Backend.cross_entropy_tile_``, else backend operations), which two
    more products turn into the rows of ``h``'s gradient and a sum into ``weight``'s (in
    blocks of ``BLOCK_BYTES``). For a "mean" or "sum" wanting a gradient that happens in
    the forward: the node keeps the two gradients (the size of its inputs) and its VJP
    scales them by the cotangent. The products of an operand that needs no gradient are
    skipped, and without any gradient only the first product runs. ``"none"`` keeps
    nothing: its VJP runs the chunks again with the cotangent's weights. The extra
    memory is one chunk, one block and a few numbers per row.
    """
    s = session_of(h, weight)
    bk = s.backend
    check_reduction(OP, reduction)
    ignore_index = _checks.count(OP, "ignore_index", ignore_index, -(2**63))
    label_smoothing = _checks.unit_interval(OP, "label_smoothing", label_smoothing)
    hv, wv = value_of(s, h), value_of(s, weight)
    hs, ws = tuple(hv.shape), tuple(wv.shape)
    if len(ws) != 2 or not hs or hs[-1] != ws[1]:
        raise ShapeError(
            f"{OP}: input of shape {hs} does not fit weight of shape {ws} "
            f"(expected input (..., H) and weight (V, H))"
        )
    if hv.dtype != wv.dtype or not bk.is_floating(hv.dtype):
        raise DTypeError(
            f"{OP}: input and weight must share one floating dtype, got "
            f"{bk.dtype_name(hv.dtype)} and {bk.dtype_name(wv.dtype)}"
        )
    t = int_array(s, OP, targets)
    if tuple(t.shape) != hs[:-1]:
        raise ShapeError(
            f"{OP}: targets of shape {tuple(t.shape)} do not fit input of shape {hs} "
            f"(expected targets of shape input.shape[:-1])"
        )
    v = ws[0]
    extra = f" or equal {ignore_index=}"
    host_count = host_targets(OP, targets, ignore_index, v, extra)
    rows = math.prod(hs[:-1])
    t = bk.astype(bk.reshape(t, (rows,)), bk.int64)
    safe, valid = t, None  # the targets with ignored ones 0, and the mask, where some may be
    if host_count != rows:
        valid = t != ignore_index
        safe = bk.where(valid, t, 0)
        if host_count is None:
            check_index_range(s, OP, "targets", safe, v, extra)
    h_ref, w_ref = lift(s, h, hv), lift(s, weight, wv)
    h2 = bk.reshape(hv, (rows, hs[-1]))
    chunks = _Chunks(bk, h2, wv, (t, safe, valid, ignore_index), label_smoothing)
    grad = s.grad_enabled
    want_h, want_w = grad and s._rg[h_ref.id], grad and s._rg[w_ref.id]
    count = loss_count(bk, reduction, valid, host_count)
    if reduction == "none" or not (want_h or want_w):
        per = chunks.run(None, False, False)
        out = reduce_losses(bk, bk.reshape(per, hs[:-1]), reduction, count)

        def vjp(g):  # "none": the chunks again, with the cotangent's weights
            _, gh, gw = chunks.run(bk.reshape(g, (rows,)), want_h, want_w)
            return (bk.reshape(gh, hs) if want_h else None), gw

        return s._record(out, (h_ref.id, w_ref.id), vjp)
    row_weight = bk.ones((1,), hv.dtype) * (1.0 / count if count else 1.0)
    per, gh, gw = chunks.run(row_weight, want_h, want_w)
    out = reduce_losses(bk, bk.reshape(per, hs[:-1]), reduction, count)
    if want_h:
        gh = bk.reshape(gh, hs)

    def reduced_vjp(g):
        if _host_one(g):  # the usual backward of a loss: the gradients as they are
            return gh, gw
        return (gh * g if want_h else None), (gw * g if want_w else None)

    return s._record(out, (h_ref.id, w_ref.id), reduced_vjp)


def _host_one(g: Any) -> bool:
    """Whether the cotangent ``g`` is a host number equal to 1 (a device one is not read:
    that would synchronise)."""
    return isinstance(g, (np.ndarray, np.generic)) and g.size == 1 and float(g) == 1.0


class _Chunks:
    """The rows of ``h2`` (rows, H) against ``weight`` (V, H), a chunk of rows at a time
    (``TILE_BYTES`` of logits). ``targets`` is ``(t, safe, valid, ignore_index)``: the
    int64 targets, the same with ignored ones 0, and the mask of the rows not ignored
    (None where none is)."""

    def __init__(
        self, bk: Backend, h2: Array, weight: Array, targets: tuple, smoothing: float
    ) -> None:
        self.bk, self.h2, self.weight, self.smoothing = bk, h2, weight, smoothing
        self.t, self.safe, self.valid, self.ignore_index = targets
        item = h2.dtype.itemsize
        v, width = weight.shape
        self.step = max(1, TILE_BYTES // max(1, v * item))
        self.block = max(1, BLOCK_BYTES // max(1, width * item))

    def run(self, row_weight: Array | None, want_h: bool, want_w: bool) -> Any:
        """Each row's loss; with ``row_weight`` (one per row, or one for every row) also
        the gradients of ``sum(row_weight * loss)`` for ``h2`` and ``weight`` (None where
        not wanted): ``(losses, grad_h2, grad_weight)``."""
        bk, h2, w = self.bk, self.h2, self.weight
        rows, width = h2.shape
        v = w.shape[0]
        wt = bk.transpose(w, (1, 0))
        grads = row_weight is not None
        losses = bk.empty((rows,), h2.dtype)
        gh = bk.empty((rows, width), h2.dtype) if want_h else None
        gw = bk.zeros((v, width), w.dtype) if want_w else None
        tile = bk.empty((min(rows, self.step), v), h2.dtype) if rows else None
        part = bk.empty((min(v, self.block), width), w.dtype) if want_w and rows else None
        for lo in range(0, rows, self.step):
            hi = min(rows, lo + self.step)
            hc, z = h2[lo:hi], tile[: hi - lo]
            bk.scaled_matmul(hc, wt, 1.0, out=z)
            rw = None
            if grads:
                rw = row_weight if row_weight.shape[0] == 1 else row_weight[lo:hi]
            losses[lo:hi] = self._tile(z, lo, hi, rw)
            if want_h:
                bk.scaled_matmul(z, w, 1.0, out=gh[lo:hi])
            if want_w:
                zt = bk.transpose(z, (1, 0))
                for b in range(0, v, self.block):
                    e = min(v, b + self.block)
                    gw[b:e] += bk.scaled_matmul(zt[b:e], hc, 1.0, out=part[: e - b])
        if not grads:
            return losses
        return losses, gh, gw

    def _tile(self, z: Array, lo: int, hi: int, rw: Array | None) -> Array:
        """The losses of rows ``lo .. hi`` from their logits ``z``, which become the
        gradient of ``sum(rw * loss)`` when ``rw`` is given (scratch otherwise)."""
        bk = self.bk
        per = bk.cross_entropy_tile_(z, self.t[lo:hi], self.ignore_index, self.smoothing, rw)
        if per is not None:  # the kernels give an ignored row loss and gradient 0
            return per
        valid = None if self.valid is None else self.valid[lo:hi]
        if valid is not None and rw is not None:
            rw = bk.where(valid, rw, 0.0)
        per = self._tile_generic(z, self.safe[lo:hi], rw)
        if valid is None:
            return per
        if rw is not None:  # no gradient in an ignored row, even where its logits are not finite
            z[~valid] = 0.0
        return bk.where(valid, per, 0.0)

    def _tile_generic(self, z: Array, t: Array, rw: Array | None) -> Array:
        """``_tile`` by backend operations, in place in ``z`` but for a few vectors:
        each row shifted by its own maximum, as ``Backend.cross_entropy_rows``."""
        bk, e = self.bk, self.smoothing
        n, c = z.shape
        z -= _row_shift(bk, z)
        picked = bk.reshape(bk.take_along_axis(z, bk.reshape(t, (n, 1)), -1), (n,))
        shifted_sum = bk.reshape(sum_last(bk, z), (n,)) if e else None
        z = bk.exp_(z)
        den = bk.reshape(sum_last(bk, z), (n,))
        log_den = bk.log(den)
        per = log_den - picked
        if e:
            per = smoothed_loss(per, shifted_sum, log_den, c, e)
        if rw is not None:
            w = bk.broadcast_to(rw, (n,))
            z *= bk.reshape(w / den, (n, 1))
            if e:
                z -= bk.reshape(w * (e / c), (n, 1))
            z[bk.arange(n, bk.int64), t] -= w * (1.0 - e)
        return per
