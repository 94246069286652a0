"""Training: the ``Trainer`` loop and its ``TrainConfig``, callbacks, run folders,
metrics, progress and plots."""

from .callbacks import Callback, LossPlot, MetricsLogger, TensorBoardLogger, TextSample
from .config import TrainConfig
from .metrics import MetricsWriter, read_metrics
from .plot import plot_losses
from .rundir import RunDir
from .trainer import Trainer, TrainResult

__all__ = [
    "Callback",
    "LossPlot",
    "MetricsLogger",
    "MetricsWriter",
    "RunDir",
    "TensorBoardLogger",
    "TextSample",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "plot_losses",
    "read_metrics",
]
