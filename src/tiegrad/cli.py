"""The ``tiegrad`` command: ``train``, ``sample``, ``inspect``, ``resume`` and ``export``.

``tiegrad train`` with no arguments is the main job: a character ``TiedLM`` trained
on the running interpreter's standard-library source (no download). It prints the
resolved configuration first and a summary at the end. Bad input (a missing or
empty text file, an unknown config key, a value out of range, a run folder holding
another model's checkpoint, a damaged checkpoint) is one line on stderr,
``tiegrad: error: ...``, and exit code 2; Ctrl-C (SIGINT) or SIGTERM during training
writes a checkpoint and exits with code 130 (143 for SIGTERM) after printing how to
resume.

A new run without ``--run`` gets ``runs/<date-time>``, and ``runs/latest`` points to
the newest run (a symbolic link where the platform has them); ``tiegrad sample`` and
``tiegrad resume`` without a run folder take that newest run.

On several processes (``torchrun --nproc-per-node N -m tiegrad train ...``, or
``tiegrad train --nproc N``) every rank trains on its shard of each global batch
(``tiegrad.distributed``) and rank 0 alone prints and writes the run folder.
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from .backend.tuning import tune_process
from .errors import CheckpointError, ConfigError, TiegradError

if TYPE_CHECKING:
    import subprocess

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143
RUNS = "runs"
LATEST = "latest"

#: flag -> config key, for the flags that override a configuration key.
FLAGS: dict[str, str] = {
    "--text": "text",
    "--vocab": "vocab",
    "--corpus-chars": "corpus_chars",
    "--val-fraction": "val_fraction",
    "--init": "init",
    "--d-model": "d_model",
    "--layers": "n_layers",
    "--heads": "n_heads",
    "--seq-len": "seq_len",
    "--mlp-ratio": "mlp_ratio",
    "--dropout": "dropout",
    "--steps": "steps",
    "--batch-size": "batch_size",
    "--grad-accum": "grad_accum",
    "--lr": "lr",
    "--min-lr": "min_lr",
    "--warmup-steps": "warmup_steps",
    "--warmup-ratio": "warmup_ratio",
    "--weight-decay": "weight_decay",
    "--clip-norm": "clip_norm",
    "--eval-every": "eval_every",
    "--eval-batches": "eval_batches",
    "--sample-every": "sample_every",
    "--log": "log",
    "--checkpoint-every": "checkpoint_every",
    "--keep-last": "keep_last",
    "--patience": "patience",
    "--seed": "seed",
    "--device": "device",
    "--run": "run",
}


_METAVARS = {
    "text": "FILE",
    "init": "DIR",
    "run": "DIR",
    "vocab": "{char,byte}",
    "log": "{tensorboard}",
}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        _fail(f"{message} (see '{self.prog} --help')")


def _fail(message: str) -> NoReturn:
    """Exit with ``EXIT_BAD_INPUT`` after one line on stderr; of a data-parallel launch's
    ranks, which all fail the same way (same command line and configuration), rank 0
    alone prints the line, the others exit with the same code in silence."""
    if _main_process():
        print(f"tiegrad: error: {message}", file=sys.stderr)
    raise SystemExit(EXIT_BAD_INPUT)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .train.config import DEFAULTS, HELP

    parser = _Parser(
        prog="tiegrad",
        description="Train and sample tied-weight language models with tiegrad.",
    )
    parser.add_argument("--version", action="version", version=f"tiegrad {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    train = sub.add_parser(
        "train",
        help="train a TiedLM (default: on the Python standard library's source)",
        description="Train a TiedLM. Precedence: defaults < --config FILE.toml < flags.",
    )
    train.add_argument("--config", metavar="FILE.toml", help="TOML file of config keys")
    for flag, key in FLAGS.items():
        kind = type(DEFAULTS[key])
        # an empty default is described by the help text itself ("empty: ...")
        shown = "" if DEFAULTS[key] == "" else f" (default: {DEFAULTS[key]})"
        train.add_argument(
            flag,
            dest=key,
            type=kind,
            default=None,
            metavar=_METAVARS.get(key, flag[2:].upper().replace("-", "_")),
            help=f"{HELP[key]}{shown}",
        )
    _add_no_progress(train)
    _add_nproc(train)
    train.add_argument(
        "--run-dir",
        dest="run",
        default=None,
        metavar="DIR",
        help="the same as --run (torchrun's own parser takes '--run' for '--run-path')",
    )

    sample = sub.add_parser("sample", help="generate text from a run's best checkpoint")
    sample.add_argument(
        "--run", metavar="DIR", help=f"run folder, its best checkpoint (default: {RUNS}/{LATEST})"
    )
    sample.add_argument("--checkpoint", metavar="FILE", help="a checkpoint file instead")
    sample.add_argument("--prompt", default="", help="text to continue (default: none)")
    sample.add_argument("--tokens", type=int, default=200, help="tokens to generate (default: 200)")
    sample.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="sampling temperature; 0 is greedy (default: 0.8)",
    )
    sample.add_argument(
        "--top-k", type=int, default=None, help="sample among the k most likely (default: all)"
    )
    sample.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")

    inspect = sub.add_parser("inspect", help="describe a checkpoint file")
    inspect.add_argument("file", metavar="FILE", help="a .safetensors checkpoint")

    resume = sub.add_parser("resume", help="continue a run from its latest checkpoint")
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
    _add_no_progress(resume)
    _add_nproc(resume)
    _add_export(sub)
    return parser


def _add_nproc(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        metavar="N",
        help="train on N local processes (data parallel, started through torchrun)",
    )


def _add_export(sub: Any) -> None:
    export = sub.add_parser(
        "export", help="write a GPT-2 run or checkpoint as a Hugging Face model directory"
    )
    export.add_argument("source", metavar="RUN_OR_CHECKPOINT", help="run folder or checkpoint")
    export.add_argument("dir", metavar="DIR", help="output directory")
    export.add_argument("--format", choices=["hf"], default="hf", help="output format (hf)")


def _add_no_progress(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-progress",
        dest="progress",
        action="store_const",
        const=False,
        default=None,
        help="hide the progress bar",
    )


def main(
    argv: Sequence[str] | None = None, precompiling: subprocess.Popen[str] | None = None
) -> int:
    """Run the command line; returns the exit code (0, 2 bad input, 130 interrupted,
    143 terminated). Ctrl-C at any point (the imports included) exits quietly with 130.

    ``precompiling``: the child process compiling the kernels (``_tiegrad_launcher``,
    ``tiegrad.train.precompile``): a thread watches it (``Precompiling``) while the
    run steps on NumPy code with the kernels' bits, switching to the kernels as it
    compiles them; the command waits for it after a run that succeeded, and stops it
    where it ends otherwise."""
    from .train import precompile

    compiling = precompile.Precompiling(precompiling)
    try:
        code = _main(argv)
        if code == 0:
            compiling.finish()
        return code
    except KeyboardInterrupt:
        if _main_process():
            print("tiegrad: aborted", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        compiling.stop()


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _unknown_arguments(parser, args.command, unknown)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_BAD_INPUT
    commands = {
        "train": _train,
        "sample": _sample,
        "inspect": _inspect,
        "resume": _resume,
        "export": _export,
    }
    try:
        if getattr(args, "nproc", None) is not None:
            return _relaunch(args.nproc, sys.argv[1:] if argv is None else argv)
        tune_process()  # the command owns its process (tiegrad.backend.tuning)
        return commands[args.command](args)
    except TiegradError as e:
        _fail(_one_line(e))
    except OSError as e:
        _fail(f"{e.strerror or e}: {e.filename}" if e.filename else str(e))


def _unknown_arguments(
    parser: argparse.ArgumentParser, command: str | None, unknown: list[str]
) -> NoReturn:
    """One line naming the unknown arguments, the closest option and the right help."""
    sub = _subparser(parser, command)
    target = sub or parser
    options = [o for action in target._actions for o in action.option_strings]
    flag = next((a.split("=", 1)[0] for a in unknown if a.startswith("-")), None)
    close = difflib.get_close_matches(flag, options, n=1) if flag else []
    hint = f"; did you mean {close[0]}?" if close else ""
    _fail(f"unrecognized arguments: {' '.join(unknown)}{hint} (see '{target.prog} --help')")


def _subparser(
    parser: argparse.ArgumentParser, command: str | None
) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return None


def _relaunch(nproc: int, argv: Sequence[str]) -> int:
    from .distributed.group import in_launcher_environment
    from .distributed.launch import relaunch, without_flag

    if nproc < 1:
        _fail(f"--nproc must be >= 1, got {nproc}")
    if in_launcher_environment():
        _fail("--nproc starts the processes itself: leave it out under torchrun")
    return relaunch(nproc, without_flag(argv, "--nproc"))


def _one_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else type(error).__name__
    return text if len(lines) <= 1 else f"{text} (+{len(lines) - 1} more lines)"


# -- train / resume ------------------------------------------------------------------------
def _train(args: argparse.Namespace) -> int:
    from .train.config import DEFAULTS, resolve

    overrides = {k: getattr(args, k) for k in DEFAULTS if getattr(args, k, None) is not None}
    labels = {key: flag for flag, key in FLAGS.items()}
    config = resolve(args.config, overrides, labels)
    _join_group(config)
    if not config["run"]:
        config["run"] = _agree(_fresh_run_folder())
    return _run_job(config, resume=False)


def _join_group(config: dict[str, Any]) -> None:
    """Under torchrun, join the process group before anything else (see the docstring)."""
    from .distributed.launch import join_if_launched

    join_if_launched(None if config["device"] == "cpu" else config["device"])


def _agree(value: Any) -> Any:
    from .distributed.group import agree

    return agree(value)


def _main_process() -> bool:
    from .distributed.group import is_main

    return is_main()


def _resume(args: argparse.Namespace) -> int:
    """Continue a run from its latest checkpoint. A finished run (its step count reached)
    and one that stopped early (its patience used up, ``Trainer``) take no step: the
    command says so and how to extend it (``--steps``, ``--patience``) and changes
    nothing, as it changes nothing when the checkpoint is refused."""
    from .train.config import DEFAULTS, check_config, check_value
    from .train.rundir import RunDir
    from .train.trainer import patience_exhausted

    if args.patience is not None:
        check_value("patience", args.patience, label="--patience")
    folder = args.run if args.run is not None else _newest_run()
    run = RunDir(folder)
    config = run.read_config()
    if "steps" in config:  # compared below, before check_config sees it
        check_value("steps", config["steps"], where=str(run.config_path))
    found = run.step_checkpoints()
    if not found and run.best_path.is_file():
        raise ConfigError(_best_only(run))
    if not found:
        raise ConfigError(f"run folder {folder!r} has no checkpoint to resume from")
    reached = found[-1][0]
    if args.steps is not None and args.steps < reached:
        raise ConfigError(
            f"--steps {args.steps} is below the step run {folder!r} already reached "
            f"({reached}); give a total above {reached} to extend it"
        )
    steps = args.steps if args.steps is not None else config.get("steps", reached)
    if steps <= reached:
        if _main_process():
            print(
                f"run {folder} is finished: it reached step {reached} of {steps}; extend it "
                f"with 'tiegrad resume {_quote(folder)} --steps {2 * reached}' (a new total)"
            )
        return 0
    config = {**DEFAULTS, **config, "run": folder, "steps": steps}
    if args.progress is not None:
        config["progress"] = args.progress
    if args.patience is not None:
        config["patience"] = args.patience
    config.pop("text_sha256", None)
    vocab = config.pop("vocab_table", None)
    config = check_config(config)
    schema = _checkpoint_schema(found[-1][1])
    extra = schema.extra
    state = extra.get("trainer") if isinstance(extra, dict) else None
    bad = state.get("bad_evals") if isinstance(state, dict) else None
    patience = config["patience"]
    if isinstance(bad, int) and patience_exhausted(bad, patience or None):
        if _main_process():
            print(
                f"run {folder} stopped early at step {reached}: no improvement in {bad} "
                f"evaluations (patience {patience}); continue it with 'tiegrad resume "
                f"{_quote(folder)} --patience {bad + patience}' (a larger patience; 0 never "
                "stops early)"
            )
        return 0
    _join_group(config)
    return _run_job(config, resume=True, vocab=vocab, stored_schedule=schema.schedule)


def _fresh_run_folder() -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = os.path.join(RUNS, stamp)
    path, n = base, 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}"
    return path


def _point_latest(folder: str) -> None:
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


def _newest_run() -> str:
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


def _run_job(
    config: dict[str, Any], resume: bool, vocab: Any = None, stored_schedule: Any = None
) -> int:
    """Train (``resume``: continue) the run ``config`` describes; ``vocab``: the run's
    stored vocabulary, ``stored_schedule``: its latest checkpoint's schedule state (printed,
    as the run keeps it). Returns the exit code."""
    from .data import tokenizer_from_dict
    from .train.job import (
        build_dataset,
        build_init,
        build_model,
        build_optimizer,
        load_text,
        model_config,
    )
    from .train.rundir import RunDir
    from .train.trainer import Trainer

    run = RunDir(config["run"])
    source = load_text(config)
    vocab = tokenizer_from_dict(vocab) if vocab else None
    if config["init"]:  # resumed: the checkpoint's model (the --init folder may have moved)
        stored = _stored_gpt2(run.latest(), "resume")[0] if resume else None
        model, dataset = build_init(config, source, vocab, stored)
    else:
        dataset = build_dataset(config, source, vocab)
        model = build_model(model_config(config, dataset.vocab_size))
    if not resume:
        _check_fresh_run_folder(run, model.config)
    optimizer, schedule = build_optimizer(config, model)
    unit = dataset.vocab.unit
    extra = {
        "model": {"class": type(model).__name__, "config": model.config},
        "vocab": dataset.vocab.to_dict(),
        "loss_unit": unit,
    }
    if config["init"]:
        extra["hf_config"] = model.source_config
    main_process = _main_process()
    callbacks = []
    if main_process:
        text = os.path.abspath(config["text"]) if config["text"] else ""
        init = os.path.abspath(config["init"]) if config["init"] else ""
        saved = dict(
            config,
            text=text,
            init=init,
            vocab_table=dataset.vocab.to_dict(),
            text_sha256=source.sha256,
        )
        callbacks = [_config_writer(run, saved), *_job_callbacks(config, run, model, dataset.vocab)]
    trainer = Trainer(
        model,
        optimizer,
        None,
        dataset.loader("train", config["batch_size"]),
        dataset.eval_batches("val", config["batch_size"], config["eval_batches"]),
        schedule,
        max_steps=config["steps"],
        grad_accum=config["grad_accum"],
        clip_norm=config["clip_norm"] or None,
        eval_every=config["eval_every"],
        checkpoint_every=config["checkpoint_every"],
        keep_last=config["keep_last"],
        patience=config["patience"] or None,
        run_dir=run.path,
        resume=resume,
        seed=config["seed"],
        device=None if config["device"] == "cpu" else config["device"],
        progress=config["progress"],
        extra=extra,
        resume_hint=f"tiegrad resume {_quote(str(run.path))}",
        callbacks=callbacks,
    )
    if main_process:
        command = "resume" if resume else "train"
        _print_config(config, source.description, dataset, model, command, stored_schedule)
        if resume and run.read_config().get("text_sha256") not in (None, source.sha256):
            print("warning: the training text differs from the one this run started with")
    result = trainer.fit()
    if main_process:
        _print_summary(result, run, unit)
    if result.status != "interrupted":
        return 0
    return EXIT_TERMINATED if result.signal == signal.SIGTERM else EXIT_INTERRUPTED


def _stored_gpt2(path: Path, what: str) -> tuple[Any, Any]:
    """The ``GPT2`` a checkpoint describes (its model and transformers configurations),
    built but not loaded, and the checkpoint's ``extra``; ``what`` names the caller in
    the error for a checkpoint of another model."""
    from .train.job import build_model

    extra = _checkpoint_extra(path)
    kwargs = _model_config(extra)
    if kwargs is None or extra["model"].get("class") != "GPT2":
        raise ConfigError(f"{path}: {what} needs a GPT2 checkpoint (from 'tiegrad train --init')")
    model = build_model(dict(kwargs), "GPT2")
    model.source_config = extra.get("hf_config") or {}
    return model, extra


def _config_writer(run: Any, config: dict[str, Any]) -> Any:
    """A callback writing ``config`` as the run's ``config.json`` and pointing
    ``runs/latest`` at the run when training begins: after a resumed run's checkpoint
    loaded, so a refused checkpoint leaves the run folder as it was."""
    from .train.callbacks import Callback

    class ConfigWriter(Callback):
        def on_train_begin(self, trainer: Any) -> None:
            run.write_config(config)
            _point_latest(str(run.path))

    return ConfigWriter()


def _default_prompt(vocab: Any) -> str:
    """The prompt of a sample without ``--prompt``: a newline when the vocabulary holds
    one, else its first character (a character vocabulary of a text without newlines)."""
    chars = getattr(vocab, "chars", "")
    return "\n" if not chars or "\n" in chars else chars[0]


def _job_callbacks(config: dict[str, Any], run: Any, model: Any, vocab: Any) -> list[Any]:
    """TensorBoard (``--log tensorboard``) and text samples (``--sample-every``)."""
    import numpy as np

    from .train.callbacks import TensorBoardLogger, TextSample

    callbacks: list[Any] = []
    if config["log"] == "tensorboard":
        callbacks.append(TensorBoardLogger(run.path / "tensorboard"))
    if config["sample_every"]:
        prompt = vocab.encode(_default_prompt(vocab))[None, :]

        def generate(step: int) -> str:
            rng = np.random.default_rng(step)
            out = model.generate(prompt, 80, temperature=0.8, rng=rng)
            return vocab.decode(np.asarray(out)[0][1:])

        callbacks.append(TextSample(generate, config["sample_every"]))
    return callbacks


def _check_fresh_run_folder(run: Any, kwargs: dict[str, Any]) -> None:
    """A new run never reuses a folder that holds checkpoints (of this model or another):
    the ``ConfigError`` says whose they are and what to do (resume only where a periodic
    checkpoint exists)."""
    latest = run.existing_checkpoint()
    if latest is None:
        return
    stored = _checkpoint_model(latest)
    if stored != kwargs:
        raise ConfigError(
            f"run folder {str(run.path)!r} holds a checkpoint of another model "
            f"({_model_difference(stored, kwargs)}): choose another --run"
        )
    if run.latest() is None:
        raise ConfigError(_best_only(run))
    raise ConfigError(
        f"run folder {str(run.path)!r} already holds this run's checkpoints: continue it "
        f"with 'tiegrad resume {run.path}' or choose another --run"
    )


def _best_only(run: Any) -> str:
    """The error for a run folder holding ``best.safetensors`` but no periodic checkpoint
    (its run stopped before the first): ``resume`` has nothing to continue and ``train``
    would overwrite the best, so both refuse it and say what to do."""
    return (
        f"run folder {str(run.path)!r} holds best.safetensors but no periodic checkpoint "
        "(step_*.safetensors) to resume from: its run stopped before the first one; move "
        "the folder away to train it again, or train with another --run"
    )


def _checkpoint_schema(path: Path) -> Any:
    from .checkpoint import Schema
    from .checkpoint.fileio import read_safetensors

    return Schema.parse(read_safetensors(os.fspath(path)))


def _checkpoint_extra(path: Path) -> Any:
    return _checkpoint_schema(path).extra


def _checkpoint_model(path: Path) -> Any:
    return _model_config(_checkpoint_extra(path))


def _model_config(extra: Any) -> Any:
    """The model constructor arguments stored in a checkpoint's ``extra`` (or ``None``)."""
    model = extra.get("model") if isinstance(extra, dict) else None
    if not isinstance(model, dict) or not isinstance(model.get("config"), dict):
        return None
    return model["config"]


def _model_difference(stored: Any, kwargs: dict[str, Any]) -> str:
    """How the model of a checkpoint (its constructor arguments ``stored``) differs from
    the one a run builds (``kwargs``): the keys that differ, with both values."""
    if not isinstance(stored, dict):
        return "the checkpoint holds no tiegrad language model"
    keys = [*kwargs, *(k for k in stored if k not in kwargs)]
    differ = [k for k in keys if stored.get(k) != kwargs.get(k)]
    return (
        f"the checkpoint's {' '.join(f'{k}={stored.get(k)}' for k in differ)}; "
        f"this run's {' '.join(f'{k}={kwargs.get(k)}' for k in differ)}"
    )


def _quote(path: str) -> str:
    return path if all(c.isalnum() or c in "/._-" for c in path) else repr(path)


def _print_config(
    config: dict[str, Any],
    text: str,
    dataset: Any,
    model: Any,
    command: str,
    schedule: Any = None,
) -> None:
    """Print the resolved configuration. ``schedule``: a resumed run's stored schedule
    state, whose warmup and length are printed (the run keeps them, whatever ``steps``
    now is); else they follow from ``config``."""
    from .train.config import DEFAULTS, warmup_steps

    unique = model.num_parameters()
    c = config
    warmup, length = warmup_steps(c), c["steps"]
    if isinstance(schedule, dict) and all(
        type(schedule.get(k)) is int for k in ("warmup_steps", "total_steps")
    ):  # a malformed state prints the configured one; the checkpoint's load refuses it
        warmup, length = schedule["warmup_steps"], schedule["total_steps"]
    kept = ""
    if length != c["steps"]:
        kept = f"; the run keeps its schedule of {length} steps"
        if length < c["steps"]:
            kept += f" (steps {length + 1}-{c['steps']} at min_lr)"
    print(f"tiegrad {command}: resolved configuration")
    print(
        f"  data     {text}; vocab {dataset.vocab.kind if c['init'] else c['vocab']} "
        f"({dataset.vocab_size} symbols); "
        f"train {len(dataset.train):,} / val {len(dataset.val):,} tokens"
    )
    if c["init"]:
        print(f"  model    {model.label()} from {c['init']}; {unique:,} parameters")
    else:
        print(
            f"  model    TiedLM d_model={c['d_model']} n_layers={c['n_layers']} "
            f"n_heads={c['n_heads']} seq_len={c['seq_len']} mlp_ratio={c['mlp_ratio']} "
            f"dropout={c['dropout']}; {unique:,} parameters (embedding tied to the output)"
        )
    print(
        f"  optim    AdamW lr={c['lr']:g} min_lr={c['min_lr']:g} "
        f"warmup={warmup} "
        f"weight_decay={c['weight_decay']:g} clip_norm={c['clip_norm']:g}{kept}"
    )
    print(
        f"  train    steps={c['steps']} batch_size={c['batch_size']} "
        f"grad_accum={c['grad_accum']} seed={c['seed']} device={c['device']}"
    )
    print(
        f"  run      {c['run']} (eval every {c['eval_every']}, checkpoint every "
        f"{c['checkpoint_every']}, keep {c['keep_last']})"
    )
    changed = sorted(k for k in DEFAULTS if c[k] != DEFAULTS[k] and k != "run")
    if changed:
        print(f"  changed  {', '.join(f'{k}={c[k]}' for k in changed)}")
    sys.stdout.flush()


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(seconds, 60)
    return f"{int(minutes)}m{seconds:04.1f}s"


def _print_summary(result: Any, run: Any, unit: str) -> None:
    verb = {"completed": "done", "early_stopped": "stopped early", "interrupted": "interrupted"}
    line = f"{verb[result.status]}: {result.step} steps in {_clock(result.elapsed)}"
    if result.resumed_from is not None:
        line += (
            f" in all (this process: {result.process_steps} steps from step "
            f"{result.resumed_from} in {_clock(result.process_elapsed)})"
        )
    print(line)
    if result.status == "interrupted" and result.train_loss is not None:
        loss, step = result.train_loss, result.train_loss_step
        print(f"last train loss: {loss:.4f} nats/{unit} (step {step})")
    if result.val_loss is not None:
        best = "" if result.best_val_loss is None else f" (best {result.best_val_loss:.4f})"
        at = f" at step {result.val_loss_step}" if result.val_loss_step != result.step else ""
        print(f"final validation loss: {result.val_loss:.4f} nats/{unit}{at}{best}")
    print(f"checkpoint: {result.checkpoint}")
    if result.best_checkpoint is not None:
        print(f"best:       {result.best_checkpoint}")
    print(f"metrics:    {result.metrics}, {result.metrics_csv}")
    if result.plot is not None:
        print(f"plot:       {result.plot}")
    if result.status != "interrupted":
        print(f"sample:     tiegrad sample --run {_quote(str(run.path))}")
    if (run.path / "tensorboard").is_dir():
        print(f"tensorboard: tensorboard --logdir {_quote(str(run.path / 'tensorboard'))}")


# -- sample / inspect ----------------------------------------------------------------------
def _sample(args: argparse.Namespace) -> int:
    import numpy as np

    from .checkpoint import load
    from .data import tokenizer_from_dict
    from .train.config import check_value
    from .train.job import build_model
    from .train.rundir import RunDir

    if args.tokens < 1:
        raise ConfigError(f"--tokens must be >= 1, got {args.tokens}")
    if not args.temperature >= 0:
        raise ConfigError(f"--temperature must be >= 0 (0 is greedy), got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        raise ConfigError(f"--top-k must be >= 1, got {args.top_k}")
    check_value("seed", args.seed, label="--seed")
    if args.run is not None and args.checkpoint is not None:
        raise ConfigError("sample: give one of --run DIR and --checkpoint FILE, not both")
    if args.checkpoint is not None:
        path = Path(args.checkpoint)
        if not path.is_file():
            raise ConfigError(f"checkpoint {args.checkpoint!r} does not exist or is not a file")
    else:
        folder = args.run if args.run is not None else _newest_run()
        found = RunDir(folder).best_or_latest()
        if found is None:
            raise ConfigError(f"run folder {folder!r} holds no checkpoint")
        path = found
    schema = _checkpoint_schema(path)
    extra = schema.extra
    kwargs = _model_config(extra)
    if kwargs is None or not isinstance(extra.get("vocab"), dict):
        raise ConfigError(f"{path}: not a checkpoint of 'tiegrad train' (no model or vocab)")
    vocab = tokenizer_from_dict(extra["vocab"])
    prompt = args.prompt or _default_prompt(vocab)
    try:
        ids = vocab.encode(prompt)[None, :]
    except ConfigError as e:
        raise ConfigError(f"--prompt {args.prompt!r}: {e}") from None
    model_class = extra["model"].get("class", "TiedLM")
    model = build_model(
        _sample_model_config(path, schema, kwargs, vocab.size, model_class), model_class
    )
    load(path, model)
    model.eval()
    rng = np.random.default_rng(args.seed)
    out = model.generate(ids, args.tokens, temperature=args.temperature, rng=rng, top_k=args.top_k)
    text = vocab.decode(np.asarray(out)[0])
    print(text if args.prompt else text[1:])
    return 0


def _sample_model_config(
    path: Path, schema: Any, kwargs: Any, vocab_size: int, model_class: str
) -> dict[str, Any]:
    """The file's model configuration, checked completely before anything is built (C6).

    The model class's ``check_config`` checks its keys, types and ranges; then the slot count,
    parameter count and bytes it implies must be the file's own (so a configuration
    cannot make ``tiegrad sample`` allocate more than the file holds), and its
    ``vocab_size`` the stored vocabulary's. Any mismatch is a ``CheckpointError``.
    """
    import math

    import numpy as np

    from . import models
    from .checkpoint.schema import nbytes

    where = f"checkpoint {path}"
    if model_class not in ("TiedLM", "GPT2"):
        raise CheckpointError(f"{where}: unknown model class {model_class!r:.80}")
    cls = getattr(models, model_class)
    try:
        config = cls.check_config(kwargs)
    except TiegradError as e:
        raise CheckpointError(f"{where}: invalid model configuration: {e}") from None
    slots, elements = cls.layout_size(config)
    implied = (slots, elements, elements * np.dtype(config["dtype"]).itemsize)
    stored = [s for i, s in enumerate(schema.slots) if s.storage == i]
    held = (len(schema.slots), sum(math.prod(s.shape) for s in stored), sum(map(nbytes, stored)))
    if implied != held:
        raise CheckpointError(
            f"{where}: the model configuration implies {implied[0]} slots and {implied[1]:,} "
            f"parameters ({implied[2]:,} bytes); the file holds {held[0]} slots and "
            f"{held[1]:,} parameters ({held[2]:,} bytes)"
        )
    if config["vocab_size"] < vocab_size or (
        model_class == "TiedLM" and config["vocab_size"] != vocab_size
    ):
        raise CheckpointError(
            f"{where}: the model's vocab_size is {config['vocab_size']}, the stored "
            f"vocabulary has {vocab_size} symbols"
        )
    return config


def _inspect(args: argparse.Namespace) -> int:
    from .checkpoint import inspect

    if not os.path.isfile(args.file):
        raise ConfigError(f"checkpoint {args.file!r} does not exist or is not a file")
    print(inspect(args.file))
    return 0


# -- export --------------------------------------------------------------------------------
def _export(args: argparse.Namespace) -> int:
    """Write a ``GPT2`` run's best (else latest) checkpoint, or a checkpoint file, as a
    transformers directory: ``config.json``, ``model.safetensors`` and the tokenizer files."""
    from .checkpoint import load
    from .data import HFTokenizer, tokenizer_from_dict
    from .train.rundir import RunDir

    source = Path(args.source)
    if source.is_dir():
        path = RunDir(source).best_or_latest()
        if path is None:
            raise ConfigError(f"run folder {args.source!r} holds no checkpoint")
    elif source.is_file():
        path = source
    else:
        raise ConfigError(f"{args.source!r} is neither a run folder nor a checkpoint file")
    model, extra = _stored_gpt2(path, "export --format hf")
    load(path, model)
    tokenizer = tokenizer_from_dict(extra["vocab"]) if "vocab" in extra else None
    model.save_pretrained(args.dir)
    if isinstance(tokenizer, HFTokenizer):
        tokenizer.save(args.dir)
    print(f"exported {path} to {args.dir} (GPT2LMHeadModel.from_pretrained loads it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
