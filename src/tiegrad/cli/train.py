"""``tiegrad train``: train a new run.

With no arguments it is the main job: a character ``TiedLM`` trained on the running
interpreter's standard-library source (no download). The configuration is resolved
with the precedence defaults < ``--config FILE.toml`` < flags (``tiegrad.train.config``);
the flags are made from ``TrainConfig``'s fields, one per setting. Without ``--run`` the
run gets a fresh ``runs/<date-time>``.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..train.config import DEFAULTS, FIELDS, TrainConfig, flag, resolve
from .job import join_group, run_job
from .options import add_nproc
from .runs import fresh_run_folder

#: flag -> config key, for the flags that set a value (``--no-progress`` is a switch).
FLAGS: dict[str, str] = {flag(key): key for key in FIELDS if not isinstance(DEFAULTS[key], bool)}


def add_parser(sub: Any) -> None:
    """The ``train`` subcommand: ``--config`` and one flag per ``TrainConfig`` field,
    made from the field's metadata (``config.setting``): its flag, type, metavar and
    help, with the default shown."""
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
    for key, field in FIELDS.items():
        default, meta = DEFAULTS[key], field.metadata
        if isinstance(default, bool):  # a switch that sets the opposite of the default
            train.add_argument(
                flag(key), dest=key, action="store_const", const=not default, default=None,
                help=meta["help"],
            )  # fmt: skip
            continue
        # an empty default is described by the help text itself ("empty: ...")
        shown = "" if default == "" else f" (default: {default})"
        train.add_argument(
            flag(key),
            dest=key,
            type=type(default),
            default=None,
            metavar=meta["metavar"] or flag(key)[2:].upper().replace("-", "_"),
            help=f"{meta['help']}{shown}",
        )
    add_nproc(train)
    train.add_argument(
        "--run-dir",
        dest="run",
        default=None,
        metavar="DIR",
        help="the same as --run (torchrun's own parser takes '--run' for '--run-path')",
    )


def configuration(args: argparse.Namespace) -> TrainConfig:
    """The ``TrainConfig`` of a ``train`` command line: the defaults, its ``--config``
    file, then its flags, a bad value named by its flag (``config.resolve``)."""
    overrides = {k: getattr(args, k) for k in FIELDS if getattr(args, k, None) is not None}
    return resolve(args.config, overrides, {key: flag(key) for key in overrides})


def run(args: argparse.Namespace) -> int:
    """Resolve the configuration, choose the run folder and make the run's id (the same
    on every rank), train."""
    from ..distributed.group import agree
    from ..train.rundir import new_run_id

    config = configuration(args)
    join_group(config)
    if not config.run:
        config = config.replace(run=agree(fresh_run_folder()))
    return run_job(config, resume=False, run_id=agree(new_run_id()))
