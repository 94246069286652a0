"""Inverted dropout with a mask drawn from the session's generator."""

from __future__ import annotations

from ..errors import HyperparameterError
from ..session import TensorRef
from ._core import session_of


def dropout(x: TensorRef, p: float, training: bool = True) -> TensorRef:
    """Zero each element with probability ``p`` and scale the others by ``1 / (1 - p)``.

    The mask comes from ``x.session.rng`` (the session's seeded generator), so a
    session seed fixes every mask. ``p == 0`` or ``training=False`` returns ``x`` itself
    and records nothing; ``p == 1`` gives zeros.
    """
    s = session_of(x)
    if not 0.0 <= p <= 1.0:
        raise HyperparameterError(f"dropout: p must be in [0, 1], got {p}")
    if p == 0.0 or not training:
        return x
    bk = s.backend
    xv = x.value
    shape = tuple(xv.shape)
    if p == 1.0:
        mask = bk.zeros(shape, xv.dtype)
    else:
        keep = bk.random_uniform(s.rng, shape, xv.dtype) >= p
        mask = bk.astype(keep, xv.dtype) * (1.0 / (1.0 - p))
    return s._record(xv * mask, (x.id,), lambda g: (g * mask,))
