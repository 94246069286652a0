"""``Trainer``: the training loop over an eager session, with a run folder.

One step draws ``grad_accum`` batches, records each on a fresh tape of one
``EagerSession``, sums the gradients per storage (C4) across the batches, clips
them (optional), lets the optimizer update each storage once from its current value
(C3) and advances the schedule. Around that loop the trainer evaluates every
``eval_every`` steps, writes metrics (``metrics.jsonl``, ``metrics.csv``), shows a
progress bar, saves checkpoints every ``checkpoint_every`` steps keeping the last
``keep_last`` plus the best, stops early when validation stops improving, and plots
``loss.png`` at the end.

Reproducibility: ``seed`` seeds both generators the trainer owns, the data
generator (batch order, window offsets) and the session generator (dropout); the
model seeds its own initialization. A checkpoint stores both generators' states,
the data position (epoch, batches consumed) and the counters, so a resumed run
continues exactly where the checkpoint was taken.

Ctrl-C (SIGINT) or SIGTERM (what schedulers, containers and ``kill`` send) during
``fit`` finishes the current step, writes a checkpoint and returns a result with
``status == "interrupted"`` and ``signal`` set; a second signal aborts at once.

What the loop reports goes through callbacks (``tiegrad.train.callbacks``): the
metrics files, TensorBoard, samples and the loss plot are callbacks like the user's.

Data parallel: with a ``tiegrad.distributed`` group initialised (or ``parallel`` given)
every rank runs this loop on its shard of each global batch; the gradients are
averaged over the ranks before clipping (``DataParallel.average``), a signal on any
rank stops all of them after the same step, and rank 0 alone prints, runs the
built-in callbacks (metrics, plot) and writes checkpoints while the others wait at a
barrier; the user's callbacks run on every rank. Each rank draws its own dropout
masks (``_own_session_stream``). Every rank must be started alike: the start check
compares positions, generators, data length, run length and optimizer settings, and
a sharded validation loader's loss is averaged over the ranks.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from ..data.loader import Batch, BatchSource, check_positive
from ..distributed.group import barrier
from ..distributed.parallel import default_parallel
from ..errors import CheckpointError, ConfigError
from ..optim.clip import clip_grad_norm
from ..session import EagerSession, TensorRef
from .callbacks import Callback, FileCallback, LossPlot, MetricsLogger, perplexity
from .progress import Progress
from .rundir import RunDir

LossFn = Callable[[EagerSession, Batch], TensorRef]
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


def derive_seeds(seed: int) -> tuple[int, int]:
    """The seeds of a run's data generator and session generator, derived from ``seed``."""
    data_seed, session_seed = np.random.SeedSequence(seed).generate_state(2)
    return int(data_seed), int(session_seed)


def rng_state(rng: np.random.Generator) -> dict[str, Any]:
    """A generator's state as JSON-safe data (its big integers as decimal strings)."""

    def enc(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: enc(x) for k, x in v.items()}
        if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
            return str(int(v))
        return v

    return enc(rng.bit_generator.state)


def set_rng_state(rng: np.random.Generator, state: Any) -> None:
    """Restore a state written by ``rng_state``; a malformed one is a ``CheckpointError``."""

    def dec(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: dec(x) for k, x in v.items()}
        if isinstance(v, str) and v.lstrip("-").isdigit():
            return int(v)
        return v

    try:
        rng.bit_generator.state = dec(state)
    except (TypeError, ValueError, KeyError) as e:
        raise CheckpointError(f"trainer state: bad generator state ({e})") from None


def patience_exhausted(bad_evals: int, patience: int | None) -> bool:
    """Whether ``bad_evals`` evaluations without improvement use up ``patience``
    (``None``: early stopping is off): a run in that state has stopped early."""
    return patience is not None and bad_evals >= patience


def _model_loss(model: Any) -> LossFn:
    """The default loss function: ``model.loss(session, *batch)``."""

    def loss_fn(session: EagerSession, batch: Batch) -> TensorRef:
        return model.loss(session, *batch)

    return loss_fn


def _jumped(bit_generator: Any, jumps: int) -> Any:
    """``bit_generator.jumped(jumps)`` with the buffered half-output it had restored.

    A float32 draw (dropout's masks) takes half of a 64-bit output and keeps the other
    half for the next; ``jumped`` drops that half. The jumped stream's own half is the
    upper half of its previous output: stepping back one output and reading it again
    leaves the state where it was, with the half that the stream drawn step by step
    would hold (PCG64's state fields; other generators are jumped as they are).
    """
    out = bit_generator.jumped(jumps)
    state = bit_generator.state
    if state.get("has_uint32") and state.get("bit_generator") in ("PCG64", "PCG64DXSM"):
        out.advance(-1)
        raw = int(out.random_raw())
        new = out.state
        new["has_uint32"], new["uinteger"] = 1, raw >> 32
        out.state = new
    return out


def _length(obj: Any) -> int | None:
    """``len(obj)``, or None for an object without a length."""
    try:
        return len(obj)
    except TypeError:
        return None


def _scalar_loss(loss: Any) -> TensorRef:
    """``loss`` when it is one number recorded on the tape; else a ``ConfigError`` naming
    ``loss_fn`` (a float has no gradient, a per-sample loss needs a reduction)."""
    if not isinstance(loss, TensorRef):
        raise ConfigError(
            f"Trainer: loss_fn must return the loss as a TensorRef of the session, got "
            f"{type(loss).__name__}"
        )
    if loss.size != 1:
        raise ConfigError(
            f"Trainer: loss_fn must return one number, got shape {tuple(loss.shape)} (reduce "
            "it, e.g. with ops.mean)"
        )
    return loss


def _check_batches(batches: Sequence[Any]) -> None:
    """A list of validation batches: at least one, each a tuple (or list) of arrays."""
    if not batches:
        raise ConfigError("Trainer: val_data is an empty list; give None or at least one batch")
    for i, batch in enumerate(batches):
        if not isinstance(batch, (tuple, list)):
            raise ConfigError(
                f"Trainer: val_data[{i}] is a {type(batch).__name__}, expected a batch (a tuple "
                "of arrays); for one batch (x, y) pass [(x, y)]"
            )


def _checked_extra(extra: Any) -> dict[str, Any]:
    """``extra`` as a dict that a checkpoint can store (JSON), without the key
    ``"trainer"`` that the trainer's own state takes."""
    if extra is None:
        return {}
    if not isinstance(extra, dict):
        raise ConfigError(f"Trainer: extra must be a dict or None, got {type(extra).__name__}")
    if "trainer" in extra:
        raise ConfigError("Trainer: extra['trainer'] is reserved for the trainer's own state")
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"Trainer: extra is not JSON-serializable: {e}") from None
    return dict(extra)


def _accumulate(total: list[Any], new: list[Any], owned: set[int]) -> list[Any]:
    """``total + new`` per slot, None counted as zeros (a micro-batch that did not use a
    storage). A slot's first addition makes a new array (listed in ``owned``) and later
    ones add into it, so the arrays the optimizer handed out are never written."""
    for i, g in enumerate(new):
        if g is None:
            continue
        if total[i] is None:
            total[i] = g
        elif i in owned:
            total[i] += g
        else:
            total[i] = total[i] + g
            owned.add(i)
    return total


SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Interrupt:
    """SIGINT and SIGTERM during ``fit``: the first sets a flag (the loop finishes its step
    and checkpoints), a second aborts (``KeyboardInterrupt``). The handlers are installed
    only for the duration of ``fit`` and only on the main thread. ``announce``: whether
    the first says so on stderr (rank 0 alone in a data-parallel run: torchrun passes
    the signal to every rank)."""

    def __init__(self, announce: bool = True) -> None:
        self.announce = announce
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Interrupt:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signum
        if self.announce:
            name = signal.Signals(signum).name
            print(
                f"\n{name}: finishing the current step, then saving a checkpoint", file=sys.stderr
            )

    def __exit__(self, *exc: Any) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def _check_run_folder(run: RunDir, resume: bool) -> None:
    """``run`` fits ``resume`` (see ``Trainer``); else a ``ConfigError`` naming the file."""
    found = run.existing_checkpoint()
    where = repr(str(run.path))
    if found is not None and not resume:
        raise ConfigError(
            f"run folder {where} already holds checkpoints ({found.name}); resume it "
            "(resume=True) or choose another folder"
        )
    if found is not None and run.latest() is None:
        raise ConfigError(
            f"run folder {where} holds {found.name} but no periodic checkpoint "
            "(step_*.safetensors) to resume from: the run stopped before its first one, "
            f"and starting again would overwrite {found.name}; move it away or choose "
            "another folder"
        )


class Trainer:
    """Train ``model`` with ``optimizer`` on batches of ``train_data``.

    ``loss_fn(session, batch)`` records the loss of one batch and returns the scalar
    ``TensorRef``; it defaults to ``model.loss(session, *batch)``. ``train_data`` is a
    batch source (``tiegrad.data.BatchSource``: ``TextDataset.loader(...)``,
    ``DataLoader``). ``val_data`` is a batch source or a fixed list of batches (e.g.
    ``TextDataset.eval_batches``); the validation loss is the mean over its batches.

    Length: ``max_steps`` optimizer steps, or ``epochs`` passes over ``train_data``.
    ``grad_accum`` batches make one step (their losses averaged). ``clip_norm`` clips
    the global gradient norm (each storage counted once). ``eval_every`` and
    ``checkpoint_every`` are in steps; a final evaluation and checkpoint always run.
    ``patience`` stops after that many evaluations without an improvement of more
    than ``min_delta``. A validation loss that is not finite (NaN, infinity) is never
    an improvement: it never becomes the best (``best_val`` keeps the previous best, or
    ``None``, so every checkpoint holds a finite one) and counts towards ``patience``
    like any evaluation that does not improve (as PyTorch's ``ReduceLROnPlateau`` and
    Keras's ``EarlyStopping`` treat NaN). A run whose patience is used up has stopped
    early and is finished: ``fit`` on it (resumed, or called again) takes no step and
    returns ``status == "early_stopped"``, unless ``patience`` was raised above the
    evaluations without improvement (or turned off).

    With ``run_dir`` the trainer writes metrics, checkpoints and the plot there;
    ``resume=True`` continues from its latest periodic checkpoint when there is one (a
    folder without any checkpoint starts a new run). A folder holding a checkpoint,
    periodic or ``best.safetensors``, with ``resume=False`` is a ``ConfigError`` (a run
    is never silently overwritten); so is one holding ``best.safetensors`` but no
    periodic checkpoint with ``resume=True`` (a run stopped before its first periodic
    checkpoint cannot be continued, and restarting it would overwrite that best, as a
    PyTorch Lightning ``ckpt_path`` that is not there is an error rather than a restart).
    Calling ``fit`` again (e.g. after raising ``max_steps``) continues the run from the
    step it reached: the metrics files are appended to and ``elapsed`` goes on counting.
    ``extra`` is stored in every checkpoint.
    ``callbacks`` (``tiegrad.train.Callback`` instances) are called in list order at each
    step, evaluation, checkpoint and at the end, between the built-in metrics writer and
    the loss plot.

    Bad settings raise ``ConfigError`` in the constructor, before anything runs.
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
    ) -> None:
        if train_data is None or not isinstance(train_data, BatchSource):
            raise ConfigError(
                "Trainer: train_data must be a batch source with epoch(rng), len() and "
                f"count(batch) (e.g. TextDataset.loader), got {type(train_data).__name__}"
            )
        if len(train_data) < 1:
            raise ConfigError("Trainer: train_data yields no batch")
        if val_data is not None and not isinstance(val_data, (BatchSource, list, tuple)):
            raise ConfigError(
                "Trainer: val_data must be None, a batch source or a list of batches, got "
                f"{type(val_data).__name__}"
            )
        if isinstance(val_data, (list, tuple)):
            _check_batches(val_data)
        for method in ("step", "canonical_gradients"):
            if not callable(getattr(optimizer, method, None)):
                raise ConfigError(
                    f"Trainer: the optimizer must be a tiegrad optimizer (with {method}()), got "
                    f"{type(optimizer).__name__}"
                )
        if (max_steps is None) == (epochs is None):
            raise ConfigError("Trainer: give exactly one of max_steps and epochs")
        self.grad_accum = check_positive("Trainer: grad_accum", grad_accum)
        if max_steps is not None:
            self.max_steps = check_positive("Trainer: max_steps", max_steps)
        else:
            epochs = check_positive("Trainer: epochs", epochs)
            self.max_steps = max(1, epochs * len(train_data) // self.grad_accum)
        self.eval_every = None if eval_every is None else check_positive("eval_every", eval_every)
        self.checkpoint_every = (
            None
            if checkpoint_every is None
            else check_positive("checkpoint_every", checkpoint_every)
        )
        self.keep_last = check_positive("Trainer: keep_last", keep_last)
        self.log_every = check_positive("Trainer: log_every", log_every)
        self.patience = None if patience is None else check_positive("Trainer: patience", patience)
        if patience is not None and val_data is None:
            raise ConfigError("Trainer: early stopping (patience) needs val_data")
        if clip_norm is not None and (
            isinstance(clip_norm, bool)
            or not isinstance(clip_norm, (int, float))
            or not 0 < clip_norm < math.inf
        ):
            raise ConfigError(
                f"Trainer: clip_norm must be a finite number > 0 or None, got {clip_norm!r}"
            )
        if not (isinstance(min_delta, (int, float)) and min_delta >= 0):
            raise ConfigError(f"Trainer: min_delta must be a number >= 0, got {min_delta!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ConfigError(f"Trainer: seed must be an integer >= 0, got {seed!r}")
        if not isinstance(callbacks, (list, tuple)):
            raise ConfigError(
                f"Trainer: callbacks must be a list of Callbacks, got {type(callbacks).__name__}"
            )
        callbacks = list(callbacks)
        if run_dir is not None and not isinstance(run_dir, (str, os.PathLike)):
            raise ConfigError(
                f"Trainer: run_dir must be a str, os.PathLike or None, got {type(run_dir).__name__}"
            )
        extra = _checked_extra(extra)
        for i, cb in enumerate(callbacks):
            if not isinstance(cb, Callback):
                raise ConfigError(
                    f"Trainer: callbacks[{i}] is a {type(cb).__name__}, expected a "
                    "tiegrad.train.Callback (override on_step_end, on_eval, on_checkpoint "
                    "or on_train_end)"
                )
        if loss_fn is None:
            if not callable(getattr(model, "loss", None)):
                raise ConfigError("Trainer: the model has no loss(); pass loss_fn")
            loss_fn = _model_loss(model)
        self.model = model
        self.optimizer = optimizer
        self.schedule = schedule
        self.loss_fn = loss_fn
        self.train_data = train_data
        self.val_data = val_data
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self.min_delta = float(min_delta)
        self.seed = seed
        self.run = RunDir(run_dir) if run_dir is not None else None
        self.resume = resume
        self.progress_enabled = progress
        self.plot_enabled = plot
        self.extra = extra
        self.resume_hint = resume_hint
        self.out = out if out is not None else sys.stdout
        self.callbacks = callbacks
        self.resumed_from: int | None = None
        #: the step the current (or last) ``fit`` started from: 0 for a new run.
        self.start_step = 0
        self._progress: Progress | None = None
        data_seed, session_seed = derive_seeds(seed)
        self.data_rng = np.random.default_rng(data_seed)
        self.session = EagerSession(device=device, seed=session_seed)
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
            _check_run_folder(self.run, resume)
        self.parallel = parallel if parallel is not None else default_parallel(model)
        self.main = self.parallel is None or self.parallel.is_main

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

    def _restore_data_position(self) -> None:
        set_rng_state(self.data_rng, self.epoch_start_state)
        self._epoch_iter = self.train_data.epoch(self.data_rng)
        for _ in range(self.batches_in_epoch):
            if next(self._epoch_iter, None) is None:
                raise CheckpointError(
                    f"trainer state: {self.batches_in_epoch} batches consumed in an epoch of "
                    f"{len(self.train_data)}: the data differs from the checkpointed run"
                )

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
        (during the sweep), several after the last one. A storage some batches (or
        ranks) did not use gets the sum (or mean) of the others; one that no batch of
        the step used is the optimizer's ``MissingGradientError`` in one process.
        """
        s = self.session
        total = 0.0
        items = 0
        scale = 1.0 / self.grad_accum
        grads: list[Any] | None = None
        owned: set[int] = set()
        for _ in range(self.grad_accum):
            batch = self._next_batch()
            items += self.train_data.count(batch)
            s.reset()
            loss = _scalar_loss(self.loss_fn(s, batch))
            total += float(loss.item())
            if self.grad_accum > 1:
                loss = loss * scale
            elif self.parallel is not None:
                grads = self.parallel.backward(s, loss, self.optimizer)
                continue
            new = self.optimizer.canonical_gradients(
                s.backward(loss), allow_missing=self.grad_accum > 1
            )
            grads = new if grads is None else _accumulate(grads, new, owned)
        if self.parallel is not None and self.grad_accum > 1:
            grads = self.parallel.average(grads)
        norm = None
        if self.clip_norm is not None:
            norm = clip_grad_norm(grads, self.clip_norm)
        s.reset()  # nothing pins the storages any more: the update is written in place
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
                    losses.append(float(_scalar_loss(self.loss_fn(s, batch)).item()))
        finally:
            s.reset()
            self._set_mode(True)
        if not losses:
            raise ConfigError("Trainer: val_data yields no batch")
        loss = float(np.mean(losses))
        if self.parallel is not None and getattr(self.val_data, "shard", None) is not None:
            loss = self.parallel.mean(loss, "the validation loss all-reduce")  # each its shard
        return loss

    def _own_session_stream(self) -> None:
        """Give this rank its own session generator (dropout masks): rank 0's stream
        jumped ``rank`` times, once per fit after construction or a checkpoint load.

        Every rank draws as many numbers per step (equal shards), and a jump commutes
        with those draws, so a resumed rank, which loads rank 0's state and jumps it,
        continues its uninterrupted stream exactly. Masks then differ between ranks, as
        they differ between the samples of one process; a run with dropout therefore
        depends on the process count.
        """
        rank = self.parallel.rank
        if rank and not self._own_stream:
            self.session.rng = np.random.Generator(_jumped(self.session.rng.bit_generator, rank))
        self._own_stream = True

    def _run_settings(self) -> dict[str, Any]:
        """What the ranks of a data-parallel run must share besides their position: the
        training data's length, batch size and sample count (where the source has them),
        the run's length, gradient accumulation and clipping, the optimizer's
        hyperparameters and the schedule's state (``elapsed`` is each rank's own)."""
        data = self.train_data
        groups = getattr(self.optimizer, "param_groups", [])
        state_of = getattr(self.schedule, "state_dict", None)
        return {
            "elapsed": None,
            "train_batches": len(data) if hasattr(data, "__len__") else None,
            "batch_size": getattr(data, "batch_size", None),
            "train_samples": _length(getattr(data, "dataset", None)),
            "max_steps": self.max_steps,
            "grad_accum": self.grad_accum,
            "clip_norm": self.clip_norm,
            "optimizer": [{k: v for k, v in g.items() if k != "params"} for g in groups],
            "schedule": state_of() if callable(state_of) else None,
        }

    def current_lr(self) -> float | None:
        groups = getattr(self.optimizer, "param_groups", None)
        if groups:
            return float(groups[0]["lr"])
        return None

    # -- checkpoints ---------------------------------------------------------------------
    def _trainer_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "epoch": self.epoch,
            "batches_in_epoch": self.batches_in_epoch,
            "epoch_start_rng": self.epoch_start_state,
            "best_val": self.best_val,
            "bad_evals": self.bad_evals,
            "elapsed": self._elapsed(),
            "seed": self.seed,
        }

    def save_checkpoint(self, path: str | Path) -> Path:
        """Write model, optimizer, schedule, trainer state and ``extra`` to ``path``."""
        from ..checkpoint import save

        extra = dict(self.extra)
        extra["trainer"] = self._trainer_state()
        save(
            path,
            self.model,
            optimizer=self.optimizer,
            schedule=self.schedule,
            extra=extra,
            rng=self.session,
        )
        for cb in self._active:
            cb.on_checkpoint(self, Path(path))
        return Path(path)

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore model, optimizer, schedule and the trainer's position from ``path``.

        All or nothing (C6): the trainer's own state is checked with everything else
        before any of it is applied; a checkpoint of another model layout or with a
        malformed trainer state is a ``CheckpointError`` and changes nothing (C9).
        """
        from ..checkpoint import load

        checked: dict[str, Any] = {}

        def check_extra(extra: Any) -> None:
            checked.update(self._checked_trainer_state(extra, path))

        load(
            path,
            self.model,
            optimizer=self.optimizer,
            schedule=self.schedule,
            rng=self.session,
            check_extra=check_extra,
        )
        self._own_stream = False  # the session generator holds rank 0's state now
        self.step, self.epoch = checked["step"], checked["epoch"]
        self.batches_in_epoch = checked["batches_in_epoch"]
        self.epoch_start_state = checked["epoch_start_rng"]
        self.best_val, self.bad_evals = checked["best_val"], checked["bad_evals"]
        self.elapsed_before = checked["elapsed"]
        self._restore_data_position()

    def _checked_trainer_state(self, extra: Any, path: str | Path) -> dict[str, Any]:
        """The trainer state in a checkpoint's ``extra``, every field checked; nothing is
        changed. Counters are integers >= 0, ``batches_in_epoch`` lies inside an epoch
        of ``train_data``, the epoch's generator state fits the data generator."""
        state = extra.get("trainer") if isinstance(extra, dict) else None
        if not isinstance(state, dict):
            raise CheckpointError(f"{path}: the checkpoint holds no trainer state")
        out: dict[str, Any] = {}
        for key in ("step", "epoch", "batches_in_epoch", "bad_evals"):
            value = state.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise CheckpointError(
                    f"{path}: malformed trainer state: {key} must be an integer >= 0, "
                    f"got {value!r:.40}"
                )
            out[key] = value
        if out["batches_in_epoch"] >= len(self.train_data):
            raise CheckpointError(
                f"{path}: trainer state: {out['batches_in_epoch']} batches consumed in an "
                f"epoch of {len(self.train_data)}: the data differs from the checkpointed run"
            )
        for key, optional in (("best_val", True), ("elapsed", False)):
            value = state.get(key)
            ok = (value is None and optional) or (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(value)
            )
            if not ok:
                raise CheckpointError(
                    f"{path}: malformed trainer state: {key} must be a finite number"
                    f"{' or null' if optional else ''}, got {value!r:.40}"
                )
            out[key] = None if value is None else float(value)
        scratch = np.random.Generator(type(self.data_rng.bit_generator)())
        set_rng_state(scratch, state.get("epoch_start_rng"))
        out["epoch_start_rng"] = state["epoch_start_rng"]
        return out

    # -- the loop ------------------------------------------------------------------------
    _active: Sequence[Callback] = ()

    def say(self, text: str) -> None:
        """Print a line to the trainer's output, above the progress bar when one is shown
        (rank 0 alone in a data-parallel run)."""
        if not self.main:
            return
        if self._progress is not None:
            self._progress.message(text, self.out)
        else:
            print(text, file=self.out)

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
        latest = None
        if self.run is not None:
            self.run.create()
            latest = self.run.latest() if self.resume else None
            if latest is not None:
                self.load_checkpoint(latest)
                self.resumed_from = self.step
                self._t0 = time.perf_counter()
        if self.parallel is not None:
            self.parallel.start(self._trainer_state() | self._run_settings())
            self._own_session_stream()
        self.start_step = first_step = self.step
        before, after = self._builtin_callbacks()
        self._active = [*before, *self.callbacks, *after]
        unit = getattr(self.train_data, "unit", "samples")
        progress = Progress(self.max_steps, self.step, unit, self.progress_enabled and self.main)
        self._progress = progress
        if self.resumed_from is not None:
            self.say(f"resumed from step {self.resumed_from} ({latest})")
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
            with _Interrupt(self.main) as interrupt:
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

    def _save_periodic(self) -> int | None:
        """Write the checkpoint of this step into the run folder (if any) and prune the old
        ones; returns the step saved (``None`` without a run folder)."""
        if self.run is None:
            return None
        if self.main:
            self.save_checkpoint(self.run.step_path(self.step))
            self.run.prune(self.keep_last)
        self._wait_for_main()
        return self.step

    def _wait_for_main(self) -> None:
        if self.parallel is not None:
            barrier()

    def _eval_and_track(self, train_loss: float | None, last: dict[str, Any]) -> None:
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
            if self.main:
                self.save_checkpoint(self.run.best_path)
            self._wait_for_main()

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

    def _report(self, result: TrainResult) -> None:
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
