"""``MetricsWriter``: a run's metrics as ``metrics.jsonl`` and ``metrics.csv``.

Each record is one row: a training record (``train_loss``, ``lr``, ``grad_norm``,
``throughput``) or an evaluation record (``val_loss``, ``val_ppl``), both with ``step``
and ``elapsed`` seconds. The JSON-lines file keeps every field; the CSV has the fixed
columns ``CSV_COLUMNS`` with empty cells where a record has no value.

Nothing already written is lost. Each record is appended to both files with
unbuffered writes, so a crash loses at most the line being written. On resume the
files are cut (truncated in place, never rewritten) before the first record past
the resumed step, which was written after the checkpoint the run continues from; a
torn last line (a kill or a full disk mid-write) is cut too, with a warning. A write
that fails raises ``OSError`` naming the file. The writer keeps no records in memory:
readers stream the file (``read_metrics``).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from ..checkpoint.fileio import MAX_JSON_BYTES, parse_json
from ..errors import ConfigError

CSV_COLUMNS = (
    "step",
    "train_loss",
    "val_loss",
    "lr",
    "grad_norm",
    "throughput",
    "elapsed",
    "val_ppl",
)
JSONL_NAME = "metrics.jsonl"
CSV_NAME = "metrics.csv"


def _lines(path: Path) -> Iterator[tuple[int, int, bytes]]:
    """``(offset, line number, line)`` of each line of ``path``, ending newline kept; a
    line longer than ``MAX_JSON_BYTES`` comes in pieces (none a record), so no line is
    read whole past what a record may take."""
    offset = 0
    with open(path, "rb") as f:
        for number, line in enumerate(iter(lambda: f.readline(MAX_JSON_BYTES), b""), 1):
            yield offset, number, line
            offset += len(line)


def _scan(path: Path) -> Iterator[tuple[int, dict[str, Any] | None]]:
    """``(offset, record)`` per line of a ``metrics.jsonl``; a torn last line (no newline,
    or not JSON) gives ``record=None``. A damaged line before the last is a ``ConfigError``."""
    pending: tuple[int, int] | None = None  # a bad line, fatal unless it is the last
    for offset, number, line in _lines(path):
        if pending is not None:
            raise ConfigError(
                f"{path}: line {pending[1]} is not a JSON record (the file is damaged "
                "before its end); move the file away to start the metrics afresh"
            )
        record = None
        if line.endswith(b"\n"):
            try:
                record = parse_json(line, f"{path}: line {number}", error=ConfigError)
            except ValueError:
                record = None
            if not line.strip():
                continue
        if not isinstance(record, dict):
            pending = (offset, number)
            continue
        yield offset, record
    if pending is not None:
        yield pending[0], None


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file (an absent file has none; a torn last
    line is left out)."""
    path = Path(path)
    if not path.exists():
        return []
    return [r for _, r in _scan(path) if r is not None]


def _json_value(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def _csv_row(record: dict[str, Any] | None) -> bytes:
    """One CSV line of ``record`` (the header for ``None``)."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    if record is None:
        writer.writeheader()
    else:
        writer.writerow(record)
    return buf.getvalue().encode("utf-8")


def _cut_jsonl(path: Path, resume_step: int, notify: Callable[[str], None]) -> None:
    """Truncate ``path`` before its first record past ``resume_step`` or its torn last line."""
    if not path.exists():
        return
    for offset, record in _scan(path):
        if record is None:
            notify(f"{path}: dropped a torn last line (a write was cut off)")
        elif record.get("step", 0) <= resume_step:
            continue
        os.truncate(path, offset)
        return


def _cut_csv(path: Path, resume_step: int) -> bool:
    """Truncate ``path`` before its first row past ``resume_step`` or a torn last row;
    returns whether the file holds the header (``False``: absent or empty)."""
    if not path.exists():
        return False
    for offset, number, line in _lines(path):
        if number == 1:
            continue
        step = line.split(b",", 1)[0]
        if not line.endswith(b"\n") or not step.isdigit() or int(step) > resume_step:
            os.truncate(path, offset)
            break
    return path.stat().st_size > 0


class MetricsWriter:
    """Appends records to ``metrics.jsonl`` and ``metrics.csv`` in ``folder``.

    ``resume_step`` (when continuing a run) keeps the existing records whose step is
    at most that step and appends after them; ``None`` starts both files afresh.
    ``notify`` receives the warning about a torn last line (default: ``warnings.warn``).
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        resume_step: int | None = None,
        notify: Callable[[str], None] | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.folder / JSONL_NAME
        self.csv_path = self.folder / CSV_NAME
        notify = notify or (lambda m: warnings.warn(m, RuntimeWarning, stacklevel=3))
        header = False
        if resume_step is not None:
            _cut_jsonl(self.jsonl_path, resume_step, notify)
            header = _cut_csv(self.csv_path, resume_step)
        mode = "ab" if resume_step is not None else "wb"
        self._files: list[tuple[Path, BinaryIO]] = []
        for path in (self.jsonl_path, self.csv_path):
            try:
                self._files.append((path, open(path, mode, buffering=0)))
            except OSError as e:
                self.close()
                raise OSError(
                    e.errno, f"cannot open the metrics file ({e.strerror})", str(path)
                ) from None
        if not header:
            self._append(1, _csv_row(None))

    def _append(self, index: int, data: bytes) -> None:
        path, f = self._files[index]
        view = memoryview(data)
        try:
            while view:
                view = view[f.write(view) :]
        except OSError as e:
            raise OSError(
                e.errno, f"cannot write the metrics file ({e.strerror})", str(path)
            ) from None

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (a dict with at least ``step``) to both files."""
        record = {k: _json_value(v) for k, v in record.items() if v is not None}
        self._append(0, (json.dumps(record) + "\n").encode("utf-8"))
        self._append(1, _csv_row(record))

    def close(self) -> None:
        for _, f in self._files:
            f.close()
        self._files = []

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
