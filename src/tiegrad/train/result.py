"""``TrainResult``: what ``Trainer.fit`` returns.

``status`` is one of ``STATUSES``: ``"completed"`` (the run reached ``max_steps``),
``"early_stopped"`` (its patience is used up) or ``"interrupted"`` (SIGINT or SIGTERM,
named by ``signal``; the run is checkpointed and can be resumed).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

STATUSES = ("completed", "early_stopped", "interrupted")


@dataclass
class TrainResult:
    """What ``Trainer.fit`` did: the final step, why it stopped, losses and paths."""

    step: int
    status: str
    elapsed: float
    train_loss: float | None = None
    val_loss: float | None = None
    best_val_loss: float | None = None
    resumed_from: int | None = None
    #: seconds and steps of this ``fit`` alone (``elapsed`` counts the run's total).
    process_elapsed: float = 0.0
    process_steps: int = 0
    #: the steps ``train_loss`` and ``val_loss`` come from.
    train_loss_step: int | None = None
    val_loss_step: int | None = None
    #: the signal that interrupted the run (``signal.SIGINT`` or ``SIGTERM``), if any.
    signal: int | None = None
    checkpoint: Path | None = None
    best_checkpoint: Path | None = None
    metrics: Path | None = None
    metrics_csv: Path | None = None
    plot: Path | None = None
