"""``Trainer``: the training loop over an eager session, with a run folder.

One step draws ``grad_accum`` batches, records each on a fresh tape of one
``EagerSession``, sums the gradients per storage across the batches (C4), clips them
(optional), lets the optimizer update each storage once from its current value (C3)
and advances the schedule. Around the steps the loop evaluates every ``eval_every``
steps, stops early when validation stops improving, and checkpoints every
``checkpoint_every`` steps keeping the last ``keep_last`` plus the best, and returns a
``TrainResult`` (``result``). Its parts: argument checks (``arguments``), checkpoints
and exact resumption (``checkpointing``), reporting through callbacks (``reporting``,
``callbacks``), Ctrl-C and SIGTERM (``signals``).

Reproducibility: ``seed`` seeds both generators the trainer owns, the data generator
(batch order, window offsets) and the session generator (dropout); the model seeds
its own initialization. A resumed run continues exactly where its checkpoint was taken.

Data parallel: with a ``tiegrad.distributed`` group initialised (or ``parallel`` given)
every rank runs this loop on its shard of each global batch; the gradients are
averaged over the ranks before clipping (``DataParallel.average``; a sharded one,
``DataParallel(shard=...)``, steps each rank's partition and gathers the optimizer
state for checkpoints), a signal on any
rank stops all of them after the same step, and rank 0 alone prints, runs the
built-in callbacks and writes checkpoints. Every rank must be started alike: the start
check compares positions, generators, data length, run length and optimizer settings,
and a sharded validation loader's loss is averaged over the ranks.
"""

from __future__ import annotations

import inspect
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from ..data.loader import Batch, BatchSource, check_positive
from ..distributed.parallel import default_parallel
from ..errors import ConfigError
from ..optim.clip import clip_grad_norm
from ..session import EagerSession
from . import arguments
from .arguments import LossFn, scalar_loss
from .callbacks import Callback, FileCallback
from .checkpointing import (
    Checkpointing,
    _jumped,  # noqa: F401 (imported from here by the tests)
    check_run_folder,
    derive_seeds,
    rng_state,
    set_rng_state,
)
from .config import TrainConfig
from .memory import peak_memory
from .progress import Progress
from .reporting import Reporting
from .result import STATUSES, TrainResult
from .rundir import RunDir
from .signals import SIGNALS, Interrupt

__all__ = [
    "SIGNALS",
    "STATUSES",
    "LossFn",
    "TrainResult",
    "Trainer",
    "derive_seeds",
    "patience_exhausted",
    "rng_state",
    "set_rng_state",
]


def patience_exhausted(bad_evals: int, patience: int | None) -> bool:
    """Whether ``bad_evals`` evaluations without improvement use up ``patience``
    (``None``: early stopping is off): a run in that state has stopped early."""
    return patience is not None and bad_evals >= patience


def _accumulate(total: list[Any], new: list[Any], made: set[int]) -> list[Any]:
    """``total + new`` per slot, None counted as zeros (a micro-batch that did not use a
    storage). A slot's first addition makes a new array (listed in ``made``) and later
    ones add into it, so the arrays the optimizer handed out are never written."""
    for i, g in enumerate(new):
        if g is None:
            continue
        if total[i] is None:
            total[i] = g
        elif i in made:
            total[i] += g
        else:
            total[i] = total[i] + g
            made.add(i)
    return total


class Trainer(Checkpointing, Reporting):
    """Train ``model`` with ``optimizer`` on batches of ``train_data``.

    ``loss_fn(session, batch)`` records the loss of one batch and returns the scalar
    ``TensorRef`` (default: ``model.loss(session, *batch)``). ``train_data`` is a batch
    source (``tiegrad.data.BatchSource``: ``TextDataset.loader(...)``, ``DataLoader``),
    ``val_data`` a batch source or a fixed list of batches (``TextDataset.eval_batches``);
    the validation loss is the mean over its batches.

    Length: ``max_steps`` optimizer steps, or ``epochs`` passes over ``train_data``.
    ``grad_accum`` batches make one step (their losses averaged). ``clip_norm`` clips
    the global gradient norm (each storage counted once). ``eval_every`` and
    ``checkpoint_every`` are in steps; a final evaluation and checkpoint always run.

    Early stopping: ``patience`` evaluations without an improvement of more than
    ``min_delta`` stop the run. A loss that is not finite never improves: it never
    becomes ``best_val`` (so every checkpoint holds a finite one) and counts towards
    ``patience``, as NaN does for PyTorch's ``ReduceLROnPlateau`` and Keras's
    ``EarlyStopping``. A run whose patience is used up is finished: ``fit`` takes no
    step and returns ``status == "early_stopped"``, unless ``patience`` was raised above
    its evaluations without improvement (or turned off).

    With ``run_dir`` the trainer writes metrics, checkpoints and the plot there;
    ``resume=True`` continues from its latest periodic checkpoint when there is one (a
    folder without any starts a new run). A run is never silently overwritten: a folder
    holding a checkpoint with ``resume=False`` is a ``ConfigError``, and so is one
    holding ``best.safetensors`` but no periodic checkpoint with ``resume=True`` (that
    run cannot be continued and restarting it would overwrite its best, as a missing
    Lightning ``ckpt_path`` is an error rather than a restart). ``fit`` called again
    (e.g. after raising ``max_steps``) continues from the step it reached, appending to
    the metrics files; ``elapsed`` goes on counting. ``extra`` is stored in every
    checkpoint. ``callbacks`` (``tiegrad.train.Callback``) are called in list order at
    each step, evaluation, checkpoint and at the end, between the built-in metrics
    writer and the loss plot.

    ``recompute=True`` (``config.recompute``) calls the model's
    ``gradient_checkpointing_enable()`` (as transformers'
    ``TrainingArguments(gradient_checkpointing=True)`` does): each block is recomputed in
    backward instead of kept, with the same gradients (``tiegrad.nn.checkpoint``). Every
    step's record also carries the process's peak memory so far, ``peak_rss_mb`` and, on a
    CUDA device, ``device_peak_mb`` (``tiegrad.train.memory``).

    Settings: ``config`` (a ``TrainConfig``) holds them all, as ``tiegrad train`` passes
    them; or the keywords ``max_steps``/``epochs`` through ``progress`` describe them
    (``None`` turning a setting off), and the trainer makes its ``TrainConfig`` from
    them. The two do not mix: with ``config`` every setting keyword keeps its default.
    ``trainer.config`` is the configuration in force; raising ``max_steps`` replaces it.

    Bad settings raise ``ConfigError`` in the constructor, before anything runs or the
    model is changed (C6).
    """

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        loss_fn: LossFn | None = None,
        train_data: BatchSource | None = None,
        val_data: BatchSource | Sequence[Batch] | None = None,
        schedule: Any = None,
        *,
        config: TrainConfig | None = None,
        max_steps: int | None = None,
        epochs: int | None = None,
        grad_accum: int = 1,
        clip_norm: float | None = None,
        eval_every: int | None = None,
        checkpoint_every: int | None = None,
        keep_last: int = 3,
        patience: int | None = None,
        min_delta: float = 0.0,
        run_dir: str | Path | None = None,
        resume: bool = False,
        seed: int = 0,
        device: str | None = None,
        log_every: int = 1,
        progress: bool = True,
        plot: bool = True,
        extra: dict[str, Any] | None = None,
        resume_hint: str | None = None,
        out: TextIO | None = None,
        callbacks: Sequence[Callback] = (),
        parallel: Any = None,
        recompute: bool = False,
    ) -> None:
        arguments.check_data(train_data, val_data)
        arguments.check_optimizer(optimizer)
        given = locals()  # the setting keywords as passed (arguments.SETTING_KEYWORDS)
        settings = {name: given[name] for name in arguments.SETTING_KEYWORDS}
        if config is None:
            config = arguments.keyword_config(settings, len(train_data))
        else:
            arguments.check_config_alone(config, settings, _SETTING_DEFAULTS)
        if config.patience and val_data is None:
            raise ConfigError("Trainer: early stopping (patience) needs val_data")
        self.log_every = check_positive("Trainer: log_every", log_every)
        callbacks = arguments.callback_list(callbacks)
        extra = arguments.checked_extra(extra)
        arguments.check_callbacks(callbacks)
        loss_fn = arguments.loss_fn_of(model, loss_fn)
        arguments.check_recompute(model, config.recompute)
        self.config = config
        self.grad_accum = config.grad_accum
        self.eval_every = config.eval_every or None
        self.checkpoint_every = config.checkpoint_every or None
        self.keep_last = config.keep_last
        self.patience = config.patience or None
        self.clip_norm = config.clip_norm or None
        self.min_delta = config.min_delta
        self.seed = config.seed
        self.progress_enabled = config.progress
        self.model = model
        self.optimizer = optimizer
        self.schedule = schedule
        self.loss_fn = loss_fn
        self.train_data = train_data
        self.val_data = val_data
        self.run = RunDir(config.run) if config.run else None
        self.resume = resume
        self.plot_enabled = plot
        self.extra = extra
        self.resume_hint = resume_hint
        self.out = out if out is not None else sys.stdout
        self.callbacks = callbacks
        self.resumed_from: int | None = None
        #: the step the current (or last) ``fit`` started from: 0 for a new run.
        self.start_step = 0
        self._progress: Progress | None = None
        data_seed, session_seed = derive_seeds(config.seed)
        self.data_rng = np.random.default_rng(data_seed)
        self.session = EagerSession(
            device=None if config.device == "cpu" else config.device, seed=session_seed
        )
        self._own_stream = False  # whether this rank's session generator is its own yet
        self.step = 0
        self.epoch = 0
        self.batches_in_epoch = 0
        self.epoch_start_state = rng_state(self.data_rng)
        self.best_val: float | None = None
        self.bad_evals = 0
        self.elapsed_before = 0.0
        self._epoch_iter: Iterator[Batch] | None = None
        if self.run is not None:
            check_run_folder(self.run, resume)
        self.parallel = parallel if parallel is not None else default_parallel(model)
        self.main = self.parallel is None or self.parallel.is_main
        self.recompute = config.recompute
        if config.recompute:
            model.gradient_checkpointing_enable()

    @property
    def max_steps(self) -> int:
        """The step count the run goes to (``config.steps``)."""
        return self.config.steps

    @max_steps.setter
    def max_steps(self, steps: int) -> None:
        """Raise (or lower) the step count; a later ``fit`` continues to it. Checked as
        ``TrainConfig.steps`` is: a bad value is a ``ConfigError`` and changes nothing."""
        self.config = self.config.replace(steps=steps)

    # -- data ------------------------------------------------------------------------
    def _next_batch(self) -> Batch:
        """The next batch; a source's epoch that ends early ends the epoch, and one that
        yields no batch at all is a ``ConfigError`` (a new epoch would yield none either)."""
        while True:
            fresh = self._epoch_iter is None
            if fresh:
                self._epoch_iter = self.train_data.epoch(self.data_rng)
            batch = next(self._epoch_iter, None)
            if batch is not None:
                self.batches_in_epoch += 1
                if self.batches_in_epoch >= len(self.train_data):
                    self._end_epoch()
                return batch
            if fresh:
                self._epoch_iter = None
                raise ConfigError(
                    f"Trainer: train_data's epoch {self.epoch} yielded no batch (its len() is "
                    f"{len(self.train_data)}); epoch(rng) must return a new iterator each call"
                )
            self._end_epoch()

    def _end_epoch(self) -> None:
        self._epoch_iter = None
        self.epoch += 1
        self.batches_in_epoch = 0
        self.epoch_start_state = rng_state(self.data_rng)

    # -- one step ----------------------------------------------------------------------
    def _set_mode(self, training: bool) -> None:
        fn = getattr(self.model, "train" if training else "eval", None)
        if callable(fn):
            fn()

    def train_step(self) -> tuple[float, float | None, int]:
        """One optimizer step; returns (mean loss, gradient norm or None, items seen).

        Each of the ``grad_accum`` batches is recorded on a fresh tape and its
        gradients are summed per canonical slot (``optimizer.canonical_gradients``:
        the uses of one storage summed, C4), so only one tape is alive at a time. Data
        parallel: one batch is averaged over the ranks by ``DataParallel.backward``
        (during the sweep), several after the last one, and ``DataParallel.step`` clips
        and updates (sharded: each rank its partition). A storage some batches (or
        ranks) did not use gets the sum (or mean) of the others; one that no batch of
        the step used is the optimizer's ``MissingGradientError`` in one process.
        """
        s = self.session
        total = 0.0
        items = 0
        scale = 1.0 / self.grad_accum
        grads: list[Any] | None = None
        made: set[int] = set()
        for _ in range(self.grad_accum):
            batch = self._next_batch()
            items += self.train_data.count(batch)
            s.reset()
            loss = scalar_loss(self.loss_fn(s, batch))
            total += float(loss.item())
            if self.grad_accum > 1:
                loss = loss * scale
            elif self.parallel is not None:
                grads = self.parallel.backward(s, loss, self.optimizer)
                continue
            new = self.optimizer.canonical_gradients(
                s.backward(loss), allow_missing=self.grad_accum > 1
            )
            grads = new if grads is None else _accumulate(grads, new, made)
        if self.parallel is not None and self.grad_accum > 1:
            grads = self.parallel.average(grads)
        s.reset()  # nothing pins the storages any more: the update is written in place
        if self.parallel is not None:
            norm = self.parallel.step(self.optimizer, grads, self.clip_norm)
        else:
            norm = None if self.clip_norm is None else clip_grad_norm(grads, self.clip_norm)
            self.optimizer.step(grads)
        if self.schedule is not None:
            self.schedule.step()
        self.step += 1
        return total * scale, norm, items

    def evaluate(self) -> float | None:
        """The mean loss over ``val_data`` without gradients (``None`` without val data).

        Data-parallel with a sharded source (a ``DataLoader``: each rank evaluates its
        shard of every batch), the mean over the ranks: every rank gets the value one
        process would, within rounding, and makes the same decisions with it.
        """
        if self.val_data is None:
            return None
        batches: Any = self.val_data
        if isinstance(batches, BatchSource):
            batches = batches.epoch(np.random.default_rng(0))
        s = self.session
        self._set_mode(False)
        losses = []
        try:
            with s.no_grad():
                for batch in batches:
                    s.reset()
                    losses.append(float(scalar_loss(self.loss_fn(s, batch)).item()))
        finally:
            s.reset()
            self._set_mode(True)
        if not losses:
            raise ConfigError("Trainer: val_data yields no batch")
        loss = float(np.mean(losses))
        if self.parallel is not None and getattr(self.val_data, "shard", None) is not None:
            loss = self.parallel.mean(loss, "the validation loss all-reduce")  # each its shard
        return loss

    def current_lr(self) -> float | None:
        groups = getattr(self.optimizer, "param_groups", None)
        if groups:
            return float(groups[0]["lr"])
        return None

    # -- the loop ------------------------------------------------------------------------
    _active: Sequence[Callback] = ()

    def fit(self) -> TrainResult:
        """Run until ``max_steps``, early stopping, Ctrl-C or SIGTERM; see the class docstring."""
        self._at_step = self.step + 1  # a failure's step: the one running, or just done
        try:
            return self._fit()
        except BaseException as e:
            if self.parallel is not None:
                self.parallel.fail(e, self._at_step)
            raise
        finally:  # a later fit goes on counting from here, idle time left out
            now = time.perf_counter()
            self.elapsed_before += now - self._t0
            self._t0 = now

    def _fit(self) -> TrainResult:
        self._t0 = time.perf_counter()
        latest = self._resume_latest()
        self._start_ranks()
        self.start_step = first_step = self.step
        progress = self._start_reporting(latest)
        status = "completed"
        finished_early = patience_exhausted(self.bad_evals, self.patience)
        if finished_early:
            status = "early_stopped"
            self.say(
                f"the run stopped early at step {self.step}: no improvement in "
                f"{self.bad_evals} evaluations (patience {self.patience}); it takes no step "
                f"unless patience is raised above {self.bad_evals}"
            )
        last: dict[str, Any] = {"train": None, "val": None}
        last_saved = self.resumed_from
        rate: float | None = None
        self._set_mode(True)
        stop_signal: int | None = None
        try:
            for cb in self._active:
                cb.on_train_begin(self)
            with Interrupt(self.main) as interrupt:
                while not finished_early and self.step < self.max_steps:
                    lr = self.current_lr()
                    started = time.perf_counter()
                    self._at_step = self.step + 1  # a failure from here is this step's
                    train_loss, norm, items = self.train_step()
                    stop_signal = interrupt.signal
                    if self.parallel is not None:
                        # every rank stops on the signal agreed here, never on its own
                        # flag: a signal that arrives later is agreed on at the next step
                        train_loss, items, stop_signal = self.parallel.end_step(
                            self.step, train_loss, items, interrupt.signal
                        )
                    step_rate = items / max(time.perf_counter() - started, 1e-9)
                    rate = step_rate if rate is None else 0.9 * rate + 0.1 * step_rate
                    progress.update(train_loss, lr, rate)
                    last["train"] = (train_loss, self.step)
                    logs = {
                        "step": self.step,
                        "train_loss": train_loss,
                        "lr": lr,
                        "grad_norm": norm,
                        "throughput": step_rate,
                        "elapsed": self._elapsed(),
                        **peak_memory(self.session.backend),
                    }
                    for cb in self._active:
                        cb.on_step_end(self, logs)
                    stop = False
                    if self.eval_every is not None and self.step % self.eval_every == 0:
                        self._eval_and_track(train_loss, last)
                        stop = patience_exhausted(self.bad_evals, self.patience)
                    if self.checkpoint_every is not None and self.step % self.checkpoint_every == 0:
                        last_saved = self._save_periodic()
                    if stop:
                        status = "early_stopped"
                        self.say(
                            f"early stop at step {self.step}: no improvement in "
                            f"{self.patience} evaluations"
                        )
                        break
                    if stop_signal is not None:
                        status = "interrupted"
                        break
                if (  # a resumed run that was already finished takes no step: no eval
                    status != "interrupted"
                    and self.step > first_step
                    and self.val_data is not None
                    and (self.eval_every is None or self.step % self.eval_every != 0)
                ):
                    self._eval_and_track(None if last["train"] is None else last["train"][0], last)
                if last_saved != self.step:
                    self._save_periodic()
                if self.parallel is not None and self.step > first_step:
                    self.parallel.check_parameters(self.step)  # the ranks end alike
        finally:
            progress.close()
            self._progress = None
            for cb in self._active:
                if isinstance(cb, FileCallback):
                    cb.close()
        result = self._finish(status, last, first_step, stop_signal)
        for cb in self._active:
            cb.on_train_end(self, result)
        self._active = ()
        self._report(result)
        return result

    def _elapsed(self) -> float:
        return self.elapsed_before + (time.perf_counter() - self._t0)

    def _finish(
        self, status: str, last: dict[str, Any], first_step: int, signum: int | None
    ) -> TrainResult:
        train = last["train"] or (None, None)
        val = last["val"] or (None, None)
        result = TrainResult(
            step=self.step,
            status=status,
            elapsed=self._elapsed(),
            train_loss=train[0],
            val_loss=val[0],
            best_val_loss=self.best_val,
            resumed_from=self.resumed_from,
            process_elapsed=time.perf_counter() - self._t0,
            process_steps=self.step - first_step,
            train_loss_step=train[1],
            val_loss_step=val[1],
            signal=signum,
        )
        if self.run is not None:
            result.checkpoint = self.run.latest()
            result.best_checkpoint = self.run.best_path if self.run.best_path.is_file() else None
        return result


#: The defaults of the ``Trainer``'s setting keywords (``arguments.SETTING_KEYWORDS``).
_SETTING_DEFAULTS = {
    name: parameter.default
    for name, parameter in inspect.signature(Trainer.__init__).parameters.items()
    if name in arguments.SETTING_KEYWORDS
}
