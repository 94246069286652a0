"""``tiegrad inspect``: describe a checkpoint (its slots, ties, frozen uses and extra data).

The source is a checkpoint file or a run folder (its best checkpoint, else its latest),
as ``sample`` and ``export`` take it. A tie is a line of its paths, e.g. ``tie:
model.embed_tokens.weight = lm_head.weight`` for a tied Llama-family model.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..errors import ConfigError


def add_parser(sub: Any) -> None:
    """The ``inspect`` subcommand: one checkpoint file or run folder."""
    inspect = sub.add_parser("inspect", help="describe a checkpoint file (or a run's best)")
    inspect.set_defaults(handler=run)
    inspect.add_argument(
        "file", metavar="FILE", help="a .safetensors checkpoint, or a run folder (its best)"
    )


def run(args: argparse.Namespace) -> int:
    """Print ``tiegrad.checkpoint.inspect``'s description of the file."""
    from ..checkpoint import inspect
    from ..train.rundir import RunDir

    path = args.file
    if os.path.isdir(path):
        found = RunDir(path).best_or_latest()
        if found is None:
            raise ConfigError(f"run folder {path!r} holds no checkpoint")
        path = os.fspath(found)
    elif not os.path.isfile(path):
        raise ConfigError(f"checkpoint {path!r} does not exist or is not a file")
    print(inspect(path))
    return 0
