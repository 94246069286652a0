"""Embedding lookup: rows of a (V, D) table at integer ids, VJP by scatter-add."""

from __future__ import annotations

from typing import Any

from ..errors import ShapeError
from ..tape import TensorRef
from ._core import check_index_range, host_indices, int_array, session_of


def embedding(weight: TensorRef, indices: Any) -> TensorRef:
    """Rows of ``weight`` (V, D) at ``indices`` (integers of any shape, each in [0, V)).

    The output has shape ``indices.shape + (D,)``. The VJP scatter-adds the cotangent
    rows into a zero (V, D) gradient, so repeated ids accumulate.
    """
    s = session_of(weight)
    bk = s.backend
    wv = weight.value
    ws = tuple(wv.shape)
    if len(ws) != 2:
        raise ShapeError(f"embedding: weight must have shape (V, D), got {ws}")
    idx = int_array(s, "embedding", indices)
    n, d = ws
    check_index_range(s, "embedding", "indices", idx, n, host=host_indices(indices))
    flat = bk.reshape(idx, (-1,))
    out = bk.reshape(bk.take(wv, flat, 0), tuple(idx.shape) + (d,))

    def vjp(g):
        gw = bk.zeros(ws, g.dtype)
        bk.index_add(gw, flat, bk.reshape(g, (tuple(flat.shape)[0], d)))  # d may be 0
        return (gw,)

    return s._record(out, (weight.id,), vjp)
