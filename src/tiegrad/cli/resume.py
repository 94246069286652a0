"""``tiegrad resume``: continue a run from its latest periodic checkpoint.

The run keeps its configuration (``config.json``), vocabulary and schedule; ``--steps``
(a new total) and ``--patience`` extend a run that finished or stopped early;
``--recompute``/``--no-recompute`` switch recomputation, which changes no gradient. A run
with nothing left to do takes no step and says how to extend it. The latest checkpoint
must be the run's own (``run_match``) and the metrics files whole up to it
(``check_metrics``): otherwise the command refuses before anything is built or written
(C6). The learning-rate schedule and the optimizer's settings are the checkpoint's,
which restores them (``kept_settings``): an edit of them in ``config.json`` is named in
a notice.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import ConfigError
from ..train.config import TrainConfig
from .checkpoints import checkpoint_schema
from .exits import main_process
from .job import join_group, run_job
from .options import add_no_progress, add_nproc, add_recompute
from .report import quote
from .run_match import check_checkpoint
from .runs import LATEST, RUNS, best_only, newest_run


def add_parser(sub: Any) -> None:
    """The ``resume`` subcommand: the run folder, and what may change."""
    resume = sub.add_parser("resume", help="continue a run from its latest checkpoint")
    resume.set_defaults(handler=run)
    resume.add_argument(
        "run", metavar="DIR", nargs="?", default=None, help=f"run folder (default: {RUNS}/{LATEST})"
    )
    resume.add_argument(
        "--steps", type=int, default=None, help="new total step count (default: the run's)"
    )
    resume.add_argument(
        "--patience",
        type=int,
        default=None,
        metavar="N",
        help="new early-stopping patience, to continue a run that stopped early; 0 never "
        "stops early (default: the run's)",
    )
    resume.add_argument(
        "--shard",
        choices=("optimizer", "gradients", "none"),
        default=None,
        help="data parallel: shard the optimizer state, or also the gradients, or neither "
        "(default: the run's)",
    )
    add_recompute(resume)
    add_no_progress(resume)
    add_nproc(resume)


def run(args: argparse.Namespace) -> int:
    """Continue a run from its latest checkpoint. A finished run (its step count reached)
    and one that stopped early (its patience used up, ``Trainer``) take no step: the
    command says so and how to extend it (``--steps``, ``--patience``) and changes
    nothing, as it changes nothing when the checkpoint or the metrics files are refused
    (C6)."""
    from ..train.config import check_value
    from ..train.metrics import check_metrics
    from ..train.rundir import RUN_ID, RunDir
    from ..train.trainer import patience_exhausted

    if args.patience is not None:
        check_value("patience", args.patience, label="--patience")
    folder = args.run if args.run is not None else newest_run()
    run_dir = RunDir(folder)
    raw = run_dir.read_config()
    if "steps" in raw:  # compared below, before the configuration is checked
        check_value("steps", raw["steps"], where=str(run_dir.config_path))
    found = run_dir.step_checkpoints()
    if not found and run_dir.best_path.is_file():
        raise ConfigError(best_only(run_dir))
    if not found:
        raise ConfigError(f"run folder {folder!r} has no checkpoint to resume from")
    reached, latest = found[-1]
    if args.steps is not None and args.steps < reached:
        raise ConfigError(
            f"--steps {args.steps} is below the step run {folder!r} already reached "
            f"({reached}); give a total above {reached} to extend it"
        )
    steps = args.steps if args.steps is not None else raw.get("steps", reached)
    if steps <= reached:
        if main_process():
            print(
                f"run {folder} is finished: it reached step {reached} of {steps}; extend it "
                f"with 'tiegrad resume {quote(folder)} --steps {2 * reached}' (a new total)"
            )
        return 0
    changes: dict[str, Any] = {"run": folder, "steps": steps}
    if args.progress is not None:
        changes["progress"] = args.progress
    if args.patience is not None:
        changes["patience"] = args.patience
    if args.shard is not None:
        changes["shard"] = "" if args.shard == "none" else args.shard
    if args.recompute is not None:  # the same gradients: a resumed run may switch it
        changes["recompute"] = args.recompute
    stored = {k: v for k, v in raw.items() if k not in ("text_sha256", "vocab_table", RUN_ID)}
    config = TrainConfig.from_mapping({**stored, **changes}, where=str(run_dir.config_path))
    schema = checkpoint_schema(latest)
    run_id = check_checkpoint(run_dir.config_path, raw, config, latest, schema)
    extra = schema.extra
    state = extra.get("trainer") if isinstance(extra, dict) else None
    bad = state.get("bad_evals") if isinstance(state, dict) else None
    patience = config["patience"]
    if isinstance(bad, int) and patience_exhausted(bad, patience or None):
        if main_process():
            print(
                f"run {folder} stopped early at step {reached}: no improvement in {bad} "
                f"evaluations (patience {patience}); continue it with 'tiegrad resume "
                f"{quote(folder)} --patience {bad + patience}' (a larger patience; 0 never "
                "stops early)"
            )
        return 0
    check_metrics(run_dir.path, reached)
    kept = kept_settings(config, schema, latest)
    if kept and main_process():
        listed = ", ".join(f"{k} {v!r} ({config[k]!r} in config.json)" for k, v in kept.items())
        print(
            f"note: a resumed run keeps the learning-rate schedule and optimizer settings of "
            f"its checkpoint: {listed}"
        )
    config = config.replace(**kept)
    if run_id is None and main_process():
        print(
            f"note: run {folder} has no {RUN_ID} (it was made before run ids): its "
            "checkpoint is matched to it by model, vocabulary and LoRA specification alone"
        )
    join_group(config)
    return run_job(
        config,
        resume=True,
        vocab=raw.get("vocab_table"),
        stored_schedule=schema.schedule,
        run_id=run_id,
    )


def kept_settings(config: TrainConfig, schema: Any, path: Any) -> dict[str, Any]:
    """The settings of ``config`` that a resumed run takes from its checkpoint instead
    (``schema``, of the file at ``path``), with the checkpoint's values: the schedule's
    ``lr`` (its base learning rate), ``min_lr`` and warmup (``warmup_steps``), and the
    optimizer's ``weight_decay``, where they differ from ``config``'s. The checkpoint
    restores them, so the configuration printed and written says what the run does."""
    from ..train.config import check_value, warmup_steps

    schedule = schema.schedule if isinstance(schema.schedule, dict) else {}
    optimizer = schema.optimizer.config.get("defaults") if schema.optimizer is not None else None
    stored: dict[str, Any] = {}
    base = schedule.get("base_lrs")
    if isinstance(base, list) and len(set(base)) == 1:
        stored["lr"] = base[0]
    for key in ("min_lr", "warmup_steps"):
        if key in schedule:
            stored[key] = schedule[key]
    if isinstance(optimizer, dict) and "weight_decay" in optimizer:
        stored["weight_decay"] = optimizer["weight_decay"]
    ours = dict(config)
    if isinstance(schedule.get("total_steps"), int):  # the warmup the stored length implies
        ours["warmup_steps"] = warmup_steps({**config, "steps": schedule["total_steps"]})
    return {
        key: check_value(key, value, where=str(path))
        for key, value in stored.items()
        if value != ours[key]
    }
