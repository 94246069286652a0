"""``RunDir``: the layout of a run folder.

::

    RUN/
      config.json                 the resolved configuration (written by the command)
      checkpoints/step_0000100.safetensors   the last K periodic checkpoints
      checkpoints/best.safetensors           the checkpoint with the lowest val loss
      metrics.jsonl, metrics.csv  one record per logged step and per evaluation
      loss.png                    train and validation loss

The latest checkpoint is the periodic one with the highest step; a run resumes from
it. A run made by ``tiegrad train`` has an id (``new_run_id``), stored under ``RUN_ID`` in
its ``config.json`` and in the ``extra`` of every checkpoint it writes, so that
``tiegrad resume`` can tell the run's own checkpoints from another run's. Pruning
keeps the newest ``keep_last`` periodic checkpoints and never touches ``best``.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path
from typing import Any

from ..checkpoint.fileio import read_json
from ..errors import ConfigError
from .metrics import CSV_NAME, JSONL_NAME

_STEP_FILE = re.compile(r"^step_(\d+)\.safetensors$")

#: The key of a run's id in its ``config.json`` and in its checkpoints' ``extra``.
RUN_ID = "run_id"


def new_run_id() -> str:
    """A fresh run id: 32 random hexadecimal digits (``uuid4``)."""
    return uuid.uuid4().hex


class RunDir:
    """Paths and checkpoint bookkeeping of one run folder (created on demand)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise ConfigError(f"run folder {str(self.path)!r} exists and is not a folder")

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def config_path(self) -> Path:
        return self.path / "config.json"

    @property
    def metrics_path(self) -> Path:
        return self.path / JSONL_NAME

    @property
    def csv_path(self) -> Path:
        return self.path / CSV_NAME

    @property
    def plot_path(self) -> Path:
        return self.path / "loss.png"

    @property
    def best_path(self) -> Path:
        return self.checkpoints / "best.safetensors"

    def create(self) -> None:
        """Create the folder and its ``checkpoints``; failing is a ``ConfigError`` naming
        the folder and the reason."""
        _mkdir(self.checkpoints, self.path)

    def step_path(self, step: int) -> Path:
        return self.checkpoints / f"step_{step:07d}.safetensors"

    def step_checkpoints(self) -> list[tuple[int, Path]]:
        """Periodic checkpoints as ``(step, path)``, oldest first."""
        if not self.checkpoints.is_dir():
            return []
        found = []
        for p in self.checkpoints.iterdir():
            m = _STEP_FILE.match(p.name)
            if m and p.is_file():
                found.append((int(m.group(1)), p))
        return sorted(found)

    def latest(self) -> Path | None:
        """The periodic checkpoint with the highest step, or ``None``."""
        found = self.step_checkpoints()
        return found[-1][1] if found else None

    def existing_checkpoint(self) -> Path | None:
        """The latest periodic checkpoint, else ``best``, else ``None``: a folder with one
        holds a run, which a new run never reuses (``Trainer``, ``tiegrad train``)."""
        return self.latest() or (self.best_path if self.best_path.is_file() else None)

    def best_or_latest(self) -> Path | None:
        """``best`` when it exists, else the latest periodic checkpoint."""
        return self.best_path if self.best_path.is_file() else self.latest()

    def prune(self, keep_last: int) -> list[Path]:
        """Delete all but the newest ``keep_last`` periodic checkpoints; returns them."""
        found = self.step_checkpoints()
        removed = [p for _, p in found[: max(0, len(found) - keep_last)]]
        for p in removed:
            p.unlink()
        return removed

    # -- configuration ------------------------------------------------------------------
    def write_config(self, config: dict[str, Any]) -> None:
        """Write ``config.json`` atomically."""
        _mkdir(self.path, self.path)
        tmp = self.config_path.with_name("config.json.tmp")
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, self.config_path)

    def read_config(self) -> dict[str, Any]:
        """The run's ``config.json``; a missing or damaged file is a ``ConfigError``."""
        if not os.path.lexists(self.config_path):
            raise ConfigError(f"{str(self.path)!r} is not a run folder: it has no config.json")
        return read_json(self.config_path, error=ConfigError)


def _mkdir(folder: Path, run: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"run folder {str(run)!r} cannot be created: {e.strerror or e} ({e.filename})"
        ) from None
