"""``tiegrad train``: train a new run.

With no arguments it is the main job: a character ``TiedLM`` trained on the running
interpreter's standard-library source (no download). The configuration is resolved
with the precedence defaults < ``--config FILE.toml`` < flags (``tiegrad.train.config``),
every flag naming the configuration key it overrides (``FLAGS``). Without ``--run`` the
run gets a fresh ``runs/<date-time>``.
"""

from __future__ import annotations

import argparse
from typing import Any

from .job import join_group, run_job
from .options import add_no_progress, add_nproc
from .runs import fresh_run_folder

#: flag -> config key, for the flags that override a configuration key.
FLAGS: dict[str, str] = {
    "--text": "text",
    "--vocab": "vocab",
    "--corpus-chars": "corpus_chars",
    "--val-fraction": "val_fraction",
    "--init": "init",
    "--lora": "lora",
    "--freeze": "freeze",
    "--add-tokens": "add_tokens",
    "--train-rows": "train_rows",
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
    "--shard": "shard",
    "--run": "run",
}

_METAVARS = {
    "text": "FILE",
    "init": "DIR",
    "lora": "SPEC",
    "freeze": "PATHS",
    "add_tokens": "FILE",
    "train_rows": "{all,new}",
    "run": "DIR",
    "vocab": "{char,byte}",
    "log": "{tensorboard}",
    "shard": "{optimizer,gradients}",
}


def add_parser(sub: Any) -> None:
    """The ``train`` subcommand: ``--config`` and one flag per configuration key."""
    from ..train.config import DEFAULTS, HELP

    train = sub.add_parser(
        "train",
        help="train a TiedLM (default: on the Python standard library's source), or "
        "fine-tune a transformers directory (--init)",
        description="Train a TiedLM, or fine-tune the GPT-2 or Llama-family model of a "
        "transformers directory (--init DIR). Precedence: defaults < --config FILE.toml < "
        "flags.",
    )
    train.set_defaults(handler=run)
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
    add_no_progress(train)
    add_nproc(train)
    train.add_argument(
        "--run-dir",
        dest="run",
        default=None,
        metavar="DIR",
        help="the same as --run (torchrun's own parser takes '--run' for '--run-path')",
    )


def run(args: argparse.Namespace) -> int:
    """Resolve the configuration, choose the run folder and make the run's id (the same
    on every rank), train."""
    from ..distributed.group import agree
    from ..train.config import DEFAULTS, resolve
    from ..train.rundir import new_run_id

    overrides = {k: getattr(args, k) for k in DEFAULTS if getattr(args, k, None) is not None}
    labels = {key: flag for flag, key in FLAGS.items()}
    config = resolve(args.config, overrides, labels)
    join_group(config)
    if not config["run"]:
        config["run"] = agree(fresh_run_folder())
    return run_job(config, resume=False, run_id=agree(new_run_id()))
