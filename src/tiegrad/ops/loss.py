"""Losses: cross-entropy over the last axis (fused log-softmax) and mean squared error."""

from __future__ import annotations

import math
from typing import Any

from ..errors import HyperparameterError, ShapeError
from ..session import TensorRef
from ._core import (
    check_index_range,
    check_reduction,
    int_array,
    lift,
    needs_grad,
    session_of,
    value_of,
)


def cross_entropy(
    logits: TensorRef,
    targets: Any,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
) -> TensorRef:
    """Cross-entropy of ``logits`` (..., C) against integer ``targets`` of shape (...).

    As ``torch.nn.functional.cross_entropy`` with the class axis last: a position whose
    target is ``ignore_index`` contributes nothing; ``"mean"`` divides by the number of
    other positions (0 when there are none, where PyTorch gives NaN). With smoothing
    ``e`` the loss of a position is ``-(1 - e) * logp[t] - e / C * sum(logp)``. One node;
    the VJP is ``(softmax - q) * weight`` with ``q`` the smoothed one-hot target.
    """
    s = session_of(logits)
    bk = s.backend
    check_reduction("cross_entropy", reduction)
    if not 0.0 <= label_smoothing <= 1.0:
        raise HyperparameterError(
            f"cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}"
        )
    lv = logits.value
    shape = tuple(lv.shape)
    t = int_array(s, "cross_entropy", targets)
    if not shape or tuple(t.shape) != shape[:-1]:
        raise ShapeError(
            f"cross_entropy: targets of shape {tuple(t.shape)} do not fit logits of shape "
            f"{shape} (expected targets of shape logits.shape[:-1])"
        )
    c = shape[-1]
    valid = t != ignore_index
    t_safe = bk.where(valid, t, 0)
    check_index_range(s, "cross_entropy", "targets", t_safe, c, f" or equal {ignore_index=}")
    shifted = lv - bk.max(lv, axis=-1, keepdims=True)
    logp = shifted - bk.log(bk.sum(bk.exp(shifted), axis=-1, keepdims=True))
    tgt = bk.expand_dims(t_safe, -1)
    picked = bk.reshape(bk.take_along_axis(logp, tgt, -1), shape[:-1])
    per = -picked
    if label_smoothing:
        per = (1.0 - label_smoothing) * per - (label_smoothing / c) * bk.sum(logp, axis=-1)
    vmask = bk.astype(valid, lv.dtype)
    per = per * vmask
    count = float(bk.sum(vmask)) if reduction == "mean" else 1.0
    if reduction == "none":
        out = per
    elif reduction == "sum":
        out = bk.sum(per)
    else:
        out = bk.sum(per) * (1.0 / count) if count else bk.sum(per)
    want = needs_grad(s, logits)

    def vjp(g):
        if not want:
            return (None,)
        w = vmask * g if reduction == "none" else vmask * (g / (count or 1.0))
        scale = bk.expand_dims(w, -1)
        onehot = tgt == bk.arange(c, t.dtype)
        hit = 1.0 - label_smoothing + label_smoothing / c
        q = bk.where(onehot, hit, label_smoothing / c)
        return ((bk.exp(logp) - bk.astype(q, lv.dtype)) * scale,)

    return s._record(out, (logits.id,), vjp)


def mse_loss(pred: TensorRef, target: Any, reduction: str = "mean") -> TensorRef:
    """Mean (or summed, or elementwise) squared difference; shapes must be equal."""
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
    sq = diff * diff
    n = math.prod(tuple(pv.shape))
    mean = reduction == "mean" and n > 0
    out = sq if reduction == "none" else bk.sum(sq)
    if mean:
        out = out * (1.0 / n)
    factor = 2.0 / n if mean else 2.0
    want_p, want_t = needs_grad(s, pred), needs_grad(s, target)

    def vjp(g):
        gd = diff * (g * factor)
        return (gd if want_p else None, -gd if want_t else None)

    return s._record(out, (pred.id, target.id), vjp)
