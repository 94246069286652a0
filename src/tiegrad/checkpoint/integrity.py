"""Per-tensor checksums of a checkpoint: written by ``save``, verified by ``load`` and ``inspect``.

From format version 2 on, the schema holds ``checksums``: ``{"algorithm": "crc32",
"tensors": {name: CRC-32 of the tensor's stored bytes}}`` for every tensor of the file,
so that a flipped byte in the tensor data is a ``CheckpointError`` naming the tensor
rather than a wrong value loaded in silence (C6, C9). A file of format version 1
(written before tiegrad stored checksums) has none: it loads, with a warning naming the
file.

CRC-32 (``zlib.crc32``) because the damage guarded against is accidental (a bit flipped
on disk or in a copy, a torn transfer): a digest stored in the same file can be
rewritten along with the data, so a cryptographic hash would detect no more forgeries
and costs several times as much (``docs/checkpoints.md``). CRC-32 detects every burst
of damage up to 32 bits long and misses other damage with a probability of 2**-32 per
tensor.
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ..errors import CheckpointError, shown_list
from .fileio import SafetensorsFile, _is_int

ALGORITHM = "crc32"


def tensor_checksum(array: np.ndarray) -> int:
    """The CRC-32 of ``array``'s bytes as a safetensors file stores them (C order,
    little-endian)."""
    stored = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    return zlib.crc32(stored.reshape(-1).view(np.uint8))


def checksums_json(checksums: Mapping[str, int]) -> dict[str, Any]:
    """The schema's ``checksums`` entry for ``checksums`` (tensor name -> CRC-32)."""
    return {"algorithm": ALGORITHM, "tensors": dict(sorted(checksums.items()))}


def parse_checksums(raw: Any, tensors: Iterable[str], where: str) -> dict[str, int]:
    """The checksums of a schema's ``checksums`` entry, which must name exactly
    ``tensors`` (the file's), each with a 32-bit unsigned integer."""
    if not isinstance(raw, dict) or set(raw) != {"algorithm", "tensors"}:
        raise CheckpointError(
            f"{where}: the schema's checksums must be {{'algorithm': ..., 'tensors': {{...}}}}, "
            f"got {raw!r:.80}"
        )
    if raw["algorithm"] != ALGORITHM:
        raise CheckpointError(
            f"{where}: checksum algorithm {raw['algorithm']!r:.40}, expected {ALGORITHM!r}"
        )
    table = raw["tensors"]
    if not isinstance(table, dict):
        raise CheckpointError(f"{where}: the schema's checksums must map tensor names to CRC-32s")
    names = set(tensors)
    for problem, keys in (
        ("no checksum for", sorted(names - set(table))),
        ("a checksum for tensors not in the file:", sorted(set(table) - names)),
    ):
        if keys:
            raise CheckpointError(f"{where}: the schema has {problem} {shown_list(keys)}")
    for name, crc in table.items():
        if not _is_int(crc) or not 0 <= crc < 1 << 32:
            raise CheckpointError(
                f"{where}: the checksum of tensor {name!r} is {crc!r:.40}, not a CRC-32 "
                f"(an integer in [0, 2**32))"
            )
    return table


def verify(file: SafetensorsFile, checksums: Mapping[str, int] | None, where: str) -> None:
    """Check every tensor's stored bytes against its checksum; any mismatch is a
    ``CheckpointError`` naming the tensor (the first few, then how many more).

    ``checksums`` None (a format 1 file) is a warning naming the file: its bytes cannot
    be checked. ``stacklevel`` points at the caller of ``load`` or ``inspect``.
    """
    if checksums is None:
        warnings.warn(
            f"{where}: written without tensor checksums (format version 1, before tiegrad "
            "stored them), so damaged tensor bytes cannot be detected; save it again to add "
            "them",
            UserWarning,
            stacklevel=3,
        )
        return
    damaged = [
        (name, crc, actual)
        for name, crc in checksums.items()
        if (actual := zlib.crc32(file.stored_bytes(name))) != crc
    ]
    if damaged:
        name, crc, actual = damaged[0]
        others = f"; damaged too: {shown_list(n for n, _, _ in damaged[1:])}" if damaged[1:] else ""
        raise CheckpointError(
            f"{where}: tensor {name!r} is damaged: its bytes have CRC-32 {actual:#010x}, the "
            f"schema records {crc:#010x}{others}"
        )
