"""Losses: cross-entropy over the last axis (fused log-softmax) and mean squared error."""

from __future__ import annotations

import math
from typing import Any

from .. import _checks
from ..backend.base import smoothed_loss
from ..errors import ShapeError
from ..tape import TensorRef
from ._core import (
    check_index_range,
    check_reduction,
    host_targets,
    int_array,
    lift,
    needs_grad,
    session_of,
    shifted_exp,
    sum_last,
    value_of,
)
from .reduce import half_to_float32, scaled_sum


def cross_entropy(
    logits: TensorRef,
    targets: Any,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
) -> TensorRef:
    """Cross-entropy of ``logits`` (..., C) against integer ``targets`` of shape (...).

    As ``torch.nn.functional.cross_entropy`` with the class axis last: a position whose
    target is ``ignore_index`` contributes nothing (loss and gradient 0 even where its
    logits are not finite; on a torch device, PyTorch's fused kernels give such a
    position PyTorch's NaN gradient); ``"mean"`` divides by the number of
    other positions (0 when there are none, where PyTorch gives NaN). With smoothing
    ``e`` the loss of a position is ``-(1 - e) * logp[t] - e / C * sum(logp)``. One node;
    the forward keeps the softmax and the VJP is ``(softmax - q) * weight`` with ``q``
    the smoothed one-hot target, built as ``softmax * weight`` minus the target terms
    (scattered into the rows, no one-hot array). ``ignore_index`` is an integer and
    ``label_smoothing`` a real number in [0, 1], read as Python numbers (a NumPy scalar
    does not widen the loss); a half-precision mean or sum accumulates in float32.
    """
    s = session_of(logits)
    bk = s.backend
    check_reduction("cross_entropy", reduction)
    ignore_index = _checks.count("cross_entropy", "ignore_index", ignore_index, -(2**63))
    label_smoothing = _checks.unit_interval("cross_entropy", "label_smoothing", label_smoothing)
    lv = logits.value
    shape = tuple(lv.shape)
    t = int_array(s, "cross_entropy", targets)
    if not shape or tuple(t.shape) != shape[:-1]:
        raise ShapeError(
            f"cross_entropy: targets of shape {tuple(t.shape)} do not fit logits of shape "
            f"{shape} (expected targets of shape logits.shape[:-1])"
        )
    c = shape[-1]
    extra = f" or equal {ignore_index=}"
    host_count = host_targets("cross_entropy", targets, ignore_index, c, extra)
    valid = t_safe = None  # on the device only where the targets are not a host array
    if host_count is None:
        valid = t != ignore_index
        t_safe = bk.where(valid, t, 0)
        check_index_range(s, "cross_entropy", "targets", t_safe, c, extra)
    want = needs_grad(s, logits)
    rows = math.prod(shape[:-1])
    # the kernel reduces, except a mean whose divisor is not a positive host count
    kernel_reduction = "none" if reduction == "mean" and not host_count else reduction
    flat = len(shape) == 2  # rows already: no reshapes
    fused = bk.cross_entropy_rows(
        lv if flat else bk.reshape(lv, (rows, c)),
        t if flat else bk.reshape(t, (rows,)),
        ignore_index,
        label_smoothing,
        want,
        kernel_reduction,
        host_count,
    )
    if fused is not None:
        if kernel_reduction != "none":
            return _reduced_cross_entropy(s, logits, fused)
        return _fused_cross_entropy(s, logits, fused, valid, host_count, reduction)
    # Host targets none of which is ignored (the common case) need no mask: multiplying
    # by a mask of ones would change no bit.
    vmask = None
    if host_count != rows:
        if valid is None:
            valid = t != ignore_index
            t_safe = bk.where(valid, t, 0)
        vmask = bk.astype(valid, lv.dtype)
    flat_t = bk.astype(bk.reshape(t if vmask is None else t_safe, (rows, 1)), bk.int64)
    shifted, probs, den = shifted_exp(bk, lv)
    log_den = bk.reshape(bk.log(den), shape[:-1])
    picked = bk.take_along_axis(bk.reshape(shifted, (rows, c)), flat_t, -1)
    per = log_den - bk.reshape(picked, shape[:-1])
    if label_smoothing:
        shifted_sum = bk.reshape(sum_last(bk, shifted), shape[:-1])
        per = smoothed_loss(per, shifted_sum, log_den, c, label_smoothing)
    del shifted
    if vmask is not None:  # an ignored position is 0, even where its logits are not finite
        per = bk.where(valid, per, 0.0)
    count = loss_count(bk, reduction, vmask, host_count)
    out = reduce_losses(bk, per, reduction, count)
    if want:
        probs *= 1.0 / den  # the softmax, kept for the VJP
    del den
    hit = 1.0 - label_smoothing

    def vjp(g):  # runs only when ``want``: the tape keeps no VJP of a node without grad
        # the mask, or without one a single 1 of the logits' dtype: the weights take the
        # dtype the mask gives them (the backend's promotion of the logits' and g's)
        unit = bk.ones((1,), lv.dtype) if vmask is None else vmask
        w = unit * (g if reduction == "none" else g / (count or 1.0))
        w = bk.reshape(w, (-1,))  # one weight per row, or one for every row
        scale = bk.reshape(w, (-1, 1))
        grad = bk.reshape(probs, (rows, c)) * scale
        if label_smoothing:
            grad -= scale * (label_smoothing / c)
        # one target per row: an indexed update (no index repeats, nothing to accumulate)
        grad[bk.arange(rows, bk.int64), bk.reshape(flat_t, (rows,))] += w * -hit
        if vmask is not None:  # no gradient at an ignored position, whatever its logits
            grad = bk.where(bk.reshape(valid, (rows, 1)), grad, 0.0)
        return (bk.reshape(grad, shape),)

    return s._record(out, (logits.id,), vjp)


def loss_count(bk: Any, reduction: str, mask: Any, host_count: int | None) -> float:
    """The divisor of a mean: the positions not ignored (counted on the host when the
    targets are a NumPy array, else from the device ``mask``); 1.0 for other reductions."""
    if reduction != "mean":
        return 1.0
    return float(bk.sum(mask) if host_count is None else host_count)


def reduce_losses(bk: Any, per: Any, reduction: str, count: float) -> Any:
    """The per-position losses reduced: as they are, summed, or summed over ``count``
    (half precision in float32, ``scaled_sum``)."""
    if reduction == "none":
        return per
    return scaled_sum(bk, per, scale=1.0 / count if reduction == "mean" and count else None)


def _reduced_cross_entropy(s: Any, logits: TensorRef, fused: tuple[Any, Any]) -> TensorRef:
    """``cross_entropy`` from the backend's fused kernel that also reduced the rows."""
    bk = s.backend
    loss, rows_vjp = fused
    shape = tuple(logits.value.shape)

    def vjp(g):  # runs only when ``rows_vjp`` exists: the op wanted the gradient
        return (bk.reshape(rows_vjp(g), shape),)

    return s._record(loss, (logits.id,), vjp)


def _fused_cross_entropy(
    s: Any, logits: TensorRef, fused: tuple[Any, Any], valid: Any, host_count: Any, reduction: str
) -> TensorRef:
    """``cross_entropy`` from the backend's fused rows (``Backend.cross_entropy_rows``)."""
    bk = s.backend
    rows_loss, rows_vjp = fused
    shape = tuple(logits.value.shape)
    count = loss_count(bk, reduction, valid, host_count)
    out = reduce_losses(bk, bk.reshape(rows_loss, shape[:-1]), reduction, count)
    rows = math.prod(shape[:-1])

    def vjp(g):  # runs only when ``rows_vjp`` exists: the op wanted the gradient
        w = g if reduction == "none" else bk.broadcast_to(g / (count or 1.0), shape[:-1])
        return (bk.reshape(rows_vjp(bk.reshape(w, (rows,))), shape),)

    return s._record(out, (logits.id,), vjp)


def mse_loss(pred: TensorRef, target: Any, reduction: str = "mean") -> TensorRef:
    """Mean (or summed, or elementwise) squared difference; shapes must be equal.

    A reduced loss is the dot product of the flat difference with itself (one pass),
    of a half-precision difference in float32 (rounded back once, as ``ops.mean``).
    The mean of no elements is NaN, as ``ops.mean`` and PyTorch's ``mse_loss`` give.
    """
    s = session_of(pred, target)
    bk = s.backend
    check_reduction("mse_loss", reduction)
    pv, tv = value_of(s, pred), value_of(s, target)
    if tuple(pv.shape) != tuple(tv.shape):
        raise ShapeError(
            f"mse_loss: pred has shape {tuple(pv.shape)} but target has shape {tuple(tv.shape)}"
        )
    pred, target = lift(s, pred, pv), lift(s, target, tv)
    diff = pv - tv
    n = math.prod(tuple(pv.shape))
    mean = reduction == "mean"
    scale = (1.0 / n if n else math.nan) if mean else 1.0
    if reduction == "none":
        out = diff * diff
    else:
        flat = bk.reshape(diff, (-1,))
        wide = half_to_float32(bk, flat.dtype)
        if wide is not None:
            flat = bk.astype(flat, wide)
        out = bk.matmul(flat, flat)  # one BLAS dot: no squared temporary
        if mean:
            out = out * scale
        if wide is not None:
            out = bk.astype(out, diff.dtype)
    factor = 2.0 * scale
    want_p, want_t = needs_grad(s, pred), needs_grad(s, target)

    def vjp(g):
        gd = diff * (g * factor)
        return (gd if want_p else None, -gd if want_t else None)

    return s._record(out, (pred.id, target.id), vjp)
