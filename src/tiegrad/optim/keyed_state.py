"""``KeyedState``: optimizer state that belongs to storages and is keyed by canonical slot.

The tensors live in a ``FlatState`` (``optim.state``) keyed by canonical slot (C5); the
slot is only a key. ``storages`` names the storage of every entry.

Guarantees:

- One history per storage, however its uses are frozen or tied (C1, C5). When the
  layout changes (a freeze, an unfreeze, a tie, an untie, a new storage at a slot),
  ``rekey`` moves each entry to the canonical slot of its storage. A row mask set or
  cleared (``params.rows``) starts the storage's history afresh.
- Nothing is lost before the next write (C6). An entry of a storage that no longer
  trains at any slot stays under its old key, or is parked aside when another
  storage's canonical slot takes that key. A refused step or a look at the state
  keeps it, and a storage that trains again before the next write finds its history.
  The next write drops it.

The state may be mirrored on a device (``mirror``, a ``DeviceState`` of
``optim.device``), as a parameter is (C7): ``sync`` downloads a newer mirror, ``release``
syncs and drops it before the host state is written.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..params.storage import ParameterStorage
from .plan import StepPlan
from .state import FlatState, SlotSpec


class KeyedState:
    """A ``FlatState``, the storage owning each of its entries, and an optional mirror."""

    def __init__(self) -> None:
        self.flat = FlatState()
        self.storages: dict[int, ParameterStorage] = {}
        self.keyed_by: StepPlan | None = None  # the plan the entries are keyed by
        self.mirror: Any = None
        self.parked: dict[int, tuple[ParameterStorage, SlotSpec, dict[str, Any]]] = {}

    def sync(self) -> None:
        """Make the host state current: download a newer device mirror (C7)."""
        if self.mirror is not None:
            self.mirror.sync()

    def release(self) -> None:
        """Sync, then drop the mirror: the host state is about to be written (C7)."""
        self.sync()
        self.mirror = None

    def rekey(self, plan: StepPlan) -> None:
        """Key the entries by ``plan``'s canonical slots, each moving with its storage.

        An entry whose storage ``plan`` trains moves to that storage's canonical slot
        (a parked one comes back); one of a storage it trains no longer stays at its
        slot while that slot is not canonical, and is parked otherwise (see the module).
        """
        if self.keyed_by is plan:
            return
        moves: dict[int, int] = {}
        kept: dict[int, ParameterStorage] = {}
        for slot, storage in self.storages.items():
            new = self._slot_of(plan, storage)
            if new is not None:
                moves[slot] = new
                kept[new] = storage
        for slot, storage in self.storages.items():
            if slot not in moves and plan.slots[slot] != slot:
                moves[slot] = slot
                kept[slot] = storage
        back = {
            slot: key
            for key, (storage, _, _) in self.parked.items()
            if (slot := self._slot_of(plan, storage)) is not None and slot not in kept
        }
        if len(moves) < len(self.storages) or back or any(a != b for a, b in moves.items()):
            self.release()
            for slot, storage in self.storages.items():
                if slot not in moves:
                    self.parked[id(storage)] = (
                        storage,
                        self.flat.spec(slot),
                        self.flat.snapshot([slot])[slot],
                    )
            self.flat.rekey(moves)
            if back:
                parked = {slot: self.parked.pop(key) for slot, key in back.items()}
                self.flat.add(
                    {slot: spec for slot, (_, spec, _) in parked.items()},
                    {slot: entry for slot, (_, _, entry) in parked.items()},
                )
                kept |= {slot: storage for slot, (storage, _, _) in parked.items()}
        self.storages = kept
        self.keyed_by = plan

    @staticmethod
    def _slot_of(plan: StepPlan, storage: Any) -> int | None:
        """The canonical slot where ``plan`` steps ``storage`` itself, or None. A storage
        stepped through its row mask's ``TrainedRows`` (or the reverse) is another key:
        its state has another shape and starts afresh (``params.rows``)."""
        slot = plan.index.get(id(storage))
        return slot if slot is not None and plan.storages[slot] is storage else None

    def trained_slots(self, plan: StepPlan) -> list[int]:
        """The slots of the entries of storages ``plan`` trains (its canonical slots)."""
        self.rekey(plan)
        return [slot for slot in self.flat.slots() if plan.slots[slot] == slot]

    def arrange(
        self, plan: StepPlan, specs: Mapping[int, SlotSpec], initial: Callable[[int, str], float]
    ) -> set[tuple[int, str]]:
        """``FlatState.arrange`` for ``specs`` (canonical slots of ``plan``); new tensors
        start at ``initial(slot, name)``. Returns the ``(slot, name)`` pairs created."""
        created = self.flat.arrange(specs, initial)
        self.storages = {slot: plan.storages[slot] for slot in specs}
        self.parked.clear()
        return created

    def install(
        self,
        plan: StepPlan,
        specs: Mapping[int, SlotSpec],
        entries: Mapping[int, Mapping[str, Any]],
    ) -> None:
        """Replace every entry by a copy of validated ``entries``; the mirror is dropped
        unsynced (the installed state wins) and ``plan``'s cached program with it."""
        self.mirror = None
        self.parked.clear()
        plan.program = None
        self.flat.install(specs, entries)
        self.storages = {slot: plan.storages[slot] for slot in specs}
        self.keyed_by = plan
