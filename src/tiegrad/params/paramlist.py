"""``ParamList``: an ordered, shape-checked pack of parameter handles (C1, C5).

The same storage may sit at several slots (a tie). The trainability mask belongs to
the handles; the alias map (canonical slots, C5) is recomputed from storage identity
on every call, so it always reflects the current layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ..backend import device_backend, dtype_name
from ..errors import DTypeError, MissingGradientError, ShapeError, SlotError
from .canonical import canonical_indices
from .groups import add_new, check_learning_rate
from .param import Param
from .rows import subtract_scaled
from .storage import HOST_DEVICES, ParameterStorage, check_host_array


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
        """Host values in slot order, without syncing newer mirrors (may be stale, C7).

        These are the live read-only host arrays, not copies: an optimizer update made
        while no tape holds an array writes into it in place. Copy to keep a snapshot.
        """
        return [p.storage.host for p in self._params]

    def values_synced(self) -> list[np.ndarray]:
        """Host values after syncing every newer mirror (C7)."""
        return [p.storage.current_host_value() for p in self._params]

    def sync(self) -> None:
        """Download every newer mirror so each host value is current; mirrors are kept (C7)."""
        for st in self._unique_storages():
            st.sync()

    def to(self, device: str | None) -> ParamList:
        """Mirror every storage on ``device`` once (``"cpu"``: sync, drop mirrors); returns self.

        An unknown or unavailable device raises before any storage moves (C6, C7).
        """
        if device not in HOST_DEVICES:
            device_backend(device)
        for st in self._unique_storages():
            st.to(device)
        return self

    def _unique_storages(self) -> list[ParameterStorage]:
        return list({id(p.storage): p.storage for p in self._params}.values())

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
        """Sum per-slot gradients at their canonical slots, in list order (C4).

        Frozen (None) slots contribute nothing. A storage with one trainable slot gets
        the very gradient object it was given. Lengths, index ranges, representatives,
        shapes and dtypes are all validated before any addition; inputs are never
        written into.
        """
        if isinstance(gradients, Mapping):
            raise SlotError(
                f"canonical_gradients: expected one gradient per slot in slot order, got a "
                f"{type(gradients).__name__} (a mapping); pass [grads[ref] for ref in refs]"
            )
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
                state = "a frozen slot" if slots[c] is None else f"mapped to {slots[c]}"
                raise SlotError(
                    f"canonical_gradients: slot {i} points at slot {c}, which is {state}; "
                    f"expected a canonical slot (one that maps to itself)"
                )
            g = gradients[i]
            if g is None:
                raise MissingGradientError(
                    f"canonical_gradients: slot {i} has no gradient, "
                    f"expected an array of shape {self._params[i].shape}"
                )
            if not hasattr(g, "shape") or not hasattr(g, "dtype"):
                raise DTypeError(
                    f"canonical_gradients: slot {i} gradient is a {type(g).__name__}, "
                    f"expected an array of shape {self._params[i].shape}"
                )
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
        made = [False] * n  # whether a sum is one this loop made: added into in place
        for i, c in enumerate(slots):
            if c is None:
                continue
            g = gradients[i]
            if sums[c] is None:
                sums[c] = g
            elif made[c]:
                sums[c] += g
            else:
                sums[c] = add_new(sums[c], g)
                made[c] = True
        return sums

    @staticmethod
    def canonical_gradient(shape: Sequence[int], sums: Sequence[Any | None], index: int) -> Any:
        """The summed gradient at canonical slot ``index``, checked against ``shape``."""
        if (
            not isinstance(index, (int, np.integer))
            or isinstance(index, bool)
            or not 0 <= index < len(sums)
        ):
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
                subtract_scaled(storage, arr, lr, np.asarray(sums[i]))
                storage.commit_host(arr)

    # -- reporting ---------------------------------------------------------------------
    def describe(self) -> str:
        """A table of slots: name, shape, trainability, canonical slot (C5) and storage.

        Storages are numbered ``S0, S1, ...`` in order of first slot. A storage held by
        several slots lists them (a tie, C1); one held by both a frozen and a trainable
        slot is flagged ``mixed``. The last line counts slots, storages and optimizer
        slots (canonical representatives).
        """
        slots = self.canonical_slot_indices()
        number: dict[ParameterStorage, int] = {}
        members: list[list[int]] = []
        trainable: list[set[bool]] = []
        for i, p in enumerate(self._params):
            k = number.setdefault(p.storage, len(number))
            if k == len(members):
                members.append([])
                trainable.append(set())
            members[k].append(i)
            trainable[k].add(p.requires_grad)
        rows = [("slot", "name", "shape", "trainable", "canonical", "storage")]
        for i, p in enumerate(self._params):
            k = number[p.storage]
            note = f"S{k}"
            if len(members[k]) > 1:
                note += f" shared by slots {members[k]}"
            if len(trainable[k]) == 2:
                note += " (mixed: frozen and trainable)"
            rows.append(
                (str(i), p.name or "-", str(p.shape), str(p.requires_grad), str(slots[i]), note)
            )
        widths = [max(len(row[c]) for row in rows) for c in range(5)]
        lines = [
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[5] for row in rows
        ]
        lines.append(
            f"{len(self)} slots, {len(number)} storages, "
            f"{sum(1 for i, c in enumerate(slots) if c == i)} optimizer slots"
        )
        return "\n".join(lines)
