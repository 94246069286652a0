"""``GradientScatter``: stage 2's reduce-scatter of the canonical gradients into partitions.

Each rank packs its canonical gradients (each divided by the world size, as the
all-reduce buckets do; a storage it did not use as zeros) in ``ShardPlan`` order and
reduce-scatters them, so it receives the mean over the ranks of its own partition
only and never holds the summed gradient of elements another rank owns. gloo has
``reduce_scatter_tensor`` for every floating dtype in torch 2.13, so no all-reduce is
needed. The partition buffers are allocated once and reused; the packing goes
through a scratch buffer that lives for the call only, in rounds: round ``k`` packs
the ``k``-th block of every rank's range, at most ``bucket_bytes`` in all. Between
steps a rank holds ``1 / world_size`` of the gradients; during the call, at most
``bucket_bytes`` more, which hold this rank's own (unsummed) gradients, never a sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .group import reduce_scatter_array
from .sharding import DTypeRange, ShardPlan


class GradientScatter:
    """The partition buffers of one ``ShardPlan`` and its rounds; see the module docstring."""

    def __init__(self, plan: ShardPlan, bucket_bytes: int) -> None:
        self.plan = plan
        self.partitions = [np.zeros(r.chunk, r.dtype) for r in plan.ranges]
        self.blocks = [
            max(1, min(r.chunk, bucket_bytes // r.dtype.itemsize // r.world_size))
            for r in plan.ranges
        ]
        parts = {id(r): part for r, part in zip(plan.ranges, self.partitions)}
        self.views = [  # this rank's pieces in the partition buffers, plan.pieces order
            parts[id(r)][p.offset - r.bounds(plan.rank)[0] :][: p.size] for r, p in plan.pieces
        ]

    @property
    def nbytes(self) -> int:
        """The bytes of gradient this rank holds between steps: its partitions."""
        return sum(a.nbytes for a in self.partitions)

    @property
    def scratch_bytes(self) -> int:
        """The most bytes of scratch one call holds at a time."""
        return max(
            (r.world_size * b * r.dtype.itemsize for r, b in zip(self.plan.ranges, self.blocks)),
            default=0,
        )

    def reduce(self, gradients: Sequence[Any]) -> list[np.ndarray]:
        """The mean over the ranks of this rank's pieces (views of the partition buffers,
        valid until the next call), in ``plan.pieces`` order. ``gradients`` is a checked
        per-slot list: an array or None at each canonical slot."""
        scale = 1.0 / self.plan.world_size
        for r, part, block in zip(self.plan.ranges, self.partitions, self.blocks):
            scratch = np.empty(r.world_size * block, r.dtype)
            for first in range(0, r.chunk, block):
                n = min(block, r.chunk - first)
                for rank in range(r.world_size):
                    lo = rank * r.chunk + first
                    dst = scratch[rank * n : (rank + 1) * n]
                    _pack(r, gradients, lo, min(lo + n, r.total), dst, scale)
                reduce_scatter_array(
                    part[first : first + n], scratch[: r.world_size * n], "the gradient scatter"
                )
        return list(self.views)


def _pack(
    r: DTypeRange, gradients: Sequence[Any], lo: int, hi: int, dst: np.ndarray, scale: float
) -> None:
    """Flat elements ``[lo, hi)`` of ``r``'s gradients times ``scale`` into ``dst``; zeros
    for a missing gradient and past the end."""
    dst[max(0, hi - lo) :] = 0
    for piece in r.pieces(lo, hi):
        out = dst[piece.offset - lo : piece.offset - lo + piece.size]
        g = gradients[piece.slot]
        if g is None:
            out[...] = 0
        else:
            np.multiply(g.reshape(-1)[piece.start : piece.stop], out.dtype.type(scale), out=out)
