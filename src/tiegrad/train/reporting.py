"""What the ``Trainer`` reports: its lines, the built-in callbacks, evaluation records.

Everything the loop reports goes through callbacks (``tiegrad.train.callbacks``): the
metrics files, TensorBoard, samples and the loss plot are callbacks like the user's.
The built-in ones run on rank 0 alone in a data-parallel run (one run folder), as do
the trainer's printed lines; the user's callbacks run on every rank.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .callbacks import Callback, LossPlot, MetricsLogger, perplexity
from .progress import Progress


class Reporting:
    """The ``Trainer``'s reporting methods (a mixin of ``Trainer``, whose attributes
    they read)."""

    def say(self, text: str) -> None:
        """Print a line to the trainer's output, above the progress bar when one is shown
        (rank 0 alone in a data-parallel run)."""
        if not self.main:
            return
        if self._progress is not None:
            self._progress.message(text, self.out)
        else:
            print(text, file=self.out)

    def _start_reporting(self, latest: Path | None) -> Progress:
        """Set up the callbacks of this ``fit`` (the built-in ones around the user's) and
        its progress display, and say where a resumed run (from ``latest``) starts."""
        before, after = self._builtin_callbacks()
        self._active = [*before, *self.callbacks, *after]
        unit = getattr(self.train_data, "unit", "samples")
        progress = Progress(self.max_steps, self.step, unit, self.progress_enabled and self.main)
        self._progress = progress
        if self.resumed_from is not None:
            self.say(f"resumed from step {self.resumed_from} ({latest})")
        return progress

    def _builtin_callbacks(self) -> tuple[list[Callback], list[Callback]]:
        """The callbacks before and after the user's: metrics first, the plot last."""
        if self.run is None or not self.main:
            return [], []
        after: list[Callback] = []
        if self.plot_enabled:
            unit = "token" if getattr(self.train_data, "unit", "") == "tokens" else "sample"
            unit = self.extra.get("loss_unit", unit)
            after.append(LossPlot(self.run.metrics_path, self.run.plot_path, unit))
        return [MetricsLogger(self.run.path, self.log_every)], after

    def _eval_and_track(self, train_loss: float | None, last: dict[str, Any]) -> None:
        """Evaluate, track the best loss and the evaluations without improvement (a loss
        that is not finite never improves), report it and write ``best`` on improvement."""
        val = self.evaluate()
        if val is None:
            return
        improved = math.isfinite(val) and (
            self.best_val is None or val < self.best_val - self.min_delta
        )
        if improved:
            self.best_val = val
            self.bad_evals = 0
        else:
            self.bad_evals += 1
        last["val"] = (val, self.step)
        ppl = perplexity(val)
        logs = {
            "step": self.step,
            "val_loss": val,
            "val_ppl": ppl,
            "best": improved,
            "elapsed": self._elapsed(),
        }
        mark = " (best)" if improved else ""
        tl = "" if train_loss is None else f"train {train_loss:.4f}  "
        self.say(f"step {self.step:>6}  {tl}val {val:.4f}  ppl {ppl:.2f}{mark}")
        for cb in self._active:
            cb.on_eval(self, logs)
        if improved and self.run is not None:
            self.save_checkpoint(self.run.best_path)  # rank 0 writes
            self._wait_for_main()

    def _report(self, result: Any) -> None:
        """After ``fit``: how to resume an interrupted run, and a warning for a final
        validation loss that is not finite."""
        if not self.main:
            return
        if result.status == "interrupted":
            hint = self.resume_hint or (
                f"Trainer(..., run_dir={str(self.run.path)!r}, resume=True).fit()"
                if self.run is not None
                else "(no run folder: nothing was saved)"
            )
            where = f" checkpoint {result.checkpoint};" if result.checkpoint else ""
            print(f"interrupted at step {result.step};{where} resume with: {hint}", file=self.out)
        if result.val_loss is not None and not math.isfinite(result.val_loss):
            print(f"warning: the final validation loss is {result.val_loss}", file=self.out)
