"""The checkpoint file: an atomic safetensors writer, a strict safetensors reader and
the bounded readers of every file a user hands in.

A checkpoint is one plain safetensors file (C9): an 8-byte little-endian header
length, a JSON header naming every tensor's dtype, shape and byte range plus string
``__metadata__``, then the tensor bytes. Writing goes through ``safetensors.numpy``;
reading parses the header here, with every field checked, so that a damaged file of
any kind (truncated, flipped bytes, lengths or offsets out of range, overlaps, holes)
is a ``CheckpointError`` naming the file and never another exception type. Nothing
in the file is ever executed (no pickle).

Reading is bounded by what the format allows, checked before the bytes are read: a
safetensors header by its first 8 bytes and the file's size, its tensor data read one
tensor at a time; a JSON file (``read_json``) by ``MAX_JSON_BYTES`` and every JSON
document (``parse_json``) by ``MAX_JSON_DEPTH`` levels of nesting. An unreadable,
missing or non-regular file is the caller's library error naming it, never a bare
``OSError`` (C6: nothing has been read into anything).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
import stat
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import safetensors.numpy

from ..errors import CheckpointError, TiegradError, shown

#: The largest JSON header read (the limit safetensors itself applies).
MAX_HEADER_BYTES = 100_000_000
#: Header bytes allowed beyond the data's length: a header is never much larger than
#: the tensors it describes, so parsing costs what reading the file costs.
HEADER_ALLOWANCE = 1 << 22
#: Tensors or slots allowed whatever the data, and the data bytes that pay for each more.
ENTRY_ALLOWANCE = 4096
BYTES_PER_ENTRY = 64
#: The largest JSON file read: a configuration or an index takes kilobytes, a run's
#: ``config.json`` holds its tokenizer's files (megabytes).
MAX_JSON_BYTES = 64 << 20
#: The deepest nesting of arrays and objects in a JSON document (configurations and
#: schemas nest a few levels); deeper is refused before parsing, which recurses.
MAX_JSON_DEPTH = 100

_WRITE_CHUNK = 1 << 22
#: Bytes of a temporary name's stem: the suffix ``.<pid>.<8 hex>.tmp`` needs at most 24
#: more, within the 255 bytes of a file name.
_STEM_BYTES = 230
#: When this process started (in the clock of file times): older temporaries of a
#: target are left by earlier writers.
_PROCESS_START = time.time()

#: safetensors dtype codes and the NumPy dtypes they hold (always little-endian).
_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
#: JSON's names of the types a document can hold at its top.
_JSON_KINDS = {dict: "object", list: "list", str: "string", int: "number", float: "number",
               bool: "boolean", type(None): "null"}  # fmt: skip
#: A JSON string (escapes included; an unclosed one runs to the end, so that no input
#: makes the scan start again at each escape) and the bytes that are not brackets: what
#: the depth scan removes, leaving the brackets of arrays and objects.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_BRACKET_STEP = np.zeros(256, np.int8)
_BRACKET_STEP[list(b"[{")], _BRACKET_STEP[list(b"]}")] = 1, -1
_DEPTH_CHUNK = 1 << 20

#: Read only, widened exactly: bfloat16 (transformers' usual export dtype) is the upper
#: half of a float32, so its 16 stored bits are read as a float32 (never written).
_BF16 = "BF16"


def _stored(code: str) -> np.dtype:
    """The element type a dtype code stores (bfloat16: its 16 bits)."""
    return np.dtype("<u2") if code == _BF16 else _DTYPES[code]


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the header: dtype (NumPy name), shape and byte range in the data."""

    name: str
    code: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def dtype(self) -> str:
        """The NumPy dtype name it is read as (``"float32"``; bfloat16 too)."""
        return "float32" if self.code == _BF16 else _DTYPES[self.code].name

    @property
    def widened(self) -> bool:
        """Whether the stored type is narrower than ``dtype`` (bfloat16, read as float32)."""
        return self.code == _BF16

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsFile:
    """A parsed, fully validated safetensors file whose tensor data is read from the file
    opened when it was parsed, one tensor as ``array`` asks for it, never whole.

    ``tensors`` maps each name to its header entry; ``metadata`` is the header's
    string map; ``size`` is the file's length in bytes. The open file is the one that
    was checked: a file renamed over ``path`` meanwhile is not read, and one cut short
    meanwhile is a ``CheckpointError`` (reads, not a memory map, which would end the
    process with a bus error). It is closed when this object is collected.
    """

    path: str
    size: int
    metadata: dict[str, str]
    tensors: dict[str, TensorEntry]
    _fd: int
    _offset: int  # where the tensor data begins in the file

    @property
    def data_bytes(self) -> int:
        """The length of the tensor data (the file less its header)."""
        return self.size - self._offset

    def stored_bytes(self, name: str) -> np.ndarray:
        """The bytes of tensor ``name`` as the file stores them (little-endian, C order),
        as a new array of ``uint8``."""
        e = self.tensors[name]
        out = np.empty(e.nbytes, np.uint8)
        view, at = memoryview(out), self._offset + e.begin
        while view:
            try:
                got = _read_at(self._fd, view, at)
            except OSError as err:
                raise CheckpointError(
                    f"checkpoint {self.path}: cannot read: {err.strerror or err}"
                ) from None
            if not got:
                raise CheckpointError(
                    f"checkpoint {self.path}: the file changed size while it was read"
                )
            view, at = view[got:], at + got
        return out

    def array(self, name: str) -> np.ndarray:
        """A fresh, writable, native-endian copy of tensor ``name``."""
        e = self.tensors[name]
        raw = self.stored_bytes(name).view(_stored(e.code))
        if e.code == _BF16:
            return (raw.astype(np.uint32) << 16).view(np.float32).reshape(e.shape)
        native = raw.dtype.newbyteorder("=")
        return (raw if raw.dtype == native else raw.astype(native)).reshape(e.shape)


def _read_at(fd: int, into: memoryview, offset: int) -> int:
    """Read into ``into`` from ``offset`` of ``fd``; the count read (0 at the end)."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [into], offset)
    os.lseek(fd, offset, os.SEEK_SET)  # Windows: no positioned read
    chunk = os.read(fd, len(into))
    into[: len(chunk)] = chunk
    return len(chunk)


def supported_dtype(dtype: np.dtype) -> bool:
    """Whether a NumPy dtype can be stored in a checkpoint."""
    return any(dt.name == np.dtype(dtype).name for dt in _DTYPES.values())


def write_safetensors(
    path: str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]
) -> int:
    """Write ``tensors`` and ``metadata`` to ``path`` atomically; return the file size.

    The bytes go to a temporary file in the same folder, which is flushed and fsynced,
    renamed over ``path`` with ``os.replace`` and then the folder is fsynced. A crash at
    any point leaves the old file or the new one under ``path``, never a partial one;
    a failure deletes the temporary file. OS errors become ``CheckpointError``.
    """
    where = f"checkpoint {path}"
    try:
        data = memoryview(
            safetensors.numpy.save({k: _contiguous(v) for k, v in tensors.items()}, dict(metadata))
        )
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: cannot serialize: {e}") from e
    n = int.from_bytes(data[:8], "little")
    check_header_length(where, n, len(data) - 8 - n)
    check_entries(where, "tensors to write", len(tensors), len(data) - 8 - n)
    folder = os.path.dirname(os.path.abspath(path))
    stem = _temporary_stem(os.path.basename(path))
    _remove_stale_temporaries(folder, stem)
    tmp = os.path.join(folder, f"{stem}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    except OSError as e:
        raise CheckpointError(f"checkpoint {path}: cannot create a temporary file: {e}") from e
    try:
        with os.fdopen(fd, "wb") as f:
            for start in range(0, len(data), _WRITE_CHUNK):
                f.write(data[start : start + _WRITE_CHUNK])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError):
            raise CheckpointError(f"checkpoint {path}: write failed: {e}") from e
        raise
    _fsync_folder(folder)
    return len(data)


def _contiguous(arr: np.ndarray) -> np.ndarray:
    """``arr`` C-contiguous with its own shape (``np.ascontiguousarray`` makes a 0-d array 1-d)."""
    return np.ascontiguousarray(arr).reshape(arr.shape)


def _temporary_stem(name: str) -> str:
    """``.<name>``, the start of the target's temporary names; a name too long to take
    the suffix within 255 bytes keeps its first bytes and a digest of all of it."""
    if len(name.encode("utf-8", "surrogateescape")) <= _STEM_BYTES:
        return f".{name}"
    digest = hashlib.blake2b(name.encode("utf-8", "surrogateescape"), digest_size=8).hexdigest()
    head = name.encode("utf-8", "surrogateescape")[: _STEM_BYTES - 17]
    return f".{head.decode('utf-8', 'ignore')}~{digest}"


def _remove_stale_temporaries(folder: str, stem: str) -> None:
    """Delete the temporaries of this target that killed writers left behind.

    A temporary is stale when it was last written before this process started and
    the process named in it is not running (a live writer's file is never touched).
    Files that vanish or cannot be removed meanwhile are left alone.
    """
    pattern = re.compile(re.escape(stem) + r"\.(\d{1,10})\.[0-9a-f]{8}\.tmp")
    try:
        found = [(e, pattern.fullmatch(e.name)) for e in os.scandir(folder)]
    except OSError:
        return
    for entry, match in found:
        if match is None:
            continue
        pid = int(match.group(1))
        try:
            stale = entry.stat(follow_symlinks=False).st_mtime < _PROCESS_START
            if stale and entry.is_file(follow_symlinks=False) and not _running(pid):
                os.unlink(entry.path)
        except OSError:
            continue


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists (another process's, not ours: ours is running
    now, but its temporaries from before it started belong to a dead namesake)."""
    if pid == os.getpid():
        return False
    if os.name == "nt":  # os.kill would terminate it: assume it runs
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):
        return True
    return True


def _fsync_folder(folder: str) -> None:
    """Make the rename durable where the platform and file system allow it.

    Runs after the new file is in place, so a file system that cannot fsync a folder
    (or a platform without ``O_DIRECTORY``) costs durability of the rename, never the file.
    """
    if not hasattr(os, "O_DIRECTORY"):
        return
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def checkpoint_path(path: Any) -> str:
    """``path`` as a string (``os.fspath``); anything else is a ``CheckpointError``."""
    try:
        return os.fspath(path)
    except TypeError:
        raise CheckpointError(
            f"checkpoint path must be a str or os.PathLike, got {type(path).__name__}"
        ) from None


def entry_limit(data_len: int) -> int:
    """The most tensors a header, or slots a schema, may describe for ``data_len`` bytes
    of tensor data: ``ENTRY_ALLOWANCE`` plus one per ``BYTES_PER_ENTRY`` bytes. The
    reader's limit on a file's work, which the writer checks too, so that a file it
    writes always reads back (C9)."""
    return ENTRY_ALLOWANCE + data_len // BYTES_PER_ENTRY


def check_entries(where: str, what: str, count: int, data_len: int) -> None:
    """Raise unless ``count`` entries (``what``: ``"tensors"``, ``"slots"``) fit
    ``data_len`` bytes of tensor data (``entry_limit``)."""
    limit = entry_limit(data_len)
    if count > limit:
        raise CheckpointError(
            f"{where}: {count} {what}, more than the {limit} allowed for {data_len} data "
            f"bytes (at most {ENTRY_ALLOWANCE} plus one per {BYTES_PER_ENTRY} bytes)"
        )


def check_header_length(where: str, n: int, data_len: int) -> None:
    """Raise unless a header of ``n`` bytes fits ``data_len`` bytes of tensor data (the
    reader's limit, checked by the writer too, as ``check_entries``)."""
    limit = min(MAX_HEADER_BYTES, HEADER_ALLOWANCE + data_len)
    if n > limit:
        raise CheckpointError(
            f"{where}: header length {n} exceeds {limit} (a header may take "
            f"{HEADER_ALLOWANCE} bytes plus one per data byte, at most {MAX_HEADER_BYTES})"
        )


def read_safetensors(path: str) -> SafetensorsFile:
    """Read and validate a safetensors file; any defect is a ``CheckpointError``.

    Checks: the path is a regular file (a FIFO, a device or a folder is refused before
    reading); the 8-byte length fits the file and at most ``HEADER_ALLOWANCE`` plus the
    data's length (and ``MAX_HEADER_BYTES``), so the work done is bounded by the file's
    size and a lying length is refused from the first 8 bytes; the header is UTF-8 JSON
    object without duplicate keys or lone surrogates (``parse_json``), describing at
    most ``entry_limit`` tensors; ``__metadata__`` maps strings to strings; every
    tensor has exactly ``dtype``, ``shape`` and ``data_offsets`` with a known dtype, a
    shape of non-negative integers and a byte range whose length is the shape's; the
    ranges tile the data exactly (no overlap, no hole, no trailing bytes). Only the
    header has been read when this returns; each tensor is read when it is asked for.
    """
    where = f"checkpoint {path}"
    with open_regular(path, where, CheckpointError) as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise CheckpointError(f"{where}: {size} bytes, too short for a safetensors header")
        n = int.from_bytes(_read_exactly(f, 8, where), "little")
        if n > size - 8:
            raise CheckpointError(
                f"{where}: header length {n} is larger than the {size - 8} bytes after it "
                f"(truncated or damaged file)"
            )
        data_len = size - 8 - n
        check_header_length(where, n, data_len)
        header = parse_json(_read_exactly(f, n, where), f"{where}: the header")
        count = len(header) - ("__metadata__" in header)
        check_entries(where, "tensors in the header", count, data_len)
        metadata: dict[str, str] = {}
        entries: dict[str, TensorEntry] = {}
        for name, spec in header.items():
            if name == "__metadata__":
                metadata = _metadata(spec, where)
            else:
                entries[name] = _entry(name, spec, data_len, where)
        _check_tiling(entries, data_len, where)
        fd = os.dup(f.fileno())
    parsed = SafetensorsFile(path, size, metadata, entries, fd, 8 + n)
    weakref.finalize(parsed, os.close, fd)
    return parsed


def _read_exactly(f: BinaryIO, n: int, where: str) -> bytes:
    """The next ``n`` bytes of ``f``; fewer is a file that shrank while it was read."""
    try:
        raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{where}: cannot read: {e.strerror or e}") from None
    if len(raw) != n:
        raise CheckpointError(f"{where}: the file changed size while it was read")
    return raw


def open_regular(path: str | os.PathLike[str], where: str, error: type[TiegradError]) -> BinaryIO:
    """``path`` opened for reading (binary, unbuffered) when it is a regular file; else
    ``error`` naming ``where`` and why it cannot be opened (no such file, permissions),
    or that it is not a regular file (a FIFO, a device, a folder: refused before
    anything is read or waited for)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise error(f"{where}: cannot read: {e.strerror or e}") from None
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError as e:
        os.close(fd)
        raise error(f"{where}: cannot read: {e.strerror or e}") from None
    if not regular:
        os.close(fd)
        raise error(f"{where}: not a regular file")
    return os.fdopen(fd, "rb", buffering=0)


def read_limited(
    path: str | os.PathLike[str], limit: int, error: type[TiegradError], where: str | None = None
) -> bytes:
    """The bytes of the regular file ``path`` (``open_regular``), refused unread when it
    holds more than ``limit`` bytes; ``error`` names ``where`` (the path by default)."""
    where = os.fspath(path) if where is None else where
    with open_regular(path, where, error) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise error(f"{where}: {size} bytes, more than the {limit} this file may hold")
        try:
            raw = f.read(limit + 1)
        except OSError as e:
            raise error(f"{where}: cannot read: {e.strerror or e}") from None
    if len(raw) > limit:
        raise error(f"{where}: the file grew past {limit} bytes while it was read")
    return raw


def read_json(
    path: str | os.PathLike[str],
    expect: type = dict,
    error: type[TiegradError] = CheckpointError,
    limit: int = MAX_JSON_BYTES,
) -> Any:
    """The JSON document of the file ``path``: read by ``read_limited`` (at most
    ``limit`` bytes), parsed by ``parse_json`` (``expect`` at its top); every defect is
    ``error`` naming the file."""
    where = os.fspath(path)
    return parse_json(read_limited(path, limit, error, where), where, expect, error)


def parse_json(
    raw: bytes | str,
    what: str,
    expect: type = dict,
    error: type[TiegradError] = CheckpointError,
) -> Any:
    """A JSON document of type ``expect`` (``dict``: an object; ``list``) from ``raw``
    (UTF-8 bytes or text), or ``error`` naming ``what``: nesting deeper than
    ``MAX_JSON_DEPTH`` (refused before parsing), invalid JSON, an integer beyond
    Python's digit limit, a repeated key, a lone surrogate (``"\\ud800"``, which no
    UTF-8 text holds), or a document of another type (``holds a JSON list, expected an
    object``)."""

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise error(f"{what} repeats the key {shown(k)}")
            out[k] = v
        return out

    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if data.count(b"[") + data.count(b"{") > MAX_JSON_DEPTH:  # else too few to nest deeper
        depth = json_depth(data)
        if depth > MAX_JSON_DEPTH:
            raise error(f"{what} nests {depth} levels deep, more than the {MAX_JSON_DEPTH} allowed")
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        doc = json.loads(text, object_pairs_hook=no_duplicates)
        json.dumps(doc, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise error(f"{what} holds a lone surrogate (not valid Unicode)") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise error(f"{what} is not valid UTF-8 JSON: {shown(str(e))}") from None
    if not isinstance(doc, expect):
        wanted = "an object" if expect is dict else f"a {_JSON_KINDS[expect]}"
        raise error(f"{what} holds a JSON {_JSON_KINDS[type(doc)]}, expected {wanted}")
    return doc


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in the JSON text ``raw``, found without
    parsing (the strings removed, the brackets counted in chunks: linear time, bounded
    memory). Invalid JSON can count deeper than a parser would reach; never shallower."""
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    level = deepest = 0
    for start in range(0, len(brackets), _DEPTH_CHUNK):
        chunk = np.frombuffer(brackets, np.uint8, min(_DEPTH_CHUNK, len(brackets) - start), start)
        levels = np.cumsum(_BRACKET_STEP[chunk], dtype=np.int64) + level
        deepest, level = max(deepest, int(levels.max())), int(levels[-1])
    return deepest


def _metadata(spec: Any, where: str) -> dict[str, str]:
    if not isinstance(spec, dict) or not all(isinstance(v, str) for v in spec.values()):
        raise CheckpointError(f"{where}: __metadata__ must map strings to strings")
    return spec


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _entry(name: str, spec: Any, data_len: int, where: str) -> TensorEntry:
    what = f"{where}: tensor {name!r}"
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise CheckpointError(
            f"{what}: expected keys dtype, shape, data_offsets, got {spec!r:.200}"
        )
    code, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if not isinstance(code, str) or (code not in _DTYPES and code != _BF16):
        raise CheckpointError(f"{what}: unsupported dtype {code!r:.40}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise CheckpointError(f"{what}: shape {shape!r:.200} is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))):
        raise CheckpointError(f"{what}: data_offsets {offsets!r:.200} is not two integers")
    begin, end = offsets
    if not 0 <= begin <= end <= data_len:
        raise CheckpointError(
            f"{what}: byte range [{begin}, {end}) lies outside the {data_len} data bytes "
            f"(truncated or damaged file)"
        )
    expected = math.prod(shape) * _stored(code).itemsize
    if end - begin != expected:
        raise CheckpointError(
            f"{what}: {end - begin} bytes for shape {tuple(shape)} {code}, expected {expected}"
        )
    return TensorEntry(name, code, tuple(shape), begin, end)


def _check_tiling(entries: Mapping[str, TensorEntry], data_len: int, where: str) -> None:
    pos = 0
    prev = "the header"
    for e in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if e.begin != pos:
            kind = "overlaps" if e.begin < pos else "leaves a hole after"
            raise CheckpointError(
                f"{where}: tensor {e.name!r} at byte {e.begin} {kind} {prev} (ends at {pos})"
            )
        pos, prev = e.end, f"tensor {e.name!r}"
    if pos != data_len:
        raise CheckpointError(
            f"{where}: {data_len - pos} trailing bytes after the last tensor (ends at {pos}, "
            f"data holds {data_len})"
        )
