"""``tiegrad inspect``: describe a checkpoint file (its slots, ties and extra data)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..errors import ConfigError


def add_parser(sub: Any) -> None:
    """The ``inspect`` subcommand: one checkpoint file."""
    inspect = sub.add_parser("inspect", help="describe a checkpoint file")
    inspect.set_defaults(handler=run)
    inspect.add_argument("file", metavar="FILE", help="a .safetensors checkpoint")


def run(args: argparse.Namespace) -> int:
    """Print ``tiegrad.checkpoint.inspect``'s description of the file."""
    from ..checkpoint import inspect

    if not os.path.isfile(args.file):
        raise ConfigError(f"checkpoint {args.file!r} does not exist or is not a file")
    print(inspect(args.file))
    return 0
