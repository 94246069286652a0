"""Run folders as the command names them: ``runs/<date-time>`` and ``runs/latest``.

A new run without ``--run`` gets a fresh ``runs/<date-time>``; ``runs/latest`` points to
the newest run (a symbolic link where the platform has them), and ``sample`` and
``resume`` without a run folder take that newest run. A new run never reuses a folder
holding checkpoints: that would overwrite a run.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

from ..errors import ConfigError
from .checkpoints import checkpoint_model, model_difference

RUNS = "runs"
LATEST = "latest"


def fresh_run_folder() -> str:
    """``runs/<date-time>``, with a ``-N`` suffix where that folder exists already."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = os.path.join(RUNS, stamp)
    path, n = base, 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}"
    return path


def point_latest(folder: str) -> None:
    """Make ``runs/latest`` name ``folder`` when it lies in ``runs/`` (best effort: a
    platform or file system without symbolic links keeps the newest-run lookup)."""
    runs = os.path.realpath(RUNS)
    target = os.path.realpath(folder)
    if os.path.dirname(target) != runs or os.path.basename(target) == LATEST:
        return
    link = os.path.join(RUNS, LATEST)
    tmp = os.path.join(RUNS, f".{LATEST}.{os.getpid()}")
    try:
        if os.path.lexists(link) and not os.path.islink(link):
            return  # a real folder named "latest" is a run of the user's: left alone
        os.symlink(os.path.basename(target), tmp)
        os.replace(tmp, link)
    except OSError:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def newest_run() -> str:
    """``runs/latest``, else the run folder in ``runs/`` whose config was written last."""
    link = os.path.join(RUNS, LATEST)
    if os.path.isfile(os.path.join(link, "config.json")):
        return link
    runs = []
    if os.path.isdir(RUNS):
        for name in os.listdir(RUNS):
            config = os.path.join(RUNS, name, "config.json")
            if os.path.isfile(config):
                runs.append((os.path.getmtime(config), os.path.join(RUNS, name)))
    if not runs:
        raise ConfigError(
            f"no run folder in {RUNS}/: train one with 'tiegrad train', or give a run folder"
        )
    return max(runs)[1]


def check_fresh_run_folder(run: Any, kwargs: dict[str, Any]) -> None:
    """A new run never reuses a folder that holds checkpoints (of this model or another):
    the ``ConfigError`` says whose they are and what to do (resume only where a periodic
    checkpoint exists)."""
    latest = run.existing_checkpoint()
    if latest is None:
        return
    stored = checkpoint_model(latest)
    if stored != kwargs:
        raise ConfigError(
            f"run folder {str(run.path)!r} holds a checkpoint of another model "
            f"({model_difference(stored, kwargs)}): choose another --run"
        )
    if run.latest() is None:
        raise ConfigError(best_only(run))
    raise ConfigError(
        f"run folder {str(run.path)!r} already holds this run's checkpoints: continue it "
        f"with 'tiegrad resume {run.path}' or choose another --run"
    )


def best_only(run: Any) -> str:
    """The error for a run folder holding ``best.safetensors`` but no periodic checkpoint
    (its run stopped before the first): ``resume`` has nothing to continue and ``train``
    would overwrite the best, so both refuse it and say what to do."""
    return (
        f"run folder {str(run.path)!r} holds best.safetensors but no periodic checkpoint "
        "(step_*.safetensors) to resume from: its run stopped before the first one; move "
        "the folder away to train it again, or train with another --run"
    )
