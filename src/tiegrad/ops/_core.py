"""Shared plumbing of the ops: operand checking and broadcasting reversal."""

from __future__ import annotations

from numbers import Number
from typing import Any

from ..backend import Array, Backend
from ..errors import TapeError
from ..session import EagerSession, TensorRef


def session_of(*xs: Any) -> EagerSession:
    """The session of the TensorRefs among ``xs``, checking each is live and local."""
    s = None
    for x in xs:
        if isinstance(x, TensorRef):
            if s is None:
                s = x.session
            s.check(x)
    if s is None:
        raise TapeError("an op needs at least one TensorRef operand to know its session")
    return s


def lift(s: EagerSession, x: Any) -> TensorRef:
    """``x`` as a ref of ``s``: refs are checked, arrays and lists become constants."""
    if isinstance(x, TensorRef):
        s.check(x)
        return x
    return s.constant(x)


def is_scalar(x: Any) -> bool:
    return isinstance(x, Number) and not isinstance(x, bool)


def unbroadcast(bk: Backend, g: Array, shape: tuple[int, ...]) -> Array:
    """Sum ``g`` over the axes that broadcasting added or stretched to reach ``shape``."""
    gshape = tuple(g.shape)
    if gshape == shape:
        return g
    lead = len(gshape) - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, n in enumerate(shape) if n == 1 and gshape[lead + i] != 1
    )
    if axes:
        g = bk.sum(g, axis=axes, keepdims=True)
    return bk.reshape(g, shape)


def normalize_axes(axis: Any, ndim: int) -> tuple[int, ...]:
    """Axes as a sorted tuple of non-negative ints (``None`` means all)."""
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, int):
        axis = (axis,)
    out = []
    for a in axis:
        if not -ndim <= a < ndim:
            raise TapeError(f"axis {a} is out of range for an array of rank {ndim}")
        out.append(a % ndim)
    return tuple(sorted(set(out)))
