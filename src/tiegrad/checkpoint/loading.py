"""``load``: validate a checkpoint against its target completely, then apply all of it (C6, C9)."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CheckpointError, TiegradError, shown_list
from ..params import ParameterStorage
from .fileio import SafetensorsFile, _is_int, checkpoint_path, read_safetensors
from .finite import finite_cast
from .integrity import verify
from .saving import as_param_list, check_methods, check_optimizer_params, generator_of
from .schema import OptimizerRecord, Schema, SlotRecord, layout_table, slot_records, slot_rows


@dataclass(frozen=True)
class LoadResult:
    """What ``load`` restored.

    ``step`` is the optimizer's ``step_count`` (None when the file has no optimizer);
    ``extra`` is the user's JSON value given to ``save``. With ``strict=False``,
    ``missing`` lists the model's slot paths absent from the file and ``unexpected``
    the file's slot paths absent from the model (both empty in strict mode).
    """

    path: str
    step: int | None
    extra: Any
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()


Pair = tuple[SlotRecord, SlotRecord]


def load(
    path: str | os.PathLike[str],
    model: Any,
    optimizer: Any = None,
    schedule: Any = None,
    strict: bool = True,
    rng: Any = None,
    *,
    allow_nonfinite: bool = False,
    check_extra: Callable[[Any], None] | None = None,
) -> LoadResult:
    """Restore ``model`` (and optionally ``optimizer``, ``schedule``, ``rng``) from ``path``.

    The file is parsed, its schema checked (``Schema.parse``) and every tensor's bytes
    checked against the CRC-32 the schema records, so a damaged tensor is refused by
    name (a file written before tiegrad stored checksums loads with a warning naming
    it, ``integrity.verify``); then everything is validated against the targets: slot
    paths, shapes, dtypes, the alias layout (the storage and canonical slot of every
    slot, so [p, q, p] and [p, q, q] differ), trainability, the row masks (strict: each
    storage's must be the file's, ``params.rows``), the optimizer's kind and
    state shapes, the RNG's bit generator. Only then is anything written: the optimizer,
    the schedule, one value per storage, the RNG state. On any error nothing has changed
    (C6) and a ``CheckpointError`` names the file and the slot; a layout mismatch shows
    both layouts side by side. The optimizer and schedule check their own state in
    ``load_state_dict`` (changing nothing when they refuse it); a schedule with
    ``check_state_dict`` (tiegrad's) is checked before the optimizer loads, and should
    another schedule refuse after the optimizer accepted, the optimizer's previous
    ``state_dict`` is put back.

    The target's alias layout must already be the file's: ties are restored by writing
    each file storage into the one target storage at the same slots (C9).
    ``strict=False`` matches slots by path, loads those present in both (shapes, dtypes
    and ties among them must agree; trainability may differ) and reports the rest in
    ``missing`` and ``unexpected``; an optimizer is then loaded only if every slot
    matches exactly. ``rng`` is a numpy Generator or a session with ``.rng``.

    Values are checked too: a parameter holding NaN or infinity is refused, naming the
    tensor and the count, unless ``allow_nonfinite`` (``finite.finite_cast``); the
    optimizer refuses state that no step can produce, whatever ``allow_nonfinite`` says
    (a NaN moment; an overflowed second moment is +inf and loads; see
    ``tiegrad.optim.state_values``). ``check_extra(extra)``, when given, is called
    with the file's ``extra`` after every other check and before any write; it raises
    (a ``TiegradError``) to refuse the file, which then changes nothing.
    """
    path = checkpoint_path(path)
    where = f"checkpoint {path}"
    plist = as_param_list(model, where)
    check_methods(optimizer, "optimizer", ("state_dict", "load_state_dict"), where)
    check_methods(schedule, "schedule", ("load_state_dict",), where)
    file = read_safetensors(path)
    schema = Schema.parse(file)
    verify(file, schema.checksums, where)
    target = slot_records(plist)
    pairs, missing, unexpected = _match_slots(schema.slots, target, strict, where)
    exact = not missing and not unexpected and all(a == b for a, b in pairs)
    if strict:
        check_rows(schema.rows, slot_rows(plist), target, where)

    opt_state = None
    if optimizer is not None:
        if not exact:
            raise CheckpointError(
                f"{where}: optimizer state is keyed by canonical slot and needs every slot to "
                f"match the model's exactly (strict layout); "
                f"missing {list(missing)[:5]}, unexpected {list(unexpected)[:5]}"
            )
        check_optimizer_params(optimizer, plist, where)
        opt_state = _optimizer_state(file, schema, optimizer, where)
    if schedule is not None and schema.schedule is None:
        raise CheckpointError(f"{where}: a schedule was given but the file holds no schedule state")
    gen = None
    if rng is not None:
        gen = generator_of(rng, where)
        _check_rng_state(schema.rng, gen, where)

    writes: dict[int, tuple[ParameterStorage, np.ndarray]] = {}
    for f, t in pairs:
        if t.storage not in writes:
            what = f"{where}: tensor {f.tensor!r} (slot {t.path!r})"
            value = finite_cast(file.array(f.tensor), t.dtype, what, allow_nonfinite)
            writes[t.storage] = (plist[t.storage].storage, value)
    if check_extra is not None:
        check_extra(schema.extra)
    if schedule is not None and hasattr(schedule, "check_state_dict"):
        _call_loader(schedule.check_state_dict, schema.schedule, "the schedule", where)

    if optimizer is not None:
        before = copy.deepcopy(optimizer.state_dict()) if schedule is not None else None
        _call_loader(optimizer.load_state_dict, opt_state, "the optimizer", where)
    if schedule is not None:
        try:
            _call_loader(schedule.load_state_dict, schema.schedule, "the schedule", where)
        except CheckpointError:
            if optimizer is not None:
                optimizer.load_state_dict(before)
            raise
    for storage, value in writes.values():
        storage.commit_host(value)
    if gen is not None:
        gen.bit_generator.state = schema.rng
    step = None if schema.optimizer is None else schema.optimizer.config.get("step_count")
    return LoadResult(
        path,
        step if _is_int(step) else None,
        schema.extra,
        tuple(missing),
        tuple(unexpected),
    )


def _match_slots(
    file_slots: Sequence[SlotRecord], target: Sequence[SlotRecord], strict: bool, where: str
) -> tuple[list[Pair], list[str], list[str]]:
    file_paths = {s.path: i for i, s in enumerate(file_slots)}
    target_paths = {s.path for s in target}
    missing = [s.path for s in target if s.path not in file_paths]
    unexpected = [s.path for s in file_slots if s.path not in target_paths]
    same_order = [s.path for s in file_slots] == [s.path for s in target]
    if strict and not same_order:
        table = layout_table(_aligned(file_slots, target), ("file", "model"))
        raise CheckpointError(
            f"{where}: the slots differ from the model's: missing from the file "
            f"{missing[:10]}, not in the model {unexpected[:10]}"
            f"{'' if missing or unexpected else ' (same paths in another order)'}\n{table}"
        )
    pairs = [(file_slots[file_paths[t.path]], t) for t in target if t.path in file_paths]
    for f, t in pairs:
        label = f"{where}: slot {t.path!r} (file slot {file_paths[t.path]})"
        if f.shape != t.shape:
            raise CheckpointError(
                f"{label}: shape mismatch, the file has {f.shape}, the model {t.shape}"
            )
        if f.dtype != t.dtype:
            raise CheckpointError(
                f"{label}: dtype mismatch, the file has {f.dtype}, the model {t.dtype}"
            )
    if strict:
        check_strict_layout(pairs, where)
    else:
        _check_ties(pairs, file_slots, target, where)
    return pairs, missing, unexpected


def check_rows(
    stored: dict[int, tuple[int, ...]],
    target: dict[int, tuple[int, ...]],
    slots: Sequence[SlotRecord],
    where: str,
) -> None:
    """``CheckpointError`` at the first storage whose row mask (``params.rows``) differs
    between the file (``stored``) and the model (``target``), both by storage slot."""
    for slot in sorted(set(stored) | set(target)):
        a, b = stored.get(slot), target.get(slot)
        if a != b:

            def told(rows: tuple[int, ...] | None) -> str:
                return "every row" if rows is None else f"{len(rows)} rows ({shown_list(rows)})"

            raise CheckpointError(
                f"{where}: row mask mismatch at slot {slot} ({slots[slot].path!r}): the file "
                f"trains {told(a)}, the model {told(b)} (set the model's with "
                f"tiegrad.nn.train_rows before loading)"
            )


def _aligned(
    file_slots: Sequence[SlotRecord], target: Sequence[SlotRecord]
) -> list[tuple[SlotRecord | None, SlotRecord | None]]:
    n = max(len(file_slots), len(target))
    return [
        (file_slots[i] if i < len(file_slots) else None, target[i] if i < len(target) else None)
        for i in range(n)
    ]


def check_strict_layout(
    pairs: Sequence[Pair], where: str, sides: tuple[str, str] = ("file", "model")
) -> None:
    """``CheckpointError`` at the first pair whose trainability or ties differ (C9).

    ``sides`` names the two layouts in the message and the side-by-side table.
    """
    a, b = sides
    for i, (f, t) in enumerate(pairs):
        if f.requires_grad != t.requires_grad:
            problem = (
                f"trainability mismatch at slot {i} ({t.path!r}): the {a} has requires_grad="
                f"{f.requires_grad}, the {b} {t.requires_grad}"
            )
        elif (f.storage, f.canonical) != (t.storage, t.canonical):
            problem = (
                f"alias layout mismatch at slot {i} ({t.path!r}) (storage alias mismatch): the "
                f"{a} stores it at slot {f.storage} (canonical {f.canonical}), the {b} at slot "
                f"{t.storage} (canonical {t.canonical})"
            )
        else:
            continue
        raise CheckpointError(f"{where}: {problem}\n{layout_table(pairs, sides)}")


def _check_ties(
    pairs: Sequence[Pair],
    file_slots: Sequence[SlotRecord],
    target: Sequence[SlotRecord],
    where: str,
) -> None:
    to_file: dict[int, int] = {}
    to_target: dict[int, int] = {}
    for f, t in pairs:
        if to_file.setdefault(t.storage, f.storage) != f.storage or (
            to_target.setdefault(f.storage, t.storage) != t.storage
        ):
            raise CheckpointError(
                f"{where}: alias layout mismatch at {t.path!r} (storage alias mismatch): it "
                f"shares storage with {target[t.storage].path!r} in the model and with "
                f"{file_slots[f.storage].path!r} in the file (matched slots, "
                f"storage = first slot of each storage)\n{layout_table(pairs, ('file', 'model'))}"
            )


def _optimizer_state(file: SafetensorsFile, schema: Schema, optimizer: Any, where: str) -> dict:
    """The optimizer's state dict from the file, checked against the optimizer first.

    The kind must match; each state tensor must have the shape and dtype the optimizer's
    ``state_tensor_specs()`` requires at that canonical slot (when it offers them; the
    schema already ties every state tensor's shape to its slot).
    """
    record: OptimizerRecord | None = schema.optimizer
    if record is None:
        raise CheckpointError(f"{where}: an optimizer was given but the file holds no optimizer")
    kind = getattr(optimizer, "kind", None)
    if record.kind != kind:
        raise CheckpointError(
            f"{where}: optimizer kind mismatch, the file holds {record.kind!r} state, "
            f"the optimizer is {kind!r}"
        )
    specs_of = getattr(optimizer, "state_tensor_specs", None)
    specs = specs_of() if callable(specs_of) else {}
    state: dict[int, dict[str, Any]] = {}
    for slot, st in record.state.items():
        entry: dict[str, Any] = dict(st.scalars)
        for name, key in st.tensors.items():
            value = file.array(key)
            spec = specs.get(slot, {}).get(name)
            if spec is not None and (value.shape, value.dtype.name) != (tuple(spec[0]), spec[1]):
                raise CheckpointError(
                    f"{where}: optimizer state {name!r} of slot {slot} "
                    f"({schema.slots[slot].path!r}) is {value.shape} {value.dtype.name} in the "
                    f"file, the optimizer needs {tuple(spec[0])} {spec[1]}"
                )
            entry[name] = value
        state[slot] = entry
    return {**record.config, "state": state}


def _check_rng_state(state: dict[str, Any] | None, gen: np.random.Generator, where: str) -> None:
    if state is None:
        raise CheckpointError(f"{where}: an rng was given but the file holds no RNG state")
    scratch = type(gen.bit_generator)()
    try:
        scratch.state = state
    except (TypeError, ValueError, LookupError, ArithmeticError) as e:
        raise CheckpointError(
            f"{where}: the RNG state does not fit a {type(gen.bit_generator).__name__} "
            f"generator: {e}"
        ) from None


def _call_loader(loader: Callable[[Any], Any], state: Any, what: str, where: str) -> None:
    try:
        loader(state)
    except (TiegradError, TypeError, ValueError, LookupError, ArithmeticError) as e:
        raise CheckpointError(f"{where}: {what} rejected the saved state: {e}") from e
