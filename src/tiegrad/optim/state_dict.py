"""A state dict checked before an optimizer adopts it (C5, C6, C9).

``Optimizer.load_state_dict`` adopts nothing until every part of the dict has passed
these checks: its keys, its alias layout (compared as a checkpoint load compares it),
its groups' slots, and every state tensor against the slot it is keyed by. Each error
is a ``CheckpointError`` (or the ``AliasError``, ``ShapeError`` or ``DTypeError`` of
the slot) naming the part and what was expected.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..checkpoint.loading import check_strict_layout
from ..checkpoint.schema import SlotRecord, layout_table, parse_slots
from ..checkpoint.schema import check_layout as check_slot_records
from ..errors import (
    AliasError,
    CheckpointError,
    DTypeError,
    HyperparameterError,
    ShapeError,
    shown_list,
)
from .hyperparams import count
from .state import SlotSpec

STATE_DICT_KEYS = (
    "kind",
    "defaults",
    "param_groups",
    "layout",
    "state",
    "step_count",
    "skipped_steps",
)


def check_layout(where: str, raw: Any, mine: list[SlotRecord]) -> None:
    """``CheckpointError`` unless ``raw`` (a state dict's ``layout``) is ``mine``.

    Parsed and compared by the checkpoint's own code (the slot records, the strict
    layout check and its side-by-side table), so both loads agree (C6, C9). A saved
    path found at another slot here is refused too: the parameters were reordered,
    and positional state would move to another parameter (pytorch#1489). Paths that
    are new here (renamed, or unnamed ``slot{i}``) are matched by position.
    """
    saved = parse_slots(raw, f"{where}: layout")
    check_slot_records(saved, f"{where}: layout")
    pairs = list(zip(saved, mine))
    if len(saved) != len(mine):
        raise CheckpointError(
            f"{where}: the state is for {len(saved)} slots, this optimizer has "
            f"{len(mine)}\n{layout_table(pairs, ('state dict', 'optimizer'))}"
        )
    check_strict_layout(pairs, where, ("state dict", "optimizer"))
    here = {m.path: j for j, m in enumerate(mine)}
    for i, s in enumerate(saved):
        j = here.get(s.path, i)
        if j != i:
            raise CheckpointError(
                f"{where}: the state dict's slot {i} is {s.path!r}, which is slot {j} "
                f"here: the parameters come in another order, and state is kept by slot, "
                f"so it would go to another parameter; build the optimizer over the "
                f"parameters in the saved order\n"
                f"{layout_table(pairs, ('state dict', 'optimizer'))}"
            )


def checked_state(
    where: str,
    state: Any,
    slots: Sequence[int | None],
    required: Mapping[int, SlotSpec],
) -> tuple[dict[int, SlotSpec], dict[int, Mapping[str, Any]]]:
    """The layout and entries of a state dict's ``state``, each entry checked against
    ``required`` (the state a canonical slot holds, C5): its ``step`` and exactly its
    tensors, with the slot's shape and dtype."""
    state = mapping(where, "state", state)
    specs: dict[int, SlotSpec] = {}
    entries: dict[int, Mapping[str, Any]] = {}
    for key, entry in state.items():
        if isinstance(key, (bool, np.bool_)) or not isinstance(key, (int, np.integer)):
            raise CheckpointError(f"{where}: state key {key!r} is not a slot index")
        slot = int(key)
        if not 0 <= slot < len(slots):
            raise CheckpointError(f"{where}: state for slot {slot}, outside [0, {len(slots)})")
        if slot not in required:
            c = slots[slot]
            what = "is frozen" if c is None else f"shares the storage of slot {c}"
            raise AliasError(
                f"{where}: state for slot {slot}, which {what} in this parameter list; "
                f"state belongs to canonical slots only (C5)"
            )
        entry = mapping(where, f"state of slot {slot}", entry)
        shape, dtype, names = required[slot]
        exact_keys(where, f"state of slot {slot}", entry, ("step", *names))
        counter(where, f"step of slot {slot}", entry["step"], 1)  # state exists after a step
        for name in names:
            arr = entry[name]
            if not isinstance(arr, np.ndarray):
                raise CheckpointError(
                    f"{where}: state {name!r} of slot {slot} is a {type(arr).__name__}, "
                    f"expected a NumPy array"
                )
            what = f"{where}: state {name!r} of slot {slot}"
            check_state_tensor(what, arr, shape, dtype, "expected")
        specs[slot] = required[slot]
        entries[slot] = entry
    return specs, entries


def check_state_tensor(
    what: str, arr: np.ndarray, shape: tuple[int, ...], dtype: np.dtype, expected: str
) -> None:
    """``ShapeError`` / ``DTypeError`` unless the state tensor ``arr`` has ``shape`` and
    ``dtype`` (in either byte order: the state is copied into native arrays)."""
    if arr.shape != shape:
        raise ShapeError(f"{what} has shape {arr.shape}, {expected} {shape}")
    if arr.dtype.newbyteorder("=") != dtype:
        raise DTypeError(f"{what} has dtype {arr.dtype.name}, {expected} {dtype.name}")


def mapping(where: str, what: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise CheckpointError(f"{where}: {what} must be a mapping, got {type(value).__name__}")
    return value


def exact_keys(where: str, what: str, value: Mapping[str, Any], keys: Sequence[str]) -> None:
    missing = [k for k in keys if k not in value]
    unexpected = sorted(str(k) for k in value if k not in keys)
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: {what} has keys other than {list(keys)}: missing "
            f"{shown_list(missing)}; unexpected {shown_list(unexpected)}"
        )


def slot_list(where: str, what: str, value: Any) -> list[Any]:
    """``value`` (a state dict's list of slot indices) as a list, or a ``CheckpointError``
    naming ``what`` and, for a bad entry, its position, type and value."""
    if not isinstance(value, (list, tuple)):
        raise CheckpointError(
            f"{where}: {what} must be a list of slot indices, got {type(value).__name__}"
        )
    for j, s in enumerate(value):
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)):
            raise CheckpointError(
                f"{where}: {what}[{j}] must be a slot index (an integer), got "
                f"{type(s).__name__} {s!r}"
            )
    return list(value)


def counter(where: str, what: str, value: Any, minimum: int = 0) -> int:
    """An integer >= ``minimum`` from a state dict, or a ``CheckpointError``."""
    try:
        return count(where, what, value, minimum)
    except HyperparameterError as e:
        raise CheckpointError(str(e)) from None


def check_structure(
    where: str,
    state_dict: Any,
    kind: str,
    hyperparameters: Sequence[str],
    group_slots: Sequence[Sequence[int]],
) -> tuple[Mapping[str, Any], list[Mapping[str, Any]]]:
    """The defaults and groups of a state dict whose keys, kind and group slots are this
    optimizer's (``kind``, ``hyperparameters``, the slots of each group)."""
    sd = mapping(where, "the state dict", state_dict)
    exact_keys(where, "the state dict", sd, STATE_DICT_KEYS)
    if sd["kind"] != kind:
        raise CheckpointError(
            f"{where}: the state is for a {sd['kind']!r} optimizer, this one is {kind!r}"
        )
    defaults = mapping(where, "defaults", sd["defaults"])
    exact_keys(where, "defaults", defaults, tuple(hyperparameters))
    groups = sd["param_groups"]
    if not isinstance(groups, (list, tuple)) or len(groups) != len(group_slots):
        size = len(groups) if isinstance(groups, (list, tuple)) else type(groups).__name__
        raise CheckpointError(
            f"{where}: param_groups must be a list of {len(group_slots)} groups, got {size}"
        )
    checked = []
    for gi, (group, mine) in enumerate(zip(groups, group_slots)):
        group = mapping(where, f"param_groups[{gi}]", group)
        exact_keys(where, f"param_groups[{gi}]", group, ("slots", *hyperparameters))
        slots = slot_list(where, f'param_groups[{gi}]["slots"]', group["slots"])
        if slots != list(mine):
            raise CheckpointError(
                f"{where}: param_groups[{gi}] holds slots {slots}, this "
                f"optimizer's group {gi} holds slots {list(mine)}"
            )
        checked.append(group)
    return defaults, checked
