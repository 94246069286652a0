"""``ShardPlan``: the trained storages' elements cut into one contiguous range per rank.

Per dtype, the trainable storages are listed once each, at their canonical slot and in
canonical-slot order (C4, C5: a tied storage is one range whatever modules use it; a
frozen storage takes none; a storage frozen at one use and trained at another is
listed once). Their flattened elements are concatenated into ``[0, N)`` and cut into
``world_size`` ranges of ``ceil(N / world_size)`` elements, the last ones shorter or
empty, so a storage may span ranks and ``N`` need not divide by the world size.
Rank ``r``'s partition is the list of its ``Piece``s: a slot and an element range of
its flattened storage. The plan depends only on the layout and the world size, so
every rank computes the same one; ``rows`` lists it for the start check.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import zip_longest

import numpy as np

from ..errors import DistributedError
from ..params import ParameterStorage, ParamList


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of the flattened storage at canonical ``slot``, found
    at ``offset`` in its dtype's flat range."""

    slot: int
    start: int
    stop: int
    offset: int

    @property
    def size(self) -> int:
        return self.stop - self.start


class DTypeRange:
    """The trainable storages of one dtype, flattened end to end, and their cut."""

    def __init__(
        self, dtype: np.dtype, slots: list[int], sizes: list[int], world_size: int
    ) -> None:
        self.dtype = dtype
        self.slots = slots
        self.offsets = [0, *np.cumsum(sizes, dtype=np.int64).tolist()]
        self.total = self.offsets[-1]
        self.chunk = max(1, math.ceil(self.total / world_size))
        self.world_size = world_size

    def bounds(self, rank: int) -> tuple[int, int]:
        """Rank ``rank``'s range of flat elements (empty past the end)."""
        return min(rank * self.chunk, self.total), min((rank + 1) * self.chunk, self.total)

    def pieces(self, lo: int, hi: int) -> list[Piece]:
        """The pieces of the storages that flat range ``[lo, hi)`` covers, in order."""
        out: list[Piece] = []
        k = bisect_right(self.offsets, lo) - 1
        while lo < hi and k < len(self.slots):
            base = self.offsets[k]
            stop = min(hi, self.offsets[k + 1])
            if stop > lo:
                out.append(Piece(self.slots[k], lo - base, stop - base, lo))
            lo = stop
            k += 1
        return out


class ShardPlan:
    """The partition of a ``ParamList``'s trained elements over ``world_size`` ranks.

    ``storages`` is the list's ``optimizer_storage()`` it was made from (compared by
    identity to notice a layout change: a freeze, an unfreeze, a tie, C1, C5);
    ``ranges`` one ``DTypeRange`` per dtype in order of first canonical slot;
    ``pieces`` this ``rank``'s partition as ``(range, piece)`` pairs.
    """

    def __init__(self, plist: ParamList, world_size: int, rank: int) -> None:
        self.storages: list[ParameterStorage | None] = plist.optimizer_storage()
        masked = [p.name or f"slot {i}" for i, p in enumerate(plist) if p.storage.rows_cell]
        if masked:
            raise DistributedError(
                f"a sharded optimizer updates whole storages, and {masked[0]!r} has a row "
                "mask (tiegrad.nn.train_rows); train it without shard, or without the mask"
            )
        self.world_size = world_size
        self.rank = rank
        canonical = plist.canonical_slot_indices()
        by_dtype: dict[np.dtype, tuple[list[int], list[int]]] = {}
        for i, c in enumerate(canonical):
            if c == i:
                slots, sizes = by_dtype.setdefault(np.dtype(plist[i].dtype), ([], []))
                slots.append(i)
                sizes.append(math.prod(plist[i].shape))
        self.shapes = {i: tuple(plist[i].shape) for i, c in enumerate(canonical) if c == i}
        self.ranges = [DTypeRange(d, sl, sz, world_size) for d, (sl, sz) in by_dtype.items()]
        self.pieces = [(r, p) for r in self.ranges for p in r.pieces(*r.bounds(rank))]

    def current(self, storages: Sequence[ParameterStorage | None]) -> bool:
        """Whether ``storages`` (a list's ``optimizer_storage()``) is this plan's layout."""
        return len(storages) == len(self.storages) and all(
            a is b for a, b in zip(storages, self.storages)
        )

    @property
    def trained_elements(self) -> int:
        return sum(r.total for r in self.ranges)

    def rows(self) -> list[tuple[str, int, int, int, int]]:
        """Every rank's pieces as ``(dtype, rank, slot, start, stop)``, rank by rank."""
        return [
            (r.dtype.name, rank, p.slot, p.start, p.stop)
            for r in self.ranges
            for rank in range(self.world_size)
            for p in r.pieces(*r.bounds(rank))
        ]


def check_plans(plans: Sequence[Sequence[tuple[str, int, int, int, int]]]) -> None:
    """``DistributedError`` naming the first rank and piece whose plan (``ShardPlan.rows``
    of each rank, rank by rank) differs from rank 0's."""
    for r, other in enumerate(plans):
        for k, (a, b) in enumerate(zip_longest(plans[0], other)):
            if a != b:
                raise DistributedError(
                    f"DataParallel: rank {r} partitions the trained storages otherwise than "
                    f"rank 0, first at piece {k} (dtype, rank, slot, start, stop): {b} on "
                    f"rank {r}, {a} on rank 0"
                )
