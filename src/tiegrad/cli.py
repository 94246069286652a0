"""The ``tiegrad`` command: ``train``, ``sample``, ``inspect``, ``resume`` and ``export``.

``tiegrad train`` with no arguments is the main job: a character ``TiedLM`` trained
on the running interpreter's standard-library source (no download). It prints the
resolved configuration first and a summary at the end. Bad input (a missing or
empty text file, an unknown config key, a value out of range, a run folder holding
another model's checkpoint, a damaged checkpoint) is one line on stderr,
``tiegrad: error: ...``, and exit code 2; Ctrl-C during training writes a
checkpoint and exits with code 130 after printing how to resume.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from .errors import ConfigError, TiegradError

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130

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
    "--weight-decay": "weight_decay",
    "--clip-norm": "clip_norm",
    "--eval-every": "eval_every",
    "--eval-batches": "eval_batches",
    "--checkpoint-every": "checkpoint_every",
    "--keep-last": "keep_last",
    "--patience": "patience",
    "--seed": "seed",
    "--device": "device",
    "--run": "run",
}


_METAVARS = {"text": "FILE", "init": "DIR", "run": "DIR", "vocab": "{char,byte}"}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        _fail(f"{message} (see '{self.prog} --help')")


def _fail(message: str) -> NoReturn:
    print(f"tiegrad: error: {message}", file=sys.stderr)
    raise SystemExit(EXIT_BAD_INPUT)


def build_parser() -> argparse.ArgumentParser:
    from .train.config import DEFAULTS, HELP

    parser = _Parser(
        prog="tiegrad",
        description="Train and sample tied-weight language models with tiegrad.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    train = sub.add_parser(
        "train",
        help="train a TiedLM (default: on the Python standard library's source)",
        description="Train a TiedLM. Precedence: defaults < --config FILE.toml < flags.",
    )
    train.add_argument("--config", metavar="FILE.toml", help="TOML file of config keys")
    for flag, key in FLAGS.items():
        kind = type(DEFAULTS[key])
        shown = DEFAULTS[key] if DEFAULTS[key] != "" else "-"
        train.add_argument(
            flag,
            dest=key,
            type=kind,
            default=None,
            metavar=_METAVARS.get(key, flag[2:].upper().replace("-", "_")),
            help=f"{HELP[key]} (default: {shown})",
        )
    _add_no_progress(train)

    sample = sub.add_parser("sample", help="generate text from a run's best checkpoint")
    sample.add_argument("--run", metavar="DIR", help="run folder (its best checkpoint)")
    sample.add_argument("--checkpoint", metavar="FILE", help="a checkpoint file instead")
    sample.add_argument("--prompt", default="", help="text to continue (default: none)")
    sample.add_argument("--tokens", type=int, default=200, help="tokens to generate (200)")
    sample.add_argument("--temperature", type=float, default=0.8, help="sampling temperature")
    sample.add_argument("--top-k", type=int, default=None, help="sample among the k most likely")
    sample.add_argument("--seed", type=int, default=0, help="sampling seed (0)")

    inspect = sub.add_parser("inspect", help="describe a checkpoint file")
    inspect.add_argument("file", metavar="FILE", help="a .safetensors checkpoint")

    resume = sub.add_parser("resume", help="continue a run from its latest checkpoint")
    resume.add_argument("run", metavar="DIR", help="run folder")
    resume.add_argument("--steps", type=int, default=None, help="new total step count")
    _add_no_progress(resume)
    _add_export(sub)
    return parser


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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0, 2 bad input, 130 interrupted)."""
    parser = build_parser()
    args = parser.parse_args(argv)
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
        return commands[args.command](args)
    except TiegradError as e:
        _fail(_one_line(e))
    except OSError as e:
        _fail(f"{e.strerror or e}: {e.filename}" if e.filename else str(e))
    except KeyboardInterrupt:
        print("tiegrad: aborted", file=sys.stderr)
        return EXIT_INTERRUPTED


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
    if not config["run"]:
        config["run"] = _fresh_run_folder()
    return _run_job(config, resume=False)


def _resume(args: argparse.Namespace) -> int:
    from .train.config import check_config
    from .train.rundir import RunDir

    run = RunDir(args.run)
    config = run.read_config()
    if run.latest() is None:
        raise ConfigError(f"run folder {args.run!r} has no checkpoint to resume from")
    config["run"] = args.run
    if args.steps is not None:
        config["steps"] = args.steps
    if args.progress is not None:
        config["progress"] = args.progress
    config.pop("text_sha256", None)
    vocab = config.pop("vocab_table", None)
    config = check_config(config)
    return _run_job(config, resume=True, vocab=vocab)


def _fresh_run_folder() -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = os.path.join("runs", stamp)
    path, n = base, 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}"
    return path


def _run_job(config: dict[str, Any], resume: bool, vocab: Any = None) -> int:
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
    if config["init"]:
        model, dataset = build_init(config, source, vocab)
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
    )
    _print_config(config, source.description, dataset, model)
    if resume and run.read_config().get("text_sha256") not in (None, source.sha256):
        print("warning: the training text differs from the one this run started with")
    text = os.path.abspath(config["text"]) if config["text"] else ""
    init = os.path.abspath(config["init"]) if config["init"] else ""
    run.write_config(
        dict(
            config,
            text=text,
            init=init,
            vocab_table=dataset.vocab.to_dict(),
            text_sha256=source.sha256,
        )
    )
    result = trainer.fit()
    _print_summary(result, run, unit)
    return EXIT_INTERRUPTED if result.status == "interrupted" else 0


def _check_fresh_run_folder(run: Any, kwargs: dict[str, Any]) -> None:
    """A new run never reuses a folder that holds checkpoints (of this model or another)."""
    latest = run.latest() or (run.best_path if run.best_path.is_file() else None)
    if latest is None:
        return
    stored = _checkpoint_model(latest)
    if stored != kwargs:
        raise ConfigError(
            f"run folder {str(run.path)!r} holds a checkpoint of another model "
            f"({_model_text(stored)}; this run builds {_model_text(kwargs)}): "
            "choose another --run"
        )
    raise ConfigError(
        f"run folder {str(run.path)!r} already holds this run's checkpoints: continue it "
        f"with 'tiegrad resume {run.path}' or choose another --run"
    )


def _checkpoint_extra(path: Path) -> Any:
    from .checkpoint import Schema
    from .checkpoint.fileio import read_safetensors

    return Schema.parse(read_safetensors(os.fspath(path))).extra


def _checkpoint_model(path: Path) -> Any:
    return _model_config(_checkpoint_extra(path))


def _model_config(extra: Any) -> Any:
    """The model constructor arguments stored in a checkpoint's ``extra`` (or ``None``)."""
    model = extra.get("model") if isinstance(extra, dict) else None
    if not isinstance(model, dict) or not isinstance(model.get("config"), dict):
        return None
    return model["config"]


def _model_text(kwargs: Any) -> str:
    if not isinstance(kwargs, dict):
        return "not a tiegrad language model"
    keys = ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len")
    return "TiedLM " + " ".join(f"{k}={kwargs.get(k)}" for k in keys)


def _quote(path: str) -> str:
    return path if all(c.isalnum() or c in "/._-" for c in path) else repr(path)


def _print_config(config: dict[str, Any], text: str, dataset: Any, model: Any) -> None:
    from .train.config import DEFAULTS

    unique = model.num_parameters()
    c = config
    print("tiegrad train: resolved configuration")
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
        f"warmup={min(c['warmup_steps'], c['steps'])} "
        f"weight_decay={c['weight_decay']:g} clip_norm={c['clip_norm']:g}"
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


def _print_summary(result: Any, run: Any, unit: str) -> None:
    minutes, seconds = divmod(result.elapsed, 60)
    verb = {"completed": "done", "early_stopped": "stopped early", "interrupted": "interrupted"}
    print(f"{verb[result.status]}: {result.step} steps in {int(minutes)}m{seconds:04.1f}s")
    if result.val_loss is not None:
        best = "" if result.best_val_loss is None else f" (best {result.best_val_loss:.4f})"
        print(f"final validation loss: {result.val_loss:.4f} nats/{unit}{best}")
    print(f"checkpoint: {result.checkpoint}")
    if result.best_checkpoint is not None:
        print(f"best:       {result.best_checkpoint}")
    print(f"metrics:    {result.metrics}, {result.metrics_csv}")
    if result.plot is not None:
        print(f"plot:       {result.plot}")
    if result.status != "interrupted":
        print(f"sample:     tiegrad sample --run {_quote(str(run.path))}")


# -- sample / inspect ----------------------------------------------------------------------
def _sample(args: argparse.Namespace) -> int:
    import numpy as np

    from .checkpoint import load
    from .data import tokenizer_from_dict
    from .train.job import build_model
    from .train.rundir import RunDir

    if args.tokens < 1:
        raise ConfigError(f"--tokens must be >= 1, got {args.tokens}")
    if not args.temperature > 0:
        raise ConfigError(f"--temperature must be > 0, got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        raise ConfigError(f"--top-k must be >= 1, got {args.top_k}")
    if (args.run is None) == (args.checkpoint is None):
        raise ConfigError("sample: give exactly one of --run DIR and --checkpoint FILE")
    if args.checkpoint is not None:
        path = Path(args.checkpoint)
        if not path.is_file():
            raise ConfigError(f"checkpoint {args.checkpoint!r} does not exist")
    else:
        run = RunDir(args.run)
        found = run.best_or_latest()
        if found is None:
            raise ConfigError(f"run folder {args.run!r} holds no checkpoint")
        path = found
    extra = _checkpoint_extra(path)
    kwargs = _model_config(extra)
    if kwargs is None or not isinstance(extra.get("vocab"), dict):
        raise ConfigError(f"{path}: not a checkpoint of 'tiegrad train' (no model or vocab)")
    vocab = tokenizer_from_dict(extra["vocab"])
    model = build_model(dict(kwargs), extra["model"].get("class", "TiedLM"))
    load(path, model)
    model.eval()
    prompt = args.prompt or "\n"
    ids = vocab.encode(prompt)[None, :]
    rng = np.random.default_rng(args.seed)
    out = model.generate(ids, args.tokens, temperature=args.temperature, rng=rng, top_k=args.top_k)
    text = vocab.decode(np.asarray(out)[0])
    print(text if args.prompt else text[1:])
    return 0


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
    from .train.job import build_model
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
    extra = _checkpoint_extra(path)
    kwargs = _model_config(extra)
    if kwargs is None or extra["model"].get("class") != "GPT2":
        raise ConfigError(
            f"{path}: export --format hf needs a GPT2 checkpoint (from 'tiegrad train --init')"
        )
    model = build_model(dict(kwargs), "GPT2")
    load(path, model)
    model.source_config = extra.get("hf_config") or {}
    tokenizer = tokenizer_from_dict(extra["vocab"]) if "vocab" in extra else None
    model.save_pretrained(args.dir)
    if isinstance(tokenizer, HFTokenizer):
        tokenizer.save(args.dir)
    print(f"exported {path} to {args.dir} (GPT2LMHeadModel.from_pretrained loads it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
