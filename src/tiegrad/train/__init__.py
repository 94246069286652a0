"""Training: the ``Trainer`` loop, run folders, metrics, progress and plots."""

from .metrics import MetricsWriter, read_metrics
from .plot import plot_losses
from .rundir import RunDir
from .trainer import Trainer, TrainResult

__all__ = [
    "MetricsWriter",
    "RunDir",
    "TrainResult",
    "Trainer",
    "plot_losses",
    "read_metrics",
]
