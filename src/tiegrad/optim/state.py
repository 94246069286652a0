"""``FlatState``: optimizer state keyed by canonical slot, in flat contiguous buffers (C5).

Every state tensor of one name and dtype (``exp_avg`` of all float32 slots, say) lives
in one 1-D buffer, slots in ascending order; each slot's tensor is a view into it.
Consecutive canonical slots therefore hold contiguous state, so an update rule can
cover many small parameters in one vectorized call. Buffers are allocated when the
layout changes (the first step, a re-tie, a load) and reused by every other step.

The state of a slot is ``{"step": int, name: array, ...}``. Only canonical slots of
trainable storages own state; frozen slots own none (C5). The slot is a key, the state
belongs to the storage: ``rekey`` moves entries when the optimizer's layout changes.

``revision`` changes with every change of the layout or of a step count, so a caller
that remembers it knows whether the state is still exactly as it left it (the
optimizer's cached step plan, ``tiegrad.optim.plan``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np

Shape = tuple[int, ...]
SlotSpec = tuple[Shape, np.dtype, tuple[str, ...]]  # (shape, dtype, tensor names)


class FlatState:
    """State tensors of canonical slots as views into per-(dtype, name) flat buffers."""

    def __init__(self) -> None:
        self._steps: dict[int, int] = {}
        self._tensors: dict[int, dict[str, np.ndarray]] = {}
        self._spans: dict[tuple[int, str], tuple[np.ndarray, int, int]] = {}
        self._starts: dict[str, np.ndarray] = {}  # name -> start of each slot's tensor
        self._specs: dict[int, SlotSpec] = {}
        self.revision = 0  # bumped by every change of the layout or of a step count

    # -- reading -------------------------------------------------------------------------
    def __contains__(self, slot: object) -> bool:
        return slot in self._steps

    def slots(self) -> list[int]:
        """The slots holding state, ascending."""
        return sorted(self._steps)

    def step(self, slot: int) -> int:
        """The number of updates slot ``slot`` has had (0 without state)."""
        return self._steps.get(slot, 0)

    def spec(self, slot: int) -> SlotSpec:
        """The layout of ``slot``'s state: ``(shape, dtype, tensor names)``."""
        return self._specs[slot]

    def tensors(self, slot: int) -> dict[str, np.ndarray]:
        """The live state tensors of ``slot`` (views into the flat buffers)."""
        return self._tensors[slot]

    def span(self, first: int, last: int, name: str) -> np.ndarray:
        """The flat view of ``name`` covering slots ``first`` .. ``last`` (consecutive state)."""
        buf, start, _ = self._spans[first, name]
        _, _, stop = self._spans[last, name]
        return buf[start:stop]

    def offsets(self, slots: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
        """The flat buffer of ``name`` holding ``slots`` (one dtype) and each slot's start in it."""
        return self._spans[int(slots[0]), name][0], self._starts[name][slots]

    def read_only(self, slots: Sequence[int]) -> Mapping[int, Mapping[str, Any]]:
        """``{slot: {"step": int, name: read-only view}}`` of ``slots``, for inspection."""
        out = {}
        for slot in slots:
            entry: dict[str, Any] = {"step": self._steps[slot]}
            for name, arr in self._tensors[slot].items():
                view = arr.view()
                view.flags.writeable = False
                entry[name] = view
            out[slot] = MappingProxyType(entry)
        return MappingProxyType(out)

    def snapshot(self, slots: Sequence[int]) -> dict[int, dict[str, Any]]:
        """``{slot: {"step": int, name: copy}}`` of ``slots``: owned copies, safe to keep."""
        return {
            slot: {"step": self._steps[slot]}
            | {name: arr.copy() for name, arr in self._tensors[slot].items()}
            for slot in slots
        }

    def layout(self) -> dict[tuple[int, str], tuple[np.ndarray, int, int]]:
        """``{(slot, name): (flat buffer, start, stop)}``: where each state tensor lives."""
        return dict(self._spans)

    def matches(self, specs: Mapping[int, SlotSpec]) -> bool:
        """Whether the state holds exactly the layout ``specs`` (``arrange`` would keep it)."""
        return dict(specs) == self._specs

    def missing(self, specs: Mapping[int, SlotSpec]) -> set[tuple[int, str]]:
        """The ``(slot, name)`` pairs ``arrange(specs)`` would create (new tensors)."""
        return {
            (slot, name)
            for slot, (_, _, names) in specs.items()
            for name in names
            if name not in self._tensors.get(slot, {})
        }

    # -- writing -------------------------------------------------------------------------
    def set_steps(self, slots: Sequence[int], step: int) -> None:
        """Record ``step`` as the number of updates of each of ``slots``."""
        steps = self._steps
        for slot in slots:
            steps[slot] = step
        self.revision += 1

    def arrange(
        self, specs: Mapping[int, SlotSpec], initial: Callable[[int, str], float]
    ) -> set[tuple[int, str]]:
        """Hold exactly the tensors of ``specs``; returns the ``(slot, name)`` pairs created.

        Tensors that exist with the same shape and dtype are kept (copied when the
        layout changes), missing ones are filled with ``initial(slot, name)``, and
        state of slots absent from ``specs`` is dropped. When the layout already
        matches nothing is allocated or copied. Callers validate shapes first.
        """
        if self.matches(specs):
            return set()
        created = self.missing(specs)
        old = self._tensors

        def source(slot: int, name: str) -> np.ndarray | float:
            return old[slot][name] if (slot, name) not in created else initial(slot, name)

        steps = {slot: self._steps.get(slot, 0) for slot in specs}
        self._build(specs, steps, source)
        return created

    def rekey(self, moves: Mapping[int, int]) -> None:
        """Move the state of each slot ``old`` to slot ``moves[old]``; drop the other slots.

        The step counts and tensors move unchanged (their buffers are rebuilt in the new
        slot order). ``moves`` must be one-to-one.
        """
        back = {new: old for old, new in moves.items()}
        old = self._tensors
        self._build(
            {new: self._specs[slot] for new, slot in back.items()},
            {new: self._steps[slot] for new, slot in back.items()},
            lambda slot, name: old[back[slot]][name],
        )

    def add(self, specs: Mapping[int, SlotSpec], entries: Mapping[int, Mapping[str, Any]]) -> None:
        """Add copies of ``entries`` (``{slot: {"step", names}}``) at slots that hold no
        state, laid out as ``specs``; the existing state is kept."""
        old = self._tensors
        steps = self._steps | {slot: int(entries[slot]["step"]) for slot in specs}
        self._build(
            self._specs | dict(specs),
            steps,
            lambda slot, name: entries[slot][name] if slot in specs else old[slot][name],
        )

    def install(
        self, specs: Mapping[int, SlotSpec], entries: Mapping[int, Mapping[str, Any]]
    ) -> None:
        """Replace all state by copies of validated ``entries`` (``{slot: {"step", names}}``)."""
        steps = {slot: int(entries[slot]["step"]) for slot in specs}
        self._build(specs, steps, lambda slot, name: entries[slot][name])

    def _build(
        self,
        specs: Mapping[int, SlotSpec],
        steps: Mapping[int, int],
        source: Callable[[int, str], np.ndarray | float],
    ) -> None:
        order = sorted(specs)
        totals: dict[tuple[str, str], int] = {}
        placed: list[tuple[int, str, tuple[str, str], int, int]] = []
        for slot in order:
            shape, dtype, names = specs[slot]
            size = int(np.prod(shape, dtype=np.int64))
            for name in names:
                key = (dtype.str, name)
                start = totals.get(key, 0)
                totals[key] = start + size
                placed.append((slot, name, key, start, start + size))
        buffers = {key: np.empty(total, np.dtype(key[0])) for key, total in totals.items()}
        tensors: dict[int, dict[str, np.ndarray]] = {slot: {} for slot in order}
        spans: dict[tuple[int, str], tuple[np.ndarray, int, int]] = {}
        starts = {name: np.zeros(order[-1] + 1 if order else 0, np.intp) for _, name in totals}
        for slot, name, key, start, stop in placed:
            buf = buffers[key]
            view = buf[start:stop].reshape(specs[slot][0])
            value = source(slot, name)
            if isinstance(value, np.ndarray):
                view[...] = value
            else:
                view.fill(value)
            tensors[slot][name] = view
            spans[slot, name] = (buf, start, stop)
            starts[name][slot] = start
        self._tensors = tensors
        self._spans = spans
        self._starts = starts
        self._steps = {slot: steps[slot] for slot in order}
        self._specs = dict(specs)
        self.revision += 1
