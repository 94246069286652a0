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
"""The most bytes of one chunk of logits (a block of rows x a block of the vocabulary)."""
BLOCK_BYTES = 8 << 20
"""The most bytes of one block of the weight's gradient summed into it at a time."""
MIN_COLUMNS = 2048
"""The fewest classes of a chunk that does not hold the whole vocabulary: a chunk takes
all rows unless that leaves it fewer (its products then stay efficient)."""


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
    none. The logits are computed a chunk of at most ``TILE_BYTES`` at a time, never
    all of them. Where a chunk holds whole rows of logits (a vocabulary of up to
    ``TILE_BYTES / (rows * itemsize)`` classes), each chunk's logits are one product,
    are turned in place into their softmax and then into their gradient
    (``Backend.cross_entropy_tile_``, else backend operations), which two more products
    turn into the rows of ``h``'s gradient and a sum into ``weight``'s (in blocks of
    ``BLOCK_BYTES``): three products in all. A larger vocabulary is taken in blocks of
    classes (all rows at once, unless that leaves fewer than ``MIN_COLUMNS`` classes per
    block): a first pass gives each row's log-sum-exp online, and a second computes
    each block's logits again, turns them into their gradient and writes that block of
    ``weight``'s gradient and adds to ``h``'s: four products, each of full-size
    operands (the weight read twice rather than once per chunk of rows). For a "mean"
    or "sum" wanting a gradient that all happens in the forward: the node keeps the two
    gradients (the size of its inputs) and its VJP scales them by the cotangent. The
    products of an operand that needs no gradient are skipped, and without any gradient
    only the logits' products run. ``"none"`` keeps nothing: its VJP runs the chunks
    again with the cotangent's weights. The extra memory is one chunk, one block of a
    gradient and a few numbers per row.
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
        rows = h2.shape[0]
        self.step = max(1, min(rows, TILE_BYTES // (max(1, min(v, MIN_COLUMNS)) * item)))
        self.cols = min(v, max(1, TILE_BYTES // (self.step * item)))
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
        whole = self.cols == v  # a chunk holds whole rows of logits: one pass
        losses = bk.empty((rows,), h2.dtype)
        gh = None
        if want_h:
            gh = (bk.empty if whole else bk.zeros)((rows, width), h2.dtype)
        gw = None  # the first chunk of rows writes it, the others add to it
        if want_w:
            gw = (bk.empty if rows else bk.zeros)((v, width), w.dtype)
        buf = bk.empty((min(rows, self.step) * self.cols,), h2.dtype) if rows else None
        part = None
        if want_w and rows > self.step and whole:
            part = bk.empty((min(v, self.block), width), w.dtype)
        for lo in range(0, rows, self.step):
            hi = min(rows, lo + self.step)
            hc = h2[lo:hi]
            rw = None
            if grads:
                rw = row_weight if row_weight.shape[0] == 1 else row_weight[lo:hi]
            if not whole:
                losses[lo:hi], lse = self._log_sum_exp(buf, hc, lo, hi)
                if grads:
                    self._blocks_backward(buf, hc, lo, hi, lse, rw, gh, gw)
                continue
            z = bk.reshape(buf[: (hi - lo) * v], (hi - lo, v))
            bk.scaled_matmul(hc, wt, 1.0, out=z)
            losses[lo:hi] = self._tile(z, lo, hi, rw)
            if want_h:
                bk.scaled_matmul(z, w, 1.0, out=gh[lo:hi])
            if want_w:
                zt = bk.transpose(z, (1, 0))
                if lo == 0:
                    bk.scaled_matmul(zt, hc, 1.0, out=gw)
                    continue
                for b in range(0, v, self.block):
                    e = min(v, b + self.block)
                    gw[b:e] += bk.scaled_matmul(zt[b:e], hc, 1.0, out=part[: e - b])
        if not grads:
            return losses
        return losses, gh, gw

    def _logits(self, buf: Array, hc: Array, b0: int, b1: int) -> Array:
        """The logits of the rows ``hc`` for classes ``b0 .. b1``, written into ``buf``."""
        bk = self.bk
        z = bk.reshape(buf[: hc.shape[0] * (b1 - b0)], (hc.shape[0], b1 - b0))
        return bk.scaled_matmul(hc, bk.transpose(self.weight[b0:b1], (1, 0)), 1.0, out=z)

    def _log_sum_exp(self, buf: Array, hc: Array, lo: int, hi: int) -> tuple[Array, Array]:
        """The losses of rows ``lo .. hi`` and the log-sum-exp of their logits, over the
        vocabulary a block of ``cols`` classes at a time: an online log-sum-exp, each
        block's exponentials shifted by the largest logit seen so far."""
        bk, e = self.bk, self.smoothing
        n, v = hi - lo, self.weight.shape[0]
        t = self.safe[lo:hi]
        top = total = picked = summed = shift = None
        for b0 in range(0, v, self.cols):
            b1 = min(v, b0 + self.cols)
            z = self._logits(buf, hc, b0, b1)
            inside = (t >= b0) & (t < b1)
            column = bk.reshape(bk.where(inside, t - b0, 0), (n, 1))
            at = bk.reshape(bk.take_along_axis(z, column, -1), (n,))
            picked = bk.where(inside, at, 0.0 if picked is None else picked)
            if e:
                block_sum = bk.reshape(sum_last(bk, z), (n,))
                summed = block_sum if summed is None else summed + block_sum
            m = bk.max(z, axis=-1)
            top = m if top is None else bk.maximum(top, m)
            new = bk.where(top == -math.inf, 0.0, top)  # a row of only -inf so far: 0
            z -= bk.reshape(new, (n, 1))
            block_total = bk.reshape(sum_last(bk, bk.exp_(z)), (n,))
            if total is not None:  # the sum so far, rescaled to the new shift
                block_total = block_total + bk.where(total == 0, 0.0, total * bk.exp(shift - new))
            total, shift = block_total, new
        log_total = bk.log(total)
        lse = shift + log_total
        per = lse - picked
        if e:
            per = smoothed_loss(per, summed - v * shift, log_total, v, e)
        if self.valid is not None:
            per = bk.where(self.valid[lo:hi], per, 0.0)
        return per, lse

    def _blocks_backward(
        self, buf: Array, hc: Array, lo: int, hi: int, lse: Array, rw: Array, gh: Any, gw: Any
    ) -> None:
        """Add the gradients of ``sum(rw * loss)`` over rows ``lo .. hi`` into ``gh`` and
        ``gw`` (where not None), block by block of the vocabulary from the log-sum-exp:
        each block's logits again, turned in place into their gradient."""
        bk, e = self.bk, self.smoothing
        n, v = hi - lo, self.weight.shape[0]
        t = self.safe[lo:hi]
        valid = None if self.valid is None else self.valid[lo:hi]
        w = bk.broadcast_to(rw, (n,))
        if valid is not None:
            w = bk.where(valid, w, 0.0)
        rows = bk.arange(n, bk.int64)
        for b0 in range(0, v, self.cols):
            b1 = min(v, b0 + self.cols)
            z = self._logits(buf, hc, b0, b1)
            z -= bk.reshape(lse, (n, 1))
            z = bk.exp_(z)
            z *= bk.reshape(w, (n, 1))
            if e:
                z -= bk.reshape(w * (e / v), (n, 1))
            inside = (t >= b0) & (t < b1)
            z[rows, bk.where(inside, t - b0, 0)] -= bk.where(inside, w * (1.0 - e), 0.0)
            if valid is not None:  # no gradient in an ignored row, whatever its logits
                z[~valid] = 0.0
            if gh is not None:
                gh[lo:hi] += bk.matmul(z, self.weight[b0:b1])
            if gw is not None:
                zt = bk.transpose(z, (1, 0))
                if lo == 0:
                    bk.scaled_matmul(zt, hc, 1.0, out=gw[b0:b1])
                else:
                    gw[b0:b1] += bk.matmul(zt, hc)

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
