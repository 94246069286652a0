"""``MetricsWriter``: a run's metrics as ``metrics.jsonl`` and ``metrics.csv``.

Each record is one row: a training record (``train_loss``, ``lr``, ``grad_norm``,
``throughput``, and the process's peak memory so far in MiB, ``peak_rss_mb`` and on a
CUDA device ``device_peak_mb``: ``tiegrad.train.memory``) or an evaluation record
(``val_loss``, ``val_ppl``), both with ``step`` and ``elapsed`` seconds. The JSON-lines
file keeps every field; the CSV has the fixed columns ``CSV_COLUMNS`` with empty cells
where a record has no value. A ``metrics.csv`` begun before the memory columns existed
(its header is ``EARLIER_COLUMNS``) keeps its columns when the run is resumed.

Nothing already written is lost. Each record is appended to both files with
unbuffered writes, so a crash loses at most the line being written. On resume the
files are cut (truncated in place, never rewritten) before the first record past
the resumed step, which was written after the checkpoint the run continues from; a
torn last line (a kill or a full disk mid-write) is cut too, with a warning. A line
before the last that is damaged, or whose ``step`` is not an integer >= 0 or whose
other fields are not numbers, is refused, a ``ConfigError`` naming the file and line
before either file is cut: skipping it would leave a file that says less than it did,
and cutting there would drop the valid rows after it; the user repairs the line. A write
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
    "peak_rss_mb",
    "device_peak_mb",
)
#: The columns of a ``metrics.csv`` written before the peak-memory columns.
EARLIER_COLUMNS = CSV_COLUMNS[:8]
JSONL_NAME = "metrics.jsonl"
CSV_NAME = "metrics.csv"


#: The numeric fields of a record: a number, or the name of a non-finite one ("nan").
_NUMBERS = frozenset(CSV_COLUMNS) - {"step"}
_NON_FINITE = ("nan", "inf", "-inf")


def _lines(path: Path) -> Iterator[tuple[int, int, bytes]]:
    """``(offset, line number, line)`` of each line of ``path``, ending newline kept; a
    line longer than ``MAX_JSON_BYTES`` comes in pieces (none a record), so no line is
    read whole past what a record may take."""
    offset = 0
    with open(path, "rb") as f:
        for number, line in enumerate(iter(lambda: f.readline(MAX_JSON_BYTES), b""), 1):
            yield offset, number, line
            offset += len(line)


def _damaged(path: Path, number: int, what: str) -> ConfigError:
    return ConfigError(
        f"{path}: line {number} {what} (the file is damaged before its end); repair or "
        "remove that line, or move the file away to start the metrics afresh"
    )


def _json_record(line: bytes) -> tuple[dict[str, Any] | None, str]:
    """A ``metrics.jsonl`` line as a record, or ``None`` and what is wrong with it."""
    try:
        record = parse_json(line, "a metrics.jsonl line", error=ConfigError)
    except ValueError:
        return None, "is not a JSON record"
    if not isinstance(record, dict):
        return None, "is not a JSON record"
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return None, f"has step {step!r:.40}, expected an integer >= 0"
    for key in _NUMBERS.intersection(record):
        value = record[key]
        if isinstance(value, bool) or not (isinstance(value, (int, float)) or value in _NON_FINITE):
            return None, f"has {key} {value!r:.40}, expected a number"
    return record, ""


def _csv_record(line: bytes, columns: tuple[str, ...]) -> tuple[dict[str, Any] | None, str]:
    """A ``metrics.csv`` row of ``columns`` as ``{"step": int}``, or ``None`` and what is
    wrong with it."""
    try:
        cells = next(csv.reader([line.decode("utf-8")]))
    except (UnicodeDecodeError, csv.Error, StopIteration):
        return None, "is not a CSV row"
    if len(cells) != len(columns):
        return (
            None,
            f"has {len(cells)} cells, expected {len(columns)} ({','.join(columns)})",
        )
    if not cells[0].isascii() or not cells[0].isdigit():
        return None, f"has step {cells[0]!r:.40}, expected an integer >= 0"
    for key, cell in zip(columns[1:], cells[1:]):
        try:
            float(cell or 0)
        except ValueError:
            return None, f"has {key} {cell!r:.40}, expected a number or an empty cell"
    return {"step": int(cells[0])}, ""


def _scan(
    path: Path, parse: Callable[[bytes], tuple[dict[str, Any] | None, str]], header: bytes = b""
) -> Iterator[tuple[int, dict[str, Any] | None]]:
    """``(offset, record)`` per line of a metrics file read by ``parse``, after its
    ``header`` line (if any), blank lines skipped. A torn or damaged last line (no
    newline, or not a record) gives ``record=None``; a damaged line before the last is
    a ``ConfigError`` naming the file, the line and what is wrong."""
    pending: tuple[int, int, str] | None = None  # a bad line, fatal unless it is the last
    for offset, number, line in _lines(path):
        if pending is not None:
            raise _damaged(path, pending[1], pending[2])
        if header and number == 1:
            if line != header:
                pending = (offset, number, f"is not the header {header.decode().strip()!r}")
            continue
        if not line.strip() and line.endswith(b"\n"):
            continue
        record, what = parse(line) if line.endswith(b"\n") else (None, "is cut off")
        if record is None:
            pending = (offset, number, what)
            continue
        yield offset, record
    if pending is not None:
        yield pending[0], None


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file (an absent file has none; a torn last
    line is left out; a damaged or wrong-typed line before the last is a ``ConfigError``
    naming the line)."""
    path = Path(path)
    if not path.exists():
        return []
    return [r for _, r in _scan(path, _json_record) if r is not None]


def _json_value(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def _csv_row(record: dict[str, Any] | None, columns: tuple[str, ...] = CSV_COLUMNS) -> bytes:
    """One CSV line of ``record`` in ``columns`` (their header for ``None``)."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, columns, extrasaction="ignore", lineterminator="\n")
    if record is None:
        writer.writeheader()
    else:
        writer.writerow(record)
    return buf.getvalue().encode("utf-8")


def _cuts(folder: Path, resume_step: int) -> list[tuple[Path, int, bool]]:
    """Where a resume from ``resume_step`` cuts the metrics files of ``folder``:
    ``(path, offset, torn)`` of each file's first record past ``resume_step`` or its torn
    last line (``torn``); a file kept whole is not listed. Reads only; a damaged line
    before the last, in either file, is a ``ConfigError``."""
    out = []
    columns = _csv_columns(folder / CSV_NAME)
    for path, lines in (
        (folder / JSONL_NAME, lambda p: _scan(p, _json_record)),
        (
            folder / CSV_NAME,
            lambda p: _scan(p, lambda r: _csv_record(r, columns), _csv_row(None, columns)),
        ),
    ):
        if not path.exists():
            continue
        for offset, record in lines(path):
            if record is None or record["step"] > resume_step:
                out.append((path, offset, record is None))
                break
    return out


def _csv_columns(path: Path) -> tuple[str, ...]:
    """The columns of the ``metrics.csv`` at ``path``: ``EARLIER_COLUMNS`` where its first
    line is their header, else ``CSV_COLUMNS`` (a missing or empty file, or a header that
    is neither, which ``_scan`` then refuses)."""
    try:
        with open(path, "rb") as f:
            first = f.readline(MAX_JSON_BYTES)
    except FileNotFoundError:
        return CSV_COLUMNS
    return EARLIER_COLUMNS if first == _csv_row(None, EARLIER_COLUMNS) else CSV_COLUMNS


def check_metrics(folder: str | os.PathLike, resume_step: int) -> None:
    """Refuse a run folder whose ``metrics.jsonl`` or ``metrics.csv`` a resume from
    ``resume_step`` could not keep whole: a damaged or wrong-typed line before the last
    is a ``ConfigError`` naming the file and line. Reads only (``tiegrad resume`` checks
    before it builds anything; ``MetricsWriter`` checks again before it cuts)."""
    _cuts(Path(folder), resume_step)


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
            for path, offset, torn in _cuts(self.folder, resume_step):  # both checked first
                if torn:
                    notify(f"{path}: dropped a torn last line (a write was cut off)")
                os.truncate(path, offset)
            header = self.csv_path.exists() and self.csv_path.stat().st_size > 0
        #: the CSV's columns: an earlier file's when a resumed run appends to one
        self.columns = _csv_columns(self.csv_path) if header else CSV_COLUMNS
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
            self._append(1, _csv_row(None, self.columns))

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
        self._append(1, _csv_row(record, self.columns))

    def close(self) -> None:
        for _, f in self._files:
            f.close()
        self._files = []

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
