"""The checkpoint schema: the JSON document in a checkpoint's safetensors metadata.

The schema (``__metadata__["tiegrad"]``, format version ``FORMAT_VERSION``) records
every slot of the parameter list (path, shape, dtype, trainability, canonical slot,
storage representative and the tensor holding its value), the optimizer's kind,
hyperparameters, counters and per-canonical-slot state, the schedule state, the RNG
state, the user's ``extra`` (C9) and, from version 2 on, a CRC-32 of every tensor
(``integrity``). ``Schema.parse`` checks a file's schema for well-formedness against the
file's tensors before anything else reads it (C6):

- ``storage`` is the first slot, frozen or not, holding the same storage object; it
  points backwards at a slot that represents itself, with equal shape, dtype and tensor;
- ``canonical`` is exactly the alias map of C5 for that storage layout: None at a frozen
  slot, else the first trainable slot of its storage (never forward, never frozen);
- every tensor named by the schema is in the file with the slot's shape and dtype, and
  the file holds no other tensor;
- optimizer state is keyed by canonical slots only, its tensors shaped like the slot;
- from version 2 on, ``checksums`` has one CRC-32 for each tensor of the file (a file of
  version 1, written before tiegrad stored them, has none; ``integrity.verify`` warns);
- from version 3 on, ``rows`` holds the row mask of each storage that has one
  (``tiegrad.params.rows``), keyed by its storage slot: distinct rows within its first
  axis; the optimizer state of that storage's canonical slot has the trained rows'
  shape ``(len(rows), *shape[1:])``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CheckpointError, TiegradError, shown_list
from ..params import ParamList
from ..params.rows import checked_rows
from .fileio import SafetensorsFile, _is_int, entry_limit, parse_json, supported_dtype
from .integrity import checksums_json, parse_checksums

FORMAT = "tiegrad-checkpoint"
#: 3: the schema holds row masks (``rows``); 2: a CRC-32 of each tensor
#: (``checksums``); 1: without them.
FORMAT_VERSION = 3
#: The first format version whose files hold checksums.
CHECKSUMS_SINCE = 2
#: The first format version whose files hold row masks.
ROWS_SINCE = 3
METADATA_KEY = "tiegrad"
PARAM_PREFIX = "param/"
OPTIM_PREFIX = "optim/"

_SLOT_KEYS = {"path", "shape", "dtype", "requires_grad", "canonical", "storage", "tensor"}
#: Rows of a layout table shown from the start and among those that differ.
TABLE_ROWS = 20

_TOP_KEYS = {"format", "format_version", "slots", "optimizer", "schedule", "rng", "extra"}
_CHECKSUMS_KEY = "checksums"
_ROWS_KEY = "rows"


@dataclass(frozen=True)
class SlotRecord:
    """One slot of a parameter list as a checkpoint describes it (C5, C9)."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool
    canonical: int | None
    storage: int
    tensor: str

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "requires_grad": self.requires_grad,
            "canonical": self.canonical,
            "storage": self.storage,
            "tensor": self.tensor,
        }


@dataclass(frozen=True)
class SlotState:
    """The optimizer state of one canonical slot: JSON scalars and named tensor keys."""

    scalars: dict[str, Any]
    tensors: dict[str, str]


@dataclass(frozen=True)
class OptimizerRecord:
    """An optimizer's ``state_dict()``: ``config`` holds every key but ``state``."""

    config: dict[str, Any]
    state: dict[int, SlotState]

    @property
    def kind(self) -> str:
        return self.config["kind"]

    def to_json(self) -> dict[str, Any]:
        state = {
            str(slot): {"scalars": s.scalars, "tensors": s.tensors}
            for slot, s in sorted(self.state.items())
        }
        return {**self.config, "state": state}


@dataclass(frozen=True)
class Schema:
    """A parsed checkpoint schema; see the module docstring for its invariants.

    ``checksums`` maps every tensor of the file to the CRC-32 of its stored bytes; it is
    None only in a file of format version 1. ``rows``: storage slot -> its row mask
    (ascending rows), for the storages that have one.
    """

    slots: tuple[SlotRecord, ...]
    optimizer: OptimizerRecord | None = None
    schedule: Any = None
    rng: dict[str, Any] | None = None
    extra: Any = None
    version: int = FORMAT_VERSION
    checksums: dict[str, int] | None = None
    rows: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    def state_shape(self, slot: int) -> tuple[int, ...]:
        """The shape of the optimizer state of canonical slot ``slot``: the slot's shape,
        or its trained rows' where its storage has a row mask."""
        s = self.slots[slot]
        rows = self.rows.get(s.storage)
        return s.shape if rows is None else (len(rows), *s.shape[1:])

    def to_json(self) -> str:
        """The schema as the JSON text stored under ``__metadata__["tiegrad"]``."""
        doc: dict[str, Any] = {
            "format": FORMAT,
            "format_version": self.version,
            "slots": [s.to_json() for s in self.slots],
            "optimizer": None if self.optimizer is None else self.optimizer.to_json(),
            "schedule": self.schedule,
            "rng": self.rng,
            "extra": self.extra,
        }
        if self.checksums is not None:
            doc[_CHECKSUMS_KEY] = checksums_json(self.checksums)
        if self.version >= ROWS_SINCE:
            doc[_ROWS_KEY] = {str(slot): list(rows) for slot, rows in sorted(self.rows.items())}
        return json.dumps(doc, separators=(",", ":"))

    @classmethod
    def parse(cls, file: SafetensorsFile) -> Schema:
        """The validated schema of ``file``; any defect is a ``CheckpointError``."""
        where = f"checkpoint {file.path}"
        if METADATA_KEY not in file.metadata:
            raise CheckpointError(
                f"{where}: not a tiegrad checkpoint (no {METADATA_KEY!r} key in __metadata__)"
            )
        doc = parse_json(file.metadata[METADATA_KEY], f"{where}: the schema")
        if doc.get("format") != FORMAT:
            raise CheckpointError(
                f"{where}: schema format {doc.get('format')!r:.60}, expected {FORMAT!r}"
            )
        version = doc.get("format_version")
        if not _is_int(version) or version < 1:
            raise CheckpointError(f"{where}: invalid format version {version!r:.60}")
        if version > FORMAT_VERSION:
            raise CheckpointError(
                f"{where}: format version {version} is newer than this tiegrad reads "
                f"(up to {FORMAT_VERSION}); upgrade tiegrad to load it"
            )
        keys = _TOP_KEYS | ({_CHECKSUMS_KEY} if version >= CHECKSUMS_SINCE else set())
        keys |= {_ROWS_KEY} if version >= ROWS_SINCE else set()
        if set(doc) != keys:
            raise CheckpointError(
                f"{where}: schema keys {sorted(doc)}, expected {sorted(keys)} (format "
                f"version {version})"
            )
        slots = tuple(parse_slots(doc["slots"], where, entry_limit(file.data_bytes)))
        check_layout(slots, where)
        optimizer = _parse_optimizer(doc["optimizer"], slots, where)
        rng = doc["rng"]
        if rng is not None and not isinstance(rng, dict):
            raise CheckpointError(f"{where}: the RNG state must be a JSON object or null")
        rows = _parse_rows(doc.get(_ROWS_KEY, {}), slots, where)
        schema = cls(slots, optimizer, doc["schedule"], rng, doc["extra"], version, rows=rows)
        _check_tensors(schema, file, where)
        if _CHECKSUMS_KEY not in doc:
            return schema
        checksums = parse_checksums(doc[_CHECKSUMS_KEY], file.tensors, where)
        return dataclasses.replace(schema, checksums=checksums)


def _slot_label(i: int, path: str) -> str:
    return f"slot {i} ({path!r})"


def parse_slots(raw: Any, where: str, limit: int | None = None) -> list[SlotRecord]:
    """Slot records from their JSON form, each field's type checked (``check_layout``: ties);
    more than ``limit`` slots (when given) is refused before any is read."""
    if not isinstance(raw, list):
        raise CheckpointError(f"{where}: schema 'slots' must be a list")
    if limit is not None and len(raw) > limit:
        raise CheckpointError(
            f"{where}: the schema lists {len(raw)} slots, more than the {limit} allowed for "
            f"the file's data bytes"
        )
    out: list[SlotRecord] = []
    seen: dict[str, int] = {}
    for i, s in enumerate(raw):
        if not isinstance(s, dict) or set(s) != _SLOT_KEYS:
            raise CheckpointError(f"{where}: slot {i}: expected keys {sorted(_SLOT_KEYS)}")
        path, shape, dtype = s["path"], s["shape"], s["dtype"]
        if not isinstance(path, str) or not path:
            raise CheckpointError(f"{where}: slot {i}: path must be a non-empty string")
        label = f"{where}: {_slot_label(i, path)}"
        if path in seen:
            raise CheckpointError(f"{label}: path already used by slot {seen[path]}")
        seen[path] = i
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise CheckpointError(f"{label}: shape {shape!r:.100} is not a list of sizes")
        if not isinstance(dtype, str) or not _floating_name(dtype):
            raise CheckpointError(f"{label}: dtype {dtype!r:.40} is not a stored floating dtype")
        if not isinstance(s["requires_grad"], bool):
            raise CheckpointError(f"{label}: requires_grad must be true or false")
        canonical, storage = s["canonical"], s["storage"]
        if canonical is not None and not _is_int(canonical):
            raise CheckpointError(f"{label}: canonical slot {canonical!r:.40} is not an integer")
        if not _is_int(storage):
            raise CheckpointError(f"{label}: storage slot {storage!r:.40} is not an integer")
        if not isinstance(s["tensor"], str):
            raise CheckpointError(f"{label}: tensor must be a string")
        out.append(
            SlotRecord(
                path, tuple(shape), dtype, s["requires_grad"], canonical, storage, s["tensor"]
            )
        )
    return out


def _parse_rows(raw: Any, slots: Sequence[SlotRecord], where: str) -> dict[int, tuple[int, ...]]:
    """The ``rows`` object: storage slot -> its row mask, each checked (``checked_rows``)."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where}: schema 'rows' must be a JSON object")
    out: dict[int, tuple[int, ...]] = {}
    for key, rows in raw.items():
        slot = int(key) if key.isascii() and key.isdigit() and len(key) <= 19 else -1
        if not 0 <= slot < len(slots) or str(slot) != key or slots[slot].storage != slot:
            raise CheckpointError(
                f"{where}: row mask key {key!r:.40} is not the storage slot of a parameter"
            )
        label = f"{where}: row mask of {_slot_label(slot, slots[slot].path)}"
        if not isinstance(rows, list) or not all(_is_int(r) for r in rows):
            raise CheckpointError(f"{label}: expected a list of row indices")
        if any(r < 0 for r in rows):
            raise CheckpointError(f"{label}: rows {shown_list([r for r in rows if r < 0])} < 0")
        try:
            checked = checked_rows(label, rows, slots[slot].shape)
        except TiegradError as e:
            raise CheckpointError(str(e)) from None
        out[slot] = tuple(checked.tolist())
    return out


def slot_rows(plist: ParamList) -> dict[int, tuple[int, ...]]:
    """The row mask of each storage of ``plist`` that has one, by storage slot (C9)."""
    out: dict[int, tuple[int, ...]] = {}
    seen: set[int] = set()
    for i, p in enumerate(plist):
        if id(p.storage) in seen:
            continue
        seen.add(id(p.storage))
        rows = p.storage.trained_rows
        if rows is not None:
            out[i] = tuple(rows.tolist())
    return out


def _floating_name(name: str) -> bool:
    try:
        dt = np.dtype(name)
    except TypeError:
        return False
    return dt.name == name and np.issubdtype(dt, np.floating) and supported_dtype(dt)


def check_layout(slots: Sequence[SlotRecord], where: str) -> None:
    """Check the storage and canonical maps of ``slots`` (see the module docstring)."""
    first_trainable: dict[int, int] = {}
    slot_of_tensor: dict[str, int] = {}
    for i, s in enumerate(slots):
        label = f"{where}: {_slot_label(i, s.path)}"
        r = s.storage
        if not 0 <= r <= i:
            raise CheckpointError(f"{label}: storage slot {r} is not in [0, {i}]")
        held_by = slot_of_tensor.setdefault(s.tensor, r)
        if held_by != r:
            raise CheckpointError(
                f"{label}: tensor {s.tensor!r} already holds the storage of slot {held_by}"
            )
        rep = slots[r]
        if rep.storage != r:
            raise CheckpointError(
                f"{label}: storage slot {r} is itself stored at slot {rep.storage}"
            )
        if (rep.shape, rep.dtype, rep.tensor) != (s.shape, s.dtype, s.tensor):
            raise CheckpointError(
                f"{label}: shares the storage of slot {r} but has shape {s.shape} {s.dtype} "
                f"in tensor {s.tensor!r}, slot {r} has {rep.shape} {rep.dtype} in {rep.tensor!r}"
            )
        expected = first_trainable.setdefault(r, i) if s.requires_grad else None
        if s.canonical != expected:
            raise CheckpointError(f"{label}: {_canonical_problem(slots, i, expected)}")


def _canonical_problem(slots: Sequence[SlotRecord], i: int, expected: int | None) -> str:
    c = slots[i].canonical
    if expected is None:
        return f"is frozen but has canonical slot {c} (a frozen slot has none)"
    if c is None:
        return f"is trainable but has no canonical slot (expected {expected})"
    if c > i:
        return f"canonical slot {c} points forward (expected {expected} <= {i})"
    if c < 0:
        return f"canonical slot {c} is negative (expected {expected})"
    if not slots[c].requires_grad:
        return f"canonical slot {c} is a frozen slot (expected {expected})"
    return f"canonical slot {c} does not match its storage (expected {expected})"


def _parse_optimizer(raw: Any, slots: Sequence[SlotRecord], where: str) -> OptimizerRecord | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("kind"), str):
        raise CheckpointError(f"{where}: the optimizer record needs a string 'kind'")
    state_raw = raw.get("state")
    if not isinstance(state_raw, dict):
        raise CheckpointError(f"{where}: the optimizer record needs a 'state' object")
    state: dict[int, SlotState] = {}
    for key, entry in state_raw.items():
        if not (len(key) <= 19 and key.isascii() and key.isdigit() and str(int(key)) == key) or int(
            key
        ) >= len(slots):
            raise CheckpointError(
                f"{where}: optimizer state key {key!r:.40} is not a slot in [0, {len(slots)})"
            )
        slot = int(key)
        label = f"{where}: optimizer state of {_slot_label(slot, slots[slot].path)}"
        if slots[slot].canonical != slot:
            raise CheckpointError(
                f"{label}: the slot is not canonical (its canonical slot is "
                f"{slots[slot].canonical}); state belongs to canonical slots only (C5)"
            )
        if (
            not isinstance(entry, dict)
            or set(entry) != {"scalars", "tensors"}
            or not isinstance(entry["scalars"], dict)
            or not isinstance(entry["tensors"], dict)
            or not all(isinstance(v, str) for v in entry["tensors"].values())
        ):
            raise CheckpointError(f"{label}: expected {{'scalars': {{...}}, 'tensors': {{...}}}}")
        if set(entry["scalars"]) & set(entry["tensors"]):
            raise CheckpointError(f"{label}: a name is both a scalar and a tensor")
        state[slot] = SlotState(entry["scalars"], entry["tensors"])
    config = {k: v for k, v in raw.items() if k != "state"}
    return OptimizerRecord(config, state)


def _check_tensors(schema: Schema, file: SafetensorsFile, where: str) -> None:
    expected: dict[str, tuple[tuple[int, ...], str | None, str]] = {}
    for i, s in enumerate(schema.slots):
        expected[s.tensor] = (s.shape, s.dtype, _slot_label(i, s.path))
    if schema.optimizer is not None:
        for slot, st in schema.optimizer.state.items():
            s = schema.slots[slot]
            for name, key in st.tensors.items():
                what = f"optimizer state {name!r} of {_slot_label(slot, s.path)}"
                if key in expected:
                    raise CheckpointError(f"{where}: {what} reuses tensor {key!r}")
                expected[key] = (schema.state_shape(slot), None, what)
    for key, (shape, dtype, what) in expected.items():
        entry = file.tensors.get(key)
        if entry is None:
            raise CheckpointError(f"{where}: {what}: tensor {key!r} is missing from the file")
        if entry.shape != shape:
            raise CheckpointError(
                f"{where}: {what}: tensor {key!r} has shape {entry.shape}, expected {shape}"
            )
        if entry.widened:  # tiegrad writes every tensor in its own dtype
            raise CheckpointError(
                f"{where}: {what}: tensor {key!r} is stored as {entry.code}, which a tiegrad "
                f"checkpoint never holds (expected {dtype or 'the parameter dtype'})"
            )
        if dtype is None and not np.issubdtype(np.dtype(entry.dtype), np.floating):
            raise CheckpointError(
                f"{where}: {what}: tensor {key!r} has dtype {entry.dtype}, expected a float"
            )
        if dtype is not None and entry.dtype != dtype:
            raise CheckpointError(
                f"{where}: {what}: tensor {key!r} has dtype {entry.dtype}, expected {dtype}"
            )
    extra = sorted(set(file.tensors) - set(expected))
    if extra:
        raise CheckpointError(
            f"{where}: tensors not described by the schema: {shown_list(extra, 5)}"
        )


def slot_paths(plist: ParamList) -> list[str]:
    """A unique path per slot: the handle's name, ``slot{i}`` when it has none.

    A name already used by an earlier slot (the same handle at two slots) gets the
    suffix ``#{i}``, its slot index. A path must be UTF-8 text, as the file stores it.
    """
    paths: list[str] = []
    seen: set[str] = set()
    for i, p in enumerate(plist):
        base = p.name or f"slot{i}"
        path = base if base not in seen else f"{base}#{i}"
        if path in seen:
            raise CheckpointError(f"slot {i}: path {path!r} is not unique in the parameter list")
        try:
            path.encode("utf-8")
        except UnicodeEncodeError as e:
            raise CheckpointError(
                f"slot {i}: path {path!r} is not UTF-8 text ({e.reason} at {e.start}), as a "
                "checkpoint stores names"
            ) from None
        seen.add(path)
        paths.append(path)
    return paths


def slot_records(plist: ParamList) -> list[SlotRecord]:
    """The schema's description of ``plist``: paths, shapes, dtypes, mask, ties (C5, C9).

    Storage identity is read with ``is`` on the storage objects (C1); values are
    never read.
    """
    paths = slot_paths(plist)
    canonical = plist.canonical_slot_indices()
    first: dict[int, int] = {}
    out = []
    for i, p in enumerate(plist):
        r = first.setdefault(id(p.storage), i)
        out.append(
            SlotRecord(
                paths[i],
                tuple(p.shape),
                np.dtype(p.dtype).name,
                bool(p.requires_grad),
                canonical[i],
                r,
                PARAM_PREFIX + paths[r],
            )
        )
    return out


def layout_table(
    pairs: Sequence[tuple[SlotRecord | None, SlotRecord | None]], title: tuple[str, str]
) -> str:
    """Two slot layouts side by side, one row per pair; rows that differ are marked.

    A row compares path, shape, dtype, trainability, canonical slot and storage slot.
    Long layouts show the first ``TABLE_ROWS`` rows and the first ``TABLE_ROWS`` that
    differ, then a count of the rows left out (an error message stays short).
    """

    def cells(s: SlotRecord | None) -> list[str]:
        if s is None:
            return ["-", "", "", "", "", ""]
        return [*slot_cells(s), str(s.storage)]

    head = ["path", "shape", "dtype", "train", "canon", "stor"]
    differing = [i for i, (a, b) in enumerate(pairs) if _differs(a, b)]
    shown = sorted(set(range(min(TABLE_ROWS, len(pairs)))) | set(differing[:TABLE_ROWS]))
    rows = [(cells(pairs[i][0]), cells(pairs[i][1]), _differs(*pairs[i])) for i in shown]
    widths = [
        max([len(head[k]), *(len(r[side][k]) for r in rows for side in (0, 1))])
        for k in range(len(head))
    ]

    def fmt(c: list[str]) -> str:
        return " ".join(v.ljust(w) for v, w in zip(c, widths))

    side = len(fmt(head))
    lines = [
        f"{'':>4}  {title[0]:<{side}} | {title[1]}",
        f"{'slot':>4}  {fmt(head)} | {fmt(head)}",
    ]
    for i, (a, b, bad) in zip(shown, rows):
        lines.append(f"{i:>4}  {fmt(a)} | {fmt(b)}{'  <-- differs' if bad else ''}".rstrip())
    if len(shown) < len(pairs):
        lines.append(
            f"({len(pairs) - len(shown)} more rows not shown, {len(differing)} rows differ in all)"
        )
    return "\n".join(lines)


def slot_cells(s: SlotRecord) -> list[str]:
    """A slot as table cells: path, shape, dtype, trainability and canonical slot."""
    return [
        printable(s.path),
        "x".join(map(str, s.shape)) or "scalar",
        s.dtype,
        "yes" if s.requires_grad else "frozen",
        "-" if s.canonical is None else str(s.canonical),
    ]


def printable(text: str) -> str:
    """``text`` for a terminal: as it is when printable, else escaped as in ``repr``."""
    return text if text.isprintable() else repr(text)[1:-1]


def _differs(a: SlotRecord | None, b: SlotRecord | None) -> bool:
    if a is None or b is None:
        return True
    return (a.path, a.shape, a.dtype, a.requires_grad, a.canonical, a.storage) != (
        b.path,
        b.shape,
        b.dtype,
        b.requires_grad,
        b.canonical,
        b.storage,
    )


def nbytes(slot: SlotRecord) -> int:
    """The bytes of one slot's value."""
    return math.prod(slot.shape) * np.dtype(slot.dtype).itemsize


def json_value(value: Any, what: str, where: str) -> Any:
    """``value`` checked to be JSON-serializable, or a ``CheckpointError`` naming ``what``."""
    try:
        json.dumps(value)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: {what} is not JSON-serializable: {e}") from None
    return value
