"""``inspect``: a terminal-readable summary of a checkpoint file (used by ``tiegrad inspect``)."""

from __future__ import annotations

import json
import os
from typing import Any

from .fileio import SafetensorsFile, checkpoint_path, read_safetensors
from .integrity import verify
from .schema import Schema, nbytes, printable, slot_cells

_JSON_WIDTH = 160


def inspect(path: str | os.PathLike[str]) -> str:
    """Describe the checkpoint at ``path``: slots, shapes, ties, frozen flags, optimizer, bytes.

    The file is fully validated first (``Schema.parse``, and every tensor against its
    checksum, ``integrity.verify``); a damaged file raises ``CheckpointError``. Nothing
    is loaded into any model. Strings from the file (paths, names) are shown escaped when
    they are not printable, so the text is safe to print.
    """
    path = checkpoint_path(path)
    file = read_safetensors(path)
    schema = Schema.parse(file)
    verify(file, schema.checksums, f"checkpoint {path}")
    slots = schema.slots
    storages = [i for i, s in enumerate(slots) if s.storage == i]
    tied = len(slots) - len(storages)
    frozen = sum(not s.requires_grad for s in slots)
    lines = [
        f"checkpoint {path}: tiegrad format {schema.version}, {file.size:,} bytes",
        ", ".join(
            f"{n} {what}{'' if n == 1 else 's'}"
            for n, what in (
                (len(slots), "slot"),
                (len(storages), "storage"),
                (tied, "tied slot"),
                (frozen, "frozen slot"),
            )
        ),
    ]
    rows = [("slot", "path", "shape", "dtype", "trainable", "canonical", "stored in")]
    for i, s in enumerate(slots):
        stored = printable(s.tensor) if s.storage == i else f"= slot {s.storage} (tied)"
        rows.append((str(i), *slot_cells(s), stored))
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    for r in rows:
        cells = [r[0].rjust(widths[0])] + [v.ljust(w) for v, w in zip(r[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
    for r in storages:
        members = [s.path for s in slots if s.storage == r]
        if len(members) > 1:
            lines.append(f"tie: {' = '.join(map(printable, members))}")
    param_bytes = sum(nbytes(slots[r]) for r in storages)
    untied = sum(nbytes(s) for s in slots)
    lines.append(
        f"parameters: {len(storages)} tensors, {param_bytes:,} bytes "
        f"({untied:,} bytes if every slot were stored)"
    )
    lines.extend(_optimizer_lines(schema, file))
    lines.append(
        f"checksums: CRC-32 of each of the {len(file.tensors)} tensors, verified"
        if schema.checksums is not None
        else "checksums: none (written before tiegrad stored them), not verified"
    )
    if schema.schedule is not None:
        lines.append(f"schedule: {_short(schema.schedule)}")
    if schema.rng is not None:
        lines.append(f"rng: {_text(schema.rng.get('bit_generator', '?'))} state")
    if schema.extra is not None:
        lines.append(f"extra: {_short(schema.extra)}")
    return "\n".join(lines)


def _optimizer_lines(schema: Schema, file: SafetensorsFile) -> list[str]:
    opt = schema.optimizer
    if opt is None:
        return ["optimizer: none"]
    keys = [k for st in opt.state.values() for k in st.tensors.values()]
    size = sum(file.tensors[k].nbytes for k in keys)
    counters = ", ".join(
        f"{k} {_text(opt.config[k])}" for k in ("step_count", "skipped_steps") if k in opt.config
    )
    lines = [
        f"optimizer: {printable(opt.kind)}{', ' + counters if counters else ''}; state for "
        f"{len(opt.state)} canonical slots in {len(keys)} tensors, {size:,} bytes"
    ]
    if "defaults" in opt.config:
        lines.append(f"  defaults: {_short(opt.config['defaults'])}")
    return lines


def _text(value: Any) -> str:
    """A string from the file as it is (escaped when not printable), anything else as JSON."""
    if not isinstance(value, str):
        return _short(value)
    text = printable(value)
    return text if len(text) <= _JSON_WIDTH else text[: _JSON_WIDTH - 3] + "..."


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= _JSON_WIDTH else text[: _JSON_WIDTH - 3] + "..."
