"""The alias map: canonical slots computed from storage identity (C1, C5)."""

from __future__ import annotations

from collections.abc import Sequence

from .storage import ParameterStorage


def canonical_indices(storages: Sequence[ParameterStorage | None]) -> list[int | None]:
    """Map each position to the first position holding the same storage object.

    ``None`` entries (frozen slots, or registrations without a storage) map to None
    and are never a representative. Every result ``c`` of position ``i`` satisfies
    ``c <= i`` and maps to itself, so there are no chains. Built with one hash index
    keyed by the storage objects, whose hash and equality are object identity (C1),
    so the map is linear in the number of positions, reads no values and is rebuilt
    on every call: re-tying and untying are always honoured (C5).
    """
    first: dict[ParameterStorage, int] = {}
    index = first.setdefault
    return [None if st is None else index(st, i) for i, st in enumerate(storages)]
