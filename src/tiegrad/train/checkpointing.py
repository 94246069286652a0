"""The ``Trainer``'s checkpoints: the run state they hold, and resuming exactly.

A checkpoint holds the model, optimizer, schedule and session generator (C9) and, in
``extra["trainer"]``, the trainer's position: step, epoch, batches consumed in the
epoch, the data generator's state when the epoch began, the early-stopping counters,
the elapsed seconds and the seed. Loading checks that state with everything else
before anything is applied (C6); the epoch is then replayed up to the batches already
consumed, so a resumed run draws the batches (and dropout masks) an uninterrupted one
would have. Generator states are stored as JSON, their big integers as decimal strings.

Data parallel: rank 0 alone writes checkpoints (a sharded run's optimizer state gathered
from every rank first), the other ranks wait at a barrier;
every rank loads rank 0's generator state and then jumps it to its own stream.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..distributed.group import barrier
from ..errors import CheckpointError, ConfigError
from .rundir import RunDir


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


def check_run_folder(run: RunDir, resume: bool) -> None:
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


class Checkpointing:
    """The ``Trainer``'s checkpoint and resume methods (a mixin of ``Trainer``, whose
    attributes they read and restore)."""

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
        """Write model, optimizer, schedule, trainer state and ``extra`` to ``path``.

        In a sharded data-parallel run every rank calls it (the optimizer state is
        gathered from all of them) and rank 0 alone writes the file (C9)."""
        optimizer = self.optimizer
        if self.parallel is not None:
            optimizer = self.parallel.checkpoint_optimizer(optimizer)
            if not self.main:
                return Path(path)
        return self._write_checkpoint(path, optimizer)

    def _write_checkpoint(self, path: str | Path, optimizer: Any) -> Path:
        from ..checkpoint import save

        extra = dict(self.extra)
        extra["trainer"] = self._trainer_state()
        save(
            path,
            self.model,
            optimizer=optimizer,
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

    def _resume_latest(self) -> Path | None:
        """Create the run folder (if any) and, with ``resume``, load its latest periodic
        checkpoint; returns that checkpoint, or ``None`` for a new run."""
        if self.run is None:
            return None
        self.run.create()
        latest = self.run.latest() if self.resume else None
        if latest is not None:
            self.load_checkpoint(latest)
            self.resumed_from = self.step
            self._t0 = time.perf_counter()
        return latest

    def _restore_data_position(self) -> None:
        """Replay the current epoch up to the batches it had consumed."""
        set_rng_state(self.data_rng, self.epoch_start_state)
        self._epoch_iter = self.train_data.epoch(self.data_rng)
        for _ in range(self.batches_in_epoch):
            if next(self._epoch_iter, None) is None:
                raise CheckpointError(
                    f"trainer state: {self.batches_in_epoch} batches consumed in an epoch of "
                    f"{len(self.train_data)}: the data differs from the checkpointed run"
                )

    def _save_periodic(self) -> int | None:
        """Write the checkpoint of this step into the run folder (if any) and prune the old
        ones; returns the step saved (``None`` without a run folder)."""
        if self.run is None:
            return None
        self.save_checkpoint(self.run.step_path(self.step))  # rank 0 writes
        if self.main:
            self.run.prune(self.keep_last)
        self._wait_for_main()
        return self.step

    def _wait_for_main(self) -> None:
        if self.parallel is not None:
            barrier()

    # -- data-parallel start ---------------------------------------------------------------
    def _start_ranks(self) -> None:
        """Data parallel: check that every rank starts alike, then give each its stream."""
        if self.parallel is not None:
            self.parallel.start(self._trainer_state() | self._run_settings())
            self._own_session_stream()

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
