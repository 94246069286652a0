"""The alias map: canonical slots computed from storage identity (C1, C5)."""

from __future__ import annotations

from collections.abc import Sequence

from .storage import ParameterStorage


def canonical_indices(storages: Sequence[ParameterStorage | None]) -> list[int | None]:
    """Map each position to the first position holding the same storage object.

    ``None`` entries (frozen slots, or registrations without a storage) map to None
    and are never a representative. Built with one hash index on storage identity,
    linear in the number of positions, rebuilt on every call so re-tying and untying
    are always honoured (C5). Values are never read (C1).
    """
    first: dict[int, int] = {}
    out: list[int | None] = []
    for i, st in enumerate(storages):
        if st is None:
            out.append(None)
        else:
            out.append(first.setdefault(id(st), i))
    return out
