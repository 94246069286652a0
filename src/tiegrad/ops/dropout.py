"""Inverted dropout with a mask drawn from the session's generator."""

from __future__ import annotations

from .. import _checks
from ..tape import TensorRef
from ._core import session_of
from .reduce import half_to_float32


def dropout(x: TensorRef, p: float, training: bool = True) -> TensorRef:
    """Zero each element with probability ``p`` and scale the others by ``1 / (1 - p)``.

    The mask comes from ``x.session.rng`` (the session's seeded generator), so a
    session seed fixes every mask; half precision draws in float32 (NumPy draws no
    float16). ``p`` is a real number in [0, 1] (a NumPy scalar does not widen the
    result's dtype). ``p == 0`` or ``training=False`` returns ``x`` itself and records
    nothing; ``p == 1`` gives zeros.
    """
    s = session_of(x)
    p = _checks.unit_interval("dropout", "p", p)
    if p == 0.0 or not training:
        return x
    bk = s.backend
    xv = x.value
    shape = tuple(xv.shape)
    if p == 1.0:
        mask = bk.zeros(shape, xv.dtype)
    else:
        wide = half_to_float32(bk, xv.dtype)
        keep = bk.random_uniform(s.rng, shape, xv.dtype if wide is None else wide) >= p
        mask = bk.astype(keep, xv.dtype) * (1.0 / (1.0 - p))
    return s._record(xv * mask, (x.id,), lambda g: (g * mask,))
