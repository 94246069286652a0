"""``MetricsWriter``: a run's metrics as ``metrics.jsonl`` and ``metrics.csv``.

Each record is one row: a training record (``train_loss``, ``lr``, ``grad_norm``,
``throughput``) or an evaluation record (``val_loss``), both with ``step`` and
``elapsed`` seconds. The JSON-lines file keeps every field; the CSV has the fixed
columns ``CSV_COLUMNS`` with empty cells where a record has no value. Both files
are appended to and flushed after each record, so a crash loses nothing already
written. On resume, records past the resumed step (written after the checkpoint
that the run continues from) are dropped from both files first.
"""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path
from typing import Any

CSV_COLUMNS = ("step", "train_loss", "val_loss", "lr", "grad_norm", "throughput", "elapsed")
JSONL_NAME = "metrics.jsonl"
CSV_NAME = "metrics.csv"


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file (an absent file has none)."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                records.append(json.loads(line))
    return records


def _json_value(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class MetricsWriter:
    """Appends records to ``metrics.jsonl`` and ``metrics.csv`` in ``folder``.

    ``resume_step`` (when continuing a run) keeps only the existing records whose
    step is at most that step; ``None`` starts both files afresh.
    """

    def __init__(self, folder: str | os.PathLike, resume_step: int | None = None) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.folder / JSONL_NAME
        self.csv_path = self.folder / CSV_NAME
        kept = []
        if resume_step is not None:
            kept = [r for r in read_metrics(self.jsonl_path) if r.get("step", 0) <= resume_step]
        self.records: list[dict[str, Any]] = []
        self._jsonl = open(self.jsonl_path, "w", encoding="utf-8")
        self._csv_file = open(self.csv_path, "w", encoding="utf-8", newline="")
        self._csv = csv.DictWriter(self._csv_file, CSV_COLUMNS, extrasaction="ignore")
        self._csv.writeheader()
        for r in kept:
            self.write(r)

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (a dict with at least ``step``) to both files."""
        record = {k: _json_value(v) for k, v in record.items() if v is not None}
        self.records.append(record)
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        self._csv.writerow(record)
        self._csv_file.flush()

    def close(self) -> None:
        self._jsonl.close()
        self._csv_file.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
