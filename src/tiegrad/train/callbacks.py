"""Callbacks: what ``Trainer.fit`` tells the code around it, and the built-in ones.

A ``Callback`` overrides any of its hooks; ``Trainer(callbacks=[...])`` calls them in
list order, after the built-in ones (metrics files, then TensorBoard or samples when
asked) and before the loss plot:

- ``on_train_begin(trainer)``: once, after a resumed run has loaded its checkpoint
  (``trainer.resumed_from`` is its step, or ``None``; ``trainer.start_step`` is the step
  this ``fit`` starts from: 0 for a new run, the step reached by an earlier ``fit`` of
  the same trainer);
- ``on_step_end(trainer, logs)``: after every optimizer step; ``logs`` holds ``step``,
  ``train_loss``, ``lr``, ``grad_norm`` (``None`` without clipping), ``throughput``
  (items per second), ``elapsed`` (the run's seconds, earlier processes included),
  ``peak_rss_mb`` and ``device_peak_mb`` (the process's peak memory so far, MiB, None
  where not known: ``tiegrad.train.memory``);
- ``on_eval(trainer, logs)``: after every evaluation; ``logs`` holds ``step``,
  ``val_loss``, ``val_ppl`` (its exponential, the perplexity), ``best`` and ``elapsed``;
- ``on_checkpoint(trainer, path)``: after a checkpoint file is written;
- ``on_train_end(trainer, result)``: once, with the ``TrainResult`` (it may fill
  result fields such as ``plot``). It is not called when ``fit`` raises.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .metrics import CSV_NAME, JSONL_NAME, MetricsWriter, read_metrics
from .plot import plot_losses


class Callback:
    """Base class of training callbacks: every hook does nothing."""

    def on_train_begin(self, trainer: Any) -> None:
        """Called once before the first step of this ``fit``."""

    def on_step_end(self, trainer: Any, logs: dict[str, Any]) -> None:
        """Called after each optimizer step."""

    def on_eval(self, trainer: Any, logs: dict[str, Any]) -> None:
        """Called after each evaluation."""

    def on_checkpoint(self, trainer: Any, path: Path) -> None:
        """Called after each checkpoint written."""

    def on_train_end(self, trainer: Any, result: Any) -> None:
        """Called once when ``fit`` returns."""


class FileCallback(Callback):
    """A callback holding files open: ``close`` (idempotent) runs when ``fit`` ends, also
    when it raises, so nothing written is left in a buffer."""

    def close(self) -> None:
        """Close what the callback holds open."""

    def on_train_end(self, trainer: Any, result: Any) -> None:
        self.close()


def perplexity(loss: float) -> float:
    """``exp(loss)``, the perplexity of a mean cross-entropy in nats (``inf`` on overflow,
    NaN for a NaN loss)."""
    if math.isnan(loss):
        return math.nan
    return math.exp(loss) if loss < 709.0 else math.inf


class MetricsLogger(FileCallback):
    """Writes ``metrics.jsonl`` and ``metrics.csv`` in ``folder``: a training record every
    ``log_every`` steps (and at the last step) and every evaluation record.

    A ``fit`` that starts past step 0 (resumed, or a second ``fit`` of the same trainer)
    keeps the records up to ``trainer.start_step`` and appends after them; one that
    starts at step 0 starts both files afresh."""

    def __init__(self, folder: str | os.PathLike, log_every: int = 1) -> None:
        self.folder = Path(folder)
        self.log_every = log_every
        self.writer: MetricsWriter | None = None

    def on_train_begin(self, trainer: Any) -> None:
        start = trainer.start_step
        self.writer = MetricsWriter(
            self.folder, start if start > 0 else None, notify=lambda m: trainer.say(f"warning: {m}")
        )

    def on_step_end(self, trainer: Any, logs: dict[str, Any]) -> None:
        if logs["step"] % self.log_every == 0 or logs["step"] == trainer.max_steps:
            self._write(dict(logs, throughput=round(logs["throughput"], 1)))

    def on_eval(self, trainer: Any, logs: dict[str, Any]) -> None:
        self._write({k: logs[k] for k in ("step", "val_loss", "val_ppl", "elapsed")})

    def _write(self, record: dict[str, Any]) -> None:
        if self.writer is not None:
            self.writer.write(dict(record, elapsed=round(record["elapsed"], 3)))

    def on_train_end(self, trainer: Any, result: Any) -> None:
        self.close()
        result.metrics = self.folder / JSONL_NAME
        result.metrics_csv = self.folder / CSV_NAME

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class LossPlot(Callback):
    """Draws ``loss.png`` from the run's ``metrics.jsonl`` when training ends."""

    def __init__(self, metrics: str | os.PathLike, path: str | os.PathLike, unit: str) -> None:
        self.metrics = Path(metrics)
        self.path = Path(path)
        self.unit = unit

    def on_train_end(self, trainer: Any, result: Any) -> None:
        result.plot = plot_losses(
            read_metrics(self.metrics),
            self.path,
            unit=self.unit,
            notify=lambda m: print(m, file=trainer.out),
        )


class TextSample(Callback):
    """Prints a text sample of a language model after each evaluation whose step is a
    multiple of ``every`` (with ``every`` equal to the evaluation interval: at each one).

    ``generate(step) -> str`` makes the text (e.g. ``model.generate`` and a decoder);
    the model is put in evaluation mode around the call.
    """

    def __init__(self, generate: Callable[[int], str], every: int) -> None:
        self.generate = generate
        self.every = every

    def on_eval(self, trainer: Any, logs: dict[str, Any]) -> None:
        if logs["step"] % self.every:
            return
        trainer._set_mode(False)
        try:
            text = self.generate(logs["step"])
        finally:
            trainer._set_mode(True)
        trainer.say(f"sample at step {logs['step']}: {text!r}")


class TensorBoardLogger(FileCallback):
    """Writes TensorBoard event files into ``log_dir``: ``train/loss``, ``train/lr``,
    ``train/grad_norm``, ``train/throughput``, ``val/loss`` and ``val/perplexity``.

    The writer is ``tensorboardX``'s ``SummaryWriter`` or, without it,
    ``torch.utils.tensorboard``'s; neither installed is a ``ConfigError`` naming the
    extra to install. A resumed run purges the events past its step.
    """

    def __init__(self, log_dir: str | os.PathLike) -> None:
        self.log_dir = Path(log_dir)
        self.writer_class = summary_writer_class()
        self.writer: Any = None

    def on_train_begin(self, trainer: Any) -> None:
        resumed = trainer.resumed_from
        self.writer = self.writer_class(
            str(self.log_dir), purge_step=None if resumed is None else resumed + 1
        )

    def on_step_end(self, trainer: Any, logs: dict[str, Any]) -> None:
        step = logs["step"]
        for key in ("loss", "lr", "grad_norm", "throughput"):
            value = logs["train_loss" if key == "loss" else key]
            if value is not None:
                self.writer.add_scalar(f"train/{key}", value, step)

    def on_eval(self, trainer: Any, logs: dict[str, Any]) -> None:
        self.writer.add_scalar("val/loss", logs["val_loss"], logs["step"])
        self.writer.add_scalar("val/perplexity", logs["val_ppl"], logs["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def summary_writer_class() -> Any:
    """``SummaryWriter`` of ``tensorboardX``, else of ``torch.utils.tensorboard``."""
    from ..errors import ConfigError

    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                "TensorBoard logging needs tensorboardX (pip install tensorboardX) or "
                "PyTorch with tensorboard (pip install torch tensorboard)"
            ) from None
    return SummaryWriter
