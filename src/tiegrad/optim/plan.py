"""``StepPlan``: what a host optimizer step works out once per parameter layout (C5, C6).

Most of a step's Python work depends on the layout, not on the values: which slots are
canonical (C5), which dtypes and shapes the gradients must have, the state each slot
holds, how slots batch into runs sharing coefficients, how fused slots are cut into
kernel calls. ``Optimizer`` keeps one plan and reuses every part while what it was
derived from holds, so a step over an unchanged layout does little per slot:

- ``StepPlan`` is derived from the storage at every slot (``ParamList.optimizer_storage``,
  None at frozen slots; a storage's ``TrainedRows`` where it has a row mask,
  ``params.rows``), compared by identity on every step (C1): a re-tie, a replaced
  storage, a new row mask or a changed ``requires_grad`` makes a new plan.
- Its ``Program`` (state specs, runs, fused layouts) is also derived from the state names
  of every group (the hyperparameters), the dtypes that run fused, and the
  ``FlatState`` object and its ``revision``, which every layout and step count change
  bumps (a load, a device step, a step that arranged new state). It is reused after a
  step of its own that created no state, with every run's step count one higher.

Values never are: every step reads and checks every gradient (type, dtype, shape, then
finiteness, C6) before any write, takes each parameter's current array from its
storage (C3), and checks the current hyperparameters and computes the coefficients
from them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..params.canonical import canonical_indices
from ..params.rows import TrainedRows
from ..params.storage import ParameterStorage
from . import fused
from .state import FlatState, SlotSpec

CHUNK = 32768  # elements per NumPy rule call: a few work buffers of this size stay in L2
SMALL = CHUNK // 4  # parameters up to this size are gathered with their neighbours
NOTHING: frozenset[str] = frozenset()

RunKey = tuple[int, int, frozenset[str], np.dtype]  # (group, step, fresh tensors, dtype)


class Run(NamedTuple):
    """Canonical slots updated by one rule call: ``key`` gives their coefficients.

    ``rows``: a fused run's rows in its dtype's ``fused.Layout``, None for a run of the
    NumPy rule.
    """

    key: RunKey
    slots: list[int]
    storages: list[ParameterStorage]
    rows: list[int] | None


class StepPlan:
    """The layout of one set of slot storages: alias map, gradient signature, groups.

    ``storages``: the storage per slot, None at frozen slots (the key, compared by
    identity). ``slots``: the alias map (C5); ``canonical``: its canonical slots,
    ascending; ``spare``: the other slots (their list entry must be None); ``aliases``:
    ``(slot, canonical slot)`` of each trainable non-canonical slot; ``index``: id of a
    canonical storage (and of the storage of a ``TrainedRows``) -> its slot;
    ``masked``: ``(slot, TrainedRows)`` of the canonical slots with a row mask;
    ``types``, ``dtypes``, ``shapes``: what the gradients of the canonical slots must
    be, in order, and ``dtype_set`` the distinct dtypes;
    ``group_dtypes``: the dtypes of each group's trainable slots; ``program``: the
    cached ``Program`` or None.
    """

    __slots__ = (
        "storages",
        "slots",
        "canonical",
        "spare",
        "aliases",
        "index",
        "masked",
        "types",
        "dtypes",
        "shapes",
        "dtype_set",
        "group_dtypes",
        "program",
    )

    def __init__(
        self, storages: list[ParameterStorage | None], slot_group: Sequence[int], groups: int
    ) -> None:
        self.storages = storages
        self.slots = canonical_indices(storages)
        self.canonical = [i for i, c in enumerate(self.slots) if c == i]
        self.spare = [i for i, c in enumerate(self.slots) if c != i]
        self.aliases = [(i, c) for i, c in enumerate(self.slots) if c is not None and c != i]
        canonical = [storages[i] for i in self.canonical]
        self.index = {id(st): i for i, st in zip(self.canonical, canonical)}
        self.masked = [
            (i, st) for i, st in zip(self.canonical, canonical) if type(st) is TrainedRows
        ]
        self.index.update((id(cell.storage), i) for i, cell in self.masked)
        self.types = [np.ndarray] * len(canonical)
        self.dtypes = [st.dtype for st in canonical]
        self.shapes = [st.shape for st in canonical]
        self.dtype_set = frozenset(self.dtypes)
        self.group_dtypes: list[set[np.dtype]] = [set() for _ in range(groups)]
        for i, st in enumerate(storages):
            if st is not None:
                self.group_dtypes[slot_group[i]].add(st.dtype)
        self.program: Program | None = None

    def specs(
        self, slot_group: Sequence[int], names: Sequence[tuple[str, ...]]
    ) -> dict[int, SlotSpec]:
        """``{canonical slot: (shape, dtype, state names)}`` with ``names`` per group."""
        st = self.storages
        return {i: (st[i].shape, st[i].dtype, names[slot_group[i]]) for i in self.canonical}


class Program:
    """The state layout and update order of steps over one plan (see the module docstring).

    ``specs``: the state layout; ``runs``: the rule calls in order; ``created``: the
    state tensors the next step creates; ``fused``: per dtype that runs fused, the
    ``fused.Layout`` of its canonical slots;
    ``rest``: the canonical slots of the other dtypes; ``operands``: the ``fused.RunOperands``
    of each fused run by run index, made by its first step (after the state is
    arranged); ``arranged``: whether the state has this layout.
    """

    __slots__ = (
        "key",
        "specs",
        "runs",
        "created",
        "fused",
        "rest",
        "state",
        "revision",
        "arranged",
        "operands",
    )

    def __init__(
        self,
        key: tuple[Any, ...],
        specs: dict[int, SlotSpec],
        state: FlatState,
        slot_group: Sequence[int],
        storages: Sequence[ParameterStorage | None],
        fusable: frozenset[np.dtype],
    ) -> None:
        self.key = key
        self.specs = specs
        self.created = state.missing(specs)
        planned = _runs(specs, self.created, state.step, slot_group, fusable)
        run_of = {slot: i for i, (_, slots) in enumerate(planned) for slot in slots}
        by_dtype: dict[np.dtype, list[int]] = {}
        for slot, spec in specs.items():
            if spec[1] in fusable:
                by_dtype.setdefault(spec[1], []).append(slot)
        self.fused = {
            dtype: fused.Layout(
                slots, [math.prod(specs[s][0]) for s in slots], [run_of[s] for s in slots], dtype
            )
            for dtype, slots in by_dtype.items()
        }
        rows = {
            dtype: {s: k for k, s in enumerate(layout.slots)}
            for dtype, layout in self.fused.items()
        }
        self.runs = [
            Run(key, slots, [storages[s] for s in slots], _rows(rows.get(key[3]), slots))
            for key, slots in planned
        ]
        self.rest = [slot for slot, spec in specs.items() if spec[1] not in fusable]
        self.state = state
        self.revision: int | None = state.revision
        self.arranged = False
        self.operands: dict[int, fused.RunOperands] = {}

    def current(self, key: tuple[Any, ...], state: FlatState) -> bool:
        """Whether this program still holds for ``key`` and ``state`` (unchanged since)."""
        return self.key == key and self.state is state and self.revision == state.revision

    def advance(self) -> None:
        """After a step of this program: the next one counts each run one step further.

        A step that created state ends the program (its runs were split by new tensors).
        """
        self.arranged = True
        if self.created:
            self.revision = None
            return
        self.runs = [
            Run((gi, step + 1, fresh, dtype), slots, storages, rows)
            for (gi, step, fresh, dtype), slots, storages, rows in self.runs
        ]
        self.revision = self.state.revision


def _rows(index: Mapping[int, int] | None, slots: list[int]) -> list[int] | None:
    """The rows of ``slots`` in a fused layout indexed by ``index``; None: not fused."""
    return None if index is None else [index[s] for s in slots]


def _runs(
    specs: Mapping[int, SlotSpec],
    created: set[tuple[int, str]],
    steps: Callable[[int], int],
    slot_group: Sequence[int],
    fusable: frozenset[np.dtype],
) -> list[tuple[RunKey, list[int]]]:
    """Canonical slots in order, consecutive small ones with equal coefficients merged.

    Slots of a dtype in ``fusable`` are merged whatever their size and position: one run
    per coefficients.
    """
    runs: list[tuple[RunKey, list[int]]] = []
    fused_run: dict[RunKey, list[int]] = {}  # the run of each key of a fusable dtype
    total = 0
    for slot in sorted(specs):
        shape, dtype, names = specs[slot]
        fresh = frozenset(n for n in names if (slot, n) in created) if created else NOTHING
        key = (slot_group[slot], steps(slot) + 1, fresh, dtype)
        if dtype in fusable:
            if key not in fused_run:
                fused_run[key] = []
                runs.append((key, fused_run[key]))
            fused_run[key].append(slot)
            continue
        size = math.prod(shape)
        small = size <= SMALL
        if small and runs and runs[-1][0] == key and total and total + size <= CHUNK:
            runs[-1][1].append(slot)
            total += size
        else:
            runs.append((key, [slot]))
            total = size if small else 0
    return runs
