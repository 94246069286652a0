"""Cutting along an axis and repeating along it: chunk, split, repeat_interleave.

``chunk`` and ``split`` return lists of refs, one ``getitem`` node per piece, as
PyTorch's ``chunk`` and ``split`` return lists of views.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral
from typing import Any

from ..errors import HyperparameterError, ShapeError
from ..tape import TensorRef
from ._core import one_axis, session_of
from .shape import getitem, reshape


def _count(op: str, name: str, value: Any, minimum: int) -> int:
    """An integer >= ``minimum`` (bools refused), else a ``HyperparameterError``."""
    if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
        raise HyperparameterError(f"{op}: {name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _pieces(x: TensorRef, axis: int, bounds: list[int]) -> list[TensorRef]:
    """The slices ``bounds[i]:bounds[i + 1]`` of ``x`` along ``axis``, one node each."""
    lead = (slice(None),) * axis
    return [getitem(x, lead + (slice(lo, hi),)) for lo, hi in zip(bounds[:-1], bounds[1:])]


def chunk(x: TensorRef, chunks: int, axis: int = 0) -> list[TensorRef]:
    """``x`` cut along ``axis`` into pieces of ``ceil(n / chunks)`` (the last may be
    smaller, so there may be fewer than ``chunks``), as PyTorch's ``chunk``; an axis of
    size 0 gives ``chunks`` empty pieces. ``chunks`` is an integer >= 1."""
    session_of(x)
    chunks = _count("chunk", "chunks", chunks, 1)
    a = one_axis(axis, x.value.ndim, "chunk")
    n = x.value.shape[a]
    if not n:
        return _pieces(x, a, [0] * (chunks + 1))
    size = -(-n // chunks)
    return _pieces(x, a, list(range(0, n, size)) + [n])


def split(x: TensorRef, sizes: int | Sequence[int], axis: int = 0) -> list[TensorRef]:
    """``x`` cut along ``axis`` as PyTorch's ``split``: an int ``sizes`` gives pieces of
    that size (the last may be smaller), a sequence gives pieces of those sizes, which
    must add up to the axis's size (``ShapeError`` naming both)."""
    session_of(x)
    a = one_axis(axis, x.value.ndim, "split")
    n = x.value.shape[a]
    if isinstance(sizes, Integral) and not isinstance(sizes, bool):
        size = _count("split", "the split size", sizes, 0 if n == 0 else 1)
        return _pieces(x, a, list(range(0, n, size)) + [n] if n else [0, 0])
    sizes = [_count("split", "each size", k, 0) for k in sizes]
    if sum(sizes) != n:
        raise ShapeError(
            f"split: sizes add up to {sum(sizes)}, expected the size {n} of axis {a} of shape "
            f"{tuple(x.value.shape)}"
        )
    bounds = [0]
    for k in sizes:
        bounds.append(bounds[-1] + k)
    return _pieces(x, a, bounds)


def repeat_interleave(
    x: TensorRef, repeats: int | Sequence[int], axis: int | None = None
) -> TensorRef:
    """Each element of ``x`` along ``axis`` repeated ``repeats`` times in place (PyTorch's
    ``repeat_interleave``; ``axis=None`` flattens ``x`` first).

    ``repeats`` is an integer >= 0, or one per element of the axis. VJP: each element's
    copies summed (a reshape and a sum for an integer; a scatter-add otherwise).
    """
    op = "repeat_interleave"
    s = session_of(x)
    bk = s.backend
    if axis is None:
        return repeat_interleave(reshape(x, (-1,)), repeats, 0)
    xv = x.value
    shape = tuple(xv.shape)
    a = one_axis(axis, len(shape), op)
    n = shape[a]
    if isinstance(repeats, Integral) and not isinstance(repeats, bool):
        r = _count(op, "repeats", repeats, 0)
        wide = shape[: a + 1] + (r,) + shape[a + 1 :]
        out = bk.reshape(
            bk.broadcast_to(bk.expand_dims(xv, a + 1), wide), shape[:a] + (n * r,) + shape[a + 1 :]
        )
        return s._record(out, (x.id,), lambda g: (bk.sum(bk.reshape(g, wide), axis=a + 1),))
    counts = [_count(op, "each repeat", k, 0) for k in repeats]
    if len(counts) != n:
        raise ShapeError(
            f"{op}: {len(counts)} repeats for axis {a} of size {n} in shape {shape}, expected {n}"
        )
    index = bk.asarray([i for i, k in enumerate(counts) for _ in range(k)], bk.int64)
    at = (slice(None),) * a + (index,)

    def vjp(g):
        z = bk.zeros(shape, g.dtype)
        bk.accumulate_at(z, at, g)
        return (z,)

    return s._record(bk.take(xv, index, axis=a), (x.id,), vjp)
