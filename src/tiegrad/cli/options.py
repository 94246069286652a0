"""The argparse pieces the subcommands share: the parser class and common options."""

from __future__ import annotations

import argparse
from typing import NoReturn

from .exits import fail


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        fail(f"{message} (see '{self.prog} --help')")


def add_nproc(parser: argparse.ArgumentParser) -> None:
    """``--nproc N``: the command relaunches itself on N processes (data parallel)."""
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        metavar="N",
        help="train on N local processes (data parallel, started through torchrun)",
    )


def add_no_progress(parser: argparse.ArgumentParser) -> None:
    """``--no-progress``: ``progress`` is ``False``, else ``None`` (the configuration's)."""
    parser.add_argument(
        "--no-progress",
        dest="progress",
        action="store_const",
        const=False,
        default=None,
        help="hide the progress bar",
    )


def add_recompute(parser: argparse.ArgumentParser) -> None:
    """``--recompute`` / ``--no-recompute``: ``recompute`` is ``True`` or ``False``, else
    ``None`` (the configuration's, or the resumed run's)."""
    from ..train.config import FIELDS

    parser.add_argument(
        "--recompute",
        dest="recompute",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"{FIELDS['recompute'].metadata['help']} (default: off; resume: the run's)",
    )
