"""``save``: a model (or ``ParamList``), its optimizer, schedule and RNG in one file (C9)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..errors import CheckpointError
from ..params import ParamList
from .fileio import check_entries, checkpoint_path, supported_dtype, write_safetensors
from .integrity import tensor_checksum
from .schema import (
    METADATA_KEY,
    OPTIM_PREFIX,
    OptimizerRecord,
    Schema,
    SlotRecord,
    SlotState,
    json_value,
    slot_records,
    slot_rows,
)


def as_param_list(model: Any, where: str) -> ParamList:
    """The ``ParamList`` of a model (anything with ``param_list()``) or the list itself."""
    if isinstance(model, ParamList):
        return model
    get = getattr(model, "param_list", None)
    if callable(get):
        plist = get()
        if isinstance(plist, ParamList):
            return plist
    raise CheckpointError(
        f"{where}: expected a ParamList or a model with param_list(), got {type(model).__name__}"
    )


def generator_of(rng: Any, where: str) -> np.random.Generator:
    """The NumPy generator of ``rng``: a ``Generator`` or an object with ``.rng`` (a session)."""
    gen = rng if isinstance(rng, np.random.Generator) else getattr(rng, "rng", None)
    if not isinstance(gen, np.random.Generator):
        raise CheckpointError(
            f"{where}: rng must be a numpy Generator or a session with .rng, "
            f"got {type(rng).__name__}"
        )
    return gen


def check_methods(target: Any, what: str, methods: tuple[str, ...], where: str) -> None:
    """An ``optimizer`` or ``schedule`` argument is None or has ``methods``; else a
    ``CheckpointError`` naming the argument."""
    if target is not None and not all(callable(getattr(target, m, None)) for m in methods):
        raise CheckpointError(
            f"{where}: {what} must have {' and '.join(m + '()' for m in methods)}, got "
            f"{type(target).__name__}"
        )


def check_optimizer_params(optimizer: Any, plist: ParamList, where: str) -> None:
    """The optimizer's ``params`` (when it has them) must be the slots of ``plist``.

    Optimizer state is keyed by canonical slot (C5), so the two lists must hold the
    same storage objects with the same trainability at every slot.
    """
    own = getattr(optimizer, "params", None)
    if own is None:
        return
    if not isinstance(own, ParamList) or len(own) != len(plist):
        size = len(own) if isinstance(own, ParamList) else type(own).__name__
        raise CheckpointError(
            f"{where}: the optimizer's parameter list ({size}) is not the model's "
            f"({len(plist)} slots)"
        )
    for i, (a, b) in enumerate(zip(own, plist)):
        if a.storage is not b.storage or a.requires_grad != b.requires_grad:
            raise CheckpointError(
                f"{where}: slot {i} ({b.name!r}) of the optimizer's parameter list is not the "
                f"model's (other storage or trainability)"
            )


def save(
    path: str | os.PathLike[str],
    model: Any,
    optimizer: Any = None,
    schedule: Any = None,
    extra: Any = None,
    rng: Any = None,
) -> int:
    """Write a checkpoint of ``model`` to ``path`` as one safetensors file; return its size.

    ``model`` is a ``ParamList`` or anything with ``param_list()``. Each storage is stored
    once, under ``param/<path of its first slot>``, from ``values_synced()`` (C7); the
    schema records every slot with its canonical slot and storage slot, so ties and the
    trainability mask survive (C9), and each storage's row mask (``params.rows``).
    ``optimizer.state_dict()`` is stored with its tensors keyed by canonical slot
    (``optim/<slot>/<name>``); ``schedule.state_dict()``, ``extra`` (JSON) and the
    bit-generator state of ``rng`` (a numpy Generator or a session) go into the schema,
    with the CRC-32 of every tensor's bytes, which ``load`` verifies (``integrity``).
    Everything is validated before the file is touched; the write is atomic (see
    ``write_safetensors``). Errors are ``CheckpointError``.
    """
    path = checkpoint_path(path)
    where = f"checkpoint {path}"
    plist = as_param_list(model, where)
    check_methods(optimizer, "optimizer", ("state_dict",), where)
    check_methods(schedule, "schedule", ("state_dict",), where)
    slots = slot_records(plist)
    rows = slot_rows(plist)
    tensors: dict[str, np.ndarray] = {}
    values = plist.values_synced()
    for i, s in enumerate(slots):
        if s.storage == i:
            if not supported_dtype(values[i].dtype):
                raise CheckpointError(
                    f"{where}: slot {i} ({s.path!r}): dtype {s.dtype} unsupported"
                )
            tensors[s.tensor] = values[i]
    record = None
    if optimizer is not None:
        check_optimizer_params(optimizer, plist, where)
        shapes = Schema(tuple(slots), rows=rows).state_shape
        record = _optimizer_record(optimizer.state_dict(), slots, shapes, tensors, where)
    schedule_state = None
    if schedule is not None:
        schedule_state = json_value(schedule.state_dict(), "the schedule state", where)
    rng_state = None
    if rng is not None:
        state = _plain(generator_of(rng, where).bit_generator.state)
        rng_state = json_value(state, "the RNG state", where)
    extra = json_value(extra, "extra", where)
    check_entries(where, "slots", len(slots), sum(t.nbytes for t in tensors.values()))
    checksums = {name: tensor_checksum(value) for name, value in tensors.items()}
    schema = Schema(
        tuple(slots), record, schedule_state, rng_state, extra, checksums=checksums, rows=rows
    )
    return write_safetensors(path, tensors, {METADATA_KEY: schema.to_json()})


def _plain(value: Any) -> Any:
    """A bit-generator state with its arrays as lists (NumPy accepts lists back)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value.tolist() if isinstance(value, np.ndarray) else value


def _optimizer_record(
    sd: Any,
    slots: list[SlotRecord],
    state_shape: Callable[[int], tuple[int, ...]],
    tensors: dict[str, np.ndarray],
    where: str,
) -> OptimizerRecord:
    if not isinstance(sd, Mapping) or not isinstance(sd.get("kind"), str):
        raise CheckpointError(f"{where}: optimizer.state_dict() must be a mapping with a 'kind'")
    raw_state = sd.get("state")
    if not isinstance(raw_state, Mapping):
        raise CheckpointError(f"{where}: optimizer.state_dict()['state'] must be a mapping")
    config = {k: v for k, v in sd.items() if k != "state"}
    json_value(config, "the optimizer's state_dict (without 'state')", where)
    state: dict[int, SlotState] = {}
    for slot, entry in raw_state.items():
        if not isinstance(slot, (int, np.integer)) or not 0 <= slot < len(slots):
            raise CheckpointError(f"{where}: optimizer state key {slot!r} is not a slot index")
        slot = int(slot)
        s = slots[slot]
        label = f"{where}: optimizer state of slot {slot} ({s.path!r})"
        if s.canonical != slot:
            raise CheckpointError(
                f"{label}: not a canonical slot (canonical {s.canonical}); state belongs to "
                f"canonical slots only (C5)"
            )
        if not isinstance(entry, Mapping):
            raise CheckpointError(f"{label}: expected a mapping, got {type(entry).__name__}")
        scalars: dict[str, Any] = {}
        names: dict[str, str] = {}
        for name, value in entry.items():
            if isinstance(value, np.ndarray):
                floating = np.issubdtype(value.dtype, np.floating)
                shape = state_shape(slot)
                if value.shape != shape or not floating or not supported_dtype(value.dtype):
                    raise CheckpointError(
                        f"{label}: tensor {name!r} is {value.shape} {value.dtype}, expected "
                        f"shape {shape} and a floating dtype"
                    )
                key = f"{OPTIM_PREFIX}{slot}/{name}"
                tensors[key] = value
                names[str(name)] = key
            else:
                item = value.item() if isinstance(value, np.generic) else value
                what = f"optimizer state {name!r} of slot {slot}"
                scalars[str(name)] = json_value(item, what, where)
        state[slot] = SlotState(scalars, names)
    return OptimizerRecord(config, state)
