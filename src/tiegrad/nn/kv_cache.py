"""``KVCache``: the keys and values of the positions a decoder has already seen.

Generation feeds the prompt once, then one token per step: each attention layer
appends its new keys and values (B, H_kv, T, D) to its entry along the position axis
and attends over all of them, so a step costs one position's work instead of the whole
sequence's. The cache holds plain arrays, not refs, so it outlives the session resets
between steps (its values are re-entered as constants: a cache never carries gradients).
"""

from __future__ import annotations

from typing import Any

from .. import ops
from ..session import EagerSession, TensorRef


class KVCache:
    """One ``(keys, values)`` entry per layer and the number of positions they hold.

    A forward pass calls ``append`` once per layer, then ``advance`` with the number of
    positions it fed: the appended arrays become the entries only then, so a pass that
    raises half-way leaves the cache as it was (the next pass appends to every layer
    again, replacing what the failed one left pending).
    """

    def __init__(self, layers: int) -> None:
        self.length = 0
        self._entries: list[tuple[Any, Any] | None] = [None] * layers
        self._pending: dict[int, tuple[Any, Any]] = {}

    def append(
        self, session: EagerSession, layer: int, k: TensorRef, v: TensorRef
    ) -> tuple[TensorRef, TensorRef]:
        """The keys and values of every position so far: layer ``layer``'s entry followed
        by ``k`` and ``v`` along axis 2; kept until ``advance``."""
        entry = self._entries[layer]
        if entry is not None:
            k = ops.concat([session.constant(entry[0]), k], axis=2)
            v = ops.concat([session.constant(entry[1]), v], axis=2)
        self._pending[layer] = (k.value, v.value)
        return k, v

    def advance(self, positions: int) -> None:
        """Keep what this pass appended: the cache now holds ``positions`` more."""
        for layer, entry in self._pending.items():
            self._entries[layer] = entry
        self._pending.clear()
        self.length += positions

    def clear(self) -> None:
        """Forget every position."""
        self._entries = [None] * len(self._entries)
        self._pending.clear()
        self.length = 0
