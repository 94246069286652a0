"""A module's parameters as PyTorch's ``state_dict``: ``{path: array}``, ties kept.

Every parameter path is a key, so a tied storage appears under each of its paths, as
in PyTorch; a load writes each storage once and refuses differing values for one
storage (C1, C6). The functions take ``Module.named_slots()``; ``Module.state_dict``
and ``Module.load_state_dict`` are their public faces.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..errors import AliasError, SlotError, shown_list
from ..params import Param
from ..params.storage import check_host_array


class IncompatibleKeys(NamedTuple):
    """What ``load_state_dict`` left out: PyTorch's ``(missing_keys, unexpected_keys)``."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def state_dict(slots: Sequence[tuple[str, Param]]) -> dict[str, np.ndarray]:
    """``{path: owned copy of the synced host value}``, one array object per storage."""
    copies: dict[int, np.ndarray] = {}
    out = {}
    for path, p in slots:
        arr = copies.get(id(p.storage))
        if arr is None:
            arr = copies[id(p.storage)] = np.array(p.value_synced())
        out[path] = arr
    return out


def load_state_dict(
    label: str,
    slots: Sequence[tuple[str, Param]],
    state: Mapping[str, Any],
    strict: bool,
) -> IncompatibleKeys:
    """Check every entry of ``state`` against ``slots``, then write each storage once (C6)."""
    if not isinstance(state, Mapping):
        raise SlotError(
            f"{label}.load_state_dict: expected a mapping of parameter paths to arrays, "
            f"got {type(state).__name__}"
        )
    paths = {path for path, _ in slots}
    missing = [path for path, _ in slots if path not in state]
    unexpected = [key for key in state if key not in paths]
    if strict and (missing or unexpected):
        parts = [f"missing keys {shown_list(missing)}"] if missing else []
        parts += [f"unexpected keys {shown_list(unexpected)}"] if unexpected else []
        raise SlotError(
            f"{label}.load_state_dict: {'; '.join(parts)} (strict=False loads the paths that match)"
        )
    writes: dict[int, tuple[str, Param, np.ndarray]] = {}
    for path, p in slots:
        if path not in state:
            continue
        arr = check_host_array(f"{label}.load_state_dict {path!r}", state[path], p.shape, p.dtype)
        first = writes.setdefault(id(p.storage), (path, p, arr))
        if first[2] is not arr and not np.array_equal(first[2], arr, equal_nan=True):
            raise AliasError(
                f"{label}.load_state_dict: {first[0]!r} and {path!r} are one storage "
                "(a tie) but their values differ; give the tied paths one value"
            )
    for _, p, arr in writes.values():
        p.storage.write_host(arr)
    return IncompatibleKeys(missing, unexpected)
