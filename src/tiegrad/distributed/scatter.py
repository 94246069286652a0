"""``GradientScatter``: stage 2's reduce-scatter of the canonical gradients into partitions.

Each rank packs its canonical gradients (each divided by the world size, as the
all-reduce buckets do; a storage it did not use as zeros) in ``ShardPlan`` order and
reduce-scatters them, so it receives the mean over the ranks of its own partition
only and never holds the summed gradient of elements another rank owns. gloo has
``reduce_scatter_tensor`` for every floating dtype in torch 2.13, so no all-reduce is
needed. The packing goes through a scratch buffer in rounds: round ``k`` packs the
``k``-th block of every rank's range (at most ``bucket_bytes`` in all, and at most a
32nd of the trained elements), so the scratch adds at most 1/32 of the gradients to
the partition. Buffers are allocated once and reused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .group import reduce_scatter_array
from .sharding import DTypeRange, ShardPlan

#: the scratch buffer holds at most this fraction of a dtype's trained elements
SCRATCH_SHARE = 1 / 32


class GradientScatter:
    """The partition buffers and scratch of one ``ShardPlan``; see the module docstring.

    ``bytes_reduced`` counts the bytes reduce-scattered so far (padding included).
    """

    def __init__(self, plan: ShardPlan, bucket_bytes: int) -> None:
        self.plan = plan
        self.partitions = [np.zeros(r.chunk, r.dtype) for r in plan.ranges]
        self.blocks = [self._block(r, bucket_bytes) for r in plan.ranges]
        self.scratch = [
            np.empty(r.world_size * b, r.dtype) for r, b in zip(plan.ranges, self.blocks)
        ]
        self.bytes_reduced = 0

    @staticmethod
    def _block(r: DTypeRange, bucket_bytes: int) -> int:
        """The elements per rank of one round."""
        cap = min(bucket_bytes // r.dtype.itemsize, math.ceil(r.total * SCRATCH_SHARE))
        return max(1, min(r.chunk, cap // r.world_size))

    @property
    def nbytes(self) -> int:
        """The bytes of gradient this rank holds: its partitions and the scratch."""
        return sum(a.nbytes for a in (*self.partitions, *self.scratch))

    def reduce(self, gradients: Sequence[Any]) -> list[np.ndarray]:
        """The mean over the ranks of this rank's pieces (views of the partition buffers,
        valid until the next call), in ``plan.pieces`` order. ``gradients`` is a checked
        per-slot list: an array or None at each canonical slot."""
        scale = 1.0 / self.plan.world_size
        for r, part, block, scratch in zip(
            self.plan.ranges, self.partitions, self.blocks, self.scratch
        ):
            for first in range(0, r.chunk, block):
                n = min(block, r.chunk - first)
                for rank in range(r.world_size):
                    lo = rank * r.chunk + first
                    dst = scratch[rank * n : (rank + 1) * n]
                    _pack(r, gradients, lo, min(lo + n, r.total), dst, scale)
                reduce_scatter_array(
                    part[first : first + n], scratch[: r.world_size * n], "the gradient scatter"
                )
                self.bytes_reduced += r.world_size * n * r.dtype.itemsize
        parts = {id(r): part for r, part in zip(self.plan.ranges, self.partitions)}
        out = []
        for r, piece in self.plan.pieces:
            at = piece.offset - r.bounds(self.plan.rank)[0]
            out.append(parts[id(r)][at : at + piece.size])
        return out


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
