"""``ParamList``: an ordered, shape-checked pack of parameter handles (seed ``001``).

The same storage may sit at several slots (a tie). The trainability mask belongs to
the handles; the alias map (canonical slots, C5) is recomputed from storage identity
on every call, so it always reflects the current layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from ..backend import dtype_name
from ..errors import DTypeError, MissingGradientError, ShapeError, SlotError
from .canonical import canonical_indices
from .groups import check_learning_rate
from .param import Param
from .storage import ParameterStorage, check_host_array


class ParamList:
    """An ordered pack of ``Param`` handles; shapes are part of its identity (``shapes``)."""

    def __init__(self, params: Iterable[Param]) -> None:
        self._params: tuple[Param, ...] = tuple(params)
        for i, p in enumerate(self._params):
            if not isinstance(p, Param):
                raise SlotError(f"slot {i}: expected a Param, got {type(p).__name__}")

    @classmethod
    def of_pack(
        cls, values: Sequence[Any], requires_grad: Sequence[bool] | None = None
    ) -> ParamList:
        """Fresh storages from arrays, with an optional trainability mask.

        The mask must hold exactly one flag per value: a shorter and a longer mask
        are distinct errors, raised before anything is allocated.
        """
        values = list(values)
        if requires_grad is None:
            flags = [True] * len(values)
        else:
            flags = [bool(f) for f in requires_grad]
            if len(flags) < len(values):
                raise SlotError(
                    f"of_pack: the requires_grad mask is shorter than the pack: "
                    f"{len(flags)} flags for {len(values)} values"
                )
            if len(flags) > len(values):
                raise SlotError(
                    f"of_pack: the requires_grad mask is longer than the pack: "
                    f"{len(flags)} flags for {len(values)} values"
                )
        return cls(Param(v, requires_grad=f) for v, f in zip(values, flags))

    # -- sequence ----------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._params)

    def __getitem__(self, i: int) -> Param:
        return self._params[i]

    def __iter__(self) -> Iterator[Param]:
        return iter(self._params)

    def __repr__(self) -> str:
        return f"ParamList({len(self)} slots, {len(set(map(id, self.storages())))} storages)"

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(p.shape for p in self._params)

    @property
    def dtypes(self) -> tuple[np.dtype, ...]:
        return tuple(p.dtype for p in self._params)

    def storages(self) -> list[ParameterStorage]:
        """The storage at every slot, frozen slots included."""
        return [p.storage for p in self._params]

    # -- mask, values ------------------------------------------------------------------
    def requires_grad_array(self) -> list[bool]:
        """The trainability mask in slot order."""
        return [p.requires_grad for p in self._params]

    def values(self) -> list[np.ndarray]:
        """Host values in slot order, without syncing newer mirrors (may be stale, C7)."""
        return [p.storage.host for p in self._params]

    def values_synced(self) -> list[np.ndarray]:
        """Host values after syncing every newer mirror (C7)."""
        return [p.storage.current_host_value() for p in self._params]

    def set_values(self, values: Sequence[Any]) -> None:
        """Replace every slot's value; all lengths, shapes and dtypes are checked first (C6).

        A storage that appears at several slots is written at each of them in slot
        order, so the last slot's value wins.
        """
        values = list(values)
        if len(values) != len(self):
            raise SlotError(f"set_values: expected {len(self)} values, got {len(values)}")
        checked = [
            check_host_array(f"set_values slot {i}", v, p.shape, p.dtype)
            for i, (p, v) in enumerate(zip(self._params, values))
        ]
        for p, v in zip(self._params, checked):
            p.storage.commit_host(np.array(v, copy=True))

    # -- alias map ---------------------------------------------------------------------
    def optimizer_storage(self) -> list[ParameterStorage | None]:
        """The storage per slot, None at every frozen slot."""
        return [p.storage if p.requires_grad else None for p in self._params]

    def canonical_slot_indices(self) -> list[int | None]:
        """Each trainable slot -> the first trainable slot sharing its storage (C5).

        Frozen slots map to None and are never representatives; indices are list
        indices, never compressed. Rebuilt on every call from storage identity.
        """
        return canonical_indices(self.optimizer_storage())

    def canonical_gradients(
        self, slots: Sequence[int | None], gradients: Sequence[Any]
    ) -> list[Any | None]:
        """Sum per-slot gradients at their canonical slots, in list order (seed ``001``).

        Frozen (None) slots contribute nothing. A storage with one trainable slot gets
        the very gradient object it was given. Lengths, index ranges, representatives,
        shapes and dtypes are all validated before any addition; inputs are never
        written into.
        """
        slots = list(slots)
        gradients = list(gradients)
        n = len(self)
        if len(slots) != n:
            raise SlotError(f"canonical_gradients: {len(slots)} slots for {n} parameters")
        if len(gradients) != n:
            raise SlotError(f"canonical_gradients: {len(gradients)} gradients for {n} parameters")
        for i, c in enumerate(slots):
            if c is None:
                continue
            if not isinstance(c, (int, np.integer)) or isinstance(c, bool) or not 0 <= c <= i:
                raise SlotError(
                    f"canonical_gradients: slot {i} points at {c!r}, expected an index in [0, {i}]"
                )
            if slots[c] != c:
                state = "a frozen slot" if slots[c] is None else f"slot {c} -> {slots[c]}"
                raise SlotError(
                    f"canonical_gradients: slot {i} points at {c}, which is not canonical ({state})"
                )
            g = gradients[i]
            if g is None:
                raise MissingGradientError(f"canonical_gradients: slot {i} has no gradient")
            shape = self._params[c].shape
            if tuple(g.shape) != self._params[i].shape or tuple(g.shape) != shape:
                raise ShapeError(
                    f"canonical_gradients: slot {i} gradient has shape {tuple(g.shape)}, "
                    f"expected {self._params[i].shape} (canonical slot {c}: {shape})"
                )
            if dtype_name(g) != self._params[c].dtype.name:
                raise DTypeError(
                    f"canonical_gradients: slot {i} gradient has dtype {dtype_name(g)}, "
                    f"expected {self._params[c].dtype.name}"
                )
        sums: list[Any | None] = [None] * n
        owned = [False] * n
        for i, c in enumerate(slots):
            if c is None:
                continue
            g = gradients[i]
            if sums[c] is None:
                sums[c] = g
            elif owned[c]:
                sums[c] += g
            else:
                sums[c] = sums[c] + g
                owned[c] = True
        return sums

    @staticmethod
    def canonical_gradient(shape: Sequence[int], sums: Sequence[Any | None], index: int) -> Any:
        """The summed gradient at canonical slot ``index``, checked against ``shape``."""
        if not 0 <= index < len(sums):
            raise SlotError(f"canonical_gradient: index {index} outside [0, {len(sums)})")
        g = sums[index]
        if g is None:
            raise MissingGradientError(f"canonical_gradient: slot {index} has no summed gradient")
        if tuple(g.shape) != tuple(shape):
            raise ShapeError(
                f"canonical_gradient: slot {index} has shape {tuple(g.shape)}, "
                f"expected {tuple(shape)}"
            )
        return g

    # -- updates -----------------------------------------------------------------------
    def sgd_step(self, lr: float, gradients: Sequence[Any]) -> None:
        """``p -= lr * sum`` once per canonical storage, from its current value (C3-C6)."""
        lr = check_learning_rate(lr)
        slots = self.canonical_slot_indices()
        sums = self.canonical_gradients(slots, gradients)
        for i, c in enumerate(slots):
            if c == i:
                storage = self._params[i].storage
                arr = storage.host_for_update()
                arr -= lr * np.asarray(sums[i])
                storage.commit_host(arr)

    # -- reporting ---------------------------------------------------------------------
    def describe(self) -> str:
        """A table of slots: shape, trainability, canonical slot and shared storages.

        Storages used by both a frozen and a trainable slot are flagged ``mixed``.
        """
        slots = self.canonical_slot_indices()
        storage_ids: dict[int, int] = {}
        members: dict[int, list[int]] = {}
        for i, p in enumerate(self._params):
            k = storage_ids.setdefault(id(p.storage), len(storage_ids))
            members.setdefault(k, []).append(i)
        lines = [f"{'slot':>4}  {'name':<24} {'shape':<16} {'trainable':<9} canonical  storage"]
        for i, p in enumerate(self._params):
            k = storage_ids[id(p.storage)]
            flags = {self._params[j].requires_grad for j in members[k]}
            note = f"S{k}"
            if len(members[k]) > 1:
                note += f" shared by slots {members[k]}"
            if len(flags) == 2:
                note += " (mixed: frozen and trainable uses)"
            lines.append(
                f"{i:>4}  {p.name or '-':<24} {str(p.shape):<16} {str(p.requires_grad):<9} "
                f"{str(slots[i]):<10} {note}"
            )
        unique = len(storage_ids)
        lines.append(
            f"{len(self)} slots, {unique} storages, "
            f"{sum(1 for i, c in enumerate(slots) if c == i)} optimizer slots"
        )
        return "\n".join(lines)
